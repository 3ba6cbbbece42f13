"""Every ``from X import Y`` in the library and the book's production names something that exists.

Imports inside functions run only when the function does (a command, a chapter's writer), so a module that
moves breaks them silently until someone runs that path; this reads every import statement of both packages,
at any depth, and resolves it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cwcore": ROOT / "cwcore", "cwbook": ROOT / "book" / "cwbook"}


def _module_name(package: str, folder: Path, path: Path) -> str:
    parts = [package, *path.relative_to(folder).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports():
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            module = _module_name(package, folder, path)
            is_package = path.name == "__init__.py"
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module != "__future__":
                    if node.level:
                        base = module.split(".")
                        base = base[:len(base) - node.level + (1 if is_package else 0)]
                        target = ".".join(base + ([node.module] if node.module else []))
                    else:
                        target = node.module
                    if target.split(".")[0] not in PACKAGES:
                        continue
                    for alias in node.names:
                        yield f"{path.relative_to(ROOT)}:{node.lineno}", target, alias.name


IMPORTS = list(_imports())


def test_the_walk_finds_the_imports_inside_functions():
    # the control: this file's walk must see a function-level import it knows is there
    assert any(where.startswith("cwcore/cli.py") for where, _, _ in IMPORTS)
    assert len(IMPORTS) > 200


def _unresolved(imports) -> list[str]:
    missing = []
    for where, target, name in imports:
        module = importlib.import_module(target)
        if name != "*" and not hasattr(module, name):
            try:
                importlib.import_module(f"{target}.{name}")  # a submodule not yet imported
            except ImportError:
                missing.append(f"{where}: from {target} import {name}")
    return missing


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_from_import_resolves(package):
    missing = _unresolved([i for i in IMPORTS if i[1].split(".")[0] == package])
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_a_stale_import_is_caught():
    # the control: git moved from cwcore.provenance to cwbook; the old import is reported, the new one is not
    assert _unresolved([("old", "cwcore.provenance", "git")]) == ["old: from cwcore.provenance import git"]
    assert _unresolved([("new", "cwbook", "git")]) == []
