"""Thin notebooks: a notebook holds its parameters, one call into its chapter's module
(``book/cwbook/chapters/``), figure cells, prose and the glue that puts the module's numbers into it.
Functions and classes live in the chapter module; only exercise and solution cells may define their own.

``THIN`` lists the notebooks converted so far, with the non-blank lines of their other code cells before
the conversion: each must stay at or below half of that.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
#: notebook stem -> non-blank lines of its code cells outside exercises and solutions before the conversion
THIN = {
    "05_sink_decomposition": 412,
    "06_sinks_as_suppressors": 526,
    "07_semantic_cone": 282,
    "09_findings": 136,
}


def _is_exercise(cell) -> bool:
    return bool({"exercise", "solution"} & set(cell.get("metadata", {}).get("tags", [])))


def definitions(nb) -> list[str]:
    """'cell <index>: <name>' of every function or class defined in a code cell that is not an exercise or a
    solution (lambdas are expressions, not definitions)."""
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or _is_exercise(cell):
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.append(f"cell {index}: {node.name}")
    return found


def code_lines(nb) -> int:
    """Non-blank lines of the code cells that are not exercises or solutions."""
    return sum(1 for cell in nb.cells if cell.cell_type == "code" and not _is_exercise(cell)
               for line in cell.source.splitlines() if line.strip())


def test_the_checks_can_fail():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("x = 1\n\ndef f():\n    return x\n"),
        nbformat.v4.new_code_cell("class C:\n    pass\n", metadata={"tags": ["hide-cell"]}),
        nbformat.v4.new_code_cell("def g():\n    pass\n", metadata={"tags": ["solution", "hide-cell"]}),
        nbformat.v4.new_markdown_cell("def h(): prose"),
    ])
    assert definitions(nb) == ["cell 0: f", "cell 1: C"]
    assert code_lines(nb) == 5


@pytest.mark.parametrize("stem", sorted(THIN))
def test_notebook_defines_nothing_outside_exercises(stem):
    nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    assert not definitions(nb), f"{stem} defines {definitions(nb)}: move them to cwbook.chapters"


@pytest.mark.parametrize("stem", sorted(THIN))
def test_notebook_code_is_at_most_half_of_what_it_was(stem):
    nb = nbformat.read(NOTEBOOKS / f"{stem}.ipynb", as_version=4)
    assert code_lines(nb) <= THIN[stem] // 2, f"{stem}: {code_lines(nb)} lines of code, at most {THIN[stem] // 2}"
