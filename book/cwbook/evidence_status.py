"""What the evidence profile plans and what ``data/results/evidence`` holds of it: ``STATUS.md``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from cwcore import cache as cw_cache
from . import DEFAULT_BOOK_DIR, BookError, load_config, plan, profile_config, results_path
from .evidence_export import CHAPTER, cell_name, notebook_parameters, paths, read_committed, weight_variant_names
from .evidence_files import DEFAULT_OUT, CommittedFileError
from .evidence_frames import ANATOMY, BENCH, DOWNSTREAM, PER_LAYER, SENSITIVITY, frame_paths, read_frame
from .findings import BENCH_CHAPTER, CHAPTERS
from .parameters import run_parameters

STATUS_FILE = "STATUS.md"
#: one row per planned part; ``held`` and ``planned`` count ``unit`` (documents, or examples of a task)
STATUS_COLUMNS = ["part", "model", "data", "cell", "planned", "held", "unit", "state", "commit", "created"]
DONE, IN_PROGRESS, NOT_STARTED, UNREADABLE = "done", "in progress", "not started", "unreadable"


def _json(path: Path) -> dict | None:
    """The metadata in ``path``: None when absent, ``{UNREADABLE: reason}`` when it does not parse (a
    damaged file is reported as such, not as work not started)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return {UNREADABLE: f"{path.name}: {err}"}


def _verified(read, meta_path: Path) -> dict | None:
    """The JSON of a committed pair once its reader verified the pair (the table's SHA-256, rows and units:
    :func:`cwbook.evidence_export.read_committed`, :func:`cwbook.evidence_frames.read_frame`); None
    when absent, ``{UNREADABLE: reason}`` when refused (a changed or torn pair is not work done)."""
    try:
        found = read()
    except CommittedFileError as err:
        return {UNREADABLE: str(err)}
    except (OSError, UnicodeDecodeError, ValueError, KeyError) as err:
        return {UNREADABLE: f"{meta_path.name}: {err}"}
    return None if found is None else found[1]


def _state(held: int, planned: int) -> str:
    return DONE if held >= planned else IN_PROGRESS if held > 0 else NOT_STARTED


def _row(part, model, data, cell, planned, held, unit, commit="", created="", meta=None) -> dict:
    state = f"{UNREADABLE} ({meta[UNREADABLE]})" if meta and UNREADABLE in meta else _state(held, planned)
    return dict(part=part, model=model, data=data, cell=cell, planned=int(planned), held=int(held), unit=unit,
                state=state, commit=(commit or "")[:7], created=created or "")


def _ladder_rows(out: Path, model: str, p: dict) -> list[dict]:
    """Chapter 4's ladder cells of ``model`` (its main protocols, the removal-unit variants where the
    profile runs them, and the main cells again on its other weights)."""
    variants = p.get("variants") or []
    if p.get("variant_models") is not None and model not in p["variant_models"]:
        variants = []
    rows = []
    for name, cells in [(model, [cell_name(q) for q in p["protocols"]] + [cell_name("default", v) for v in variants]),
                        *((w, [cell_name(q) for q in p["protocols"]]) for w in weight_variant_names(model, p))]:
        for data in p["datasets"]:
            meta = _verified(lambda: read_committed(name, data, out), paths(name, data, out)[1]) or {}
            for cell in cells:
                record = meta.get("cells", {}).get(cell)
                if record is None and cell in meta.get("protocols", ()):  # an export older than ``cells``
                    record = {"documents": meta["documents"], "commit": meta.get("commit"),
                              "created": meta.get("created")}
                record = record or {}
                rows.append(_row("ladder", name, data, cell, p["n_sequences"], record.get("documents", 0),
                                 "documents", record.get("commit"), record.get("created"), meta))
    return rows


def _documents_row(out: Path, kind, part: str, model: str, data: str, cell: str, planned: int) -> dict:
    """The row of one committed frame of ``kind`` that counts documents (``document_ids`` in its JSON)."""
    meta = _verified(lambda: read_frame(kind, model, data, out), frame_paths(kind, model, data, out)[1]) or {}
    return _row(part, model, data, cell, planned, len(meta.get("document_ids", ())), "documents",
                meta.get("commit"), meta.get("created"), meta)


