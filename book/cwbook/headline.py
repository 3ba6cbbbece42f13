"""What the evidence decided, told in plain sentences, and a picture of every verdict."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from cwcore import stats
from . import ladder as evidence
from . import registration
from .confirmatory import ladder_progress
from .evidence_files import read_checked_csv
from .findings import CONFIRMATORY_DIR, EVIDENCE_DIR, load_results, sample_folders

REPO = Path(__file__).resolve().parents[2]
START, END = "<!-- headline:start -->", "<!-- headline:end -->"
#: the ladder's steps in words, by findings.csv's claim
STEP_NAMES = {"step 1->2": "step 1 → 2 (attention → value-weighted)",
              "step 2->3": "step 2 → 3 (value-weighted → output-normalised)",
              "step 3->4": "step 3 → 4 (output-normalised → contribution weights)",
              "contribution beats random": "contribution weights against random"}
_ORDER_STEPS = ("step 1->2", "step 2->3", "step 3->4")
# the registered data sets as a reader reads them (the sentences; the verdict grid's columns shorten "web text")
DATA_NAMES = {"gsm8k": "GSM8K", "web-text": "web text"}
#: the registered sink claims' parts in words (their keys are the chapters' tables')
PART_WORDS = {
    "sink_eps_by_layer": "the share of sink heads", "sink_geometry_margin_by_layer": "the sink's geometry share",
    "tail_alpha_share": "the tail's attention share", "tail_cosine_share": "the tail's alignment share",
    "sink_geometry_minus_null": "the null baseline (a random key)", "cos_semantic": "the sink's cosine with the semantic component",
    "contrast": "the random-key control", "cos_semantic_centred": "the centred-values control",
    "rho_semantic": "the rank correlation", "shortened": "the share of shortened outputs",
    "share_vertex_inside": "the share of heads with an interior minimum",
    "share_interior_minus_random_direction": "the random-direction control",
    "dcos_sink_q1": "the turn towards the cone axis", "dcos_sink_minus_control": "the random-token control",
    "dcos_sink_minus_mass": "the mass-matched control", "dcos_sink_minus_random_direction": "the random-direction control",
    "dlog_sink": "the rise of log-perplexity", "dlog_sink_minus_control": "the random-token control",
    "dlog_sink_minus_mass": "the mass-matched control", "drift_weak_q1": "the drift of weak tokens",
    "drift_null_q1": "the random-tail null"}
_SINK_CHAPTERS = ("05_sink_decomposition", "06_sinks_as_suppressors", "07_semantic_cone")


def primary_rows(findings: pd.DataFrame, sample: str) -> pd.DataFrame:
    """The primary family's rows of ``sample`` (each step under the protocol where it is measured, |c|,
    full range, main variant)."""
    if "sample" not in findings:
        findings = findings.assign(sample=registration.EXPLORATORY)
    rows = findings[(findings["sample"] == sample) & findings["primary"].astype(bool)]
    return rows.reset_index(drop=True)


def _count(verdicts) -> str:
    counts = pd.Series(list(verdicts)).value_counts()
    return ", ".join(f"{int(counts[v])} {v}" for v in stats.VERDICTS if v in counts)


def _tally(verdicts) -> str:
    """``"contradicted in 8 of 8"`` or ``"holds in 2, contradicted in 5 and inconclusive in 1 of 8"``."""
    verdicts = list(verdicts)
    counts = pd.Series(verdicts).value_counts()
    parts = [f"{v} in {int(counts[v])}" for v in stats.VERDICTS if v in counts]
    joined = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{joined} of {len(verdicts)}" if len(parts) == 1 else joined

def ordering_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per model, data set and mode of the primary ``rows``: each step's verdict and the ordering
    (:func:`cwcore.stats.combine_all` of the three steps; not measured where a step is missing)."""
    out = []
    models = list(dict.fromkeys(rows["model"])) or list(evidence.PRIMARY["models"])
    for model in models:
        for data in evidence.PRIMARY["data"]:
            for mode in evidence.PRIMARY["modes"]:
                one = rows[(rows["model"] == model) & (rows["data"] == data) & (rows["mode"] == mode)]
                found = dict(zip(one["claim"], one["verdict"]))
                steps = {claim: found.get(claim, stats.NOT_MEASURED) for claim in [*_ORDER_STEPS, "contribution beats random"]}
                out.append({"model": model, "data": data, "mode": mode, **steps,
                            "ordering": stats.combine_all([steps[c] for c in _ORDER_STEPS])})
    return pd.DataFrame(out)


