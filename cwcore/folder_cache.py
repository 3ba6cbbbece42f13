"""The folder cache: what is built once, such as a converted model (``<cache>/models/<name>``), built aside,
renamed into place, with a marker of every file's size and checksum.

:func:`ensure_cached_folder` returns the folder, building it first when it is missing, of another source or
damaged; :func:`verify_cached_folder` checks a folder's files against its marker (once per process while
they are unchanged); :func:`read_cache_marker` reads the marker. A folder that cannot be replaced (a
read-only cache) raises :class:`ModelCacheError`; a full disk builds into a temporary folder for this
process, with a :class:`~cwcore.cache.CacheWarning`. The result cache is :mod:`cwcore.cache`."""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from .cache import current_umask, warn_cache

__all__ = ["CACHE_FORMAT", "CACHE_MARKER", "FOLDER_ABANDONED_AFTER_SECONDS", "ModelCacheError", "disk_full",
           "ensure_cached_folder", "library_versions", "read_cache_marker", "verify_cached_folder"]

CACHE_MARKER = "cwcore-cache.json"
CACHE_FORMAT = 2  # 2: the marker lists every file with its size and checksum
# Temporary and displaced folders older than this are left-overs of killed processes.
FOLDER_ABANDONED_AFTER_SECONDS = 24 * 3600


class ModelCacheError(RuntimeError):
    """A converted model is damaged and could not be converted again (e.g. a read-only cache)."""




