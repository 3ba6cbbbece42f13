"""The paper's claims against what the book measured: one verdict per claim and model."""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from cwcore import stats
from cwcore.core.decomposition import METRICS
from . import registration, results_path
from cwcore.cache import atomic_write_bytes
from . import ladder as evidence
from .evidence_files import DEFAULT_OUT, HASH_FIELD, CommittedFileError, content_hash, read_pair
from cwcore.stats import (CONTRADICTED, HOLDS, INCONCLUSIVE, NEGLIGIBLE, NOT_MEASURED, VERDICTS, combine_all,
                    combine_verdicts)
from . import sink_claims
from cwcore.sinks.engine import EPS as _EPS_OPTION

_EPS = _EPS_OPTION.default  # the sink analyses' one eps (cwcore.sinks.engine.EPS)

__all__ = ["HOLDS", "CONTRADICTED", "NEGLIGIBLE", "INCONCLUSIVE", "NOT_MEASURED", "VERDICTS", "primary_decisions",
           "primary_ordering", "STEPS", "RUNGS", "CLAIMS", "held_models",
           "CHAPTERS", "CHAPTER_CLAIMS", "EVIDENCE_DIR", "ROW_KEYS", "beside", "SINK_RATES", "Finding", "Results", "ordering", "cosine_gain", "primary_cosine_gain",
           "from_claims", "sink_findings", "findings_table", "scoreboard", "verdict_counts",
           "save_results", "load_results", "model_findings", "not_built", "FAITHFULNESS_COLUMNS", "headline_ladder",
           "faithfulness_findings", "findings_csv", "combined_findings", "SAMPLE_FINDING_KEY", "CONFIRMATORY_DIR", "sample_folders", "BENCH_CHAPTER", "bench_findings", "claim_findings"]

RUNGS = tuple(map(str, METRICS))  # the ladder, from its one home

CLAIMS = {
    "ordering": "faithfulness: attention < value-weighted < output-normalised < contribution",
    "cosine_gain": "the cosine (rung 3 -> 4) is the largest gain",
    "ordering_sufficiency": "faithfulness (sufficiency): attention < value-weighted < output-normalised < contribution",
    "cosine_gain_sufficiency": "the cosine (rung 3 -> 4) is the largest gain (sufficiency)",
    "sink_rates": f"(the book's claim, not the paper's) many heads are sink heads (Sink_eps, eps = {_EPS:g})",
    "decomposition": "sink contribution driven by geometry, tail by attention and alignment",
    "sink_position": "(the book's check of the paper's reading) the sink is the first position",
    "anti_alignment": "the sink's value points against the semantic values",
    "anti_alignment_trend": "the stronger the sink, the stronger the anti-alignment",
    "suppression": "the sink suppresses the output norm",
    "convexity": "output norm convex in the sink rate, interior minimum",
    "semantic_cone": "removing the sink: low-norm outputs collapse into the semantic cone, PPL rises",
    "weak_token_drift": "noise from many weak tokens accumulates",
    "encoders": "contribution weights apply to encoders",
}

#: the chapters whose tables the findings page reads, and what each table is
CHAPTERS = {
    "04_faithfulness": "ladder",
    "05_sink_decomposition": "claims",
    "06_sinks_as_suppressors": "claims",
    "07_semantic_cone": "claims",
}

#: the claim "many heads are sink heads" (chapter 5 writes it through :func:`cwbook.sink_claims.rate_claims`)
SINK_RATES = sink_claims.SINK_RATES

# the chapters' claims behind each sink finding: a finding combines every part of those claims with
# the chapters' own verdicts, so a chapter and this page never judge the same claim differently
CHAPTER_CLAIMS = {
    "sink_rates": (SINK_RATES,),
    "sink_position": (sink_claims.SINK_POSITION_CLAIM,),
    "decomposition": (sink_claims.DECOMPOSITION,),
    "anti_alignment": (sink_claims.ANTI_ALIGNMENT,),
    "anti_alignment_trend": (sink_claims.TREND,),
    "suppression": (sink_claims.SUPPRESSION,),
    "convexity": (sink_claims.CONVEXITY,),
    "semantic_cone": (sink_claims.CONE, sink_claims.PERPLEXITY),
    "weak_token_drift": (sink_claims.DRIFT,),
}

# the chapter whose table holds each finding's numbers
_SOURCE = {"ordering": "04_faithfulness", "cosine_gain": "04_faithfulness",
           "ordering_sufficiency": "04_faithfulness", "cosine_gain_sufficiency": "04_faithfulness", "sink_rates": "05_sink_decomposition",
           "decomposition": "05_sink_decomposition", "anti_alignment": "06_sinks_as_suppressors",
           "anti_alignment_trend": "06_sinks_as_suppressors", "suppression": "06_sinks_as_suppressors",
           "convexity": "06_sinks_as_suppressors", "semantic_cone": "07_semantic_cone",
           "sink_position": "05_sink_decomposition", "weak_token_drift": "07_semantic_cone"}


@dataclass(frozen=True)
class Finding:
    """One claim on one model: its ``verdict`` (one of :data:`VERDICTS`), the numbers it rests on as
    text (``measured``) and the ``rule`` that turned them into the verdict."""

    claim: str
    verdict: str
    measured: str
    rule: str

    def row(self, model: str) -> dict:
        fields = {k: v for k, v in asdict(self).items() if k != "claim"}
        return {"model": model, "claim": CLAIMS.get(self.claim, self.claim), **fields, "key": self.claim}


def _fmt(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.3g}"


def _chapter_number(chapter: str) -> str:
    return str(int(chapter.split("_", 1)[0])) if chapter[:2].isdigit() else chapter


def not_built(claim: str, chapter: str) -> Finding:
    """The finding of a claim whose chapter's table is missing: not measured, and why."""
    return Finding(claim, NOT_MEASURED, f"not measured: chapter {_chapter_number(chapter)} was not built",
                   f"read from the table of {chapter}")


# ------------------------------------------------------------------------------------------------
# chapter 4: the faithfulness ladder
# ------------------------------------------------------------------------------------------------
def _side(mode: str) -> str:
    return "above" if mode == "comprehensiveness" else "below"


