"""The committed evidence, per document, and a slice of it recomputed."""

from __future__ import annotations

import argparse
import io
import json
import platform
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

import cwcore
from cwcore import cache as cw_cache
from . import ladder as evidence
from . import findings
from . import BookError, results_path, slug
from . import registration
from .evidence_files import (DEFAULT_OUT, HASH_FIELD, CommittedFileError, check_rows, checked_table_what, checkout,
                             content_hash, gzipped_csv, now, read_present_pair, write_checked_csv)
from .evidence_frames import (ANATOMY, SIGNIFICANT_DIGITS, anatomy_held_out, compare_rows, downstream_ladder,
                              read_downstream, read_frame)
from .findings import sample_folders
from .parameters import profile_models, run_parameters

CHAPTER = "04_faithfulness"
#: the columns that name a row of the per-document table
KEYS = ("data", "model", "protocol", "variant", "importance", "metric", "mode", "ratio", "document")
#: integer columns, equal exactly
EXACT = ("sequence", "n_tokens", "n_removed", "n_candidates")
#: float columns, equal within a tolerance
FLOATS = ("nll", "clean_nll", "delta_nll")
#: the other numeric columns of an export
_NUMERIC = ("ratio", "document", "keep_first_token")
#: the chapter's parameters that :func:`cwbook.ladder.ladder_evidence` takes as they are
LADDER_PARAMETERS = ("datasets", "n_sequences", "seq_len", "low_ratios", "ratios", "protocols", "importances",
                     "metrics", "random_seeds", "variants", "variant_models", "n_bootstrap", "seed", "batch_size",
                     "cache")
_FIRST = ["data", "model", "protocol", "importance", "metric", "kind", "mode", "ratio", "document", "sequence",
          "nll", "clean_nll", "delta_nll", "n_tokens", "n_removed", "n_candidates"]


def notebook_parameters(profile: str, model: str, config: str | Path | None = None) -> dict:
    """What notebook ``04_faithfulness`` runs with for ``model`` under ``profile``
    (:func:`cwbook.parameters.run_parameters`: its parameters cell's defaults, replaced by what the
    book runner injects from run.yml)."""
    return run_parameters(CHAPTER, profile, model, config=config)


def weight_variant_names(model: str, parameters: dict) -> list[str]:
    """The other weights of ``model`` on which chapter 4 runs its main cells again (its parameters
    ``weight_variants``, on the models ``weight_variant_models`` names): ``<model>-<variant>`` names
    :func:`cwcore.load_model` takes (:data:`cwcore.models.VARIANTS`), exported like models of their own."""
    only = parameters.get("weight_variant_models")
    if only is not None and model not in only:
        return []
    return [f"{model}-{v}" for v in parameters.get("weight_variants") or []]


def grids_of(parameters: dict) -> evidence.RatioGrids:
    """The named ratio grids of chapter 4's parameters (``low_ratios``, ``ratios``) or of an export's
    metadata (``grids``)."""
    if "grids" in parameters:
        return evidence.RatioGrids(**parameters["grids"])
    return evidence.RatioGrids(parameters["low_ratios"], parameters["ratios"])


def _subset(wanted, available, what: str) -> list:
    if wanted is None:
        return list(available)
    chosen = []
    for w in wanted:
        hits = [a for a in available if (np.isclose(float(a), float(w), rtol=1e-9, atol=0)
                                         if what == "ratio" else a == w)]
        if not hits:
            raise ValueError(f"{what} {w!r} is not one the notebook runs: {list(available)}")
        chosen.append(hits[0])
    return chosen


def per_document(profile: str, model: str, data: str, n_documents: int,
                 protocols: Sequence[str] = ("default",), importances: Sequence[str] | None = None,
                 ratios: Sequence[float] | None = None, metrics: Sequence[str] | None = None, *,
                 config: str | Path | None = None, cache: bool | None = None, cache_dir: str | Path | None = None,
                 loaded=None, progress: bool = False, sweep=None, variants: Sequence[str] | None = None) -> pd.DataFrame:
    """The per-document table of chapter 4's ladder sweeps under ``profile`` on the first
    ``n_documents`` documents of ``data``: the notebook's own function,
    :func:`cwbook.ladder.ladder_evidence`, with the notebook's parameters
    (:func:`notebook_parameters`) for this one data set, with a ``model`` column."""
    p = notebook_parameters(profile, model, config)
    protocols = _subset(protocols, p["protocols"], "protocol")
    importances = _subset(importances, p["importances"], "importance")
    metrics = _subset(metrics, p["metrics"], "metric")
    variants = _subset(variants, p.get("variants") or [], "variant")
    grids = grids_of(p)
    grids = grids if ratios is None else grids.restrict(_subset(ratios, grids.ratios, "ratio"))
    if data not in p["datasets"]:
        raise ValueError(f"the notebook does not run data set {data!r} under {profile} (it runs {p['datasets']})")
    if not 1 <= n_documents <= p["n_sequences"]:
        raise ValueError(f"n_documents must lie in 1..{p['n_sequences']} (the profile's n_sequences)")
    if loaded is None:
        loaded = cwcore.load_model(model, dtype=p["dtype"], device=p["device"])
    lm, tokenizer = loaded
    extra = {} if cache_dir is None else {"cache_dir": cache_dir}
    run = evidence.ladder_evidence(lm, tokenizer, **{
        **{k: p[k] for k in LADDER_PARAMETERS}, "datasets": [data], "n_sequences": n_documents,
        "low_ratios": grids.low, "ratios": grids.paper, "protocols": protocols, "importances": importances,
        "metrics": metrics, "variants": variants, "cache": p["cache"] if cache is None else bool(cache)},
        model_name=model, progress=progress, sweep=sweep, **extra)
    table = pd.concat([run.per_sequence, run.variant_rows], ignore_index=True).assign(model=model)
    table["delta_nll"] = table["nll"] - table["clean_nll"]
    table = table[[c for c in _FIRST if c in table] + [c for c in table if c not in _FIRST]]
    table.attrs["parameters"] = {**p, "grid": grids.ratios, "grids": grids.as_dict(), "protocols_run": protocols,
                                 "importances_run": importances, "metrics_run": metrics}
    return table


