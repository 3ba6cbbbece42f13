"""Chapter 9's Table 1: the pre-registered primary family, each step under the protocol where it is
measured and the ordering over those steps, in both modes and both importance signs, from the committed
evidence (:func:`cwcore.book.findings.findings_csv` of ``data/results/evidence``), with this build's live
verdicts beside it as a rerun check."""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from ..faithfulness import evidence
from ..stats import NOT_MEASURED, combine_all
from .findings import STEPS, _main

__all__ = ["PRIMARY_COLUMNS", "primary_table"]

#: Table 1's columns: (mode, importance, label); the ``|c|`` columns are the pre-registered headline
PRIMARY_COLUMNS = (("comprehensiveness", "absolute", "comprehensiveness |c| (primary)"),
                   ("comprehensiveness", "signed", "comprehensiveness signed"),
                   ("sufficiency", "absolute", "sufficiency |c| (primary)"),
                   ("sufficiency", "signed", "sufficiency signed"))


def _cell(rows: pd.DataFrame, claim: str, protocol: str, mode: str, importance: str, rng: str) -> tuple[str, str]:
    """(verdict, "verdict estimate [low, high]") of one findings row (the main variant's), or not measured."""
    rows = _main(rows)
    found = rows[(rows["claim"] == claim) & (rows["protocol"] == protocol) & (rows["mode"] == mode)
                 & (rows["importance"] == importance) & (rows["range"] == rng)]
    if found.empty:
        return NOT_MEASURED, NOT_MEASURED
    r = found.iloc[0]
    if pd.isna(r.get("estimate")):
        return r["verdict"], r["verdict"]
    return r["verdict"], f"{r['verdict']} {r['estimate']:+.3g} [{r['ci_low']:+.3g}, {r['ci_high']:+.3g}]"


def primary_table(evidence_rows: pd.DataFrame, live_rows: pd.DataFrame | None = None,
                  models: Sequence[str] | None = None) -> pd.DataFrame:
    """Chapter 9's Table 1: for each pre-registered model and data set, each primary step under the
    protocol where it is measured and the ordering over those steps (:func:`cwcore.stats.combine_all`),
    in both modes and both importance signs (:data:`PRIMARY_COLUMNS`), from the committed evidence
    (``evidence_rows``: :func:`findings_csv` of the evidence folder; ``|c|`` cells Holm-decided, signed cells
    exploratory and unadjusted); with ``live_rows`` (this build's findings), one ``rerun`` column per
    mode and sign holding the live verdicts in the same order, and ``rerun agrees`` (of the cells
    measured by both, how many give the same verdict; empty when none is)."""
    rng = evidence.PRIMARY["range"]
    models = list(models or evidence.PRIMARY["models"])
    steps = [(claim, next(p for lo, hi, p in evidence.PRIMARY["pairs"] if (lo, hi) == (a, b)))
             for claim, a, b in STEPS]
    out = []
    for model in models:
        for data in evidence.PRIMARY["data"]:
            ev = evidence_rows[(evidence_rows["model"] == model) & (evidence_rows["data"] == data)]
            lv = None if live_rows is None else live_rows[(live_rows["model"] == model) & (live_rows["data"] == data)]
            chain = {label: [] for *_, label in PRIMARY_COLUMNS}
            chain_live = {label: [] for *_, label in PRIMARY_COLUMNS}
            for claim, protocol in [*steps, ("ordering", "every step where measured")]:
                row = {"model": model, "data": data, "claim": claim, "protocol": protocol}
                live = []
                for mode, importance, label in PRIMARY_COLUMNS:
                    if claim == "ordering":
                        v = combine_all(chain[label])
                        row[label] = v
                        live.append(combine_all(chain_live[label]) if lv is not None else "")
                        continue
                    v, text = _cell(ev, claim, protocol, mode, importance, rng)
                    row[label] = text
                    if claim.startswith("step"):
                        chain[label].append(v)
                    if lv is not None:
                        lv_v, _ = _cell(lv, claim, protocol, mode, importance, rng)
                        live.append(lv_v)
                        if claim.startswith("step"):
                            chain_live[label].append(lv_v)
                if live_rows is not None:
                    row["rerun (|c| / signed, comprehensiveness; sufficiency)"] = \
                        f"{live[0]} / {live[1]}; {live[2]} / {live[3]}"
                    ours = [row[label].split(" ")[0] if not row[label].startswith(NOT_MEASURED) else NOT_MEASURED
                            for *_, label in PRIMARY_COLUMNS]
                    both = [(a, b) for a, b in zip(ours, live) if NOT_MEASURED not in (a, b)]
                    row["rerun agrees"] = f"{sum(a == b for a, b in both)}/{len(both)}" if both else ""
                out.append(row)
    return pd.DataFrame(out)
