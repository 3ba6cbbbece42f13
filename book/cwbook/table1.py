"""Chapter 9's Table 1: the pre-registered primary family, each step under the protocol where it is
measured and the ordering over those steps, in both modes and both importance signs, from the committed
evidence (:func:`cwbook.findings.findings_csv` of ``data/results/evidence``), with this build's live
verdicts beside it as a rerun check."""

from __future__ import annotations

from typing import Sequence

import pandas as pd

from . import ladder as evidence
from cwcore.stats import NOT_MEASURED, combine_all
from .findings import STEPS, _main

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
    exploratory and unadjusted); with ``live_rows`` (this build's findings), one ``rerun agrees?`` column
    saying, per mode and sign in the same order, whether the rerun gives the evidence's verdict (no rerun
    verdict is printed), and ``rerun agrees`` (of the cells
    measured by both, how many give the same verdict; empty when none is)."""
    rng = evidence.PRIMARY["range"]
    models = list(models or evidence.PRIMARY["models"])
    steps = [(claim, next(p for lo, hi, p in evidence.PRIMARY["pairs"] if (lo, hi) == (a, b))) for claim, a, b in STEPS]
    out = []
    for model in models:
        for data in evidence.PRIMARY["data"]:
            ev = evidence_rows[(evidence_rows["model"] == model) & (evidence_rows["data"] == data)]
            lv = None if live_rows is None else live_rows[(live_rows["model"] == model) & (live_rows["data"] == data)]
            rerun = lv is not None and not lv.empty  # a model this build did not run: no rerun to agree or not
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
                    from cwbook.chapters.common import AGREEMENT_SHORT, rerun_agrees

                    ours = [row[label].split(" ")[0] if not row[label].startswith(NOT_MEASURED) else NOT_MEASURED
                            for *_, label in PRIMARY_COLUMNS]
                    # whether the rerun gives the evidence's verdict, cell by cell (never the rerun's own verdict)
                    said = [AGREEMENT_SHORT[rerun_agrees(lv_, ev_)] if lv_ else "" for lv_, ev_ in zip(live, ours)]
                    row["rerun agrees? (|c| / signed, comprehensiveness; sufficiency)"] = \
                        f"{said[0]} / {said[1]}; {said[2]} / {said[3]}" if rerun else "not in this build"
                    both = [(a, b) for a, b in zip(ours, live) if NOT_MEASURED not in (a, b)] if rerun else []
                    row["rerun agrees"] = f"{sum(a == b for a, b in both)}/{len(both)}" if both else ""
                out.append(row)
    return pd.DataFrame(out)


# -- both samples side by side ----------------------------------------------------------------------
_SHORT = {"holds": "holds", "contradicted": "contra.", "negligible": "neglig.", "inconclusive": "inconcl.",
          NOT_MEASURED: "—"}


def _short(rows: pd.DataFrame, claim: str, protocol: str, mode: str, importance: str) -> tuple[str, str]:
    """(verdict, compact cell "holds +0.173") of one main-variant full-range row, or not measured."""
    verdict, _ = _cell(rows, claim, protocol, mode, importance, evidence.PRIMARY["range"])
    found = _main(rows)
    found = found[(found["claim"] == claim) & (found["protocol"] == protocol) & (found["mode"] == mode)
                  & (found["importance"] == importance) & (found["range"] == evidence.PRIMARY["range"])]
    if found.empty or pd.isna(found.iloc[0].get("estimate")):
        return verdict, _SHORT.get(verdict, verdict)
    return verdict, f"{_SHORT.get(verdict, verdict)} {found.iloc[0]['estimate']:+.3f}"


def side_by_side(rows: pd.DataFrame, importance: str = "absolute") -> pd.DataFrame:
    """Table 1: the registered tests of both samples side by side (``rows``: findings.csv with its
    ``sample`` column): one row per model, data set and step (each under the protocol where it is
    measured) plus the ordering, one column per mode and sample, each cell the verdict and the paired
    AOPC difference in nats (full range; ``importance`` "absolute" is the registered |c|, "signed" the
    exploratory reading). An exploratory test computed before its registration is marked ``†``; a
    confirmatory cell not computed yet reads "—"."""
    from . import registration

    if "sample" not in rows:
        rows = rows.assign(sample=registration.EXPLORATORY)
    seen = {tuple(c) for c in registration.SEEN_BEFORE_REGISTRATION}
    steps = [(claim, next(p for lo, hi, p in evidence.PRIMARY["pairs"] if (lo, hi) == (a, b))) for claim, a, b in STEPS]
    out = []
    for model in evidence.PRIMARY["models"]:
        for data in evidence.PRIMARY["data"]:
            chains: dict = {}
            for claim, protocol in [*steps, ("ordering", "")]:
                row = {"model": model, "data": data, "step": claim.replace("step ", "").replace("->", "→")
                       .replace("contribution beats random", "4 vs random")}
                for mode in evidence.PRIMARY["modes"]:
                    for sample in registration.SAMPLES:
                        column = f"{mode[:4]}. {sample}"
                        if claim == "ordering":
                            row[column] = _SHORT.get(combine_all(chains.get(column, [])), "")
                            continue
                        part = rows[(rows["sample"] == sample) & (rows["model"] == model) & (rows["data"] == data)]
                        verdict, text = _short(part, claim, protocol, mode, importance)
                        if claim.startswith("step"):
                            chains.setdefault(column, []).append(verdict)
                        if sample == registration.EXPLORATORY and (model, data, protocol) in seen \
                                and verdict != NOT_MEASURED:
                            text += " †"
                        row[column] = text
                out.append(row)
    return pd.DataFrame(out)


def secondary_contradictions(rows: pd.DataFrame) -> pd.DataFrame:
    """Every exploratory (non-primary) ladder row on the language-modelling data sets that contradicts
    the paper: a step or contribution against random under the signed weight, the low range, a
    removal-unit or weights variant, or a protocol where the step is not registered. Columns ``model,
    data, step, mode, importance, range, variant, protocol, estimate, interval``."""
    from . import registration

    if "sample" in rows:
        rows = rows[rows["sample"] == registration.EXPLORATORY]
    claims = [claim for claim, *_ in STEPS]
    found = rows[rows["claim"].isin(claims) & ~rows["primary"].astype(bool) & (rows["verdict"] == "contradicted")
                 & rows["data"].isin(list(evidence.PRIMARY["data"]))]
    return pd.DataFrame({
        "model": found["model"], "data": found["data"],
        "step": found["claim"].str.replace("step ", "").str.replace("->", "→")
        .str.replace("contribution beats random", "4 vs random"),
        "mode": found["mode"], "importance": found["importance"].replace({"absolute": "|c|"}),
        "range": found["range"], "variant": found["variant"], "protocol": found["protocol"],
        "estimate": found["estimate"].round(3),
        "interval": [f"[{lo:+.3f}, {hi:+.3f}]" for lo, hi in zip(found["ci_low"], found["ci_high"])],
    }).reset_index(drop=True)