def _frame_rows(out: Path, model: str, p: dict) -> list[dict]:
    """The downstream tasks (examples of each task), the per-layer interventions and the protocol variants
    (documents of the first data set) and the anatomy (documents of each data set) of ``model``, from
    their committed frames."""
    rows = []
    if p.get("n_examples"):
        for task in p["tasks"]:
            meta = _verified(lambda: read_frame(DOWNSTREAM, model, task, out),
                             frame_paths(DOWNSTREAM, model, task, out)[1]) or {}
            held = len(meta.get("example_ids", {}).get(task, ()))
            rows.append(_row("downstream", model, task, "", p["n_examples"], held, "examples",
                             meta.get("commit"), meta.get("created"), meta))
    if p.get("per_layer_sequences"):
        data = p["datasets"][0]
        rows.append(_documents_row(out, PER_LAYER, "per-layer", model, data, "", p["per_layer_sequences"]))
    if p.get("sensitivity_sequences"):  # Table 8: every variant on the first documents of the first data set
        data = p["datasets"][0]
        meta = _verified(lambda: read_frame(SENSITIVITY, model, data, out),
                         frame_paths(SENSITIVITY, model, data, out)[1]) or {}
        rows.append(_row("protocol variants", model, data, f"{len(meta.get('variants', {})) or ''} variants".strip(),
                         p["sensitivity_sequences"], len(meta.get("document_ids", ())), "documents",
                         meta.get("commit"), meta.get("created"), meta))
    for data in p["datasets"]:  # the anatomy of the profile's documents (the build's step after the exports)
        rows.append(_documents_row(out, ANATOMY, "anatomy", model, data, "per-head", p["n_sequences"]))
    return rows


def _bench_rows(out: Path, model: str, profile: str, config) -> list[dict]:
    """The attribution bench of ``model``: one row per data set, the documents its committed frame holds
    (a data set's frame is written when it completes, so a bench half done shows as one data set done)."""
    p = run_parameters(BENCH_CHAPTER, profile, model, config=config)
    return [_documents_row(out, BENCH, BENCH_CHAPTER, model, data, "", p["n_sequences"]) for data in p["datasets"]]


def _chapter_row(out: Path, run) -> dict:
    """A chapter other than 4 whose table ``findings.csv`` reads: the documents its committed table ran
    with against the profile's."""
    from .findings import load_results

    # read through the verifying reader: a lost or changed table is not work done
    path = results_path(out, run.chapter.name, run.model)
    found = _verified(lambda: (lambda r: None if r is None else (r.table, r.metadata))(
        load_results(out, run.chapter.name, run.model)), path.with_suffix(".json"))
    meta = found or {}
    if not found and path.is_file() != path.with_suffix(".json").is_file():  # a table without its JSON
        meta = {UNREADABLE: f"{path.name} has no {path.with_suffix('.json').name} beside it"}
    ran = meta.get("parameters", {})
    held = int(ran.get("n_documents", ran.get("n_sequences", 0)) or 0)
    planned = int(run.parameters.get("n_sequences", 0))
    data = ran.get("data", "")
    return _row(run.chapter.name, run.model, ",".join(data) if isinstance(data, list) else data, "", planned, held,
                "documents", meta.get("commit"), meta.get("created"), meta)


def evidence_status(out: str | Path | None = None, *, profile: str = "evidence",
                    config: str | Path | None = None) -> pd.DataFrame:
    """One row per part of ``profile`` (:data:`STATUS_COLUMNS`): ``planned`` units, the ``held`` ones in
    ``out`` (default ``data/results/evidence``), and ``state`` (done, in progress, not started)."""
    out = Path(out) if out is not None else DEFAULT_OUT
    config = config or DEFAULT_BOOK_DIR / "run.yml"
    _, _, planned = plan(load_config(config), profile=profile)
    rows = []
    for run in planned:
        if run.model is None:
            continue
        if run.chapter.name == CHAPTER:
            p = notebook_parameters(profile, run.model, config)
            rows += _ladder_rows(out, run.model, p) + _frame_rows(out, run.model, p)
        elif run.chapter.name == BENCH_CHAPTER:
            rows += _bench_rows(out, run.model, profile, config)
        elif run.chapter.name in CHAPTERS:
            rows.append(_chapter_row(out, run))
    return pd.DataFrame(rows, columns=STATUS_COLUMNS)


