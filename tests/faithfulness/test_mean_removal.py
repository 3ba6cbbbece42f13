"""``removal="mean"``: removed terms replaced by the head's mean value from the *other* documents.

At ratio 1 comprehensiveness removes every candidate term (all keys but the first, in every head), so
each sequence's NLL must equal a forward of that sequence alone with those terms removed and, as
stand-in, the mean value vectors (``cwcore.core.mean_values``) of the other documents' sequences.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

import cwcore
from cwcore import faithfulness as fa
from cwcore.core import mean_values
from cwcore.faithfulness.layers import per_layer_curve
from cwcore.faithfulness.protocol import Protocol
from tiny_models import VOCAB, tiny_model

KW = dict(progress=False, n_bootstrap=20)


def _texts():
    ids = torch.randint(1, VOCAB, (3, 7), generator=torch.Generator().manual_seed(11))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # the second sequence has five tokens
    return {"input_ids": ids, "attention_mask": mask, "document": [0, 0, 1]}, ids, mask


def _naive_nll(model, ids, others):
    """Mean next-token NLL of ``ids`` [n] with every term but the first key's removed in every layer,
    stand-ins = the mean values of the sequences ``others`` (list of [n_k] tensors)."""
    n = ids.shape[0]
    sums, count = None, 0
    for other in others:  # the pooled mean over the other documents' tokens (first of each left out)
        means = mean_values(model, other[None])
        weight = other.shape[0] - 1
        sums = {l: m * weight for l, m in means.items()} if sums is None else {
            l: sums[l] + m * weight for l, m in means.items()}
        count += weight
    stand_in = {layer: summed / count for layer, summed in sums.items()}
    removed = torch.ones(n, n, dtype=torch.bool).tril()
    removed[:, 0] = False
    masks = {layer: removed[None, None] for layer in stand_in}
    with torch.no_grad(), cwcore.intervene(model, masks, stand_in=stand_in):
        logits = model(input_ids=ids[None]).logits[0]
    return float(torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:]))


def test_mean_removal_equals_a_forward_with_the_other_documents_mean_values():
    model = tiny_model("llama")
    texts, ids, mask = _texts()
    result = fa.faithfulness_curve(model, None, texts, "random", [1.0], "comprehensiveness", removal="mean",
                                   batch_size=2, **KW)
    rows = result.per_sequence.set_index("sequence")
    assert set(rows["variant"]) == {"removal=mean"}
    sequences = [ids[0], ids[1, :5], ids[2]]
    assert rows.loc[0, "n_removed"] == 2 * 4 * sum(range(7))  # every (layer, head, query, key) but the first key
    for s, document_others in ((0, [2]), (1, [2]), (2, [0, 1])):
        expected = _naive_nll(model, sequences[s], [sequences[o] for o in document_others])
        assert rows.loc[s, "nll"] == pytest.approx(expected, rel=1e-5)
    zeroed = fa.faithfulness_curve(model, None, texts, "random", [1.0], "comprehensiveness", batch_size=2,
                                   **KW).per_sequence.set_index("sequence")
    assert (rows["nll"] - zeroed["nll"]).abs().max() > 1e-3  # the stand-ins changed the outcome


def test_live_scores_use_the_same_stand_ins():
    model = tiny_model("llama")
    texts, _, _ = _texts()
    kw = dict(metric="contribution", ratios=[0.3, 1.0], mode="comprehensiveness", removal="mean", batch_size=2, **KW)
    clean = fa.faithfulness_curve(model, None, texts, **kw).per_sequence
    live = fa.faithfulness_curve(model, None, texts, scores="live", **kw).per_sequence
    at_one = lambda t: t[t["ratio"] == 1.0].set_index("sequence")["nll"]  # noqa: E731 - all removed: same terms
    torch.testing.assert_close(torch.tensor(at_one(live).values), torch.tensor(at_one(clean).values))


def test_zero_is_the_default_and_its_settings_are_unchanged():
    assert Protocol().removal == "zero" and Protocol().variant == "main"
    old_fields = {"unit", "scope", "layers", "keep_first_token", "scores", "kind", "importance", "seed"}
    assert set(Protocol().settings()) == old_fields  # cached pieces and exports of zeroing runs stay valid
    assert Protocol(removal="mean").settings() == asdict(Protocol(removal="mean"))
    with pytest.raises(ValueError, match="removal must be one of"):
        Protocol(removal="resample")


def test_mean_removal_refusals():
    model = tiny_model("llama")
    texts, _, _ = _texts()
    one_document = {**texts, "document": [4, 4, 4]}
    with pytest.raises(ValueError, match="at least two documents"):
        fa.faithfulness_curve(model, None, one_document, "random", [0.5], removal="mean", **KW)
    with pytest.raises(ValueError, match="per_layer_curve removes terms by zeroing only"):
        per_layer_curve(model, None, texts, "random", [0.5], removal="mean", progress=False)
