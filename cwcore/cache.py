"""A result cache for long runs: keyed by every parameter, written incrementally and atomically.

Each run (one set of parameters) owns a folder ``<cache>/results/<namespace>/<key>``; its pieces
(a batch of sequences, one ratio, ...) are separate parquet files, so an interrupted run resumes
where it stopped. A piece is written to a temporary file and renamed into place, so a reader never
sees a half-written file. The key hashes the parameters and the source code that produces the
result: the core (``cwcore/core``), the statistics, the run driver, the cache and the data loaders,
plus the producing module or subpackage named by ``code`` (e.g. ``"faithfulness"``). Plotting, the
book runner and the command line are never in a key: editing a figure reuses every cached number.

A cache cannot silently go wrong: each piece has a checksum (``<piece>.parquet.sha256``, written
atomically before the rename that publishes the piece); a piece that fails to read or verify is
deleted and computed again with a :class:`CacheWarning`. A cache that cannot be written (read-only,
full disk) turns into an uncached run with one warning per cache folder and process. Setting
``CWCORE_NO_CACHE=1`` switches the result cache off (nothing read, nothing written).
:func:`verify` checks every piece (``cwcore cache verify [--repair]``).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import tempfile
import time
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Callable

import pandas as pd

__all__ = ["BASE_CODE", "CacheWarning", "NO_CACHE_ENV_VAR", "cache_root", "caching_disabled", "code_scope",
           "code_version", "parameters_key", "ResultCache", "atomic_write_bytes", "write_csv", "current_umask", "result_runs",
           "prune", "verify", "verify_piece"]

NO_CACHE_ENV_VAR = "CWCORE_NO_CACHE"
CHECKSUM_SUFFIX = ".sha256"  # <piece>.parquet.sha256: the hex sha256 of the piece's bytes
_TRUE = {"1", "true", "yes", "on"}
# temporary files of atomic writes older than this are left-overs of killed processes
ABANDONED_AFTER_SECONDS = 3600


class CacheWarning(UserWarning):
    """The cache was damaged or could not be written; the run goes on (recomputing, or uncached)."""


def caching_disabled() -> bool:
    """True when ``$CWCORE_NO_CACHE`` asks for uncached runs (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(NO_CACHE_ENV_VAR, "").strip().lower() in _TRUE


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


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; 0o022 where unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    The file gets the mode an ordinary ``open(path, "w")`` would give (0666 less the umask), not
    ``mkstemp``'s private 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), 0o666 & ~current_umask())
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_csv(frame: pd.DataFrame, path: str | os.PathLike, **to_csv) -> Path:
    """Write ``frame`` as CSV to ``path`` atomically (:func:`atomic_write_bytes`: a full disk or a killed
    process leaves the old file or none, never a partial one); ``to_csv`` as in :meth:`pandas.DataFrame.to_csv`."""
    path = Path(path)
    atomic_write_bytes(path, frame.to_csv(**to_csv).encode())
    return path


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def write_piece(path: Path, data: bytes) -> None:
    """Publish a piece: its checksum first, then the piece, each atomically. A process killed between
    the two leaves a checksum without a piece (a missing piece), never a piece without its checksum."""
    atomic_write_bytes(_checksum_path(path), (_sha256(data) + "\n").encode())
    atomic_write_bytes(path, data)


def _check_piece(path: Path, data: bytes) -> tuple[pd.DataFrame | None, str | None]:
    """``(frame, None)`` for a sound piece, ``(None, problem)`` otherwise."""
    try:
        expected = _checksum_path(path).read_text().strip()
    except FileNotFoundError:
        return None, "it has no checksum file"
    except (OSError, UnicodeDecodeError) as err:
        return None, f"its checksum file cannot be read ({err})"
    if _sha256(data) != expected:
        return None, f"its checksum does not match (truncated or overwritten: {len(data)} bytes)"
    try:
        return pd.read_parquet(io.BytesIO(data)), None
    except Exception as err:  # ArrowInvalid, OSError from pyarrow, ...
        return None, f"it is not a readable table ({type(err).__name__}: {err})"


def verify_piece(path: str | os.PathLike) -> str | None:
    """What is wrong with one cached piece (a sentence), or None when it reads and verifies."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    return _check_piece(path, data)[1]


def _discard_piece(path: Path) -> None:
    for file in (path, _checksum_path(path)):
        try:
            file.unlink(missing_ok=True)
        except OSError:
            pass


_unwritable: dict[str, str] = {}  # cache roots this process could not write to -> why (warned once each)


def _mark_unwritable(root: Path, error: OSError) -> None:
    key = str(root)
    if key in _unwritable:
        return
    reason = error.strerror or str(error)
    if error.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM):
        reason = {errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
                  errno.EDQUOT: "disk quota exceeded"}.get(error.errno, reason)
    _unwritable[key] = reason
    warnings.warn(f"cwcore: the result cache {root} cannot be written ({reason}); this run continues uncached: "
                  f"results are computed but not stored (set {NO_CACHE_ENV_VAR}=1 or pass cache=False / "
                  "--no-cache to run uncached without this warning)", CacheWarning, stacklevel=4)


class ResultCache:
    """Pieces of one run's results, as DataFrames.

    >>> cache = ResultCache("faithfulness", {"model": "smollm2-135m", "ratios": [0.1, 0.2]})
    >>> frame = cache.get_or_compute("batch-0", lambda: compute_batch(0))

    Each piece is checked when read (its sha256 against the checksum written with it, then parquet);
    a damaged piece is deleted with a :class:`CacheWarning`, so it is computed again. ``enabled=False``
    or ``$CWCORE_NO_CACHE=1``: nothing is read or written. A cache folder that cannot be written
    (read-only, full) makes :meth:`put` a no-op after one warning.
    """

    def __init__(self, namespace: str, parameters: dict, root: Path | None = None, enabled: bool = True,
                 code: str | tuple | list | None = None):
        self.parameters = parameters
        self.enabled = bool(enabled) and not caching_disabled()
        self.code = code_scope(code)
        self.root = Path(root) if root is not None else cache_root()
        self.directory = self.root / "results" / namespace / parameters_key(parameters, self.code)

    def _path(self, piece: str) -> Path:
        return self.directory / f"{piece}.parquet"

    def get(self, piece: str) -> pd.DataFrame | None:
        """The stored piece, or None if it was never completed (or was damaged: then it is deleted)."""
        if not self.enabled:
            return None
        path = self._path(piece)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            warnings.warn(f"cwcore: cached piece {path} cannot be read ({err.strerror or err}); computing it again",
                          CacheWarning, stacklevel=2)
            return None
        frame, problem = _check_piece(path, data)
        if problem is not None:
            _discard_piece(path)
            warnings.warn(f"cwcore: cached piece {path} was damaged ({problem}); deleted it, computing it again",
                          CacheWarning, stacklevel=2)
        return frame

    @property
    def writable(self) -> bool:
        """False once this process found the cache folder unwritable (then :meth:`put` stores nothing)."""
        return str(self.root) not in _unwritable

    def put(self, piece: str, frame: pd.DataFrame) -> None:
        if not self.enabled or not self.writable:
            return
        data = frame.to_parquet(index=False)
        try:
            if not (self.directory / "parameters.json").exists():
                text = json.dumps({"parameters": _canonical(self.parameters), "code": code_version(self.code),
                                   "code_scope": list(self.code)}, indent=1)
                atomic_write_bytes(self.directory / "parameters.json", text.encode())
            write_piece(self._path(piece), data)
        except OSError as err:  # read-only folder, full disk, ...: run on without the cache
            _mark_unwritable(self.root, err)

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
                     "pieces": sum(f.suffix == ".parquet" and not f.name.startswith(".") for f in files),
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
    doomed = runs if everything else runs[~runs["current"].astype(bool)]  # (an empty column is object-typed)
    doomed = doomed[doomed["modified"] < time.time() - min_age_seconds]
    if not dry_run:
        for path in doomed["path"]:
            shutil.rmtree(path, ignore_errors=True)
    return doomed.reset_index(drop=True)


def verify(root: Path | None = None, repair: bool = False) -> list[dict]:
    """Check every cached piece under ``<root>/results``: its checksum, then that it reads as a table.

    Returns one dict per problem: ``path``, ``problem`` (a sentence) and ``action`` (what ``repair``
    did, or would do). ``repair=True`` deletes damaged pieces (the next run computes them again),
    checksums without a piece and temporary files of killed writers older than an hour.
    Converted models are checked by :func:`cwcore.models.verify_models`.
    """
    base = (root or cache_root()) / "results"
    problems = []
    now = time.time()

    def report(path: Path, problem: str, remove: bool = True):
        action = ("deleted" if repair else "would delete") if remove else "left alone"
        if repair and remove:
            _discard_piece(path) if path.suffix == ".parquet" else path.unlink(missing_ok=True)
        problems.append({"path": str(path), "problem": problem, "action": action})

    for folder in sorted(base.glob("*/*")) if base.is_dir() else []:
        if not folder.is_dir():
            continue
        meta = folder / "parameters.json"
        try:
            json.loads(meta.read_text())
        except FileNotFoundError:
            pass  # no piece was ever completed here
        except (OSError, ValueError) as err:
            report(meta, f"the run's parameters.json is unreadable ({err}); `cwcore cache prune` removes the run",
                   remove=False)
        for path in sorted(folder.iterdir()):
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                try:
                    old = now - path.stat().st_mtime > ABANDONED_AFTER_SECONDS
                except OSError:
                    continue
                if old:
                    report(path, "a temporary file left by a killed writer")
            elif path.suffix == ".parquet":
                problem = verify_piece(path)
                if problem is not None:
                    report(path, problem)
            elif path.name.endswith(".parquet" + CHECKSUM_SUFFIX) and not path.with_name(
                    path.name[: -len(CHECKSUM_SUFFIX)]).exists():
                try:
                    old = now - path.stat().st_mtime > ABANDONED_AFTER_SECONDS
                except OSError:
                    continue
                if old:  # a writer between the checksum and the piece may be running right now
                    report(path, "a checksum without its piece (a killed writer)")
    return problems