def status_markdown(table: pd.DataFrame, profile: str = "evidence") -> str:
    """``table`` (:func:`evidence_status`) as the text of ``STATUS.md``: a summary line, then one
    markdown table per part."""
    counts = table["state"].value_counts()
    lines = [f"# Evidence build: what is committed (profile `{profile}`)", "",
             "Generated from the committed files by `python -m cwbook.evidence_status --write` (`make "
             "evidence` runs it after the tables); do not edit. `held` counts what the committed "
             "files hold of the `planned` units; a ladder cell in progress is committed as a checkpoint and "
             "is judged in `findings.csv` only once it holds every document.", "",
             f"**{counts.get(DONE, 0)} of {len(table)} parts done**, {counts.get(IN_PROGRESS, 0)} in progress, "
             f"{counts.get(NOT_STARTED, 0)} not started.", ""]
    for part, rows in table.groupby("part", sort=False):
        lines += [f"## {part}", "", "| model | data | cell | held / planned | state | commit | created |",
                  "|---|---|---|---:|---|---|---|"]
        for r in rows.itertuples():
            state = f"**{r.state}**" if r.state != DONE else r.state
            lines.append(f"| {r.model} | {r.data} | {r.cell} | {r.held} / {r.planned} {r.unit} | {state} | "
                         f"{r.commit} | {r.created} |")
        lines.append("")
    return "\n".join(lines)


def check_folder_profile(out: str | Path | None, profile: str) -> None:
    """Refuse to judge ``out``'s exports by another profile than the one they were made under (their JSONs'
    ``profile``): ``--profile smoke --write`` replaced the committed STATUS.md with "16 of 16 parts done"."""
    out = Path(out) if out is not None else DEFAULT_OUT
    made = sorted({str(meta["profile"]) for meta in map(_json, sorted(out.glob("*.json")))
                   if isinstance(meta, dict) and meta.get("profile")})
    if made and made != [profile]:
        raise ValueError(f"the exports in {out} were made under profile {', '.join(made)}, not {profile!r}: their "
                         f"status is judged by the plan of their own profile (--profile {made[0]})")


def write_status(out: str | Path | None = None, *, profile: str = "evidence", config: str | Path | None = None) -> Path:
    """Write ``out/STATUS.md`` (:func:`status_markdown` of :func:`evidence_status`) atomically; returns its path.
    A folder whose exports were made under another profile is refused (:func:`check_folder_profile`)."""
    check_folder_profile(out, profile)
    out = Path(out) if out is not None else DEFAULT_OUT
    path = out / STATUS_FILE
    cw_cache.atomic_write_bytes(path, status_markdown(evidence_status(out, profile=profile, config=config),
                                                      profile).encode())
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwbook.evidence_status", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help=f"folder of the committed evidence (default {DEFAULT_OUT})")
    parser.add_argument("--profile", default="evidence")
    parser.add_argument("--write", action="store_true", help=f"write {STATUS_FILE} there instead of printing it")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    args = parser.parse_args(argv)
    from cwcore.cli import debug_requested, run_command

    return run_command("python -m cwbook.evidence_status", lambda: _main(args), debug_requested(argv),
                       user_errors=(ValueError, BookError))


def _main(args) -> int:
    from cwcore.cli import UsageError

    if args.out is not None and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out}: no such folder of committed evidence (default {DEFAULT_OUT})")
    # a profile run.yml has (one it lacks ended in a traceback), and the folder's own
    profile_config(load_config(DEFAULT_BOOK_DIR / "run.yml"), args.profile)
    check_folder_profile(args.out, args.profile)
    if args.write:
        print(f"wrote {write_status(args.out, profile=args.profile)}")
    else:
        print(status_markdown(evidence_status(args.out, profile=args.profile), args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