def _model_sentence(model: str, summary: pd.DataFrame) -> str:
    """How the ordering fares on one model, and which step decides it."""
    one = summary[summary["model"] == model]
    cells = len(one)
    ordering = one["ordering"].value_counts()
    if ordering.get(stats.NOT_MEASURED, 0) == cells:
        return f"**{model}**: not computed yet."
    said = f"**{model}**, the ordering over its {cells} cells (data set x mode): {_tally(one['ordering'])}"
    against = [c for c in _ORDER_STEPS if (one[c] == stats.CONTRADICTED).any()]
    if not against:
        return said + "; no step contradicts it."
    parts = []
    for claim in _ORDER_STEPS:
        parts.append(f"{claim.replace('step ', '').replace('->', ' → ')} {_tally(one[claim])}")
    if len(against) == 1:
        others_hold = all((one[c] == stats.HOLDS).all() for c in _ORDER_STEPS if c != against[0])
        lead = (f"; the contradiction rests on {STEP_NAMES[against[0]]} alone"
                + (", every other step holds in every cell" if others_hold else ""))
    else:
        lead = "; it is contradicted by " + ", ".join(STEP_NAMES[c] for c in against)
    return said + lead + " (" + "; ".join(parts) + ")."


def progress_clause(progress: Sequence[dict] | None) -> str:
    """How far a sample's ladder cells are computed (``progress``: :func:`cwbook.confirmatory.ladder_progress`'s
    rows, or a model's share of them), as a clause; "" without progress."""
    if not progress:
        return ""
    n = registration.CONFIRMATORY_DOCUMENTS
    complete = sum(cell["documents"] == n for cell in progress)
    partly = sum(0 < cell["documents"] < n for cell in progress)
    if complete == len(progress):
        return (f"all {complete} of its ladder cells (model x data set x mode) hold all {n} documents; the tables "
                "step (`python -m cwbook.confirmatory tables`) judges the tests")
    return (f"{complete} of its {len(progress)} ladder cells (model x data set x mode) hold all {n} documents"
            + (f" and {partly} more {'is' if partly == 1 else 'are'} partly computed" if partly else "")
            + "; the tests are judged once every cell is in")


def ladder_sentences(findings: pd.DataFrame, sample: str, progress: Sequence[dict] | None = None) -> list[str]:
    """The faithfulness ladder's headline on ``sample``: how many of the 32 tests are judged (an inconclusive
    verdict is a judgement, not a decision: each verdict is counted by name), the
    ordering per model with the step that decides it, and contribution weights against random. ``progress``:
    the sample's cells as :func:`cwbook.confirmatory.ladder_progress` gives them, said while none is judged."""
    rows = primary_rows(findings, sample)
    family = len(evidence.primary_family())
    measured = rows[rows["verdict"] != stats.NOT_MEASURED]
    if measured.empty:
        clause = progress_clause(progress)
        return [f"None of the {family} registered tests is judged on this sample yet"
                + (f": {clause}." if clause else ".")]
    summary = ordering_summary(rows)
    lines = [f"{len(measured)} of the {family} registered tests are judged ({_count(measured['verdict'])}; "
             f"Holm-adjusted over the family, |c|, full ratio range). The paper's ordering "
             f"1 < 2 < 3 < 4 over its {len(summary)} cells (model x data set x mode): {_tally(summary['ordering'])}."]
    lines += [_model_sentence(model, summary) for model in dict.fromkeys(summary["model"])]
    beats = summary["contribution beats random"]
    lines.append(f"Contribution weights against a random ranking, {len(beats)} cells: {_tally(beats)}.")
    return lines


