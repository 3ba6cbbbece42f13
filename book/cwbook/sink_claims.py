"""The sink chapters' claims, each part judged by one rule: its 95% interval against a threshold.

Chapters 5-7 of the book and the findings page (chapter 9) call these functions with the results of
:func:`cwcore.sinks.run_analyses` (``raw=True``), so a claim gets the same verdict wherever it is shown.
Every function returns a claims table, one row per part of a claim:

``chapter, claim, part, statistic, key, estimate, low, high, threshold, side, n, verdict, why, unit,
n_units, source``

``estimate`` is the statistic, ``[low, high]`` its 95% interval (Wilson for shares of heads, a
percentile bootstrap otherwise: over heads for medians and rank correlations, over whole sequences for
pooled means), and ``verdict`` is :func:`cwcore.stats.verdict` of that interval against ``threshold``
on the claimed ``side`` (holds / contradicted / inconclusive / not measured); ``why`` says, for a part
not measured, what the model lacks (e.g. "no sink heads at eps=0.3"), and :func:`display` shows it;
``source`` says whose claim the row tests: ``"paper"`` (the paper's section 'Value geometry of attention sinks') or ``"book"`` (the book's
own: "many heads are sink heads", "the sink is position 0", the older tail reading).
:func:`claim_verdicts` combines the parts of each claim (:func:`cwcore.stats.combine_verdicts`). ``key`` names a part for
code (e.g. ``"cos_semantic"``); :func:`triple` reads ``(estimate, low, high)`` by key.

Each analysis module states its own claims (its registered :class:`~cwcore.sinks.engine.Analysis`
has a ``claims`` function); this module gathers them by chapter and for :func:`all_claims`. It was
``cwcore.sinks.claims``.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

from cwcore import stats
from cwcore.sinks.anti_alignment import ANTI_ALIGNMENT, TREND
from cwcore.sinks.anti_alignment import _claim_rows as _anti_alignment_rows
from cwcore.sinks.convexity import CONVEXITY, CONVEXITY_V0, OBSERVED_CLAIMS, SUPPRESSION
from cwcore.sinks.convexity import _claim_rows as _convexity_rows
from cwcore.sinks.decomposition import DECOMPOSITION, TAIL_ATTENTION_ONLY, TAIL_MARGIN, decomposition_claims, head_shares, joint_shares
from cwcore.sinks.engine import EPS, REGISTRY
from cwcore.sinks.intervals import (BOOK, COLUMNS, PAPER, claims_frame, contrast, group_value, no_sink_heads, pooled_by_layer,
                        pooled_claim_rows, UNMEASURED)
from cwcore.sinks.rates import SINK_POSITION_CLAIM, SINK_RATES, rate_claim_rows
from cwcore.sinks.semantic_cone import (CONE, DRIFT, PERPLEXITY, PerplexityChanges, cone_claims, drift_curve,
                            perplexity_changes)

__all__ = ["COLUMNS", "chapter_claims", "decomposition_claims", "suppressor_claims", "cone_claims", "all_claims",
           "claim_verdicts", "claim_verdict_texts", "triple", "display", "head_shares", "pooled_suppression",
           "contrast",
           "group_value", "no_sink_heads", "sink_heads_sentence", "verdict_text", "perplexity_changes",
           "PerplexityChanges", "DECOMPOSITION", "ANTI_ALIGNMENT", "TREND", "SUPPRESSION", "CONVEXITY", "CONE",
           "PERPLEXITY", "DRIFT", "CONVEXITY_V0", "OBSERVED_CLAIMS", "TAIL_MARGIN", "BOOK", "PAPER", "SINK_RATES", "SINK_POSITION_CLAIM", "TAIL_ATTENTION_ONLY", "for_data",
           "rate_claims", "joint_shares", "drift_curve", "pooled_by_layer", "pooled_claim_rows", "stack_data"]


def verdict_text(claims: pd.DataFrame) -> list[str]:
    """Each part's verdict as the chapters show it: "not measured: <why>" where the table says why."""
    why = claims["why"].astype(object).fillna("").astype(str) if "why" in claims else pd.Series("", index=claims.index)
    return [f"{v}: {w}" if v == UNMEASURED and w and w != "nan" else str(v) for v, w in zip(claims["verdict"], why)]


