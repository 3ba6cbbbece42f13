"""A result cache for long runs: keyed by every parameter, written incrementally and atomically.

Each run (one set of parameters) owns a folder ``<cache>/results/<namespace>/<key>``; its pieces
(a batch of sequences, one ratio, ...) are separate parquet files, so an interrupted run resumes
where it stopped. A piece is written to a temporary file and renamed into place, so a reader never
sees a half-written file. The key hashes the parameters and cwcore's source code.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pandas as pd

__all__ = ["cache_root", "code_version", "parameters_key", "ResultCache", "atomic_write_bytes", "result_runs", "prune"]


def cache_root() -> Path:
    """Root of cwcore's caches: ``$CWCORE_CACHE`` or ``~/.cache/cwcore``."""
    configured = os.environ.get("CWCORE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "cwcore"


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of cwcore's source files: results computed by other code are never reused."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _canonical(value):
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_canonical(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # torch dtypes, paths, ...


def parameters_key(parameters: dict) -> str:
    """A stable hash of the parameters together with :func:`code_version`."""
    text = json.dumps({"parameters": _canonical(parameters), "code": code_version()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResultCache:
    """Pieces of one run's results, as DataFrames.

    >>> cache = ResultCache("faithfulness", {"model": "smollm2-135m", "ratios": [0.1, 0.2]})
    >>> frame = cache.get_or_compute("batch-0", lambda: compute_batch(0))
    """

    def __init__(self, namespace: str, parameters: dict, root: Path | None = None, enabled: bool = True):
        self.parameters = parameters
        self.enabled = enabled
        self.directory = (root or cache_root()) / "results" / namespace / parameters_key(parameters)

    def _path(self, piece: str) -> Path:
        return self.directory / f"{piece}.parquet"

    def get(self, piece: str) -> pd.DataFrame | None:
        """The stored piece, or None if it was never completed."""
        path = self._path(piece)
        if not self.enabled or not path.exists():
            return None
        return pd.read_parquet(path)

    def put(self, piece: str, frame: pd.DataFrame) -> None:
        if not self.enabled:
            return
        if not (self.directory / "parameters.json").exists():
            text = json.dumps({"parameters": _canonical(self.parameters), "code": code_version()}, indent=1)
            atomic_write_bytes(self.directory / "parameters.json", text.encode())
        atomic_write_bytes(self._path(piece), frame.to_parquet(index=False))

    def get_or_compute(self, piece: str, compute: Callable[[], pd.DataFrame]) -> pd.DataFrame:
        frame = self.get(piece)
        if frame is None:
            frame = compute()
            self.put(piece, frame)
        return frame


def result_runs(root: Path | None = None) -> pd.DataFrame:
    """Every cached run under ``<root>/results``: one row per folder with ``namespace, key, current``
    (computed by the installed cwcore code), ``pieces``, ``bytes``, ``modified`` (POSIX time) and ``path``.
    """
    base = (root or cache_root()) / "results"
    current = code_version()
    rows = []
    for folder in sorted(base.glob("*/*")) if base.is_dir() else []:
        if not folder.is_dir():
            continue
        try:
            code = json.loads((folder / "parameters.json").read_text()).get("code")
        except (OSError, ValueError):
            code = None  # no piece was ever completed here, or the file is unreadable
        files = {f: f.stat() for f in folder.iterdir() if f.is_file()}  # one stat per file
        rows.append({"namespace": folder.parent.name, "key": folder.name, "current": code == current,
                     "pieces": sum(f.suffix == ".parquet" for f in files),
                     "bytes": sum(st.st_size for st in files.values()),
                     "modified": max([st.st_mtime for st in files.values()], default=folder.stat().st_mtime),
                     "path": str(folder)})
    return pd.DataFrame(rows, columns=["namespace", "key", "current", "pieces", "bytes", "modified", "path"])


def prune(root: Path | None = None, everything: bool = False, dry_run: bool = False,
          min_age_seconds: float = 60.0) -> pd.DataFrame:
    """Delete cached runs that no installed code can read: those computed by another version of cwcore
    (``everything=True``: every run). Runs touched in the last ``min_age_seconds`` are kept, so a job
    writing into the cache right now is not disturbed. Converted models (``<root>/models``) are never
    touched. Returns the rows of :func:`result_runs` that were (``dry_run``: would be) deleted."""
    import shutil
    import time

    runs = result_runs(root)
    doomed = runs if everything else runs[~runs["current"]]
    doomed = doomed[doomed["modified"] < time.time() - min_age_seconds]
    if not dry_run:
        for path in doomed["path"]:
            shutil.rmtree(path, ignore_errors=True)
    return doomed.reset_index(drop=True)