def _step_place(model: str, data: str, mode: str, claim: str) -> str:
    return f"{model}, {DATA_NAMES.get(data, data)}, {mode}, {STEP_NAMES.get(claim, claim)}"


def ladder_agreement(findings: pd.DataFrame) -> str:
    """The confirmatory sample's judged tests beside the exploratory sample's: the same verdict in how many
    of the tests judged on both, and each one that differs (exploratory verdict "there", confirmatory
    "here"); "" while the confirmatory sample judges none. Descriptive: the registered rule decides each
    sample on its own, this counts where the two agree."""
    keys = ["claim", "model", "data", "mode", "protocol"]
    here = primary_rows(findings, registration.CONFIRMATORY)
    here = here[here["verdict"] != stats.NOT_MEASURED]
    if here.empty:
        return ""
    there = primary_rows(findings, registration.EXPLORATORY)
    both = here[keys + ["verdict"]].merge(there[keys + ["verdict"]], on=keys, suffixes=("", "_there"))
    both = both[both["verdict_there"] != stats.NOT_MEASURED]
    differ = both[both["verdict"] != both["verdict_there"]]
    text = (f"Beside the exploratory sample: the same verdict in {len(both) - len(differ)} of the {len(both)} "
            "tests judged on both")
    if differ.empty:
        return text + "."
    return (text + f"; different in {len(differ)}: "
            + "; ".join(f"{_step_place(r.model, r.data, r.mode, r.claim)}: {r.verdict_there} there, {r.verdict} here"
                        for r in differ.itertuples()) + ".")


def sink_agreement(here: pd.DataFrame, there: pd.DataFrame) -> str:
    """The registered sink claims, confirmatory (``here``) beside exploratory (``there``), both
    :func:`registered_sink_verdicts`: per (claim, model), both data sets combined, the same verdict in how many
    of the pairs judged on both, the pairs judged only here (a registered control the exploratory tables
    lack) and each pair that differs; "" while the confirmatory sample judges none."""
    if here.empty or (here["verdict"] == stats.NOT_MEASURED).all():
        return ""
    a, b = claim_model_verdicts(here), claim_model_verdicts(there) if len(there) else pd.Series(dtype=object)
    judged = [pair for pair in a.index if a[pair] != stats.NOT_MEASURED]
    on_both = [pair for pair in judged if b.get(pair, stats.NOT_MEASURED) != stats.NOT_MEASURED]
    differ = [pair for pair in on_both if a[pair] != b[pair]]
    only_here = [pair for pair in judged if pair not in on_both]
    text = (f"Beside the exploratory sample, the sink claims: the same verdict for {len(on_both) - len(differ)} of the "
            f"{len(on_both)} (claim, model) pairs judged on both")
    if differ:
        text += (f"; different for {len(differ)}: "
                 + "; ".join(f"*{claim}*, {model}: {b[(claim, model)]} there, {a[(claim, model)]} here"
                             for claim, model in differ))
    if only_here:
        text += (f"; {len(only_here)} more {'is' if len(only_here) == 1 else 'are'} judged here only, the exploratory "
                 "tables lacking a registered control: "
                 + "; ".join(f"*{claim}*, {model}: {a[(claim, model)]}" for claim, model in only_here))
    return text + "."