def _identical(row) -> bool:
    """Two rungs that rank identically by construction under the row's protocol
    (:func:`cwcore.faithfulness.protocol.identical_steps`), a property of the protocol, never of the
    numbers: the row's ``identical`` column where the ladder table has one, else the protocol read from
    its columns (``protocol``: a main protocol's name; ``unit``, ``scope``). Only a bare table with none of
    them falls back to the numbers (difference and interval exactly 0)."""
    from cwbook.ladder import PROTOCOLS
    from cwcore.faithfulness.protocol import Protocol, identical_steps

    get = row.get if hasattr(row, "get") else (lambda key, default=None: default)
    given = get("identical")
    if isinstance(given, (bool, np.bool_)) or given in (0, 1):
        return bool(given)
    if any(get(column) is not None for column in ("protocol", "unit", "scope")):
        change = PROTOCOLS.get(get("protocol", "default"), {})
        protocol = Protocol(unit=get("unit", "head_key"), scope=get("scope", "row"), **change)
        return (row["lower"], row["higher"]) in identical_steps(protocol)
    return row["difference"] == 0 and row["ci_low"] == 0 and row["ci_high"] == 0


def _judged(ladder: pd.DataFrame) -> pd.DataFrame:
    """``ladder`` with the pre-registered verdicts (:func:`cwbook.ladder.judge`) unless
    it carries them already (a ``margin`` column: chapter 4's tables do)."""
    if ladder is None or ladder.empty or "margin" in ladder:
        return ladder
    return evidence.judge(ladder)


def _pair_verdict(row, mode: str) -> str:
    """The ladder's own verdict of a pair; recomputed by :func:`cwcore.stats.verdict` (interval against
    0 on the claimed side) where the table has none in the project's vocabulary."""
    given = row.get("verdict") if hasattr(row, "get") else None
    if isinstance(given, str) and given in VERDICTS:
        return given
    return stats.verdict(row["ci_low"], row["ci_high"], threshold=0.0, side=_side(mode))


def _main(rows: pd.DataFrame) -> pd.DataFrame:
    """The main protocols' rows: a variant's (``token-unit``, ``requantized``, ...) are judged beside
    them, never in their place (a table without the column holds main rows only)."""
    return rows[rows["variant"].astype(object).fillna("main") == "main"] if "variant" in rows else rows


def _consecutive(ladder: pd.DataFrame, mode: str) -> pd.DataFrame:
    if "variant" in ladder and ladder["variant"].astype(object).fillna("main").nunique() > 1:
        ladder = _main(ladder)  # a table of several variants: judge the main one; one variant's slice as it is
    rows = ladder[ladder["mode"] == mode] if "mode" in ladder else ladder
    keep = [rows[(rows["lower"] == a) & (rows["higher"] == b)] for a, b in zip(RUNGS, RUNGS[1:])]
    return pd.concat(keep, ignore_index=True) if keep else rows.iloc[:0]


def _chain(name: str, steps: list[tuple[str, object]], mode: str, rule: str) -> Finding:
    """A chain of steps (``[(label, ladder row or None)]``) judged by :func:`cwcore.stats.combine_all`,
    the measured text naming every step's verdict and which steps hold."""
    if not steps:
        return Finding(name, NOT_MEASURED, "", rule)
    parts, texts = [], []
    for label, r in steps:
        if r is None:
            parts.append(NOT_MEASURED)
            texts.append(f"{label}: not in the table")
            continue
        v = _pair_verdict(r, mode)
        parts.append(v)
        texts.append(f"{label}: {_fmt(r['difference'])} [{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}] {v}")
    holding = [label for (label, _), v in zip(steps, parts) if v == HOLDS]
    summary = f"steps that hold: {', '.join(holding) if holding else 'none'}"
    return Finding(name, combine_all(parts), f"{mode}: " + "; ".join(texts) + f" ({summary})", rule)


def ordering(ladder: pd.DataFrame, mode: str = "comprehensiveness") -> Finding:
    """Rule: each consecutive pair of rungs (1-2, 2-3, 3-4) takes the ladder's verdict (its paired
    bootstrap interval of the AOPC difference against 0 on the claimed side — above for
    comprehensiveness, below for sufficiency —, negligible inside the mode's equivalence margin, not
    measured where the protocol ranks the two rungs identically: 2-3 under ``default``)."""
    rule = ("every consecutive rung pair's verdict (paired AOPC-difference interval against 0 on the claimed "
            "side, margin per mode, identical-by-construction pairs not measured), combined by "
            "cwcore.stats.combine_all: holds only when every step is measured and holds")
    pairs = _consecutive(_judged(ladder), mode)
    steps = [(f"{r['lower']}->{r['higher']}", r) for _, r in pairs.iterrows()]
    return _chain("ordering", steps, mode, rule)


def _primary_steps(ladder: pd.DataFrame, mode: str, data: str | None) -> list[tuple[str, object]]:
    """[(label, ladder row or None)] of the pre-registered steps (:data:`cwbook.ladder.PRIMARY`),
    each under the protocol where it is measured, at the headline importance and range, of ``data``
    (default: the table's first data set), the main variant's."""
    t = _judged(_with_defaults(ladder))
    t = t if t is None else _main(t)
    if t is None or t.empty:
        return []
    data = t["data"].iloc[0] if data is None else data
    t = t[(t["data"] == data) & (t["mode"] == mode) & (t["importance"] == evidence.PRIMARY["importance"])
          & (t["range"] == evidence.PRIMARY["range"])]
    steps = []
    for i, (a, b) in enumerate(zip(RUNGS, RUNGS[1:])):
        protocol = next(p for lo, hi, p in evidence.PRIMARY["pairs"] if (lo, hi) == (a, b))
        found = t[(t["lower"] == a) & (t["higher"] == b) & (t["protocol"] == protocol)]
        steps.append((f"{i + 1}->{i + 2} [{protocol}]", found.iloc[0] if len(found) else None))
    return steps