# -- export ----------------------------------------------------------------------------------------
def paths(model: str, data: str, out: str | Path | None = None) -> tuple[Path, Path]:
    """(gzipped CSV, JSON) of one model and data set under ``out`` (default ``data/results/evidence``).
    The rows are gzipped (about a quarter of the plain CSV; pandas and ``zcat`` read them)."""
    folder = Path(out) if out is not None else DEFAULT_OUT
    stem = f"per_document_{slug(model)}_{data}"
    return folder / f"{stem}.csv.gz", folder / f"{stem}.json"


def export(profile: str, model: str, data: str, n_documents: int, protocols: Sequence[str] = ("default",),
           importances: Sequence[str] | None = None, ratios: Sequence[float] | None = None,
           metrics: Sequence[str] | None = None, *, out: str | Path | None = None, require_cached: bool = False,
           config: str | Path | None = None, sweep=None) -> tuple[Path, Path]:
    """Run :func:`per_document` and write its CSV (floats to :data:`SIGNIFICANT_DIGITS` significant
    digits) and the provenance JSON; returns their paths. ``require_cached``: fail, computing nothing,
    unless every piece is in the result cache; ``sweep`` as in :func:`per_document`."""
    t0 = time.monotonic()
    p = notebook_parameters(profile, model, config)
    loaded = cwcore.load_model(model, dtype=p["dtype"], device=p["device"])
    load_s = time.monotonic() - t0
    with cw_cache.counting(require=require_cached) as counter:
        table = per_document(profile, model, data, n_documents, protocols, importances, ratios, metrics,
                             config=config, loaded=loaded, sweep=sweep)
    wall = time.monotonic() - t0
    used = table.attrs["parameters"]
    meta = {
        "what": f"per-document rows of chapter {CHAPTER}'s ladder sweeps (cwbook.ladder.ladder_sweep)"
                " on the first documents of the profile's sample; delta_nll = nll - clean_nll (nats)",
        **checkout(),
        "profile": profile, "model": model, "data": data, "documents": int(n_documents),
        "document_ids": [int(d) for d in table.sort_values("sequence", kind="stable")["document"].unique()],
        "protocols": list(used["protocols_run"]), "variants": list(used.get("variants") or []),
        "importances": list(used["importances_run"]),
        "ratios": [float(r) for r in used["grid"]], "grids": used["grids"], "metrics": list(used["metrics_run"]),
        "modes": sorted(table["mode"].unique().tolist()),
        "seed": used["seed"], "dtype": used["dtype"], "device": used["device"], "seq_len": used["seq_len"],
        "batch_size": used["batch_size"], "profile_n_sequences": used["n_sequences"],
        "rows": len(table), "float_format": f"%.{SIGNIFICANT_DIGITS}g",
        "wall_s": round(wall, 2), "model_load_s": round(load_s, 2),
        "cache": {"code_hash": cw_cache.code_version(("faithfulness",)), "hits": counter.hits,
                  "misses": counter.misses, "folders": sorted(counter.folders)},
        "versions": {"python": platform.python_version(), "torch": _version("torch"),
                     "transformers": _version("transformers")},
        "created": now(),
    }
    csv, js = paths(model, data, out)
    found = read_committed(model, data, out)
    if found is not None:
        lost = lost_by_replacing(table, meta, *found)
        if lost:  # the README's hand command dropped 3 of 4 finished cells and left a pair its reader refused
            raise ValueError(f"{model} {data}: writing this run to {csv.parent} would lose committed evidence "
                             f"({'; '.join(lost)}); write it to another --out folder")
        if found[1].get("cells"):  # the cells merged while the build ran keep their commit
            meta["cells"] = found[1]["cells"]
        table, meta = keep_other_cells(table, meta, *found)
    csv.parent.mkdir(parents=True, exist_ok=True)
    if not _write(csv, js, table, meta):
        print(f"{model} {data}: the export holds these rows already: left as it is")
    return csv, js


