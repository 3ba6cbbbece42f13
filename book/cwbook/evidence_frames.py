"""Chapter 4's other sweeps and chapter 4b's bench kept in ``data/results/evidence``, so that a new
machine resumes from them."""

from __future__ import annotations

import functools
import hashlib
import inspect
import io
import itertools
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from cwcore import cache as cw_cache
from cwcore import provenance
from cwcore import runs
from cwcore.data import load_dataset
from cwcore.folder_cache import library_versions
from . import ladder as evidence
from .anatomy import LADDER, MEASURES, explain_held_out, explain_step, layer_average, selection_anatomy
from cwcore.faithfulness.downstream import downstream_eval
from cwcore.faithfulness.layers import per_layer_curve

from .cached import cached_downstream_eval, cached_per_layer_curve, per_sequence_curve
from cwcore.faithfulness.protocol import PROTOCOL_FIELDS, as_protocol, modes as parse_modes, ratios as parse_ratios
from cwcore.faithfulness.protocol import specs as parse_specs
from cwcore.faithfulness.summary import ladder_comparison
from . import book_code_hash, slug
from .evidence_files import (DEFAULT_OUT, HASH_FIELD, CommittedFileError, check_rows, check_units, checkout,
                             content_hash, gzipped_csv, now, read_present_pair)

#: units of a committed cell recomputed before it is taken, and the tolerance: ``ATOL`` nats plus ``RTOL`` of
#: the committed value (float32 rounding: reordering a float32 sum moved clean NLLs by up to 1.2e-6 nats)
SLICE_DOCUMENTS = 2
ATOL = 1e-6
RTOL = 1e-6
SIGNIFICANT_DIGITS = 8
#: a folder where each committed cell's decision is recorded (the evidence build sets it)
CELLS_ENV_VAR = "CWCORE_EVIDENCE_CELLS"
#: keywords of a sweep that change no number of its rows beyond float rounding (which the slice check
#: bounds), so an export made with other values is still taken: batching, progress, the cache, the
#: summary's bootstrap (the per-unit rows do not use it)
NOT_NUMBERS = ("batch_size", "max_batch_pairs", "progress", "cache", "cache_dir", "n_bootstrap", "confidence",
               "per_example")


# -- decisions ---------------------------------------------------------------------------------------
def _decision_path(decision: dict) -> Path | None:
    folder = os.environ.get(CELLS_ENV_VAR, "").strip()
    if not folder:
        return None
    name = "cell-" + "-".join(provenance.slug(str(decision[k])) for k in ("sweep", "model", "data", "protocol",
                                                                          "variant") if k in decision) + ".json"
    return Path(folder) / name


def record_decision(decision: dict) -> None:
    """Write ``decision`` (one committed cell: taken, resumed or recomputed, and why) into
    ``$CWCORE_EVIDENCE_CELLS`` (nothing when unset; the main rank only), where ``PROVENANCE`` reads it."""
    path = _decision_path(decision)
    if path is not None and runs.is_main_rank():
        cw_cache.atomic_write_bytes(path, json.dumps(decision).encode())


def recorded_decision(decision: dict) -> dict | None:
    """The decision this build recorded for the same cell and committed rows, when it took them (or
    computed them into the export, checkpointing): the cell is not checked again."""
    path = _decision_path(decision)
    if path is None or not path.is_file():
        return None
    earlier = json.loads(path.read_text())
    same = all(earlier.get(k) == decision[k] for k in ("documents", "cell_sha256"))
    return earlier if same and (earlier.get("decision") == "committed" or earlier.get("merged")) else None


def say(log, text: str) -> None:
    """``log(text)`` on the main rank (None: silent)."""
    if log is not None and runs.is_main_rank():
        log(text)


# -- checks this machine passed before ------------------------------------------------------------------
#: ``1``: recompute every committed cell's slice, even where this machine passed the same check before
RECHECK_ENV_VAR = "CWCORE_RECHECK"


#: CPU flags named in PROVENANCE's machine: the ones that decide the speed of float32/bfloat16 forwards
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description(cpuinfo: str) -> str | None:
    """The first processor of a ``/proc/cpuinfo`` text as ``"<model name> (family F, model M; flags)"``
    with the flags of :data:`CPU_FLAGS` it has: a machine kind that ``model name`` alone may not tell
    (two EPYC kinds read "AMD EPYC"). None when the text names no processor."""
    first = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if first:
                break
            continue
        key, _, value = line.partition(":")
        first.setdefault(key.strip(), value.strip())
    name = first.get("model name") or first.get("Model name")
    if not name:
        return None
    flags = set(first.get("flags", "").split())
    kind = ", ".join(f"{k} {first[v]}" for k, v in (("family", "cpu family"), ("model", "model")) if v in first)
    have = " ".join(f for f in CPU_FLAGS if f in flags)
    return name + (f" ({'; '.join(x for x in (kind, have) if x)})" if kind or have else "")


@functools.lru_cache(maxsize=None)
def this_cpu() -> str | None:
    """:func:`cpu_description` of this machine's ``/proc/cpuinfo`` (None where there is none), read once."""
    try:
        return cpu_description(Path("/proc/cpuinfo").read_text())
    except OSError:
        return None