def primary_ordering(ladder: pd.DataFrame, mode: str = "comprehensiveness", *, data: str | None = None) -> Finding:
    """The ordering over the pre-registered steps (:data:`cwbook.ladder.PRIMARY`): each
    consecutive step under the protocol where it is measured (1->2 and 3->4 under ``default``, 2->3 under
    ``per-head``), at the headline importance and ratio range, of ``data`` (default: the table's first
    data set); combined by :func:`cwcore.stats.combine_all`."""
    rule = ("each pre-registered step under the protocol where it is measured (1->2, 3->4: default; 2->3: "
            "per-head), headline importance and range; holds only when every step is measured and holds")
    steps = _primary_steps(ladder, mode, data)
    if not steps:
        return Finding("ordering", NOT_MEASURED, "", rule)
    return _chain("ordering", steps, mode, rule)


COSINE_RULE = ("rung 3->4 AOPC gain against each other measured step (a step whose rungs rank identically by "
               "construction is left out): its interval above all others' (holds), below one of them "
               "(contradicted), overlapping (inconclusive); negligible when every step compared lies inside "
               "the mode's equivalence margin")


def _cosine_gain(pairs: pd.DataFrame, mode: str) -> Finding:
    """:data:`COSINE_RULE` over ``pairs`` (ladder rows of consecutive steps, judged)."""
    if pairs.empty or not (pairs["higher"] == "contribution").any():
        return Finding("cosine_gain", NOT_MEASURED, "", COSINE_RULE)
    pairs = pairs.reset_index(drop=True)
    identical = np.array([_identical(r) for _, r in pairs.iterrows()], dtype=bool)
    sign = 1.0 if mode == "comprehensiveness" else -1.0
    gain = sign * pairs["difference"].to_numpy(float)
    a, b = sign * pairs["ci_low"].to_numpy(float), sign * pairs["ci_high"].to_numpy(float)
    low, high = np.minimum(a, b), np.maximum(a, b)
    last = int(np.flatnonzero(pairs["higher"].to_numpy() == "contribution")[0])
    others = [i for i in range(len(pairs)) if i != last and not identical[i]]
    text = f"{mode}: " + ", ".join(
        f"{x}->{y} " + ("not measured (identical ranking by construction)" if same else
                        f"{_fmt(g)} [{_fmt(lo)}, {_fmt(hi)}]")
        for x, y, g, lo, hi, same in zip(pairs["lower"], pairs["higher"], gain, low, high, identical))
    bounds = [low[last], high[last], *(low[i] for i in others), *(high[i] for i in others)]
    if identical[last] or not others or not all(np.isfinite(bounds)):
        return Finding("cosine_gain", NOT_MEASURED, text, COSINE_RULE)
    compared = [last, *others]
    if all(_pair_verdict(pairs.iloc[i], mode) == NEGLIGIBLE for i in compared):
        verdict = NEGLIGIBLE
    elif all(low[last] > high[i] for i in others):
        verdict = HOLDS
    elif any(high[last] < low[i] for i in others):
        verdict = CONTRADICTED
    else:
        verdict = INCONCLUSIVE
    return Finding("cosine_gain", verdict, text, COSINE_RULE)


def cosine_gain(ladder: pd.DataFrame, mode: str = "comprehensiveness") -> Finding:
    """:data:`COSINE_RULE` over one protocol's consecutive rung pairs: the 3 -> 4 gain against every other
    measured pair (2 -> 3 under ``default`` is left out: its zero by construction would make the test one
    that cannot fail); not measured without the 3 -> 4 pair or another measured pair."""
    return _cosine_gain(_consecutive(_judged(ladder), mode), mode)


def primary_cosine_gain(ladder: pd.DataFrame, mode: str = "comprehensiveness", *, data: str | None = None) -> Finding:
    """:func:`cosine_gain` over the pre-registered steps, each under the protocol where it is measured
    (as :func:`primary_ordering`): the scoreboard's reading."""
    steps = [r for _, r in _primary_steps(ladder, mode, data) if r is not None]
    if not steps:
        return Finding("cosine_gain", NOT_MEASURED, "", COSINE_RULE)
    pairs = pd.DataFrame([dict(r) for r in steps])
    return _cosine_gain(pairs, mode)


FAITHFULNESS_COLUMNS = ["claim", "model", "data", "mode", "protocol", "importance", "range", "verdict", "estimate",
                        "ci_low", "ci_high", "n_units", "unit", "mde", "profile", "measured", "variant", "primary",
                        "margin", "p", "p_holm", "source", "sample", "prospective"]
#: whose claim a findings row tests (``source``): the paper's (chapter 4's ladder; the sink claims of its section on the value
#: geometry of attention sinks) or the book's own (the attribution bench, "many heads are sink heads", ...)
PAPER_CLAIM, BOOK_CLAIM = "paper", "book"

#: the slice of chapter 4's ladder that the scoreboard judges: the pre-registered headline importance
#: (``|c|``) and ratio range (book/preregistration.md); the steps each under the protocol where it is measured
HEADLINE = {"protocol": "default", "importance": evidence.PRIMARY["importance"], "range": evidence.PRIMARY["range"],
            "variant": "main"}

#: the ladder's steps as claims: (claim, lower rung, higher rung)
STEPS = (*((f"step {i + 1}->{i + 2}", a, b) for i, (a, b) in enumerate(zip(RUNGS, RUNGS[1:]))),
         ("contribution beats random", "random", "contribution"))


def _with_defaults(ladder: pd.DataFrame) -> pd.DataFrame:
    if ladder is None:
        return ladder
    ladder = ladder.copy()
    for column, default in (("data", ""), ("protocol", "default"), ("importance", "signed"), ("range", "full"),
                            ("variant", "main")):
        if column not in ladder:
            ladder[column] = default
    return ladder


def headline_ladder(ladder: pd.DataFrame) -> pd.DataFrame:
    """The scoreboard's slice of a stacked ladder table: its first data set, the default protocol, the
    headline importance and ratio range (each where the table has the column; an older single-slice
    table is returned as it is)."""
    rows = ladder
    if "data" in rows and len(rows):
        rows = rows[rows["data"] == rows["data"].iloc[0]]
    for column, value in HEADLINE.items():
        if column in rows and (rows[column] == value).any():
            rows = rows[rows[column] == value]
    return rows


