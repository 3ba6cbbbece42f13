"""The run driver every experiment uses: one model identity, content-named batches, cached pieces, ranks.

Each batch is named by its content (:func:`tensor_digest`); its pieces are read back from the result
cache when complete, else computed and stored (the parts first, a ``.done`` marker last), so an
interrupted run resumes and a longer run reuses the same first batches. :func:`model_fingerprint` (from
:mod:`cwcore.identity`) is the model's identity in every cache key.

**Ranks.** Sweeps map their batches through :func:`shard_map`. Under a ``torch.distributed`` launcher
(``WORLD_SIZE > 1``) rank r computes batches r, r + N, ... and the ranks exchange their results over a
gloo group, so every rank returns the complete result, bit for bit that of one process. With
``$CWCORE_JOBS=N`` and no launcher a sweep forks N-1 single-thread helper ranks on this machine that
join the same path. :func:`launch_info` says how the process was started."""

from __future__ import annotations

import contextlib
import contextvars
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import pandas as pd
import torch
from torch import nn

from .cache import ResultCache, caching_enabled
from .core.inputs import InputError, InputTypeError, check_batch_size, check_count, check_inputs  # the counts: one home, the core's inputs
from .identity import model_fingerprint, tensor_digest  # the identities: one home, cwcore.identity

__all__ = ["JOBS_ENV_VAR", "PROGRESS_FILE_ENV_VAR", "PieceStore", "check_batch_size", "check_count", "check_token_blocks", "for_each_batch",
           "is_main_rank", "launch_info", "local_jobs", "model_fingerprint", "progress", "shard_map", "tensor_digest",
           "world"]


