"""The book wing sits on top: nothing in the science (cwcore.core, faithfulness, sinks, stats, runs, cache,
data, models) imports cwcore.book or the old names of its modules, lazily inside a function or not.
The imports are read from the source (AST), relative ones resolved, so a lazy import is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import cwcore
from cwcore import _compat

PACKAGE = Path(cwcore.__file__).resolve().parent
SCIENCE = ("core", "faithfulness", "sinks", "stats.py", "runs.py", "cache.py", "data.py", "models.py")
#: the book wing's package and the old names that alias into it
BOOK = ("cwcore.book", *(old for old, new in _compat.MOVED.items() if new.startswith("cwcore.book")))


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``path`` (module ``name``, default from its place
    in the package), at any depth; ``from x import y`` gives both ``x`` and ``x.y`` (y may be a submodule)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return out


def into_book(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BOOK)


def science_files() -> list[Path]:
    files = []
    for entry in SCIENCE:
        path = PACKAGE / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def test_the_science_never_imports_the_book_wing():
    bad = [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}"
           for path in science_files() for line, name in imports(path) if into_book(name)]
    assert not bad, "\n".join(bad)
    assert len(science_files()) > 30  # the walk found the packages


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    # a control that could fail: a lazy relative import of the book inside a function of a science module
    fake = tmp_path / "probe.py"
    fake.write_text("def f():\n    from .. import book\n    from ..book import findings\n    import cwcore.notebook\n")
    tree_names = [n for _, n in imports(fake, "cwcore.faithfulness.probe")]
    assert {"cwcore.book", "cwcore.book.findings", "cwcore.notebook"} <= set(tree_names)
    assert all(into_book(n) for n in ("cwcore.book", "cwcore.book.findings", "cwcore.notebook", "cwcore.findings"))
    assert not into_book("cwcore.bookkeeping") and not into_book("cwcore.faithfulness.evidence")


def test_no_module_or_notebook_of_the_project_uses_the_old_names():
    old = [name for name in BOOK if name != "cwcore.book"]
    repo = PACKAGE.parent
    users = []
    for path in [*PACKAGE.rglob("*.py"), *(repo / "notebooks").glob("*.ipynb")]:
        if path.name == "_compat.py":
            continue
        text = path.read_text()
        users += [f"{path.relative_to(repo)}: {name}" for name in old if name in text]
        if path.suffix == ".ipynb" or path.parent.name in ("book",):
            users += [f"{path.relative_to(repo)}: from cwcore import findings" for _ in [0]
                      if "from cwcore import findings" in text]
    assert not users, users


def test_the_old_names_still_import_as_the_same_modules():
    import importlib

    for old, new in _compat.MOVED.items():
        if new.startswith("cwcore.book"):
            assert importlib.import_module(old) is importlib.import_module(new)
