"""The library and the book apart: nothing in ``cwcore`` imports ``cwbook`` (the book's production, under
``book/cwbook/``), lazily inside a function or not, and the package holds no book production.
The imports are read from the source (AST), relative ones resolved, so a lazy import is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import cwcore

PACKAGE = Path(cwcore.__file__).resolve().parent
REPO = PACKAGE.parent
BOOK_PACKAGE = REPO / "book" / "cwbook"


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
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
    return name == "cwbook" or name.startswith("cwbook.") or name == "cwcore.book" or name.startswith("cwcore.book.")


def test_the_library_never_imports_the_book():
    files = sorted(PACKAGE.rglob("*.py"))
    bad = [f"{path.relative_to(REPO)}:{line} imports {name}"
           for path in files for line, name in imports(path) if into_book(name)]
    assert not bad, "\n".join(bad)
    assert len(files) > 50  # the walk found the package


def test_the_walk_sees_lazy_and_relative_imports(tmp_path):
    # a control that could fail: lazy imports of the book inside a function of a library module
    fake = tmp_path / "probe.py"
    fake.write_text("def f():\n    import cwbook.findings\n    from cwbook import ladder\n    from .. import book\n")
    names = [n for _, n in imports(fake, "cwcore.faithfulness.probe")]
    assert {"cwbook.findings", "cwbook", "cwbook.ladder", "cwcore.book"} <= set(names)
    assert all(into_book(n) for n in ("cwbook", "cwbook.findings", "cwcore.book"))
    assert not into_book("cwcore.bookkeeping") and not into_book("cwbooks")


def test_the_library_holds_no_book_production():
    # the runner, the evidence build and the chapters' helpers live in book/cwbook, a package of their own
    assert not (PACKAGE / "book").exists()
    assert (BOOK_PACKAGE / "__init__.py").is_file()
    assert not any(PACKAGE.rglob("evidence*.py")), "evidence modules belong to the book's production"
    # no module of the library names the repository's evidence folder
    users = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "data/results/evidence" in p.read_text()
             or '"results" / "evidence"' in p.read_text()]
    assert not users, users


def test_the_book_imports_the_library_by_its_public_name():
    # cwbook is another distribution: it reaches cwcore as `cwcore`, never by a relative import out of itself
    bad = [f"{path.relative_to(REPO)}:{node.lineno}" for path in sorted(BOOK_PACKAGE.rglob("*.py"))
           for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level > 1]
    assert not bad, "\n".join(bad)