def check_identity(what: dict, reference: pd.DataFrame, *, computed_by: Callable | None, lm=None, units=None,
                   atol: float, rtol: float) -> dict | None:
    """All that a slice check's outcome depends on: ``what`` (the cell and the sweep's call), the function
    that recomputes the slice (``computed_by``), the committed rows it compares with (``reference``), the
    model's weights, the units' tokens (``units``: a digest), every byte of cwcore (the book wing too: the
    ladder's sweep and the anatomy's rows live there), the libraries, the machine kind and the tolerance."""
    import torch

    if computed_by is None:
        return None
    module, name = getattr(computed_by, "__module__", None) or "", getattr(computed_by, "__qualname__", "")
    if not (inspect.isfunction(computed_by) and module.split(".")[0] in ("cwcore", "cwbook") and "<" not in name):
        return None
    rows = hashlib.sha256(pd.util.hash_pandas_object(reference, index=False).values.tobytes()).hexdigest()
    return {"what": what, "computed_by": f"{module}.{name}", "reference_rows": rows,
            "model": runs.model_fingerprint(lm) if lm is not None else None, "units": units,
            "code": cw_cache.code_version(None), "book_code": book_code_hash(), "libraries": library_versions(),
            "cpu": this_cpu() or platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "atol": atol, "rtol": rtol}


def remembering(function: Callable, call: Mapping) -> Callable | None:
    """``function`` (a check's ``computed_by``), or None when its call asks for no cache (``cache=False``):
    then no check is remembered."""
    return None if call.get("cache", True) is False else function


def _check_path(identity: dict | None) -> Path | None:
    recheck = os.environ.get(RECHECK_ENV_VAR, "").strip().lower() in cw_cache._TRUE
    if identity is None or recheck or cw_cache.caching_disabled():
        return None
    text = json.dumps(identity, sort_keys=True, default=str)
    return cw_cache.cache_root() / "checks" / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def passed_check(identity: dict | None) -> dict | None:
    """The record of a slice check with this ``identity`` (:func:`check_identity`) that passed on this
    machine (in the result cache's ``checks`` folder), or None: then the slice is recomputed."""
    path = _check_path(identity)
    record = None
    if path is not None and path.is_file():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):  # damaged: check again
            record = None
    if identity is not None and runs.world() is not None:
        import torch.distributed as dist

        shared = [record]
        dist.broadcast_object_list(shared, src=0, group=runs._objects_group())
        record = shared[0]
    return record


def remember_check(identity: dict | None, record: dict) -> None:
    """Keep ``record`` (what the passed check found) under ``identity`` for :func:`passed_check` (main rank)."""
    path = _check_path(identity)
    if path is None or not runs.is_main_rank():
        return
    try:
        cw_cache.atomic_write_bytes(path, json.dumps({**record, "checked": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}).encode())
    except OSError:  # an unwritable cache: the next build checks again
        pass


def slice_check(identity: dict | None, check: Callable[[], tuple[pd.DataFrame, int, float]],
                diff_name: str = "max_abs_diff_nll") -> tuple[pd.DataFrame, int, float, dict | None]:
    """``check()`` (recompute a committed cell's slice and compare: the mismatching rows, the slice's rows,
    the largest difference), unless this machine passed the same check before (:func:`passed_check`):
    then no mismatch and that check's numbers. A check that passes is remembered. Returns
    ``(mismatches, slice rows, largest difference, the earlier check's record or None)``."""
    before = passed_check(identity)
    if before is not None:
        return pd.DataFrame(), before["slice_rows"], before[diff_name], before
    bad, slice_rows, diff = check()
    if bad.empty:
        remember_check(identity, {"slice_rows": slice_rows, diff_name: diff})
    return bad, slice_rows, diff, None


def checked_how(before: dict | None) -> str:
    """How a taken slice was checked, for the build's log."""
    return "recomputed" if before is None else f"checked on this machine at {before['checked']}"


# -- comparing a recomputed slice ----------------------------------------------------------------------
def compare_rows(committed: pd.DataFrame, recomputed: pd.DataFrame, *, keys: Sequence[str], exact: Sequence[str],
                 floats: Sequence[str], atol: float, rtol: float = 0.0) -> pd.DataFrame:
    """The rows of ``recomputed`` that do not match ``committed`` (a slice: committed rows outside
    ``recomputed``'s ``keys`` are ignored)."""
    keys = list(keys)
    values = [c for c in (*exact, *floats) if c in recomputed.columns]

    def keyed(frame):
        frame = frame.copy()
        for k in keys:  # float keys (ratios) compare as written; integer ones as integers
            if pd.api.types.is_float_dtype(frame[k]):
                frame[k] = frame[k].round(9)
            elif pd.api.types.is_numeric_dtype(frame[k]) and not pd.api.types.is_bool_dtype(frame[k]):
                frame[k] = frame[k].astype("int64")
        dup = frame.duplicated(keys)
        if dup.any():
            raise ValueError(f"{int(dup.sum())} rows share their keys {keys}")
        return frame[keys + [c for c in values if c in frame.columns]]

    def tagged(frame, tag):
        return frame.rename(columns={c: f"{c}_{tag}" for c in values})

    merged = tagged(keyed(recomputed), "recomputed").merge(tagged(keyed(committed), "committed"), on=keys,
                                                            how="left", indicator=True)
    problems = pd.Series([""] * len(merged), index=merged.index, dtype=object)
    problems[merged["_merge"] == "left_only"] = "missing from committed"
    present = merged["_merge"] == "both"
    for col in values:
        a, b = merged[f"{col}_recomputed"], merged.get(f"{col}_committed")
        if b is None:
            bad = present
        elif col in exact:
            bad = present & (a != b)
        else:
            a, b = a.astype(float), b.astype(float)
            bad = present & ~np.isclose(a, b, atol=atol, rtol=rtol, equal_nan=True)
        problems[bad] = problems[bad] + f"{col} "
    out = merged[problems != ""].drop(columns="_merge").assign(problem=problems[problems != ""].str.strip())
    return out.reset_index(drop=True)


