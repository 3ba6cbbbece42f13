"""The book's evidence design for section 5: which protocols, ratio ranges and importance signs the
ladder is judged under, and one call that runs them all on one sample of documents.

Main protocols (:data:`PROTOCOLS`)
----------------------------------
``default``
    the package defaults (ranking (head, key) pairs jointly per query row, contribution relative to
    the combined output o_i). Rungs 2 and 3 rank identically by construction (o_i's norm is shared by
    the heads of a query), so this protocol tests a three-rung ladder.
``per-head``
    the same with ``kind="intra"``: rungs 3 and 4 are normalised by each head's own output o^h_i.
    Its normaliser differs between heads of one query, so the joint (head, key) ranking of rung 3
    differs from rung 2 and all four rungs are distinct. It was chosen over ``scope="layer"`` because
    it keeps the per-row removal of the default (every query loses the same share of its own terms),
    so the two main protocols differ in one choice only.

Ratio ranges (:data:`LOW_RATIOS`, :data:`PAPER_RATIOS`)
-------------------------------------------------------
The paper's grid starts at r = 0.05, where the packaged models have already lost several nats of
log-perplexity; the low grid (0.001 to 0.05) measures where removal is still gentle. AOPC is reported
over the low range (r <= :data:`LOW_MAX`) and over the full range (both grids together).

Importance signs
----------------
``signed`` ranks by the metric's value, ``absolute`` by ``|score|``. Attention, value-weighted,
output-normalised attention and the random control are never negative, so their |score| rankings
are their signed ones (:data:`SIGN_INVARIANT`, checked by a test against a real absolute run):
:func:`ladder_sweep` reuses their signed rows for the absolute importance and runs only the
contribution weights again.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from ..core.decomposition import METRICS
from .lm import faithfulness_curve
from .protocol import DEFAULT_RATIOS, parse_metric
from .summary import aopc, ladder_comparison

__all__ = ["PROTOCOLS", "PROTOCOL_NOTES", "LOW_RATIOS", "PAPER_RATIOS", "LOW_MAX", "IMPORTANCES",
           "SIGN_INVARIANT", "ratio_grid", "ladder_sweep", "ranges", "evidence_tables"]

PROTOCOLS = {"default": {}, "per-head": {"kind": "intra"}}
PROTOCOL_NOTES = {
    "default": "head_key units per query row, contribution relative to o_i (kind=inter): rungs 2 and 3 identical",
    "per-head": "as default with kind=intra (normalised by each head's own output): four distinct rungs",
}
LOW_RATIOS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
PAPER_RATIOS = DEFAULT_RATIOS
LOW_MAX = 0.05
IMPORTANCES = ("signed", "absolute")
SIGN_INVARIANT = tuple(str(r) for r in METRICS if r.nonnegative) + ("random",)  # never negative


def ratio_grid(low: Sequence[float] = LOW_RATIOS, paper: Sequence[float] = PAPER_RATIOS) -> list[float]:
    """The low grid and the paper's grid, merged, sorted and deduplicated."""
    return sorted({float(r) for r in (*low, *paper)})


def ranges(ratios: Sequence[float], low_max: float = LOW_MAX) -> dict[str, float | None]:
    """``{"low": low_max, "full": None}``, less the low range when no ratio lies at or below it, and
    less the full range when it would be the low one."""
    out: dict[str, float | None] = {}
    if any(r <= low_max for r in ratios):
        out["low"] = low_max
    if not out or max(ratios) > low_max:
        out["full"] = None
    return out


def ladder_sweep(model, tokenizer, blocks, metrics, ratios, modes=None, *, protocol: str = "default",
                 importances: Sequence[str] = IMPORTANCES, **kwargs) -> pd.DataFrame:
    """The per-sequence table of :func:`~cwcore.faithfulness.faithfulness_curve` under one main
    ``protocol`` (a key of :data:`PROTOCOLS`) for every importance sign, stacked, with a ``protocol``
    column. Sign-invariant metrics (:data:`SIGN_INVARIANT`) are run once and their rows reused for the
    absolute importance (relabelled); ``kwargs`` go to ``faithfulness_curve``."""
    change = PROTOCOLS[protocol]
    kind = change.get("kind", kwargs.get("kind", "inter"))
    frames = []
    signed = None
    for importance in importances:
        chosen = list(metrics)
        if importance == "absolute" and signed is not None:
            chosen = [m for m in metrics if parse_metric(m, kind).name not in SIGN_INVARIANT]
        part = None
        if chosen:
            part = faithfulness_curve(model, tokenizer, blocks, chosen, ratios, modes, per_sequence=True,
                                      importance=importance, **{**kwargs, **change})
        if importance == "absolute" and signed is not None:
            reused = signed[signed["metric"].map(lambda m: parse_metric(m, kind).name in SIGN_INVARIANT)]
            part = pd.concat([reused.assign(importance="absolute"), part], ignore_index=True)
        if importance == "signed":
            signed = part
        frames.append(part)
    return pd.concat(frames, ignore_index=True).assign(protocol=protocol)


def evidence_tables(per_sequence: pd.DataFrame, *, n_bootstrap: int = 1000, seed: int = 0,
                    low_max: float = LOW_MAX, confidence: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(AOPC, ladder) of a :func:`ladder_sweep` table (one or several protocols, stacked) over each
    ratio range of :func:`ranges`, with columns ``protocol`` and ``range``. The ladder comes from
    :func:`~cwcore.faithfulness.ladder_comparison` (paired bootstrap over documents, ``mde`` beside
    each interval)."""
    areas, ladders = [], []
    for protocol, part in per_sequence.groupby("protocol", sort=False):
        part = part.drop(columns="protocol")
        for name, max_ratio in ranges(sorted(part["ratio"].unique()), low_max).items():
            kw = dict(n_bootstrap=n_bootstrap, seed=seed, confidence=confidence, max_ratio=max_ratio)
            areas.append(aopc(part, **kw).assign(protocol=protocol, range=name))
            ladders.append(ladder_comparison(part, **kw).assign(protocol=protocol, range=name))
    return pd.concat(areas, ignore_index=True), pd.concat(ladders, ignore_index=True)
