"""Convexity of the output norm in the sink rate (cwcore.sinks.sink_convexity)."""

import numpy as np
import pandas as pd
import pytest

from cwcore import sinks
from cwcore.sinks.convexity import vertex_intervals
from sink_fixtures import (FAST, P_TAIL, Q_SINK, T, V0, VT, expected_alpha, naive_run, planted_ids,
                           planted_model, random_ids)
from tiny_models import tiny_model


# -- 4. convexity ----------------------------------------------------------------------------------


def test_convexity_fit_recovers_the_planted_interior_minimum():
    model, ids = planted_model(), planted_ids()
    vt, v0 = np.array(VT), np.array(V0)
    a_star = vt @ (vt - v0) / ((vt - v0) @ (vt - v0))  # 0.4615...
    exact = sinks.sink_convexity(model, None, ids, fit_on="squared_norm", **FAST)
    fits = exact.fits.set_index("scope").loc["head"].set_index("head")
    assert fits.loc[1, "alpha_star"] == pytest.approx(a_star, abs=1e-3)
    assert fits.loc[1, "curvature"] == pytest.approx((vt - v0) @ (vt - v0), rel=1e-3)  # ||vt - v0||^2
    assert fits.loc[1, "r2"] == pytest.approx(1.0, abs=1e-6)
    assert fits.loc[1, "two_vector_alpha_star"] == pytest.approx(a_star, abs=1e-4)
    assert fits.loc[1, "reference_alpha_star"] == pytest.approx(a_star, abs=0.005)
    assert bool(fits.loc[1, "interior_minimum"]) and bool(fits.loc[1, "minimum_in_range"])
    # on the norm itself (not exactly quadratic) the vertex is still close
    norm_fit = sinks.sink_convexity(model, None, ids, **FAST).fits
    head1 = norm_fit[(norm_fit["scope"] == "head") & (norm_fit["head"] == 1)].iloc[0]
    assert head1["alpha_star"] == pytest.approx(a_star, abs=0.05) and head1["curvature"] > 0
    # head 0: anti-parallel values, the norm |(1 - a) P - a Q| vanishes at P / (P + Q)
    assert fits.loc[0, "two_vector_alpha_star"] == pytest.approx(P_TAIL / (P_TAIL + Q_SINK), abs=1e-4)
    # ... and |(1 - a) - a| < (1 - a) (the sink shortens the output) exactly when a < 2/3
    assert fits.loc[0, "share_sink_suppresses"] == pytest.approx(np.mean(expected_alpha() < 2 / 3))
    assert fits.loc[1, "median_norm_over_semantic"] == pytest.approx(np.median(np.linalg.norm(
        np.outer(expected_alpha(), v0) + np.outer(1 - expected_alpha(), vt), axis=1) / (1 - expected_alpha())), rel=1e-4)
    # the binned curves: observed norms follow the two-vector formula, and the reference at each centre
    curves = exact.curves[(exact.curves["scope"] == "head") & (exact.curves["head"] == 1)]
    c = curves["bin_centre"].to_numpy()
    expected_ref = np.linalg.norm(np.outer(c, v0) + np.outer(1 - c, vt), axis=1)
    np.testing.assert_allclose(curves["reference_norm"], expected_ref, atol=1e-4)
    seen = curves[curves["n"] > 0]
    np.testing.assert_allclose(seen["norm_mean"], np.linalg.norm(
        np.outer(seen["alpha_mean"], v0) + np.outer(1 - seen["alpha_mean"], vt), axis=1), rtol=0.05)
    assert curves["n"].sum() == 3 * (T - 1)