def pooled_suppression(fits: pd.DataFrame, points: pd.DataFrame, eps: float = EPS.default, n_resamples: int = 1000,
                       seed: int = 0) -> tuple[float, float, float]:
    """``(share, low, high)`` of sink-head queries with ``||o_i|| < ||s_i||``, bootstrap over sequences
    (``fits``: the convexity fits; ``points``: its raw points)."""
    rate = fits[fits["scope"] == "head"].set_index(["layer", "head"])["sink_rate"]
    in_sink = rate.reindex(pd.MultiIndex.from_frame(points[["layer", "head"]])).to_numpy() > eps
    with np.errstate(invalid="ignore"):
        shortened = (points["norm"] < np.sqrt(points["s_sq"].clip(lower=0))).astype(float)
    shortened = shortened.where(points["s_sq"] > 0)  # s_i = 0: undefined
    if not in_sink.any():
        return (np.nan, np.nan, np.nan)
    chosen = points.assign(shortened=shortened)[in_sink]
    boot = stats.cluster_bootstrap(chosen, ["shortened"], cluster="sequence", n_resamples=n_resamples, seed=seed)
    return tuple(float(x) for x in boot.interval(0, "shortened"))


def triple(claims: pd.DataFrame, key: str) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of the part named ``key`` (NaNs if absent)."""
    row = claims[claims["key"] == key]
    if not len(row):
        return (np.nan, np.nan, np.nan)
    return tuple(float(row[c].iloc[0]) for c in ("estimate", "low", "high"))


def sink_heads_sentence(n_sink_heads: int, n_heads: int, eps: float, short: bool = False) -> str:
    """The sentence a chapter puts before its statistics over sink heads (markdown): what they are taken
    over, or, on a model without sink heads, that they are not measured and why (instead of bare NaNs).
    ``short``: the reminder for later paragraphs of the same page."""
    if n_sink_heads > 0:
        if short:
            return f"(Sink heads: {n_sink_heads} of {n_heads}.)"
        return (f"The statistics over sink heads below are taken over the {n_sink_heads} of {n_heads} heads whose "
                f"sink rate exceeds eps = {eps:g}.")
    if short:
        return f"**Not measured: {no_sink_heads(eps)}** (the numbers over sink heads are nan)."
    return (f"**Not measured: {no_sink_heads(eps)}.** None of the {n_heads} heads of this model puts more than "
            f"{eps:g} of its attention on position 0 on average, so every statistic over sink heads below is "
            "undefined (shown as nan) and its verdict is *not measured*.")


def claim_verdicts(claims: pd.DataFrame) -> pd.Series:
    """One verdict per claim (in table order), its parts combined by :func:`cwcore.stats.combine_verdicts`."""
    return claims.groupby("claim", sort=False)["verdict"].apply(stats.combine_verdicts)


def claim_verdict_texts(claims: pd.DataFrame) -> pd.Series:
    """:func:`claim_verdicts` as the chapters write them: a claim "not measured" says why (its parts'
    reasons, e.g. "not measured: no sink heads at eps=0.3")."""
    verdicts = claim_verdicts(claims)
    why = claims["why"].astype(object).fillna("").astype(str) if "why" in claims else pd.Series("", index=claims.index)
    out = {}
    for claim, result in verdicts.items():
        reasons = [w for w in dict.fromkeys(why[claims["claim"] == claim]) if w and w != "nan"]
        out[claim] = f"{result}: {'; '.join(reasons)}" if result == stats.NOT_MEASURED and reasons else result
    return pd.Series(out, name="verdict")


def display(claims: pd.DataFrame, digits: int = 2) -> pd.DataFrame:
    """The table as the chapters show it: interval and rule as text."""
    fmt = f"{{:.{digits}f}}"
    return pd.DataFrame({
        "claim": claims["claim"], "part": claims["part"], "statistic": claims["statistic"],
        "estimate": claims["estimate"],
        "95% interval": [f"{fmt.format(lo)} to {fmt.format(hi)}" for lo, hi in zip(claims["low"], claims["high"])],
        "holds if the interval is": [f"{'<' if s == 'below' else '>'} {t:g}"
                                     for s, t in zip(claims["side"], claims["threshold"])],
        "verdict": verdict_text(claims),
        "claim by": ["the book" if s == BOOK else "the paper" for s in
                     (claims["source"] if "source" in claims else [PAPER] * len(claims))],
    })


def suppressor_claims(anti_alignment: pd.DataFrame, fits: pd.DataFrame, points: pd.DataFrame, eps: float = EPS.default,
                      n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Chapter 6: anti-alignment (medians over sink heads below 0, bootstrap over heads), its trend with
    the sink rate (Spearman rho below 0), suppression (pooled share of shortened outputs above 0.5) and
    convexity (shares of fitted heads with an interior minimum, and with it inside the observed range,
    above 0.5, Wilson).

    ``anti_alignment``: :func:`cwcore.sinks.anti_alignment`'s table; ``fits``/``points``: see
    :func:`pooled_suppression`.
    """
    return claims_frame(_anti_alignment_rows(anti_alignment, n_resamples, seed, eps)
                        + _convexity_rows(fits, points, eps, n_resamples, seed))