#: what two exports of one (model, data) must share for their cells to stand in one file
SAME_SAMPLE = ("profile", "seq_len", "seed", "dtype", "document_ids")


def lost_by_replacing(table: pd.DataFrame, meta: dict, committed: pd.DataFrame, committed_meta: dict) -> list[str]:
    """What writing ``table`` over the ``committed`` export would lose, one phrase each: a cell the run
    replaces with fewer documents, ratios, metrics or importances than it holds, and the other cells when the
    run's sample differs (:func:`keep_other_cells` would drop them)."""
    lost = []
    cells_of = {name: rows for name, rows in committed.groupby(
        [cell_name(p, v) for p, v in zip(committed["protocol"], committed["variant"])])}
    for name, rows in table.groupby([cell_name(p, v) for p, v in zip(table["protocol"], table["variant"])]):
        held = cells_of.get(name)
        if held is None:
            continue
        for column in ("document", "ratio", "metric", "importance"):
            missing = set(held[column]) - set(rows[column])
            if missing:
                lost.append(f"cell {name} holds {len(missing)} {column}s the run lacks")
    ran = {cell_name(p, v) for p, v in zip(table["protocol"], table["variant"])}
    others = sorted(set(cells_of) - ran)
    differ = [k for k in SAME_SAMPLE if committed_meta.get(k) != meta.get(k)]
    if others and differ:
        lost.append(f"cells {', '.join(others)} ran with another {', '.join(differ)}")
    return lost


def keep_other_cells(table: pd.DataFrame, meta: dict, committed: pd.DataFrame,
                     committed_meta: dict) -> tuple[pd.DataFrame, dict]:
    """(table, meta) of an export with the committed export's cells that this one did not run kept in it:
    a build whose configuration asks for fewer cells (no variants, say) must not drop finished evidence."""
    ran = set(zip(table["protocol"], table["variant"]))
    cell_of = pd.Series(list(zip(committed["protocol"], committed["variant"])), index=committed.index)
    other = committed[~cell_of.isin(ran)]
    if other.empty:
        return table, meta
    names = sorted({cell_name(p, v) for p, v in zip(other["protocol"], other["variant"])})
    differ = [k for k in SAME_SAMPLE if committed_meta.get(k) != meta.get(k)]
    if differ:
        print(f"{meta['model']} {meta['data']}: the committed cells {', '.join(names)} ran with another "
              f"{', '.join(differ)}: not kept in the new export")
        for name in names:
            meta.get("cells", {}).pop(name, None)
        return table, meta
    table = pd.concat([table, other[table.columns]], ignore_index=True)
    main = table[table["variant"] == "main"]
    meta = {**meta, "protocols": list(dict.fromkeys([*meta["protocols"], *main["protocol"]])),
            "variants": list(dict.fromkeys([*meta.get("variants", []),
                                            *(v for v in table["variant"] if v != "main")])),
            "importances": list(dict.fromkeys([*meta["importances"], *table["importance"]])),
            "metrics": list(dict.fromkeys([*meta["metrics"], *other["metric"]])),
            "kept_cells": names, "rows": len(table)}
    return table, meta


def cell_name(protocol: str, variant: str = "main") -> str:
    """The name of one ladder cell in an export's ``cells`` record: ``default``, ``default/token-unit``."""
    return protocol if variant in ("", "main") else f"{protocol}/{variant}"


#: the order of an export's rows, whoever writes it (then the documents in the sample's order)
ROW_ORDER = ("protocol", "variant", "importance", "metric", "mode", "ratio")


def canonical_rows(table: pd.DataFrame, document_ids: Sequence[int] | None = None) -> pd.DataFrame:
    """``table`` in the one order every writer of an export uses (:data:`ROW_ORDER`, then the documents
    in ``document_ids``' order, else by id; columns: the usual first ones, then the rest by name), so that
    an export and a merge of the same rows write the same bytes."""
    if table.empty:
        return table
    ids = list(document_ids) if document_ids else sorted(table["document"].unique())
    order = {int(d): i for i, d in enumerate(ids)}
    keys = [k for k in ROW_ORDER if k in table]
    table = table.assign(_d=table["document"].map(lambda d: order.get(int(d), len(order) + int(d))))
    table = table.sort_values([*keys, "_d"], kind="stable").drop(columns="_d").reset_index(drop=True)
    return table[[c for c in _FIRST if c in table] + sorted(c for c in table if c not in _FIRST)]


def _digits(values: pd.Series) -> pd.Series:
    return values.map(lambda x: f"%.{SIGNIFICANT_DIGITS}g" % x)


def _keep_written_differences(table: pd.DataFrame, written: pd.DataFrame) -> pd.DataFrame:
    """``table`` with ``written``'s ``delta_nll`` on the rows whose ``nll`` and ``clean_nll`` print the same:
    a cell taken from an export reads them back at 8 digits, and their difference, derived again, would
    move the last digits of a value that did not change."""
    keys = [k for k in KEYS if k in table and k in written]
    if table.empty or written.empty or "delta_nll" not in written:
        return table
    ours = table[keys].assign(_row=np.arange(len(table)), _nll=_digits(table["nll"]),
                              _clean=_digits(table["clean_nll"]))
    theirs = written[keys].assign(_nll=_digits(written["nll"]), _clean=_digits(written["clean_nll"]),
                                  _delta=written["delta_nll"].to_numpy())
    both = ours.merge(theirs, on=[*keys, "_nll", "_clean"], how="inner")
    if both.empty:
        return table
    table = table.copy()
    table.loc[table.index[both["_row"].to_numpy()], "delta_nll"] = both["_delta"].to_numpy()
    return table