def test_convexity_points_match_naive_head_output_norms():
    model, ids = tiny_model("gemma3"), random_ids(length=10)
    fits = sinks.sink_convexity(model, None, ids, min_range=0.0, **FAST).fits
    reference, _ = naive_run(model, ids)
    heads = fits[fits["scope"] == "head"].set_index(["layer", "head"])
    for l, ref in enumerate(reference):
        a0 = ref["attention"][:, :, 1:, 0]
        norm = ref["outputs"][:, :, 1:].norm(dim=-1)
        for h in range(a0.shape[1]):
            c2, c1, c0 = np.polyfit(a0[:, h].reshape(-1).numpy(), norm[:, h].reshape(-1).numpy(), 2)
            assert heads.loc[(l, h), "curvature"] == pytest.approx(c2, rel=1e-3, abs=1e-6)
            assert heads.loc[(l, h), "alpha_star"] == pytest.approx(-c1 / (2 * c2), rel=1e-3, abs=1e-6)


# -- where the vertex lies, with an interval over documents ----------------------------------------


def test_vertex_intervals_refit_equals_polyfit_and_resamples_whole_sequences():
    """The pooled rows were compared only between the fits and the refit, both library code, so a scale changed
    in both places passed. Now both are also checked against np.polyfit on the scale as documented, written
    here: "model" divides each head's norms by their mean, "model_v0" each point's norm by sqrt(v0_sq)."""
    model, ids = tiny_model("gemma3"), random_ids(n=5, length=10)
    out = sinks.run_analyses(model, None, ids, ["convexity"], raw=True, min_range=0.0, **FAST)
    fits, points = out["convexity"].fits, out["raw"]["convexity"]["points"]
    vertices = vertex_intervals(points, fits, n_resamples=100, seed=0)
    head = vertices[vertices["scope"] == "head"].set_index(["layer", "head"])
    heads = fits[fits["scope"] == "head"].set_index(["layer", "head"])
    np.testing.assert_allclose(head["alpha_star"], heads.loc[head.index, "alpha_star"], rtol=1e-6)
    np.testing.assert_allclose(head["curvature"], heads.loc[head.index, "curvature"], rtol=1e-6)
    pooled = vertices[vertices["scope"] == "model"].iloc[0]
    assert pooled["alpha_star"] == pytest.approx(fits[fits["scope"] == "model"]["alpha_star"].iloc[0], rel=1e-6)
    # the pooled rows against the naive reference (see the docstring)
    by_head = points.groupby(["layer", "head"])["norm"].transform("mean")
    for scope, y in (("model", points["norm"] / by_head), ("model_v0", points["norm"] / np.sqrt(points["v0_sq"]))):
        c2, c1, _ = np.polyfit(points["alpha0"], y, 2)
        row = fits[fits["scope"] == scope].iloc[0]
        refit = vertices[vertices["scope"] == scope].iloc[0]
        for got in (row, refit):
            assert got["curvature"] == pytest.approx(c2, rel=1e-5), scope
            assert got["alpha_star"] == pytest.approx(-c1 / (2 * c2), rel=1e-5), scope
    # the control: another reasonable scale (each head's largest norm) gives another pooled fit
    by_max = points.groupby(["layer", "head"])["norm"].transform("max")
    c2_max, _, _ = np.polyfit(points["alpha0"], points["norm"] / by_max, 2)
    assert c2_max != pytest.approx(fits[fits["scope"] == "model"]["curvature"].iloc[0], rel=1e-2)
    # one bootstrap replicate by hand: the same resampled sequences, the rows of each drawn sequence repeated
    from cwcore import stats
    draw = stats.resample_indices(5, 100, 0)
    (layer, h) = head.index[0]
    mine = points[(points["layer"] == layer) & (points["head"] == h)]
    stars = []
    for d in draw:
        rows = pd.concat([mine[mine["sequence"] == k] for k in d])
        c2, c1, _ = np.polyfit(rows["alpha0"], rows["norm"], 2)
        stars.append(-c1 / (2 * c2))
    low, high = np.percentile(stars, [2.5, 97.5])
    assert head.loc[(layer, h), "alpha_star_low"] == pytest.approx(low, rel=1e-5, abs=1e-7)
    assert head.loc[(layer, h), "alpha_star_high"] == pytest.approx(high, rel=1e-5, abs=1e-7)