def check_token_blocks(input_ids, model: nn.Module | None = None, *, argument: str = "input_ids",
                       caller: str = "the experiment") -> torch.Tensor:
    """Token blocks as a non-empty ``[sequence, token]`` integer tensor, inside ``model``'s vocabulary and
    context when a model is given (:func:`cwcore.core.inputs.check_inputs`)."""
    if model is not None:
        return check_inputs(model, {"input_ids": input_ids}, caller=caller)["input_ids"]
    ids = torch.as_tensor(input_ids)
    if ids.ndim != 2 or ids.numel() == 0:
        raise InputError(f"{caller}: {argument} must be a non-empty [sequence, token] block, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise InputTypeError(f"{caller}: {argument} must hold integer token ids, got {ids.dtype}")
    return ids


class PieceStore:
    """The cached pieces of one run (a :class:`cwcore.cache.ResultCache` folder).

    ``parameters``: every option that changes the result; ``model`` adds :func:`model_fingerprint`;
    ``code``: the producing module or subpackage whose code, with the base code, is in the key. Nothing is
    read or stored (nor the weights hashed) outside :func:`cwcore.cache.caching`, with ``cache=False`` or
    under ``$CWCORE_NO_CACHE=1``. A damaged part makes its batch incomplete, so it is computed again."""

    def __init__(self, namespace: str, parameters: Mapping, *, model: nn.Module | None = None,
                 code: str | tuple | list | None = None, cache: bool = True, cache_root: str | Path | None = None):
        parameters = dict(parameters)
        cache = bool(cache) and caching_enabled()
        if model is not None and cache:  # reading every weight byte costs ~0.3 s per 500 MB: only when caching
            parameters["model"] = model_fingerprint(model)
        self.namespace = namespace
        self.cache = ResultCache(namespace, parameters, root=None if cache_root is None else Path(cache_root),
                                 enabled=bool(cache), code=code)

    @property
    def parameters(self) -> dict:
        return self.cache.parameters

    @property
    def directory(self) -> Path:
        return self.cache.directory

    def get(self, piece: str) -> pd.DataFrame | None:
        """One stored piece, or None."""
        return self.cache.get(piece)

    def put(self, piece: str, frame: pd.DataFrame) -> None:
        self.cache.put(piece, frame)

    def get_group(self, key: str) -> dict[str, pd.DataFrame] | None:
        """The parts stored under ``key`` by :meth:`put_group`, or None unless all of them are complete."""
        index = self.cache.get(f"{key}.done")  # written last: the batch's parts are complete
        if index is None:
            return None
        frames = {part: self.cache.get(f"{key}.{part}") for part in index["part"]}
        return None if any(f is None for f in frames.values()) else frames

    def put_group(self, key: str, frames: Mapping[str, pd.DataFrame]) -> None:
        """Store ``frames`` under ``key``: every part, then the ``.done`` marker that lists them."""
        for part, frame in frames.items():
            self.cache.put(f"{key}.{part}", frame)
        self.cache.put(f"{key}.done", pd.DataFrame({"part": list(frames)}))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


#: a file the main rank writes its current bar to (``desc``, ``n``, ``total``, ``unit``, ``started``), for a
#: process that shows the progress of work it does not see, e.g. the book build of its notebooks' kernels
PROGRESS_FILE_ENV_VAR = "CWCORE_PROGRESS_FILE"


class _ReportedBar:
    """A bar (or the silent stand-in) that also writes its state to ``$CWCORE_PROGRESS_FILE``, atomically,
    at most once a second and when it closes."""

    def __init__(self, bar, path: str, total: int | None, desc: str, unit: str):
        import time

        self._bar, self._path, self._clock = bar, path, time.time
        self._state = {"desc": desc, "n": 0, "total": total, "unit": unit, "started": self._clock()}
        self._written = 0.0
        self._write(force=True)

    def _write(self, force: bool = False) -> None:
        import json

        from .cache import atomic_write_bytes

        now = self._clock()
        if force or now - self._written >= 1.0:
            self._written = now
            try:
                atomic_write_bytes(Path(self._path), json.dumps({**self._state, "updated": now}).encode())
            except OSError:  # progress is a courtesy: never fail a sweep over it
                pass

    def update(self, n: int = 1) -> None:
        self._bar.update(n)
        self._state["n"] += n
        self._write()

    def close(self) -> None:
        self._bar.close()
        self._write(force=True)

    def set_postfix_str(self, text: str) -> None:
        self._bar.set_postfix_str(text)


#: False inside :func:`bars_off`: a caller asked for no progress, so the bars of what it calls stay silent too
_BARS = contextvars.ContextVar("cwcore_bars", default=True)


@contextlib.contextmanager
def bars_off(off: bool = True):
    """Inside the block no :func:`progress` bar is drawn (``off``; a sweep called with ``progress=False``
    silences the bars of the methods it runs, such as value zeroing's)."""
    token = _BARS.set(False) if off else None
    try:
        yield
    finally:
        if token is not None:
            _BARS.reset(token)


def progress(total: int | None, desc: str, unit: str = "batch", enabled: bool = True, **kwargs):
    """A :mod:`tqdm.auto` bar, or a silent stand-in (``enabled`` False, or inside :func:`bars_off`); under
    ``$CWCORE_PROGRESS_FILE`` the main rank's bar is also written there (for the book build to show)."""
    if not is_main_rank():
        return _NoBar()
    bar = _NoBar()
    if enabled and _BARS.get():
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=desc, unit=unit, **kwargs)
    path = os.environ.get(PROGRESS_FILE_ENV_VAR, "").strip()
    return _ReportedBar(bar, path, total, desc, unit) if path else bar


def for_each_batch(
    batches: Iterable[Any],
    compute: Callable[[Any], Mapping[str, pd.DataFrame]],
    store: PieceStore,
    *,
    key: Callable[[Any], str] = tensor_digest,
    desc: str = "",
    total: int | None = None,
    show_progress: bool = True,
) -> Iterator[tuple[Any, dict[str, pd.DataFrame]]]:
    """For each batch, ``(batch, frames)``: read from ``store`` under ``key(batch)`` when complete, else
    ``compute(batch)`` (a dict of DataFrames) and stored; with ranks every rank yields every batch, in order."""
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)

    def one(batch) -> dict[str, pd.DataFrame]:
        name = key(batch)
        frames = store.get_group(name)
        if frames is None:
            frames = dict(compute(batch))
            store.put_group(name, frames)
        return frames

    if world() is not None or local_jobs() > 1:
        batches = list(batches)
        bar = progress(len(batches), desc or store.namespace, "batch", show_progress)
        try:
            results = shard_map(batches, one, progress=bar)
        finally:
            bar.close()
        yield from zip(batches, results)
        return
    bar = progress(total, desc or store.namespace, "batch", show_progress)
    try:
        for batch in batches:
            frames = one(batch)
            bar.update(1)
            yield batch, frames
    finally:
        bar.close()


