"""The sink chapters' claims, each part judged by one rule: its 95% interval against a threshold.

Chapters 5-7 of the book and the findings page (chapter 9) call these functions with the results of
:func:`cwcore.sinks.run_analyses` (``raw=True``), so a claim gets the same verdict wherever it is shown.
Every function returns a claims table, one row per part of a claim:

``chapter, claim, part, statistic, key, estimate, low, high, threshold, side, n, verdict``

``estimate`` is the statistic, ``[low, high]`` its 95% interval (Wilson for shares of heads, a
percentile bootstrap otherwise: over heads for medians and rank correlations, over whole sequences for
pooled means), and ``verdict`` is :func:`cwcore.stats.verdict` of that interval against ``threshold``
on the claimed ``side`` (holds / contradicted / inconclusive / not measured). :func:`claim_verdicts`
combines the parts of each claim (:func:`cwcore.stats.combine_verdicts`). ``key`` names a part for
code (e.g. ``"cos_semantic"``); :func:`triple` reads ``(estimate, low, high)`` by key.

Each analysis module states its own claims (its registered :class:`~cwcore.sinks.engine.Analysis`
has a ``claims`` function); this module gathers them by chapter and for :func:`all_claims`. It was
``cwcore.sink_claims``, which still imports.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

from .. import stats
from .anti_alignment import ANTI_ALIGNMENT, TREND
from .anti_alignment import _claim_rows as _anti_alignment_rows
from .convexity import CONVEXITY, SUPPRESSION, pooled_suppression
from .convexity import _claim_rows as _convexity_rows
from .decomposition import DECOMPOSITION, decomposition_claims, head_shares
from .engine import REGISTRY
from .intervals import COLUMNS, claims_frame, contrast, group_value
from .semantic_cone import CONE, PERPLEXITY, PerplexityChanges, cone_claims, perplexity_changes

__all__ = ["COLUMNS", "decomposition_claims", "suppressor_claims", "cone_claims", "all_claims",
           "claim_verdicts", "triple", "display", "head_shares", "pooled_suppression", "contrast",
           "group_value", "perplexity_changes", "PerplexityChanges", "DECOMPOSITION", "ANTI_ALIGNMENT", "TREND",
           "SUPPRESSION", "CONVEXITY", "CONE", "PERPLEXITY"]


def triple(claims: pd.DataFrame, key: str) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of the part named ``key`` (NaNs if absent)."""
    row = claims[claims["key"] == key]
    if not len(row):
        return (np.nan, np.nan, np.nan)
    return tuple(float(row[c].iloc[0]) for c in ("estimate", "low", "high"))


def claim_verdicts(claims: pd.DataFrame) -> pd.Series:
    """One verdict per claim (in table order), its parts combined by :func:`cwcore.stats.combine_verdicts`."""
    return claims.groupby("claim", sort=False)["verdict"].apply(stats.combine_verdicts)


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


def suppressor_claims(anti_alignment: pd.DataFrame, fits: pd.DataFrame, points: pd.DataFrame, eps: float = 0.3,
                      n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Chapter 6: anti-alignment (medians over sink heads below 0, bootstrap over heads), its trend with
    the sink rate (Spearman rho below 0), suppression (pooled share of shortened outputs above 0.5) and
    convexity (shares of fitted heads with an interior minimum, and with it inside the observed range,
    above 0.5, Wilson).

    ``anti_alignment``: :func:`cwcore.sinks.anti_alignment`'s table; ``fits``/``points``: see
    :func:`pooled_suppression`.
    """
    return claims_frame(_anti_alignment_rows(anti_alignment, n_bootstrap, seed)
                        + _convexity_rows(fits, points, eps, n_bootstrap, seed))


def all_claims(results: Mapping, eps: float = 0.3, quantiles: int = 5, n_bootstrap: int = 1000,
               seed: int = 0) -> pd.DataFrame:
    """Every sink claim of chapters 5-7 from ``run_analyses(model, ..., ANALYSES, raw=True)``'s results:
    the claims of every registered analysis, in registration order."""
    rows = []
    for analysis in REGISTRY.values():
        if analysis.claims is not None:
            rows += analysis.claims(results, eps=eps, quantiles=quantiles, n_bootstrap=n_bootstrap, seed=seed)
    return claims_frame(rows)