def _step_row(r, mode: str) -> tuple[str, float, float, float, str]:
    identical = _identical(r)
    verdict = NOT_MEASURED if identical else _pair_verdict(r, mode)
    return verdict, float(r["difference"]), float(r["ci_low"]), float(r["ci_high"]), \
        ("identical ranking" if identical else verdict)


def faithfulness_findings(ladder: pd.DataFrame, *, model: str, profile: str | None = None) -> pd.DataFrame:
    """Every faithfulness claim of chapter 4's stacked ladder table, one row per claim x data set x mode x
    protocol x importance x ratio range (:data:`FAITHFULNESS_COLUMNS`)."""
    if ladder is None or ladder.empty:
        return pd.DataFrame(columns=FAITHFULNESS_COLUMNS)
    ladder = _judged(_with_defaults(ladder))
    rows = []
    keys = ["data", "protocol", "importance", "range", "mode", "variant"]
    for key, part in ladder.groupby(keys, sort=False, dropna=False):
        data, protocol, importance, rng, mode, variant = key
        base = {"model": model, "data": data, "mode": mode, "protocol": protocol, "importance": importance,
                "range": rng, "profile": profile, "variant": variant, "source": PAPER_CLAIM}
        for claim, lower, higher in STEPS:
            primary = variant == "main" and evidence.is_primary(model, data, mode, protocol, importance, rng,
                                                                 lower, higher)
            found = part[(part["lower"] == lower) & (part["higher"] == higher)]
            if found.empty:
                rows.append({**base, "claim": claim, "verdict": NOT_MEASURED, "measured": "pair not in the table",
                             "primary": primary})
                continue
            r = found.iloc[0]
            verdict = _pair_verdict(r, mode)
            est, low, high = float(r["difference"]), float(r["ci_low"]), float(r["ci_high"])
            why = " (identical ranking by construction)" if _identical(r) else ""
            rows.append({**base, "claim": claim, "verdict": verdict, "estimate": est, "ci_low": low, "ci_high": high,
                         "n_units": int(r["n"]), "unit": r.get("sample_unit", "sequence"),
                         "mde": float(r.get("mde", np.nan)), "primary": primary,
                         "margin": float(r.get("margin", np.nan)), "p": float(r.get("p", np.nan)),
                         "measured": f"{lower}->{higher}: {_fmt(est)} [{_fmt(low)}, {_fmt(high)}] {verdict}{why}"})
        n = int(part["n"].max())
        unit = part["sample_unit"].iloc[0] if "sample_unit" in part else "sequence"
        for finding in (ordering(part, mode), cosine_gain(part, mode)):
            rows.append({**base, "claim": finding.claim, "verdict": finding.verdict, "n_units": n, "unit": unit,
                         "measured": finding.measured, "primary": False})
    out = pd.DataFrame(rows, columns=FAITHFULNESS_COLUMNS)
    out["primary"] = out["primary"].astype(object).fillna(False).astype(bool)
    return out


def primary_decisions(table: pd.DataFrame, models: Sequence[str] | None = None) -> pd.DataFrame:
    """The pre-registered decision of the primary family in a findings table (:func:`findings_csv`).

    The family (:func:`cwbook.ladder.primary_family`) keeps its registered size: a member without a row or a
    p-value counts as p = 1. ``p_holm``: Holm's adjustment of the sign-flip ``p``. A member is negligible
    when its interval lies inside +-margin, else holds (contradicted) when ``p_holm`` < ALPHA with the
    estimate on the claimed (other) side, else inconclusive ("too small to decide" when ``mde`` > margin).
    One derived ``ordering`` row per model, data set and mode chains the three steps (not itself a test)."""
    if table is None or table.empty or "primary" not in table:
        return table
    out = table.copy()
    out["primary"] = out["primary"].astype(object).fillna(False).astype(bool)
    family = evidence.primary_family(models=[m for m in (models or evidence.PRIMARY["models"])])
    claim_of = {(lo, hi): c for c, lo, hi in STEPS}
    index, pvalues = [], []
    for member in family:
        hit = out.index[out["primary"] & (out["model"] == member["model"]) & (out["data"] == member["data"])
                        & (out["mode"] == member["mode"]) & (out["protocol"] == member["protocol"])
                        & (out["claim"] == claim_of[(member["lower"], member["higher"])])]
        index.append(hit[0] if len(hit) else None)
        pvalues.append(float(out.at[hit[0], "p"]) if len(hit) else np.nan)
    adjusted = stats.holm(pvalues)
    for i, p_holm in zip(index, adjusted):
        if i is None:
            continue
        out.at[i, "p_holm"] = p_holm
        r = out.loc[i]
        if r["verdict"] == NOT_MEASURED:
            continue
        side = 1.0 if r["mode"] == "comprehensiveness" else -1.0
        margin = float(r["margin"])
        if -margin < r["ci_low"] and r["ci_high"] < margin:
            v = NEGLIGIBLE
        elif p_holm < evidence.ALPHA and np.isfinite(r["estimate"]) and r["estimate"] != 0:
            v = HOLDS if side * r["estimate"] > 0 else CONTRADICTED
        else:
            v = INCONCLUSIVE
        note = f"; primary: sign-flip p = {_fmt(r['p'])}, Holm p = {_fmt(p_holm)} (family of {len(family)})"
        # the smallest detectable effect at the family's strictest Holm level (registered 2026-12-05)
        mde = stats.mde_at_level(float(r["mde"]), registration.MDE_LEVEL, from_alpha=evidence.ALPHA)
        out.at[i, "mde"] = mde
        if v == INCONCLUSIVE and np.isfinite(mde) and mde > margin:
            note += f"; too small to decide (mde {_fmt(mde)} at α/{len(family)} > margin {_fmt(margin)})"
        if v != r["verdict"]:
            note += f"; unadjusted interval verdict: {r['verdict']}"
        out.at[i, "verdict"] = v
        out.at[i, "measured"] = f"{r['measured']}{note}"
    chains = []
    primary = out[out["primary"]]
    for (model, data, mode, importance, rng), part in primary.groupby(["model", "data", "mode", "importance", "range"],
                                                                      sort=False):
        steps = []
        for claim, lower, higher in STEPS[:3]:
            found = part[part["claim"] == claim]
            r = found.iloc[0] if len(found) else None
            row = None if r is None else {"difference": r["estimate"], "ci_low": r["ci_low"], "ci_high": r["ci_high"],
                                          "verdict": r["verdict"]}
            steps.append((f"{claim.split()[-1]} [{r['protocol'] if r is not None else '?'}]", row))
        f = _chain("ordering", steps, mode, "")
        chains.append({"claim": "ordering", "model": model, "data": data, "mode": mode, "protocol": "primary steps",
                       "importance": importance, "range": rng, "verdict": f.verdict, "n_units": part["n_units"].max(),
                       "unit": part["unit"].iloc[0], "profile": part["profile"].iloc[0], "variant": "main",
                       "primary": False, "source": PAPER_CLAIM,
                       "measured": f"the pre-registered steps, Holm-decided: {f.measured}"})
    if chains:
        out = pd.concat([out, pd.DataFrame(chains, columns=FAITHFULNESS_COLUMNS)], ignore_index=True)
    return out


