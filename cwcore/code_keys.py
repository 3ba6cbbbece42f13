"""What a result cache key covers: the normalised code (no comments, docstrings or layout) of the modules
that produce a result and of every package module they import, except those declared non-producing
(exporters, command lines). :mod:`cwcore.cache` builds its keys from :func:`code_version`."""

from __future__ import annotations

import ast
import hashlib
from functools import lru_cache
from pathlib import Path

__all__ = ["ALL_CODE", "BASE_CODE", "NOT_PRODUCING", "code_files", "code_scope", "code_version", "normalised_source"]

#: The code every cached result depends on, whatever produced it (paths relative to the package):
#: the core, the statistics, the run driver, the cache and the data loaders.
BASE_CODE = ("core", "stats.py", "runs.py", "cache.py", "data.py")
#: Modules that never compute a cached number (exporters, command lines; ``models.py``: the weights are in
#: every key through :func:`cwcore.identity.model_fingerprint`). A module not named here is hashed, so the
#: list errs safely (a hand-bumped version number would not: a forgotten bump serves stale numbers).
NOT_PRODUCING = ("cli.py", "explorer.py", "models.py", "plotting.py", "provenance.py", "tokens.py",
                 "faithfulness/__main__.py", "faithfulness/cli.py",
                 "sinks/__main__.py", "sinks/cli.py", "sinks/summary.py")
_PACKAGE = Path(__file__).parent


def _code_files(name: str) -> list[Path]:
    if name == "*":
        return sorted(_PACKAGE.rglob("*.py"))
    path = _PACKAGE / name
    if path.is_dir():
        return sorted(path.rglob("*.py"))
    if path.suffix != ".py":
        path = path.with_suffix(".py")
    if path.is_file():
        return [path]
    raise ValueError(f"code scope {name!r} is neither a module nor a subpackage of cwcore")


ALL_CODE = ("*",)  # every source file of the package


def code_scope(code: str | tuple | list | None = None) -> tuple[str, ...]:
    """The sorted module/subpackage names a key starts from: :data:`BASE_CODE` plus ``code``; None means
    the whole package (:data:`ALL_CODE`), the safe choice for anything that is not a result, e.g. a book page."""
    if code is None or tuple(code) == ALL_CODE or code == "*":
        return ALL_CODE
    extra = (code,) if isinstance(code, str) else tuple(code)
    return tuple(sorted(set(BASE_CODE) | set(extra)))


def _relative(path: Path) -> str:
    return path.relative_to(_PACKAGE).as_posix()


def _producing(path: Path) -> bool:
    rel = _relative(path)
    return not any(rel == name or rel.startswith(name + "/") for name in NOT_PRODUCING)


def _read_source(path: Path) -> str:
    """The source of one module (tests replace this to edit a module without touching the checkout)."""
    return path.read_text(encoding="utf-8")


_DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, _DOCSTRING_OWNERS) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def _serialise(node) -> str:
    """A node as text: its type and fields, no positions; None and empty fields are left out, so the
    text stays the same across Python versions that add optional fields (e.g. ``type_params``)."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_serialise(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_serialise(item) for item in node) + "]"
    return repr(node)


def normalised_source(source: str) -> str:
    """``source``'s code without comments, docstrings or layout: what a cache key hashes."""
    return _serialise(_strip_docstrings(ast.parse(source)))


def _module_path(module: str) -> Path | None:
    """The file of ``cwcore.<module>`` (dotted, relative to the package), or None outside it."""
    base = _PACKAGE.joinpath(*module.split(".")) if module else _PACKAGE
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _imported(path: Path, tree: ast.AST) -> set[Path]:
    """The package's files that ``path`` imports anywhere (lazy imports inside functions too), with
    the ``__init__.py`` of every package on the way (importing a submodule runs them)."""
    parts = path.relative_to(_PACKAGE).with_suffix("").parts
    package = parts[:-1]  # the package a relative import starts from (for __init__ too)
    targets: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets += [a.name[len("cwcore."):] for a in node.names if a.name.startswith("cwcore.")]
            targets += ["" for a in node.names if a.name == "cwcore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + tuple(filter(None, (node.module or "").split("."))))
            elif node.module and (node.module == "cwcore" or node.module.startswith("cwcore.")):
                base = node.module[len("cwcore."):] if node.module != "cwcore" else ""
            else:
                continue
            targets.append(base)
            targets += [f"{base}.{a.name}" if base else a.name for a in node.names]  # submodules
    found = set()
    for target in targets:
        names = target.split(".") if target else []
        for i in range(len(names) + 1):  # the packages on the way, then the module itself
            module = _module_path(".".join(names[:i]))
            if module is not None:
                found.add(module)
    return found


def _closure(scope: tuple[str, ...]) -> dict[Path, str]:
    """``{file: normalised source}`` of the producing files that ``scope`` names, and of every producing
    file they import, transitively (see :data:`NOT_PRODUCING`)."""
    todo = [f for name in scope for f in _code_files(name) if _producing(f)]
    seen: dict[Path, str] = {}
    while todo:
        path = todo.pop()
        if path in seen or not _producing(path):
            continue
        seen[path], imported = _parsed(path, _read_source(path))
        todo.extend(imported - set(seen))
    return seen


_PARSED: dict[tuple[Path, str], tuple[str, frozenset]] = {}


def _parsed(path: Path, source: str) -> tuple[str, frozenset]:
    """(normalised source, imported package files) of one module, memoised on its text."""
    key = (path, hashlib.sha256(source.encode()).hexdigest())
    if key not in _PARSED:
        tree = ast.parse(source)
        imported = frozenset(_imported(path, tree))  # before the docstrings go: they import nothing
        _PARSED[key] = (_serialise(_strip_docstrings(tree)), imported)
    return _PARSED[key]


def code_files(code: str | tuple | list | None = None) -> list[str]:
    """The package files (relative paths) whose code is part of the key of a result of ``code``."""
    scope = code_scope(code)
    files = _code_files("*") if scope == ALL_CODE else _closure(scope)
    return sorted(_relative(f) for f in files)


@lru_cache(maxsize=None)
def _code_hash(scope: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    if scope == ALL_CODE:  # a book page: every byte of the package, as before
        for path in sorted(_code_files("*")):
            digest.update(_relative(path).encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()[:16]
    digest.update(b"normalised-ast-1")
    for path, text in sorted(_closure(scope).items(), key=lambda kv: _relative(kv[0])):
        digest.update(_relative(path).encode() + b"\0")
        digest.update(text.encode() + b"\0")
    return digest.hexdigest()[:16]


def code_version(code: str | tuple | list | None = None) -> str:
    """A hash of the normalised code of :data:`BASE_CODE`, of ``code`` (e.g. ``"faithfulness"``) and of every
    package module they import, except :data:`NOT_PRODUCING`: results of other code are never reused, a
    docstring or an exporter edit never invalidates them. ``code=None`` hashes every byte of the package."""
    return _code_hash(code_scope(code))