def registered_sink_verdicts(results_dir: str | Path, models: Sequence[str]) -> pd.DataFrame:
    """Every registered sink claim (:data:`cwbook.registration.SINK_CLAIMS`) per model and data set,
    judged by the registered rule from the sink chapters' tables in ``results_dir``: each part's verdict
    (main parts and controls) and the claim's, :func:`cwcore.stats.combine_all` over all parts (a control
    missing from the table, e.g. one registered after the table was made, counts as not measured).
    Columns ``model, data, claim, source, computed`` (parts found), ``verdict, parts, failing``."""
    out = []
    for model in models:
        parts = [load_results(results_dir, chapter, model) for chapter in _SINK_CHAPTERS]
        table = pd.concat([p.table for p in parts if p is not None], ignore_index=True) if any(parts) else None
        for data in registration.CONFIRMATORY_DATA:
            for claim in registration.SINK_CLAIMS:
                verdicts, described = [], []
                for key, threshold, side, role in claim["parts"]:
                    hit = None if table is None else table[table["key"] == f"{data}/{key}"]
                    if hit is None or hit.empty:
                        v = stats.NOT_MEASURED
                        described.append(f"{role} {key}: not computed")
                    else:
                        r = hit.iloc[0]
                        v = stats.verdict(float(r["low"]), float(r["high"]), threshold=threshold, side=side)
                        described.append(f"{role} {key}: {r['estimate']:+.3g} [{r['low']:+.3g}, {r['high']:+.3g}] {v}")
                    verdicts.append((role, key, v))
                # the parts that keep the claim from holding, the decisive ones first
                rank = {stats.CONTRADICTED: 0, stats.NOT_MEASURED: 1, stats.INCONCLUSIVE: 2, stats.NEGLIGIBLE: 3}
                failing = [f"{PART_WORDS.get(key, key)} {'is ' + v if v != stats.NOT_MEASURED else 'was not computed'}"
                           for role, key, v in sorted(verdicts, key=lambda x: rank.get(x[2], 9)) if v != stats.HOLDS]
                out.append({"model": model, "data": data, "claim": claim["claim"], "source": claim["source"],
                            "computed": sum(not d.endswith("not computed") for d in described),
                            "verdict": stats.combine_all([v for *_, v in verdicts]) if table is not None
                            else stats.NOT_MEASURED, "parts": "; ".join(described), "failing": "; ".join(failing)})
    return pd.DataFrame(out)


def stopping_part(rows: pd.DataFrame, combined: str) -> str:
    """The part that keeps one (claim, model) from holding, for its sentence: taken from a data set whose
    verdict is the ``combined`` one (the decisive data set, named when the data sets disagree), so that a
    claim contradicted on one data set and inconclusive on the other is explained by the contradiction.
    ``rows``: that claim and model's rows of :func:`registered_sink_verdicts`; "" when the claim holds."""
    if combined == stats.HOLDS:
        return ""
    decisive = rows[rows["verdict"] == combined]
    for _, row in (decisive if len(decisive) else rows).iterrows():
        parts = [f for f in str(row["failing"]).split("; ") if f]
        if parts:
            return parts[0] + (f" on {DATA_NAMES.get(row['data'], row['data'])}" if 0 < len(decisive) < len(rows) else "")
    return ""


def sink_sentences(verdicts: pd.DataFrame) -> list[str]:
    """One sentence per registered sink claim: its verdict per model (both data sets), and for a claim
    that does not hold, the part that stops it."""
    if verdicts.empty or (verdicts["verdict"] == stats.NOT_MEASURED).all():
        return ["None of the registered sink claims has been computed on this sample yet."]
    combined = claim_model_verdicts(verdicts)
    lines = []
    for claim, rows in verdicts.groupby("claim", sort=False):
        per_model = []
        for model, one in rows.groupby("model", sort=False):
            both = combined[(claim, model)]
            text = f"{model} {both}"
            reason = stopping_part(one, both)
            if reason:
                text += f" ({reason})"
            per_model.append(text)
        lines.append(f"*{claim}*: " + "; ".join(per_model) + ".")
    return lines


def claim_model_verdicts(verdicts: pd.DataFrame) -> pd.Series:
    """Each (claim, model)'s verdict over both data sets by the registered rule (:func:`cwcore.stats.combine_all`),
    from :func:`registered_sink_verdicts`."""
    return verdicts.groupby(["claim", "model"], sort=False)["verdict"].agg(stats.combine_all)


