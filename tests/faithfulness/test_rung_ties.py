"""Rungs 2 and 3 under kind="inter": the same ranking by algebra (rung 3 divides rung 2 by ||o_i||, one
number per query row), so the sweep must remove the same terms for both, even where float rounding of
the division turns an order of rung 2 into a tie of rung 3; and "not measured" is read from the
protocol, never from the numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cwcore import faithfulness as fa
from cwbook import findings
from cwcore.faithfulness.protocol import Protocol, identical_steps, ranking_identity, same_ranking
from cwcore.faithfulness.ranking import candidate_mask, selection
from faith_helpers import peaked_llama, self_sampled

RATIOS = [0.1, 0.2, 0.3, 0.5, 0.7]
STEP = ("value_weighted", "value_weighted_output_normalized")


def tied_llama(delta: float = 2.0 ** -23):
    """Four heads with one attention pattern and one value/output map, except that the second key-value
    head's values are scaled by (1 + delta): rung 2's (head, key) scores of heads 0-1 and 2-3 differ by
    about one float32 ulp, which dividing by ||o_i|| sometimes rounds into a tie (deliberate near-ties)."""
    model = peaked_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            attn, d = layer.self_attn, layer.self_attn.head_dim
            attn.q_proj.weight.view(4, d, -1)[1:] = attn.q_proj.weight.view(4, d, -1)[0].clone()
            k, v = attn.k_proj.weight.view(2, d, -1), attn.v_proj.weight.view(2, d, -1)
            k[1] = k[0].clone()
            v[1] = v[0] * (1 + delta)
            o = attn.o_proj.weight.view(attn.o_proj.weight.shape[0], 4, d)
            o[:, 1:] = o[:, :1].clone()
    return model


@pytest.fixture(scope="module")
def tied():
    model = tied_llama()
    return model, self_sampled(model, n=6, length=16)


def test_the_tiny_model_has_ties_that_the_division_reorders(tied):
    """The control: ranking rung 3's own float32 scores removes other terms than rung 2's (so the next
    test could fail)."""
    model, ids = tied
    s2 = fa.method_scores(model, "value_weighted", ids)
    s3 = fa.method_scores(model, "value_weighted_output_normalized", ids)
    cand = candidate_mask(torch.ones_like(ids))
    changed = sum(int((selection(s2[l], cand, RATIOS).buckets[m] != selection(s3[l], cand, RATIOS).buckets[m]).sum())
                  for l in s2 for m in fa.MODES)
    assert changed > 0
    # and they are the algebra's: rung 3 = rung 2 / ||o_i|| per query row, within float32 rounding
    norm = (s2[0] / s3[0]).nan_to_num(0.0)  # [b, h, q, k]: one positive number per (row, query)
    real = s2[0] > 0
    per_row = torch.where(real, norm, torch.nan).nanmean((1, 3), keepdim=True)
    assert torch.allclose(norm[real], per_row.expand_as(norm)[real], rtol=1e-5)


@pytest.mark.parametrize("importance", ["signed", "absolute"])
def test_rungs_2_and_3_rows_are_bit_identical_under_the_default_protocol(tied, importance):
    model, ids = tied
    table = fa.faithfulness_curve(model, None, ids, list(STEP), RATIOS, progress=False,
                                  deduplicate=False, importance=importance).per_sequence
    a = table[table["metric"] == STEP[0]].reset_index(drop=True)
    b = table[table["metric"] == STEP[1]].reset_index(drop=True)
    assert len(a) == len(b) == len(ids) * 2 * len(RATIOS)
    for column in ("nll", "n_removed", "n_candidates", "sequence", "mode", "ratio"):
        assert np.array_equal(a[column].to_numpy(), b[column].to_numpy()), column
    ladder = fa.ladder_comparison(table, n_bootstrap=50)
    row = ladder[(ladder["lower"] == STEP[0]) & (ladder["higher"] == STEP[1])]
    assert len(row) == 2 and row["identical"].all() and set(row["verdict"]) == {"not measured"}
    assert (row["difference"] == 0).all()


def test_per_head_keeps_rungs_2_and_3_apart(tied):
    """kind="intra": ||o^h_i|| differs between the heads of a row, so the joint (head, key) rankings differ."""
    model, ids = tied
    table = fa.faithfulness_curve(model, None, ids, list(STEP), [0.3], "comprehensiveness", kind="intra",
                                  progress=False, deduplicate=False).per_sequence
    ladder = fa.ladder_comparison(table, n_bootstrap=50)
    assert not ladder.loc[(ladder["lower"] == STEP[0]) & (ladder["higher"] == STEP[1]), "identical"].any()


def test_identical_steps_is_a_property_of_the_protocol():
    assert identical_steps(Protocol()) == {STEP}
    assert identical_steps(Protocol(unit="token")) == {STEP}
    assert identical_steps(Protocol(importance="absolute", scores="live")) == {STEP}
    assert identical_steps(Protocol(kind="intra")) == set()
    assert identical_steps(Protocol(kind="intra", unit="key")) == {STEP}  # one head's row: ||o^h_i|| is one number
    assert identical_steps(Protocol(scope="layer")) == set()  # averaged over queries with different ||o_i||
    assert ranking_identity("contribution", "intra") == ("contribution", "intra")
    assert ranking_identity("value_weighted_output_normalized", "inter") == ("value_weighted", "")
    # intra and inter output-normalised attention rank alike within one head's row
    assert same_ranking(STEP[1], STEP[1], Protocol(unit="key"), "inter", "intra")
    assert not same_ranking("contribution", "contribution", Protocol(), "inter", "intra")


def test_findings_reads_identity_from_the_protocol_not_the_numbers():
    # a 2.7e-6 float tie difference under default is still "not measured"; an exact 0 under per-head is not
    base = {"lower": STEP[0], "higher": STEP[1], "unit": "head_key", "scope": "row", "mode": "comprehensiveness"}
    tie = {**base, "protocol": "default", "difference": 2.7e-6, "ci_low": 0.0, "ci_high": 5e-6, "verdict": "inconclusive"}
    zero = {**base, "protocol": "per-head", "difference": 0.0, "ci_low": 0.0, "ci_high": 0.0, "verdict": "inconclusive"}
    assert findings._identical(tie) and not findings._identical(zero)
    assert findings._identical({**zero, "identical": True}) and not findings._identical({**tie, "identical": False})
