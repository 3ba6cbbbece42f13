"""The sink chapters' interval and verdict names (cwcore.sinks.intervals, shims over cwcore.stats)."""

import numpy as np
import pandas as pd
import pytest

from cwcore import sinks


# ---------------------------------------------------------------------------------------------------
# intervals and verdicts used by the book's sink chapters
# ---------------------------------------------------------------------------------------------------


def test_verdict_rule_and_combination():
    assert sinks.verdict(0.1, 0.4) == "holds"
    assert sinks.verdict(-0.4, -0.1) == "contradicted"
    # touching the threshold is not above it, and not strictly below it either (cwcore.stats' rule)
    assert sinks.verdict(-0.4, 0.0) == "inconclusive"
    assert sinks.verdict(-0.1, 0.2) == "inconclusive"
    assert sinks.verdict(-0.4, -0.1, side="below") == "holds"
    assert sinks.verdict(0.55, 0.7, threshold=0.5, side="below") == "contradicted"
    assert sinks.verdict(0.52, 0.7, threshold=0.5) == "holds"
    assert sinks.verdict(float("nan"), 0.3) == sinks.UNMEASURED
    with pytest.raises(ValueError, match="side"):
        sinks.verdict(0, 1, side="left")
    assert sinks.combine_verdicts(["holds", "holds"]) == "holds"
    assert sinks.combine_verdicts(["holds", "contradicted"]) == "contradicted"
    assert sinks.combine_verdicts(["holds", "inconclusive"]) == "inconclusive"
    assert sinks.combine_verdicts(["inconclusive", "contradicted"]) == "contradicted"
    assert sinks.combine_verdicts(["inconclusive", sinks.UNMEASURED]) == "inconclusive"
    assert sinks.combine_verdicts([sinks.UNMEASURED]) == sinks.UNMEASURED == "not measured"


def test_share_ci_is_the_wilson_interval():
    share, low, high = sinks.share_ci([True] * 8 + [False] * 2)
    assert share == pytest.approx(0.8)
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    share, low, high = sinks.share_ci([True] * 20 + [None])  # NaN/None dropped; no collapse at 1
    assert share == 1.0 and high == 1.0 and low == pytest.approx(0.8389, abs=1e-4)
    assert np.isnan(sinks.share_ci([])[0])


def test_spearman_and_bootstrap_intervals():
    x = np.arange(30.0)
    rho, low, high = sinks.spearman_ci(x, x**3)  # monotone: rho = 1 in every resample
    assert (rho, low, high) == (1.0, 1.0, 1.0)
    rho, low, high = sinks.spearman_ci(x, -np.exp(x / 10), n_bootstrap=200)
    assert (rho, low, high) == (-1.0, -1.0, -1.0)
    rng = np.random.default_rng(0)
    a = rng.normal(size=200)
    b = a + rng.normal(size=200)
    rho, low, high = sinks.spearman_ci(a, b, seed=1)
    from scipy.stats import spearmanr

    assert rho == pytest.approx(spearmanr(a, b).statistic)
    assert low < rho < high and 0.5 < low and high < 0.85
    assert sinks.spearman_ci(a, b, seed=1) == (rho, low, high)  # seeded
    est, low, high = sinks.bootstrap_ci([1.0, 2.0, 3.0, np.nan, 10.0])
    assert est == 2.5 and 1.0 <= low <= est <= high <= 10.0
    assert sinks.bootstrap_ci([4.0], np.mean)[0] == 4.0 and np.isnan(sinks.bootstrap_ci([4.0])[1])


def test_sequence_bootstrap_pools_rows_and_resamples_whole_sequences():
    # sequence 0: three rows of 1.0 in group "a"; sequence 1: one row of 5.0 in "a"; "b" doubles "a"
    points = pd.DataFrame({"sequence": [0, 0, 0, 1] * 2, "g": ["a"] * 4 + ["b"] * 4,
                           "x": [1.0, 1.0, 1.0, 5.0, 2.0, 2.0, 2.0, 10.0], "w": [1.0, 1.0, 1.0, 3.0] * 2})
    boot = sinks.sequence_bootstrap(points, ["x"], by="g", n_bootstrap=500)
    table = boot.table.set_index("g")
    assert table.loc["a", "x"] == pytest.approx(2.0)  # pooled over rows: (1 + 1 + 1 + 5) / 4
    assert table.loc["b", "x"] == pytest.approx(4.0)
    assert list(table["n"]) == [4, 4] and list(table["n_clusters"]) == [2, 2]
    # a resample holds sequence 0 k times and sequence 1 (2 - k) times: means 1, 2 or 5 only
    assert set(np.round(np.unique(boot.replicates["x"][:, 0]), 6)) <= {1.0, 2.0, 5.0}
    assert table.loc["a", "x_low"] == 1.0 and table.loc["a", "x_high"] == 5.0
    # the same resamples for every group: "b" is exactly twice "a" in every replicate
    assert np.allclose(boot.replicates["x"][:, 1], 2 * boot.replicates["x"][:, 0])
    weighted = sinks.sequence_bootstrap(points, "x", by="g", weight="w", n_bootstrap=10).table
    assert weighted["x"].iloc[0] == pytest.approx((3 * 1.0 + 3 * 5.0) / 6)
    one = sinks.sequence_bootstrap(points[points["sequence"] == 0], ["x"]).table
    assert one["x"].iloc[0] == pytest.approx(1.5) and np.isnan(one["x_low"].iloc[0])
