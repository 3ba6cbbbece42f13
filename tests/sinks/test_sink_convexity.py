"""Convexity of the output norm in the sink rate (cwcore.sinks.convexity)."""

import numpy as np
import pytest

from cwcore import sinks
from sink_fixtures import (FAST, P_TAIL, Q_SINK, T, V0, VT, expected_alpha, naive_run, planted_ids,
                           planted_model, random_ids)
from tiny_models import tiny_model


# -- 4. convexity ----------------------------------------------------------------------------------


def test_convexity_fit_recovers_the_planted_interior_minimum():
    model, ids = planted_model(), planted_ids()
    vt, v0 = np.array(VT), np.array(V0)
    a_star = vt @ (vt - v0) / ((vt - v0) @ (vt - v0))  # 0.4615...
    exact = sinks.convexity(model, None, ids, fit_on="squared_norm", **FAST)
    fits = exact.fits.set_index("scope").loc["head"].set_index("head")
    assert fits.loc[1, "alpha_star"] == pytest.approx(a_star, abs=1e-3)
    assert fits.loc[1, "curvature"] == pytest.approx((vt - v0) @ (vt - v0), rel=1e-3)  # ||vt - v0||^2
    assert fits.loc[1, "r2"] == pytest.approx(1.0, abs=1e-6)
    assert fits.loc[1, "two_vector_alpha_star"] == pytest.approx(a_star, abs=1e-4)
    assert fits.loc[1, "reference_alpha_star"] == pytest.approx(a_star, abs=0.005)
    assert bool(fits.loc[1, "interior_minimum"]) and bool(fits.loc[1, "minimum_in_range"])
    # on the norm itself (not exactly quadratic) the vertex is still close
    norm_fit = sinks.convexity(model, None, ids, **FAST).fits
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
    fits = sinks.convexity(model, None, ids, min_range=0.0, **FAST).fits
    reference, _ = naive_run(model, ids)
    heads = fits[fits["scope"] == "head"].set_index(["layer", "head"])
    for l, ref in enumerate(reference):
        a0 = ref["attention"][:, :, 1:, 0]
        norm = ref["outputs"][:, :, 1:].norm(dim=-1)
        for h in range(a0.shape[1]):
            c2, c1, c0 = np.polyfit(a0[:, h].reshape(-1).numpy(), norm[:, h].reshape(-1).numpy(), 2)
            assert heads.loc[(l, h), "curvature"] == pytest.approx(c2, rel=1e-3, abs=1e-6)
            assert heads.loc[(l, h), "alpha_star"] == pytest.approx(-c1 / (2 * c2), rel=1e-3, abs=1e-6)
