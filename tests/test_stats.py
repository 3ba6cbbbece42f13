"""cwcore.stats against independent computations (closed forms, scipy directly, brute force)."""

import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from cwcore import stats


def test_bootstrap_mean_interval_matches_the_normal_theory_interval():
    x = np.random.default_rng(0).normal(2.0, 1.0, 400)
    est, low, high = stats.bootstrap_ci(x, n_resamples=4000)
    half = 1.96 * x.std(ddof=1) / math.sqrt(x.size)
    assert est == pytest.approx(x.mean())
    assert low == pytest.approx(x.mean() - half, abs=0.02) and high == pytest.approx(x.mean() + half, abs=0.02)


def test_bootstrap_is_deterministic_and_uses_scipy():
    x = np.random.default_rng(1).exponential(size=30)
    a, b = stats.bootstrap_ci(x, np.median, seed=5), stats.bootstrap_ci(x, np.median, seed=5)
    assert a == b
    ref = sps.bootstrap((x,), np.median, n_resamples=1000, method="percentile", rng=np.random.default_rng(5))
    assert (a.low, a.high) == (ref.confidence_interval.low, ref.confidence_interval.high)


@pytest.mark.parametrize("values, expected", [
    ([], (np.nan,) * 3), ([np.nan, np.nan], (np.nan,) * 3), ([3.0], (3.0, np.nan, np.nan)),
    ([2.0, 2.0, np.nan], (2.0, 2.0, 2.0)),
])
def test_edge_cases_have_one_contract(values, expected):
    got = stats.bootstrap_ci(values)
    np.testing.assert_equal(np.array(got), np.array(expected))


def test_paired_bootstrap_resamples_pairs_not_samples():
    rng = np.random.default_rng(2)
    shared = rng.normal(0, 10, 200)  # large unit effect, tiny paired difference
    x, y = shared + 0.5 + rng.normal(0, 0.1, 200), shared
    est, low, high = stats.paired_bootstrap_ci(x, y)
    assert est == pytest.approx(np.mean(x - y))
    assert 0.4 < low < 0.5 < high < 0.6  # an unpaired interval would be ~+-1.4 wide


def test_cluster_bootstrap_pools_rows_and_resamples_clusters():
    rng = np.random.default_rng(4)
    rows = []
    for cluster in range(30):
        effect = rng.normal(0, 1)  # rows of a cluster share its effect: they are not independent
        rows += [{"sequence": cluster, "g": g, "v": effect + rng.normal(0, 0.1)} for g in (0, 1) for _ in range(20)]
    frame = pd.DataFrame(rows)
    boot = stats.cluster_bootstrap(frame, "v", by="g", n_resamples=2000)
    per_cluster = frame.groupby("sequence")["v"].mean().to_numpy()
    naive_half = 1.96 * per_cluster.std(ddof=1) / math.sqrt(30)  # the right width: clusters are the units
    est, low, high = boot.interval(0, "v")
    assert est == pytest.approx(frame[frame.g == 0]["v"].mean())
    assert (high - low) / 2 == pytest.approx(naive_half, rel=0.2)
    assert boot.table["n_clusters"].tolist() == [30, 30]
    # the two groups share clusters, so their difference is tiny and its interval narrow
    d, dlow, dhigh = boot.contrast(0, 1, "v")
    assert abs(d) < 0.05 and dhigh - dlow < 0.1


def test_wilson_matches_the_closed_form():
    k, n, z = 7, 20, sps.norm.ppf(0.975)
    p = k / n
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    got = stats.wilson_ci(k, n)
    assert got.estimate == p
    assert (got.low, got.high) == pytest.approx((centre - half, centre + half))
    assert stats.share_ci([True] * 7 + [False] * 13 + [None]) == got
    assert stats.wilson_ci(20, 20).low < 1.0  # does not collapse when every unit agrees


def test_spearman_matches_scipy():
    rng = np.random.default_rng(6)
    x = rng.normal(size=60)
    y = x + rng.normal(size=60)
    got = stats.spearman_ci(x, y)
    assert got.estimate == pytest.approx(sps.spearmanr(x, y).statistic)
    assert got.low < got.estimate < got.high
    assert np.isnan(stats.spearman_ci([1, 2], [2, 1]).estimate)


