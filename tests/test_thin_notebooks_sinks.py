"""Thin notebooks: a notebook holds its parameters, one call into its chapter's module
(``book/cwbook/chapters/``), figure cells, prose and the glue that puts the module's numbers into it.
Functions and classes live in the chapter module; only exercise and solution cells may define their own.

``THIN`` lists the notebooks converted so far; ``LINES_BEFORE`` the non-blank lines of their other code cells
before the conversion: each must stay at or below half of that. The chapter modules' own helpers are tested
below against hand-computed values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
#: the notebooks whose computation lives in their chapter module (cwbook.chapters)
THIN = ["05_sink_decomposition", "06_sinks_as_suppressors", "07_semantic_cone", "09_findings"]
#: notebook stem -> non-blank lines of its code cells outside exercises and solutions before the conversion
LINES_BEFORE = {"05_sink_decomposition": 412, "06_sinks_as_suppressors": 526, "07_semantic_cone": 282,
                "09_findings": 136}


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
    limit = LINES_BEFORE[stem] // 2
    assert code_lines(nb) <= limit, f"{stem}: {code_lines(nb)} lines of code, at most {limit}"


# -- the chapter modules' helpers ---------------------------------------------------------------------------------------
def test_the_sink_chapters_reach_the_analyses_modules_whatever_the_package_binds(monkeypatch):
    import cwcore.sinks
    from cwbook.chapters.sinks_common import sinks_module

    module = sinks_module("anti_alignment")
    monkeypatch.setattr(cwcore.sinks, "anti_alignment", lambda *a, **k: None, raising=False)  # a function of that name
    assert sinks_module("anti_alignment") is module and callable(module.layer_profile)
    assert callable(sinks_module("convexity").vertex_intervals)


def _claims(**rows):
    import pandas as pd

    return pd.DataFrame([{"key": key, "estimate": e, "low": lo, "high": hi, "verdict": v, "why": why}
                         for key, (e, lo, hi, v, why) in rows.items()])


def test_chapter_6_quotes_claims_rows_as_the_prose_reads_them():
    import numpy as np

    from cwbook.chapters.ch06_sinks_as_suppressors import Suppressors, listing

    claims = _claims(cos_semantic=(0.18, 0.12, 0.25, "contradicted", ""),
                     shortened=(0.5, 0.375, 0.625, "inconclusive", ""),
                     contrast=(np.nan, np.nan, np.nan, "not measured", "no sink heads at eps=0.3"))
    r = Suppressors(sinks=None, bins=10, min_range=0.05, n_examples=4, n_bootstrap=10, runs={},
                    claims_of={"gsm8k": claims}, claims=claims)
    assert r.ci_text("gsm8k", "cos_semantic") == "0.18 (0.12 to 0.25)"
    assert r.ci_text("gsm8k", "cos_semantic", fmt="{:+.1f}") == "+0.2 (+0.1 to +0.2)"
    assert r.ci_text("gsm8k", "shortened", pct=True) == "50% (38% to 62%)"  # round half to even, as f-strings do
    assert r.ci_text("gsm8k", "contrast") == "not measured (no sink heads at eps=0.3)"
    assert r.ci_text("gsm8k", "absent") == "not measured"
    # the rerun's own verdict, for comparisons; the page prints where its interval lies, never a verdict word
    assert r.live_verdict("gsm8k", "cos_semantic") == "contradicted"
    assert r.live_verdict("gsm8k", "contrast") == "not measured: no sink heads at eps=0.3"
    assert r.verdict_of("gsm8k", "cos_semantic") == "interval on the opposite side"
    assert r.verdict_of("gsm8k", "contrast") == "not measured: no sink heads at eps=0.3"
    assert r.verdict_of("gsm8k", "absent") == "no interval"
    assert [listing([]), listing(["a"]), listing(["a", "b", "c"])] == ["none", "*a*", "*a*, *b* and *c*"]


def test_chapter_5_pools_the_decomposition_summary_by_group():
    import numpy as np
    import pandas as pd

    from cwbook.chapters.ch05_sink_decomposition import SinkDecomposition, layer_type_note, ratio

    summary = pd.DataFrame({"scope": ["sink_heads", "sink_heads", "other_heads"], "token_class": ["sink", "tail", "sink"],
                            "factor": ["alpha", "alpha", "alpha"], "median": [0.7, 0.01, 0.2]})
    r = SinkDecomposition(sinks=None, sample_size=10, n_bootstrap=10, summary=summary)
    assert r.pooled("sink_heads", "tail", "alpha", "median") == 0.01
    assert r.pooled("other_heads", "sink", "alpha", "median") == 0.2
    assert np.isnan(r.pooled("other_heads", "tail", "alpha", "median"))  # no such group
    assert ratio(0.3, 0.1) == pytest.approx(3.0) and np.isnan(ratio(0.3, 0.0))
    frame = pd.DataFrame({"key": ["sink_eps", "sink_eps@global", "sink_eps@sliding"], "estimate": [0.5, 0.25, 0.75],
                          "low": [0.4, 0.125, 0.5], "high": [0.6, 0.375, 1.0]})
    assert layer_type_note(frame, "sink_eps") == "global layers 0.25 (0.12 to 0.38); sliding layers 0.75 (0.50 to 1.00)"
    frame.loc[1, ["low", "high"]] = np.nan  # too few layers of a type to resample them: no "nan to nan"
    assert layer_type_note(frame, "sink_eps") == "global layers 0.25 (no interval); sliding layers 0.75 (0.50 to 1.00)"


def test_chapter_7_reads_a_difference_by_its_sign():
    import numpy as np

    from cwbook.chapters.ch07_semantic_cone import by_sign

    assert by_sign((0.0125, -0.002, 0.02), "further", "closer") == "further by 0.013 (difference +0.013, -0.002 to +0.020)"
    assert by_sign((-0.5, -0.75, -0.25), "further", "closer") == "closer by 0.500 (difference -0.500, -0.750 to -0.250)"
    assert by_sign((np.nan, np.nan, np.nan), "further", "closer") == "not measured"
