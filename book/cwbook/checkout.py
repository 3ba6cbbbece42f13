"""Which checkout is running: a warning when ``import cwcore`` loads another checkout's code."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

SILENCE_ENV_VAR = "CWCORE_NO_CHECKOUT_WARNING"


class CheckoutWarning(UserWarning):
    """The imported cwcore is not the checkout the process runs in."""


def _is_checkout(folder: Path) -> bool:
    """Whether ``folder`` is a cwcore source checkout: its ``pyproject.toml`` names the project and it
    holds the package."""
    project = folder / "pyproject.toml"
    if not (folder / "cwcore" / "__init__.py").is_file() or not project.is_file():
        return False
    try:
        head = project.read_text(encoding="utf-8", errors="replace")[:4000]
    except OSError:
        return False
    return 'name = "cwcore"' in head


def checkout_of(path: Path) -> Path | None:
    """The cwcore checkout that contains ``path`` (``path`` itself or a parent), or None."""
    path = path.resolve()
    for folder in (path, *path.parents):
        if _is_checkout(folder):
            return folder
    return None


def warn_if_other_checkout(package_dir: str | os.PathLike, cwd: str | os.PathLike | None = None) -> Path | None:
    """Warn (:class:`CheckoutWarning`) when the working folder ``cwd`` (default: the process's) is inside
    a cwcore checkout other than the one that holds ``package_dir`` (the imported ``cwcore/``). Returns
    the other checkout, or None when there is nothing to say."""
    if os.environ.get(SILENCE_ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    package_dir = Path(package_dir).resolve()
    imported = package_dir.parent
    if not _is_checkout(imported):
        return None  # an installed wheel (site-packages): no checkout to compare
    try:
        here = checkout_of(Path(cwd) if cwd is not None else Path.cwd())
    except (OSError, RuntimeError):  # the working folder was deleted, a symlink loop
        return None
    if here is None or here == imported:
        return None
    warnings.warn(f"cwcore is imported from {imported}, but this process runs inside the checkout {here}: its "
                  f"edits are not the code that runs. Install it into its own environment (cd {here} && make "
                  f"venv), or put it first on the path (PYTHONPATH={here}); {SILENCE_ENV_VAR}=1 silences this.",
                  CheckoutWarning, stacklevel=3)
    return here
