"""The sink claims' rows and the intervals they read, all built on :mod:`cwcore.stats`.

:func:`group_value` and :func:`contrast` read a :class:`cwcore.stats.ClusterBootstrap` by group keys;
:func:`pooled_by_layer` pools a head-level statistic resampling whole layers. The claims tables' row
(:data:`COLUMNS`, :func:`claim_row`) lives here so every analysis module can state its claims."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import pandas as pd

from .. import stats

__all__ = ["BOOK", "COLUMNS", "PAPER", "pooled_by_layer", "pooled_claim_rows", "UNMEASURED", "claim_row", "claims_frame",
           "combine_verdicts", "contrast", "group_value", "no_sink_heads", "share_ci", "verdict"]

share_ci = stats.share_ci
verdict = stats.verdict
combine_verdicts = stats.combine_verdicts
UNMEASURED = stats.NOT_MEASURED


def _group_index(table: pd.DataFrame, where: Mapping) -> int | None:
    hit = np.flatnonzero(np.logical_and.reduce([table[k].to_numpy() == v for k, v in where.items()]))
    return int(hit[0]) if len(hit) else None


def group_value(boot: stats.ClusterBootstrap, column: str, **where) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of one group of a :func:`cwcore.stats.cluster_bootstrap` table (NaNs if missing)."""
    i = _group_index(boot.table, where)
    if i is None:
        return (np.nan, np.nan, np.nan)
    return tuple(float(boot.table[column + s].iloc[i]) for s in ("", "_low", "_high"))


def contrast(boot: stats.ClusterBootstrap, column: str, first: Mapping, second: Mapping) -> tuple[float, float, float]:
    """``(estimate, low, high)`` of group ``first`` minus group ``second`` of one :func:`cwcore.stats.cluster_bootstrap`
    (e.g. ``{"condition": "sink", "quantile": 1}``): the same resampled sequences on both sides, so the
    interval is paired (:meth:`cwcore.stats.ClusterBootstrap.contrast`). NaNs if a group is missing."""
    i, j = _group_index(boot.table, first), _group_index(boot.table, second)
    if i is None or j is None:
        return (np.nan, np.nan, np.nan)
    return tuple(float(x) for x in boot.contrast(i, j, column))


# the claims table's row

COLUMNS = ["chapter", "claim", "part", "statistic", "key", "estimate", "low", "high", "threshold", "side", "n",
           "verdict", "why", "unit", "n_units", "source"]

#: whose claim a row tests (the ``source`` column): the paper's section 'Value geometry of attention sinks', or the book's own (a claim the
#: book adds, e.g. "many heads are sink heads", or an older reading it keeps beside the paper's)
PAPER, BOOK = "paper", "book"


def no_sink_heads(eps: float) -> str:
    """Why a part over sink heads is not measured on a model without them (the ``why`` of :func:`claim_row`)."""
    return f"no sink heads at eps={eps:g}"


def too_few_layers(n_layers: int) -> str:
    """Why a statistic resampling whole layers has no interval: fewer layers than
    :data:`cwcore.stats.MIN_CLUSTERS` ("" when there are enough; kept only if the part is not measured)."""
    return f"{n_layers} layers, too few to resample (fewer than {stats.MIN_CLUSTERS})" \
        if n_layers < stats.MIN_CLUSTERS else ""


def claim_row(chapter, claim, part, statistic, key, triple_, threshold, side, n=np.nan, why: str = "",
              unit: str = "", n_units=np.nan, source: str = PAPER) -> dict:
    """One part of a claim: ``triple_`` = (estimate, low, high) judged by :func:`cwcore.stats.verdict`.

    ``n``: values the statistic is over; ``unit`` / ``n_units``: what the interval treats as independent
    and how many; ``why``: what the model lacks, kept only when "not measured"; ``source``:
    :data:`PAPER` or :data:`BOOK` (whose claim it is)."""
    if source not in (PAPER, BOOK):
        raise ValueError(f"source must be {PAPER!r} or {BOOK!r}, not {source!r}")
    est, low, high = (float(x) for x in triple_)
    judged = verdict(low, high, threshold=threshold, side=side)
    if judged != UNMEASURED:
        why = ""
    elif not why:
        why = "no interval" if not isinstance(n, (int, np.integer)) else f"too few values for an interval (n={n})"
    return {"chapter": chapter, "claim": claim, "part": part, "statistic": statistic, "key": key, "estimate": est,
            "low": low, "high": high, "threshold": float(threshold), "side": side, "n": n,
            "verdict": judged, "why": why, "unit": unit, "n_units": n_units, "source": source}