def _write(csv: Path, js: Path, table: pd.DataFrame, meta: dict) -> bool:
    """Write an export in its canonical order (:func:`canonical_rows`), its JSON recording the SHA-256 of
    the table's bytes (``csv_sha256``, verified by :func:`read_committed`); False, touching nothing, when
    the rows already written are these and their JSON records them (a rebuild that took every cell leaves
    git clean, its record too)."""
    table = canonical_rows(table, meta.get("document_ids"))
    written = _read_rows(csv) if csv.is_file() and js.is_file() else None  # verified by the caller's read
    if written is not None:
        table = _keep_written_differences(table, written)
    rows = gzipped_csv(table, SIGNIFICANT_DIGITS)  # written whole, then renamed: a killed export leaves the old file
    digest = content_hash(rows)
    if written is not None and csv.read_bytes() == rows and _recorded_hash(js) == digest:
        return False
    meta = {**meta, "rows": len(table), HASH_FIELD: digest}
    cw_cache.atomic_write_bytes(csv, rows)
    cw_cache.atomic_write_bytes(js, (json.dumps(meta, indent=1) + "\n").encode())
    return True


def _recorded_hash(js: Path) -> str | None:
    try:
        return json.loads(js.read_text()).get(HASH_FIELD)
    except (OSError, ValueError, AttributeError):
        return None


def merge_cell(model: str, data: str, rows: pd.DataFrame | None, *, protocol: str, variant: str = "main",
               profile: str, seq_len: int, seed: int, dtype: str, document_ids: Sequence[int],
               out: str | Path | None = None, replace: bool = False) -> tuple[Path, Path]:
    """Merge the per-document ``rows`` of one ladder cell (as :func:`cwbook.ladder.ladder_sweep`
    returns them, for some of its documents) into the export of ``model`` and ``data``, atomically, so
    that a long build's finished documents can be committed while it runs (the evidence build checkpoints
    every few batches: :func:`cwbook.evidence_build.ladder_cell`)."""
    csv, js = paths(model, data, out)
    found = read_committed(model, data, out)
    same = {"profile": profile, "seq_len": int(seq_len), "seed": int(seed), "dtype": str(dtype)}
    ids = [int(d) for d in document_ids]
    if found is not None:
        table, meta = found
        differ = {k: meta.get(k) for k, v in same.items() if meta.get(k) != v}
        if differ or [int(d) for d in meta["document_ids"][:len(ids)]] != ids[:len(meta["document_ids"])]:
            raise ValueError(f"{csv.name} holds another run ({differ or 'other documents'}): not merging into it")
        ids = ids if len(ids) >= len(meta["document_ids"]) else [int(d) for d in meta["document_ids"]]
    else:
        table, meta = pd.DataFrame(), {}
    variants = table["variant"] if "variant" in table else pd.Series("main", index=table.index, dtype=object)
    in_cell = (table["protocol"] == protocol) & (variants == variant) if len(table) else pd.Series(dtype=bool)
    fresh = pd.DataFrame() if rows is None else rows.assign(data=data, model=model,
                                                            delta_nll=rows["nll"] - rows["clean_nll"])
    if replace and len(table):
        table = table[~in_cell]
    elif len(table) and len(fresh):
        keys = [k for k in KEYS if k in fresh]
        new = pd.MultiIndex.from_frame(fresh[keys].astype(str))
        table = table[~pd.MultiIndex.from_frame(table[keys].astype(str)).isin(new)]
    table = pd.concat([table, fresh], ignore_index=True)
    table = canonical_rows(table, ids)
    cell_rows = table[(table["protocol"] == protocol) & (table["variant"] == variant)] if len(table) else table
    checked_out, created = checkout(), now()
    commit = checked_out["commit"]
    cells = dict(meta.get("cells", {}))
    cells[cell_name(protocol, variant)] = {
        "documents": int(cell_rows["document"].nunique()) if len(cell_rows) else 0,
        "metrics": sorted(cell_rows["metric"].unique().tolist()) if len(cell_rows) else [],
        "commit": commit, "created": created}
    main = table[table["variant"] == "main"] if len(table) else table
    meta = {
        "what": meta.get("what", f"per-document rows of chapter {CHAPTER}'s ladder sweeps (merged cell by cell "
                                 "while the evidence build runs); delta_nll = nll - clean_nll (nats)"),
        **meta, **same, "model": model, "data": data, "sample": registration.sample_of(profile),
        "documents": int(table["document"].nunique()) if len(table) else 0, "document_ids": ids,
        "protocols": list(dict.fromkeys(main["protocol"])) if len(main) else [],
        "variants": [v for v in dict.fromkeys(table["variant"]) if v != "main"] if len(table) else [],
        "rows": len(table), "float_format": f"%.{SIGNIFICANT_DIGITS}g", "cells": cells,
        # the last merge's checkout (each cell's own commit is in ``cells``)
        **checked_out, "created": created,
    }
    for key, value in (("importances", "importance"), ("modes", "mode")):
        meta[key] = sorted(table[value].unique().tolist()) if len(table) else []
    meta["ratios"] = sorted(float(r) for r in table["ratio"].unique()) if len(table) else []
    meta["metrics"] = list(dict.fromkeys(table["metric"])) if len(table) else []
    meta.setdefault("cache", {"code_hash": cw_cache.code_version(("faithfulness",)), "hits": 0, "misses": 0,
                              "folders": []})
    csv.parent.mkdir(parents=True, exist_ok=True)
    _write(csv, js, table, meta)
    return csv, js


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - provenance only
        return None


