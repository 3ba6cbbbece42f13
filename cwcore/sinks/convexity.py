"""Analysis 4, convexity: the head output norm as a function of the sink rate (chapter 6)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from .engine import _COMMON, Analysis, Collector, _concat, _grid, _np, register, run_one
from .. import stats
from .intervals import claim_row, no_sink_heads, share_ci

__all__ = ["CONVEXITY", "SUPPRESSION", "ConvexityTables", "convexity", "pooled_suppression"]

#: the claims chapter 6 judges with this analysis
SUPPRESSION = "the sink suppresses the output norm"
CONVEXITY = "convexity"


class ConvexityTables(NamedTuple):
    """``fits``: one row per head (plus one pooled "model" row); ``curves``: binned norm against alpha_i0."""

    fits: pd.DataFrame
    curves: pd.DataFrame


class _ConvexityCollector(Collector):
    """Piece ``points``: per (sequence, layer, head, query >= 1) alpha_i0, ||o^h_i|| and the inner products
    ||v~_0||^2, ||s_i||^2, <v~_0, s_i> from which the two-vector reference is built."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows = []

    def on_layer(self, s):
        b, h, T, _ = s.probs.shape
        cols = _grid((b, h, T - 1), ("sequence", "head", "query"), {"sequence": self.start, "query": 1})
        self.rows.append(pd.DataFrame({
            "layer": np.full(b * h * (T - 1), s.layer, np.int32), **cols,
            "alpha0": _np(s.probs[:, :, 1:, 0]), "norm": _np(s.output_norm[..., 1:]),
            "v0_sq": np.repeat(_np(s.value_norm[..., 0] ** 2), T - 1), "s_sq": _np(s.semantic_norm[..., 1:] ** 2),
            "v0_s": _np(s.sink_inner(s.semantic)[..., 1:]),
        }))

    def finish(self, logits):
        return {"points": _concat(self.rows)}


