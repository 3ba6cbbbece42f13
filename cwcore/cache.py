"""A result cache for long runs: keyed by every parameter, written incrementally and atomically.

Each run (one set of parameters) owns ``<cache>/results/<namespace>/<key>``; its pieces (a batch, a
ratio, ...) are separate parquet files, each written to a temporary file and renamed into place, so
an interrupted run resumes. The key hashes the parameters and the producing code
(:mod:`cwcore.code_keys`): editing a figure, the book runner or the command line reuses every number.

A cache cannot silently go wrong: each piece has a checksum (``<piece>.parquet.sha256``, published
before the piece) over its place (namespace, key, name) and its bytes, so a piece copied under
another key is refused; a piece that fails to read or verify is deleted and computed again with a
:class:`CacheWarning`. A cache that cannot be written or read turns into an uncached run with one
warning per folder and process. Caching is opt-in (:func:`caching`); :func:`verify` checks every piece.

The cache deletes only what it wrote: a run folder is cwcore's when its ``parameters.json`` carries
:data:`RUN_MARKER` with the folder's own key; :func:`prune` and :func:`verify` skip every other
folder and touch only the files the cache writes.

The folder cache of converted models is :mod:`cwcore.folder_cache`."""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Callable

import pandas as pd
import pyarrow as pa

from .cache_switch import (_TRUE, CACHING_ENV_VAR, NO_CACHE_ENV_VAR, active_cache_root, cache_root,  # noqa: F401
                           caching, caching_disabled, caching_enabled)
from .code_keys import (BASE_CODE, NOT_PRODUCING, code_files, code_scope, code_version,  # noqa: F401
                        normalised_source)

__all__ = ["BASE_CODE", "CacheWarning", "CACHING_ENV_VAR", "NO_CACHE_ENV_VAR", "active_cache_root", "caching", "caching_enabled", "NOT_PRODUCING", "cache_root", "caching_disabled", "code_scope",
           "code_files", "code_version", "normalised_source", "parameters_key", "ResultCache", "atomic_write_bytes", "write_csv", "current_umask", "result_runs",
           "prune", "verify", "verify_piece", "CacheTally", "counting"]

CHECKSUM_SUFFIX = ".sha256"  # <piece>.parquet.sha256: the hex sha256 of the piece's bytes
# temporary files of atomic writes older than this are left-overs of killed processes
ABANDONED_AFTER_SECONDS = 3600
#: the file of a run folder every process using the run holds a shared lock on (``flock``), which
#: :func:`prune` asks for exclusively: a run in use is never deleted, however long its piece takes
IN_USE = ".in-use"

#: at most this many runs held at once by one process (each holds a file descriptor); beyond it, prune's age
#: rule alone protects a run
MAX_HELD_RUNS = 256
_HELD: "weakref.WeakSet[ResultCache]" = weakref.WeakSet()

try:
    import fcntl
except ImportError:  # not POSIX: no locks, prune's age rule alone protects a run in use
    fcntl = None


class CacheWarning(UserWarning):
    """The cache was damaged or could not be written, or a result cannot be cached; the run goes on
    (recomputing, or uncached). Each points at the user's line that led to it (:func:`user_stacklevel`)."""


def _skipped_folders() -> tuple[str, ...]:
    """cwcore's folder, the standard library's and those of the libraries that call back into cwcore (torch
    runs hooks and forwards, transformers its models, pandas and numpy callbacks)."""
    import sysconfig

    folders = [Path(__file__).resolve().parent, Path(sysconfig.get_paths()["stdlib"]).resolve()]
    for name in ("torch", "transformers", "pandas", "numpy"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            folders.append(Path(module.__file__).resolve().parent)
    return tuple(f"{folder}{os.sep}" for folder in folders)


def user_stacklevel() -> int:
    """The ``stacklevel`` with which a warning issued by the caller of this function names the first frame
    outside cwcore, the standard library, torch, transformers, pandas and numpy: the user's own line (a
    notebook cell, a script), which the default filter then shows once per line. 1 (the warning's own line)
    where every frame is inside them, as in a rank's thread or under ``python -m cwcore``."""
    skipped = _skipped_folders()
    frame, level = sys._getframe(1), 1
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(skipped) or filename.startswith("<frozen ")):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def warn_cache(message: str) -> None:
    """Issue ``message`` as a :class:`CacheWarning` at the user's line (:func:`user_stacklevel`)."""
    warnings.warn(message, CacheWarning, stacklevel=user_stacklevel())