def rate_claims(rates: pd.DataFrame, eps: float = EPS.default, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Chapter 5's claims on the sink rates ("many heads are sink heads", Wilson and by layer; "the sink is
    position 0"), see :func:`cwcore.sinks.rates.rate_claim_rows`."""
    return claims_frame(rate_claim_rows(rates, eps, n_resamples=n_resamples, seed=seed))


def for_data(claims: pd.DataFrame, data: str) -> pd.DataFrame:
    """A claims table of one data set, ready to be stacked with others' (columns unchanged): ``part``
    prefixed with ``"<data>: "`` and ``key`` with ``"<data>/"``. A finding that combines the parts of a
    claim then combines them over the data sets too (it holds when it holds on each)."""
    out = claims.copy()
    out["part"] = f"{data}: " + out["part"].astype(str)
    out["key"] = f"{data}/" + out["key"].astype(str)
    return out


def stack_data(tables: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """``{data: claims table}`` as one table (:func:`for_data` of each, in order)."""
    return claims_frame([]) if not tables else pd.concat([for_data(t, d) for d, t in tables.items()],
                                                           ignore_index=True)


def chapter_claims(chapter: str, result: Mapping, eps: float = EPS.default, *, n_resamples: int = 1000, seed: int = 0,
                   quantiles: int = 5) -> pd.DataFrame:
    """The claims table of one sink chapter (``"05_sink_decomposition"``, ``"06_sinks_as_suppressors"`` or
    ``"07_semantic_cone"``) on one data set, from that data set's ``run_analyses(..., raw=True)`` result: the
    one place the chapters and the confirmatory build (:func:`cwbook.confirmatory.sink_tables`) build it.
    ``quantiles``: bins of the clean output norm (chapter 7's; chapter 6's anti-alignment and convexity rows
    take 5)."""
    boot = dict(n_resamples=n_resamples, seed=seed)
    if chapter == "05_sink_decomposition":
        return pd.concat([
            rate_claims(result["rates"], eps, **boot),  # "many heads are sink heads", "the sink is position 0"
            decomposition_claims(result["rates"], result["decomposition"].summary, eps,
                                 stats=result["raw"]["decomposition"]["stats"], **boot),
        ], ignore_index=True)
    if chapter == "06_sinks_as_suppressors":
        return claims_frame([row for name in ("anti_alignment", "convexity")
                             for row in REGISTRY[name].claims(result, eps=eps, quantiles=quantiles, **boot)])
    if chapter == "07_semantic_cone":
        return cone_claims(result["raw"]["semantic_cone"], quantiles, **boot)
    raise ValueError(f"{chapter!r} is not a sink chapter (05_sink_decomposition, 06_sinks_as_suppressors, "
                     "07_semantic_cone)")


def all_claims(results: Mapping, eps: float = EPS.default, quantiles: int = 5, n_resamples: int = 1000,
               seed: int = 0) -> pd.DataFrame:
    """Every sink claim of chapters 5-7 from ``run_analyses(model, ..., ANALYSES, raw=True)``'s results:
    the claims of every registered analysis, in registration order."""
    rows = []
    for analysis in REGISTRY.values():
        if analysis.claims is not None:
            rows += analysis.claims(results, eps=eps, quantiles=quantiles, n_resamples=n_resamples, seed=seed)
    return claims_frame(rows)
