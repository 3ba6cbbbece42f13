"""The sink chapters' claims, each part judged by one rule: its 95% interval against a threshold.

Chapters 5-7 of the book and the findings page (chapter 9) call these functions with the results of
:func:`cwcore.sinks.run_analyses` (``raw=True``), so a claim gets the same verdict wherever it is shown.
Every function returns a claims table, one row per part of a claim:

``chapter, claim, part, statistic, key, estimate, low, high, threshold, side, n, verdict``

``estimate`` is the statistic, ``[low, high]`` its 95% interval (Wilson for shares of heads, a
percentile bootstrap otherwise: over heads for medians and rank correlations, over whole sequences for
pooled means), and ``verdict`` is :func:`cwcore.sinks.verdict` of that interval against ``threshold``
on the claimed ``side``. :func:`claim_verdicts` combines the parts of each claim
(:func:`cwcore.sinks.combine_verdicts`). ``key`` names a part for code (e.g. ``"cos_semantic"``);
:func:`triple` reads ``(estimate, low, high)`` by key.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np
import pandas as pd

from .sinks import (SequenceBootstrap, bootstrap_ci, combine_verdicts, cone_points, sequence_bootstrap,
                    share_ci, spearman_ci, verdict)

__all__ = ["COLUMNS", "decomposition_claims", "suppressor_claims", "cone_claims", "all_claims",
           "claim_verdicts", "triple", "display", "head_shares", "pooled_suppression", "contrast",
           "perplexity_changes", "PerplexityChanges"]

COLUMNS = ["chapter", "claim", "part", "statistic", "key", "estimate", "low", "high", "threshold", "side", "n",
           "verdict"]

# the claims, by the chapter that judges them (their names are the keys of claim_verdicts)
DECOMPOSITION = "sink driven by value geometry, tail by attention"
ANTI_ALIGNMENT = "anti-alignment"
TREND = "stronger sink, stronger anti-alignment"
SUPPRESSION = "the sink suppresses the output norm"
CONVEXITY = "convexity"
CONE = "low-norm outputs collapse into the cone"
PERPLEXITY = "removing the sink raises perplexity"


def _row(chapter, claim, part, statistic, key, triple_, threshold, side, n=np.nan) -> dict:
    est, low, high = (float(x) for x in triple_)
    return {"chapter": chapter, "claim": claim, "part": part, "statistic": statistic, "key": key, "estimate": est,
            "low": low, "high": high, "threshold": float(threshold), "side": side, "n": n,
            "verdict": verdict(low, high, threshold=threshold, side=side)}


def _frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=COLUMNS)


def triple(claims: pd.DataFrame, key: str) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of the part named ``key`` (NaNs if absent)."""
    row = claims[claims["key"] == key]
    if not len(row):
        return (np.nan, np.nan, np.nan)
    return tuple(float(row[c].iloc[0]) for c in ("estimate", "low", "high"))


def claim_verdicts(claims: pd.DataFrame) -> pd.Series:
    """One verdict per claim (in table order): every part holds -> "holds", some -> "holds partly", ..."""
    return claims.groupby("claim", sort=False)["verdict"].apply(combine_verdicts)


def display(claims: pd.DataFrame, digits: int = 2) -> pd.DataFrame:
    """The table as the chapters show it: interval and rule as text."""
    fmt = f"{{:.{digits}f}}"
    return pd.DataFrame({
        "claim": claims["claim"], "part": claims["part"], "statistic": claims["statistic"],
        "estimate": claims["estimate"],
        "95% interval": [f"{fmt.format(lo)} to {fmt.format(hi)}" for lo, hi in zip(claims["low"], claims["high"])],
        "holds if the interval is": [f"{'<' if s == 'below' else '>'} {t:g}"
                                     for s, t in zip(claims["side"], claims["threshold"])],
        "verdict": claims["verdict"],
    })


