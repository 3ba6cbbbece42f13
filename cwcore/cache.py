"""A result cache for long runs: keyed by every parameter, written incrementally and atomically.

Each run (one set of parameters) owns a folder ``<cache>/results/<namespace>/<key>``; its pieces
(a batch of sequences, one ratio, ...) are separate parquet files, so an interrupted run resumes
where it stopped. A piece is written to a temporary file and renamed into place, so a reader never
sees a half-written file. The key hashes the parameters and the source code that produces the
result: the core (``cwcore/core``), the statistics, the run driver, the cache and the data loaders,
plus the producing module or subpackage named by ``code`` (e.g. ``"faithfulness"``). Plotting, the
book runner and the command line are never in a key: editing a figure reuses every cached number.
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

__all__ = ["BASE_CODE", "cache_root", "code_scope", "code_version", "parameters_key", "ResultCache", "atomic_write_bytes", "result_runs", "prune"]


def cache_root() -> Path:
    """Root of cwcore's caches: ``$CWCORE_CACHE`` or ``~/.cache/cwcore``."""
    configured = os.environ.get("CWCORE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "cwcore"


#: The code every cached result depends on, whatever produced it (paths relative to the package).
BASE_CODE = ("core", "stats.py", "runs.py", "cache.py", "data.py")
_PACKAGE = Path(__file__).parent


def _code_files(name: str) -> list[Path]:
    if name == "*":
        return sorted(_PACKAGE.rglob("*.py"))
    path = _PACKAGE / name
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    if path.suffix != ".py":
        path = path.with_suffix(".py")
    if path.is_file():
        return [path]
    raise ValueError(f"code scope {name!r} is neither a module nor a subpackage of cwcore")


ALL_CODE = ("*",)  # every source file of the package


def code_scope(code: str | tuple | list | None = None) -> tuple[str, ...]:
    """The sorted module/subpackage names a key covers: :data:`BASE_CODE` plus ``code``; None means the
    whole package (:data:`ALL_CODE`), the safe choice for anything that is not a result, e.g. a book page."""
    if code is None or tuple(code) == ALL_CODE or code == "*":
        return ALL_CODE
    extra = (code,) if isinstance(code, str) else tuple(code)
    return tuple(sorted(set(BASE_CODE) | set(extra)))


@lru_cache(maxsize=None)
def _code_hash(scope: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    files = sorted({f for name in scope for f in _code_files(name)})
    for path in files:
        digest.update(path.relative_to(_PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def code_version(code: str | tuple | list | None = None) -> str:
    """A hash of the source that produces a result: :data:`BASE_CODE` plus ``code`` (module or
    subpackage names such as ``"faithfulness"``, ``"sinks"``, ``"analysis"``). Results computed by other
    code are never reused; code outside the scope (plotting, the book, the CLI) never invalidates them.
    ``code=None`` hashes the whole package."""
    return _code_hash(code_scope(code))


def _canonical(value):
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_canonical(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # torch dtypes, paths, ...


def parameters_key(parameters: dict, code: str | tuple | list | None = None) -> str:
    """A stable hash of the parameters together with :func:`code_version` of ``code``."""
    version = code_version() if code is None else code_version(code)
    text = json.dumps({"parameters": _canonical(parameters), "code": version}, sort_keys=True)
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

    def __init__(self, namespace: str, parameters: dict, root: Path | None = None, enabled: bool = True,
                 code: str | tuple | list | None = None):
        self.parameters = parameters
        self.enabled = enabled
        self.code = code_scope(code)
        self.directory = (root or cache_root()) / "results" / namespace / parameters_key(parameters, self.code)

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
            text = json.dumps({"parameters": _canonical(self.parameters), "code": code_version(self.code),
                               "code_scope": list(self.code)}, indent=1)
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
    rows = []
    for folder in sorted(base.glob("*/*")) if base.is_dir() else []:
        if not folder.is_dir():
            continue
        try:
            stored = json.loads((folder / "parameters.json").read_text())
            code = stored.get("code")
            scope = stored.get("code_scope")  # absent in runs written before scopes existed: whole package
            current = code_version(None if scope is None else tuple(scope))
        except (OSError, ValueError, TypeError):
            code = current = None  # no piece was ever completed here, the file is unreadable, or its scope gone
        files = {f: f.stat() for f in folder.iterdir() if f.is_file()}  # one stat per file
        rows.append({"namespace": folder.parent.name, "key": folder.name, "current": code is not None and code == current,
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
