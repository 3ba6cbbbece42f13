"""Chapter 9, the findings page: the tables it shows beside the committed evidence's headline (which
:mod:`cwbook.headline` and :mod:`cwbook.table1` draw), read from the chapters' results tables."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pandas as pd

#: the columns of the faithfulness rows the page shows
STEP_COLUMNS = ["model", "data", "protocol", "importance", "range", "mode", "claim", "verdict", "estimate", "interval",
                "n_units", "unit", "mde"]


@dataclass
class Findings:
    """The findings page's tables for ``models`` (one row per claim, part or step unless said otherwise)."""

    models: list
    profile: str
    committed_dir: Path
    use_committed: bool
    phrases: dict = field(default_factory=dict)
    table1: pd.DataFrame = None
    board: pd.DataFrame = None
    table: pd.DataFrame = None
    sources: pd.DataFrame = None
    faith_findings: pd.DataFrame = None  # findings.csv of this build's tables
    committed_findings: pd.DataFrame = None  # ... and of the committed evidence, when the page sets them side by side
    steps: pd.DataFrame = None
    sink_rows: pd.DataFrame = None
    compared: pd.DataFrame = None

    @cached_property
    def evidence_size(self) -> str:
        """"64 documents per data set": what the committed evidence's tables record (read once per page)."""
        from cwbook import findings

        return findings.documents_per_data_set(self.committed_dir)


def rerun_size(rows: pd.DataFrame) -> str:
    """The rerun check's label from this build's findings rows: the documents its ladder ran on per data set
    (``n_units`` of the rows counted in documents), e.g. "rerun check (4 documents per data set, one seed, no
    adjustment)"."""
    from cwbook.chapters.common import rerun_label

    counted = rows.loc[rows.get("unit", pd.Series(dtype=str)).eq("document"), "n_units"] if len(rows) else []
    sizes = sorted({int(n) for n in counted if pd.notna(n) and n > 0})
    if not sizes:
        return "rerun check (this build, one seed, no adjustment)"
    if len(sizes) == 1:
        return rerun_label({"": sizes[0]})
    return f"rerun check ({sizes[0]} to {sizes[-1]} documents per data set, one seed, no adjustment)"


def beside_evidence(rows: pd.DataFrame, evidence_rows: pd.DataFrame, label: str) -> pd.DataFrame:
    """This build's findings ``rows`` as a labelled rerun check: their ``verdict`` column becomes one named by
    ``label`` ("rerun check (N documents ...)") saying where the interval lies (no verdict word), beside the
    verdict of the same row (:data:`cwbook.findings.ROW_KEYS`) in the committed ``evidence_rows`` (column
    ``evidence``) and whether the rerun agrees with it."""
    from cwbook import findings
    from cwbook.chapters.common import AGREEMENT_SHORT, rerun_agrees, rerun_direction

    keys = [k for k in findings.ROW_KEYS if k in rows and k in evidence_rows]
    committed = dict(zip(map(tuple, evidence_rows[keys].astype(object).fillna("").astype(str).to_numpy()), evidence_rows["verdict"]))
    found = [committed.get(k) for k in map(tuple, rows[keys].astype(object).fillna("").astype(str).to_numpy())]
    at = list(rows.columns).index("verdict")
    out = rows.drop(columns="verdict")
    out.insert(at, "rerun direction", [rerun_direction(v) for v in rows["verdict"]])
    out.insert(at + 1, "evidence", [v if v is not None else "not committed" for v in found])
    out.insert(at + 2, "rerun agrees with the evidence?",
               [AGREEMENT_SHORT[rerun_agrees(v, e)] for v, e in zip(rows["verdict"], found)])
    return out.rename(columns={"rerun direction": label})  # "rerun check (N documents ...)": where it lies


def _interval(frame: pd.DataFrame) -> list[str]:
    return [f"{lo:+.3f} – {hi:+.3f}" if pd.notna(lo) else "" for lo, hi in zip(frame["ci_low"], frame["ci_high"])]