# -- committed frames --------------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameKind:
    """One sweep's committed frame: its file prefix (``per_layer``: ``per_layer_<model>_<data>.csv.gz``), the
    columns that name a row (``keys``, also the sweep's row order, outermost first: text keys in the
    requested order, numbers ascending), those compared exactly and those within the tolerance."""

    name: str
    what: str
    keys: tuple[str, ...]
    exact: tuple[str, ...]
    floats: tuple[str, ...]

    @property
    def sweep(self) -> str:
        return self.name.replace("_", "-")


DOWNSTREAM = FrameKind("downstream", "per-example rows of chapter 04_faithfulness's downstream tasks "
                       "(cwcore.faithfulness.downstream_eval, per_example=True); nll in nats per gold token",
                       keys=("task", "metric", "mode", "ratio", "example"),
                       exact=("n_tokens", "n_removed", "n_candidates", "correct", "clean_correct"),
                       floats=("nll", "clean_nll"))
BENCH = FrameKind("bench", "per-sequence rows of chapter 04b_attribution_bench, one data set "
                  "(cwcore.faithfulness.faithfulness_curve, per_sequence=True); nll in nats",
                  keys=("metric", "mode", "ratio", "sequence"),
                  exact=("document", "n_tokens", "n_removed", "n_candidates"), floats=("nll", "clean_nll"))
SENSITIVITY = FrameKind("sensitivity", "per-sequence rows of chapter 04_faithfulness's protocol variants (Table 8: "
                        "cwcore.faithfulness.faithfulness_curve, per_sequence=True, one call per variant); nll in nats",
                        keys=("change", "metric", "mode", "ratio", "sequence"),
                        exact=("document", "n_tokens", "n_removed", "n_candidates"), floats=("nll", "clean_nll"))
ANATOMY = FrameKind("anatomy", "per-document layer averages of what each rung's removal takes in the clean run "
                    "(cwbook.anatomy.selection_anatomy, then layer_average) on chapter 04_faithfulness's "
                    "evidence sample, per-head protocol, signed",
                    keys=("metric", "mode", "ratio", "sequence"), exact=("document",), floats=MEASURES)
PER_LAYER = FrameKind("per_layer", "per-sequence rows of chapter 04_faithfulness's per-layer interventions "
                      "(cwcore.faithfulness.layers.per_layer_curve); nll in nats",
                      keys=("layer", "metric", "mode", "ratio", "sequence"),
                      exact=("document", "n_tokens", "n_removed", "n_candidates"), floats=("nll", "clean_nll"))


def frame_paths(kind: FrameKind, model: str, data: str | None = None,
                out: str | Path | None = None) -> tuple[Path, Path]:
    """(gzipped CSV, JSON) of one committed frame under ``out`` (default ``data/results/evidence``)."""
    folder = Path(out) if out is not None else DEFAULT_OUT
    stem = f"{kind.name}_{slug(model)}" + (f"_{data}" if data else "")
    return folder / f"{stem}.csv.gz", folder / f"{stem}.json"


def write_frame(kind: FrameKind, table: pd.DataFrame, meta: dict, model: str, data: str | None = None,
                out: str | Path | None = None) -> tuple[Path, Path]:
    """Write ``table`` (floats to :data:`SIGNIFICANT_DIGITS` significant digits) and ``meta`` with its
    columns, dtypes, row count and the SHA-256 of the table's bytes (``csv_sha256``, checked by
    :func:`read_frame`), each file atomically; returns their paths."""
    csv, js = frame_paths(kind, model, data, out)
    meta = {**meta, "columns": list(table.columns), "dtypes": {c: str(t) for c, t in table.dtypes.items()},
            "rows": len(table), "float_format": f"%.{SIGNIFICANT_DIGITS}g"}
    rows = gzipped_csv(table, SIGNIFICANT_DIGITS)  # a rewrite that changes nothing leaves git clean
    meta[HASH_FIELD] = content_hash(rows)
    csv.parent.mkdir(parents=True, exist_ok=True)
    cw_cache.atomic_write_bytes(csv, rows)
    cw_cache.atomic_write_bytes(js, (json.dumps(meta, indent=1, default=_plain) + "\n").encode())
    return csv, js