def read_cache_marker(folder: str | os.PathLike, source: dict | None = None) -> dict | None:
    """Return the marker of a completed cache folder, or None if it is missing, unreadable, of
    another cache format, or (when ``source`` is given) made from another source."""
    try:
        marker = json.loads((Path(folder) / CACHE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != CACHE_FORMAT:
        return None
    if source is not None and marker.get("source") != _json_roundtrip(source):
        return None
    return marker


def ensure_cached_folder(target: str | os.PathLike, source: dict,
                         build: Callable[[Path], dict | None], description: str | None = None) -> Path:
    """Return ``target``, first building it with ``build(tmp_folder)`` unless its marker names ``source`` (a
    JSON-able fingerprint of its inputs). ``build`` fills a fresh folder beside ``target`` and may return
    marker fields; the marker is written last and the folder renamed into place (another process's
    finished folder wins)."""
    target = Path(target)
    marker = read_cache_marker(target, source)
    damage = None
    if marker is not None:
        damage = verify_cached_folder(target, marker)
        if damage is None:
            return target
        warn_cache(f"cwcore: the converted model at {target} is damaged ({damage}); converting it again")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_folders(target)
        if damage is not None:
            _displace(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as err:
        if damage is not None:
            raise ModelCacheError(f"the converted model at {target} is damaged ({damage}) and cannot be replaced "
                                  f"({err.strerror or err}); delete the folder, or run `cwcore cache verify "
                                  "--repair` where the cache is writable") from None
        return _build_uncached(target, source, build, description, err)
    try:
        _build_into(tmp, target, source, build, description)
    except Exception as err:  # noqa: BLE001 - safetensors reports a full disk as its own SafetensorError
        if not disk_full(err):
            raise
        try:  # the promised fallback: a temporary folder for this process (another disk, often)
            return _build_uncached(target, source, build, description,
                                   OSError(errno.ENOSPC, "no space left on the device"))
        except Exception as again:  # noqa: BLE001
            if not disk_full(again):
                raise
            raise ModelCacheError(f"no space left on the device to convert {target.name}, neither in the cache "
                                  f"{target.parent} nor in the temporary folder {tempfile.gettempdir()}: free "
                                  "space there, or set CWCORE_CACHE (and TMPDIR) to a disk with room") from None
    return target


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a full disk or an exceeded quota, however a library words it
    (an OSError's errno; safetensors' ``SafetensorError`` carries only the operating system's message)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or "Disk quota exceeded" in text or "StorageFull" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


_uncached_builds: dict[str, Path] = {}  # target -> temporary folder, for caches this process cannot write


def _build_uncached(target: Path, source: dict, build, description, error: OSError) -> Path:
    """Convert into a temporary folder deleted at exit: the cache folder cannot be written."""
    import atexit

    known = _uncached_builds.get(str(target))
    if known is not None and read_cache_marker(known, source) is not None:
        return known
    warn_cache(f"cwcore: the model cache {target.parent} cannot be written ({error.strerror or error}); "
               f"converting {target.name} into a temporary folder for this process only")
    holder = Path(tempfile.mkdtemp(prefix="cwcore-model-"))
    atexit.register(shutil.rmtree, holder, True)
    tmp, final = holder / ".tmp", holder / target.name
    tmp.mkdir()
    _build_into(tmp, final, source, build, description)
    _uncached_builds[str(target)] = final
    return final


def _displace(target: Path) -> None:
    """Move a damaged folder aside atomically (a reader never sees half of it), then delete it."""
    displaced = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(target, displaced)
    except FileNotFoundError:
        return
    shutil.rmtree(displaced, ignore_errors=True)


def _build_into(tmp: Path, target: Path, source: dict, build, description) -> None:
    try:
        print(f"cwcore: converting {description or target.name} once, cached at {target}",
              file=sys.stderr, flush=True)
        started = time.perf_counter()
        extra = build(tmp)
        extra = extra if isinstance(extra, dict) else {}
        marker = {
            "format": CACHE_FORMAT,
            "source": source,
            **extra,
            "build_seconds": round(time.perf_counter() - started, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **library_versions(),
        }
        _apply_umask(tmp)  # mkdtemp makes a private 0700 folder; a cache follows the umask
        _fsync_tree(tmp)
        marker["checksum"] = _CHECKSUM
        marker["files"] = _file_checksums(tmp)
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _fsync_tree(tmp, only=CACHE_MARKER)
        _move_into_place(tmp, target, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(tmp: Path, target: Path, source: dict) -> None:
    for _ in range(10):
        try:
            os.rename(tmp, target)  # atomic; fails when target exists and is not an empty folder
            return
        except OSError as err:
            if not os.path.lexists(target) and err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if read_cache_marker(target, source) is not None:
            return  # another process finished first: keep its folder
        displaced = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(target, displaced)  # move the stale folder aside atomically, then delete it
        except FileNotFoundError:
            continue
        if displaced.is_dir():
            shutil.rmtree(displaced, ignore_errors=True)
        else:
            displaced.unlink(missing_ok=True)
    raise RuntimeError(f"could not move the new cache folder into place at {target}")


def _remove_abandoned_folders(target: Path) -> None:
    now = time.time()
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for path in target.parent.glob(pattern):
            try:
                if now - path.stat().st_mtime > FOLDER_ABANDONED_AFTER_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


_current_umask = current_umask


def _apply_umask(folder: Path) -> None:
    umask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        try:
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        except OSError:
            pass


try:
    import xxhash  # a dependency of datasets: 5x faster than sha256 (0.2 s against 1.0 s for 538 MB)

    _CHECKSUM = "xxh3_128"
    _new_hash = xxhash.xxh3_128
except ImportError:  # pragma: no cover
    _CHECKSUM = "sha256"
    _new_hash = hashlib.sha256


def _hash_file(path: Path, algorithm: str) -> str:
    if algorithm == _CHECKSUM:
        digest = _new_hash()
    elif algorithm == "xxh3_128":
        import xxhash

        digest = xxhash.xxh3_128()
    else:
        import hashlib

        digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_checksums(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "checksum": _hash_file(p, _CHECKSUM)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != CACHE_MARKER}


_verified: dict[str, tuple] = {}  # folder -> the stat of its files when this process last verified them


def _files_state(folder: Path, names) -> tuple:
    state = []
    for name in names:
        st = (folder / name).stat()
        state.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(state)


def verify_cached_folder(folder: str | os.PathLike, marker: dict | None = None) -> str | None:
    """What is wrong with a completed cache folder (a sentence), or None when every file its marker
    lists has its recorded size and checksum. Verified once per process; checked again when a file's
    size, time or inode changes."""
    folder = Path(folder)
    marker = read_cache_marker(folder) if marker is None else marker
    if marker is None:
        return f"it has no valid {CACHE_MARKER} (an interrupted conversion, or another cache format)"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return f"its {CACHE_MARKER} lists no checksums"
    algorithm = marker.get("checksum", "sha256")
    try:
        state = _files_state(folder, sorted(files))
    except FileNotFoundError as err:
        return f"{Path(err.filename).name} is missing"
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    if _verified.get(str(folder)) == state:
        return None
    for (name, size, _, _), expected in zip(state, (files[n] for n in sorted(files))):
        if size != expected.get("size"):
            return f"{name} has {size} bytes, {expected.get('size')} were written (truncated?)"
        try:
            actual = _hash_file(folder / name, algorithm)
        except (OSError, ValueError) as err:
            return f"{name} cannot be read ({err})"
        if actual != expected.get("checksum"):
            return f"{name} does not match its checksum (overwritten in place?)"
    _verified[str(folder)] = state
    return None


def _fsync_tree(folder: Path, only: str | None = None) -> None:
    paths = [folder / only] if only else [p for p in folder.rglob("*") if p.is_file()]
    for path in paths:
        try:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        except OSError:
            pass


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def library_versions() -> dict:
    """``{"<package>_version": version}`` of transformers, torch and gguf where installed: what a converted
    model (and a remembered check of committed evidence) was made with."""
    versions = {}
    for dist in ("transformers", "torch", "gguf"):
        try:
            versions[f"{dist}_version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions
