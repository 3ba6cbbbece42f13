"""``make evidence``: the evidence profile, resumed from the repository, then its tables and ``PROVENANCE``.

:func:`build_evidence` (``python -m cwbook build --profile evidence [--jobs N]``)

1. executes the profile's notebooks; a ladder cell (:func:`ladder_cell`) is taken from its committed export
   when its first :data:`SLICE_DOCUMENTS` documents, recomputed without the cache, equal the committed rows
   within :data:`ATOL` nats plus :data:`RTOL` relative, else computed, merging every
   :data:`CHECKPOINT_DOCUMENTS` documents into the export (so a new machine resumes from what is committed);
2. copies the sink chapters' tables (:func:`copy_chapter_tables`), exports chapter 4's per-document rows,
   remakes the evidence tables and ``findings.csv`` (:func:`export_and_tables`), the anatomy
   (:func:`anatomy_evidence`) and ``STATUS.md``;
3. writes ``PROVENANCE`` (:func:`write_provenance`): commit, code hashes, cache hits and misses over every
   process, the committed cells taken and recomputed, wall time, machine and launcher.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

import cwcore
from cwcore import cache as cw_cache
from cwcore import runs
from cwcore.data import document_blocks, load_dataset
from . import ladder as evidence
from .anatomy import LADDER
from cwcore.faithfulness.protocol import Protocol, identical_steps
from cwcore.faithfulness.ranking import MODES
from . import DEFAULT_BOOK_DIR, slug, PROFILE_BUILDS, build as book_build, load_config, plan, results_path
from . import evidence_export
from .evidence_files import DEFAULT_OUT, CommittedFileError, checked_table_what, checkout, now, write_checked_csv
from .evidence_export import CHAPTER, compare, export, notebook_parameters, read_committed, tables as export_tables
from .evidence_frames import (ANATOMY, ATOL, BENCH, CELLS_ENV_VAR, DOWNSTREAM, NOT_NUMBERS, PER_LAYER, RTOL,
                              SENSITIVITY, SLICE_DOCUMENTS, anatomy_cell, anatomy_explained, check_identity, checked_how,
                              downstream_cell, frame_paths, per_layer_cell, record_decision,
                              recorded_decision, remembering, say, slice_check, this_cpu)
from .evidence_status import write_status
from .findings import BENCH_CHAPTER
from .parameters import run_parameters

#: documents a ladder cell computes between two merges into its export during the evidence build
#: (about 20 minutes of smollm2-135m, 45 of gemma3-270m on 2 CPU cores): what is finished can be committed
CHECKPOINT_DOCUMENTS = 16
CHECKPOINT_ENV_VAR = "CWCORE_EVIDENCE_CHECKPOINT"
CODE_SCOPES = ("faithfulness", "sinks")  # the producing code of the evidence profile's results


def committed_documents(model: str, data: str, protocol: str, documents: Sequence[int], metrics, ratios, importances,
                        *, profile: str, seq_len: int, seed: int, dtype: str, exports: str | Path | None = None,
                        variant: str = "main", multiple: int = 1, found=False) -> tuple[pd.DataFrame | None, int, str]:
    """(rows, held, why): the committed rows of one ladder cell (its ``protocol`` and ``variant``) on its first
    ``held`` ``documents``, the longest leading run of them that the export holds whole (every
    importance, metric, ratio and mode), cut to a multiple of ``multiple`` unless it is all of them
    (a checkpointed build merges whole batches); rows None and ``held`` 0 with the reason otherwise.
    ``found``: the export as :func:`~cwbook.evidence_export.read_committed` already read it."""
    if found is False:
        found = _read_or_refused(model, data, exports)
    if isinstance(found, CommittedFileError):
        return None, 0, f"the committed export is refused: {found}"
    if found is None:
        return None, 0, "no committed export"
    table, meta = found
    same = {"profile": profile, "seq_len": int(seq_len), "seed": int(seed), "dtype": str(dtype)}
    differ = [k for k, v in same.items() if meta.get(k) != v]
    if differ:
        return None, 0, "the export ran with other " + ", ".join(f"{k} ({meta.get(k)!r}, not {same[k]!r})"
                                                                for k in differ)
    documents = [int(d) for d in documents]
    listed = [int(d) for d in meta["document_ids"][:len(documents)]]
    if listed != documents[:len(listed)]:
        return None, 0, "the export holds other documents"
    variants = table["variant"] if "variant" in table else pd.Series("main", index=table.index)
    rows = table[(table["protocol"] == protocol) & (variants == variant) & table["importance"].isin(list(importances))
                 & table["metric"].isin(list(metrics)) & table["document"].isin(documents)]
    rows = rows[rows["ratio"].astype(float).round(9).isin([round(float(r), 9) for r in ratios])]
    per_document = len(importances) * len(metrics) * len(ratios) * len(meta["modes"])
    counts = rows.groupby("document").size()
    held = 0
    while held < len(documents) and counts.get(documents[held], 0) == per_document:
        held += 1
    if held < len(documents):
        held -= held % max(1, int(multiple))
    if held < len(documents):
        why = (f"the export holds {len(rows)} of the cell's {per_document * len(documents)} rows"
               + (f" (its first {held} documents whole)" if held else ""))
    else:
        why = "committed"
    if held == 0:
        return None, 0, why
    rows = rows[rows["document"].isin(documents[:held])]
    broken = _broken_identities(rows, protocol, variant)
    if broken:
        return None, 0, (f"the export breaks the protocol's identical rungs ({broken}: they rank alike by "
                         "construction, so their rows must be equal; made before the rung-tie fix)")
    return rows.reset_index(drop=True), held, why


def _read_or_refused(model: str, data: str, exports) -> tuple | None | CommittedFileError:
    """:func:`~cwbook.evidence_export.read_committed`, or the reason it refused the export."""
    try:
        return read_committed(model, data, exports)
    except CommittedFileError as err:
        return err


def _broken_identities(rows: pd.DataFrame, protocol: str, variant: str) -> str:
    """The steps whose two rungs :func:`cwcore.faithfulness.protocol.identical_steps` ranks identically
    under the cell's protocol but whose committed rows differ (checked on every row, not a slice)."""
    change = {**evidence.PROTOCOLS[protocol], **evidence.VARIANT_CHANGES.get(variant, {})}
    keys = ["importance", "mode", "ratio", "document"]
    broken = []
    for lower, higher in sorted(identical_steps(Protocol(**change))):
        pair = [rows[rows["metric"] == m].set_index(keys)["nll"].sort_index() for m in (lower, higher)]
        if len(pair[0]) and len(pair[0]) == len(pair[1]) and not pair[0].equals(pair[1]):
            broken.append(f"{lower} and {higher} differ in {int((pair[0] != pair[1]).sum())} rows")
    return "; ".join(broken)