#: the attribution bench (chapter 4b): its paired comparisons join the faithfulness rows of findings.csv
BENCH_CHAPTER = "04b_attribution_bench"


def judged_bench(comparisons: pd.DataFrame) -> pd.DataFrame:
    """The bench's comparisons with the verdicts findings.csv gives them (:func:`bench_findings`): the registered
    interval and margin rule (:func:`cwbook.ladder.judge`), not measured where two methods ranked identically."""
    judged = _judged(comparisons)
    if judged is None or judged.empty:
        return judged
    return judged.assign(verdict=[_step_row(r, r["mode"])[0] for _, r in judged.iterrows()])


def bench_findings(comparisons: pd.DataFrame, *, model: str, profile: str | None = None) -> pd.DataFrame:
    """The attribution bench's paired comparisons (:func:`cwcore.faithfulness.ladder_comparison` with
    :func:`cwcore.faithfulness.method_pairs`, stacked over data sets and ratio ranges) as findings rows
    (:data:`FAITHFULNESS_COLUMNS`): claim ``"<higher> beats <lower>"``, its paired 95% interval against 0 on
    the mode's side (above for comprehensiveness, below for sufficiency); two methods that ranked identically
    (difference and interval exactly 0) are *not measured*, as the ladder's identical rungs. Judged by the
    ladder's rule (:func:`cwbook.ladder.judge`): negligible where the interval lies inside the mode's margin."""
    if comparisons is None or comparisons.empty:
        return pd.DataFrame(columns=FAITHFULNESS_COLUMNS)
    rows = []
    # the registered rule of the secondary rows: the ladder's interval and margin (negligible inside +-margin)
    for _, r in _judged(comparisons).iterrows():
        verdict, est, low, high, shown = _step_row(r, r["mode"])
        rows.append({"claim": f"{r['higher']} beats {r['lower']}", "model": model, "data": r.get("data", ""),
                     "mode": r["mode"], "protocol": r.get("protocol", "default"),
                     "importance": r.get("importance", "signed"), "range": r.get("range", "full"),
                     "verdict": verdict, "estimate": est, "ci_low": low, "ci_high": high, "n_units": int(r["n"]),
                     "unit": r.get("sample_unit", "sequence"), "mde": float(r.get("mde", np.nan)),
                     "margin": float(r.get("margin", np.nan)),
                     "profile": profile, "variant": r.get("variant", "main"), "primary": False,
                     "source": BOOK_CLAIM, "measured": f"chapter 4b, {r['lower']}->{r['higher']}: {_fmt(est)} [{_fmt(low)}, {_fmt(high)}] "
                                 f"{shown}"})
    return pd.DataFrame(rows, columns=FAITHFULNESS_COLUMNS)


def findings_csv(results_dir: str | os.PathLike, models: Sequence[str], profile: str | None = None) -> pd.DataFrame:
    """The downloadable findings table: :func:`faithfulness_findings` of chapter 4's table for every
    model (a model whose chapter 4 was not built gets one "not measured" row), followed by the
    attribution bench's rows (:func:`bench_findings` of chapter 4b's table, where it was built) but those
    chapter 4 measures (:func:`_not_in`), then the sink chapters' claims."""
    frames = []
    for model in models:
        got = load_results(results_dir, "04_faithfulness", model)
        if got is None:
            frames.append(pd.DataFrame([{"claim": "ordering", "model": model, "verdict": NOT_MEASURED,
                                         "profile": profile, "measured": "chapter 4 was not built"}],
                                       columns=FAITHFULNESS_COLUMNS))
        else:
            frames.append(faithfulness_findings(got.table, model=model, profile=got.metadata.get("profile", profile)))
    ladder = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=FAITHFULNESS_COLUMNS)
    for model in models:
        bench = load_results(results_dir, BENCH_CHAPTER, model)
        if bench is not None:
            rows = bench_findings(bench.table, model=model, profile=bench.metadata.get("profile", profile))
            frames.append(_not_in(rows, ladder))
    for model in models:
        for chapter, kind in CHAPTERS.items():
            got = load_results(results_dir, chapter, model) if kind == "claims" else None
            if got is not None:
                frames.append(claim_findings(got.table, model=model, profile=got.metadata.get("profile", profile)))
            elif kind == "claims" and not _weights_variant(model):  # its claims are not measured, and say so
                # (they were left out: 34 rows lost); a weights variant runs the ladder only
                claims = [claim for key, source in _SOURCE.items() if source == chapter
                          for claim in CHAPTER_CLAIMS.get(key, ())]
                frames.append(pd.DataFrame([{"claim": claim, "model": model, "verdict": NOT_MEASURED,
                                             "profile": profile,
                                             "measured": f"chapter {_chapter_number(chapter)} was not built"}
                                            for claim in dict.fromkeys(claims)], columns=FAITHFULNESS_COLUMNS))
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=FAITHFULNESS_COLUMNS)
    table = pd.concat(frames, ignore_index=True).drop(columns=["sample", "prospective"], errors="ignore")
    # as object first: a column no frame had is all-NaN float64, which pandas 4 will not fill with text or bools
    table["variant"] = table["variant"].astype(object).fillna("main").infer_objects()
    table["source"] = table["source"].astype(object).fillna(PAPER_CLAIM).infer_objects()
    table["primary"] = table["primary"].astype(object).fillna(False).astype(bool)
    return _with_sample(primary_decisions(_weights_variants(table)), profile)