# Ranks: one sweep's batches split over the processes of a torch.distributed group
#: ``N > 1``: sweeps run on N single-thread ranks of this machine (forked helpers) when no launcher is used
JOBS_ENV_VAR = "CWCORE_JOBS"
#: how long a rank waits for the others (a sweep's share can take hours): ``$CWCORE_RANK_TIMEOUT`` seconds
RANK_TIMEOUT_ENV_VAR = "CWCORE_RANK_TIMEOUT"
_DEFAULT_RANK_TIMEOUT = 24 * 3600

_inside_shard = False  # a sweep inside a sharded map runs whole on its rank (no nested sharding)
_object_group = None  # the gloo group results travel through (the default group may be nccl)


def _timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(RANK_TIMEOUT_ENV_VAR, _DEFAULT_RANK_TIMEOUT)))


#: how long forked ranks wait for each other to form their group: a rank that dies while it joins is named
#: after this, not after ``$CWCORE_RANK_TIMEOUT`` (the sweep's exchanges keep that one)
SETUP_TIMEOUT_SECONDS = 120.0


def _forked_group(rank: int, size: int, address: str):
    """Form the forked ranks' group (within :data:`SETUP_TIMEOUT_SECONDS`) and return a gloo group over it whose
    exchanges wait ``$CWCORE_RANK_TIMEOUT``."""
    import torch.distributed as dist

    setup = min(_timeout(), timedelta(seconds=SETUP_TIMEOUT_SECONDS))
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size, timeout=setup)
    return dist.new_group(backend="gloo", timeout=_timeout())


def local_jobs() -> int:
    """``$CWCORE_JOBS`` as an int (1 when unset): how many single-thread ranks a sweep forks here."""
    value = os.environ.get(JOBS_ENV_VAR, "").strip()
    if not value:
        return 1
    try:
        jobs = int(value)
    except ValueError:
        raise ValueError(f"${JOBS_ENV_VAR} must be a whole number of ranks, got {value!r}") from None
    if jobs < 1:
        raise ValueError(f"${JOBS_ENV_VAR} must be at least 1, got {jobs}")
    return jobs


def world() -> tuple[int, int] | None:
    """``(rank, world size)`` of this process's torch.distributed group, or None alone (or inside a sharded
    map). A launcher's environment starts the group on first use: gloo on CPU, nccl for CUDA tensors."""
    if _inside_shard:
        return None
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=_timeout())
    if dist.get_world_size() <= 1:
        return None
    return dist.get_rank(), dist.get_world_size()


def is_main_rank() -> bool:
    """True on rank 0 and when there are no ranks: the process that writes files and shows progress."""
    if _helper_rank:
        return False
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except (ImportError, RuntimeError):
        pass
    return int(os.environ.get("RANK", "0")) == 0


_helper_rank = False  # a forked helper of $CWCORE_JOBS (never the main rank)