def read_committed(model: str, data: str, out: str | Path | None = None) -> tuple[pd.DataFrame, dict] | None:
    """(table, provenance) of an export, or None when both files are absent."""
    csv, js = paths(model, data, out)
    found = read_present_pair(csv, js)
    if found is None:
        return None
    data_bytes, meta = found
    table = _read_rows(io.BytesIO(data_bytes))
    _check_export(table, meta, csv.name)
    _check_provenance(table, meta, csv.name, csv.parent / "PROVENANCE")
    return table, meta


def cell_rows_hash(rows: pd.DataFrame) -> str:
    """The SHA-256 of a ladder cell's rows as ``PROVENANCE`` records it (``cell_sha256``): keys, ``nll`` and
    ``clean_nll`` at the export's 8 significant digits, so computed rows hash as they read back."""
    import hashlib

    keys = [k for k in ("importance", "metric", "mode", "ratio", "document") if k in rows]
    text = rows.sort_values(keys, kind="stable")[[*keys, "nll", "clean_nll"]].to_csv(
        index=False, float_format=f"%.{SIGNIFICANT_DIGITS}g")
    return hashlib.sha256(text.encode()).hexdigest()


def _check_provenance(table: pd.DataFrame, meta: dict, name: str, provenance_file: Path) -> None:
    """Each cell of the export that a build recorded in ``PROVENANCE`` (its ``cell_sha256``) and that no
    merge has written since must still hold those rows: otherwise it changed outside a build."""
    if not provenance_file.is_file() or not len(table):
        return
    try:
        builds = json.loads(provenance_file.read_text()).get("builds", [])
    except (OSError, ValueError, AttributeError) as err:
        raise CommittedFileError(f"{provenance_file.name} beside {name} cannot be read ({err})") from None
    variants = table["variant"] if "variant" in table else pd.Series("main", index=table.index)
    for build in builds:
        cells = build.get("committed_cells", {})
        for cell in [*cells.get("taken", []), *cells.get("recomputed", [])]:
            if (cell.get("model"), cell.get("data")) != (meta.get("model"), meta.get("data")) or "cell_sha256" not in cell:
                continue
            protocol, variant = cell.get("protocol"), cell.get("variant", "main")
            record = meta.get("cells", {}).get(cell_name(protocol, variant), {})
            if str(record.get("created", "")) > str(build.get("created", "")):
                continue  # merged again after that build: a later record describes it
            rows = table[(table["protocol"] == protocol) & (variants == variant)]
            if cell_rows_hash(rows) != cell["cell_sha256"]:
                raise CommittedFileError(f"{name}: cell {cell_name(protocol, variant)} no longer holds the rows "
                                         f"PROVENANCE records for the build of {build.get('created')} (changed "
                                         "outside a build): not taken; restore it from git or recompute it")