def run(models, results_dir: str | os.PathLike, profile: str, evidence_dir: str | os.PathLike | None = None) -> Findings:
    """The findings page's tables: ``models`` of the book's per_model chapters, ``results_dir`` the chapters'
    tables of this build, ``profile`` its run profile, ``evidence_dir`` the committed evidence tables (None:
    ``data/results/evidence`` of this checkout)."""
    from cwbook import findings

    committed_dir = Path(evidence_dir) if evidence_dir else findings.EVIDENCE_DIR
    use_committed = profile != "evidence" and (committed_dir / "PROVENANCE").is_file()
    r = Findings(models=list(models), profile=profile, committed_dir=committed_dir, use_committed=use_committed)
    # read once, used by every table; the evidence's with the weights variants it holds (the re-quantised rows)
    live_models = findings.held_models(results_dir, r.models) if profile == "evidence" else r.models
    r.faith_findings = findings.findings_csv(results_dir, live_models, profile)
    if use_committed:
        # the named models and their weights variants only: every other committed model's rows were set beside
        # a build that never ran it (804 SmolLM2 rows beside a rerun on the user's own model)
        r.committed_findings = findings.findings_csv(committed_dir, findings.held_variants(committed_dir, r.models),
                                                     "evidence")
    _primary(r)
    _scoreboard(r, results_dir)
    _faithfulness_rows(r)
    _compared(r)
    return r


def _primary(r: Findings) -> None:
    from cwbook import findings
    from cwbook import ladder as evidence
    from cwbook.table1 import PRIMARY_COLUMNS, primary_table

    models, profile, committed_dir = r.models, r.profile, r.committed_dir
    live_rows = r.faith_findings
    if r.use_committed:
        evidence_rows = findings.findings_csv(
            committed_dir, findings.held_models(committed_dir, list(evidence.PRIMARY["models"])), "evidence")
        r.table1 = primary_table(evidence_rows, live_rows)
        r.phrases["table1_source"] = (
            f"the committed evidence (`{committed_dir.name}/`, {r.evidence_size}), "
            f"with this build (profile `{profile}`, {', '.join(models)}) beside it as the "
            f"{rerun_size(live_rows)} (`rerun agrees?`: whether it gives the evidence's verdict, |c| / signed in "
            "comprehensiveness; the same in sufficiency)")
        source_rows = evidence_rows
    else:  # an evidence build, or an installed package without data/results: this build is the evidence
        r.table1 = primary_table(live_rows, None, models)
        r.phrases["table1_source"] = f"this build (profile `{profile}`)" + (
            "" if profile == "evidence" else "; no committed evidence was found beside it")
        source_rows = live_rows
    measured = r.table1[~r.table1["claim"].eq("ordering")]
    holding = {label: int(measured[label].str.startswith(findings.HOLDS).sum()) for *_, label in PRIMARY_COLUMNS}
    requantized = source_rows[(source_rows["variant"] == "requantized") & source_rows["claim"].str.startswith("step")]
    if requantized.empty:
        r.phrases["requantized_status"] = "its rows are not in these findings yet, so this confound is stated, not tested"
    else:
        main_rows = source_rows[source_rows["primary"]]
        survive = requantized.merge(main_rows, on=["model", "data", "mode", "protocol", "importance", "range", "claim"],
                                    suffixes=("", "_main"))
        same = int((survive["verdict"] == survive["verdict_main"]).sum())
        r.phrases["requantized_status"] = (
            f"of the {len(survive)} primary steps it ran, {same} keep their verdict on the "
            f"re-quantised weights ({', '.join(sorted(set(survive['model'])))}; `variant = requantized` in "
            "`findings.csv`, exploratory and unadjusted)")
    r.phrases["table1_counts"] = "; ".join(f"{label}: {n} of {len(measured)} steps hold" for label, n in holding.items())


def registered_sink_findings(found: list, results_dir, model: str) -> list:
    """``found`` (:func:`cwbook.findings.model_findings`) with its sink findings replaced by the registered sink
    claims judged as the headline judges them (:func:`cwbook.headline.registered_sink_verdicts`: the registered
    parts and controls only, both data sets combined), so that this page's table and its headline say one
    thing. Findings no registered claim covers (the book's own check of the sink's position) stay."""
    from cwbook import findings, headline, registration

    # every sink finding but the book's own position check is a registered claim's
    covered = set(findings.CHAPTER_CLAIMS) - {"sink_position"}
    verdicts = headline.registered_sink_verdicts(results_dir, [model])
    if verdicts.empty or not verdicts["computed"].any():
        return found
    combined = headline.claim_model_verdicts(verdicts)
    kept = [f for f in found if f.claim not in covered]
    registered = []
    for claim in registration.SINK_CLAIMS:
        rows = verdicts[verdicts["claim"] == claim["claim"]]
        both = combined[(claim["claim"], model)]
        measured = "; ".join(f"{d}: {v} ({parts})" for d, v, parts in zip(rows["data"], rows["verdict"], rows["parts"]))
        registered.append(findings.Finding(
            claim["claim"], both, measured, "the registered rule (Pre-registration): every part's and control's 95% "
                                            "interval against its threshold, both data sets combined"))
    encoders = [f for f in kept if f.claim == "encoders"]
    return [f for f in kept if f.claim != "encoders"] + registered + encoders