def convexity(
    model,
    tokenizer,
    data,
    *,
    bins: int = 10,
    fit_on: str = "norm",
    min_range: float = 0.05,
    eps: float = 0.3,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> ConvexityTables:
    """Head output norm ||o^h_i|| as a function of the sink rate a_i = alpha^h_i0, over queries i >= 1.

    Every head output is a two-vector mixture o_i = a_i v~_0 + (1 - a_i) s^_i with s^_i = s_i / (1 - a_i)
    the normalised semantic component (a convex combination of the tail values).

    ``fits``: per (layer, head) a least-squares quadratic y = c2 a^2 + c1 a + c0 through the points
    (a_i, y_i), y = ||o^h_i|| (``fit_on="norm"``) or ||o^h_i||^2 (``"squared_norm"``, exactly quadratic in
    a for a fixed pair v~_0, s^). Columns: ``sink_rate``, ``is_sink_head``, ``n``, ``alpha_q05``/``alpha_q95``
    (the range of a the fit sees), ``curvature`` (= c2; the second derivative is 2 c2), ``linear``,
    ``constant``, ``alpha_star`` (= -c1 / 2 c2, the vertex), ``interior_minimum`` (c2 > 0 and
    0 < alpha_star < 1), ``minimum_in_range`` (also alpha_q05 <= alpha_star <= alpha_q95: the minimum is
    observed, not extrapolated), ``r2``, ``two_vector_alpha_star`` (median over queries of the analytic
    minimiser of ||a v~_0 + (1 - a) s^_i||, <s^, s^ - v~_0> / ||s^ - v~_0||^2), ``reference_alpha_star``
    (argmin over a 201-point grid of the averaged reference curve below), ``share_sink_suppresses`` (share
    of queries whose output is shorter than its semantic component, ||o_i|| < ||s_i||: the sink term
    interferes destructively) and ``median_norm_over_semantic`` (median ||o_i|| / ||s_i||). Heads whose a spans less than
    ``min_range`` (q95 - q05) are not fitted (NaN, ``fitted`` False). Two rows fit the pooled points of
    all heads, made dimensionless: "model" divides each head's vectors by that head's mean output norm,
    "model_v0" divides each point's vectors by its ||v~_0|| (so y = 1 at a = 1).

    ``curves``: per (scope, layer, head, bin) of a in ``bins`` equal bins on [0, 1]: ``n``, ``alpha_mean``,
    ``norm_mean``, ``norm_median``, ``fitted`` (the quadratic at the bin centre, in the fitted y's
    units: ||o|| or ||o||^2), and ``reference_norm``: the mean over *all* the head's queries of
    ||c v~_0 + (1 - c) s^_i|| at the bin centre c, i.e. what the norm would be if only the sink rate
    changed. "model" and "model_v0" rows pool the heads, normalised as in ``fits``.
    """
    if fit_on not in ("norm", "squared_norm"):
        raise ValueError(f"fit_on must be 'norm' or 'squared_norm', not {fit_on!r}")
    del seed
    common = {k: v for k, v in locals().items() if k in _COMMON}
    options = dict(bins=bins, fit_on=fit_on, min_range=min_range, eps=eps)
    return run_one("convexity", model, tokenizer, data, options, common)


def _reference_norm(a: np.ndarray, c: np.ndarray | float, v0_sq, s_sq, v0_s) -> np.ndarray:
    """||c v~_0 + (1 - c) s^|| with s^ = s / (1 - a), from the stored inner products (broadcasts)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (1 - c) / (1 - a)  # coefficient of s
        sq = c**2 * v0_sq + 2 * c * k * v0_s + k**2 * s_sq
    return np.sqrt(np.clip(sq, 0, None))


def _mean_reference(a, grid, v0_sq, s_sq, v0_s, chunk: int = 4_000_000) -> np.ndarray:
    """Mean over points of :func:`_reference_norm` at every ``grid`` value ``[len(grid)]`` (NaN: no point)."""
    if len(a) == 0:
        return np.full(len(grid), np.nan)
    step = max(1, chunk // len(grid))
    total, count = np.zeros(len(grid)), np.zeros(len(grid))
    for i in range(0, len(a), step):
        part = slice(i, i + step)
        values = _reference_norm(a[part, None], grid[None, :], v0_sq[part, None], s_sq[part, None], v0_s[part, None])
        finite = np.isfinite(values)
        total += np.where(finite, values, 0).sum(0)
        count += finite.sum(0)
    with np.errstate(invalid="ignore"):
        return total / count


def _quadratic_fit(a: np.ndarray, y: np.ndarray, min_range: float) -> dict:
    ok = np.isfinite(a) & np.isfinite(y)
    a, y = a[ok], y[ok]
    out = {"n": int(len(a)), "alpha_q05": np.nan, "alpha_q95": np.nan, "fitted": False, "curvature": np.nan,
           "linear": np.nan, "constant": np.nan, "alpha_star": np.nan, "r2": np.nan}
    if len(a) < 3:
        return out
    out["alpha_q05"], out["alpha_q95"] = np.quantile(a, [0.05, 0.95])
    if out["alpha_q95"] - out["alpha_q05"] < min_range:
        return out
    c2, c1, c0 = np.polyfit(a, y, 2)
    residual = y - np.polyval([c2, c1, c0], a)
    total = ((y - y.mean()) ** 2).sum()
    out.update(fitted=True, curvature=c2, linear=c1, constant=c0,
               alpha_star=-c1 / (2 * c2) if c2 != 0 else np.nan,
               r2=1 - (residual**2).sum() / total if total > 0 else np.nan)
    return out


def _convexity_tables(points: pd.DataFrame, bins: int, fit_on: str, min_range: float, eps: float) -> ConvexityTables:
    edges = np.linspace(0, 1, bins + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    grid = np.linspace(0, 1, 201)
    fits, curves = [], []
    groups = [(("head", layer, head), frame, None) for (layer, head), frame in points.groupby(["layer", "head"])]
    # pooled over heads, made dimensionless per head (by its mean output norm) or per point (by ||v~_0||)
    groups.append((("model", pd.NA, pd.NA), points, points.groupby(["layer", "head"])["norm"].transform("mean")))
    groups.append((("model_v0", pd.NA, pd.NA), points, np.sqrt(points["v0_sq"].clip(lower=0))))
    for (scope, layer, head), frame, scale in groups:
        a = frame["alpha0"].to_numpy(float)
        v0_sq, s_sq, v0_s = (frame[c].to_numpy(float) for c in ("v0_sq", "s_sq", "v0_s"))
        norm = frame["norm"].to_numpy(float)
        if scale is not None:  # divide every vector by the scale
            scale = scale.to_numpy(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                norm, v0_s, s_sq, v0_sq = norm / scale, v0_s / scale**2, s_sq / scale**2, v0_sq / scale**2
        y = norm if fit_on == "norm" else norm**2
        fit = _quadratic_fit(a, y, min_range)
        with np.errstate(divide="ignore", invalid="ignore"):
            s_hat_sq = s_sq / (1 - a) ** 2
            s_hat_v0 = v0_s / (1 - a)
            gap = s_hat_sq - 2 * s_hat_v0 + v0_sq  # ||s^ - v0||^2
            two_vector = (s_hat_sq - s_hat_v0) / gap
        usable = a < 1 - 1e-6  # s^ undefined where all attention is on the sink
        curve = _mean_reference(a[usable], np.concatenate([grid, centres]), v0_sq[usable], s_sq[usable], v0_s[usable])
        reference, at_centres = curve[: len(grid)], curve[len(grid):]
        with np.errstate(divide="ignore", invalid="ignore"):
            to_semantic = norm / np.sqrt(np.clip(s_sq, 0, None))  # ||o_i|| / ||s_i|| (scale-free)
        fits.append({"scope": scope, "layer": layer, "head": head, "sink_rate": a.mean(), **fit,
                     "share_sink_suppresses": float(np.mean(to_semantic[np.isfinite(to_semantic)] < 1)),
                     "median_norm_over_semantic": float(np.nanmedian(to_semantic)),
                     "two_vector_alpha_star": float(np.nanmedian(two_vector[usable])) if usable.any() else np.nan,
                     "reference_alpha_star": float(grid[np.nanargmin(reference)]) if np.isfinite(reference).any() else np.nan})
        which = np.clip(np.digitize(a, edges[1:-1]), 0, bins - 1)
        for k in range(bins):
            inside = which == k
            curves.append({
                "scope": scope, "layer": layer, "head": head, "bin": k, "bin_low": edges[k], "bin_high": edges[k + 1],
                "bin_centre": centres[k], "n": int(inside.sum()),
                "alpha_mean": a[inside].mean() if inside.any() else np.nan,
                "norm_mean": norm[inside].mean() if inside.any() else np.nan,
                "norm_median": float(np.median(norm[inside])) if inside.any() else np.nan,
                "fitted": np.polyval([fit["curvature"], fit["linear"], fit["constant"]], centres[k]) if fit["fitted"] else np.nan,
                "reference_norm": at_centres[k],
            })
    fits = pd.DataFrame(fits)
    fits["is_sink_head"] = fits["sink_rate"] > eps
    fits["interior_minimum"] = fits["fitted"] & (fits["curvature"] > 0) & (fits["alpha_star"] > 0) & (fits["alpha_star"] < 1)
    fits["minimum_in_range"] = fits["interior_minimum"] & (fits["alpha_star"] >= fits["alpha_q05"]) & (
        fits["alpha_star"] <= fits["alpha_q95"])
    fits["fit_on"] = fit_on
    curves = pd.DataFrame(curves)
    for table in (fits, curves):
        for col in ("layer", "head"):
            table[col] = table[col].astype("Int64")
    columns = ["scope", "layer", "head", "sink_rate", "is_sink_head", "n", "alpha_q05", "alpha_q95", "fitted", "fit_on",
               "curvature", "linear", "constant", "alpha_star", "interior_minimum", "minimum_in_range", "r2",
               "two_vector_alpha_star", "reference_alpha_star", "share_sink_suppresses", "median_norm_over_semantic"]
    return ConvexityTables(fits[columns], curves)


def _tables(parts: dict, blocks, *, bins: int, fit_on: str, min_range: float, eps: float, **_) -> ConvexityTables:
    return _convexity_tables(parts["points"], bins, fit_on, min_range, eps)


def _summary(tables: dict, add) -> None:
    if "convexity" in tables:
        c = tables["convexity"]
        heads = c[c["scope"] == "head"]
        fitted = heads[heads["fitted"]]
        sink_fitted = fitted[fitted["is_sink_head"]]
        add("convexity", "num_heads_fitted", len(fitted))
        add("convexity", "share_fitted_heads_interior_minimum", fitted["interior_minimum"].mean())
        add("convexity", "share_fitted_heads_minimum_in_range", fitted["minimum_in_range"].mean())
        add("convexity", "share_fitted_heads_convex", (fitted["curvature"] > 0).mean())
        add("convexity", "num_sink_heads_fitted", len(sink_fitted))
        add("convexity", "share_sink_heads_interior_minimum",
            sink_fitted["interior_minimum"].mean() if len(sink_fitted) else np.nan)
        add("convexity", "share_sink_heads_minimum_in_range",
            sink_fitted["minimum_in_range"].mean() if len(sink_fitted) else np.nan)
        head_sink = heads[heads["is_sink_head"]]
        add("anti_alignment", "median_share_sink_suppresses_norm_sink_heads",
            head_sink["share_sink_suppresses"].median() if len(head_sink) else np.nan)
        add("anti_alignment", "share_sink_heads_mostly_suppressed",
            (head_sink["share_sink_suppresses"] > 0.5).mean() if len(head_sink) else np.nan)
        add("anti_alignment", "median_norm_over_semantic_sink_heads",
            head_sink["median_norm_over_semantic"].median() if len(head_sink) else np.nan)
        add("convexity", "median_r2_fitted", fitted["r2"].median())
        add("convexity", "median_r2_sink_heads", sink_fitted["r2"].median() if len(sink_fitted) else np.nan)
        add("convexity", "share_sink_heads_convex", (sink_fitted["curvature"] > 0).mean() if len(sink_fitted) else np.nan)
        add("convexity", "median_alpha_star_interior",
            fitted.loc[fitted["interior_minimum"], "alpha_star"].median())
        add("convexity", "median_two_vector_alpha_star", heads["two_vector_alpha_star"].median())
        add("convexity", "median_reference_alpha_star", heads["reference_alpha_star"].median())
        for scope, name in (("model", "pooled"), ("model_v0", "pooled_v0")):
            m = c[c["scope"] == scope]
            if len(m):
                add("convexity", f"{name}_curvature", m["curvature"].iloc[0])
                add("convexity", f"{name}_alpha_star", m["alpha_star"].iloc[0])


def pooled_suppression(fits: pd.DataFrame, points: pd.DataFrame, eps: float = 0.3, n_bootstrap: int = 1000,
                       seed: int = 0) -> tuple[float, float, float]:
    """The share of sink-head queries whose output is shorter than its semantic part, ``||o_i|| < ||s_i||``,
    pooled over sequences, with a bootstrap over sequences: ``(share, low, high)``.

    ``fits``: the convexity ``fits`` table (head rows give each head's sink rate); ``points``: the
    convexity raw points (``run_analyses(..., raw=True)["raw"]["convexity"]["points"]``).
    """
    rate = fits[fits["scope"] == "head"].set_index(["layer", "head"])["sink_rate"]
    in_sink = rate.reindex(pd.MultiIndex.from_frame(points[["layer", "head"]])).to_numpy() > eps
    with np.errstate(invalid="ignore"):
        shortened = (points["norm"] < np.sqrt(points["s_sq"].clip(lower=0))).astype(float)
    shortened = shortened.where(points["s_sq"] > 0)  # s_i = 0: undefined
    if not in_sink.any():
        return (np.nan, np.nan, np.nan)
    chosen = points.assign(shortened=shortened)[in_sink]
    boot = stats.cluster_bootstrap(chosen, ["shortened"], cluster="sequence", n_resamples=n_bootstrap, seed=seed)
    return tuple(float(x) for x in boot.interval(0, "shortened"))


def _claim_rows(fits: pd.DataFrame, points: pd.DataFrame, eps: float = 0.3, n_bootstrap: int = 1000,
                seed: int = 0) -> list[dict]:
    """Suppression (pooled share of shortened sink-head outputs above 0.5, bootstrap over sequences) and
    convexity (shares of fitted heads with an interior minimum, and with it inside the observed range,
    above 0.5, Wilson)."""
    head_fits = fits[fits["scope"] == "head"]
    fitted = head_fits[head_fits["fitted"].astype(bool)]
    no_sinks = no_sink_heads(eps) if not bool((head_fits["sink_rate"] > eps).any()) else ""
    unfitted = f"no head's sink rates span min_range (none of {len(head_fits)} fitted)"
    return [
        claim_row(6, SUPPRESSION, "sink term shortens most outputs", "share of sink-head queries with ‖oᵢ‖ < ‖sᵢ‖",
                  "shortened", pooled_suppression(fits, points, eps, n_bootstrap, seed), 0.5, "above", why=no_sinks),
        claim_row(6, CONVEXITY, "convex with an interior minimum", "share of fitted heads with 0 < α* < 1, c₂ > 0",
                  "share_interior", share_ci(fitted["interior_minimum"]), 0.5, "above", len(fitted), unfitted),
        claim_row(6, CONVEXITY, "the minimum is observed", "share of fitted heads with α* in [q05, q95]",
                  "share_in_range", share_ci(fitted["minimum_in_range"]), 0.5, "above", len(fitted), unfitted),
    ]


def _claims(results, *, eps: float, n_bootstrap: int, seed: int, **_) -> list[dict]:
    return _claim_rows(results["convexity"].fits, results["raw"]["convexity"]["points"], eps, n_bootstrap, seed)


ANALYSIS = register(Analysis("convexity", _ConvexityCollector, _tables, stems=("convexity", "convexity-curves"),
                             summary=_summary, claims=_claims))
