"""Names and provenance shared by the science and the book wing: a model name as a file component, and
the git commit of a checkout (both used where committed evidence files are written)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

__all__ = ["slug", "git"]


def slug(name: str) -> str:
    """A model name as a file and URL component: 'Qwen/Qwen3-8B' -> 'qwen-qwen3-8b' (ValueError when the
    name has no letters or digits)."""
    s = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")
    if not s:
        raise ValueError(f"model name {name!r} has no letters or digits")
    return s


def git(root: str | Path, *args: str) -> str | None:
    """``git -C root args...``'s output, stripped, or None when git or the repository is absent."""
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