def _with_sample(table: pd.DataFrame, profile: str | None) -> pd.DataFrame:
    """``sample`` (:func:`cwbook.registration.sample_of` the profile) and, on primary rows,
    ``prospective``: whether the test's cell was computed after its registration (every confirmatory test;
    the 10 exploratory tests outside :data:`cwbook.registration.SEEN_BEFORE_REGISTRATION`)."""
    sample = registration.sample_of(profile or "")
    table = table.assign(sample=sample)
    seen = {tuple(cell) for cell in registration.SEEN_BEFORE_REGISTRATION}
    table["prospective"] = [
        (sample == registration.CONFIRMATORY or (m, d, p) not in seen) if primary else None
        for primary, m, d, p in zip(table["primary"], table["model"], table["data"], table["protocol"])]
    return table


def held_models(folder: str | os.PathLike, models: Sequence[str]) -> list[str]:
    """``models`` and every other model ``folder`` holds a chapter table for (a weights variant such as
    ``smollm2-135m-requantized``): the models whose rows its ``findings.csv`` holds."""
    return list(dict.fromkeys([*models, *sorted({p.stem for p in Path(folder).glob("*/*.csv")})]))


def held_variants(folder: str | os.PathLike, models: Sequence[str]) -> list[str]:
    """``models`` and the weights variants of them that ``folder`` holds (``<model>-<variant>``), no other model:
    the rows a build of ``models`` can be set beside."""
    return [m for m in held_models(folder, models) if any(m == n or m.startswith(f"{n}-") for n in models)]


def combined_findings(exploratory_dir: str | os.PathLike, confirmatory_dir: str | os.PathLike | None,
                      models: Sequence[str], exploratory_profile: str = "evidence") -> pd.DataFrame:
    """``findings.csv`` of both samples: :func:`findings_csv` of the exploratory evidence folder, then the
    confirmatory folder's (where it holds a table), each primary family decided on its own sample. Each
    folder's rows cover ``models`` and every other model it holds a chapter table for (a weights variant
    such as ``smollm2-135m-requantized``), whichever folder's build writes the file."""
    parts = [findings_csv(exploratory_dir, held_models(exploratory_dir, models), exploratory_profile)]
    if confirmatory_dir is not None and any(Path(confirmatory_dir).glob("*/*.csv")):
        confirmatory = findings_csv(confirmatory_dir, held_models(confirmatory_dir, models), registration.CONFIRMATORY)
        measured = confirmatory["measured"].astype(object).fillna("").infer_objects()
        parts.append(confirmatory[~measured.str.endswith("was not built")])
    return pd.concat(parts, ignore_index=True)


#: what one row of findings.csv measures: no two rows share these values
FINDING_KEY = ["claim", "model", "data", "mode", "protocol", "importance", "range", "variant"]
#: the two samples' rows in one findings.csv (:func:`combined_findings`): no two rows share these values
SAMPLE_FINDING_KEY = [*FINDING_KEY, "sample"]