def sink_tally(verdicts: pd.DataFrame) -> str:
    """The registered sink claims in one sentence: how many (claim, model) pairs hold, are contradicted, ...
    (both data sets combined by the registered rule), or that none is computed yet."""
    if verdicts.empty or (verdicts["verdict"] == stats.NOT_MEASURED).all():
        return "None of the registered sink claims has been computed on this sample yet."
    combined = claim_model_verdicts(verdicts)
    return (f"The {verdicts['claim'].nunique()} registered sink claims, each with its controls, over "
            f"{verdicts['model'].nunique()} models: {_count(combined)} of {len(combined)} (claim, model) pairs.")


def exploratory_title(findings: pd.DataFrame) -> str:
    """The exploratory block's title, its counts read from ``findings``: documents per data set (the primary
    tests' units) and how many of its primary tests were computed before their registration (``prospective``
    false)."""
    rows = primary_rows(findings, registration.EXPLORATORY)
    documents = sorted(set(rows.loc[rows["unit"] == "document", "n_units"].astype(int))) if "unit" in rows else []
    size = (f"{documents[0]} documents per data set" if len(documents) == 1 else
            f"{documents[0]}-{documents[-1]} documents per data set" if documents else "no test computed yet")
    seen = int((~rows["prospective"].astype(object).fillna(True).astype(bool)).sum()) if "prospective" in rows else 0
    before = (f"; {seen} of its {len(rows)} tests were computed before their registration, so these verdicts "
              "generate hypotheses rather than confirm them" if seen else "")
    return f"**Exploratory sample** ({size}{before})"


def headline_markdown(findings: pd.DataFrame | None = None, *, exploratory_dir: str | Path = EVIDENCE_DIR,
                      confirmatory_dir: str | Path = CONFIRMATORY_DIR, compact: bool = False) -> str:
    """The generated opening of chapter 9, the introduction and the README (markdown): the confirmatory
    sample's verdicts, then the exploratory sample's, labelled so. ``compact`` (the README's, which must stay
    short): the exploratory sample in two counting sentences (its tests, its sink claims) and where the rest is."""
    if findings is None:
        findings = read_checked_csv(Path(exploratory_dir) / "findings.csv")
    models = list(evidence.PRIMARY["models"])
    verdicts_of = {registration.CONFIRMATORY: registered_sink_verdicts(confirmatory_dir, models),
                   registration.EXPLORATORY: registered_sink_verdicts(exploratory_dir, models)}
    blocks = []
    for sample, folder, title in (
            (registration.CONFIRMATORY, confirmatory_dir,
             f"**Confirmatory replication** (registered {registration.REGISTERED} before it was computed; "
             f"{registration.CONFIRMATORY_DOCUMENTS} new documents per data set that the exploratory analysis never saw)"),
            (registration.EXPLORATORY, exploratory_dir, exploratory_title(findings))):
        ladder = ladder_sentences(findings, sample, ladder_progress(folder)
                                  if sample == registration.CONFIRMATORY else None)
        verdicts = verdicts_of[sample]
        if compact and sample == registration.EXPLORATORY:
            blocks.append(title + ".\n\n" + "\n".join(f"- {line}" for line in [ladder[0], sink_tally(verdicts)])
                          + "\n\nEvery claim, model and step, with its interval: the book's introduction and chapter 9.")
            continue
        agreement = [ladder_agreement(findings), sink_agreement(verdicts, verdicts_of[registration.EXPLORATORY])] \
            if sample == registration.CONFIRMATORY else []
        blocks.append(title + ".\n\n" + "\n".join(f"- {line}" for line in ladder)
                      + "\n- The sink claims, each judged with its registered controls:\n"
                      + "\n".join(f"  - {line}" for line in sink_sentences(verdicts))
                      + "".join(f"\n- {line}" for line in agreement if line))
    return "\n\n".join(blocks) + "\n"


