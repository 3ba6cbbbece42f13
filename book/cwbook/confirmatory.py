"""``make confirmatory``: the confirmatory sample's evidence, computed after its registration.

``python -m cwbook.confirmatory build [--models m1,m2] [--jobs N]`` computes the registered tests on the
confirmatory sample (:func:`cwbook.registration.confirmatory_blocks`) with the ``confirmatory`` profile's
parameters into ``data/results/confirmatory``, never executing a notebook, in three resumable steps:
``ladder`` (chapter 4's eight cells through :func:`cwbook.evidence_build.ladder_cell`, checkpointed into
``per_document_<model>_<data>.csv.gz``), ``sinks`` (chapters 5-7's claims tables, :func:`sink_tables`) and
``tables`` (:func:`cwbook.evidence_export.tables`: the ladder tables and ``findings.csv``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from . import registration

#: the committed confirmatory evidence (beside the exploratory ``data/results/evidence``)
OUT = Path(__file__).resolve().parents[2] / "data" / "results" / "confirmatory"  # findings.CONFIRMATORY_DIR
#: the profile of ``book/run.yml`` that holds the parameters, and the name every confirmatory export carries
PROFILE = registration.CONFIRMATORY
CHAPTER = "04_faithfulness"
SINK_CHAPTERS = ("05_sink_decomposition", "06_sinks_as_suppressors", "07_semantic_cone")


def ladder_parameters(model: str) -> dict:
    """Chapter 4's parameters under the confirmatory profile (:func:`cwbook.parameters.run_parameters`)."""
    from .parameters import run_parameters

    return run_parameters(CHAPTER, PROFILE, model)


def _sample(data: str, tokenizer, smoke: int | None):
    """The registered sample of ``data``; with ``smoke``, that many documents of the *exploratory* sample
    instead (a check of the code path that looks at no confirmatory document)."""
    if smoke is None:
        return registration.confirmatory_blocks(data, tokenizer)
    from cwcore.data import document_blocks, load_dataset

    return document_blocks(load_dataset(data), tokenizer, registration.CONFIRMATORY_SEQ_LEN, int(smoke),
                           seed=registration.EXPLORATORY_SEED)


def _profile(smoke: int | None) -> str:
    """The profile a run's files carry: a smoke run's never reads as the confirmatory sample."""
    return PROFILE if smoke is None else f"{PROFILE}-smoke"


def ladder(models: Sequence[str] = registration.CONFIRMATORY_MODELS,
           datasets: Sequence[str] = registration.CONFIRMATORY_DATA, *, out: str | Path = OUT,
           smoke: int | None = None, log=print) -> list[Path]:
    """The confirmatory ladder cells of ``models`` x ``datasets`` (see the module's docstring), each protocol
    in turn, merged into ``out`` as they go. ``smoke``: that many *exploratory* documents instead, into
    another ``out`` (a check of the code path). Returns the exports written."""
    import cwcore
    from . import ladder as evidence
    from .evidence_build import CHECKPOINT_DOCUMENTS, ladder_cell
    from .evidence_export import paths

    out = Path(out)
    written = []
    for model in models:
        p = ladder_parameters(model)
        ratios = evidence.RatioGrids(p["low_ratios"], p["ratios"]).ratios
        lm, tokenizer = cwcore.load_model(model, dtype=p["dtype"], device=p["device"])
        for data in datasets:
            blocks = _sample(data, tokenizer, smoke)
            for protocol in p["protocols"]:
                t0 = time.monotonic()
                ladder_cell(lm, tokenizer, blocks, p["metrics"], ratios, model=model, data=data, protocol=protocol,
                            importances=p["importances"], profile=_profile(smoke), seed=p["seed"], dtype=p["dtype"],
                            exports=out, checkpoint=CHECKPOINT_DOCUMENTS, log=log, batch_size=p["batch_size"],
                            max_length=p["seq_len"], random_seeds=p["random_seeds"], n_bootstrap=p["n_bootstrap"],
                            progress=True, cache=p["cache"])
                log(f"confirmatory  {model} {data} {protocol}: {time.monotonic() - t0:.0f} s")
            written += list(paths(model, data, out))
        del lm
    return written


def sink_tables(results_by_data: Mapping[str, dict], parameters: Mapping[str, dict]) -> dict[str, pd.DataFrame]:
    """Chapters 5-7's claims tables from one pass of every sink analysis per data set
    (``results_by_data[data] = run_analyses(..., sinks.ANALYSES, raw=True)``), each stacked over the data
    sets (:func:`cwbook.sink_claims.stack_data`) exactly as the chapters stack theirs. ``parameters``: each
    chapter's parameters (``n_bootstrap``, ``quantiles``) by chapter name."""
    from cwbook import sink_claims
    from cwcore.sinks.engine import EPS

    seed = int(next(iter(parameters.values()))["run_parameters"].get("seed", 0))
    options = {c: dict(n_resamples=parameters[c]["n_bootstrap"], seed=seed) for c in SINK_CHAPTERS}
    options["07_semantic_cone"]["quantiles"] = parameters["07_semantic_cone"]["quantiles"]
    return {chapter: sink_claims.stack_data({d: sink_claims.chapter_claims(chapter, r, EPS.default, **options[chapter])
                                             for d, r in results_by_data.items()})
            for chapter in SINK_CHAPTERS}