# ---------------------------------------------------------------------------------------------------
# chapter 5: what drives the sink's contribution
# ---------------------------------------------------------------------------------------------------
def head_shares(rates: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, head, token class): the share of var(log|c|) of each factor, ``geometry`` (relative
    norm + cosine) and the head's ``sink_rate``; heads with an undefined share are left out.

    ``rates``: :func:`cwcore.sinks.sink_rates`' table; ``summary``: the decomposition's ``summary``.
    """
    heads = (summary[summary["scope"] == "head"]
             .pivot_table(index=["layer", "head", "token_class"], columns="factor", values="share")
             .reset_index())
    rate = rates.set_index(["layer", "head"])["sink_rate"]
    heads["sink_rate"] = rate.reindex(pd.MultiIndex.from_frame(heads[["layer", "head"]])).to_numpy()
    heads["geometry"] = heads["relative_norm"] + heads["cosine"]
    return heads[np.isfinite(heads["geometry"]) & np.isfinite(heads["alpha"])].reset_index(drop=True)


def decomposition_claims(rates: pd.DataFrame, summary: pd.DataFrame, eps: float = 0.3) -> pd.DataFrame:
    """Chapter 5: in sink heads (sink rate > ``eps``), the geometry (relative norm + cosine) explains more
    of the sink's var(log|c|) than attention does in more than half of the heads, and attention more of
    the tail's in more than half (shares of heads with Wilson intervals, threshold 0.5)."""
    heads = head_shares(rates, summary)
    in_sink = heads[heads["sink_rate"] > eps]
    sink = in_sink[in_sink["token_class"] == "sink"]
    tail = in_sink[in_sink["token_class"] == "tail"]
    return _frame([
        _row(5, DECOMPOSITION, "sink: geometry explains more than attention",
             "share of sink heads where geometry's share of var(log|c|) > attention's", "sink_geometry_share",
             share_ci(sink["geometry"] > sink["alpha"]), 0.5, "above", len(sink)),
        _row(5, DECOMPOSITION, "tail: attention explains more than geometry",
             "share of sink heads where attention's share of var(log|c|) > geometry's", "tail_attention_share",
             share_ci(tail["alpha"] > tail["geometry"]), 0.5, "above", len(tail)),
    ])


# ---------------------------------------------------------------------------------------------------
# chapter 6: sinks as suppressors
# ---------------------------------------------------------------------------------------------------
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
    table = sequence_bootstrap(points.assign(shortened=shortened)[in_sink], "shortened", n_bootstrap=n_bootstrap,
                               seed=seed).table
    if not len(table) or not in_sink.any():
        return (np.nan, np.nan, np.nan)
    return tuple(float(x) for x in table[["shortened", "shortened_low", "shortened_high"]].iloc[0])