def read_frame(kind: FrameKind, model: str, data: str | None = None,
               out: str | Path | None = None) -> tuple[pd.DataFrame, dict] | None:
    """(table, meta) of a committed frame with the columns and dtypes the sweep returned (an empty text
    is ``""``, as the sweep wrote it), or None when either file is absent."""
    csv, js = frame_paths(kind, model, data, out)
    found = read_present_pair(csv, js)
    if found is None:
        return None
    data_bytes, meta = found
    dtypes = meta.get("dtypes", {})
    text = [c for c, t in dtypes.items() if t in ("str", "object", "string")]
    table = pd.read_csv(io.BytesIO(data_bytes), dtype={c: str for c in text}, compression="gzip")
    if set(meta.get("columns", table.columns)) != set(table.columns) or set(dtypes) - set(table.columns):
        raise CommittedFileError(f"{csv.name}: its columns {sorted(table.columns)} are not the ones its JSON records "
                                 f"({sorted(meta.get('columns', []))})")  # a column dropped without a word
    for column, dtype in dtypes.items():
        if column in text:
            table[column] = table[column].astype(object).fillna("").infer_objects()
            continue
        try:
            cast = table[column].astype(dtype)
        except (TypeError, ValueError) as err:
            raise CommittedFileError(f"{csv.name}: column {column} is not {dtype} ({err})") from None
        numeric = pd.api.types.is_numeric_dtype(table[column]) and pd.api.types.is_numeric_dtype(cast)
        if numeric and not np.array_equal(cast.to_numpy(np.float64), table[column].to_numpy(np.float64),
                                          equal_nan=True):  # nll recorded as int64 read 7.078 as 7
            raise CommittedFileError(f"{csv.name}: its JSON records column {column} as {dtype}, which would change "
                                     "its values")
        table[column] = cast
    table = table[meta.get("columns", list(table.columns))]
    _check_frame(kind, table, meta, csv.name)
    return table, meta


def _check_frame(kind: FrameKind, table: pd.DataFrame, meta: dict, name: str) -> None:
    """The counts of a committed frame against its JSON: its rows, and every unit it ran in every group."""
    check_rows(table, meta, name)
    if "example" in kind.keys and "example_ids" in meta:
        for task, ids in meta["example_ids"].items():
            check_units(table[table["task"] == task], [k for k in kind.keys if k != "example"], "example", ids,
                        name, "examples")
    elif "sequence" in kind.keys and "document_ids" in meta:
        ids = [int(d) for d in meta["document_ids"]]
        check_units(table, [k for k in kind.keys if k != "sequence"], "sequence", range(len(ids)), name)
        if "document" in table and len(table):
            placed = table["sequence"].map(dict(enumerate(ids)))
            if not (placed == table["document"].astype("int64")).all():
                raise CommittedFileError(f"{name} pairs sequences with other documents than its JSON lists")


def _plain(value):
    """JSON's form of the settings' values (tuples as lists, numpy numbers as numbers)."""
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    return str(value)


def _canonical(value) -> object:
    return json.loads(json.dumps(value, sort_keys=True, default=_plain))


def _held(kind: FrameKind, found, settings: dict, wanted: dict[str, Sequence],
          samples: dict[str, str], combinations: Sequence[tuple] | None = None) -> tuple[pd.DataFrame | None, str]:
    """(rows, why): the frame's rows of ``wanted`` (column: values) in the sweep's order, when it ran with
    ``settings``, the same ``samples`` (digest of each requested group's units) and holds every
    combination of ``wanted`` (or each of ``combinations``, tuples of ``wanted``'s columns in its order,
    when not every combination is requested);
    None with the reason otherwise."""
    if found is None:
        return None, "no committed export"
    table, meta = found
    held = meta.get("settings", {})
    differ = sorted(k for k in set(held) | set(settings) if _canonical(held.get(k)) != _canonical(settings.get(k)))
    differ += [f"{group} sample" for group, digest in samples.items() if meta.get("samples", {}).get(group) != digest]
    if differ:
        return None, "the export ran with other " + ", ".join(differ)
    rows = table
    for column, values in wanted.items():
        if pd.api.types.is_float_dtype(rows[column]):
            rows = rows[rows[column].round(9).isin([round(float(v), 9) for v in values])]
        else:
            rows = rows[rows[column].isin(list(values))]
    def key(values):  # floats as the column filter above compares them
        return tuple(round(float(v), 9) if isinstance(v, (float, np.floating)) else v for v in values)

    requested = {key(c) for c in (itertools.product(*wanted.values()) if combinations is None else combinations)}
    rows = rows[[key(r) in requested for r in rows[list(wanted)].itertuples(index=False)]]
    found_combinations = len({key(r) for r in rows[list(wanted)].itertuples(index=False)})
    if found_combinations < len(requested):
        return None, f"the export holds {found_combinations} of the {len(requested)} requested " + \
            " x ".join(wanted) + " combinations"
    sort_keys = {}
    for column in kind.keys:  # the sweep's order: text keys as requested, numbers ascending
        if column in wanted and not pd.api.types.is_numeric_dtype(rows[column]):
            sort_keys[column] = rows[column].map({v: i for i, v in enumerate(dict.fromkeys(wanted[column]))})
        else:
            sort_keys[column] = rows[column]
    order = pd.DataFrame(sort_keys).sort_values(list(kind.keys), kind="stable").index
    return rows.loc[order].reset_index(drop=True), "committed"


