"""Committed evidence verified by its content: each committed table's JSON records the SHA-256 of its CSV."""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

#: the JSON field that holds the SHA-256 (hex) of the table's bytes as committed
HASH_FIELD = "csv_sha256"


class CommittedFileError(ValueError):
    """A committed table does not hold what its JSON records (its content, rows or units): refused."""


def content_hash(data: bytes) -> str:
    """The SHA-256 (hex) of a committed file's bytes."""
    return hashlib.sha256(data).hexdigest()


def read_pair(table: Path, meta_path: Path) -> tuple[bytes, dict]:
    """``(the table's bytes, its JSON)``, once the bytes hash to the JSON's :data:`HASH_FIELD`; otherwise
    :class:`CommittedFileError` with a one-line reason. Both files must exist."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CommittedFileError(f"{meta_path.name} cannot be read ({err})") from None
    if not isinstance(meta, dict):
        raise CommittedFileError(f"{meta_path.name} is not a JSON object")
    try:
        data = table.read_bytes()
    except OSError as err:
        raise CommittedFileError(f"{table.name} cannot be read ({err.strerror or err})") from None
    recorded = meta.get(HASH_FIELD)
    if not recorded:
        raise CommittedFileError(f"{meta_path.name} records no {HASH_FIELD} of {table.name}, so its content cannot "
                                 "be verified: recompute it, or record the hash of a table known to be right with "
                                 "`python -m cwbook.evidence_files --record`")
    if content_hash(data) != recorded:
        raise CommittedFileError(f"{table.name} does not match the SHA-256 its {meta_path.name} records (changed "
                                 "after it was written, or a write interrupted between the two files): not taken; "
                                 "restore both from git or recompute them")
    return data, meta


def read_present_pair(table: Path, meta_path: Path) -> tuple[bytes, dict] | None:
    """:func:`read_pair`, or None when both files are absent; one without the other is refused."""
    if not (table.is_file() and meta_path.is_file()):
        if table.is_file() != meta_path.is_file():
            raise CommittedFileError(f"{(table if table.is_file() else meta_path).name} has no "
                                     f"{(meta_path if table.is_file() else table).name} beside it (an interrupted write)")
        return None
    return read_pair(table, meta_path)


def write_checked_csv(table: pd.DataFrame, path: str | Path, what: str, **to_csv) -> list[Path]:
    """``table`` as CSV at ``path`` (``to_csv`` as in :meth:`pandas.DataFrame.to_csv`, never the index) and
    beside it ``<name>.json`` recording ``what`` it holds, its rows and its SHA-256 (:data:`HASH_FIELD`), each
    written atomically, the table first: a write interrupted between the two leaves a pair that
    :func:`read_checked_csv` refuses. Returns both paths."""
    from cwcore.cache import atomic_write_bytes

    path = Path(path)
    data = table.to_csv(index=False, **to_csv).encode()
    atomic_write_bytes(path, data)
    meta_path = path.with_suffix(".json")
    atomic_write_bytes(meta_path, _dump({"what": what, "rows": len(table), HASH_FIELD: content_hash(data)}))
    return [path, meta_path]


def read_checked_csv(path: str | Path, **read_csv) -> pd.DataFrame:
    """The table :func:`write_checked_csv` wrote at ``path``, once its bytes hash to what its JSON records and
    it has the rows recorded (:class:`CommittedFileError` otherwise, and where either file is missing)."""
    import io

    path = Path(path)
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        raise CommittedFileError(f"{path.name} has no {meta_path.name} beside it, so its content cannot be verified: "
                                 "recompute it, or record the hash of a table known to be right with "
                                 "`python -m cwbook.evidence_files --record`")
    data, meta = read_pair(path, meta_path)
    table = pd.read_csv(io.BytesIO(data), **read_csv)
    check_rows(table, meta, path.name)
    return table


def gzipped_csv(table: pd.DataFrame, significant_digits: int) -> bytes:
    """``table`` as gzipped CSV, floats to ``significant_digits``; mtime 0, so the same rows give the same bytes."""
    import io

    rows = io.BytesIO()
    table.to_csv(rows, index=False, float_format=f"%.{significant_digits}g", compression={"method": "gzip", "mtime": 0})
    return rows.getvalue()


def now() -> str:
    """The current UTC time as the committed files record it."""
    import time

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def checkout() -> dict:
    """``commit`` and ``cwcore_modified`` of the cwcore checkout that runs (None where git cannot tell)."""
    import cwcore

    from . import git

    root = Path(cwcore.__file__).resolve().parent.parent
    status = git(root, "status", "--porcelain", "--", "cwcore")
    return {"commit": git(root, "rev-parse", "HEAD"), "cwcore_modified": None if status is None else bool(status)}


def check_rows(table: pd.DataFrame, meta: dict, name: str) -> None:
    """:class:`CommittedFileError` unless ``table`` has the ``rows`` its JSON records."""
    if "rows" in meta and int(meta["rows"]) != len(table):
        raise CommittedFileError(f"{name} holds {len(table)} rows, its JSON records {meta['rows']}")


def check_units(table: pd.DataFrame, groups: Sequence[str], unit: str, expected: Sequence, name: str,
                what: str = "documents") -> None:
    """:class:`CommittedFileError` unless every group of ``table`` (by ``groups``) holds exactly the units
    ``expected`` in column ``unit`` (each sequence of the sample, each example of the task)."""
    wanted = set(expected)
    if table.empty:
        if wanted:
            raise CommittedFileError(f"{name} holds no rows of its {len(wanted)} {what}")
        return
    for key, part in (table.groupby(list(groups), sort=False, dropna=False) if groups else [((), table)]):
        held = set(part[unit])
        if held != wanted or len(part) != len(held):
            missing, extra = sorted(wanted - held), sorted(held - wanted)
            detail = (f"lacks {len(missing)} of its {len(wanted)} {what} ({', '.join(map(str, missing[:3]))}"
                      f"{', ...' if len(missing) > 3 else ''})" if missing else
                      f"holds {what} its JSON does not list ({', '.join(map(str, extra[:3]))})" if extra else
                      f"repeats {what}")
            raise CommittedFileError(f"{name} {detail} in {dict(zip(groups, key if isinstance(key, tuple) else (key,)))}"
                                     if groups else f"{name} {detail}")


#: the plain tables a committed evidence folder holds beside its exports, each with a JSON of its own
#: (:func:`write_checked_csv`): both samples' findings, the anatomy's explanations and their held-out tests
CHECKED_TABLES = {
    "findings.csv": "the verdicts of both samples, one row per claim part, model and data set (findings_csv)",
    "explain_*.csv": "the ladder's steps against the anatomy of the terms each rung removes (anatomy.explain_step)",
    "held_out_*.csv": "the anatomy's explanation fitted on half of the documents and tested on the other half "
                      "(anatomy.explain_held_out)",
}


def checked_table_what(path: str | Path) -> str:
    """What a :data:`CHECKED_TABLES` table holds, by its name (the ``what`` of its JSON)."""
    from fnmatch import fnmatch

    return next(what for pattern, what in CHECKED_TABLES.items() if fnmatch(Path(path).name, pattern))


def committed_pairs(folder: Path) -> list[tuple[Path, Path]]:
    """The (table, JSON) pairs of a committed evidence folder: every ``*.csv.gz`` with a JSON beside it, the
    chapters' tables (``<chapter>/<model>.csv``, written by :func:`cwbook.findings.save_results`) and the
    :data:`CHECKED_TABLES` (a JSON missing beside one of those is recorded by ``--record``)."""
    pairs = []
    for table in sorted(Path(folder).glob("*.csv.gz")):
        meta = table.with_name(table.name[: -len(".csv.gz")] + ".json")
        if meta.is_file():
            pairs.append((table, meta))
    for table in sorted(Path(folder).glob("*/*.csv")):
        if table.with_suffix(".json").is_file():
            pairs.append((table, table.with_suffix(".json")))
    for pattern in CHECKED_TABLES:
        pairs += [(table, table.with_suffix(".json")) for table in sorted(Path(folder).glob(pattern))]
    return pairs


def half_pairs(folder: Path) -> list[str]:
    """The files of ``folder`` whose other half is missing: a JSON without its table (``.csv.gz`` at the top,
    ``.csv`` in a chapter's folder), an export or a chapter's table without its JSON; each as "name (why)"."""
    folder, missing = Path(folder), []
    for meta in sorted(folder.glob("*.json")) + sorted(folder.glob("*/*.json")):
        stem = meta.name[: -len(".json")]
        tables = [meta.with_name(stem + ".csv.gz"), meta.with_name(stem + ".csv")]
        if not any(t.is_file() for t in tables):
            missing.append(f"{meta.name} (its table is missing)")
    for table in sorted(folder.glob("*.csv.gz")):
        if not table.with_name(table.name[: -len(".csv.gz")] + ".json").is_file():
            missing.append(f"{table.name} (its JSON is missing)")
    for table in sorted(folder.glob("*/*.csv")):
        if not table.with_suffix(".json").is_file():
            missing.append(f"{table.parent.name}/{table.name} (its JSON is missing)")
    return missing


def _dump(meta: Mapping) -> bytes:
    return (json.dumps(meta, indent=1) + "\n").encode()


def record_hashes(folder: str | Path, *, dry_run: bool = False) -> list[Path]:
    """Add :data:`HASH_FIELD` to each JSON of ``folder``'s pairs that has none, and write the JSON of a
    :data:`CHECKED_TABLES` table that has none (the table's bytes as they are: nothing is recomputed, no table
    is touched)."""
    from cwcore.cache import atomic_write_bytes

    changed, wrong = [], []
    for table, meta_path in committed_pairs(Path(folder)):
        if not meta_path.is_file():  # a checked table committed before it had a JSON
            meta = {"what": checked_table_what(table), "rows": len(pd.read_csv(table))}
        else:
            meta = json.loads(meta_path.read_text())
        digest = content_hash(table.read_bytes())
        if meta.get(HASH_FIELD):
            if meta[HASH_FIELD] != digest:
                wrong.append(table.name)
            continue
        changed.append(meta_path)
        if not dry_run:
            atomic_write_bytes(meta_path, _dump({**meta, HASH_FIELD: digest}))
    if wrong:
        raise CommittedFileError(f"{len(wrong)} tables do not match their recorded hash ({', '.join(wrong)}): "
                                 "left alone; recompute them")
    return changed


#: the committed evidence of this checkout (data/results/evidence), absent in an installed package: the one
#: definition, which the evidence modules import from here (cwbook.findings names it ``EVIDENCE_DIR``)
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "data" / "results" / "evidence"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwbook.evidence_files", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", default=str(DEFAULT_OUT), help=f"default {DEFAULT_OUT}")
    parser.add_argument("--record", action="store_true", help=f"add {HASH_FIELD} to the JSONs that have none")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    args = parser.parse_args(argv)
    from cwcore.cli import debug_requested, run_command

    # a damaged table is the verification's finding (status 1, a line per table), not bad input
    return run_command("python -m cwbook.evidence_files", lambda: _main(args), debug_requested(argv))


def _main(args) -> int:
    from cwcore.cli import UsageError

    folder = Path(args.folder)
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder of committed evidence")
    try:
        if args.record:
            for path in record_hashes(folder):
                print(f"recorded the hash in {path.name}")
        bad = 0
        for table, meta_path in committed_pairs(folder):
            try:
                data, meta = read_pair(table, meta_path)
                if "rows" in meta:  # a JSON recording other rows than its table holds
                    rows = len(pd.read_csv(io.BytesIO(data), compression="gzip" if table.suffix == ".gz" else None))
                    if rows != int(meta["rows"]):
                        raise CommittedFileError(f"holds {rows} rows, its JSON records {meta['rows']}")
            except (CommittedFileError, OSError) as err:
                bad += 1
                print(f"{table.name}: {err}")
        for name in half_pairs(folder):  # a lost table or JSON: not a verified pair, not silently left out
            bad += 1
            print(f"{name}")
        total = len(committed_pairs(folder)) + len(half_pairs(folder))
        if not total:  # a mistyped folder verified "0 of 0", status 0
            raise UsageError(f"{folder} holds no committed table (a table beside its JSON): is it the right folder?")
        print(f"{total - bad} of {total} committed tables verified")
        return 1 if bad else 0
    except CommittedFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