def _check_export(table: pd.DataFrame, meta: dict, name: str) -> None:
    """An export's counts against its JSON: rows, documents, and each cell's documents."""
    check_rows(table, meta, name)
    ids = [int(d) for d in meta.get("document_ids", [])]
    held = sorted(set(int(d) for d in table["document"])) if len(table) else []
    if "documents" in meta and int(meta["documents"]) != len(held):
        raise CommittedFileError(f"{name} holds {len(held)} documents, its JSON records {meta['documents']}")
    if ids and not set(held) <= set(ids):
        raise CommittedFileError(f"{name} holds documents its JSON does not list")
    if not len(table):
        return
    variants = table["variant"] if "variant" in table else pd.Series("main", index=table.index)
    names = pd.Series([cell_name(p, v) for p, v in zip(table["protocol"], variants)], index=table.index)
    for cell, record in meta.get("cells", {}).items():
        rows = table[names == cell]
        recorded = int(record.get("documents", 0))
        documents = set(int(d) for d in rows["document"])
        if len(documents) != recorded or (ids and documents != set(ids[:recorded])):
            raise CommittedFileError(f"{name}: cell {cell} holds {len(documents)} documents, its JSON records "
                                     f"{recorded} (the first {recorded} of the sample)")
        if rows.duplicated(["importance", "metric", "mode", "ratio", "document"]).any():  # averaged in twice
            raise CommittedFileError(f"{name}: cell {cell} holds a (importance, metric, mode, ratio, document) twice")
        seeded = rows["metric"].astype(str).str.startswith(evidence.RANDOM_PREFIX)
        per_combination = rows[~seeded].groupby(["importance", "metric", "mode", "ratio"])["document"].nunique()
        # every combination the JSON names, not only those present: a metric lost at one ratio moved verdicts
        metrics = [m for m in record.get("metrics", meta.get("metrics", []))
                   if not m.startswith(evidence.RANDOM_PREFIX)]
        expected = pd.MultiIndex.from_product([meta.get("importances", sorted(set(rows["importance"]))), metrics,
                                               meta.get("modes", sorted(set(rows["mode"]))),
                                               [float(r) for r in meta.get("ratios", sorted(set(rows["ratio"])))]],
                                              names=["importance", "metric", "mode", "ratio"])
        per_combination = per_combination.reindex(expected, fill_value=0) if recorded else per_combination
        if len(per_combination) and (per_combination != recorded).any():
            short = per_combination[per_combination != recorded]
            raise CommittedFileError(f"{name}: cell {cell} lacks documents in {len(short)} of its importance x metric "
                                     f"x mode x ratio combinations (e.g. {short.index[0]}: {int(short.iloc[0])} of "
                                     f"{recorded})")
        for metric, part in rows[seeded].groupby("metric"):  # a seed being completed covers the first documents
            held = part.groupby(["importance", "mode", "ratio"])["document"].apply(frozenset)
            first = frozenset(ids[:len(held.iloc[0])]) if ids else held.iloc[0]
            if len(held) != len(expected) // max(len(metrics), 1) or any(h != first for h in held):
                raise CommittedFileError(f"{name}: cell {cell}'s seed {metric} covers other documents at different "
                                         "points, or not the first of the sample: not a checkpoint a build leaves")


def _read_rows(csv) -> pd.DataFrame:
    table = pd.read_csv(csv, compression="gzip")
    if "variant" not in table:  # an export older than the column holds the main protocols only
        table.insert(int(table.columns.get_loc("protocol")) + 1, "variant", "main")
    for column in table.columns.difference([*EXACT, *FLOATS, *_NUMERIC]):
        if not pd.api.types.is_bool_dtype(table[column]):
            table[column] = table[column].astype(object).where(table[column].notna(), "").astype(str)
    return table


# -- compare ---------------------------------------------------------------------------------------
def compare(committed: pd.DataFrame, recomputed: pd.DataFrame, atol: float, rtol: float = 0.0) -> pd.DataFrame:
    """The rows of ``recomputed`` that do not match ``committed`` (a slice: committed rows outside
    ``recomputed``'s keys are ignored)."""
    return compare_rows(committed, recomputed, keys=KEYS, exact=EXACT, floats=FLOATS, atol=atol, rtol=rtol)


# -- tables ----------------------------------------------------------------------------------------
def _exports(out: Path) -> dict[str, list[str]]:
    """{model: [data sets]} of the exports in ``out``, in the order the notebook runs data sets."""
    found: dict[str, list[str]] = {}
    for js in sorted(out.glob("per_document_*.json")):
        meta = json.loads(js.read_text())
        if not paths(meta["model"], meta["data"], out)[0].is_file():  # a data set would vanish from the tables
            raise CommittedFileError(f"{js.name} has no {paths(meta['model'], meta['data'], out)[0].name} beside "
                                     "it: restore it from git or recompute the cells")
        found.setdefault(meta["model"], []).append(meta["data"])
    return found