def claims_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows of :func:`claim_row` as a claims table (columns :data:`COLUMNS`)."""
    frame = pd.DataFrame(rows, columns=COLUMNS)
    frame["why"] = frame["why"].astype(object).fillna("").astype(str)
    frame["source"] = frame["source"].astype(object).fillna(PAPER).astype(str)
    return frame


# head tables -> pooled claims, resampling whole layers

_STATISTICS = {"mean": np.nanmean, "share": np.nanmean, "median": np.nanmedian}


def _by_layer(values: np.ndarray, layers: np.ndarray, statistic: str, n_resamples: int, seed: int,
              confidence: float) -> tuple[float, float, float, int]:
    """(estimate, low, high, n_layers) of ``statistic`` over heads, resampling whole layers."""
    f = _STATISTICS[statistic]
    ok = np.isfinite(values)
    values, layers = values[ok], layers[ok]
    if not len(values):
        return (np.nan, np.nan, np.nan, 0)
    units, index = np.unique(layers, return_inverse=True)
    estimate = float(f(values))
    if len(units) < stats.MIN_CLUSTERS:  # too few layers to resample: no interval (see stats.MIN_CLUSTERS)
        return (estimate, np.nan, np.nan, len(units))
    members = [np.flatnonzero(index == u) for u in range(len(units))]
    draws = stats.resample_indices(len(units), n_resamples, seed)
    if statistic in ("mean", "share"):  # pooled mean of the drawn layers' heads: from per-layer sums
        sums = np.array([values[m].sum() for m in members])
        counts = np.array([len(m) for m in members], float)
        replicates = sums[draws].sum(1) / counts[draws].sum(1)
    else:
        replicates = np.array([f(np.concatenate([values[members[u]] for u in d])) for d in draws])
    low, high = stats.percentile_interval(replicates[:, None], confidence)
    return (estimate, float(low[0]), float(high[0]), len(units))


def pooled_by_layer(table: pd.DataFrame, column: str, *, statistic: str = "mean", n_resamples: int = 1000,
                    seed: int = 0, confidence: float = 0.95, layer: str = "layer",
                    layer_type: str = "layer_type") -> pd.DataFrame:
    """A head-level statistic ("mean", "median" or "share" of ``column``) pooled over heads, with a cluster
    bootstrap by layer (heads of a layer are not independent). Rows per ``scope`` ("all", then each
    ``layer_type`` when there are two or more): ``estimate``, ``low``, ``high``, ``n``, ``n_layers``; NaN
    intervals with fewer than :data:`cwcore.stats.MIN_CLUSTERS` layers."""
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {', '.join(_STATISTICS)}, not {statistic!r}")
    scopes = [("all", np.ones(len(table), bool))]
    if layer_type in table and table[layer_type].nunique() > 1:
        scopes += [(str(t), (table[layer_type] == t).to_numpy()) for t in sorted(table[layer_type].unique())]
    rows = []
    for scope, keep in scopes:
        values = table.loc[keep, column].to_numpy(float) if len(table) else np.zeros(0)
        layers = table.loc[keep, layer].to_numpy() if len(table) else np.zeros(0)
        est, low, high, n_layers = _by_layer(values, layers, statistic, n_resamples, seed, confidence)
        rows.append({"scope": scope, "estimate": est, "low": low, "high": high,
                     "n": int(np.isfinite(values).sum()), "n_layers": n_layers})
    return pd.DataFrame(rows, columns=["scope", "estimate", "low", "high", "n", "n_layers"])


def pooled_claim_rows(table: pd.DataFrame, column: str, *, chapter, claim: str, part: str, statistic_text: str,
                      key: str, threshold: float, side: str, statistic: str = "mean", why: str = "",
                      n_resamples: int = 1000, seed: int = 0, source: str = PAPER) -> list[dict]:
    """Claim rows of :func:`pooled_by_layer`: the pooled row is a part of ``claim``; each layer type's row a
    part of the separate claim ``"<claim> [<type> layers]"`` (key ``"<key>@<type>"``)."""
    pooled = pooled_by_layer(table, column, statistic=statistic, n_resamples=n_resamples, seed=seed)
    rows = []
    for r in pooled.itertuples():
        here_claim, here_key = (claim, key) if r.scope == "all" else (f"{claim} [{r.scope} layers]", f"{key}@{r.scope}")
        text = f"{statistic_text} (cluster bootstrap by layer, {r.n_layers} layers)"
        here_why = why if r.n == 0 else too_few_layers(r.n_layers)
        rows.append(claim_row(chapter, here_claim, part, text, here_key, (r.estimate, r.low, r.high), threshold, side,
                              int(r.n), here_why, unit="layer", n_units=int(r.n_layers), source=source))
    return rows