def _narrow_points(low=0.50, high=0.53, vertex=0.515, curvature=50.0):
    """One head whose sink rates span ``high - low``: norms on a planted parabola, 8 sequences of 100 queries."""
    rng = np.random.default_rng(0)
    parts = []
    for sequence in range(8):
        a = rng.uniform(low, high, 100)
        parts.append(pd.DataFrame({"layer": 0, "head": 0, "sequence": sequence, "query": np.arange(1, 101),
                                   "alpha0": a, "norm": 1 + curvature * (a - vertex) ** 2 + rng.normal(0, 1e-4, 100),
                                   "v0_sq": 1.0, "s_sq": 1.0, "v0_s": 0.0}))
    return pd.concat(parts, ignore_index=True)


def test_a_vertex_of_sink_rates_that_span_little_is_refitted_not_called_singular():
    """The refits solved normal equations in raw powers of the sink rate: rates spanning 0.03 made them look
    singular (|det| <= 1e-12 n^3) and every vertex NaN, though np.polyfit finds the planted one to 1e-5."""
    from cwcore.sinks.convexity import _convexity_tables

    points = _narrow_points()
    fits = _convexity_tables(points, 10, "norm", 0.02, 0.3).fits
    vertices = vertex_intervals(points, fits, n_resamples=200, seed=0)
    c2, c1, _ = np.polyfit(points["alpha0"], points["norm"], 2)
    for _, row in vertices.iterrows():
        if row["scope"] == "model":  # the pooled fit divides each head's norms by their mean
            continue
        assert row["alpha_star"] == pytest.approx(-c1 / (2 * c2), abs=1e-6)
        assert row["curvature"] == pytest.approx(c2, rel=1e-6)
        assert row["alpha_star_low"] < 0.515 < row["alpha_star_high"] and row["vertex_inside"]


def test_the_claims_refit_with_the_fits_own_fit_on_and_a_misspelt_one_is_refused():
    """The registered claims refitted y = ||o|| whatever fit_on the run used (the pooled curvature 1.12 where the
    fits, on the squared norm, said 2.83); vertex_intervals read any other spelling as the square."""
    from cwcore.sinks.convexity import _claims

    model, ids = tiny_model("gemma3"), random_ids(n=6, length=16)
    out = sinks.run_analyses(model, None, ids, ["convexity"], raw=True, fit_on="squared_norm", **FAST)
    fits = out["convexity"].fits
    rows = pd.DataFrame(_claims(out, eps=0.3, n_resamples=50, seed=0)).set_index("key")
    pooled = fits[fits["scope"] == "model"].iloc[0]
    assert rows.loc["pooled_curvature", "estimate"] == pytest.approx(pooled["curvature"], rel=1e-6)
    on_norm = vertex_intervals(out["raw"]["convexity"]["points"], fits, "norm", 50, 0)
    assert on_norm[on_norm["scope"] == "model"]["curvature"].iloc[0] != pytest.approx(pooled["curvature"], rel=1e-2)
    with pytest.raises(ValueError, match="fit_on must be one of 'norm', 'squared_norm', not 'Norm'"):
        vertex_intervals(out["raw"]["convexity"]["points"], fits, "Norm")