def committed_frame(kind: FrameKind, compute: Callable[[], pd.DataFrame], recompute_slice: Callable[[], pd.DataFrame],
                    *, model: str, data: str | None = None, settings: dict, wanted: dict[str, Sequence],
                    samples: dict[str, str] | None = None, meta: dict | None = None,
                    exports: str | Path | None = None, atol: float = ATOL, rtol: float = RTOL,
                    log: Callable[[str], None] | None = print, combinations: Sequence[tuple] | None = None,
                    computed_by: Callable | None = None, lm=None, slice_units: int | None = None) -> pd.DataFrame:
    """``compute()`` (a sweep's whole frame), or its committed frame (:func:`read_frame`) when that ran with
    ``settings`` on the same ``samples`` (group: digest of its units, e.g. each task's examples), holds
    every combination of ``wanted`` (column: requested values; or each of ``combinations``) and
    ``recompute_slice()`` (its first units, without the cache) equals its rows within ``atol`` nats plus ``rtol`` relative
    (:func:`compare_rows`)."""
    t0 = time.monotonic()
    label = f"{model}{' ' + data if data else ''} {kind.sweep}"
    decision = {"sweep": kind.sweep, "model": model, **({"data": data} if data else {})}
    try:
        found = read_frame(kind, model, data, exports)
    except CommittedFileError as err:  # refused: computed again, saying why
        found, refused = None, str(err)
    else:
        refused = None
    rows, why = _held(kind, found, settings, wanted, samples or {}, combinations)
    if refused is not None:
        why = f"the committed export is refused: {refused}"
    if rows is not None:
        identity = None if computed_by is None else check_identity(
            {"frame": label, "settings": settings, "wanted": wanted, "samples": samples, "combinations": combinations,
             "slice_units": slice_units}, rows, computed_by=computed_by, lm=lm, atol=atol, rtol=rtol)
        diff_name = "max_abs_diff_nll" if "nll" in kind.floats else "max_abs_diff"

        def check():
            fresh = recompute_slice()
            bad = compare_rows(rows, fresh, keys=kind.keys, exact=kind.exact, floats=kind.floats, atol=atol, rtol=rtol)
            both = fresh.merge(rows, on=list(kind.keys), suffixes=("", "_c"))
            diff = max((float((both[c] - both[f"{c}_c"]).abs().max()) for c in kind.floats), default=float("nan")) \
                if len(both) else float("nan")
            return bad, len(fresh), diff

        bad, slice_rows, diff, before = slice_check(identity, check, diff_name)
        if before is not None:
            decision["checked_before"] = before["checked"]
        decision.update(slice_rows=slice_rows, check_s=round(time.monotonic() - t0, 1), **{diff_name: diff})
        if bad.empty:
            decision.update(decision="committed", rows=len(rows))
            say(log, f"{label}: committed export taken ({slice_rows} rows {checked_how(before)}, within {atol:g} nats + "
                     f"{rtol:g} relative, max |diff| {diff:.1e})")
            record_decision(decision)
            return rows
        why = (f"{len(bad)} of {slice_rows} recomputed rows differ from the export by more than {atol:g} nats "
               f"+ {rtol:g} relative")
    if refused is not None or (why != "no committed export" and "profile" not in why):  # another profile: silent
        say(log, f"{label}: computing ({why})")
    decision.update(decision="recomputed", reason=why)
    table = compute()
    wall = time.monotonic() - t0
    decision["compute_s"] = round(wall, 1)
    if (exports is not None or os.environ.get(CELLS_ENV_VAR, "").strip()) and runs.is_main_rank():
        csv, _ = write_frame(kind, table, {
            "what": kind.what, **checkout(), "profile": settings.get("profile"),
            "model": model, "data": data, "settings": settings, "samples": samples or {},
            **{f"{k}s": list(v) for k, v in wanted.items()},
            **(meta or {}), "wall_s": round(wall, 1),
            "cache": {"code_hash": cw_cache.code_version(("faithfulness",))},
            "created": now()}, model, data, exports)
        decision["written"] = csv.name
        say(log, f"{label}: written to {csv.name} ({wall:.0f} s)")
    record_decision(decision)
    return table


def downstream_ladder(per_example: pd.DataFrame, *, n_bootstrap: int, seed: int) -> pd.DataFrame:
    """The ladder steps of the downstream tasks' per-example table, as notebook 04 computes them (paired
    bootstrap over examples, judged by the registered margins, as the ladder's steps under the ``default``
    protocol, signed importance, full range), with the task as ``data``."""
    ladder = evidence.judge(ladder_comparison(per_example, n_bootstrap=n_bootstrap, seed=seed).assign(
        protocol="default", importance="signed", range="full"))
    ladder["data"] = ladder.pop("task")
    return ladder


def _call_settings(function: Callable, kwargs: dict, skip: Sequence[str] = ()) -> dict:
    """The keywords of ``function`` that change numbers (not :data:`NOT_NUMBERS`, not ``skip``), as given
    or defaulted, with its protocol resolved (:func:`cwcore.faithfulness.protocol.as_protocol`) into
    ``protocol``: so an export of a call that relied on a default is not taken once the default changes."""
    out = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is not inspect.Parameter.KEYWORD_ONLY or name in (*NOT_NUMBERS, *skip, "protocol"):
            continue
        out[name] = kwargs.get(name, parameter.default)
    protocol = as_protocol(kwargs.get("protocol"), **{k: v for k, v in kwargs.items() if k in PROTOCOL_FIELDS})
    out["protocol"] = protocol.settings()
    return out


def _requested(metrics, ratios, mode, kwargs: dict) -> dict:
    """The metric labels, modes and ratios a sweep runs, as it names them in its rows."""
    protocol = as_protocol(kwargs.get("protocol"), **{k: v for k, v in kwargs.items() if k in PROTOCOL_FIELDS})
    return {"metric": [s.label for s in parse_specs(metrics, protocol.kind)], "mode": list(parse_modes(mode)),
            "ratio": [float(r) for r in parse_ratios(ratios)]}


