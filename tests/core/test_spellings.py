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


IDS = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


@pytest.fixture(scope="module")
def d(model):
    return cwcore.decompose(model, input_ids=IDS)


def _naive_layer(model, layer):
    """alpha from the model's eager run, v_j from a hook on v_proj (its bias included) and W_O^h sliced by hand
    from o_proj's columns, in float64: v~_j = W_O^h v_j, o^h_i = sum_j alpha_ij v~_j and o_i = sum_h o^h_i."""
    captured = {}
    v_proj = model.model.layers[layer].self_attn.v_proj
    handle = v_proj.register_forward_hook(lambda module, args, out: captured.__setitem__("v", out.detach()))
    try:
        with torch.no_grad():
            eager = model(input_ids=IDS, output_attentions=True)
    finally:
        handle.remove()
    cfg = model.config
    heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    batch, tokens = IDS.shape
    v = captured["v"].double().reshape(batch, tokens, cfg.num_key_value_heads, head_dim).transpose(1, 2)
    v = v.repeat_interleave(heads // cfg.num_key_value_heads, dim=1)  # [b, h, k, d]
    weight = model.model.layers[layer].self_attn.o_proj.weight.detach().double()
    w_o = torch.stack([weight[:, h * head_dim:(h + 1) * head_dim] for h in range(heads)])  # [h, model, d]
    alpha = eager.attentions[layer].double()
    projected = torch.einsum("bhkd,hmd->bhkm", v, w_o)
    head_out = torch.einsum("bhqk,bhkm->bhqm", alpha, projected)
    return alpha, projected, head_out


def test_the_one_spellings_do_not_warn_and_match_a_naive_computation(d, model):
    """The one spellings against a reference computed here from the model itself (_naive_layer). The old
    reference was built from the decomposition's own value_norm and output norms, and the factorisation check
    c = alpha * relative_norm * cosine is blind to a rescaled value norm (it cancels between the two factors), so
    a value_norm reported twice too large passed."""
    alpha, projected, head_out = _naive_layer(model, 1)
    tol = dict(rtol=1e-4, atol=1e-5)  # float32 model and geometry against float64 sums of float32 inputs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ld = d[1]
        vnorm = projected.norm(dim=-1)[:, :, None, :]  # ||v~_j||, [b, h, 1, k]
        torch.testing.assert_close(ld.value_norm.double(), vnorm[:, :, 0], **tol)
        for kind in ("inter", "intra"):
            o = head_out.sum(1)[:, None] if kind == "inter" else head_out  # [b, 1 or h, q, model]
            norm = o.norm(dim=-1)[..., None]  # ||o_i|| or ||o^h_i||, [b, 1 or h, q, 1]
            dot = torch.einsum("bhqm,bhkm->bhqk", o.expand_as(head_out), projected)  # <o_i, v~_j>
            naive = {"value_weighted_output_normalized": alpha * vnorm / norm,
                     "relative_norm": (vnorm / norm).expand_as(alpha),
                     "cosine": dot / (norm * vnorm),
                     "contribution": alpha * dot / norm**2}
            for name, want in naive.items():
                torch.testing.assert_close(getattr(ld, name)(kind).double(), want, **tol, msg=f"{kind} {name}")
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