def test_planted_vertex_is_established_and_pooled_claims_judge_the_vertex():
    model, ids = planted_model(), planted_ids(n=4)
    vt, v0 = np.array(VT), np.array(V0)
    a_star = vt @ (vt - v0) / ((vt - v0) @ (vt - v0))
    out = sinks.run_analyses(model, None, ids, ["convexity"], raw=True, fit_on="squared_norm", **FAST)
    fits, raw = out["convexity"].fits, out["raw"]["convexity"]
    vertices = vertex_intervals(raw["points"], fits, "squared_norm", n_resamples=200)
    head1 = vertices[(vertices["scope"] == "head") & (vertices["head"] == 1)].iloc[0]
    # every document is the same planted sequence: each refit finds the exact vertex
    assert head1["alpha_star_low"] == pytest.approx(a_star, abs=1e-4)
    assert head1["alpha_star_high"] == pytest.approx(a_star, abs=1e-4)
    assert bool(head1["vertex_inside"]) and head1["share_interior"] == 1.0
    from cwcore.sinks.convexity import CONVEXITY, _claim_rows
    rows = pd.DataFrame(_claim_rows(fits, raw["points"], 0.1, 200, 0, raw["block"], raw["layers"], "squared_norm"))
    pooled = rows[rows["claim"] == CONVEXITY].set_index("key")
    assert set(pooled.index) == {"pooled_curvature", "pooled_vertex_above_0", "pooled_vertex_below_1"}
    model_fit = fits[fits["scope"] == "model"].iloc[0]
    assert pooled.loc["pooled_vertex_below_1", "estimate"] == pytest.approx(model_fit["alpha_star"], rel=1e-6)
    assert pooled.loc["pooled_curvature", "estimate"] == pytest.approx(model_fit["curvature"], rel=1e-6)
    per_head = rows[rows["claim"] == f"{CONVEXITY} [per head]"].set_index("key")
    fitted = fits[(fits["scope"] == "head") & fits["fitted"]]
    assert per_head.loc["share_interior", "estimate"] == pytest.approx(fitted["interior_minimum"].mean())
    # one layer: no interval over layers, so the per-head shares are not measured (not a crash)
    assert per_head.loc["share_interior", "verdict"] == "not measured"


def test_convexity_claims_without_fitted_heads_say_why():
    model, ids = planted_model(), planted_ids(n=2)
    out = sinks.run_analyses(model, None, ids, ["convexity"], raw=True, min_range=2.0, **FAST)
    from cwcore.sinks.convexity import _claim_rows
    raw = out["raw"]["convexity"]
    rows = pd.DataFrame(_claim_rows(out["convexity"].fits, raw["points"], 0.3, 100, 0, raw["block"], raw["layers"]))
    convex = rows[rows["claim"].str.startswith("convexity")]
    assert set(convex["verdict"]) == {"not measured"} and (convex["why"] != "").all()


def test_a_concave_pooled_fit_has_no_minimum_to_locate():
    from cwcore.sinks.convexity import CONVEXITY, _claim_rows, _convexity_tables
    rng = np.random.default_rng(0)
    n = 600
    a = rng.uniform(0, 0.95, n)
    points = pd.DataFrame({"layer": rng.integers(0, 3, n), "head": rng.integers(0, 2, n), "sequence": rng.integers(0, 6, n),
                           "query": np.arange(n), "alpha0": a, "norm": 2 - (a - 0.5) ** 2 + rng.normal(0, 0.01, n),
                           "v0_sq": np.ones(n), "s_sq": np.ones(n), "v0_s": np.zeros(n)})
    fits = _convexity_tables(points, 10, "norm", 0.05, 0.3).fits
    rows = pd.DataFrame(_claim_rows(fits, points, 0.3, 200, 0)).set_index("key")
    assert rows.loc["pooled_curvature", "verdict"] == "contradicted"
    for key in ("pooled_vertex_above_0", "pooled_vertex_below_1"):
        assert rows.loc[key, "verdict"] == "not measured"
        assert "concave" in rows.loc[key, "why"]
    assert rows.loc["pooled_curvature", "claim"] == CONVEXITY