def launch_info() -> dict:
    """How this process was started, for provenance: ``launcher`` (``torchrun``, ``accelerate``, ``slurm``,
    ``jobs`` for ``$CWCORE_JOBS``, ``single``), ``world_size``, ``rank``, ``backend`` and ``jobs``."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    size = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if initialized else int(os.environ.get("RANK", "0"))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = "torchrun"
    elif any(name.startswith("ACCELERATE_") for name in os.environ):
        launcher = "accelerate"
    elif "SLURM_JOB_ID" in os.environ and size > 1:
        launcher = "slurm"
    elif local_jobs() > 1:
        launcher, size = "jobs", local_jobs()
    else:
        launcher = "single"
    backend = str(dist.get_backend()) if initialized else ("gloo" if launcher == "jobs" else None)
    return {"launcher": launcher, "world_size": size, "rank": rank, "backend": backend, "jobs": local_jobs()}


class _Failure:
    """What a rank sends instead of its results when its share failed (the others raise it too)."""

    def __init__(self, rank: int, error: BaseException):
        self.rank = rank
        self.text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        self.error = error


def _work_signature(items: list) -> tuple:
    """What one map's items are, comparable across ranks: each item's digest where it has one, else its type."""
    return tuple(str(getattr(item, "digest", None) or type(item).__name__) for item in items)


class _RankLost(RuntimeError):
    """The exchange of results failed: another rank is gone (killed, or left without sending its share)."""


def _gather_map(items: list, compute: Callable, rank: int, size: int, group, bar) -> list:
    import torch.distributed as dist

    global _inside_shard
    _inside_shard = True
    work = _work_signature(items)
    mine: dict[int, Any] | _Failure = {}
    try:
        for i in range(rank, len(items), size):
            mine[i] = compute(items[i])
            bar.update(size if i + size <= len(items) else len(items) - i)
    except Exception as err:  # the other ranks must not wait for a share that never comes
        mine = _Failure(rank, err)
    finally:
        _inside_shard = False
    gathered: list = [None] * size
    try:
        dist.all_gather_object(gathered, (work, mine), group=group)
    except RuntimeError as err:  # gloo: "Connection closed by peer" when a rank died without a word
        raise _RankLost(str(err)) from err
    works = [part[0] for part in gathered]
    if any(other != work for other in works):  # before: the shares of two different maps merged without a word
        raise RuntimeError(
            "the ranks mapped different work in one exchange (" + "; ".join(
                f"rank {r}: {len(w)} items" for r, w in enumerate(works)) + "): every rank must call shard_map with "
            "the same items, so a choice made on one rank only (a file read before another rank wrote it) must be "
            "made once and shared")
    gathered = [part[1] for part in gathered]
    for part in gathered:
        if isinstance(part, _Failure):
            if part.rank == rank:
                raise part.error
            raise RuntimeError(f"rank {part.rank} of {size} failed in a sharded sweep:\n{part.text}")
    merged: dict[int, Any] = {}
    for part in gathered:
        merged.update(part)
    return [merged[i] for i in range(len(items))]


def _objects_group():
    """A gloo group over every rank (the default group itself when it is gloo)."""
    global _object_group
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    if _object_group is None:  # with the exchanges' timeout (torch's default for a new group is 30 minutes)
        _object_group = dist.new_group(backend="gloo", timeout=_timeout())
    return _object_group


def shard_map(items: Iterable[Any], compute: Callable[[Any], Any], *, progress=None) -> list:
    """``[compute(item) for item in items]`` split over ranks: rank r computes items r, r + N, ...; every rank
    returns the full list, in order. Every rank must call it with the same items; a failure raises on all."""
    items = list(items)
    bar = progress if progress is not None else _NoBar()
    ranks = world()
    if ranks is not None:
        return _gather_map(items, compute, *ranks, _objects_group(), bar)
    jobs = min(local_jobs(), len(items))
    if jobs > 1 and not _inside_shard:
        return _forked_map(items, compute, jobs, bar)
    out = []
    for item in items:
        out.append(compute(item))
        bar.update(1)
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """Ask Linux to kill this forked rank when its parent dies (a build killed with SIGKILL, a notebook kernel
    shut down): otherwise it would compute on, orphaned, holding a core. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _helper(rank: int, size: int, address: str, items: list, compute: Callable, joining=None) -> None:
    """A forked rank: join the group, compute its share, hand it over, leave without cleanup."""
    global _helper_rank
    import torch.distributed as dist

    status = 1
    try:
        _helper_rank = True
        _die_with_parent()
        torch.set_num_threads(1)
        try:  # bars inherited from the parent stay silent here
            from tqdm import tqdm

            for bar in list(getattr(tqdm, "_instances", ())):
                bar.disable = True
        except ImportError:
            pass
        if joining is not None:  # rank 0 waits for this before it waits for the group (a rank dead before is named)
            joining.set()
        group = _forked_group(rank, size, address)
        _gather_map(items, compute, rank, size, group, _NoBar())
        dist.destroy_process_group()
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        from .cache import flush_tally

        flush_tally()  # os._exit skips atexit: this rank's cache reads go to the build's provenance
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _dead_helpers(helpers, size: int) -> list[str]:
    """How each forked rank that is gone ended (``rank 1 of 2 was killed by SIGKILL``), waiting a little for
    its exit status; ``helpers``: ``(rank, process)`` pairs."""
    import signal

    dead = []
    for rank, helper in helpers:
        helper.join(timeout=5)
        code = helper.exitcode
        if code is None or code == 0:
            continue
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            how = f"was killed by {name}" + (" (out of memory, or killed from outside)" if -code == signal.SIGKILL else "")
        else:
            how = f"exited with status {code}"
        dead.append(f"rank {rank} of {size} {how}")
    return dead


