"""Summaries: AOPC, the ladder's paired tests and their intervals against independent computations."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cwcore import faithfulness as fa


def test_aopc_is_the_trapezoid_mean_over_ratios():
    curve = pd.DataFrame({"metric": "m", "kind": "", "mode": "comprehensiveness", "ratio": [0.1, 0.5],
                          "delta_nll": [1.0, 3.0], "delta_ppl": [2.0, 2.0]})
    area = fa.aopc(curve)
    assert area.aopc_nll.item() == pytest.approx((0.1 * 0.5 + 0.4 * 2.0) / 0.5)
    assert area.aopc_ppl.item() == pytest.approx((0.1 * 1.0 + 0.4 * 2.0) / 0.5)
    with_zero = pd.concat([curve, curve.iloc[:1].assign(ratio=0.0, delta_nll=0.0, delta_ppl=0.0)])
    assert fa.aopc(with_zero).aopc_nll.item() == pytest.approx(area.aopc_nll.item())


def test_aopc_intervals_from_per_sequence_tables(sweep):
    area = fa.aopc(sweep, n_bootstrap=200).set_index(["metric", "mode"])
    point = fa.aopc(fa.summarize(sweep)).set_index(["metric", "mode"])
    np.testing.assert_allclose(area.aopc_nll, point.aopc_nll.loc[area.index], rtol=1e-10)
    assert (area.aopc_nll_ci_low <= area.aopc_nll).all() and (area.aopc_nll <= area.aopc_nll_ci_high).all()
    assert (area.n_sequences == 10).all()
    ladder = fa.ladder_comparison(sweep, n_bootstrap=200)
    verdicts = ladder[(ladder.lower == "random") & (ladder.higher == "contribution")].set_index("mode").verdict
    assert verdicts["comprehensiveness"] == "holds" and verdicts["sufficiency"] == "holds"


# ------------------------------------------------------------------------------------------------
# intervals and verdicts against independent computations
# ------------------------------------------------------------------------------------------------


def _scipy_percentile(values, n_resamples, seed, confidence=0.95):
    """The percentile bootstrap interval of the mean, straight from scipy (the reference)."""
    from scipy import stats as scipy_stats

    result = scipy_stats.bootstrap((np.asarray(values, dtype=np.float64),), np.mean, n_resamples=n_resamples,
                                   confidence_level=confidence, method="percentile",
                                   rng=np.random.default_rng(seed))
    return result.confidence_interval.low, result.confidence_interval.high


def test_curve_intervals_are_scipy_percentile_bootstraps_with_shared_resamples(sweep):
    summary = fa.summarize(sweep, n_bootstrap=300, seed=3)
    frame = sweep.assign(delta_nll=sweep.nll - sweep.clean_nll)
    for _, row in summary[summary.ratio > 0].iterrows():
        point = frame[(frame.metric == row.metric) & (frame["mode"] == row["mode"]) & (frame.ratio == row.ratio)]
        values = point.sort_values("sequence").delta_nll.to_numpy()
        assert row.delta_nll == values.mean()
        np.testing.assert_allclose((row.nll_ci_low, row.nll_ci_high), _scipy_percentile(values, 300, 3), rtol=1e-12)


def test_ladder_intervals_are_paired_bootstraps_of_the_aopc_differences(sweep):
    ladder = fa.ladder_comparison(sweep, n_bootstrap=300, seed=5)
    frame = sweep.assign(delta_nll=sweep.nll - sweep.clean_nll)

    def per_sequence_aopc(metric, mode):
        curve = frame[(frame.metric == metric) & (frame["mode"] == mode)].pivot_table(
            index="sequence", columns="ratio", values="delta_nll").sort_index()
        r = curve.columns.to_numpy(dtype=float)  # ratio 0 measured (delta 0): no point to prepend
        assert r[0] == 0
        return np.trapezoid(curve.to_numpy(), r, axis=1) / (r[-1] - r[0])

    row = ladder[(ladder.lower == "attention") & (ladder.higher == "contribution")
                 & (ladder["mode"] == "comprehensiveness")].iloc[0]
    difference = per_sequence_aopc("contribution", "comprehensiveness") - per_sequence_aopc("attention",
                                                                                             "comprehensiveness")
    assert row.difference == pytest.approx(difference.mean(), rel=1e-12)
    np.testing.assert_allclose((row.ci_low, row.ci_high), _scipy_percentile(difference, 300, 5), rtol=1e-10)


def test_ladder_verdicts_use_the_one_vocabulary(sweep):
    from cwcore import stats

    ladder = fa.ladder_comparison(sweep, n_bootstrap=200)
    assert set(ladder.verdict) <= set(stats.VERDICTS)
    # rungs 2 and 3 rank identically under the default protocol by construction: exactly zero, and "not
    # measured" (a property of the protocol, not of the numbers)
    same = ladder[(ladder.lower == "value_weighted") & (ladder.higher == "value_weighted_output_normalized")]
    assert len(same) == 2
    assert (same.difference == 0).all() and (same.ci_low == 0).all() and (same.ci_high == 0).all()
    assert (same.verdict == stats.NOT_MEASURED).all()


def _synthetic(per_sequence_aopc: dict[str, list[float]], mode="comprehensiveness"):
    """A per-sequence table at one ratio (1.0) whose AOPCs are half the given deltas (trapezoid from 0)."""
    rows = []
    for metric, deltas in per_sequence_aopc.items():
        for sequence, delta in enumerate(deltas):
            rows.append({"sequence": sequence, "metric": metric, "kind": "", "mode": mode, "ratio": 1.0,
                         "nll": 2.0 + delta, "clean_nll": 2.0, "n_removed": 1, "n_candidates": 1})
    return pd.DataFrame(rows)


def test_a_significant_reversal_is_contradicted_and_one_unit_is_not_measured():
    from cwcore import stats

    rng = np.random.default_rng(0)
    low = list(2.0 + 0.1 * rng.standard_normal(12))
    high = list(1.0 + 0.1 * rng.standard_normal(12))
    pairs = [("attention", "contribution")]
    for mode, expected in (("comprehensiveness", stats.CONTRADICTED), ("sufficiency", stats.HOLDS)):
        ladder = fa.ladder_comparison(_synthetic({"attention": low, "contribution": high}, mode), pairs=pairs)
        assert ladder.verdict.item() == expected
        assert ladder.difference.item() == pytest.approx((np.mean(high) - np.mean(low)) / 2)
    single = fa.ladder_comparison(_synthetic({"attention": low[:1], "contribution": high[:1]}), pairs=pairs)
    assert single.verdict.item() == stats.NOT_MEASURED


def test_fewer_documents_than_min_clusters_give_no_verdict_however_wide_apart():
    """With 2-4 documents the percentile interval covers far less than 95%: a null difference 'held' in 26% of
    2-document samples. Below MIN_CLUSTERS units the ladder gives no verdict; at MIN_CLUSTERS it does."""
    from cwcore import stats

    pairs = [("attention", "contribution")]
    for n, expected in ((stats.MIN_CLUSTERS - 1, stats.NOT_MEASURED), (stats.MIN_CLUSTERS, stats.HOLDS)):
        table = _synthetic({"attention": [0.0 + 0.01 * i for i in range(n)],
                            "contribution": [5.0 + 0.01 * i for i in range(n)]})
        assert fa.ladder_comparison(table, pairs=pairs).verdict.item() == expected


def test_aopc_keeps_a_group_whose_key_is_nan_as_a_csv_round_trip_gives_it(tmp_path):
    """kind "" written to CSV reads back as NaN: aopc's pivot dropped those groups (2 of 6 rows left)."""
    table = pd.concat([_synthetic({"attention": [1.0, 2.0, 3.0], "contribution": [2.0, 3.0, 5.0]}),
                       _synthetic({"contribution": [1.0, 1.0, 4.0]}).assign(kind="inter")])
    table.to_csv(tmp_path / "t.csv", index=False)
    read = pd.read_csv(tmp_path / "t.csv")
    assert read["kind"].isna().sum() == 6
    area = fa.aopc(read, n_bootstrap=50)
    assert len(area) == 3
    expected = {("attention", None): 1.0, ("contribution", None): 10 / 6, ("contribution", "inter"): 1.0}
    for _, row in area.iterrows():
        kind = None if pd.isna(row["kind"]) else row["kind"]
        assert row.aopc_nll == pytest.approx(expected[(row.metric, kind)])