def sinks(models: Sequence[str] = registration.CONFIRMATORY_MODELS,
          datasets: Sequence[str] = registration.CONFIRMATORY_DATA, *, out: str | Path = OUT,
          smoke: int | None = None, log=print) -> list[Path]:
    """Chapters 5-7's claims tables of ``models`` on the confirmatory sample (one pass of every sink
    analysis per data set, :func:`sink_tables`), written to ``out/<chapter>/<model>.csv`` with their JSON.
    ``smoke``: as in :func:`ladder`. Returns the paths written."""
    from cwcore import sinks as sink_analyses
    from . import results_path
    from .evidence_files import checkout
    from .findings import save_results
    from .notebook import SinkRun
    from .parameters import run_parameters

    out = Path(out)
    written = []
    code = checkout()  # the commit that computes, read before it runs (and whether cwcore was edited)
    for model in models:
        parameters = {c: run_parameters(c, PROFILE, model) for c in SINK_CHAPTERS}
        run = SinkRun.of(parameters["05_sink_decomposition"]["run_parameters"])
        options = run.options()
        lm, tokenizer = run.load(model)
        t0 = time.monotonic()
        samples = {d: _sample(d, tokenizer, smoke) for d in datasets}
        results = {}
        with run.caching():
            for d in datasets:  # a line per data set: a pass takes tens of minutes
                log(f"confirmatory  {model} sink pass on {d}: started")
                started = time.monotonic()
                results[d] = sink_analyses.run_analyses(
                    lm, tokenizer, samples[d], list(sink_analyses.ANALYSES), options, raw=True,
                    sample_size=parameters["05_sink_decomposition"]["sample_size"],
                    bins=parameters["06_sinks_as_suppressors"]["bins"],
                    min_range=parameters["06_sinks_as_suppressors"]["min_range"],
                    quantiles=parameters["07_semantic_cone"]["quantiles"])
                log(f"confirmatory  {model} sink pass on {d}: {time.monotonic() - started:.0f} s")
        n = min(len(blocks) for blocks in samples.values())
        for chapter, table in sink_tables(results, parameters).items():
            path = results_path(out, chapter, model)
            save_results(path, table, chapter=chapter, model=model, profile=_profile(smoke),
                         parameters=dict(data=",".join(datasets), n_documents=n, seq_len=run.seq_len, seed=run.seed,
                                         dtype=run.dtype, n_bootstrap=parameters[chapter]["n_bootstrap"],
                                         sample=registration.EXPLORATORY if smoke else registration.CONFIRMATORY,
                                         **code))
            written += [path, path.with_suffix(".json")]
        log(f"confirmatory  {model} sink pass: {time.monotonic() - t0:.0f} s")
        del lm
    return written


def ladder_progress(out: str | Path = OUT) -> list[dict]:
    """Per registered ladder cell, as its committed export's metadata records it: ``model``, ``data``,
    ``protocol``, ``documents`` (held, of :data:`~cwbook.registration.CONFIRMATORY_DOCUMENTS`) and
    ``created`` (when it was last merged, "" for none)."""
    from .evidence_export import read_committed
    from .evidence_files import CommittedFileError

    cells_held = []
    for model in registration.CONFIRMATORY_MODELS:
        protocols = ladder_parameters(model)["protocols"]
        for data in registration.CONFIRMATORY_DATA:
            try:  # through the verifying reader: a changed or lost table holds nothing (it counted as done)
                found = read_committed(model, data, Path(out))
                cells, why = ({} if found is None else found[1].get("cells", {})), ""
            except CommittedFileError as err:
                cells, why = {}, f"unreadable: {err}"
            for protocol in protocols:
                cells_held.append({"model": model, "data": data, "protocol": protocol,
                                   "documents": int(cells.get(protocol, {}).get("documents", 0)),
                                   "created": why or cells.get(protocol, {}).get("created", "")})
    return cells_held