def test_a_concave_head_has_no_established_interior_minimum_though_its_vertex_lies_inside():
    """``vertex_inside`` is "an interior minimum established by both intervals": alpha*'s inside (0, 1) and the
    curvature's above 0. Every test read it on convex heads, so the curvature condition could be dropped. Here
    each head's norms lie on a concave parabola with its vertex (a maximum) at 0.5: alpha*'s interval lies in
    (0, 1) (the control: that condition alone says inside), the curvature's below 0, so no head is inside."""
    from cwcore.sinks.convexity import _claim_rows, _convexity_tables

    rng = np.random.default_rng(0)
    n = 600
    a = rng.uniform(0, 0.95, n)
    points = pd.DataFrame({"layer": rng.integers(0, 3, n), "head": rng.integers(0, 2, n),
                           "sequence": rng.integers(0, 6, n), "query": np.arange(n), "alpha0": a,
                           "norm": 2 - (a - 0.5) ** 2 + rng.normal(0, 0.01, n),
                           "v0_sq": np.ones(n), "s_sq": np.ones(n), "v0_s": np.zeros(n)})
    fits = _convexity_tables(points, 10, "norm", 0.05, 0.3).fits
    heads = vertex_intervals(points, fits, n_resamples=200, seed=0)
    heads = heads[heads["scope"] == "head"].set_index(["layer", "head"])
    assert len(heads) == 6
    for (layer, head), g in points.groupby(["layer", "head"]):
        c2, c1, _ = np.polyfit(g["alpha0"], g["norm"], 2)
        assert c2 < 0 and heads.loc[(layer, head), "curvature"] == pytest.approx(c2, rel=1e-6)
    assert (heads["alpha_star_low"] > 0).all() and (heads["alpha_star_high"] < 1).all()  # the control
    assert (heads["curvature_high"] < 0).all()
    assert not heads["vertex_inside"].any()
    assert (heads["share_interior"] == 0).all()
    rows = pd.DataFrame(_claim_rows(fits, points, 0.3, 200, 0)).set_index("key")
    assert rows.loc["share_vertex_inside", "estimate"] == pytest.approx(0.0)
    assert rows.loc["share_interior", "estimate"] == pytest.approx(0.0)


def test_a_group_seen_in_one_sequence_has_no_interval_over_sequences():
    """The intervals resample whole sequences: a group seen in one sequence has no interval (NaN) and no
    established vertex, though every resample refits the same points (a zero-width interval). No test had one."""
    points = _narrow_points()
    one = points[points["sequence"] == 0]
    from cwcore.sinks.convexity import _convexity_tables

    fits = _convexity_tables(one, 10, "norm", 0.02, 0.3).fits
    vertices = vertex_intervals(one, fits, n_resamples=50, seed=0).set_index("scope")
    c2, c1, _ = np.polyfit(one["alpha0"], one["norm"], 2)
    assert vertices.loc["head", "alpha_star"] == pytest.approx(-c1 / (2 * c2), abs=1e-6)  # the fit itself is made
    assert (vertices["n_sequences"] == 1).all()
    for column in ("alpha_star_low", "alpha_star_high", "curvature_low", "curvature_high"):
        assert vertices[column].isna().all(), column
    assert not vertices["vertex_inside"].any()
    # the control: two sequences give a finite interval
    two = vertex_intervals(points[points["sequence"] < 2], fits, n_resamples=50, seed=0).set_index("scope")
    assert np.isfinite(two.loc["head", ["alpha_star_low", "alpha_star_high"]].astype(float)).all()


def test_an_extrapolated_vertex_is_established_but_not_observed():
    from cwcore.sinks.convexity import CONVEXITY, OBSERVED_CLAIMS, _claim_rows, _convexity_tables
    rng = np.random.default_rng(0)
    n = 900
    a = rng.uniform(0, 0.5, n)  # the sink rates seen stop at 0.5; the planted vertex is at 0.8
    points = pd.DataFrame({"layer": rng.integers(0, 3, n), "head": rng.integers(0, 2, n), "sequence": rng.integers(0, 8, n),
                           "query": np.arange(n), "alpha0": a, "norm": 1 + (a - 0.8) ** 2 + rng.normal(0, 0.002, n),
                           "v0_sq": np.ones(n), "s_sq": np.ones(n), "v0_s": np.zeros(n)})
    fits = _convexity_tables(points, 10, "norm", 0.05, 0.3).fits
    rows = pd.DataFrame(_claim_rows(fits, points, 0.3, 200, 0)).set_index("key")
    # established by its interval: convex, vertex inside (0, 1)
    for key in ("pooled_curvature", "pooled_vertex_above_0", "pooled_vertex_below_1"):
        assert rows.loc[key, "verdict"] == "holds", key
    # observed: the vertex lies beyond the highest observed sink rates
    model = fits[fits["scope"] == "model"].iloc[0]
    high, low = rows.loc["pooled_vertex_observed_high"], rows.loc["pooled_vertex_observed_low"]
    assert high["claim"] == OBSERVED_CLAIMS["model"] and high["threshold"] == pytest.approx(model["alpha_q95"])
    assert high["verdict"] == "contradicted" and low["verdict"] == "holds"
    assert low["threshold"] == pytest.approx(model["alpha_q05"])
    assert high["estimate"] == rows.loc["pooled_vertex_below_1", "estimate"]
    assert (rows.loc[rows["claim"] == CONVEXITY, "source"] == "paper").all()
    # per head: every head's vertex is interior but outside its observed rates [q05, q95]. The range condition of
    # minimum_in_range was only ever asserted True, on a head whose vertex lay inside its range. The reference:
    # np.polyfit and np.quantile per head, written here
    heads = fits[fits["scope"] == "head"].set_index(["layer", "head"])
    for (layer, head), g in points.groupby(["layer", "head"]):
        c2, c1, _ = np.polyfit(g["alpha0"], g["norm"], 2)
        star = -c1 / (2 * c2)
        q05, q95 = np.quantile(g["alpha0"], [0.05, 0.95])
        assert heads.loc[(layer, head), "alpha_star"] == pytest.approx(star, rel=1e-6)
        assert c2 > 0 and 0 < star < 1 and not q05 <= star <= q95  # interior, not observed
        assert bool(heads.loc[(layer, head), "interior_minimum"])
        assert not bool(heads.loc[(layer, head), "minimum_in_range"]), (layer, head)
    assert rows.loc["share_interior", "estimate"] == pytest.approx(1.0)
    assert rows.loc["share_in_range", "estimate"] == pytest.approx(0.0)