def suppressor_claims(anti_alignment: pd.DataFrame, fits: pd.DataFrame, points: pd.DataFrame, eps: float = 0.3,
                      n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Chapter 6: anti-alignment (medians over sink heads below 0, bootstrap over heads), its trend with
    the sink rate (Spearman rho below 0), suppression (pooled share of shortened outputs above 0.5) and
    convexity (shares of fitted heads with an interior minimum, and with it inside the observed range,
    above 0.5, Wilson).

    ``anti_alignment``: :func:`cwcore.sinks.anti_alignment`'s table; ``fits``/``points``: see
    :func:`pooled_suppression`.
    """
    boot = dict(n_bootstrap=n_bootstrap, seed=seed)
    sink_aa = anti_alignment[anti_alignment["is_sink_head"].astype(bool)]
    head_fits = fits[fits["scope"] == "head"]
    fitted = head_fits[head_fits["fitted"].astype(bool)]
    return _frame([
        _row(6, ANTI_ALIGNMENT, "sink value against the tail values", "median over sink heads of mean cos(ṽ₀, ṽⱼ)",
             "cos_value", bootstrap_ci(sink_aa["cos_value_mean"], np.median, **boot), 0.0, "below", len(sink_aa)),
        _row(6, ANTI_ALIGNMENT, "sink value against the semantic component",
             "median over sink heads of mean cos(ṽ₀, sᵢ)", "cos_semantic",
             bootstrap_ci(sink_aa["cos_semantic_mean"], np.median, **boot), 0.0, "below", len(sink_aa)),
        _row(6, TREND, "rank correlation over all heads", "Spearman ρ(sink rate, mean cos(ṽ₀, sᵢ))", "rho_semantic",
             spearman_ci(anti_alignment["sink_rate"], anti_alignment["cos_semantic_mean"], **boot), 0.0, "below",
             len(anti_alignment)),
        _row(6, SUPPRESSION, "sink term shortens most outputs", "share of sink-head queries with ‖oᵢ‖ < ‖sᵢ‖",
             "shortened", pooled_suppression(fits, points, eps, **boot), 0.5, "above"),
        _row(6, CONVEXITY, "convex with an interior minimum", "share of fitted heads with 0 < α* < 1, c₂ > 0",
             "share_interior", share_ci(fitted["interior_minimum"]), 0.5, "above", len(fitted)),
        _row(6, CONVEXITY, "the minimum is observed", "share of fitted heads with α* in [q05, q95]",
             "share_in_range", share_ci(fitted["minimum_in_range"]), 0.5, "above", len(fitted)),
    ])


# ---------------------------------------------------------------------------------------------------
# chapter 7: the semantic cone
# ---------------------------------------------------------------------------------------------------
def _group_index(table: pd.DataFrame, where: Mapping) -> int | None:
    hit = np.flatnonzero(np.logical_and.reduce([table[k].to_numpy() == v for k, v in where.items()]))
    return int(hit[0]) if len(hit) else None


def _interval(replicates: np.ndarray, estimate: float, n_sequences: int) -> tuple[float, float, float]:
    if n_sequences < 2 or not np.isfinite(replicates).any():
        return (float(estimate), np.nan, np.nan)
    low, high = np.nanpercentile(replicates, [2.5, 97.5])
    return (float(estimate), float(low), float(high))


def contrast(boot: SequenceBootstrap, column: str, first: Mapping, second: Mapping) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of group ``first`` minus group ``second`` of one :func:`sequence_bootstrap`
    (e.g. ``{"condition": "sink", "quantile": 1}``): the same resampled sequences on both sides, so the
    interval is paired. NaNs if a group is missing."""
    t = boot.table
    i, j = _group_index(t, first), _group_index(t, second)
    if i is None or j is None:
        return (np.nan, np.nan, np.nan)
    reps = boot.replicates[column][:, i] - boot.replicates[column][:, j]
    n = int(min(t["n_sequences"].iloc[i], t["n_sequences"].iloc[j]))
    return _interval(reps, float(t[column].iloc[i] - t[column].iloc[j]), n)


def group_value(boot: SequenceBootstrap, column: str, **where) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of one group of a :func:`sequence_bootstrap` table."""
    i = _group_index(boot.table, where)
    if i is None:
        return (np.nan, np.nan, np.nan)
    return tuple(float(boot.table[column + s].iloc[i]) for s in ("", "_low", "_high"))


class PerplexityChanges(NamedTuple):
    """Per condition (and ``"clean"``) the perplexity; per intervention the change against clean, as
    ``delta_log`` (mean NLL per token, nats) and ``delta_ppl``; ``sink_minus_control``: Delta log-PPL of
    removing the sink minus that of the control. Each value is ``(estimate, low, high)``, intervals by
    a bootstrap over sequences (token-weighted means; the same resamples for every condition)."""

    ppl: dict
    delta_log: dict
    delta_ppl: dict
    sink_minus_control: tuple


def perplexity_changes(sequences: pd.DataFrame, conditions=("sink", "sink_renorm", "control"),
                       n_bootstrap: int = 1000, seed: int = 0) -> PerplexityChanges:
    """From the cone's raw ``sequences`` table (``n_tokens`` and summed ``nll_<condition>`` per sequence)."""
    names = ["clean", *conditions]
    long = pd.concat([pd.DataFrame({"sequence": sequences["sequence"], "condition": name,
                                    "n_tokens": sequences["n_tokens"], "nll": sequences[f"nll_{name}"] / sequences["n_tokens"]})
                      for name in names], ignore_index=True)
    boot = sequence_bootstrap(long, "nll", by="condition", weight="n_tokens", n_bootstrap=n_bootstrap, seed=seed)
    order = list(boot.table["condition"])
    reps = {c: boot.replicates["nll"][:, order.index(c)] for c in order}
    est = dict(zip(order, boot.table["nll"]))
    n = int(sequences["sequence"].nunique())
    ppl = {c: tuple(np.exp(_interval(reps[c], est[c], n))) for c in names}
    delta_log = {c: _interval(reps[c] - reps["clean"], est[c] - est["clean"], n) for c in conditions}
    delta_ppl = {c: _interval(np.exp(reps[c]) - np.exp(reps["clean"]), np.exp(est[c]) - np.exp(est["clean"]), n)
                 for c in conditions}
    minus = (_interval(reps["sink"] - reps["control"], est["sink"] - est["control"], n)
             if {"sink", "control"} <= set(conditions) else (np.nan,) * 3)
    return PerplexityChanges(ppl, delta_log, delta_ppl, minus)


def cone_claims(raw: Mapping[str, pd.DataFrame], quantiles: int = 5, n_bootstrap: int = 1000,
                seed: int = 0) -> pd.DataFrame:
    """Chapter 7: removing the sink turns the lowest-norm outputs towards the cone axis (Delta cos > 0),
    more than removing a random token does, and more than for the highest-norm outputs; and it raises
    perplexity, more than the control. Every interval is a bootstrap over sequences, paired for
    differences; each part holds when its interval is above 0.

    ``raw``: the semantic cone's raw pieces (``run_analyses(..., raw=True)["raw"]["semantic_cone"]``).
    """
    boot = dict(n_bootstrap=n_bootstrap, seed=seed)
    points = cone_points(raw, quantiles)
    within = sequence_bootstrap(points, "delta_cos", by=["condition", "quantile"], **boot)
    changes = perplexity_changes(raw["sequences"], **boot)
    sink_low = dict(condition="sink", quantile=1)
    return _frame([
        _row(7, CONE, "removing the sink turns them towards the cone axis", "Δcos, lowest-norm bin, sink removed",
             "dcos_sink_q1", group_value(within, "delta_cos", **sink_low), 0.0, "above"),
        _row(7, CONE, "more than the control does", "Δcos(sink) − Δcos(control), lowest-norm bin",
             "dcos_sink_minus_control", contrast(within, "delta_cos", sink_low, dict(condition="control", quantile=1)),
             0.0, "above"),
        _row(7, CONE, "more for low-norm than for high-norm outputs",
             "Δcos(lowest bin) − Δcos(highest bin), sink removed", "dcos_low_minus_high",
             contrast(within, "delta_cos", sink_low, dict(condition="sink", quantile=quantiles)), 0.0, "above"),
        _row(7, PERPLEXITY, "perplexity rises", "Δ log PPL, sink removed", "dlog_sink", changes.delta_log["sink"],
             0.0, "above"),
        _row(7, PERPLEXITY, "more than removing a random token", "Δ log PPL(sink) − Δ log PPL(control)",
             "dlog_sink_minus_control", changes.sink_minus_control, 0.0, "above"),
    ])


def all_claims(results: Mapping, eps: float = 0.3, quantiles: int = 5, n_bootstrap: int = 1000,
               seed: int = 0) -> pd.DataFrame:
    """Every sink claim of chapters 5-7 from ``run_analyses(model, ..., ANALYSES, raw=True)``'s results."""
    raw = results["raw"]
    return pd.concat([
        decomposition_claims(results["rates"], results["decomposition"].summary, eps),
        suppressor_claims(results["anti_alignment"], results["convexity"].fits, raw["convexity"]["points"], eps,
                          n_bootstrap, seed),
        cone_claims(raw["semantic_cone"], quantiles, n_bootstrap, seed),
    ], ignore_index=True)
