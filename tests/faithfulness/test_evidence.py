"""The evidence design: documents as units (cluster bootstrap), ratio ranges, power, both importance signs
and the per-head protocol, against independent computations on the peaked tiny Llama."""

from __future__ import annotations

import datasets
import numpy as np
import pandas as pd
import pytest

from cwcore import faithfulness as fa
from cwcore import stats
from cwbook import ladder as ev


def _curves(sweep, unit="document"):
    """{(metric, mode): per-unit AOPC} computed naively: mean over a unit's rows, then the trapezoid."""
    frame = sweep.assign(delta_nll=sweep["nll"] - sweep["clean_nll"])
    out = {}
    for (metric, mode), g in frame.groupby(["metric", "mode"]):
        wide = g.groupby([unit, "ratio"])["delta_nll"].mean().unstack("ratio").sort_index()
        r = wide.columns.to_numpy(float)
        m = wide.to_numpy()
        if r[0] > 0:
            r, m = np.r_[0.0, r], np.c_[np.zeros(len(m)), m]
        out[(metric, mode)] = np.array([np.trapezoid(row, r) / r[-1] for row in m])
    return out


def test_document_column_is_carried_and_blocks_of_one_document_are_one_unit(peaked, sweep):
    model, ids = peaked
    assert (sweep["document"] == sweep["sequence"]).all()  # tensors: each sequence its own document
    documents = [0, 0, 1, 1, 2, 3, 3, 4, 5, 5]  # ten blocks from six documents
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * ids.shape[1]] * len(ids),
                                         "document": documents})
    per = fa.faithfulness_curve(model, None, blocks, ratios=[0.2, 0.5], batch_size=6, progress=False).per_sequence
    assert per.groupby("sequence")["document"].first().tolist() == documents
    # the numbers do not depend on where the blocks came from
    same = sweep[sweep["ratio"] > 0].reset_index(drop=True)
    pd.testing.assert_series_equal(per["nll"], same["nll"])
    # summaries average each document's blocks and resample the six documents
    area = fa.aopc(per, n_bootstrap=300, seed=1).set_index(["metric", "mode"])
    naive = _curves(per)
    for key, values in naive.items():
        ci = stats.bootstrap_ci(values, np.mean, n_resamples=300, seed=1)
        assert area.loc[key, "aopc_nll"] == pytest.approx(values.mean(), rel=1e-12)
        assert (area.loc[key, "aopc_nll_ci_low"], area.loc[key, "aopc_nll_ci_high"]) == pytest.approx((ci.low, ci.high))
        assert area.loc[key, "n_documents"] == 6 and area.loc[key, "n_sequences"] == 10
    summary = fa.summarize(per, n_bootstrap=300, seed=1)
    row = summary[(summary.metric == "contribution") & (summary["mode"] == "comprehensiveness")
                  & (summary.ratio == 0.5)].iloc[0]
    g = per[(per.metric == "contribution") & (per["mode"] == "comprehensiveness") & (per.ratio == 0.5)]
    doc_means = (g["nll"] - g["clean_nll"]).groupby(g["document"]).mean().to_numpy()
    ci = stats.bootstrap_ci(doc_means, np.mean, n_resamples=300, seed=1)
    assert (row.delta_nll, row.nll_ci_low, row.nll_ci_high) == pytest.approx((ci.estimate, ci.low, ci.high))
    assert row.n_documents == 6
    # the ladder pairs document-level curves and states its power
    lad = fa.ladder_comparison(per, n_bootstrap=300, seed=1)
    pair = lad[(lad.lower == "random") & (lad.higher == "contribution") & (lad["mode"] == "comprehensiveness")].iloc[0]
    diff = naive[("contribution", "comprehensiveness")] - naive[("random", "comprehensiveness")]
    paired = stats.paired_bootstrap_ci(naive[("contribution", "comprehensiveness")],
                                       naive[("random", "comprehensiveness")], np.mean, n_resamples=300, seed=1)
    assert (pair.difference, pair.ci_low, pair.ci_high) == pytest.approx((paired.estimate, paired.low, paired.high))
    assert pair.n == 6 and pair.sample_unit == "document"
    assert pair.sd == pytest.approx(np.std(diff, ddof=1))
    assert pair.mde == pytest.approx(stats.min_detectable_effect(np.std(diff, ddof=1), 6))