def committed_findings(evidence_dir: str | Path | None = None) -> pd.DataFrame:
    """The committed ``findings.csv`` of ``evidence_dir`` (default: this checkout's exploratory evidence
    folder, which holds both samples' rows); an empty table where there is none (an installed package
    ships no ``data/results``)."""
    path = Path(evidence_dir or EVIDENCE_DIR) / "findings.csv"
    if not path.is_file():
        return pd.DataFrame(columns=["claim", "model", "data", "mode", "protocol", "importance", "range", "verdict",
                                     "estimate", "ci_low", "ci_high", "variant", "primary", "sample"])
    return read_checked_csv(path)


def folders(evidence_dir: str | Path | None = None) -> dict:
    """``exploratory_dir`` and ``confirmatory_dir`` (its sibling, :func:`cwbook.findings.sample_folders`) of
    ``evidence_dir``."""
    exploratory, confirmatory = sample_folders(evidence_dir or EVIDENCE_DIR)
    return {"exploratory_dir": exploratory, "confirmatory_dir": confirmatory}


def chapter4_answer(findings: pd.DataFrame, model: str, confirmatory_dir: str | Path = CONFIRMATORY_DIR) -> str:
    """Chapter 4's generated answer for ``model`` (markdown): what each sample's registered tests say of the
    paper's ordering on this model, and which step decides it; the confirmatory sample's progress."""
    parts = []
    for sample, label in ((registration.CONFIRMATORY, "Confirmatory sample (registered before it was computed)"),
                          (registration.EXPLORATORY, "Exploratory sample (64 documents per data set)")):
        rows = primary_rows(findings, sample) if len(findings) else findings
        rows = rows[rows["model"] == model] if len(rows) else rows
        if not len(rows) or (rows["verdict"] == stats.NOT_MEASURED).all():
            clause = progress_clause([cell for cell in ladder_progress(confirmatory_dir) if cell["model"] == model]
                                     if sample == registration.CONFIRMATORY else None)
            parts.append(f"*{label}*: not judged yet" + (f" ({clause})." if clause else "."))
            continue
        summary = ordering_summary(rows)
        sentence = _model_sentence(model, summary).replace(f"**{model}**, ", "")
        beats = summary["contribution beats random"]
        parts.append(f"*{label}*: {sentence[0].upper() + sentence[1:]} Contribution weights against a random "
                     f"ranking: {_tally(beats)}.")
    return "\n\n".join(parts)


#: the chapter that judges each registered sink claim
SINK_CLAIM_CHAPTER = {"many heads are sink heads": "05_sink_decomposition",
                      "sink driven by value geometry, tail by attention and alignment": "05_sink_decomposition",
                      "anti-alignment": "06_sinks_as_suppressors",
                      "stronger sink, stronger anti-alignment": "06_sinks_as_suppressors",
                      "the sink suppresses the output norm": "06_sinks_as_suppressors",
                      "convexity": "06_sinks_as_suppressors",
                      "low-norm outputs collapse into the cone": "07_semantic_cone",
                      "removing the sink raises perplexity": "07_semantic_cone",
                      "noise from many weak tokens accumulates": "07_semantic_cone"}


def sink_chapter_figure(chapter: str, model: str, *, exploratory_dir: str | Path = EVIDENCE_DIR,
                        confirmatory_dir: str | Path = CONFIRMATORY_DIR):
    """The verdict picture (:func:`plot_verdicts`) of the registered claims a sink chapter judges, for ``model``:
    each data set, the exploratory sample beside the confirmatory one, with the controls (the same verdicts as
    :func:`sink_chapter_answer`). None where neither sample has computed any of them for this model."""
    claims = [c for c, where in SINK_CLAIM_CHAPTER.items() if where == chapter]
    rows = []
    for sample, folder in ((registration.EXPLORATORY, exploratory_dir), (registration.CONFIRMATORY, confirmatory_dir)):
        verdicts = registered_sink_verdicts(folder, [model])
        verdicts = verdicts[verdicts["claim"].isin(claims)]
        if verdicts["computed"].any():
            rows += _sink_grid_rows(sample, verdicts)
    return plot_verdicts(pd.DataFrame(rows)) if rows else None


