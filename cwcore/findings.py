"""The paper's claims against what the book measured: one verdict per claim and model.

Each function takes the tables the chapters compute (:func:`cwcore.faithfulness.ladder_comparison`,
:func:`cwcore.sinks.summarize` rows ``claim, statistic, value``, the claims tables of
:mod:`cwcore.sink_claims` that chapters 5-7 show) and returns a :class:`Finding`: the verdict (one of
:data:`VERDICTS`), the numbers it rests on, as text, and the rule. :func:`findings_table` stacks them.
The sink findings reuse the chapters' verdicts (:func:`from_claims`), so the findings page and a
chapter never judge the same claim differently.

Verdicts
--------
``"agrees"``: every part of the claim holds by its rule; ``"partly"``: some parts hold, or the
evidence points the claimed way without excluding the alternative; ``"does not reproduce"``: no part
holds; ``"not measured"``: the numbers are missing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from . import sink_claims, sinks

AGREES, PARTLY, NO, UNMEASURED = "agrees", "partly", "does not reproduce", "not measured"
VERDICTS = (AGREES, PARTLY, NO, UNMEASURED)
RUNGS = ("attention", "value_weighted", "value_weighted_output_normalized", "contribution")

CLAIMS = {
    "ordering": "faithfulness: attention < value-weighted < output-normalised < contribution",
    "cosine_gain": "the cosine (rung 3 -> 4) is the largest gain",
    "sink_rates": "many heads are sink heads (Sink_eps, eps = 0.3)",
    "decomposition": "sink contribution driven by geometry, tail by attention",
    "anti_alignment": "the sink's value points against the semantic values",
    "anti_alignment_trend": "the stronger the sink, the stronger the anti-alignment",
    "suppression": "the sink suppresses the output norm",
    "convexity": "output norm convex in the sink rate, interior minimum",
    "semantic_cone": "removing the sink: low-norm outputs collapse into the semantic cone, PPL rises",
    "encoders": "contribution weights apply to encoders",
}


@dataclass(frozen=True)
class Finding:
    claim: str
    verdict: str
    measured: str
    rule: str

    def row(self, model: str) -> dict:
        return {"model": model, "claim": CLAIMS.get(self.claim, self.claim), **{k: v for k, v in asdict(self).items()
                                                                                if k != "claim"}, "key": self.claim}


def _fmt(x: float) -> str:
    return "nan" if not np.isfinite(x) else f"{x:.3g}"


def _identical(row) -> bool:
    """Two rungs whose rankings were identical (same forwards): difference exactly 0, zero-width interval."""
    return row["difference"] == 0 and row["ci_low"] == 0 and row["ci_high"] == 0


def _consecutive(ladder: pd.DataFrame, mode: str) -> pd.DataFrame:
    rows = ladder[ladder["mode"] == mode] if "mode" in ladder else ladder
    pairs = list(zip(RUNGS, RUNGS[1:]))
    keep = [rows[(rows["lower"] == a) & (rows["higher"] == b)] for a, b in pairs]
    return pd.concat(keep, ignore_index=True) if keep else rows.iloc[:0]


def ordering(ladder: pd.DataFrame, mode: str = "comprehensiveness") -> Finding:
    """Rule: each consecutive pair of rungs (1-2, 2-3, 3-4) is judged by its paired bootstrap interval
    of the AOPC difference (``ladder_comparison``'s ``verdict``: "holds" when the interval excludes 0 on
    the claimed side). A pair whose two rungs ranked identically (difference and interval exactly 0:
    rungs 2 and 3 under the default protocol) cannot be tested and is left out. Agrees: every tested
    pair holds; partly: some do; does not reproduce: none does."""
    rule = ("each consecutive rung pair's paired AOPC-difference interval on the claimed side of 0 "
            "(identically ranked pairs left out)")
    pairs = _consecutive(ladder, mode)
    if pairs.empty:
        return Finding("ordering", UNMEASURED, "", rule)
    tested = pairs[[not _identical(r) for _, r in pairs.iterrows()]]
    parts = [f"{r['lower']}->{r['higher']}: {_fmt(r['difference'])} [{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}] "
             f"{r['verdict'] if not _identical(r) else 'identical ranking'}" for _, r in pairs.iterrows()]
    if tested.empty:
        return Finding("ordering", UNMEASURED, "; ".join(parts), rule)
    held = int((tested["verdict"] == "holds").sum())
    verdict = AGREES if held == len(tested) else PARTLY if held else NO
    return Finding("ordering", verdict, f"{mode}: " + "; ".join(parts), rule)


def cosine_gain(ladder: pd.DataFrame, mode: str = "comprehensiveness") -> Finding:
    """Rule: among the consecutive rung pairs, the 3 -> 4 difference (in the claimed direction) is the
    largest point estimate (partly) and its interval lies entirely beyond every other pair's interval
    (agrees); not the largest: does not reproduce."""
    rule = "rung 3->4 AOPC gain largest; its interval above the others' (agrees) or only its estimate (partly)"
    pairs = _consecutive(ladder, mode)
    if pairs.empty or not (pairs["higher"] == "contribution").any():
        return Finding("cosine_gain", UNMEASURED, "", rule)
    sign = 1.0 if mode == "comprehensiveness" else -1.0
    gain = sign * pairs["difference"].to_numpy(float)
    low = np.minimum(sign * pairs["ci_low"].to_numpy(float), sign * pairs["ci_high"].to_numpy(float))
    high = np.maximum(sign * pairs["ci_low"].to_numpy(float), sign * pairs["ci_high"].to_numpy(float))
    last = int(np.flatnonzero(pairs["higher"].to_numpy() == "contribution")[0])
    others = [i for i in range(len(pairs)) if i != last]
    text = f"{mode}: " + ", ".join(f"{a}->{b} {_fmt(g)}" for a, b, g in zip(pairs["lower"], pairs["higher"], gain))
    if not others:
        return Finding("cosine_gain", UNMEASURED, text, rule)
    if all(gain[last] > gain[i] for i in others):
        verdict = AGREES if all(low[last] > high[i] for i in others) else PARTLY
    else:
        verdict = NO
    return Finding("cosine_gain", verdict, text, rule)


def _stat(summary: pd.DataFrame, statistic: str) -> float:
    row = summary[summary["statistic"] == statistic]
    return float(row["value"].iloc[0]) if len(row) else np.nan


def sink_rates(summary: pd.DataFrame, majority: float = 0.5) -> Finding:
    """Rule: Sink_eps above ``majority`` of heads agrees; above 0 partly; no sink head: does not reproduce."""
    rule = f"Sink_eps > {majority:g}: agrees; > 0: partly; 0: does not reproduce"
    s = _stat(summary, "sink_eps")
    if not np.isfinite(s):
        return Finding("sink_rates", UNMEASURED, "", rule)
    verdict = AGREES if s > majority else PARTLY if s > 0 else NO
    return Finding("sink_rates", verdict, f"Sink_eps {_fmt(s)}, mean sink rate {_fmt(_stat(summary, 'mean_sink_rate'))}",
                   rule)


def _from_verdict(claim: str, chapter_verdict: str | None, measured: str, rule: str) -> Finding:
    """Map a chapter's verdict (:func:`cwcore.sinks.verdict` / ``combine_verdicts`` strings) to ours."""
    mapping = {"holds": AGREES, "holds partly": PARTLY, "inconclusive": PARTLY, "does not hold": NO}
    if chapter_verdict is None or chapter_verdict not in mapping:
        return Finding(claim, UNMEASURED, measured, rule)
    return Finding(claim, mapping[chapter_verdict], measured, rule)


