"""Per-thread state of cwcore's attention sessions, and the per-model locks that serialise threads on one model,
apart from the session code so that the architecture facts (whose probe passes must stay invisible to an active
session) and the faithfulness sweeps can use them without an import cycle."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from torch import nn

# Sessions are per thread: two threads decomposing two models do not see each other's session.
LOCAL = threading.local()


@contextlib.contextmanager
def outside_sessions(model: nn.Module | None = None) -> Iterator[None]:
    """Inside the block, this thread's forward passes of ``model`` (None: of every model) are invisible to its active
    sessions (their hooks and attention points do nothing; attention is the model's own): for a probe pass run from
    inside a session. Another model's session, started meanwhile (by a user's hook), sees its own passes."""
    previous = getattr(LOCAL, "outside", frozenset())
    LOCAL.outside = None if model is None or previous is None else previous | {id(m) for m in model.modules()}
    try:
        yield
    finally:
        LOCAL.outside = previous


def outside(module: nn.Module | None = None) -> bool:
    """Whether this thread's forward passes through ``module`` are inside :func:`outside_sessions` (of its model, or
    of every model; ``module`` None: of every model only)."""
    current = getattr(LOCAL, "outside", frozenset())
    return current is None or (module is not None and id(module) in current)


# A model's attention implementation is switched under a lock per config object, so that two threads on one model
# serialise (the implementation is a setting of the model, not of the thread).
_LOCKS: dict[int, threading.RLock] = {}
_LOCKS_GUARD = threading.Lock()
#: id(config) -> the implementation it had before a session switched it to cwcore's (for forwards no session sees)
SWITCHED: dict[int, str | None] = {}


def attention_configs(model: nn.Module) -> list:
    """The config objects of ``model`` that hold an attention implementation (a composite model has several)."""
    seen, configs = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            configs.append(config)
    return configs


@contextlib.contextmanager
def holding(model: nn.Module, configs: list | None = None) -> Iterator[None]:
    """Hold ``model``'s locks inside the block (re-entrant; taken in one fixed order): what a cwcore call that runs
    the model with hooks or patched layers of its own must do, so that another thread's session on the same model
    waits instead of seeing them. A model's locks are taken in one fixed order, so one call never deadlocks another;
    calls nested crosswise (a hook in thread 1's call on A calling B while thread 2's call on B calls A) wait on each
    other forever, as any two locks taken in opposite orders do: nest cwcore calls in one thread only. ``configs``:
    the model's :func:`attention_configs`, where the caller has them already."""
    with _LOCKS_GUARD:
        configs = sorted(attention_configs(model) if configs is None else configs, key=id)
        locks = [_LOCKS.setdefault(id(config), threading.RLock()) for config in configs]
    with contextlib.ExitStack() as held:
        for lock in locks:
            held.enter_context(lock)
        yield