def sink_chapter_answer(chapter: str, model: str, *, exploratory_dir: str | Path = EVIDENCE_DIR,
                        confirmatory_dir: str | Path = CONFIRMATORY_DIR) -> str:
    """A sink chapter's generated answer for ``model`` (markdown bullets): each registered claim the chapter
    judges, on each sample, with its controls (:func:`registered_sink_verdicts`), both data sets combined,
    and the part that keeps a claim from holding."""
    claims = [c for c, where in SINK_CLAIM_CHAPTER.items() if where == chapter]
    lines = []
    found = {sample: registered_sink_verdicts(folder, [model]) for sample, folder in
             ((registration.CONFIRMATORY, confirmatory_dir), (registration.EXPLORATORY, exploratory_dir))}
    for claim in claims:
        said = []
        for sample, verdicts in found.items():
            rows = verdicts[verdicts["claim"] == claim]
            if rows.empty or not rows["computed"].any():
                said.append(f"{sample}: not computed yet")
                continue
            both = stats.combine_all(rows["verdict"])
            reason = stopping_part(rows, both)
            said.append(f"{sample}: **{both}**" + (f" ({reason})" if reason else ""))
        lines.append(f"- *{claim}*: " + "; ".join(said) + ".")
    return "\n".join(lines)


def primary_forest(findings: pd.DataFrame, model: str, sample: str = registration.EXPLORATORY):
    """The forest plot of ``model``'s committed ladder steps on ``sample`` (main variant, every protocol,
    sign and range; :func:`cwbook.forests.ladder_forest`), or None when there are none."""
    from .forests import ladder_forest

    if not len(findings):
        return None
    rows = findings if "sample" not in findings else findings[findings["sample"] == sample]
    rows = rows[(rows["model"] == model) & rows["data"].isin(list(evidence.PRIMARY["data"]))]
    if rows.empty:
        return None
    return ladder_forest(rows, title=f"{model}, {sample} sample")


# -- the picture ------------------------------------------------------------------------------------
_CODES = {stats.HOLDS: 0, stats.NEGLIGIBLE: 1, stats.INCONCLUSIVE: 2, stats.CONTRADICTED: 3, stats.NOT_MEASURED: 4}


def verdict_grid(findings: pd.DataFrame, *, exploratory_dir: str | Path = EVIDENCE_DIR,
                 confirmatory_dir: str | Path = CONFIRMATORY_DIR) -> pd.DataFrame:
    """Every registered verdict in one long table: ``sample, claim, model, data, mode, verdict`` (the
    ladder's steps and ordering per mode, |c|; the sink claims with their controls, ``mode`` empty)."""
    rows = []
    models = list(evidence.PRIMARY["models"])
    for sample, folder in ((registration.EXPLORATORY, exploratory_dir), (registration.CONFIRMATORY, confirmatory_dir)):
        found = primary_rows(findings, sample)
        summary = ordering_summary(found) if len(found) else ordering_summary(
            pd.DataFrame({"model": models, "claim": "", "verdict": stats.NOT_MEASURED, "data": "", "mode": ""}))
        for d in summary[summary["model"].isin(models)].to_dict("records"):
            for claim in [*_ORDER_STEPS, "contribution beats random", "ordering"]:
                rows.append({"sample": sample, "claim": STEP_NAMES.get(claim, "ordering 1 < 2 < 3 < 4"),
                             "model": d["model"], "data": d["data"], "mode": d["mode"], "verdict": d[claim]})
        rows += _sink_grid_rows(sample, registered_sink_verdicts(folder, models))
    return pd.DataFrame(rows)


def _sink_grid_rows(sample: str, verdicts: pd.DataFrame) -> list[dict]:
    """:func:`registered_sink_verdicts` rows as rows of the verdict picture (``mode`` empty)."""
    return [{"sample": sample, "claim": r.claim, "model": r.model, "data": r.data, "mode": "", "verdict": r.verdict}
            for r in verdicts.itertuples(index=False)]