def _await_helpers(helpers, joining) -> None:
    """Wait until every forked rank is about to join the group; one that is gone before is a one-sentence error
    (rank 0 would wait for it in the group's rendezvous for ``$CWCORE_RANK_TIMEOUT``, a day by default)."""
    import time

    while not all(event.is_set() for event in joining):
        gone = [(rank, helper) for rank, (helper, event) in enumerate(zip(helpers, joining), start=1)
                if not event.is_set() and not helper.is_alive()]
        if gone:
            raise RuntimeError(f"${JOBS_ENV_VAR}: {'; '.join(_dead_helpers(gone, len(helpers) + 1))} before it joined "
                               f"the sweep; run it again, or with fewer ranks (${JOBS_ENV_VAR}=1 runs in this process "
                               "alone)")
        time.sleep(0.01)


def _forked_map(items: list, compute: Callable, jobs: int, bar) -> list:
    """:func:`shard_map` over ``jobs`` ranks of this machine: this process is rank 0, the others are
    forked from it (they share its model and data), every rank single-threaded."""
    import multiprocessing

    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(f"${JOBS_ENV_VAR} forks CPU ranks and CUDA is initialised in this process; on GPUs "
                           "launch one process per GPU instead: torchrun --nproc-per-node N <script>")
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(f"${JOBS_ENV_VAR} cannot fork ranks inside a process group of one rank; unset it")
    address = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("fork")
    joining = [context.Event() for _ in range(1, jobs)]
    helpers = [context.Process(target=_helper, args=(rank, jobs, address, items, compute, joining[rank - 1]),
                               daemon=True) for rank in range(1, jobs)]
    for helper in helpers:
        helper.start()
    threads = torch.get_num_threads()
    joined = False
    try:
        torch.set_num_threads(1)
        _await_helpers(helpers, joining)
        try:
            group = _forked_group(0, jobs, address)
        except Exception as err:  # a rank that died while joining: named, after the set-up's timeout
            if dist.is_initialized():
                dist.destroy_process_group()
            dead = _dead_helpers(list(enumerate(helpers, start=1)), jobs)
            if not dead:
                raise
            raise RuntimeError(f"${JOBS_ENV_VAR}: {'; '.join(dead)} while the ranks formed their group; run it again, "
                               f"or with fewer ranks (${JOBS_ENV_VAR}=1 runs in this process alone)") from err
        joined = True
        try:
            return _gather_map(items, compute, 0, jobs, group, bar)
        finally:
            dist.destroy_process_group()
    except _RankLost as err:
        dead = _dead_helpers(list(enumerate(helpers, start=1)), jobs)
        if not dead:
            raise
        raise RuntimeError(f"${JOBS_ENV_VAR}: {'; '.join(dead)} during the sweep, so its share of the results never "
                           f"came back; run it again (finished cached pieces are kept), or with fewer ranks "
                           f"(${JOBS_ENV_VAR}=1 runs in this process alone)") from err
    finally:
        torch.set_num_threads(threads)
        for helper in helpers:
            if not joined and helper.is_alive():  # it waits for a group that never forms
                helper.kill()
            helper.join(timeout=60)
            if helper.is_alive():
                helper.kill()