def test_spearman_of_a_small_tied_sample_leaves_constant_resamples_out_as_the_cluster_path_does():
    """Five pairs with ties: a few resamples hold one y value, rho is undefined there, and the interval was
    (nan, nan) beside a finite estimate. The reference: scipy's own bootstrap of scipy's spearmanr, the same
    draws, with those resamples dropped; a sample without such resamples keeps scipy's interval exactly."""
    x, y = np.array([1, 2, 3, 4, 5.0]), np.array([1, 1, 1, 2, 3.0])

    def rho(a, b):
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return sps.spearmanr(a, b).statistic

    reference = sps.bootstrap((x, y), rho, paired=True, vectorized=False, n_resamples=500, method="percentile",
                              rng=np.random.default_rng(2))
    assert not np.isfinite(reference.confidence_interval.low)  # the case: scipy's interval is NaN
    distribution = reference.bootstrap_distribution[np.isfinite(reference.bootstrap_distribution)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the undefined resamples are left out quietly: no warning reaches the user
        got = stats.spearman_ci(x, y, n_resamples=500, seed=2)
    assert got.estimate == pytest.approx(sps.spearmanr(x, y).statistic)
    assert (got.low, got.high) == pytest.approx(tuple(np.percentile(distribution, [2.5, 97.5])), abs=1e-12)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=40), rng.normal(size=40)
    plain = sps.bootstrap((a, b), rho, paired=True, vectorized=False, n_resamples=300, method="percentile",
                          rng=np.random.default_rng(4)).confidence_interval
    assert tuple(stats.spearman_ci(a, b, n_resamples=300, seed=4))[1:] == pytest.approx(tuple(plain), abs=1e-12)
    four = stats.spearman_ci(x[:4], y[:4] + np.arange(4), n_resamples=500, seed=2)  # below MIN_CLUSTERS pairs
    assert four.estimate == pytest.approx(sps.spearmanr(x[:4], y[:4] + np.arange(4)).statistic)
    assert np.isnan(four.low) and np.isnan(four.high)


def test_trapezoid_mean_and_min_detectable_effect():
    assert stats.trapezoid_mean([0.0, 0.5, 1.0], [0.0, 1.0, 0.0]) == pytest.approx(0.5)
    assert stats.trapezoid_mean([0.1, 0.3], [[1.0, 3.0]]) == pytest.approx([2.0])
    assert stats.min_detectable_effect(1.0, 100) == pytest.approx((1.959964 + 0.841621) / 10, rel=1e-5)
    assert np.isnan(stats.min_detectable_effect(1.0, 1))


@pytest.mark.parametrize("low, high, side, expected", [
    (0.1, 0.3, "above", stats.HOLDS), (-0.3, -0.1, "above", stats.CONTRADICTED), (-0.1, 0.2, "above", stats.INCONCLUSIVE),
    (0.0, 0.0, "above", stats.INCONCLUSIVE), (0.0, 0.2, "above", stats.INCONCLUSIVE), (np.nan, 0.2, "above", stats.NOT_MEASURED),
    (-0.3, -0.1, "below", stats.HOLDS), (0.1, 0.3, "below", stats.CONTRADICTED),
])
def test_verdict_rule(low, high, side, expected):
    assert stats.verdict(low, high, side=side) == expected


def test_verdict_refuses_a_nan_threshold_a_swapped_interval_and_a_margin_that_is_no_number():
    """threshold=nan read "inconclusive", low > high "held", margin=inf was ignored."""
    for kwargs, message in ((dict(threshold=np.nan), "threshold must be a finite number"),
                            (dict(margin=np.inf), "margin must be a positive finite number"),
                            (dict(margin=np.nan), "margin must be a positive finite number"),
                            (dict(margin=0.0), "margin must be a positive finite number")):
        with pytest.raises(ValueError, match=message):
            stats.verdict(0.1, 0.3, **kwargs)
    with pytest.raises(ValueError, match="low end 0.3 is above its high end 0.1"):
        stats.verdict(0.3, 0.1)
    assert stats.verdict(-0.01, 0.02, margin=0.05) == stats.NEGLIGIBLE


def test_verdict_threshold_and_combination():
    assert stats.verdict(0.31, 0.5, threshold=0.3) == stats.HOLDS
    H, C, I, N = stats.HOLDS, stats.CONTRADICTED, stats.INCONCLUSIVE, stats.NOT_MEASURED
    assert stats.combine_verdicts([H, H, N]) == H
    assert stats.combine_verdicts([H, C]) == C  # a significant reversal is never "partly"
    assert stats.combine_verdicts([H, I]) == I
    assert stats.combine_verdicts([N, N]) == N and stats.combine_verdicts([]) == N
    with pytest.raises(ValueError, match="vocabulary"):
        stats.combine_verdicts(["agrees"])