def from_chapter(claim: str, chapter_verdict: str | None, measured: str = "") -> Finding:
    """A claim judged in a chapter by the sinks rule (interval against a threshold): holds -> agrees,
    holds partly / inconclusive -> partly, does not hold -> does not reproduce."""
    return _from_verdict(claim, chapter_verdict, measured,
                         "the chapter's rule (cwcore.sinks.verdict: 95% interval against the threshold)")


def findings_table(findings: dict[str, list[Finding]]) -> pd.DataFrame:
    """One row per (model, claim): ``model, claim, verdict, measured, rule, key``."""
    rows = [f.row(model) for model, items in findings.items() for f in items]
    return pd.DataFrame(rows, columns=["model", "claim", "verdict", "measured", "rule", "key"])


def scoreboard(table: pd.DataFrame) -> pd.DataFrame:
    """Claims by model, verdicts as cells."""
    return table.pivot(index="claim", columns="model", values="verdict").reindex(
        [c for c in dict.fromkeys(table["claim"])])


# ------------------------------------------------------------------------------------------------
# section 6: from the rows of cwcore.sinks.summarize (claim, statistic, value)
# ------------------------------------------------------------------------------------------------
def sink_tables(results: dict) -> dict[str, pd.DataFrame]:
    """The tables :func:`cwcore.sinks.summarize` reads, from :func:`cwcore.sinks.run_analyses`' results
    (as the sinks command line names them)."""
    names = {"decomposition": ("decomposition", "decomposition-sample"),
             "convexity": ("convexity", "convexity-curves"),
             "semantic_cone": ("semantic_cone", "semantic_cone-heads", "semantic_cone-ppl")}
    tables = {}
    for name, result in results.items():
        if name == "raw":
            continue
        if name in names:
            tables.update(zip(names[name], tuple(result)))
        else:
            tables[name] = result
    return tables