def _examples_digest(dataset) -> str:
    """sha256 of a multiple-choice sample's examples (contexts, continuations, gold), in order."""
    text = json.dumps([[row["contexts"], row["continuations"], row["gold"]] for row in dataset], default=_plain)
    return hashlib.sha256(text.encode()).hexdigest()


def downstream_cell(lm, tokenizer, tasks, metric=None, ratios=None, mode=None, *, model: str, profile: str,
                    num_examples: int | None = None, data_seed: int = 0, dtype: str = "float32",
                    exports: str | Path | None = None, slice_examples: int = SLICE_DOCUMENTS, atol: float = ATOL,
                    rtol: float = RTOL, evaluate: Callable = cached_downstream_eval, log: Callable[[str], None] | None = print,
                    per_example: bool = True, **kwargs) -> pd.DataFrame:
    """``evaluate(lm, tokenizer, tasks, metric, ratios, mode, num_examples=..., data_seed=...,
    per_example=True, **kwargs)`` (:func:`cwbook.cached.cached_downstream_eval`, the cached
    :func:`cwcore.faithfulness.downstream.downstream_eval`: the per-example
    table of the downstream tasks, ``tasks`` packaged names), task by task: each task's committed frame
    ``downstream_<model>_<task>.csv.gz`` (:func:`committed_frame`) is taken once the first ``slice_examples``
    examples of its sample, recomputed without the cache, equal it; otherwise the task is computed (and
    written) before the next one starts."""
    if not per_example:
        raise ValueError("downstream_cell returns the per-example table (per_example=True); summarise it with "
                         "cwcore.faithfulness.summarize_downstream")
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    settings = {"profile": profile, "dtype": str(dtype), "num_examples": num_examples, "data_seed": data_seed,
                **_call_settings(downstream_eval, kwargs, skip=("task", "num_examples", "data_seed"))}
    call = dict(num_examples=num_examples, data_seed=data_seed, per_example=True, **kwargs)
    wanted = _requested(metric, ratios, mode, kwargs)
    frames = []
    for task in tasks:
        sample = load_dataset(task, limit=num_examples, seed=data_seed)

        def recompute_slice(task=task, sample=sample):
            return evaluate(lm, tokenizer, sample.select(range(min(slice_examples, len(sample)))), metric, ratios,
                            mode, **{**call, "task": task, "num_examples": None, "cache": False, "progress": False})

        frames.append(committed_frame(
            DOWNSTREAM, lambda task=task: evaluate(lm, tokenizer, [task], metric, ratios, mode, **call),
            recompute_slice, model=model, data=task, settings=settings, wanted={"task": [task], **wanted},
            samples={task: _examples_digest(sample)},
            meta={"example_ids": {task: list(range(len(sample)))}, "call": call}, exports=exports, atol=atol,
            rtol=rtol, log=log, computed_by=remembering(evaluate, kwargs), lm=lm, slice_units=slice_examples))
    return pd.concat(frames, ignore_index=True)


def read_downstream(model: str, tasks: Sequence[str],
                    out: str | Path | None = None) -> tuple[pd.DataFrame, dict[str, dict]] | None:
    """The committed downstream frames of ``model`` (:func:`downstream_cell`) for those of ``tasks`` that have
    one: their rows concatenated in the order of ``tasks`` and each task's JSON (``{task: meta}``); None
    when no task has a frame."""
    found = {task: read_frame(DOWNSTREAM, model, task, out) for task in tasks}
    found = {task: f for task, f in found.items() if f is not None}
    if not found:
        return None
    return (pd.concat([table for table, _ in found.values()], ignore_index=True),
            {task: meta for task, (_, meta) in found.items()})