def plot_verdicts(grid: pd.DataFrame):
    """The verdict picture: one panel per sample (exploratory, confirmatory), claims down, model x data
    set (x mode for the ladder) across, each cell coloured by its verdict. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from .forests import VERDICT_COLOURS

    colours = [VERDICT_COLOURS["holds"], VERDICT_COLOURS["negligible"], VERDICT_COLOURS["inconclusive"],
               VERDICT_COLOURS["contradicted"], "#e6e6e6"]
    claims = list(dict.fromkeys(grid["claim"]))
    grid = grid.assign(column=[f"{m.split('-')[0]} {DATA_NAMES.get(d, d).replace('web text', 'web')}"
                               + (f" {'comp' if mo == 'comprehensiveness' else 'suff'}" if mo else "")
                               for m, d, mo in zip(grid["model"], grid["data"], grid["mode"])])
    ladder_columns = list(dict.fromkeys(grid.loc[grid["mode"] != "", "column"]))
    sink_columns = list(dict.fromkeys(grid.loc[grid["mode"] == "", "column"]))
    columns = ladder_columns + [c for c in sink_columns if c not in ladder_columns]
    width = 13 if len(columns) > 6 else 5 + 1.3 * len(columns)  # a chapter's few columns: a narrower figure
    fig, axes = plt.subplots(1, 2, figsize=(width, 0.36 * len(claims) + 2.2), sharey=True, constrained_layout=True)
    for ax, sample in zip(axes, registration.SAMPLES):
        part = grid[grid["sample"] == sample]
        codes = np.full((len(claims), len(columns)), np.nan)
        for r in part.itertuples(index=False):
            codes[claims.index(r.claim), columns.index(r.column)] = _CODES[r.verdict]
        ax.imshow(np.ma.masked_invalid(codes), cmap=ListedColormap(colours), vmin=0, vmax=4, aspect="auto")
        ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(claims)), claims, fontsize=8)
        ax.set_xticks(np.arange(-0.5, len(columns)), minor=True)
        ax.set_yticks(np.arange(-0.5, len(claims)), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        ax.set_title(sample, fontsize=10)
    labels = [stats.HOLDS, stats.NEGLIGIBLE, stats.INCONCLUSIVE, stats.CONTRADICTED, stats.NOT_MEASURED]
    fig.legend([Patch(facecolor=c, edgecolor="#bbbbbb") for c in colours], labels, loc="outside lower center",
               ncols=5, fontsize=8, frameon=False)
    return fig


# -- generated blocks of the introduction and the README -------------------------------------------
#: the pages that carry the generated headline, and whether each carries the compact one
HEADLINE_PAGES = {REPO / "book" / "intro.md": False, REPO / "README.md": True}


def write_blocks(paths: Sequence[str | Path] | None = None, text: str | None = None) -> list[Path]:
    """Replace the text between ``<!-- headline:start -->`` and ``<!-- headline:end -->`` of each file
    (default :data:`HEADLINE_PAGES`) with :func:`headline_markdown` (compact where the page says so, or
    ``text``); returns the files that changed."""
    changed = []
    for path in map(Path, HEADLINE_PAGES if paths is None else paths):
        text_here = text if text is not None else headline_markdown(compact=HEADLINE_PAGES.get(path, False))
        old = path.read_text()
        pattern = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
        if not pattern.search(old):
            raise ValueError(f"{path.name} has no generated headline block ({START} ... {END})")
        new = pattern.sub(lambda _: f"{START}\n{text_here}{END}", old)
        if new != old:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwbook.headline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the generated blocks of book/intro.md and README.md")
    args = parser.parse_args(argv)
    if args.write:
        changed = write_blocks()
        print("rewrote " + (", ".join(p.name for p in changed) if changed else "nothing (up to date)"))
    else:
        print(headline_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
