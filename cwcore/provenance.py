"""The command lines' outputs: a model name as a file component and the folder the tables go to."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["slug", "RESULTS_FOLDER", "output_folder", "confined"]

#: where the command lines write their tables unless ``--out`` says otherwise: a folder of the user's working
#: folder, never a repository's committed tables (``data/results``)
RESULTS_FOLDER = "cwcore-results"


def slug(name: str) -> str:
    """A model name as a file and URL component: 'Qwen/Qwen3-8B' -> 'qwen-qwen3-8b' (ValueError when the
    name has no letters or digits)."""
    s = re.sub(r"[^a-z0-9]+", "-", str(name).lower()).strip("-")
    if not s:
        raise ValueError(f"model name {name!r} has no letters or digits")
    return s


def output_folder(out: str | Path, flag: str = "--out") -> Path:
    """``out`` as a folder that exists or can be made, checked before any model is loaded: refused (a
    ``ValueError`` in one sentence) when it is a file, sits under a file, or cannot be written."""
    import os

    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} {out} is a file; pass a folder for the tables (default ./{RESULTS_FOLDER}/)")
    parent = folder
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {out}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {out}: {parent} cannot be written (permission denied)")
    return folder


def confined(folder: str | Path, name: str) -> Path:
    """``folder / name``, refused (``ValueError``) unless it is a file directly inside ``folder``."""
    import os

    folder = Path(folder)
    path = folder / name
    if Path(os.path.abspath(path)).parent != Path(os.path.abspath(folder)):
        raise ValueError(f"output {name!r} would leave {folder}")
    return path