def _scoreboard(r: Findings, results_dir) -> None:
    from cwbook import findings

    # the verdicts a reader reads come from the evidence-size tables where they are committed; this build's
    # own (smaller) tables are the rerun check above
    results, sources = {}, []
    for name in r.models:
        # a model the evidence holds is read at evidence size; any other model (your own) from this build
        held = r.use_committed and findings.load_results(r.committed_dir, "04_faithfulness", name) is not None
        verdict_dir = r.committed_dir if held else results_dir
        results[name], read = findings.model_findings(verdict_dir, name)
        results[name] = registered_sink_findings(results[name], verdict_dir, name)
        for chapter in [*findings.CHAPTERS, findings.BENCH_CHAPTER]:
            # the bench's table is not among the claims model_findings reads: look it up on its own
            got = read.get(chapter) if chapter in read else findings.load_results(verdict_dir, chapter, name)
            params = got.metadata.get("parameters", {}) if got else {}
            sources.append({"chapter": chapter, "model": name,
                            "table": "read" if got else "not built",
                            "profile": got.metadata.get("profile") if got else "",
                            "ran with": ", ".join(f"{k} = {v}" for k, v in params.items())})
    r.sources = pd.DataFrame(sources)
    r.table = findings.findings_table(results)
    r.board = findings.scoreboard(r.table)
    judged = r.table[r.table["key"] != "encoders"]

    def counted(name):
        n = findings.verdict_counts(judged, name)
        return f"{name}: " + ", ".join(f"{n[v]} {v}" for v in findings.VERDICTS)

    r.phrases["counts"] = "; ".join(counted(name) for name in r.models)
    built = sorted({s["chapter"].split("_")[0] for s in sources if s["table"] == "read"})
    r.phrases["caption"] = (f"{', '.join(r.models)}; "
                            + (f"the committed evidence, {r.evidence_size}, for the "
                               "models it holds"
                               if r.use_committed else f"profile `{r.profile}`")
                            + "; tables of chapter(s) "
                            f"{', '.join(c.lstrip('0') for c in built) if built else 'none'}")


def _faithfulness_rows(r: Findings) -> None:
    faith = r.faith_findings
    steps = faith[faith["claim"].str.startswith("step") | faith["claim"].isin(
        ["ordering", "cosine_gain", "contribution beats random"]) | faith["measured"].str.startswith(
        "chapter 4b", na=False)]
    r.steps = steps.assign(interval=_interval(steps))[STEP_COLUMNS]
    sink_rows = faith[faith["measured"].str.match(r"chapter [567],", na=False)]
    r.phrases["n_sink_rows"] = f"{len(sink_rows)} rows"
    r.sink_rows = (sink_rows.assign(interval=_interval(sink_rows))
                   [["model", "data", "claim", "source", "protocol", "variant", "mode", "importance", "range",
                     "verdict", "estimate", "interval", "n_units"]])
    r.phrases["rerun_label"] = rerun_size(faith)
    if r.use_committed:  # a default build: its verdicts are a rerun check, the evidence's are the verdicts
        committed = r.committed_findings
        r.steps = beside_evidence(r.steps, committed, r.phrases["rerun_label"])
        r.sink_rows = beside_evidence(r.sink_rows, committed, r.phrases["rerun_label"])
    r.phrases["n_findings"] = f"{len(r.steps)} rows"
    r.sink_rows = (r.sink_rows.drop(columns=["variant", "mode", "importance", "range"])
                   .rename(columns={"protocol": "part", "n_units": "n", "source": "claim by"}))