def status(out: str | Path = OUT) -> str:
    """``STATUS.md`` of the confirmatory folder (markdown): per registered ladder cell the documents its
    export holds of the registered number, per model the sink chapters' tables present, and what is left."""
    from . import results_path

    out = Path(out)
    n = registration.CONFIRMATORY_DOCUMENTS
    rows, done, parts = [], 0, 0
    for cell in ladder_progress(out):
        rows.append(f"| {cell['model']} | {cell['data']} | {cell['protocol']} | {cell['documents']} of {n} "
                    f"| {cell['created']} |")
        parts += 1
        done += cell["documents"] == n
    sink_rows = []
    from .findings import results_verified

    for model in registration.CONFIRMATORY_MODELS:  # a table whose pair verifies, not one merely present
        present = [c for c in SINK_CHAPTERS if results_verified(results_path(out, c, model))]
        sink_rows.append(f"| {model} | {len(present)} of {len(SINK_CHAPTERS)} | {', '.join(present) or 'none'} |")
        parts += 1
        done += len(present) == len(SINK_CHAPTERS)
    return "\n".join([
        "# Confirmatory evidence: what is committed", "",
        f"Written by `python -m cwbook.confirmatory status` (`make confirmatory` rewrites it). {done} of {parts} "
        "parts done. The registration (book/preregistration.md) fixed these parts before any was computed.", "",
        "| model | data | protocol | documents | last merged |", "| --- | --- | --- | --- | --- |", *rows, "",
        "| model | sink chapters' tables | present |", "| --- | --- | --- |", *sink_rows, ""])


def write_status(out: str | Path = OUT) -> Path:
    """Write :func:`status` to ``out/STATUS.md`` (atomically); returns its path."""
    from cwcore.cache import atomic_write_bytes

    path = Path(out) / "STATUS.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, status(out).encode())
    return path


def tables(out: str | Path = OUT) -> list[Path]:
    """Chapter 4's ladder tables from the confirmatory exports and both ``findings.csv``
    (:func:`cwbook.evidence_export.tables`)."""
    from . import evidence_export

    return evidence_export.tables(out)


def refuse_unregistered(models: Sequence[str], datasets: Sequence[str] = ()) -> None:
    """One line (status 2) naming every model or data set the registration does not hold: the confirmatory
    folder holds the registered ones only."""
    from cwcore.cli import UsageError

    unknown = [m for m in models if m not in registration.CONFIRMATORY_MODELS] + \
              [d for d in datasets if d not in registration.CONFIRMATORY_DATA]
    if unknown:
        raise UsageError(f"not registered: {', '.join(unknown)} (registered models "
                         f"{', '.join(registration.CONFIRMATORY_MODELS)}, "
                         f"data {', '.join(registration.CONFIRMATORY_DATA)})")


def build(*, profile: str = PROFILE, models=None, only=None, out: str | Path = OUT, config_path=None,
          force: bool = False, html: bool = True, build_dir=None, book_dir=None, notebooks_dir=None) -> list[Path]:
    """The three steps of the module's docstring in order (``only``: a subset of "ladder", "sinks",
    "tables"); what ``python -m cwbook build --profile confirmatory`` runs. It executes no notebook and builds
    no HTML, on the registered models only: a notebook build's options, or another model, are refused (an
    unregistered model was written into the committed folder, and ``--config`` ran the registered sizes)."""
    from cwcore.cli import UsageError

    from . import DEFAULT_BOOK_DIR, DEFAULT_NOTEBOOKS_DIR

    given = {"--config": config_path is not None, "--force": force, "--no-html": not html,
             "--build-dir": build_dir is not None,
             "--book-dir": book_dir is not None and Path(book_dir) != DEFAULT_BOOK_DIR,
             "--notebooks-dir": notebooks_dir is not None and Path(notebooks_dir) != DEFAULT_NOTEBOOKS_DIR}
    if any(given.values()):
        raise UsageError(f"{', '.join(flag for flag, on in given.items() if on)}: the confirmatory build executes no "
                         "notebook and reads its sizes from the registration (python -m cwbook.confirmatory)")
    models, steps = _models_and_steps(models, only)
    written = []
    if "ladder" in steps:
        written += ladder(models, out=out)
    if "sinks" in steps:
        written += sinks(models, out=out)
    if "tables" in steps:
        written += tables(out)
    return written + [write_status(out)]


STEPS = ("ladder", "sinks", "tables")