def _canonical(value):
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_canonical(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # torch dtypes, paths, ...


#: what a model or metric cwcore cannot fingerprint gets instead of a key (:func:`never_cached_identity`)
_NEVER_CACHED = re.compile(r"uncached-[0-9a-f]{16}")


def never_cached_identity() -> str:
    """An identity no later call repeats, for a model or metric whose state cwcore cannot fingerprint: a run
    whose parameters hold one reads and writes no piece (each would be stored under a key never asked again)."""
    import uuid

    return "uncached-" + uuid.uuid4().hex[:16]


def never_cached(parameters: dict) -> bool:
    """Whether ``parameters`` hold a :func:`never_cached_identity` (a piece whose name holds one is skipped
    alone: a run's other pieces, e.g. the clean scores beside a metric's, stay cached)."""
    return bool(_NEVER_CACHED.search(json.dumps(_canonical(parameters), sort_keys=True)))


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
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename, with the mode an
    ordinary ``open(path, "w")`` gives (not ``mkstemp``'s 0600)."""
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


def piece_checksum(path: str | os.PathLike, data: bytes) -> str:
    """The checksum of a piece at ``path`` (``<root>/results/<namespace>/<key>/<piece>.parquet``) holding
    ``data``: the sha256 of its place (namespace, key and piece name) and its bytes, so the same bytes
    under another key or name do not verify."""
    path = Path(path)
    place = f"cwcore-piece:{path.parent.parent.name}/{path.parent.name}/{path.name}\n".encode()
    return _sha256(place + data)


def write_piece(path: Path, data: bytes) -> None:
    """Publish a piece: its checksum first, then the piece, each atomically. A process killed between
    the two leaves a checksum without a piece (a missing piece), never a piece without its checksum."""
    atomic_write_bytes(_checksum_path(path), (piece_checksum(path, data) + "\n").encode())
    atomic_write_bytes(path, data)


def _check_piece(path: Path, data: bytes) -> tuple[pd.DataFrame | None, str | None]:
    """``(frame, None)`` for a sound piece, ``(None, problem)`` otherwise."""
    try:
        expected = _checksum_path(path).read_text().strip()
    except FileNotFoundError:
        return None, "it has no checksum file"
    except (OSError, UnicodeDecodeError) as err:
        return None, f"its checksum file cannot be read ({err})"
    if piece_checksum(path, data) != expected:
        return None, (f"its checksum does not match (truncated, overwritten, or copied from another key or piece: "
                      f"{len(data)} bytes)")
    try:
        # read from an Arrow buffer on this thread: pyarrow's readers of a Python file object leave
        # threads that abort the interpreter at exit now and then (apache/arrow#34314; measured here with
        # pyarrow 26: 7 of 150 processes reading one piece from io.BytesIO ended with SIGABRT, 0 of 150 so)
        return pd.read_parquet(pa.BufferReader(data), use_threads=False, pre_buffer=False), None
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


def _discard_piece(path: Path) -> str | None:
    """Delete a piece and its checksum; why one of them could not be deleted (a read-only cache), or None."""
    failure = None
    for file in (path, _checksum_path(path)):
        failure = _unlink(file) or failure
    return failure


def _unlink(path: Path) -> str | None:
    """Delete ``path`` (gone already is fine); why it could not be, or None."""
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        return err.strerror or str(err)
    return None


_unwritable: dict[str, str] = {}  # cache roots this process could not write to -> why (warned once each)
_unreadable: dict[str, str] = {}  # cache roots this process could not read from -> why (warned once each)


def _warn_unreadable(root: Path, path: Path, error: OSError) -> None:
    """One warning per cache root and process for pieces that cannot be read (a sweep reads many)."""
    key = str(root)
    if key in _unreadable:
        return
    _unreadable[key] = error.strerror or str(error)
    fix = {errno.ENOTDIR: "a file stands where the cache's folder or one inside it should be: point caching() or "
                          "$CWCORE_CACHE at a folder",
           errno.EISDIR: f"a folder stands where the piece {path.name} should be: delete it"}.get(
        error.errno, "fix the folder's permissions")
    warn_cache(f"cwcore: the result cache {root} cannot be read ({error.strerror or error}: {path.name}); "
               f"its pieces are computed again ({fix}, or set {NO_CACHE_ENV_VAR}=1)")


def _mark_unwritable(root: Path, error: OSError) -> None:
    key = str(root)
    if key in _unwritable:
        return
    reason = error.strerror or str(error)
    if key in _unreadable:  # warned already: one warning for a cache that can be neither read nor written
        _unwritable[key] = reason
        return
    if error.errno in (errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM):
        reason = {errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the device",
                  errno.EDQUOT: "disk quota exceeded"}.get(error.errno, reason)
    _unwritable[key] = reason
    warn_cache(f"cwcore: the result cache {root} cannot be written ({reason}); this run continues uncached: "
               f"results are computed but not stored (set {NO_CACHE_ENV_VAR}=1, run outside cwcore.cache.caching() "
               "or pass --no-cache to run uncached without this warning)")


class CacheTally:
    """Result-cache reads counted while :func:`counting` is active: ``hits``, ``misses`` and the
    ``folders`` read (``<namespace>/<key>``); with ``require``, a miss raises :class:`LookupError`
    before anything is computed."""

    def __init__(self, require: bool = False):
        self.require, self.hits, self.misses, self.folders = require, 0, 0, set()

    def record(self, cache: "ResultCache", piece: str, frame) -> None:
        self.folders.add(f"{cache.directory.parent.name}/{cache.directory.name}")
        if frame is None:
            self.misses += 1
            if self.require:
                raise LookupError(f"piece {piece} is not in {cache.directory} (a run that requires cached results)")
        else:
            self.hits += 1


_TALLIES: list[CacheTally] = []

#: a folder: every process that reads the result cache writes its count there (``tally-<pid>.json``,
#: ``{"pid", "hits", "misses"}``), so a build of many processes (notebook kernels, ranks) can be summed
TALLY_ENV_VAR = "CWCORE_CACHE_TALLY"
_FLUSH_EVERY_S = 10.0


class _ProcessTally(CacheTally):
    """This process's reads, written to ``$CWCORE_CACHE_TALLY`` now and then, at exit, and by a forked
    rank before it leaves (:func:`flush_tally`); a forked child starts from zero (its own file)."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.flushed = folder, 0.0

    def record(self, cache, piece, frame) -> None:
        super().record(cache, piece, frame)
        if time.monotonic() - self.flushed > _FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self.flushed = time.monotonic()
        data = json.dumps({"pid": os.getpid(), "hits": self.hits, "misses": self.misses}).encode()
        try:
            atomic_write_bytes(self.folder / f"tally-{os.getpid()}.json", data)
        except OSError:  # provenance only: never fail a run for it
            pass


_process_tally: _ProcessTally | None = None


def _start_process_tally() -> None:
    global _process_tally
    folder = os.environ.get(TALLY_ENV_VAR, "").strip()
    if folder and _process_tally is None:
        _process_tally = _ProcessTally(Path(folder))
        _TALLIES.append(_process_tally)


def _restart_process_tally_in_child() -> None:
    global _process_tally
    if _process_tally is not None:
        _TALLIES.remove(_process_tally)
        _process_tally = None
        _start_process_tally()


def _stop_process_tally() -> None:
    global _process_tally
    if _process_tally is not None:
        _TALLIES.remove(_process_tally)
        _process_tally = None


def flush_tally() -> None:
    """Write this process's ``$CWCORE_CACHE_TALLY`` count now (a process leaving by ``os._exit``)."""
    if _process_tally is not None:
        _process_tally.flush()


def read_tallies(folder: str | os.PathLike) -> dict:
    """``{"hits", "misses", "processes"}`` summed over the ``tally-*.json`` files in ``folder``."""
    total = {"hits": 0, "misses": 0, "processes": 0}
    for path in sorted(Path(folder).glob("tally-*.json")):
        try:
            count = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        total["hits"] += int(count["hits"])
        total["misses"] += int(count["misses"])
        total["processes"] += 1
    return total


_start_process_tally()
atexit.register(flush_tally)
os.register_at_fork(after_in_child=_restart_process_tally_in_child)


@contextlib.contextmanager
def counting(require: bool = False):
    """Count every :class:`ResultCache` read in this block (all caches, however deep they are made)::

        with counting(require=True) as tally:
            run()
        tally.hits, tally.misses
    """
    tally = CacheTally(require)
    _TALLIES.append(tally)
    try:
        yield tally
    finally:
        _TALLIES.remove(tally)


class ResultCache:
    """Pieces of one run's results, as DataFrames.

    >>> cache = ResultCache("faithfulness", {"model": "smollm2-135m", "ratios": [0.1, 0.2]})
    >>> frame = cache.get_or_compute("batch-0", lambda: compute_batch(0))

    Each piece is verified when read; a damaged one is deleted with a :class:`CacheWarning`. Nothing is
    read or written outside :func:`caching`, with ``enabled=False`` or under ``$CWCORE_NO_CACHE=1``;
    ``root`` defaults to the block's folder. An unwritable folder makes :meth:`put` a no-op after one warning."""

    def __init__(self, namespace: str, parameters: dict, root: Path | None = None, enabled: bool = True,
                 code: str | tuple | list | None = None):
        self.parameters = parameters
        # a model or metric without a stable identity: its pieces would pile up under keys never asked again
        self.enabled = bool(enabled) and caching_enabled() and not never_cached(parameters)
        self.code = code_scope(code)
        self.root = Path(root) if root is not None else active_cache_root()
        self.directory = self.root / "results" / namespace / parameters_key(parameters, self.code)
        self.hits = 0  # reads that found their piece (get), and those that did not
        self.misses = 0
        self._recorded = False  # this run folder's parameters.json was found sound, or written, by this object
        self._in_use = None  # the descriptor of this run's IN_USE file while this object holds its shared lock

    def _hold(self) -> None:
        """Hold a shared lock on this run folder's :data:`IN_USE` file while this object lives (released when
        it is collected, or the process ends): :func:`prune` leaves a locked run alone."""
        if self._in_use is not None or fcntl is None or len(_HELD) >= MAX_HELD_RUNS:
            return
        try:
            descriptor = os.open(self.directory / IN_USE, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # a read-only cache (never pruned by this user), or the folder is gone
            return
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # being pruned right now (its pieces are going: computed again), or no locks here
            os.close(descriptor)
            return
        self._in_use = descriptor
        _HELD.add(self)
        self._unlock = weakref.finalize(self, os.close, descriptor)

    def release(self) -> None:
        """Say this object is done with its run: its :data:`IN_USE` lock goes now, not when it is collected (a
        later read or write takes it again)."""
        if self._in_use is not None:
            self._unlock()
            self._in_use = None
            _HELD.discard(self)

    def _path(self, piece: str) -> Path:
        return self.directory / f"{piece}.parquet"

    def get(self, piece: str) -> pd.DataFrame | None:
        """The stored piece, or None if it was never completed (or was damaged: then it is deleted).
        Counted: this cache's ``hits`` / ``misses``, and every active :func:`counting` tally."""
        frame = self._read(piece)
        if frame is None:
            self.misses += 1
        else:
            self.hits += 1
        for tally in tuple(_TALLIES):
            tally.record(self, piece, frame)
        return frame

    def _read(self, piece: str) -> pd.DataFrame | None:
        if not self.enabled or _NEVER_CACHED.search(piece):
            return None
        path = self._path(piece)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            _warn_unreadable(self.root, path, err)
            return None
        self._hold()
        frame, problem = _check_piece(path, data)
        if problem is not None:
            failure = _discard_piece(path)
            done = "deleted it" if failure is None else f"could not delete it ({failure})"
            warn_cache(f"cwcore: cached piece {path} was damaged ({problem}); {done}, computing it again")
        return frame

    @property
    def writable(self) -> bool:
        """False once this process found the cache folder unwritable (then :meth:`put` stores nothing)."""
        return str(self.root) not in _unwritable

    def put(self, piece: str, frame: pd.DataFrame) -> None:
        if not self.enabled or not self.writable or _NEVER_CACHED.search(piece):  # a key no later call asks for
            return
        data = frame.to_parquet(index=False)
        try:
            record = self.directory / "parameters.json"
            if not record.exists() or (not self._recorded and run_record(self.directory) is None):  # or damaged
                text = json.dumps({RUN_MARKER: RUN_FORMAT, "key": self.directory.name,
                                   "parameters": _canonical(self.parameters), "code": code_version(self.code),
                                   "code_scope": list(self.code)}, indent=1)
                atomic_write_bytes(self.directory / "parameters.json", text.encode())
            self._recorded = True
            self._hold()
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
        stored = run_record(folder)
        if stored is None:  # not a folder the cache wrote: never listed, never deleted
            continue
        try:
            code = stored.get("code")
            scope = stored.get("code_scope")  # absent in runs written before scopes existed: whole package
            current = code_version(None if scope is None else tuple(scope))
        except (OSError, ValueError, TypeError):
            code = current = None  # no piece was ever completed here, the file is unreadable, or its scope gone
        files = {f: f.stat() for f in folder.iterdir() if f.is_file() and _written_by_cache(f)}  # one stat per file
        rows.append({"namespace": folder.parent.name, "key": folder.name, "current": code is not None and code == current,
                     "pieces": sum(f.suffix == ".parquet" and not f.name.startswith(".") for f in files),
                     "bytes": sum(st.st_size for st in files.values()),
                     "modified": max([st.st_mtime for st in files.values()], default=folder.stat().st_mtime),
                     "path": str(folder)})
    return pd.DataFrame(rows, columns=["namespace", "key", "current", "pieces", "bytes", "modified", "path"])


def prune(root: Path | None = None, everything: bool = False, dry_run: bool = False,
          min_age_seconds: float = 60.0) -> pd.DataFrame:
    """Delete cached runs no installed code can read (other versions of cwcore; ``everything=True``: all),
    except those touched in the last ``min_age_seconds`` and those a process is using (it holds the run's
    :data:`IN_USE` lock, however long its current piece takes); converted models are never touched. Returns
    the rows of :func:`result_runs` deleted (``dry_run``: that would be); ``.attrs["in_use"]`` counts the runs
    spared because a process holds them."""
    runs = result_runs(root)
    doomed = runs if everything else runs[~runs["current"].astype(bool)]  # (an empty column is object-typed)
    doomed = doomed[doomed["modified"] < time.time() - min_age_seconds]
    removed, in_use = [], 0
    for index, path in doomed["path"].items():
        with _unused(Path(path)) as unused:
            if unused:
                removed.append(index)
                if not dry_run:
                    _remove_run(Path(path))
            else:
                in_use += 1
    gone = doomed.loc[removed].reset_index(drop=True)
    gone.attrs["in_use"] = in_use
    return gone


@contextlib.contextmanager
def _unused(folder: Path):
    """Yields whether no process uses the run ``folder`` (none holds its :data:`IN_USE` lock), holding the lock
    exclusively meanwhile, so that no process starts using it while it is deleted."""
    if fcntl is None or not (folder / IN_USE).is_file():
        yield True
        return
    try:
        descriptor = os.open(folder / IN_USE, os.O_RDONLY)
    except OSError:  # gone meanwhile, or unreadable: nobody holds it
        yield True
        return
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a process holds it
            yield False
            return
        except OSError:  # a file system without locks (some NFS): the age rule alone decides
            pass
        yield True
    finally:
        os.close(descriptor)


#: the field of a run folder's ``parameters.json`` that marks the folder as the result cache's
RUN_MARKER = "cwcore_result_run"
RUN_FORMAT = 1


def run_record(folder: Path) -> dict | None:
    """The ``parameters.json`` of a run folder the result cache wrote (:data:`RUN_MARKER`, naming this
    folder's key), or None for any other folder, whose files the cache never touches."""
    try:
        stored = json.loads((folder / "parameters.json").read_text()) if not folder.is_symlink() else None
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get(RUN_MARKER) != RUN_FORMAT or stored.get("key") != folder.name:
        return None
    return stored


#: the temporary files :func:`atomic_write_bytes` leaves in a run folder when killed: ``.<file>.<random>.tmp`` of
#: a piece, a checksum or ``parameters.json`` (another ``.<name>.tmp`` is someone else's and is left alone)
_TEMPORARY_NAME = re.compile(r"\.(?:parameters\.json|.+\.parquet(?:\.sha256)?)\.[A-Za-z0-9_]+\.tmp")


def _cache_temporary(name: str) -> bool:
    """Whether ``name`` is a temporary file of the cache's own atomic writes in a run folder."""
    return _TEMPORARY_NAME.fullmatch(name) is not None


def _damaged_run_record(folder: Path) -> bool:
    """A folder named like a run's key (20 hex digits) whose ``parameters.json`` does not read as its run record:
    most likely the cache's own, damaged (its files are still left alone: it may be someone else's)."""
    record = folder / "parameters.json"
    return (re.fullmatch(r"[0-9a-f]{20}", folder.name) is not None and not folder.is_symlink() and record.is_file()
            and run_record(folder) is None)


def _written_by_cache(path: Path) -> bool:
    """A name the cache writes in a run folder: a piece with its checksum (the cache writes the checksum first,
    so a piece without one is not its), a checksum, a temporary file, ``parameters.json``, the :data:`IN_USE`
    lock file."""
    name = path.name
    if name.endswith(".parquet"):
        return _checksum_path(path).exists()
    return name in ("parameters.json", IN_USE) or name.endswith(".parquet" + CHECKSUM_SUFFIX) or _cache_temporary(name)


def _remove_run(folder: Path) -> None:
    """Delete the cache's files of one run folder, then the folder if nothing else is left in it."""
    ours = [path for path in folder.iterdir()  # chosen before any is deleted: a piece is the cache's by its checksum
            if path.is_file() and not path.is_symlink() and _written_by_cache(path) and path.name != "parameters.json"]
    for path in ours:
        path.unlink(missing_ok=True)
    (folder / "parameters.json").unlink(missing_ok=True)  # last: a half-removed run is still marked as ours
    with contextlib.suppress(OSError):  # a file the cache did not write is in it: left alone
        folder.rmdir()


def verify(root: Path | None = None, repair: bool = False) -> list[dict]:
    """Check every piece of the cache's own run folders: its checksum, then that it reads as a table. One
    dict per problem (``path``, ``problem``, ``action``); ``repair=True`` deletes damaged pieces, orphan
    checksums and hour-old temporary files. Converted models: :func:`cwcore.models.verify_models`."""
    base = (root or cache_root()) / "results"
    problems = []
    now = time.time()

    def report(path: Path, problem: str, remove: bool = True):
        action = ("deleted" if repair else "would delete") if remove else "left alone"
        if repair and remove:
            failure = _discard_piece(path) if path.suffix == ".parquet" else _unlink(path)
            if failure is not None:  # a read-only cache: the damage stays, and is reported as unrepaired
                action = f"could not delete: {failure}"
        problems.append({"path": str(path), "problem": problem, "action": action})

    for folder in sorted(base.glob("*/*")) if base.is_dir() else []:
        if run_record(folder) is None:  # not a run folder the cache wrote: nothing in it is checked or deleted
            if _damaged_run_record(folder):
                problems.append({"path": str(folder / "parameters.json"), "problem": (
                    "not a run record the cache can read (damaged?): the folder's pieces are not checked and it is "
                    "never pruned; delete the folder if it is the cache's"), "action": "left alone"})
            continue
        for path in sorted(folder.iterdir()):
            if path.is_symlink() or not path.is_file():
                continue
            if _cache_temporary(path.name):
                try:
                    old = now - path.stat().st_mtime > ABANDONED_AFTER_SECONDS
                except OSError:
                    continue
                if old:
                    report(path, "a temporary file left by a killed writer")
            elif path.suffix == ".parquet" and not _written_by_cache(path):
                problems.append({"path": str(path), "problem": "no checksum file: not a piece the cache wrote (it "
                                 "writes the checksum first)", "action": "left alone"})
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
