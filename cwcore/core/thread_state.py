"""Per-thread state of cwcore's attention sessions, apart from the session code so that the
architecture facts (whose probe passes must stay invisible to an active session) can use it without an
import cycle."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

# Sessions are per thread: two threads decomposing two models do not see each other's session.
LOCAL = threading.local()


@contextlib.contextmanager
def outside_sessions() -> Iterator[None]:
    """Inside the block, this thread's forward passes are invisible to its active sessions (their hooks and
    attention points do nothing; attention is plain eager): for a probe pass run from inside a session."""
    previous = getattr(LOCAL, "outside", False)
    LOCAL.outside = True
    try:
        yield
    finally:
        LOCAL.outside = previous


def outside() -> bool:
    """Whether this thread is inside :func:`outside_sessions`."""
    return getattr(LOCAL, "outside", False)