# -- the direction control (registered with the confirmatory sample) -----------------------------


def test_the_random_direction_inner_products_match_a_naive_model_space_computation():
    """``u_s`` = <u_h, s_i> with u_h the registered unit vector of (layer, head) (``default_rng([seed,
    layer])``) and s_i = o_i - alpha_i0 v~_0 materialised in model space from the model's own run; the
    control's norm ||a ||v~_0|| u + s_i|| follows from it."""
    from cwcore.sinks.convexity import random_direction_norm

    model, ids = tiny_model("llama"), random_ids(n=3, length=10)
    out = sinks.run_analyses(model, None, ids, ["convexity"], raw=True, min_range=0.0, **FAST)
    points = out["raw"]["convexity"]["points"].sort_values(["layer", "sequence", "head", "query"])
    reference, _ = naive_run(model, ids)
    for layer, ref in enumerate(reference):
        o, v, a = ref["outputs"].double(), ref["values"].double(), ref["attention"].double()  # model space
        heads, width = o.shape[1], o.shape[-1]
        u = np.random.default_rng([0, layer]).standard_normal((heads, width))
        u = u / np.linalg.norm(u, axis=1, keepdims=True)
        semantic = o[:, :, 1:] - a[:, :, 1:, :1] * v[:, :, None, 0]  # [b, h, q, m]
        expected = np.einsum("bhqm,hm->bhq", semantic.numpy(), u)
        mine = points[points["layer"] == layer]
        got = mine.pivot_table(index=["sequence", "head"], columns="query", values="u_s").to_numpy()
        np.testing.assert_allclose(got, expected.reshape(-1, expected.shape[-1]), rtol=1e-4, atol=1e-5)
        direct = np.linalg.norm(a[:, :, 1:, 0, None].numpy() * np.linalg.norm(v[:, :, 0].numpy(), axis=-1)[:, :, None, None]
                                * u[None, :, None, :] + semantic.numpy(), axis=-1)
        np.testing.assert_allclose(random_direction_norm(mine).reshape(direct.shape), direct, rtol=1e-4, atol=1e-6)


