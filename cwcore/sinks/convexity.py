"""Analysis 4, convexity: the head output norm as a function of the sink rate (chapter 6)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from .engine import EPS, SEED, Analysis, Collector, Option, concat, count, flat, grid_columns, non_negative, register
from .. import stats
from ..core.architectures import attention_blocks
from .intervals import claim_row
from .suppression import block_points, post_attention_norms, suppression_claim_rows

__all__ = ["CONVEXITY", "CONVEXITY_V0", "OBSERVED_CLAIMS", "SUPPRESSION", "ConvexityTables", "sink_convexity", "vertex_intervals"]

BINS = Option("bins", 10, "equal-width bins of the sink rate in the convexity curves", count("bins"))
FIT_ON = Option("fit_on", "norm", "the convexity fits' y: the output norm or its square", choices=("norm", "squared_norm"))
MIN_RANGE = Option("min_range", 0.05, "heads whose sink rates span less (q95 - q05) are not fitted",
                   non_negative("min_range"))

#: the claims chapter 6 judges with this analysis
SUPPRESSION = "the sink suppresses the output norm"
CONVEXITY = "convexity"
#: the pooled fit with each point's norm divided by ||v~_0|| (the second scaling, shown beside the first)
CONVEXITY_V0 = f"{CONVEXITY} [pooled, norms over ‖ṽ₀‖]"
#: per pooled scaling, the claim that its vertex is *observed* (inside the pooled sink rates' q05..q95),
#: beside the claim that it is *established* by its interval (which may extrapolate)
OBSERVED_CLAIMS = {"model": f"{CONVEXITY} [pooled minimum observed]",
                   "model_v0": f"{CONVEXITY} [pooled, norms over ‖ṽ₀‖, minimum observed]"}


class ConvexityTables(NamedTuple):
    """``fits``: one row per head (plus one pooled "model" row); ``curves``: binned norm against alpha_i0."""

    fits: pd.DataFrame
    curves: pd.DataFrame


class _ConvexityCollector(Collector):
    """Pieces ``points`` (per sequence, layer, head, query >= 1: alpha_i0, ||o^h_i||, ||v~_0||^2, ||s_i||^2,
    <v~_0, s_i>) and ``block`` (:func:`cwcore.sinks.suppression.block_points`)."""

    def __init__(self, *args, seed: int = 0, **options):
        super().__init__(*args, **options)
        self.seed = seed
        self.rows, self.block, self.layers = [], [], []
        self.blocks = {b.layer: b for b in attention_blocks(self.model)}
        self.norms = post_attention_norms(self.model, self.ids)

    def on_layer(self, s):
        b, h, T, _ = s.probs.shape
        p = s.sink_position
        cols = grid_columns((b, h, T - 1), ("sequence", "head", "query"), {"sequence": self.start, "query": 1})
        self.rows.append(pd.DataFrame({
            "layer": np.full(b * h * (T - 1), s.layer, np.int32), **cols,
            "alpha0": flat(s.probs[:, :, 1:, p]), "norm": flat(s.output_norm[..., 1:]),
            "v0_sq": np.repeat(flat(s.value_norm[..., p] ** 2), T - 1), "s_sq": flat(s.semantic_norm[..., 1:] ** 2),
            "v0_s": flat(s.sink_inner(s.semantic)[..., 1:]),
            "u_s": flat(_random_direction_inner(s, self.seed)[..., 1:]),
        }))
        _, bias = self.blocks[s.layer].output_projection()
        self.block.append(block_points(s, self.start, self.norms.get(s.layer), bias, p))
        self.layers.append((s.layer, getattr(s, "layer_type", "global"), self.norms.get(s.layer) is not None))

    def finish(self, logits):
        layers = pd.DataFrame(self.layers, columns=["layer", "layer_type", "post_norm"])
        return {"points": concat(self.rows), "block": concat(self.block), "layers": layers}


def _random_direction_inner(s, seed: int) -> torch.Tensor:
    """<u_h, s_i> ``[b, h, q]`` for one unit vector u_h per (layer, head) of model space, drawn isotropically
    (numpy's ``default_rng([seed, layer])``, one row per head): the direction control's sink value is
    ||v~_0|| u_h, so its output is a_i ||v~_0|| u_h + s_i (:func:`random_direction_norm`)."""
    heads, width = s.w_o.shape[0], s.w_o.shape[1]
    u = np.random.default_rng([seed, s.layer]).standard_normal((heads, width))
    u = torch.as_tensor(u / np.linalg.norm(u, axis=1, keepdims=True), dtype=s.w_o.dtype, device=s.w_o.device)
    w = torch.einsum("hm,hmd->hd", u, s.w_o)  # W_O^h^T u_h: <u_h, W_O^h z> = w_h . z
    return (s.semantic * w[None, :, None, :]).sum(-1)


def random_direction_norm(points: pd.DataFrame) -> np.ndarray:
    """||a_i ||v~_0|| u + s_i|| per point: the head output with the sink's value replaced by a vector of the
    same norm in a random direction (the convexity claim's direction control; ``u_s`` = <u, s_i>)."""
    a = points["alpha0"].to_numpy(float)
    v0 = np.sqrt(points["v0_sq"].clip(lower=0).to_numpy(float))
    squared = a**2 * v0**2 + 2 * a * v0 * points["u_s"].to_numpy(float) + points["s_sq"].to_numpy(float)
    return np.sqrt(np.clip(squared, 0, None))


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
        # a query that does not see the sink (alpha_i0 = 0: a sliding window) has o_i = s_i: 1, not the rounding
        # of two norms computed apart, which said "shortened" for half of them
        to_semantic = np.where(a == 0, 1.0, to_semantic)
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


def _fit_points(points: pd.DataFrame, scope: str) -> tuple[np.ndarray, np.ndarray]:
    """``(a, norm)`` of a fit scope, made dimensionless as in :func:`sink_convexity`'s pooled rows."""
    a, norm = points["alpha0"].to_numpy(float), points["norm"].to_numpy(float)
    if scope == "model":
        norm = norm / points.groupby(["layer", "head"])["norm"].transform("mean").to_numpy(float)
    elif scope == "model_v0":
        with np.errstate(divide="ignore", invalid="ignore"):
            norm = norm / np.sqrt(points["v0_sq"].clip(lower=0).to_numpy(float))
    return a, norm


def _solve_quadratics(moments: np.ndarray) -> np.ndarray:
    """Least-squares ``(c2, c1, c0)`` from moments ``[..., 8]`` = (sum a^0..a^4, sum y, a y, a^2 y)."""
    s0, s1, s2, s3, s4, t0, t1, t2 = np.moveaxis(moments, -1, 0)
    m = np.stack([np.stack([s4, s3, s2], -1), np.stack([s3, s2, s1], -1), np.stack([s2, s1, s0], -1)], -2)
    rhs = np.stack([t2, t1, t0], -1)
    out = np.full(rhs.shape, np.nan)
    ok = np.isfinite(m).all((-1, -2)) & (np.abs(np.linalg.det(m)) > 1e-12 * np.maximum(1, s0) ** 3)
    if ok.any():
        out[ok] = np.linalg.solve(m[ok], rhs[ok][..., None])[..., 0]
    return out


def _group_centre_scale(a: np.ndarray, code: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group ``[groups]``: the mean and the standard deviation (1 where it is 0 or undefined) of ``a``."""
    n = np.bincount(code, minlength=groups).astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        centre = np.bincount(code, weights=a, minlength=groups) / n
        spread = np.sqrt(np.bincount(code, weights=(a - centre[code]) ** 2, minlength=groups) / n)
    return np.nan_to_num(centre), np.where(np.isfinite(spread) & (spread > 0), spread, 1.0)


def vertex_intervals(points: pd.DataFrame, fits: pd.DataFrame, fit_on: str = "norm", n_resamples: int = 1000,
                     seed: int = 0) -> pd.DataFrame:
    """The quadratic fits of :func:`sink_convexity` refitted on resampled sequences: per fitted (scope,
    layer, head) ``alpha_star`` and ``curvature`` with ``_low``/``_high``, ``share_interior``,
    ``vertex_inside`` (an interior minimum established by both intervals) and ``n_sequences``. ``fit_on``: as
    the fits were made (their ``fit_on`` column), ``"norm"`` or ``"squared_norm"``."""
    if fit_on not in FIT_ON.choices:  # anything but "norm" read as the square before
        raise ValueError(f"fit_on must be one of {', '.join(map(repr, FIT_ON.choices))}, not {fit_on!r}")
    rows = []
    sequences, seq_index = np.unique(points["sequence"].to_numpy(), return_inverse=True)
    n_seq = len(sequences)
    idx = stats.resample_indices(n_seq, n_resamples, seed) if n_seq else np.zeros((n_resamples, 0), int)
    counts = np.stack([np.bincount(r, minlength=n_seq) for r in idx]).astype(float) if n_seq else idx.astype(float)
    fitted = fits[fits["fitted"].astype(bool)]
    for scope in ("head", "model", "model_v0"):
        wanted = fitted[fitted["scope"] == scope]
        if not len(wanted):
            continue
        a, y = _fit_points(points, scope)
        y = y if fit_on == "norm" else y**2
        if scope == "head":
            keys = pd.MultiIndex.from_frame(points[["layer", "head"]])
            chosen = pd.MultiIndex.from_arrays([wanted["layer"].astype(int), wanted["head"].astype(int)])
            code = chosen.get_indexer(keys)
            labels = list(zip(wanted["layer"].astype(int), wanted["head"].astype(int)))
        else:
            code = np.zeros(len(points), dtype=np.int64)
            labels = [(pd.NA, pd.NA)]
        ok = (code >= 0) & np.isfinite(a) & np.isfinite(y)
        g = len(labels)
        cell = code[ok] * n_seq + seq_index[ok]
        # each group's sink rates centred and scaled by the whole sample's (fixed over the resamples): raw powers of
        # rates that span 0.03 make normal equations too ill-conditioned to solve, however good the fit
        centre, scale = _group_centre_scale(a[ok], code[ok], g)
        u = (a[ok] - centre[code[ok]]) / scale[code[ok]]
        terms = [u**k for k in range(5)] + [y[ok] * u**k for k in range(3)]
        moments = np.stack([np.bincount(cell, weights=t, minlength=g * n_seq) for t in terms], -1).reshape(g, n_seq, 8)
        full = _solve_quadratics(moments.sum(1))  # [g, 3] in u
        reps = _solve_quadratics(np.einsum("rs,gsk->rgk", counts, moments))  # [R, g, 3] in u
        with np.errstate(divide="ignore", invalid="ignore"):  # back to a: c2 = c2' / s^2, a* = m - c1' s / (2 c2')
            star = centre - full[:, 1] * scale / (2 * full[:, 0])
            rep_star = centre - reps[..., 1] * scale / (2 * reps[..., 0])
        full_c2, rep_c2 = full[:, 0] / scale**2, reps[..., 0] / scale**2
        star_lo, star_hi = stats.percentile_interval(rep_star)
        c2_lo, c2_hi = stats.percentile_interval(rep_c2)
        interior = np.where(np.isfinite(rep_star), (rep_c2 > 0) & (rep_star > 0) & (rep_star < 1), np.nan)
        share = np.nanmean(interior, 0) if len(interior) else np.full(g, np.nan)
        per_group_seq = (moments[..., 0] > 0).sum(1)
        for k, (layer, head) in enumerate(labels):
            few = per_group_seq[k] < 2
            lo_hi = (np.nan, np.nan, np.nan, np.nan) if few else (star_lo[k], star_hi[k], c2_lo[k], c2_hi[k])
            rows.append({"scope": scope, "layer": layer, "head": head, "alpha_star": star[k],
                         "alpha_star_low": lo_hi[0], "alpha_star_high": lo_hi[1], "curvature": full_c2[k],
                         "curvature_low": lo_hi[2], "curvature_high": lo_hi[3], "share_interior": share[k],
                         "vertex_inside": bool(lo_hi[2] > 0 and lo_hi[0] > 0 and lo_hi[1] < 1),
                         "n_sequences": int(per_group_seq[k])})
    out = pd.DataFrame(rows, columns=["scope", "layer", "head", "alpha_star", "alpha_star_low", "alpha_star_high",
                                      "curvature", "curvature_low", "curvature_high", "share_interior",
                                      "vertex_inside", "n_sequences"])
    for col in ("layer", "head"):
        out[col] = out[col].astype("Int64")
    return out


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


def _layer_type_map(layers: pd.DataFrame | None) -> dict:
    if layers is None or not len(layers):
        return {}
    return dict(layers.drop_duplicates("layer")[["layer", "layer_type"]].itertuples(index=False, name=None))


def _pooled_rows(table: pd.DataFrame, column: str, *, claim: str, part: str, statistic_text: str, key: str,
                 why: str, n_resamples: int, seed: int) -> list[dict]:
    """A share over heads with the cluster bootstrap by layer (and per layer type):
    :func:`cwcore.sinks.intervals.pooled_claim_rows`."""
    from . import intervals

    return intervals.pooled_claim_rows(table, column, chapter=6, claim=claim, part=part, statistic_text=statistic_text,
                                       key=key, threshold=0.5, side="above", statistic="share", why=why,
                                       n_resamples=n_resamples, seed=seed)


def _claim_rows(fits: pd.DataFrame, points: pd.DataFrame, eps: float = EPS.default, n_resamples: int = 1000,
                seed: int = 0, block: pd.DataFrame | None = None, layers: pd.DataFrame | None = None,
                fit_on: str | None = None) -> list[dict]:
    """Suppression in both readings (:func:`cwcore.sinks.suppression.suppression_claim_rows`) and convexity by
    where the vertex lies: pooled (refits on resampled documents, :func:`vertex_intervals`) and per head
    (shares with an interior minimum, in range, established; cluster bootstrap by layer)."""
    fit_on = _fitted_on(fits) if fit_on is None else fit_on
    rows = suppression_claim_rows(fits, points, block, eps, n_resamples, seed, layer_types=_layer_type_map(layers))
    head_fits = fits[fits["scope"] == "head"]
    fitted = head_fits[head_fits["fitted"].astype(bool)].copy()
    unfitted = f"no head's sink rates span min_range (none of {len(head_fits)} fitted)"
    vertices = vertex_intervals(points, fits, fit_on, n_resamples, seed)
    for scope, claim, what in (("model", CONVEXITY, "pooled fit (each head's norms over its mean)"),
                               ("model_v0", CONVEXITY_V0, "pooled fit (norms over ‖ṽ₀‖)")):
        if not (fits["scope"] == scope).any():
            continue  # a fits table without pooled rows (built by hand): nothing to judge, no row
        v = vertices[vertices["scope"] == scope]
        triple_c = tuple(v[["curvature", "curvature_low", "curvature_high"]].iloc[0]) if len(v) else (np.nan,) * 3
        triple_a = tuple(v[["alpha_star", "alpha_star_low", "alpha_star_high"]].iloc[0]) if len(v) else (np.nan,) * 3
        n = int(v["n_sequences"].iloc[0]) if len(v) else 0
        why = "" if len(v) else "the pooled sink rates do not span min_range"
        vertex_why = why
        if len(v) and not triple_c[0] > 0:  # a concave fit's vertex is its maximum: no minimum to locate
            triple_a, vertex_why = (np.nan,) * 3, "the pooled fit is concave: its vertex is a maximum"
        tag = "" if scope == "model" else "_v0"
        rows += [
            claim_row(6, claim, f"{what}: convex", "curvature c₂ of the pooled quadratic", f"pooled_curvature{tag}",
                      triple_c, 0.0, "above", n, why, unit="document", n_units=n),
            claim_row(6, claim, f"{what}: vertex at a positive sink rate", "vertex α* of the pooled fit",
                      f"pooled_vertex_above_0{tag}", triple_a, 0.0, "above", n, vertex_why, unit="document", n_units=n),
            claim_row(6, claim, f"{what}: vertex below α = 1", "vertex α* of the pooled fit",
                      f"pooled_vertex_below_1{tag}", triple_a, 1.0, "below", n, vertex_why, unit="document", n_units=n),
        ]
        # "established" (above) may rest on an extrapolation; "observed": the vertex also lies inside the sink
        # rates the pooled points cover (their 5th to 95th percentile), beside it as its own claim
        pooled_fit = fits[fits["scope"] == scope].iloc[0]
        q05, q95 = float(pooled_fit["alpha_q05"]), float(pooled_fit["alpha_q95"])
        observed = OBSERVED_CLAIMS[scope]
        range_why = vertex_why or ("" if np.isfinite(q05) and np.isfinite(q95) else "too few pooled points")
        rows += [
            claim_row(6, observed, f"{what}: vertex above the lowest observed sink rates (q05)",
                      "vertex α* of the pooled fit against q05 of the pooled sink rates",
                      f"pooled_vertex_observed_low{tag}", triple_a if np.isfinite(q05) else (np.nan,) * 3, q05, "above", n,
                      range_why, unit="document", n_units=n),
            claim_row(6, observed, f"{what}: vertex below the highest observed sink rates (q95)",
                      "vertex α* of the pooled fit against q95 of the pooled sink rates",
                      f"pooled_vertex_observed_high{tag}", triple_a if np.isfinite(q95) else (np.nan,) * 3, q95, "below", n,
                      range_why, unit="document", n_units=n),
        ]
    types = _layer_type_map(layers)
    head_v = vertices[vertices["scope"] == "head"][["layer", "head", "vertex_inside"]]
    fitted = fitted.merge(head_v, on=["layer", "head"], how="left")
    fitted["layer_type"] = [types.get(int(layer), "global") for layer in fitted["layer"]]
    per_head = f"{CONVEXITY} [per head]"
    boot = dict(n_resamples=n_resamples, seed=seed, why=unfitted)
    rows += _pooled_rows(fitted, "interior_minimum", claim=per_head, part="convex with an interior minimum",
                         statistic_text="share of fitted heads with 0 < α* < 1, c₂ > 0", key="share_interior", **boot)
    rows += _pooled_rows(fitted, "minimum_in_range", claim=per_head, part="the minimum is observed",
                         statistic_text="share of fitted heads with α* in [q05, q95]", key="share_in_range", **boot)
    rows += _pooled_rows(fitted, "vertex_inside", claim=per_head, part="the interior minimum is established",
                         statistic_text="share of fitted heads whose α* interval lies in (0, 1), c₂ interval > 0",
                         key="share_vertex_inside", **boot)
    rows.append(_direction_control(points, fits, fitted, fit_on, n_resamples, seed, unfitted, per_head))
    return rows


def _direction_control(points: pd.DataFrame, fits: pd.DataFrame, fitted: pd.DataFrame, fit_on: str,
                       n_resamples: int, seed: int, unfitted: str, claim: str) -> dict:
    """The convexity claim's direction control: per fitted head, an established interior minimum with the
    real sink value minus one with a same-norm value of random direction (:func:`random_direction_norm`),
    averaged over heads; only a positive difference credits the direction."""
    key, part = "share_interior_minus_random_direction", "more interior minima than a random-direction sink value"
    text = ("share of fitted heads whose interior minimum is established, minus the same with the sink value "
            "replaced by a same-norm vector of random direction (bootstrap over heads)")
    if "u_s" not in points or not len(fitted):
        why = "the points hold no random-direction inner products" if len(fitted) else unfitted
        return claim_row(6, claim, part, text, key, (np.nan,) * 3, 0.0, "above", 0, why, unit="head", n_units=0)
    control = vertex_intervals(points.assign(norm=random_direction_norm(points)), fits, fit_on, n_resamples, seed)
    control = control[control["scope"] == "head"][["layer", "head", "vertex_inside"]]
    paired = fitted.merge(control, on=["layer", "head"], how="left", suffixes=("", "_random"))
    random_inside = paired["vertex_inside_random"].astype(object).fillna(False).astype(float)
    difference = paired["vertex_inside"].astype(float) - random_inside
    ci = stats.bootstrap_ci(difference.to_numpy(), np.mean, n_resamples=n_resamples, seed=seed)
    return claim_row(6, claim, part, text, key, (ci.estimate, ci.low, ci.high), 0.0, "above", len(paired), "",
                     unit="head", n_units=len(paired))


def _claims(results, *, eps: float, n_resamples: int, seed: int, **_) -> list[dict]:
    raw, fits = results["raw"]["convexity"], results["convexity"].fits
    return _claim_rows(fits, raw["points"], eps, n_resamples, seed, raw.get("block"), raw.get("layers"))


def _fitted_on(fits: pd.DataFrame) -> str:
    """The ``fit_on`` the fits were made with (their column; "norm" for a table without it). The claims refit
    on resampled documents: refitted on another y, their vertices were not the fits'."""
    used = fits["fit_on"].dropna().unique() if "fit_on" in fits else []
    if len(used) > 1:
        raise ValueError(f"the fits mix fit_on values {sorted(used)}: refit them with one")
    return str(used[0]) if len(used) else FIT_ON.default


ANALYSIS = register(Analysis("convexity", _ConvexityCollector, _tables, stems=("convexity", "convexity-curves"),
                             collector_options=("seed",), summary=_summary, claims=_claims,
                             options=(BINS, FIT_ON, MIN_RANGE, EPS, SEED)))


@ANALYSIS.public
def sink_convexity(model, tokenizer, data, **options) -> ConvexityTables:
    """Head output norm ||o^h_i|| as a function of the sink rate a_i = alpha^h_i0, over queries i >= 1.

    Every output is o_i = a_i v~_0 + (1 - a_i) s^_i with s^_i = s_i / (1 - a_i).

    ``fits``: per (layer, head) a least-squares quadratic y = c2 a^2 + c1 a + c0 of y = ||o^h_i||
    (``fit_on="norm"``) or its square: ``sink_rate``, ``is_sink_head``, ``n``, ``alpha_q05``/``alpha_q95``,
    ``curvature`` (c2), ``linear``, ``constant``, ``alpha_star`` (the vertex -c1 / 2 c2),
    ``interior_minimum``, ``minimum_in_range``, ``r2``, ``two_vector_alpha_star`` (median analytic
    minimiser), ``reference_alpha_star``, ``share_sink_suppresses`` (share with ||o_i|| < ||s_i||) and
    ``median_norm_over_semantic``; heads whose a spans less than ``min_range`` are not fitted. Pooled rows
    "model" (vectors over each head's mean output norm) and "model_v0" (over each point's ||v~_0||).

    ``curves``: per (scope, layer, head, bin of a): ``n``, ``alpha_mean``, ``norm_mean``, ``norm_median``,
    ``fitted`` and ``reference_norm`` (mean ||c v~_0 + (1 - c) s^_i|| at the bin centre c).

    Options: ``bins``, ``fit_on``, ``min_range``, ``eps`` and the run options (:class:`cwcore.sinks.SinkOptions`)."""