def _without_verdict(text) -> str:
    """``"+0.1 [+0.05, +0.2] holds"`` (:func:`cwbook.findings.beside`'s cell) with its verdict word replaced by
    where the interval lies (:func:`cwbook.chapters.common.rerun_direction`)."""
    from cwbook.chapters.common import rerun_direction
    from cwcore import stats

    if not isinstance(text, str):
        return text
    for v in stats.VERDICTS:
        if text == v or text.startswith(v + ":"):
            return rerun_direction(text)
        if text.endswith(" " + v):
            return f"{text[:-len(v) - 1]}: {rerun_direction(v)}"
    return text


def _compared(r: Findings) -> None:
    from cwbook import findings
    from cwbook.chapters.common import AGREES, rerun_agrees
    from cwbook.evidence_build import provenance_lines
    from cwcore.stats import NOT_MEASURED

    committed_dir, profile = r.committed_dir, r.profile
    provenance = committed_dir / "PROVENANCE"
    if profile == "evidence":
        r.phrases["committed_note"] = ("This page was built with the `evidence` profile: the numbers above *are* the "
                                       "evidence tables, so there is nothing to set beside them.")
        compared = pd.DataFrame()
    elif not provenance.is_file():
        r.phrases["committed_note"] = (f"No committed evidence was found (`{committed_dir}` has no PROVENANCE): an "
                                       "installed package does not ship `data/results/`; a checkout of the repository "
                                       "does.")
        compared = pd.DataFrame()
    else:
        compared = findings.beside(r.faith_findings, r.committed_findings, live_name=profile, committed_name="evidence",
                                   verdicts=True)
        measured = compared["evidence verdict"].map(lambda v: isinstance(v, str) and not v.startswith(NOT_MEASURED))
        compared = compared.loc[measured.astype(bool)]  # what the evidence measured
        both = compared.loc[compared[profile].map(lambda t: isinstance(t, str) and bool(t)).astype(bool)]  # here too
        agreeing = sum(rerun_agrees(a, b) == AGREES
                       for a, b in zip(both[f"{profile} verdict"], both["evidence verdict"]))
        head = compared[~compared["claim"].str.contains(r"\[", regex=True)].copy()  # the paper's own readings
        lines = "; ".join(provenance_lines(provenance))  # each build: its chapters, commit, time, machine
        r.phrases["committed_note"] = (
            f"The committed tables (`{committed_dir.name}/`: {lines}) hold {len(compared)} measured findings rows "
            f"of this build's models ({', '.join(sorted(set(compared['model']))) or 'none of them'}); "
            f"{len(both)} of them have a row here too, and on "
            f"{agreeing} of those the rerun gives the evidence's verdict. The table shows "
            f"the {len(head)} parts of the paper's own readings (the bracketed variants are in both "
            "`findings.csv` files).")
        compared = head
        compared[profile] = [_without_verdict(t) for t in compared[profile]]  # the rerun's interval, no verdict
        # the steps table's answer (rerun_agrees: an interval that decides nothing is "too few to tell", not "no")
        compared["rerun agrees with the evidence?"] = [
            rerun_agrees(a, b) if isinstance(rerun, str) and rerun else "not in this build"
            for a, b, rerun in zip(compared[f"{profile} verdict"], compared["evidence verdict"], compared[profile])]
        # mode, importance and range tell the rows apart: one "part" column (1,104 of 1,224 rows looked doubled)
        compared["protocol"] = [", ".join(str(v) for v in values if isinstance(v, str) and v)
                                for values in zip(compared["protocol"], compared["mode"], compared["importance"],
                                                  compared["range"])]
        compared = compared.drop(columns=["agree", f"{profile} verdict", "evidence verdict"])
        for column in (f"{profile} n", "evidence n"):  # counts (documents, heads): no "3.000" after the merge
            counts = pd.to_numeric(compared[column], errors="coerce")
            if counts.dropna().eq(counts.dropna().round()).all():
                compared[column] = counts.round().astype("Int64")
    r.phrases["committed_table_note"] = (
        "" if compared.empty else
        f"Each part measured by both profiles: estimate [95% interval] and where it lies in this page's "
        f"{r.phrases.get('rerun_label', 'rerun check')}, estimate [95% interval] and verdict at the evidence size, "
        "the number of independent units behind each (`n`) and the smallest effect each could detect (`mde`). "
        "The last column: whether the rerun gives the evidence's verdict.")
    r.compared = compared.drop(columns=["mode", "importance", "range"], errors="ignore").rename(
        columns={"protocol": "part"})