def _sample_settings(blocks, profile: str, dtype) -> dict:
    """The settings of a :func:`cwcore.data.document_blocks` sample: its documents and the digest of its
    token ids (the random control hashes each sequence's place, so the sample must be the same)."""
    ids = np.asarray(blocks["input_ids"], dtype=np.int64)
    return {"profile": profile, "dtype": str(dtype), "documents": [int(d) for d in blocks["document"]],
            "input_ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(), "seq_len": int(ids.shape[1])}


def _documents_frame(kind: FrameKind, curve: Callable, reference: Callable, lm, tokenizer, blocks, metric, ratios,
                     mode, *, model: str, data: str, profile: str, dtype: str, exports, slice_documents: int,
                     atol: float, rtol: float, log, kwargs: dict) -> pd.DataFrame:
    """``curve(lm, tokenizer, blocks, metric, ratios, mode, **kwargs)``, a per-sequence sweep over a
    :func:`cwcore.data.document_blocks` data set (``reference``: the library function whose keywords
    are the settings), or its committed frame once its first ``slice_documents`` documents, recomputed
    without the cache, equal it. The documents and the digest of their token ids are among the settings
    (the random control hashes each sequence's place, so the sample must be the same)."""
    settings = {**_sample_settings(blocks, profile, dtype), **_call_settings(reference, kwargs)}

    def recompute_slice():
        return curve(lm, tokenizer, blocks.select(range(min(slice_documents, len(blocks)))), metric, ratios, mode,
                     **{**kwargs, "cache": False, "progress": False})

    return committed_frame(kind, lambda: curve(lm, tokenizer, blocks, metric, ratios, mode, **kwargs),
                           recompute_slice, model=model, data=data, settings=settings,
                           wanted=_requested(metric, ratios, mode, kwargs),
                           meta={"document_ids": settings["documents"], "call": kwargs}, exports=exports,
                           atol=atol, rtol=rtol, log=log, computed_by=remembering(curve, kwargs), lm=lm,
                           slice_units=slice_documents)


def per_layer_cell(lm, tokenizer, blocks, metric=None, ratios=None, mode=None, *, model: str, data: str, profile: str,
                   dtype: str = "float32", exports: str | Path | None = None, slice_documents: int = SLICE_DOCUMENTS,
                   atol: float = ATOL, rtol: float = RTOL, curve: Callable = cached_per_layer_curve,
                   log: Callable[[str], None] | None = print, **kwargs) -> pd.DataFrame:
    """``curve(lm, tokenizer, blocks, metric, ratios, mode, **kwargs)``
    (:func:`cwbook.cached.cached_per_layer_curve`, the cached :func:`cwcore.faithfulness.layers.per_layer_curve`:
    the per-layer interventions' per-sequence table),
    or its committed frame ``per_layer_<model>_<data>.csv.gz`` (:func:`committed_frame`) once its first
    ``slice_documents`` documents, recomputed without the cache, equal it."""
    return _documents_frame(PER_LAYER, curve, per_layer_curve, lm, tokenizer, blocks, metric, ratios, mode,
                            model=model, data=data, profile=profile, dtype=dtype, exports=exports,
                            slice_documents=slice_documents, atol=atol, rtol=rtol, log=log, kwargs=kwargs)


def bench_cell(lm, tokenizer, blocks, metric=None, ratios=None, mode=None, *, model: str, data: str, profile: str,
               dtype: str = "float32", exports: str | Path | None = None, slice_documents: int = SLICE_DOCUMENTS,
               atol: float = ATOL, rtol: float = RTOL, curve: Callable = per_sequence_curve,
               log: Callable[[str], None] | None = print, **kwargs) -> pd.DataFrame:
    """``curve(lm, tokenizer, blocks, metric, ratios, mode, per_sequence=True, **kwargs)``
    (:func:`cwbook.cached.per_sequence_curve`, the per-sequence table of
    :func:`cwcore.faithfulness.faithfulness_curve`: chapter 4b's attribution bench, one data set), or its
    committed frame ``bench_<model>_<data>.csv.gz`` (:func:`committed_frame`) once its first
    ``slice_documents`` documents, recomputed without the cache, equal it; ``blocks`` as in
    :func:`per_layer_cell`."""
    if not kwargs.setdefault("per_sequence", True):
        raise ValueError("bench_cell returns the per-sequence table (per_sequence=True); summarise it with "
                         "cwcore.faithfulness.summarize")
    return _documents_frame(BENCH, curve, per_sequence_curve, lm, tokenizer, blocks, metric, ratios, mode,
                            model=model, data=data, profile=profile, dtype=dtype, exports=exports,
                            slice_documents=slice_documents, atol=atol, rtol=rtol, log=log, kwargs=kwargs)


def sensitivity_cell(lm, tokenizer, blocks, metric=None, ratios=None, mode=None, *, variants: Mapping[str, Mapping],
                     model: str, data: str, profile: str, dtype: str = "float32", exports: str | Path | None = None,
                     slice_documents: int = SLICE_DOCUMENTS, atol: float = ATOL, rtol: float = RTOL,
                     curve: Callable = per_sequence_curve, log: Callable[[str], None] | None = print,
                     **kwargs) -> pd.DataFrame:
    """Chapter 4's protocol variants (Table 8): for each ``name: change`` of ``variants``,
    ``curve(lm, tokenizer, blocks, metric, ratios, mode, per_sequence=True, **{**kwargs, **change})``
    (:func:`cwbook.cached.per_sequence_curve`), its rows with the variant's ``name`` as a first column
    ``change`` (the rows' own ``variant`` names only the removal unit's deviations, not the sign or the
    kind), concatenated in the order of ``variants``; or the committed frame
    ``sensitivity_<model>_<data>.csv.gz`` (:func:`committed_frame`) once its first ``slice_documents``
    documents, recomputed without the cache under every variant, equal it. ``blocks``: a
    :func:`cwcore.data.document_blocks` data set; each variant's resolved settings are among the frame's."""
    if not kwargs.setdefault("per_sequence", True):
        raise ValueError("sensitivity_cell returns the per-sequence table (per_sequence=True); summarise each "
                         "variant with cwcore.faithfulness.summarize")
    if not variants:
        raise ValueError("sensitivity_cell needs at least one variant ({name: protocol keywords})")
    calls = {str(name): {**kwargs, **dict(change)} for name, change in variants.items()}
    requested = {name: _requested(metric, ratios, mode, call) for name, call in calls.items()}
    labels = list(dict.fromkeys(label for r in requested.values() for label in r["metric"]))
    first = next(iter(requested.values()))
    settings = {**_sample_settings(blocks, profile, dtype),
                "variants": {name: _call_settings(per_sequence_curve, call) for name, call in calls.items()}}

    def sweep(part, **extra):
        frames = [curve(lm, tokenizer, part, metric, ratios, mode, **{**call, **extra}) for call in calls.values()]
        return pd.concat([f.assign(change=name)[["change", *f.columns]] for name, f in zip(calls, frames)],
                         ignore_index=True)

    return committed_frame(
        SENSITIVITY, lambda: sweep(blocks),
        lambda: sweep(blocks.select(range(min(slice_documents, len(blocks)))), cache=False, progress=False),
        model=model, data=data, settings=settings,
        wanted={"change": list(calls), "metric": labels, "mode": first["mode"], "ratio": first["ratio"]},
        combinations=[(name, m, mode_, r) for name, q in requested.items() for m in q["metric"] for mode_ in q["mode"]
                      for r in q["ratio"]],
        meta={"document_ids": settings["documents"], "call": kwargs, "variants": {k: dict(v) for k, v in variants.items()}},
        exports=exports, atol=atol, rtol=rtol, log=log, computed_by=remembering(curve, kwargs), lm=lm,
        slice_units=slice_documents)


def _anatomy_rows(lm, blocks, metrics, ratios, modes, *, protocol, batch_size: int, progress: bool) -> pd.DataFrame:
    """:func:`~cwbook.anatomy.layer_average` of :func:`~cwbook.anatomy.selection_anatomy`
    with each document's place in ``blocks`` (``sequence``), in :data:`ANATOMY`'s key order."""
    table = layer_average(selection_anatomy(lm, blocks, metrics, ratios, modes, protocol=protocol,
                                            batch_size=batch_size, progress=progress))
    place = {int(d): i for i, d in enumerate(blocks["document"])}
    table.insert(int(table.columns.get_loc("document")) + 1, "sequence", table["document"].map(place).astype("int64"))
    order = pd.DataFrame({"metric": table["metric"].map({m: i for i, m in enumerate(metrics)}),
                          "mode": table["mode"].map({m: i for i, m in enumerate(modes)}),
                          "ratio": table["ratio"], "sequence": table["sequence"]})
    return table.loc[order.sort_values(list(order.columns), kind="stable").index].reset_index(drop=True)


def anatomy_cell(lm, blocks, metrics: Sequence[str] = LADDER, ratios: Sequence[float] = (0.01, 0.05),
                 modes: Sequence[str] = ("comprehensiveness", "sufficiency"), *, model: str, data: str, profile: str,
                 dtype: str = "float32", protocol: str = "per-head", batch_size: int = 8,
                 exports: str | Path | None = None, slice_documents: int = SLICE_DOCUMENTS, atol: float = ATOL,
                 rtol: float = RTOL, progress: bool = False, log: Callable[[str], None] | None = print) -> pd.DataFrame:
    """What each rung's removal takes, per document: the layer averages of
    :func:`cwbook.anatomy.selection_anatomy` (``protocol``, a main protocol's name; one row per
    metric, mode, ratio and document, with its place ``sequence``), or the committed frame
    ``anatomy_<model>_<data>.csv.gz`` (:func:`committed_frame`) once its first ``slice_documents``
    documents, recomputed, equal it. ``blocks``: a :func:`cwcore.data.document_blocks` data set."""
    metrics, modes = list(metrics), list(parse_modes(modes))
    ratios = [float(r) for r in ratios]
    settings = {**_sample_settings(blocks, profile, dtype),
                "protocol": as_protocol(None, **evidence.PROTOCOLS[protocol]).settings(), "protocol_name": protocol}
    run = dict(protocol=protocol, batch_size=batch_size)
    return committed_frame(
        ANATOMY, lambda: _anatomy_rows(lm, blocks, metrics, ratios, modes, progress=progress, **run),
        lambda: _anatomy_rows(lm, blocks.select(range(min(slice_documents, len(blocks)))), metrics, ratios, modes,
                              progress=False, **run),
        model=model, data=data, settings=settings, wanted={"metric": metrics, "mode": modes, "ratio": ratios},
        meta={"document_ids": settings["documents"], "call": run}, exports=exports, atol=atol, rtol=rtol, log=log,
        computed_by=_anatomy_rows, lm=lm, slice_units=slice_documents)


def _step_rows(per_document: pd.DataFrame) -> pd.DataFrame:
    """The per-head, signed rows of a per-document export (the damage the anatomy's steps are paired with)."""
    rows = per_document[(per_document["protocol"] == "per-head") & (per_document["importance"] == "signed")]
    if "variant" in rows:
        rows = rows[rows["variant"].isin(["main", ""])]
    return rows


def anatomy_explained(anatomy: pd.DataFrame, per_document: pd.DataFrame, *, n_bootstrap: int,
                      seed: int) -> pd.DataFrame:
    """:func:`cwbook.anatomy.explain_step` for the ladder's three steps (1->2, 2->3, 3->4): does a
    step's damage gap (the per-head, signed rows of the per-document export) follow its gap in what it
    removes (``anatomy``, :func:`anatomy_cell`'s frame) across documents?"""
    rows = _step_rows(per_document)
    if rows.empty:
        return pd.DataFrame()
    return pd.concat([explain_step(anatomy, rows, lower, higher, n_bootstrap=n_bootstrap, seed=seed)
                      for lower, higher in zip(LADDER, LADDER[1:])], ignore_index=True)


def anatomy_held_out(anatomy: pd.DataFrame, per_document: pd.DataFrame, *, seed: int) -> pd.DataFrame:
    """:func:`cwbook.anatomy.explain_held_out` (fitted on half of the documents, tested on the
    other half, with the controls 1->2 and 3->4) of an anatomy frame and a per-document export."""
    return explain_held_out(anatomy, _step_rows(per_document), seed=seed)
