"""The build's view of its kernels' progress: the sweep a notebook is running, with the time left."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

from cwcore.runs import PROGRESS_FILE_ENV_VAR


def read(path: str | Path) -> dict | None:
    """The bar a kernel last wrote to ``path``, or None (no file yet, or one being replaced)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe(state: dict, now: float | None = None) -> str:
    """One line: ``<desc> <n>/<total> <unit>, <elapsed> elapsed, ~<left> left`` (the time left at the
    bar's mean rate so far; without a total or a finished batch, no estimate)."""
    now = time.time() if now is None else now
    n, total = int(state.get("n") or 0), state.get("total")
    started = state.get("started")
    elapsed = now - (now if started is None else float(started))
    text = f"{state.get('desc') or 'sweep'} {n}/{total if total else '?'} {state.get('unit') or ''}".rstrip()
    text += f", {_duration(elapsed)} elapsed"
    if total and 0 < n < total:
        text += f", ~{_duration(elapsed / n * (total - n))} left"
    return text


class Watch:
    """While open, show the bar a kernel writes to ``path`` after ``prefix`` (the runner's
    ``[i/n] chapter [model] executing ...``): refreshed in place on a terminal (every ``interval``
    seconds), else one line when ``log_every`` seconds have passed since the last one."""

    def __init__(self, path: str | Path, prefix: str, *, stream=None, interval: float = 2.0, log_every: float = 300.0):
        self.path, self.prefix = Path(path), prefix
        self.stream = stream if stream is not None else sys.stdout
        self.interval, self.log_every = interval, log_every
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._shown = False
        self._last_log = time.monotonic()

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._shown:  # the runner's " done in ..." follows its own prefix again
            self.stream.write(("\r\033[K" if self.interactive else "\n") + self.prefix)
            self.stream.flush()

    def poll(self) -> None:
        """Show the current bar once (what the thread does every ``interval`` seconds)."""
        state = read(self.path)
        if state is None:
            return
        if self.interactive:
            self.stream.write("\r\033[K" + f"{self.prefix} {describe(state)}")
            self.stream.flush()
            self._shown = True
        elif time.monotonic() - self._last_log >= self.log_every:
            self._last_log = time.monotonic()
            self.stream.write(f"\n    ... {describe(state)}")
            self.stream.flush()
            self._shown = True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()
