"""Whether results are cached now: caching is opt-in, around any call (:func:`caching`)."""

from __future__ import annotations

import contextlib
import contextvars
import os
from pathlib import Path

__all__ = ["CACHING_ENV_VAR", "NO_CACHE_ENV_VAR", "active_cache_root", "cache_root", "caching", "caching_disabled",
           "caching_enabled"]

NO_CACHE_ENV_VAR = "CWCORE_NO_CACHE"
_TRUE = {"1", "true", "yes", "on"}


def caching_disabled() -> bool:
    """True when ``$CWCORE_NO_CACHE`` asks for uncached runs (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(NO_CACHE_ENV_VAR, "").strip().lower() in _TRUE


def cache_root() -> Path:
    """Root of cwcore's caches: ``$CWCORE_CACHE`` or ``~/.cache/cwcore``."""
    configured = os.environ.get("CWCORE_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "cwcore"


#: ``1`` (``true``, ``yes``, ``on``): this process caches results as if every call ran inside :func:`caching`
CACHING_ENV_VAR = "CWCORE_CACHING"
#: the innermost :func:`caching` block: ``(on, root or None)``; unset outside every block
_CACHING: contextvars.ContextVar[tuple[bool, Path | None]] = contextvars.ContextVar("cwcore_caching")


@contextlib.contextmanager
def caching(root: str | os.PathLike | None = None, *, enabled: bool = True):
    """Cache the results of the calls in this block (opt-in; outside every block nothing is read or written)::

        with cwcore.cache.caching():            # under $CWCORE_CACHE, or ~/.cache/cwcore
            curve = faithfulness_curve(model, tokenizer, texts)
        with cwcore.cache.caching("runs/cache"):  # under a folder of one's own
            ...

    A piece's key holds every parameter, every weight byte, the model's settings (its configuration, a
    norm's epsilon) and the code it runs besides its classes' own (forward hooks, a replaced ``forward``:
    :func:`cwcore.identity.model_fingerprint`; a hook marked ``cwcore_observer = True`` is left out) and the
    producing code (:func:`code_version`).
    ``enabled=False`` switches caching off inside a block; ``$CWCORE_NO_CACHE=1`` everywhere;
    ``$CWCORE_CACHING=1`` turns it on for a process. Blocks nest; each thread and asyncio task sees its own."""
    token = _CACHING.set((bool(enabled), None if root is None else Path(root).expanduser()))
    try:
        yield
    finally:
        _CACHING.reset(token)


def caching_enabled() -> bool:
    """Whether a cached computation started now reads and writes the result cache: inside a
    :func:`caching` block (or under ``$CWCORE_CACHING=1`` outside every block), unless
    ``$CWCORE_NO_CACHE`` is set."""
    if caching_disabled():
        return False
    chosen = _CACHING.get(None)
    if chosen is None:
        return os.environ.get(CACHING_ENV_VAR, "").strip().lower() in _TRUE
    return chosen[0]


def active_cache_root() -> Path:
    """The folder cached computations use now: the innermost :func:`caching` block's ``root``, else
    :func:`cache_root`."""
    chosen = _CACHING.get(None)
    return chosen[1] if chosen is not None and chosen[1] is not None else cache_root()