def _models_and_steps(models, only) -> tuple[list[str], list[str]]:
    """The registered models (default: all) and steps (``only``: some of :data:`STEPS`) of a build."""
    from cwcore.cli import UsageError

    if isinstance(models, str):
        models = [m for m in models.split(",") if m]
    models = list(models or registration.CONFIRMATORY_MODELS)
    refuse_unregistered(models)
    steps = list(STEPS) if not only else [s.strip() for s in str(only).split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        raise UsageError(f"unknown steps {unknown}: the confirmatory build has ladder, sinks and tables "
                         "(python -m cwbook.confirmatory ladder|sinks|tables runs one)")
    return models, steps


def plan(*, models=None, only=None, out: str | Path = OUT) -> list[str]:
    """What :func:`build` computes, a line per ladder cell and sink pass with its parameters, executing
    nothing: what ``python -m cwbook plan --profile confirmatory`` prints (the profile runs no notebook)."""
    import json

    from . import results_path
    from .evidence_export import paths
    from .parameters import run_parameters

    models, steps = _models_and_steps(models, only)
    out = Path(out)
    lines = [f"the confirmatory build (python -m cwbook.confirmatory build) executes no notebook; it writes {out}"]
    for model in models if "ladder" in steps else ():
        p = ladder_parameters(model)
        shown = {k: p[k] for k in ("protocols", "metrics", "importances", "low_ratios", "ratios", "seq_len",
                                   "random_seeds", "n_bootstrap", "seed", "dtype")}
        for data in registration.CONFIRMATORY_DATA:
            lines.append(f"ladder  {model} on {data:<10} -> {paths(model, data, out)[0].name}  {json.dumps(shown)}")
    for model in models if "sinks" in steps else ():
        shared = run_parameters(SINK_CHAPTERS[0], PROFILE, model)["run_parameters"]
        written = ", ".join(str(results_path(out, c, model).relative_to(out)) for c in SINK_CHAPTERS)
        data = ",".join(registration.CONFIRMATORY_DATA)
        lines.append(f"sinks   {model} on {data} -> {written}  {json.dumps(shared)}")
    if "tables" in steps:
        lines.append("tables  the ladder tables and findings.csv from the exports above")
    return lines


def _register_profile_build() -> None:
    from . import PROFILE_BUILDS, PROFILE_PLANS

    PROFILE_BUILDS[PROFILE] = build
    PROFILE_PLANS[PROFILE] = plan


_register_profile_build()


def main(argv=None) -> int:
    """The command line; 0 when done, 2 for bad input (one line, before any work), 1 for a bug."""
    from cwcore.cli import debug_requested, run_command

    from . import BookError

    return run_command("python -m cwbook.confirmatory", lambda: _main(argv), debug_requested(argv),
                       user_errors=(BookError,))


def _main(argv=None) -> int:
    from cwcore.cli import UsageError

    parser = argparse.ArgumentParser(prog="python -m cwbook.confirmatory", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"build": "every step below, in order", "ladder": "compute (or resume) the ladder cells",
                "sinks": "the sink pass and chapters 5-7's claims tables", "tables": "the ladder tables and findings.csv",
                "status": "write STATUS.md: what the folder holds of the registered parts"}
    for name, text in commands.items():
        p = sub.add_parser(name, help=text)
        if name not in ("tables", "status"):
            p.add_argument("--models", default=",".join(registration.CONFIRMATORY_MODELS))
            p.add_argument("--jobs", type=int, default=None,
                           help="single-thread ranks per sweep (default: $CWCORE_JOBS or 1)")
        if name in ("ladder", "sinks"):
            p.add_argument("--data", default=",".join(registration.CONFIRMATORY_DATA))
            p.add_argument("--smoke", type=int, default=None, metavar="N",
                           help="N exploratory documents instead of the registered sample: a check of the code path "
                                "that looks at no confirmatory document (needs --out elsewhere)")
        p.add_argument("--out", default=str(OUT))
        p.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    args = parser.parse_args(argv)
    models = [m for m in getattr(args, "models", "").split(",") if m]
    datasets = [d for d in getattr(args, "data", ",".join(registration.CONFIRMATORY_DATA)).split(",") if d]
    refuse_unregistered(models, datasets)
    smoke = getattr(args, "smoke", None)
    if smoke is not None and Path(args.out).resolve() == OUT.resolve():
        raise UsageError("--smoke writes exploratory documents: give --out another folder than the committed "
                         "evidence")
    for flag, value in (("--smoke", smoke), ("--jobs", getattr(args, "jobs", None))):
        if value is not None and value < 1:  # before any model loads (they failed after it, in a traceback)
            raise UsageError(f"{flag} must be at least 1, got {value}")
    if args.command in ("status", "tables") and not Path(args.out).is_dir():  # a typo wrote "0 of 10 parts done"
        raise UsageError(f"--out {args.out}: no such folder of confirmatory exports")
    if getattr(args, "jobs", None) is not None:
        os.environ["CWCORE_JOBS"] = str(args.jobs)
    if args.command == "build":
        build(models=models, out=args.out)
    elif args.command == "ladder":
        ladder(models, datasets, out=args.out, smoke=smoke)
    elif args.command == "sinks":
        sinks(models, datasets, out=args.out, smoke=smoke)
    elif args.command == "status":
        print(f"wrote {write_status(args.out)}")
    else:
        tables(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