def _synthetic_points(u_s_of, n_heads=8, n_seq=8, n_q=40, seed=0):
    """Heads whose real output norm |(1 - a) s - a s| has an interior minimum at a = 1/2 (an anti-parallel
    sink value of the tail's norm), with ``u_s = u_s_of(v0_s)``: the random direction's inner products."""
    rng = np.random.default_rng(seed)
    rows = []
    for layer in range(n_heads // 2):
        for head in range(2):
            for sequence in range(n_seq):
                a = rng.uniform(0.05, 0.95, n_q)
                s_sq = (1 - a) ** 2
                v0_s = -(1 - a)  # <v0, s_i> with v0 = -e, s_i = (1 - a) e
                norm = np.abs(1 - 2 * a) + rng.normal(0, 1e-3, n_q)
                rows.append(pd.DataFrame({"layer": layer, "head": head, "sequence": sequence, "query": np.arange(n_q),
                                          "alpha0": a, "norm": norm, "v0_sq": 1.0, "s_sq": s_sq, "v0_s": v0_s,
                                          "u_s": u_s_of(v0_s)}))
    return pd.concat(rows, ignore_index=True)


def test_the_direction_control_credits_the_direction_only_when_a_random_one_does_worse():
    from cwcore.sinks.convexity import _claim_rows, _convexity_tables

    # a random direction aligned with the tail (u = +e): the norm a + (1 - a) = 1 is flat, no minimum
    points = _synthetic_points(lambda v0_s: -v0_s)
    fits = _convexity_tables(points, 10, "norm", 0.05, 0.3).fits
    rows = pd.DataFrame(_claim_rows(fits, points, 0.3, 200, 0)).set_index("key")
    part = rows.loc["share_interior_minus_random_direction"]
    assert part["claim"] == "convexity [per head]" and part["verdict"] == "holds"
    assert part["estimate"] == pytest.approx(rows.loc["share_vertex_inside", "estimate"])
    # the control: the "random" direction is the sink's own, so the difference is 0 and the part cannot hold
    points = _synthetic_points(lambda v0_s: v0_s)
    fits = _convexity_tables(points, 10, "norm", 0.05, 0.3).fits
    rows = pd.DataFrame(_claim_rows(fits, points, 0.3, 200, 0)).set_index("key")
    assert rows.loc["share_interior_minus_random_direction", "estimate"] == pytest.approx(0.0)
    assert rows.loc["share_interior_minus_random_direction", "verdict"] != "holds"


def test_a_query_that_does_not_see_the_sink_is_not_counted_as_shortened():
    """In a sliding layer a query past the window does not see key 0 (alpha_i0 = 0), so its output is its
    sink-free part exactly. Before, ||o_i|| and ||s_i|| were computed apart and compared, so float rounding
    called half of those queries shortened (a layer's share 0.36-0.55 where it is 0.06-0.15). The reference:
    the flags from the dense decomposition in float64, a query that does not see the sink not shortened. The
    control: the layer has such queries."""
    import torch

    import cwcore
    from cwcore.sinks.suppression import head_points

    model, ids = tiny_model("gemma3"), random_ids(n=3, length=12, seed=1)  # layer 0 slides over 4 keys
    d = cwcore.decompose(model, input_ids=ids)[0]
    alpha, values, w_o = d.attention.double(), d.geometry.values.double(), d.geometry.w_o.double()
    mixed = alpha @ values  # [b, h, q, d]
    semantic = mixed - alpha[..., :1] * values[:, :, None, 0]
    norm = [torch.einsum("bhqd,hmd->bhqm", x, w_o).norm(dim=-1) for x in (mixed, semantic)]
    unseen = alpha[..., 0] == 0
    assert int(unseen[:, :, 1:].sum()) > 20  # the control
    expected = ((norm[0] < norm[1]) & ~unseen)[:, :, 1:].double().mean((0, 2)).numpy()
    fits, _ = sinks.sink_convexity(model, None, ids, min_range=0.01, **FAST)
    got = fits[(fits["scope"] == "head") & (fits["layer"] == 0)].sort_values("head")["share_sink_suppresses"]
    np.testing.assert_allclose(got.to_numpy(), expected, atol=1e-12)
    from cwcore.sinks import engine

    parts, _ = engine.collect(model, None, ids, [engine.REGISTRY["convexity"].spec({"seed": 0})], progress=False)
    points = head_points(parts["convexity"]["points"])
    assert (points.loc[points["alpha0"] == 0, "raw"] == points.loc[points["alpha0"] == 0, "out"]).all()