def test_spearman_by_cluster_resamples_whole_clusters_like_a_naive_loop():
    rng = np.random.default_rng(3)
    layers = np.repeat(np.arange(8), 5)  # 8 clusters of 5 pairs, with a shared offset per cluster
    x = rng.normal(size=40) + np.repeat(rng.normal(size=8), 5)
    y = x + rng.normal(size=40) + np.repeat(rng.normal(size=8) * 2, 5)
    got = stats.spearman_ci(x, y, clusters=layers, n_resamples=400, seed=5)
    assert got.estimate == pytest.approx(sps.spearmanr(x, y).statistic)
    draws = np.random.default_rng(5).integers(0, 8, size=(400, 8))  # the same draws: whole layers
    naive = []
    for d in draws:
        rows = np.concatenate([np.flatnonzero(layers == u) for u in d])
        naive.append(sps.spearmanr(x[rows], y[rows]).statistic)
    low, high = np.nanpercentile(naive, [2.5, 97.5])
    assert (got.low, got.high) == pytest.approx((low, high), abs=1e-12)
    # pairs that are near-copies within a cluster: 40 pairs carry the information of 8, and only the
    # cluster bootstrap's interval is as wide as 8 independent pairs' would be
    xc = np.repeat(rng.normal(size=8), 5) + 0.01 * rng.normal(size=40)
    yc = np.repeat(rng.normal(size=8), 5) + 0.01 * rng.normal(size=40)
    clustered = stats.spearman_ci(xc, yc, clusters=layers, n_resamples=400, seed=5)
    pairs = stats.spearman_ci(xc, yc, n_resamples=400, seed=5)
    assert clustered.high - clustered.low > 1.5 * (pairs.high - pairs.low)
    assert np.isnan(stats.spearman_ci(x, y, clusters=np.zeros(40)).low)  # one cluster: no interval


def test_detectable_effect_from_an_interval_equals_the_mde_of_a_normal_mean():
    sd, n = 2.0, 50
    half = sps.norm.ppf(0.975) * sd / np.sqrt(n)
    assert stats.detectable_from_interval(1.0 - half, 1.0 + half) == pytest.approx(stats.min_detectable_effect(sd, n))
    assert np.isnan(stats.detectable_from_interval(np.nan, 1.0))


def test_negligible_needs_the_whole_interval_inside_the_margin():
    assert stats.verdict(1e-4, 3e-4, margin=0.01) == stats.NEGLIGIBLE  # excludes 0, yet practically zero
    assert stats.verdict(1e-4, 3e-4) == stats.HOLDS  # without a margin: the old rule
    assert stats.verdict(-0.004, 0.002, side="below", margin=0.01) == stats.NEGLIGIBLE
    assert stats.verdict(0.005, 0.02, margin=0.01) == stats.HOLDS  # reaches past the margin
    assert stats.verdict(-0.02, 0.005, margin=0.01) == stats.INCONCLUSIVE
    assert stats.verdict(0.295, 0.305, threshold=0.3, margin=0.01) == stats.NEGLIGIBLE
    with pytest.raises(ValueError, match="positive"):
        stats.verdict(0.1, 0.2, margin=0.0)


def test_combine_all_needs_every_part():
    H, C, G, I, N = stats.HOLDS, stats.CONTRADICTED, stats.NEGLIGIBLE, stats.INCONCLUSIVE, stats.NOT_MEASURED
    assert stats.combine_all([H, H, H]) == H and stats.combine_verdicts([H, N, H]) == H
    assert stats.combine_all([H, N, H]) == N  # a chain with an unmeasured link is not shown
    assert stats.combine_all([H, N, C]) == C  # ... but a measured reversal refutes it
    assert stats.combine_all([G, G]) == G and stats.combine_all([H, G]) == I


def test_sign_flip_p_is_the_exact_enumeration_for_small_samples():
    import itertools

    d = np.array([0.3, -0.1, 0.5, 0.2, 0.4, -0.05, 0.25, 0.15])
    signs = np.array(list(itertools.product([1, -1], repeat=d.size)))  # all 2^8 sign flips
    null = (signs * d).mean(1)
    naive = np.mean(np.abs(null) >= abs(d.mean()) - 1e-12)
    assert stats.sign_flip_p(d) == pytest.approx(naive)
    assert stats.sign_flip_p(np.zeros(5)) == 1.0 and np.isnan(stats.sign_flip_p([0.3]))


def test_holm_matches_the_step_down_definition():
    p = np.array([0.01, 0.04, 0.03, 0.005, np.nan])
    m = p.size
    order = [3, 0, 2, 1, 4]  # ascending, the NaN counted as 1
    naive = np.empty(m)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * (1.0 if np.isnan(p[i]) else p[i])))
        naive[i] = running
    np.testing.assert_allclose(stats.holm(p), naive)
    np.testing.assert_allclose(stats.holm([0.01, 0.02]), [0.02, 0.02])


