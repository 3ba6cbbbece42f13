"""One spelling per quantity: d[l].contribution(kind), relative_norm(kind), cosine(kind) and
value_weighted_output_normalized(kind) are the names; the old aliases (d.inter[l], d[l].inter,
inter_cosine, ...) return the same tensors and warn DeprecationWarning once each."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import cwcore
from cwcore.core import decomposition
from tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def d():
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    return cwcore.decompose(tiny_model("qwen2"), input_ids=ids)


def test_the_one_spellings_do_not_warn_and_match_a_naive_computation(d):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ld = d[1]
        for kind in ("inter", "intra"):
            norm = ld.output_norm[:, None, :, None] if kind == "inter" else ld.head_output_norm[..., None]
            naive_vw = ld.attention * ld.value_norm[:, :, None, :] / norm
            torch.testing.assert_close(ld.value_weighted_output_normalized(kind), naive_vw)
            torch.testing.assert_close(ld.relative_norm(kind), (ld.value_norm[:, :, None, :] / norm).expand_as(naive_vw))
            c = ld.contribution(kind)
            # c = alpha * relative norm * cosine, the paper's factorisation, and its sums
            torch.testing.assert_close(c, ld.attention * ld.relative_norm(kind) * ld.cosine(kind), rtol=1e-4, atol=1e-6)
            sums = c.sum((1, 3)) if kind == "inter" else c.sum(-1)
            torch.testing.assert_close(sums, torch.ones_like(sums), rtol=1e-4, atol=1e-5)
        d.attention[1], d.value_norm[0]  # field views of undeprecated names stay quiet


def test_each_old_spelling_is_the_same_tensor_and_warns_once(d, monkeypatch):
    monkeypatch.setattr(decomposition, "_WARNED", set())
    ld = d[0]
    old = {"inter": ld.contribution("inter"), "intra": ld.contribution("intra"),
           "inter_relative_norm": ld.relative_norm("inter"), "intra_relative_norm": ld.relative_norm("intra"),
           "inter_cosine": ld.cosine("inter"), "intra_cosine": ld.cosine("intra"),
           "inter_value_weighted_normalized": ld.value_weighted_output_normalized("inter"),
           "intra_value_weighted_normalized": ld.value_weighted_output_normalized("intra")}
    assert set(old) == set(decomposition.DEPRECATED_VIEWS)
    for name, expected in old.items():
        message = f"d[layer].{name} is deprecated: use d[layer].{decomposition.DEPRECATED_VIEWS[name]}"
        with pytest.warns(DeprecationWarning, match=re.escape(message)):
            torch.testing.assert_close(getattr(ld, name), expected, equal_nan=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the second read is quiet
            torch.testing.assert_close(getattr(ld, name), expected, equal_nan=True)
            torch.testing.assert_close(getattr(d, name)[0], expected, equal_nan=True)  # d.inter[0]: same key, warned


def test_the_layer_indexed_alias_warns_when_read_first(d, monkeypatch):
    monkeypatch.setattr(decomposition, "_WARNED", set())
    with pytest.warns(DeprecationWarning, match=r'd\.inter is deprecated: use d\[layer\]\.contribution\("inter"\)'):
        view = d.inter
    torch.testing.assert_close(view[1], d[1].contribution("inter"))


def test_a_kind_that_is_neither_is_refused_for_every_rung(d):
    """``kind`` does not change attention and value_weighted, but a typo passed there without a word
    (``metric("attention", "intre")``, ``token_level("attention", "bogus")``) while the other rungs refused it."""
    ld = d[0]
    for name in decomposition.METRICS:
        with pytest.raises(ValueError, match="kind must be 'intra' or 'inter', not 'intre'"):
            ld.metric(name, "intre")
        with pytest.raises(ValueError, match="kind must be 'intra' or 'inter'"):
            ld.token_level(name, "bogus")
    torch.testing.assert_close(ld.metric("attention", "intra"), ld.attention)  # the control: both kinds read
    torch.testing.assert_close(ld.token_level("attention", "inter"), ld.attention.mean(1))