def _not_in(rows: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """``rows`` without those whose :data:`FINDING_KEY` ``measured`` already has: the bench's "contribution
    beats random" is chapter 4's claim, which the ladder measures on its own finer grid and random seeds,
    so findings.csv keeps the ladder's row (the bench's stays on its chapter page) and no key has two verdicts."""
    if rows.empty or measured.empty:
        return rows

    def keys(frame):
        frame = frame[FINDING_KEY].astype(object).fillna({"variant": "main"}).fillna("")
        return pd.MultiIndex.from_frame(frame.astype(str))

    return rows[~keys(rows).isin(keys(measured))]


def _weights_variant(model: str) -> bool:
    """Whether ``model`` names a packaged model's weights variant (``smollm2-135m-requantized``)."""
    from cwcore.models import VARIANTS as WEIGHTS_VARIANTS

    return any(str(model).endswith(f"-{name}") for name in WEIGHTS_VARIANTS)


def _weights_variants(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of a packaged model's weights variant (``<model>-<variant>``, :data:`cwcore.models.VARIANTS`,
    e.g. ``smollm2-135m-requantized``) as rows of that model with the variant named (``requantized``, or
    ``requantized+token-unit``); never primary (they were computed as other models' rows)."""
    from cwcore.models import VARIANTS as WEIGHTS_VARIANTS

    table = table.copy()
    for name in WEIGHTS_VARIANTS:
        rows = table["model"].astype(str).str.endswith(f"-{name}")
        if rows.any():
            table.loc[rows, "model"] = table.loc[rows, "model"].str[:-len(name) - 1]
            table.loc[rows, "variant"] = [name if v == "main" else f"{name}+{v}" for v in table.loc[rows, "variant"]]
            table.loc[rows, "primary"] = False
    return table


#: the committed evidence tables of this checkout (data/results/evidence: the chapters' tables of the
#: ``evidence`` profile, laid out as a results folder, with PROVENANCE); absent in an installed package
EVIDENCE_DIR = DEFAULT_OUT
#: the confirmatory sample's evidence (book/preregistration.md, "Confirmatory registration")
CONFIRMATORY_DIR = EVIDENCE_DIR.parent / "confirmatory"


def documents_per_data_set(results_dir: str | os.PathLike, chapter: str = "*", model: str = "*") -> str:
    """``"64 documents per data set"``: what the tables committed in ``results_dir`` (``chapter``'s, ``model``'s:
    glob patterns) record in their metadata (``n_documents``, or chapter 6's ``n_sequences``); ``"16 to 64
    documents per data set"`` where they differ; ``"no committed table here"`` where none records a count (an
    installed package)."""
    counts = set()
    for meta in Path(results_dir).glob(f"{chapter}/{model}.json"):
        parameters = json.loads(meta.read_text()).get("parameters", {})
        n = parameters.get("n_documents", parameters.get("n_sequences"))
        if n is not None:
            counts.add(int(n))
    if not counts:
        return "no committed table here"
    shown = str(min(counts)) if len(counts) == 1 else f"{min(counts)} to {max(counts)}"
    return f"{shown} documents per data set"


def sample_folders(out: str | os.PathLike, profile: str = "evidence") -> tuple[Path, Path]:
    """``(exploratory, confirmatory)``: the two samples' evidence folders that ``out`` (a folder of ``profile``)
    belongs to, ``out`` and its sibling (``evidence`` and ``confirmatory`` in ``data/results``). A folder
    elsewhere (a trial run in a temporary folder) pairs with its own sibling, never with this checkout's."""
    out = Path(out)
    if profile == registration.CONFIRMATORY:
        return out.parent / EVIDENCE_DIR.name, out
    return out, out.parent / CONFIRMATORY_DIR.name

#: the columns that name one findings row (a claim part, or one ladder step, of one model and data set)
ROW_KEYS = ["claim", "model", "data", "mode", "protocol", "importance", "range", "variant"]


def beside(live: pd.DataFrame, committed: pd.DataFrame, *, live_name: str = "live",
           committed_name: str = "evidence", verdicts: bool = False) -> pd.DataFrame:
    """Two findings tables (:func:`findings_csv`) side by side, row by row (:data:`ROW_KEYS`): for each
    of the two, ``<name>`` (estimate [low, high] verdict, as text), ``<name> n`` and ``<name> mde``
    (and ``<name> verdict`` with ``verdicts``); ``agree`` is True where both give the same verdict. Rows present
    in one table only are kept (the other side empty), so a claim measured at one size and not the other shows
    as such."""
    def side(table: pd.DataFrame, name: str) -> pd.DataFrame:
        if table is None or table.empty:
            return pd.DataFrame(columns=[*ROW_KEYS, name, f"{name} verdict", f"{name} n", f"{name} mde"])
        t = table.copy()
        for k in ROW_KEYS:
            if k not in t:  # a table written before the column existed
                t[k] = "main" if k == "variant" else ""
            t[k] = t[k].astype(object).fillna("main" if k == "variant" else "").astype(str)
        text = [f"{_fmt(e)} [{_fmt(lo)}, {_fmt(hi)}] {v}" if np.isfinite(e) else str(v)
                for e, lo, hi, v in zip(t["estimate"], t["ci_low"], t["ci_high"], t["verdict"])]
        return pd.DataFrame({**{k: t[k] for k in ROW_KEYS}, name: text, f"{name} verdict": t["verdict"],
                             f"{name} n": t["n_units"], f"{name} mde": t["mde"]}).drop_duplicates(ROW_KEYS)

    out = side(live, live_name).merge(side(committed, committed_name), on=ROW_KEYS, how="outer", sort=False)
    out["agree"] = out[f"{live_name} verdict"] == out[f"{committed_name} verdict"]
    return out if verdicts else out.drop(columns=[f"{live_name} verdict", f"{committed_name} verdict"])


def claim_findings(claims: pd.DataFrame, *, model: str, profile: str | None = None) -> pd.DataFrame:
    """The sink chapters' claims tables (:mod:`cwbook.sink_claims` columns, data sets stacked with
    :func:`cwbook.sink_claims.stack_data`) as findings rows (:data:`FAITHFULNESS_COLUMNS`): one row per
    claim part and data set, with the part's own verdict, estimate and interval."""
    if claims is None or claims.empty:
        return pd.DataFrame(columns=FAITHFULNESS_COLUMNS)
    rows = []
    for _, r in claims.iterrows():
        key = str(r.get("key", ""))
        data, _, key = key.rpartition("/")
        part = str(r["part"])
        if data and part.startswith(f"{data}: "):
            part = part[len(data) + 2:]
        verdict = _part_verdict(r)
        why = _why(r)
        shown = f"{verdict}: {why}" if verdict == NOT_MEASURED and why else verdict
        unit = r.get("unit")
        has_unit = isinstance(unit, str) and unit != ""  # tables written before claims carried their unit
        n_units = r.get("n_units") if has_unit else r.get("n")
        rows.append({"claim": r["claim"], "model": model, "data": data, "mode": "", "protocol": part,
                     "importance": "", "range": "", "verdict": verdict, "estimate": float(r["estimate"]),
                     "ci_low": float(r["low"]), "ci_high": float(r["high"]),
                     "n_units": int(n_units) if pd.notna(n_units) else 0, "unit": unit if has_unit else "",
                     "mde": stats.detectable_from_interval(float(r["low"]), float(r["high"])), "profile": profile,
                     "variant": "main", "primary": False,
                     "source": BOOK_CLAIM if r.get("source") == sink_claims.BOOK else PAPER_CLAIM,
                     "measured": f"chapter {r['chapter']}, {part} ({r.get('statistic', '')}): {_fmt(r['estimate'])} [{_fmt(r['low'])}, "
                                 f"{_fmt(r['high'])}] {shown}"})
    return pd.DataFrame(rows, columns=FAITHFULNESS_COLUMNS)


# ------------------------------------------------------------------------------------------------
# chapters 5-7: the sinks' claims tables
# ------------------------------------------------------------------------------------------------
def _part_verdict(row) -> str:
    """A claims row's verdict (recomputed by :func:`cwcore.stats.verdict` of its interval against its
    threshold if the table's is not in the project's vocabulary)."""
    given = row["verdict"] if "verdict" in row else None
    if isinstance(given, str) and given in VERDICTS:
        return given
    return stats.verdict(row["low"], row["high"], threshold=row["threshold"], side=row["side"])


def _why(row) -> str:
    """What a claims row says the model lacked (its ``why``; "" if none, also in tables written without it)."""
    why = row.get("why") if hasattr(row, "get") else None
    return why if isinstance(why, str) and why and why != "nan" else ""


def from_claims(claim: str, claims: pd.DataFrame) -> Finding:
    """The finding ``claim`` (a key of :data:`CHAPTER_CLAIMS`) from a claims table: the verdicts of the
    parts of its chapter claims combined by :func:`cwcore.stats.combine_verdicts`, with every part's
    estimate, interval and verdict as the measured text."""
    rows = claims[claims["claim"].isin(CHAPTER_CLAIMS[claim])]
    verdicts = [_part_verdict(r) for _, r in rows.iterrows()]
    measured = "; ".join(f"{r['part']}: " + (f"{v}: {_why(r)}" if v == NOT_MEASURED and _why(r) else
                                             f"{_fmt(r['estimate'])} [{_fmt(r['low'])}, {_fmt(r['high'])}] {v}")
                         for (_, r), v in zip(rows.iterrows(), verdicts))
    chapters = ", ".join(str(c) for c in dict.fromkeys(rows["chapter"])) or "5-7"
    rule = (f"chapter {chapters}: every part's 95% interval against its threshold on the claimed side, "
            "combined by cwcore.stats.combine_verdicts")
    return Finding(claim, combine_verdicts(verdicts) if verdicts else NOT_MEASURED, measured, rule)


def sink_findings(claims: pd.DataFrame) -> list[Finding]:
    """The sink findings (every key of :data:`CHAPTER_CLAIMS`) from the chapters' claims tables, stacked."""
    return [from_claims(key, claims) for key in CHAPTER_CLAIMS]


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------
def findings_table(findings: Mapping[str, Sequence[Finding]]) -> pd.DataFrame:
    """One row per (model, claim): ``model, claim, verdict, measured, rule, key``."""
    rows = [f.row(model) for model, items in findings.items() for f in items]
    return pd.DataFrame(rows, columns=["model", "claim", "verdict", "measured", "rule", "key"])


def scoreboard(table: pd.DataFrame) -> pd.DataFrame:
    """Claims by model, verdicts as cells."""
    return table.pivot(index="claim", columns="model", values="verdict").reindex(
        [c for c in dict.fromkeys(table["claim"])])


def verdict_counts(table: pd.DataFrame, model: str) -> dict[str, int]:
    """How many claims of ``model`` got each verdict, in the order of :data:`VERDICTS`."""
    mine = table.loc[table["model"] == model, "verdict"]
    return {v: int((mine == v).sum()) for v in VERDICTS}


# ------------------------------------------------------------------------------------------------
# the tables chapters write and the findings page reads
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Results:
    """A chapter's table as read back: the ``table`` and its ``metadata`` (chapter, model, profile and
    the parameters the chapter ran with)."""

    table: pd.DataFrame
    metadata: dict


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def save_results(results_file: str | os.PathLike | None, table: pd.DataFrame, *, chapter: str,
                 model: str | None = None, profile: str | None = None,
                 parameters: Mapping | None = None) -> Path | None:
    """Write a chapter's table to ``results_file`` (CSV) and its metadata beside it (``.json``), each
    atomically, the metadata last."""
    if results_file is None:
        return None
    path = Path(results_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = table.to_csv(index=False).encode()
    atomic_write_bytes(path, data)
    meta = {"chapter": chapter, "model": model, "profile": profile, "columns": list(map(str, table.columns)),
            "parameters": _jsonable(dict(parameters or {})), HASH_FIELD: content_hash(data)}
    atomic_write_bytes(path.with_suffix(".json"), (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
    return path


def load_results(results_dir: str | os.PathLike, chapter: str, model: str | None = None) -> Results | None:
    """The table ``chapter`` wrote for ``model`` into ``results_dir`` (:func:`save_results`), or None
    when it is missing (the chapter was not built) or unfinished (no metadata yet)."""
    path = results_path(results_dir, chapter, model)
    meta = path.with_suffix(".json")
    if meta.is_file() and not path.is_file():  # the table is written first: its loss is no interrupted write
        raise CommittedFileError(f"{meta.name} has no {path.name} beside it: restore it from git or rebuild the "
                                 "chapter")
    if not path.is_file() or not meta.is_file():
        return None
    data, metadata = read_pair(path, meta)
    return Results(pd.read_csv(io.BytesIO(data), keep_default_na=True), metadata)


def results_verified(results_file: str | os.PathLike) -> bool:
    """Whether a chapter's table and its metadata exist and agree (:func:`save_results`'s hash)."""
    path = Path(results_file)
    try:
        read_pair(path, path.with_suffix(".json"))
    except (CommittedFileError, FileNotFoundError):
        return False
    return True


def model_findings(results_dir: str | os.PathLike, model: str) -> tuple[list[Finding], dict[str, Results]]:
    """Every finding of ``model`` from the chapters' tables in ``results_dir``, and the tables read."""
    read = {chapter: load_results(results_dir, chapter, model) for chapter in CHAPTERS}
    found = {k: v for k, v in read.items() if v is not None}
    out: list[Finding] = []
    ladder = found.get("04_faithfulness")
    faith_keys = ("ordering", "cosine_gain", "ordering_sufficiency", "cosine_gain_sufficiency")
    if ladder is None:
        out += [not_built(key, "04_faithfulness") for key in faith_keys]
    else:
        judged = _judged(_with_defaults(ladder.table))
        for mode, (o, c) in (("comprehensiveness", faith_keys[:2]), ("sufficiency", faith_keys[2:])):
            found_o, found_c = primary_ordering(judged, mode), primary_cosine_gain(judged, mode)
            out += [Finding(o, found_o.verdict, found_o.measured, found_o.rule),
                    Finding(c, found_c.verdict, found_c.measured, found_c.rule)]
    claims = [r.table for c, r in found.items() if CHAPTERS[c] == "claims"]
    claims = pd.concat(claims, ignore_index=True) if claims else pd.DataFrame(columns=sink_claims.COLUMNS)
    for key in CHAPTER_CLAIMS:
        source = _SOURCE[key]
        out.append(from_claims(key, claims) if source in found else not_built(key, source))
    out.append(Finding("encoders", NOT_MEASURED, "chapter 8 computes contribution maps of an encoder (minilm-l6)",
                       "not judged here"))
    return out, found