def test_low_range_is_the_aopc_of_the_low_ratios_only(sweep):
    low = fa.aopc(sweep, n_bootstrap=100, max_ratio=0.2).set_index(["metric", "mode"])
    cut = fa.aopc(sweep[sweep.ratio <= 0.2], n_bootstrap=100).set_index(["metric", "mode"])
    np.testing.assert_array_equal(low.aopc_nll, cut.aopc_nll.loc[low.index])
    assert (low.r_max == 0.2).all() and (fa.aopc(sweep, n_bootstrap=100).r_max == 0.5).all()
    lad = fa.ladder_comparison(sweep, n_bootstrap=100, max_ratio=0.2)
    assert (lad.r_max == 0.2).all()
    with pytest.raises(ValueError, match="no ratio"):
        fa.aopc(sweep[sweep.ratio > 0.1], max_ratio=0.1)
    assert ev.ranges([0.001, 0.05, 0.5]) == {"low": 0.05, "full": None}
    assert ev.ranges([0.01, 0.05]) == {"low": 0.05} and ev.ranges([0.3]) == {"full": None}
    assert ev.ratio_grid([0.001, 0.05], [0.05, 0.9]) == [0.001, 0.05, 0.9]


def test_both_signs_reuse_only_the_sign_invariant_rankings(peaked):
    model, ids = peaked
    kw = dict(batch_size=5, progress=False)
    both = ev.ladder_sweep(model, None, ids, fa.DEFAULT_METRICS, [0.1, 0.4], cache=False, **kw)
    assert set(both["importance"]) == {"signed", "absolute"} and set(both["protocol"]) == {"default"}
    absolute = both[both.importance == "absolute"].drop(columns=["importance", "protocol"])
    # a real absolute run of every metric gives the same rows: |score| ranks the non-negative metrics as
    # their signed values do, and contribution was run again
    real = fa.faithfulness_curve(model, None, ids, fa.DEFAULT_METRICS, [0.1, 0.4],
                                 importance="absolute", **kw).per_sequence.drop(columns="importance")
    key = ["metric", "mode", "ratio", "sequence"]
    a = absolute.sort_values(key).reset_index(drop=True)
    b = real.sort_values(key).reset_index(drop=True)[a.columns]
    pd.testing.assert_frame_equal(a, b)
    signed = both[both.importance == "signed"]
    c_abs = a[a.metric == "contribution"]["nll"].to_numpy()
    c_sig = signed[signed.metric == "contribution"].sort_values(key)["nll"].to_numpy()
    assert not np.array_equal(c_abs, c_sig)  # contribution weights do go negative here


@pytest.mark.slow  # one of the quick tier's slowest
def test_per_head_protocol_separates_rungs_2_and_3(peaked):
    model, ids = peaked
    kw = dict(batch_size=5, cache=False, progress=False, importances=["signed"])
    metrics = ["value_weighted", "value_weighted_output_normalized"]
    default = ev.ladder_sweep(model, None, ids, metrics, [0.2, 0.5], **kw)
    per_head = ev.ladder_sweep(model, None, ids, metrics, [0.2, 0.5], protocol="per-head", **kw)
    assert set(per_head["kind"].replace("", np.nan).dropna()) == {"intra"}
    areas, ladders = ev.evidence_tables(pd.concat([default, per_head]), n_bootstrap=100)
    assert set(ladders["protocol"]) == {"default", "per-head"} and set(ladders["range"]) == {"full"}
    step = ladders[(ladders.lower == "value_weighted") & (ladders.higher == "value_weighted_output_normalized")]
    d = step.set_index(["protocol", "mode"])["difference"]
    assert (d.loc["default"] == 0).all()  # identical rankings by construction
    assert (d.loc["per-head"] != 0).all()
