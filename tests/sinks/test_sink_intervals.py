"""The sink chapters' interval and verdict names (cwcore.sinks.intervals, over cwcore.stats)."""

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


def test_cluster_bootstrap_as_the_sink_chapters_use_it_pools_rows_and_resamples_whole_sequences():
    from cwcore import stats

    # sequence 0: three rows of 1.0 in group "a"; sequence 1: one row of 5.0 in "a"; "b" doubles "a"
    points = pd.DataFrame({"sequence": [0, 0, 0, 1] * 2, "g": ["a"] * 4 + ["b"] * 4,
                           "x": [1.0, 1.0, 1.0, 5.0, 2.0, 2.0, 2.0, 10.0], "w": [1.0, 1.0, 1.0, 3.0] * 2})
    boot = stats.cluster_bootstrap(points, ["x"], "g", n_resamples=500)
    table = boot.table.set_index("g")
    assert table.loc["a", "x"] == pytest.approx(2.0)  # pooled over rows: (1 + 1 + 1 + 5) / 4
    assert table.loc["b", "x"] == pytest.approx(4.0)
    assert list(table["n"]) == [4, 4] and list(table["n_clusters"]) == [2, 2]
    # a resample holds sequence 0 k times and sequence 1 (2 - k) times: means 1, 2 or 5 only
    assert set(np.round(np.unique(boot.replicates["x"][:, 0]), 6)) <= {1.0, 2.0, 5.0}
    assert table.loc["a", "x_low"] == 1.0 and table.loc["a", "x_high"] == 5.0
    # the same resamples for every group: "b" is exactly twice "a" in every replicate
    assert np.allclose(boot.replicates["x"][:, 1], 2 * boot.replicates["x"][:, 0])
    weighted = stats.cluster_bootstrap(points, "x", "g", weight="w", n_resamples=10).table
    assert weighted["x"].iloc[0] == pytest.approx((3 * 1.0 + 3 * 5.0) / 6)
    one = stats.cluster_bootstrap(points[points["sequence"] == 0], ["x"]).table
    assert one["x"].iloc[0] == pytest.approx(1.5) and np.isnan(one["x_low"].iloc[0])


def test_pooled_by_layer_resamples_whole_layers_naively():
    from cwcore import stats
    from cwcore.sinks.intervals import pooled_by_layer, pooled_claim_rows

    rng = np.random.default_rng(0)
    layers = np.repeat(np.arange(11), [3, 4, 2, 5, 3, 3, 2, 4, 3, 2, 3])
    table = pd.DataFrame({"layer": layers, "x": rng.normal(size=len(layers)) + layers * 0.3,
                          "layer_type": np.where(layers % 2 == 0, "global", "sliding")})
    table["flag"] = table["x"] > 0.5
    for statistic, column, f in (("mean", "x", np.mean), ("median", "x", np.median), ("share", "flag", np.mean)):
        got = pooled_by_layer(table, column, statistic=statistic, n_resamples=300, seed=4).set_index("scope")
        assert list(got.index) == ["all", "global", "sliding"]
        for scope in got.index:
            part = table if scope == "all" else table[table["layer_type"] == scope]
            units = np.unique(part["layer"])
            draws = stats.resample_indices(len(units), 300, 4)
            values = [part.loc[part["layer"] == u, column].to_numpy(float) for u in units]
            replicates = [f(np.concatenate([values[u] for u in d])) for d in draws]
            low, high = np.quantile(replicates, [0.025, 0.975])
            assert got.loc[scope, "estimate"] == pytest.approx(f(part[column].to_numpy(float)))
            assert (got.loc[scope, "low"], got.loc[scope, "high"]) == pytest.approx((low, high), abs=1e-9)
            assert got.loc[scope, "n"] == len(part) and got.loc[scope, "n_layers"] == len(units)
    rows = pd.DataFrame(pooled_claim_rows(table, "x", chapter=5, claim="c", part="p", statistic_text="s", key="k",
                                          threshold=0.0, side="above", n_resamples=300, seed=4))
    assert list(rows["claim"]) == ["c", "c [global layers]", "c [sliding layers]"]
    assert list(rows["key"]) == ["k", "k@global", "k@sliding"]
    empty = pooled_claim_rows(table.iloc[:0], "x", chapter=5, claim="c", part="p", statistic_text="s", key="k",
                              threshold=0.0, side="above", why="no sink heads at eps=0.3")
    assert len(empty) == 1 and empty[0]["verdict"] == "not measured" and empty[0]["why"] == "no sink heads at eps=0.3"
    one_layer = pooled_by_layer(table[table["layer"] == 0], "x")
    assert np.isnan(one_layer["low"].iloc[0]) and one_layer["n_layers"].iloc[0] == 1
    # fewer layers than stats.MIN_CLUSTERS: an estimate, no interval, and the part says why
    few = table[table["layer"] < stats.MIN_CLUSTERS - 1]
    got = pooled_by_layer(few, "x").set_index("scope")
    assert got["low"].isna().all() and got.loc["all", "estimate"] == pytest.approx(few["x"].mean())
    few_rows = pooled_claim_rows(few, "x", chapter=5, claim="c", part="p", statistic_text="s", key="k",
                                 threshold=0.0, side="above")
    assert {r["verdict"] for r in few_rows} == {"not measured"}
    assert few_rows[0]["why"] == f"{stats.MIN_CLUSTERS - 1} layers, too few to resample (fewer than {stats.MIN_CLUSTERS})"


def test_no_bootstrap_function_outside_stats():
    # one home for resampling: the sink package defines no *bootstrap* function of its own
    import ast
    import pathlib

    import cwcore
    root = pathlib.Path(cwcore.__file__).parent
    offenders = []
    for path in (root / "sinks").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and "bootstrap" in node.name.lower():
                offenders.append(f"{path.name}:{node.name}")
    assert not offenders
    assert not any("bootstrap" in name.lower() for name in sinks.__all__)