def test_mde_at_level_restates_the_detectable_effect_at_another_level():
    """min_detectable_effect at 0.05 restated at 0.05/32 equals a direct computation at 0.05/32 (and the
    restatement is the identity at the same level)."""
    from cwcore import stats as S

    direct = S.min_detectable_effect(0.3, 64, alpha=0.05 / 32)
    restated = S.mde_at_level(S.min_detectable_effect(0.3, 64), 0.05 / 32, from_alpha=0.05)
    assert restated == pytest.approx(direct, rel=1e-12) and restated > S.min_detectable_effect(0.3, 64)
    assert S.mde_at_level(0.1, 0.05, from_alpha=0.05) == pytest.approx(0.1)


def test_a_group_whose_values_lie_in_one_cluster_has_no_interval():
    """cluster_bootstrap resamples whole clusters; a group (or a column of it) whose values all come from one
    cluster resamples to one value. Before, such a group got the point interval [x, x] whenever the table as a
    whole had two clusters, and ``verdict`` read it as decisive ("holds"). The control: a group spread over
    five clusters keeps an interval of positive width."""
    points = pd.DataFrame({"sequence": [0, 0, 1, 2, 3, 4, 5], "group": ["a", "a", "b", "b", "b", "b", "b"],
                           "x": [0.1, 0.3, 1.0, 2.0, 0.5, 1.5, 0.7], "y": [1.0, 2.0, 1.0] + [np.nan] * 4})
    table = stats.cluster_bootstrap(points, ["x", "y"], by="group", seed=0).table.set_index("group")
    assert np.isnan(table.loc["a", "x_low"]) and np.isnan(table.loc["a", "x_high"])
    assert table.loc["a", "x"] == pytest.approx(0.2)
    assert np.isnan(table.loc["b", "y_low"])  # b's y is a number in one cluster only (sequence 1)
    assert table.loc["b", "x_low"] < table.loc["b", "x"] < table.loc["b", "x_high"]  # the control
    assert stats.verdict(table.loc["a", "x_low"], table.loc["a", "x_high"]) != stats.HOLDS


def test_infinite_values_are_left_out_with_a_warning_that_counts_them():
    """An overflowed value (a perplexity of inf) is not dropped without a word: the interval covers the finite
    values only, and the warning says how many were left out."""
    values = [1.0, 2.0, 3.0, np.inf, 4.0]
    with pytest.warns(RuntimeWarning, match="1 infinite value"):
        got = stats.bootstrap_ci(values, seed=0)
    assert got.estimate == pytest.approx(2.5)
    with pytest.warns(RuntimeWarning, match="2 infinite value"):
        stats.paired_bootstrap_ci([1.0, np.inf, 2.0, 3.0], [0.0, 1.0, -np.inf, 1.0])
    with pytest.warns(RuntimeWarning, match="infinite"):
        stats.sign_flip_p([1.0, -np.inf, 2.0])
    frame = pd.DataFrame({"v": [1.0, np.inf, 2.0, 3.0], "sequence": [0, 1, 2, 3]})
    with pytest.warns(RuntimeWarning, match="1 infinite value"):
        table = stats.cluster_bootstrap(frame, "v").table
    assert table["v"].iloc[0] == pytest.approx(2.0)
    with warnings.catch_warnings():  # NaN alone is the documented "missing", dropped quietly
        warnings.simplefilter("error")
        assert stats.bootstrap_ci([1.0, np.nan, 3.0]).estimate == pytest.approx(2.0)


def test_share_ci_refuses_flags_that_are_not_booleans():
    """bool("False") is True: a column of strings would have been counted as all true."""
    with pytest.raises(ValueError, match="booleans.*'True' and 1 more"):
        stats.share_ci(["True", "False"])
    with pytest.raises(ValueError, match="booleans.*2"):
        stats.share_ci([0, 1, 2])
    assert stats.share_ci(np.array([1, 0, 0, 1])) == stats.wilson_ci(2, 4)
    assert stats.share_ci(pd.Series([True, False, None, False])) == stats.wilson_ci(1, 3)


def test_cluster_bootstrap_refuses_a_missing_group_or_cluster_key():
    frame = pd.DataFrame({"v": [1.0, 2.0, 3.0], "g": ["a", None, "a"], "sequence": [0, 1, 2]})
    with pytest.raises(ValueError, match="column 'g' has 1 missing"):
        stats.cluster_bootstrap(frame, "v", by="g")
    frame = pd.DataFrame({"v": [1.0, 2.0, 3.0], "sequence": [0.0, np.nan, 1.0]})
    with pytest.raises(ValueError, match="column 'sequence' has 1 missing"):
        stats.cluster_bootstrap(frame, "v")
