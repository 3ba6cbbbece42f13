"""Notebooks are thin: parameters, calls into their chapter's module (``cwbook.chapters``), figures, prose
and exercises. No function or class is defined outside the exercise and solution cells: the helpers and the
computation live in the chapter module, where they can be read, tested and reused."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

#: notebooks already thin (the others still define helpers of their own)
THIN = ["02_geometry", "03_contribution_maps", "04_faithfulness", "04b_attribution_bench", "08_encoders"]


def _is_exercise(cell) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    return "exercise" in tags or "solution" in tags


def definitions(nb: dict) -> list[str]:
    """``cell id:line: name`` of every ``def`` or ``class`` in a code cell that is not an exercise or a
    solution (lines of IPython magics are read as blank lines)."""
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or _is_exercise(cell):
            continue
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                           for line in "".join(cell["source"]).splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(f"{cell.get('id')}:{node.lineno}: {node.name}")
    return found


def _notebook(*sources: str, tags=()) -> dict:
    return {"cells": [{"cell_type": "code", "id": f"c{i}", "metadata": {"tags": list(tags)}, "source": s}
                      for i, s in enumerate(sources)]}


def test_the_check_finds_definitions():
    assert definitions(_notebook("x = 1\ndef f():\n    pass\n")) == ["c0:2: f"]
    assert definitions(_notebook("if x:\n    class A:\n        pass\n")) == ["c0:2: A"]
    assert definitions(_notebook("%matplotlib inline\nasync def g():\n    pass\n")) == ["c0:2: g"]
    assert definitions(_notebook("def f():\n    pass\n", tags=["solution", "hide-cell"])) == []
    assert definitions(_notebook("f = lambda x: x\nfrom m import f\n")) == []


@pytest.mark.parametrize("name", THIN)
def test_a_thin_notebook_defines_nothing_outside_its_exercises(name):
    path = REPO / "notebooks" / f"{name}.ipynb"
    found = definitions(json.loads(path.read_text()))
    assert not found, f"{path.name} defines functions or classes (move them to its chapter module): {found}"


@pytest.mark.parametrize("name", THIN)
def test_a_thin_notebook_calls_its_chapter_module(name):
    stem = name.split("_", 1)
    module = REPO / "book" / "cwbook" / "chapters" / f"ch{stem[0]}_{stem[1]}.py"
    assert module.is_file(), module
    code = "".join("".join(c["source"]) for c in json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text())["cells"]
                   if c["cell_type"] == "code")
    assert "cwbook.chapters" in code and module.stem in code, f"{name} does not import {module.stem}"


def test_the_chapter_modules_hide_nothing_of_the_books_runner():
    """Importing ``cwbook.chapters.<module>`` sets the attribute ``cwbook.chapters`` to that package: a function
    of the runner by that name would be replaced (``plan`` called ``chapters(config)`` and failed with "'module'
    object is not callable" in any process that had imported a chapter module)."""
    import importlib

    import cwbook

    for path in sorted((REPO / "book" / "cwbook" / "chapters").glob("*.py")):
        importlib.import_module(f"cwbook.chapters.{path.stem}")
    _, chapters, runs = cwbook.plan(cwbook.load_config(REPO / "book" / "run.yml"), profile="smoke")
    assert set(THIN) <= {c.name for c in chapters} and runs