def checkpoint_documents(checkpoint: int | None, batch_size: int) -> int:
    """Documents computed between two merges into the export (0: none): ``checkpoint``, or
    ``$CWCORE_EVIDENCE_CHECKPOINT`` (the evidence build sets it), rounded up to whole batches on every
    rank (:func:`cwcore.runs.world`, ``$CWCORE_JOBS``), so each slice runs the batches a whole run runs."""
    if checkpoint is None:
        value = os.environ.get(CHECKPOINT_ENV_VAR, "").strip()
        checkpoint = int(value) if value else 0
    if checkpoint <= 0:
        return 0
    ranks = runs.world()
    step = int(batch_size) * max(1, ranks[1] if ranks else runs.local_jobs())
    return -(-int(checkpoint) // step) * step


def ladder_cell(lm, tokenizer, blocks, metrics, ratios, *, model: str, data: str, protocol: str = "default",
                importances: Sequence[str] = evidence.IMPORTANCES, profile: str, seed: int = 0, dtype: str = "float32",
                exports: str | Path | None = None, slice_documents: int = SLICE_DOCUMENTS, atol: float = ATOL, rtol: float = RTOL,
                sweep: Callable = evidence.ladder_sweep, log: Callable[[str], None] | None = print,
                checkpoint: int | None = None, **kwargs) -> pd.DataFrame:
    """``sweep(lm, tokenizer, blocks, metrics, ratios, protocol=..., importances=..., seed=seed, **kwargs)``
    (:func:`cwbook.ladder.ladder_sweep`: the per-sequence table of one ladder cell), resumed
    from the cell's committed rows (:func:`committed_documents`; ``model`` and ``data`` name the export)
    when ``sweep`` on the first ``slice_documents`` blocks, without the cache, gives the same rows within
    ``atol`` nats plus ``rtol`` of the committed value (:func:`cwbook.evidence_export.compare`): the documents the export holds whole are
    taken, the rest computed (``first_sequence``: the same batches as a whole run)."""
    t0 = time.monotonic()
    call = dict(protocol=protocol, importances=list(importances), seed=seed, **kwargs)
    seq_len = len(blocks[0]["input_ids"])
    chosen = Protocol(**{**evidence.PROTOCOLS[protocol], **kwargs.get("protocol_change", {})})
    variant = chosen.variant
    same = dict(profile=profile, seq_len=seq_len, seed=seed, dtype=dtype)
    documents = list(blocks["document"])
    n = len(documents)
    batch = int(kwargs.get("batch_size", 16))
    every_slice = checkpoint_documents(checkpoint, batch)
    seeds = evidence.extra_seed_labels(metrics, seed, kwargs.get("random_seeds", 1))
    labels = [*metrics, *seeds]
    found = _read_or_refused(model, data, exports)
    if isinstance(found, CommittedFileError):  # every merge into it would be refused after the work (16 documents)
        raise CommittedFileError(f"{found}; the cells of {model} {data} share that export, so none can be merged "
                                 "into it: restore it from git (or move both files aside), then run again")
    look = dict(**same, exports=exports, variant=variant, multiple=batch, found=found)
    whole, held_whole, why = committed_documents(model, data, protocol, documents, labels, ratios, importances, **look)
    base, held = whole, held_whole
    if seeds:
        base, held, why_base = committed_documents(model, data, protocol, documents, metrics, ratios, importances,
                                                   **look)
        why = why if held_whole else why_base
    label = f"{model} {data} {protocol}" + (f" ({variant})" if variant != "main" else "")
    decision = {"model": model, "data": data, "protocol": protocol, "documents": n,
                **({"variant": variant} if variant != "main" else {})}
    taken: list[pd.DataFrame] = []
    todo: list[tuple[int, int, bool]] = [(0, n, False)]  # (first, stop, extra seeds only)
    replace = True
    if held:
        kept = whole if held_whole else base
        if held_whole == n:
            decision["cell_sha256"] = evidence_export.cell_rows_hash(kept)
        earlier = recorded_decision(decision) if held_whole == n else None
        if earlier is not None:  # checked (or computed) earlier in this build (the notebook's kernel): not again
            return _ordered([_plain(kept)], labels, importances, chosen.kind)
        head = blocks.select(range(min(slice_documents, held)))
        checked = {**call, "random_seeds": 1} if held_whole < len(head) else call  # what the export holds
        reference = (whole if held_whole >= len(head) else base)
        reference = reference[reference["document"].isin(list(head["document"]))]
        identity = check_identity(
            {"cell": label, "metrics": list(metrics), "ratios": [float(r) for r in ratios],
             "call": {k: v for k, v in checked.items() if k not in NOT_NUMBERS}},
            reference, computed_by=remembering(sweep, call), lm=lm, units=runs.tensor_digest(list(head["input_ids"])),
            atol=atol, rtol=rtol)

        def check():
            fresh = sweep(lm, tokenizer, head, metrics, ratios, **{**checked, "cache": False}).assign(data=data,
                                                                                                      model=model)
            bad = compare(reference.assign(data=data, model=model), fresh, atol=atol, rtol=rtol)
            diff = float((fresh.merge(reference, on=["importance", "metric", "mode", "ratio", "document"],
                                      suffixes=("", "_c")).eval("abs(nll - nll_c)").max()))
            return bad, len(fresh), diff

        bad, slice_rows, diff, before = slice_check(identity, check)
        if before is not None:  # this machine passed the same check (same code, model, rows, libraries)
            decision["checked_before"] = before["checked"]
        decision.update(slice_rows=slice_rows, max_abs_diff_nll=diff, check_s=round(time.monotonic() - t0, 1))
        if bad.empty:  # the main metrics' rows of ``held`` documents, the extra seeds' of ``held_whole``
            taken = [base] + ([whole[whole["metric"].isin(seeds)]] if seeds and held_whole else [])
            todo = ([(held_whole, held, True)] if seeds and held > held_whole else []) + \
                   ([(held, n, False)] if held < n else [])
            replace = False
            missing = [f"seeds {', '.join(seeds)} on documents {a + 1}-{b}" for a, b, only in todo if only]
            missing += [f"documents {a + 1}-{b}" for a, b, only in todo if not only]
            say(log, f"{label}: committed export taken for {held} of {n} documents (first {len(head)} {checked_how(before)}, "
                      f"{slice_rows} rows within {atol:g} nats + {rtol:g} relative, max |diff| {diff:.1e})"
                      + (f"; computing {'; '.join(missing)}" if missing else ""))
            decision["decision"] = "committed" if held == n else "resumed"
            if held < n:
                decision["documents_taken"] = held
            if seeds and held_whole < held:
                decision["seeds_computed"] = seeds
        else:
            why = (f"{len(bad)} of {slice_rows} recomputed rows differ from the export by more than {atol:g} nats "
                   f"+ {rtol:g} relative")
    if todo == [(0, n, False)]:
        decision.update(decision="recomputed", reason=why)
        if held or not (why == "no committed export" or "profile" in why):  # another profile: silent
            say(log, f"{label}: computing the cell ({why})")
    computed = []
    for first, stop, extra_only in todo:
        size = every_slice or (stop - first)
        for a in range(first, stop, size):
            b = min(a + size, stop)
            part = sweep(lm, tokenizer, blocks if (a, b) == (0, n) else blocks.select(range(a, b)), metrics, ratios,
                         **{**call, **({"extra_seeds_only": True} if extra_only else {}),
                            **({"first_sequence": a} if a else {})})
            computed.append(part)
            if every_slice and runs.is_main_rank():
                csv, _ = evidence_export.merge_cell(model, data, part, protocol=protocol, variant=variant, **same,
                                                    document_ids=documents, out=exports, replace=replace)
                replace = False
                say(log, f"{label}: documents {a + 1}-{b} of {n} merged into {csv.name} "
                          f"({time.monotonic() - t0:.0f} s)")
    if todo:
        decision["compute_s"] = round(time.monotonic() - t0, 1)
    if len(computed) == 1 and not taken:
        out = computed[0]
    else:
        out = _ordered([*map(_plain, taken), *computed], labels, importances, chosen.kind)
    if every_slice and todo:
        decision.update(merged=True, cell_sha256=evidence_export.cell_rows_hash(out))
    record_decision(decision)
    return out


def _plain(rows: pd.DataFrame) -> pd.DataFrame:
    """Committed rows as the sweep returns them (without the export's own columns)."""
    return rows.drop(columns=[c for c in ("data", "model", "delta_nll") if c in rows])


def _ordered(parts: list[pd.DataFrame], labels, importances, kind: str) -> pd.DataFrame:
    columns = list(parts[-1].columns)
    rows = pd.concat([p[[c for c in columns if c in p.columns]] for p in parts], ignore_index=True)
    return evidence.sweep_order(rows, labels, importances, kind=kind)


# -- PROVENANCE ------------------------------------------------------------------------------------
def _machine() -> dict:
    import torch

    out = {"node": platform.node(), "platform": platform.platform(), "processor": platform.processor() or None,
           "cpu": this_cpu() or platform.processor() or None, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    out["transformers"] = evidence_export._version("transformers")
    return out


PROVENANCE_WHAT = ("provenance of `make evidence` (python -m cwbook build --profile evidence), written by "
                   "cwbook.evidence_build: one record per build, each with the chapters whose tables it made")


def provenance_record(*, profile: str, models, only, wall_s: float, tally: dict, cells: list[dict],
                      written: Sequence[Path] = (), chapters: Sequence[str] = (), config=None) -> dict:
    """What ``PROVENANCE`` holds (see the module's docstring), as a dict."""
    if isinstance(models, str):
        models = [m.strip() for m in models.split(",") if m.strip()]
    return {
        **checkout(),
        "profile": profile, "models": list(models) if models else None, "only": only,
        "code_hashes": {scope: cw_cache.code_version((scope,)) for scope in CODE_SCOPES},
        "cache": {"hits": tally["hits"], "misses": tally["misses"], "processes": tally["processes"]},
        "committed_cells": {"taken": [c for c in cells if c.get("decision") == "committed"],
                            "recomputed": [c for c in cells if c.get("decision") == "recomputed"]},
        "chapters": list(chapters or []), "created": now(),
        "wall_s": round(float(wall_s), 1), "machine": _machine(), **{"launch": runs.launch_info()},
        "written": [Path(p).name for p in written],
        **({"config": {"path": str(config), "sha256": _file_hash(config)}} if config is not None else {}),
    }


def _file_hash(path) -> str | None:
    import hashlib

    path = Path(path)
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


_CHAPTER_NAME = re.compile(r"\b\d\d[a-z]?_[a-z_]+")


def read_provenance(path: str | Path) -> dict:
    """``PROVENANCE`` as a dict ``{"what", "builds": [record, ...], "earlier": [line, ...]}`` (empty lists
    when absent; the plain-text lines of a file older than the JSON one are kept as ``earlier``)."""
    path = Path(path)
    text = path.read_text() if path.is_file() else ""
    try:
        found = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        found = {"earlier": [line.strip() for line in text.splitlines() if line.strip()]}
    if "builds" not in found and "commit" in found:  # one record, as the first JSON files held
        found = {"builds": [found]}
    return {"what": PROVENANCE_WHAT, "builds": list(found.get("builds", [])), "earlier": list(found.get("earlier", []))}


def write_provenance(path: str | Path, record: dict) -> Path:
    """Add ``record`` (one build, its ``chapters`` listed) to ``PROVENANCE`` at ``path``, atomically (the
    old file or the new one, never half)."""
    path = Path(path)
    old, rebuilt = read_provenance(path), set(record.get("chapters") or [])
    builds = []
    for earlier in old["builds"]:
        kept = [c for c in earlier.get("chapters") or [] if c not in rebuilt]
        if kept:
            builds.append({**earlier, "chapters": kept})
    lines = [line for line in old["earlier"] if not set(_CHAPTER_NAME.findall(line.split(":")[0])) <= rebuilt
             or not _CHAPTER_NAME.findall(line.split(":")[0])]
    merged = {"what": PROVENANCE_WHAT, "builds": [*builds, record], **({"earlier": lines} if lines else {})}
    cw_cache.atomic_write_bytes(path, (json.dumps(merged, indent=1, default=str) + "\n").encode())
    return path


def provenance_lines(path: str | Path) -> list[str]:
    """One line per build of ``PROVENANCE`` (chapters, commit, profile, documents' sizes are in the
    tables' own JSON), the older plain-text lines as they are: for a page to quote."""
    found = read_provenance(path)
    out = [f"chapters {', '.join(b.get('chapters') or ['?'])}: commit {str(b.get('commit'))[:12]}, profile "
           f"{b.get('profile')}, {b.get('wall_s')} s wall on {b.get('machine', {}).get('cpus')} CPUs"
           f"{' with ' + str(b['launch'].get('world_size')) + ' ranks' if b.get('launch') else ''}, "
           f"{str(b.get('created', ''))[:10]}" for b in found["builds"]]
    return out + found["earlier"]


def _chapters(profile: str, models, only, config_path=None) -> list[str]:
    """The notebooks a build of ``profile`` (``only``, ``models``) runs, by name."""
    _, chosen, _ = plan(load_config(config_path or DEFAULT_BOOK_DIR / "run.yml"), profile=profile, models=models,
                        only=only)
    return [c.name for c in chosen if not c.is_page]


def _cells(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("cell-*.json"))]


def copy_chapter_tables(planned, out: Path) -> list[Path]:
    """The results tables (CSV and JSON, :func:`cwbook.findings.save_results`) that the build's
    per-model chapters other than chapter 4 wrote (the sink chapters 5-7, the bench), copied into
    ``out/<chapter>/<model>.csv`` atomically, so that ``findings.csv`` and the book read this build's
    tables. Chapter 4's table is remade from its exports instead. Returns the paths written."""
    written = []
    for run in planned:
        if run.model is None or run.chapter.name == CHAPTER or "results_file" not in run.parameters:
            continue
        source = (run.output.parent / run.parameters["results_file"]).resolve()
        if not source.is_file():
            continue
        target = results_path(out, run.chapter.name, run.model)
        for src, dst in ((source, target), (source.with_suffix(".json"), target.with_suffix(".json"))):
            if src.is_file():
                dst.parent.mkdir(parents=True, exist_ok=True)
                cw_cache.atomic_write_bytes(dst, src.read_bytes())
                written.append(dst)
    return written


def anatomy_evidence(model: str, p: dict, out: Path, *, profile: str, loaded=None) -> list[Path]:
    """Chapter 4's anatomy evidence of ``model`` (``p``: the chapter's parameters under ``profile``) on each
    data set it exported: what each rung removes on the profile's documents, at every ratio of the
    export and in both modes, per-head, signed (:func:`cwbook.evidence_frames.anatomy_cell`: taken
    from ``anatomy_<model>_<data>.csv.gz`` after its 2-document check, else computed over the ranks and
    written), and ``explain_<model>_<data>.csv``, the ladder's three steps explained against the export's
    damage (:func:`cwbook.evidence_frames.anatomy_explained`). Returns the paths written."""
    written: list[Path] = []
    for data in p["datasets"]:
        found = read_committed(model, data, out)
        if found is None or not ((found[0]["protocol"] == "per-head") & (found[0]["importance"] == "signed")).any():
            continue
        if loaded is None:
            loaded = cwcore.load_model(model, dtype=p["dtype"], device=p["device"])
        lm, tokenizer = loaded
        blocks = document_blocks(load_dataset(data), tokenizer, p["seq_len"], p["n_sequences"], seed=p["seed"])
        frame = anatomy_cell(lm, blocks, LADDER, evidence_export.grids_of(p).ratios, MODES, model=model, data=data,
                             profile=profile, dtype=p["dtype"], batch_size=p["batch_size"], exports=out)
        explained = anatomy_explained(frame, found[0], n_bootstrap=p["n_bootstrap"], seed=p["seed"])
        path = out / f"explain_{slug(model)}_{data}.csv"
        written += [*frame_paths(ANATOMY, model, data, out),
                    *write_checked_csv(explained.assign(model=model, data=data), path, checked_table_what(path),
                                       float_format="%.8g")]
    return written


def export_and_tables(out: Path, *, profile: str = "evidence", models=None, only=None,
                      config_path: str | Path | None = None, **_) -> list[Path]:
    """Steps 2-3 of :func:`build_evidence`'s work: the other chapters' tables copied
    (:func:`copy_chapter_tables`), every (model, data set) of chapter 4 in the build exported (:func:`cwbook.evidence_export.export`, resumed: the cache's pieces, or a committed cell
    this build took), then :func:`cwbook.evidence_export.tables`."""
    config = config_path or DEFAULT_BOOK_DIR / "run.yml"
    _, _, planned = plan(load_config(config), profile=profile, models=models, only=only)
    written: list[Path] = copy_chapter_tables(planned, out)
    for run in planned:
        if run.chapter.name == BENCH_CHAPTER:  # the bench's committed frames, one per data set
            bench = run_parameters(BENCH_CHAPTER, profile, run.model, config=config)
            frames = [frame_paths(BENCH, run.model, data, out) for data in bench["datasets"]]
            written += [path for pair in frames if all(x.is_file() for x in pair) for path in pair]
        if run.chapter.name != CHAPTER:
            continue
        p = notebook_parameters(profile, run.model, config)
        for model in [run.model, *evidence_export.weight_variant_names(run.model, p)]:
            for data in p["datasets"]:
                sweep = partial(ladder_cell, model=model, data=data, profile=profile, dtype=p["dtype"], exports=out)
                written += export(profile, model, data, p["n_sequences"], p["protocols"], out=out, config=config,
                                  sweep=sweep)
        written += anatomy_evidence(run.model, p, out, profile=profile)
        # the downstream tasks, per-layer interventions and protocol variants the notebook wrote (or took)
        frames = [*(frame_paths(DOWNSTREAM, run.model, task, out) for task in p["tasks"]),
                  frame_paths(PER_LAYER, run.model, p["datasets"][0], out),
                  frame_paths(SENSITIVITY, run.model, p["datasets"][0], out)]
        written += [path for pair in frames if all(x.is_file() for x in pair) for path in pair]
    written += export_tables(out) if any(out.glob("per_document_*.json")) else []
    return written + [write_status(out, profile=profile, config=config)]


def build_evidence(*, profile: str = "evidence", models=None, only=None, out: str | Path | None = None,
                   build: Callable | None = None, tables: Callable | None = None, **build_kwargs) -> Path:
    """Steps 1-3 of the module's docstring; returns the path of ``PROVENANCE``."""
    out = Path(out) if out is not None else DEFAULT_OUT
    build = build or book_build
    if tables is None:
        def tables(folder):
            return export_and_tables(folder, profile=profile, models=models, only=only, **build_kwargs)
    t0 = time.monotonic()
    chapters = _chapters(profile, models, only, build_kwargs.get("config_path"))  # a bad --only fails here
    scratch = Path(tempfile.mkdtemp(prefix="cwcore-evidence-"))
    saved = {name: os.environ.get(name) for name in (cw_cache.TALLY_ENV_VAR, CELLS_ENV_VAR, CHECKPOINT_ENV_VAR)}
    os.environ[cw_cache.TALLY_ENV_VAR] = os.environ[CELLS_ENV_VAR] = str(scratch)  # the kernels inherit them
    # chapter 4's cells merge every few batches into their exports, which can be committed while it runs
    os.environ.setdefault(CHECKPOINT_ENV_VAR, str(CHECKPOINT_DOCUMENTS))
    cw_cache._start_process_tally()  # this process's own reads too
    try:
        build(profile=profile, models=models, only=only, **build_kwargs)
        written = tables(out)
        cw_cache.flush_tally()
        record = provenance_record(profile=profile, models=models, only=only, wall_s=time.monotonic() - t0,
                                   config=build_kwargs.get("config_path"),
                                   tally=cw_cache.read_tallies(scratch), cells=_cells(scratch), written=written,
                                   chapters=chapters)
        path = write_provenance(out / "PROVENANCE", record)
    finally:
        cw_cache._stop_process_tally()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(scratch, ignore_errors=True)
    c = record["cache"]
    print(f"evidence  PROVENANCE written: {path} (cache hits {c['hits']}, misses {c['misses']}, "
          f"{len(record['committed_cells']['taken'])} committed cells taken, {record['wall_s']} s)", flush=True)
    return path


PROFILE_BUILDS["evidence"] = build_evidence