def whole_seeds(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows without the random control's extra seeds on a cell where they do not yet cover every
    document of the cell (a checkpointed build that was completing them): the random rung then averages
    over the seeds every document has."""
    seeded = rows["metric"].astype(str).str.startswith(evidence.RANDOM_PREFIX)
    if not seeded.any():
        return rows
    keep = pd.Series(True, index=rows.index)
    for _, cell in rows.groupby(["protocol", "variant"], sort=False):
        documents = set(cell.loc[~seeded[cell.index], "document"])
        for metric, part in cell[seeded[cell.index]].groupby("metric"):
            if set(part["document"]) != documents:
                keep[part.index] = False
    return rows[keep]


def _partial_cells(meta: dict) -> dict[str, int]:
    """``{cell: documents}`` of the cells an export holds in part (a checkpointed build still computing
    them, committed so that another machine resumes it)."""
    total = len(meta.get("document_ids", ()))
    return {name: int(c["documents"]) for name, c in meta.get("cells", {}).items() if int(c["documents"]) < total}


def _judged(rows: pd.DataFrame, meta: dict) -> tuple[pd.DataFrame, dict[str, int]]:
    """The rows of the cells an export holds whole, and :func:`_partial_cells`: the pre-registration fixes
    each cell's documents, so a cell is judged once it holds all of them, never on an interim count."""
    partial = _partial_cells(meta)
    if not partial or not len(rows):
        return rows, partial
    variants = rows["variant"] if "variant" in rows else pd.Series("main", index=rows.index)
    names = pd.Series([cell_name(p, v) for p, v in zip(rows["protocol"], variants)], index=rows.index)
    return rows[~names.isin(list(partial))], partial


def _cell_documents(meta: dict, name: str) -> str:
    """How many documents the tables judged of cell ``name``, or that it is still in progress
    (:func:`_partial_cells`)."""
    partial = _partial_cells(meta)
    if name in partial:
        return f"{partial[name]} of {len(meta['document_ids'])} documents: in progress, not judged"
    return f"{meta.get('cells', {}).get(name, {}).get('documents', meta['documents'])} documents"


def tables(out: str | Path | None = None, models: Sequence[str] | None = None,
           all_models: Sequence[str] | None = None) -> list[Path]:
    """Chapter 4's evidence tables from the exports in ``out`` (default ``data/results/evidence``):
    for each model, :func:`cwbook.ladder.evidence_tables` of every exported data set
    (per protocol and ratio range, the low range ending at the top of the export's low grid; the
    profile's ``n_bootstrap`` and ``seed``), stacked with a ``data``
    column as the notebook stacks them, written by :func:`cwbook.findings.save_results` to
    ``out/04_faithfulness/<model>.csv`` (the layout of a book results folder)."""
    out = Path(out) if out is not None else DEFAULT_OUT
    if not out.is_dir():
        raise ValueError(f"{out} is not a folder of per-document exports (pass --out the folder that holds "
                         "per_document_<model>_<data>.csv.gz)")
    exported = _exports(out)
    if not exported:
        raise ValueError(f"{out} holds no per-document export (per_document_<model>_<data>.csv.gz with its .json)")
    unknown = [m for m in models or [] if m not in exported]
    if unknown:
        raise ValueError(f"no per-document export of {', '.join(map(repr, unknown))} in {out}; it holds "
                         f"{', '.join(exported)}")
    written = []
    for model in models or list(exported):
        if model not in exported:
            raise ValueError(f"no per-document export of {model!r} in {out}")
        ladders, cells, provenance, p, committed = [], [], {}, None, {}
        for data in exported[model]:
            committed[data], meta = read_committed(model, data, out)
            rows, _ = _judged(committed[data], meta)
            p = p or notebook_parameters(meta["profile"], model)  # one profile per folder
            # the low range ends at the top of the low grid the export ran (an export older than the
            # "grids" field ran the profile's)
            grids = grids_of(meta if "grids" in meta else p)
            if len(rows):
                _, ladder = evidence.evidence_tables(whole_seeds(rows).drop(columns=["data", "model", "delta_nll"]),
                                                     grids=grids, n_bootstrap=p["n_bootstrap"], seed=p["seed"])
                ladders.append(ladder.assign(data=data))
            cells += [f"{data} x {protocol} ({_cell_documents(meta, protocol)})" for protocol in meta["protocols"]]
            cells += [f"{data} x default, {v} ({_cell_documents(meta, cell_name('default', v))})"
                      for v in meta.get("variants", [])]
            provenance[data] = {k: meta[k] for k in ("commit", "cwcore_modified", "created", "rows")}
            provenance[data]["cache_hits"] = meta["cache"]["hits"]
        not_included, downstream = "downstream tasks, per-layer interventions, Table 8's protocol variants", {}
        found = read_downstream(model, p["tasks"], out=out)
        if found is not None:
            down_per, down_metas = found
            ladders.append(downstream_ladder(down_per, n_bootstrap=p["n_bootstrap"], seed=p["seed"]))
            examples = {t: int(n) for t, n in down_per.groupby("task", sort=False)["example"].nunique().items()}
            cells += [f"downstream {t} ({n} examples)" for t, n in examples.items()]
            not_included = not_included.replace("downstream tasks, ", "")
            downstream = dict(tasks=",".join(examples), n_examples=max(examples.values()),
                              task_ratios=next(iter(down_metas.values()))["ratios"])
            for task, down_meta in down_metas.items():
                provenance[f"downstream {task}"] = {k: down_meta[k]
                                                    for k in ("commit", "cwcore_modified", "created", "rows")}
        if not ladders:  # every cell still in progress: nothing to judge yet
            print(f"{model}: no complete cell ({'; '.join(cells)}): no table written")
            continue
        path = results_path(out, CHAPTER, model)
        findings.save_results(path, pd.concat(ladders, ignore_index=True), chapter=CHAPTER, model=model,
                              profile=meta["profile"], parameters=dict(
                                  source="per-document exports (evidence_slice tables)", cells=cells,
                                  not_included=not_included,
                                  n_documents=meta["documents"], seq_len=p["seq_len"], ratios=meta["ratios"],
                                  n_bootstrap=p["n_bootstrap"], seed=p["seed"], dtype=meta["dtype"],
                                  **downstream, exports=provenance))
        written += [path, path.with_suffix(".json")]
        for data in exported[model]:  # the anatomy's held-out test, where its anatomy is committed
            frame = read_frame(ANATOMY, model, data, out)
            if frame is not None:
                held_out = anatomy_held_out(frame[0], committed[data], seed=p["seed"]).assign(model=model, data=data)
                path = out / f"held_out_{slug(model)}_{data}.csv"
                written += write_checked_csv(held_out, path, checked_table_what(path))
    return list(dict.fromkeys(written + write_findings(out, meta["profile"], exported, all_models)))


def write_findings(out: Path, profile: str, exported, all_models: Sequence[str] | None = None) -> list[Path]:
    """``out/findings.csv`` of ``profile``; and ``findings.csv`` of both samples (column ``sample``, each
    primary family decided on its own sample) in the exploratory folder of
    :func:`cwbook.findings.sample_folders`, where
    that folder exists and either sample has a confirmatory table. Returns the paths written."""
    if all_models is None:
        all_models = list(dict.fromkeys([*profile_models(profile), *exported]))
    table = findings.findings_csv(out, list(all_models), profile)
    written = write_checked_csv(table, out / "findings.csv", checked_table_what("findings.csv"))
    exploratory_dir, confirmatory_dir = sample_folders(out, profile)
    if exploratory_dir.is_dir() and (profile == registration.CONFIRMATORY or any(confirmatory_dir.glob("*/*.csv"))):
        evidence_models = list(dict.fromkeys([*profile_models("evidence"), *all_models]))
        both = findings.combined_findings(exploratory_dir, confirmatory_dir, evidence_models)
        written += write_checked_csv(both, exploratory_dir / "findings.csv", checked_table_what("findings.csv"))
    return written


# -- command line ----------------------------------------------------------------------------------
def _arguments(argv=None):
    parser = argparse.ArgumentParser(prog="python -m cwbook.evidence_export", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("export", "write per_document_<model>_<data>.csv.gz/.json"),
                       ("check", "recompute a slice without the cache and compare it with the export")):
        p = sub.add_parser(name, help=text)
        if name == "export":  # check recomputes with the profile its export records
            p.add_argument("--profile", default="evidence")
        p.add_argument("--model", default="smollm2-135m")
        p.add_argument("--data", default="gsm8k")
        p.add_argument("--documents", type=int, default=8 if name == "export" else 2)
        p.add_argument("--protocols", nargs="+", default=["default"])
        p.add_argument("--importances", nargs="+", default=None)
        p.add_argument("--ratios", nargs="+", type=float, default=None,
                       help="default: the notebook's grid (export), 0.05 (check)")
        p.add_argument("--metrics", nargs="+", default=None)
        p.add_argument("--out", default=None, help=f"folder of the files (default {DEFAULT_OUT})")
        p.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
        if name == "export":
            p.add_argument("--require-cached", action="store_true",
                           help="fail, computing nothing, unless every piece is in the result cache")
        else:
            p.add_argument("--atol", type=float, default=2e-4)
    p = sub.add_parser("tables", help="chapter 4's evidence tables and findings.csv from the exports")
    p.add_argument("--out", default=None, help=f"folder of the exports and tables (default {DEFAULT_OUT})")
    p.add_argument("--models", nargs="+", default=None, help="default: every model with an export")
    p.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """The command line: 0 when done; 2 for bad input or a damaged export (one line); 1 for a bug; 130 when
    interrupted (``cwcore.cli.run_command``, the one error path of the command lines)."""
    from cwcore.cli import debug_requested, run_command

    args = _arguments(argv)
    # CommittedFileError is a ValueError, --require-cached's a LookupError, a profile not in run.yml a BookError
    return run_command("python -m cwbook.evidence_export", lambda: _main(args), debug_requested(argv),
                       user_errors=(ValueError, LookupError, BookError))


def _main(args) -> int:
    if args.out is not None and args.command != "export" and not Path(args.out).is_dir():
        raise ValueError(f"--out {args.out}: no such folder")
    if args.command == "tables":
        for path in tables(args.out, args.models):
            print(f"wrote {path}")
        return 0
    if args.command == "export":
        csv, js = export(args.profile, args.model, args.data, args.documents, args.protocols, args.importances,
                         args.ratios, args.metrics, out=args.out, require_cached=args.require_cached)
        meta = json.loads(js.read_text())
        print(f"wrote {csv} ({meta['rows']} rows) and {js.name}: {meta['wall_s']} s, "
              f"cache hits {meta['cache']['hits']}, misses {meta['cache']['misses']}, commit {meta['commit']}")
        return 0
    found = read_committed(args.model, args.data, args.out)
    if found is None:
        print("no committed export", file=sys.stderr)
        return 2
    committed, meta = found
    t0 = time.monotonic()
    fresh = per_document(meta["profile"], args.model, args.data, args.documents, args.protocols,
                         args.importances or meta["importances"], args.ratios or [0.05], args.metrics, cache=False)
    bad = compare(committed, fresh, atol=args.atol)
    print(f"{len(fresh)} rows recomputed in {time.monotonic() - t0:.1f} s; {len(bad)} mismatch (atol {args.atol})")
    if len(bad):
        print(bad.to_string())
    return 1 if len(bad) else 0


if __name__ == "__main__":
    sys.exit(main())