# the chapters' claims (cwcore.sink_claims) behind each finding: a finding agrees when every part of those
# claims holds by the chapter's interval rule, so the chapters and this table never disagree
CHAPTER_CLAIMS = {
    "decomposition": (sink_claims.DECOMPOSITION,),
    "anti_alignment": (sink_claims.ANTI_ALIGNMENT,),
    "anti_alignment_trend": (sink_claims.TREND,),
    "suppression": (sink_claims.SUPPRESSION,),
    "convexity": (sink_claims.CONVEXITY,),
    "semantic_cone": (sink_claims.CONE, sink_claims.PERPLEXITY),
}


def from_claims(claim: str, claims: pd.DataFrame) -> Finding:
    """The finding ``claim`` (a key of :data:`CHAPTER_CLAIMS`) from a claims table of
    :mod:`cwcore.sink_claims`: the parts of its chapter claims combined by
    :func:`cwcore.sinks.combine_verdicts` (holds -> agrees, holds partly / inconclusive -> partly, does
    not hold -> does not reproduce), with every part's estimate and interval as the measured text."""
    rows = claims[claims["claim"].isin(CHAPTER_CLAIMS[claim])]
    measured = "; ".join(f"{r['part']}: {_fmt(r['estimate'])} [{_fmt(r['low'])}, {_fmt(r['high'])}] {r['verdict']}"
                         for _, r in rows.iterrows())
    combined = sinks.combine_verdicts(list(rows["verdict"])) if len(rows) else None
    chapters = ", ".join(str(c) for c in dict.fromkeys(rows["chapter"])) or "5-7"
    return _from_verdict(claim, combined, measured,
                         f"chapter {chapters}: every part's 95% interval on the claimed side of its threshold "
                         "(cwcore.sink_claims)")


def sink_findings(summary: pd.DataFrame, claims: pd.DataFrame) -> list[Finding]:
    """The sink findings: the rate of sink heads from ``summary`` (:func:`cwcore.sinks.summarize`), the
    others from the chapters' ``claims`` (:func:`cwcore.sink_claims.all_claims`)."""
    return [sink_rates(summary), *(from_claims(key, claims) for key in CHAPTER_CLAIMS)]