def test_an_incomplete_or_doubled_table_is_refused_not_averaged_over_what_is_there():
    table = _synthetic({"attention": [1.0, 2.0, 3.0], "contribution": [2.0, 3.0, 5.0]})
    two_ratios = pd.concat([table, table.assign(ratio=0.5, nll=table.nll - 0.5)], ignore_index=True)
    with pytest.raises(ValueError, match="not every sequence was measured at every ratio"):
        fa.aopc(two_ratios.drop(index=1))  # sequence 1 of attention lost at ratio 1.0
    with pytest.raises(ValueError, match="a sequence appears twice at one ratio"):
        fa.aopc(pd.concat([table, table.iloc[:1]]))
    with pytest.raises(ValueError, match="rows have no document"):
        fa.aopc(table.assign(document=[0, 0, np.nan, 1, 1, 1]))
    uneven = pd.concat([two_ratios, table[table.metric == "contribution"].assign(ratio=0.8)], ignore_index=True)
    with pytest.raises(ValueError, match="measured at different ratios"):
        fa.ladder_comparison(uneven, pairs=[("attention", "contribution")])
    with pytest.raises(ValueError, match="pairs name metrics the table does not hold: \\['contribtion'\\]"):
        fa.ladder_comparison(table, pairs=[("attention", "contribtion")])


def test_contribution_rollout_is_a_method_not_a_variant_of_the_contribution_rung():
    from cwcore.faithfulness.summary import _default_pairs

    pairs = _default_pairs(["attention", "value_weighted", "contribution", "contribution_rollout",
                            "contribution_intra", "random"])
    assert ("value_weighted", "contribution_rollout") not in pairs
    assert ("value_weighted", "contribution") in pairs and ("value_weighted", "contribution_intra") in pairs
    assert ("random", "contribution_rollout") not in pairs


def test_aopc_reads_a_per_document_table_without_sequences():
    """aopc raised KeyError: 'sequence' on a per-document table that ladder_comparison accepts."""
    table = _synthetic({"attention": [1.0, 2.0, 4.0]}).rename(columns={"sequence": "document"})
    area = fa.aopc(table, n_bootstrap=50)
    assert area.n_documents.item() == 3 and area.aopc_nll.item() == pytest.approx(7 / 6)
