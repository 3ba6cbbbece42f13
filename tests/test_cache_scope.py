"""Cache keys cover the code that produces a result, and nothing else."""

import shutil
from pathlib import Path

import pandas as pd
import pytest

from cwcore import cache, code_keys

PACKAGE = Path(cache.__file__).parent


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    copy = tmp_path / "cwcore"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(code_keys, "_PACKAGE", copy)
    code_keys._code_hash.cache_clear()
    yield copy
    code_keys._code_hash.cache_clear()


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# an edit\n")
    code_keys._code_hash.cache_clear()


def _code_edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n_AN_EDIT = 1\n")
    code_keys._code_hash.cache_clear()


def test_edits_to_code_that_computes_no_result_keep_every_result_key(package_copy):
    # every module code_keys.NOT_PRODUCING names, each of which must exist (four names of the book's old home under
    # cwcore/ were skipped as missing, so only two files were ever edited)
    scopes = ["faithfulness", "sinks"]
    before = {s: cache.code_version(s) for s in scopes}
    whole = cache.code_version()
    for name in code_keys.NOT_PRODUCING:
        assert (package_copy / name).is_file(), name
        _code_edit(package_copy / name)
    assert {s: cache.code_version(s) for s in scopes} == before
    assert cache.code_version() != whole  # a book page (whole-package stamp) is re-rendered


@pytest.mark.parametrize("edited, changes, keeps", [
    ("core/geometry.py", ["faithfulness", "sinks"], []),
    ("stats.py", ["faithfulness", "sinks"], []),
    ("sinks/rates.py", ["sinks"], ["faithfulness"]),
])
def test_producing_code_edits_invalidate_exactly_their_results(package_copy, edited, changes, keeps):
    before = {s: cache.code_version(s) for s in changes + keeps}
    _code_edit(package_copy / edited)
    for s in changes:
        assert cache.code_version(s) != before[s], s
    for s in keeps:
        assert cache.code_version(s) == before[s], s


def test_a_subpackage_scope_covers_all_its_producing_files(package_copy):
    name = "faithfulness"
    covered = set(cache.code_files(name))
    for path in sorted((package_copy / name).glob("*.py")):
        rel = path.relative_to(package_copy).as_posix()
        before = cache.code_version(name)
        _code_edit(path)
        assert (cache.code_version(name) != before) == (rel in covered), rel
        assert (rel in covered) == (rel not in cache.NOT_PRODUCING), rel


def test_normalised_source_ignores_comments_docstrings_and_layout_only():
    code = 'def f(x):\n    """Doc."""\n    return x + 1  # why\n'
    same = '# header\ndef f(x):\n    """Another doc,\n    longer."""\n\n    return (x +\n            1)\n'
    assert cache.normalised_source(code) == cache.normalised_source(same)
    for other in ('def f(x):\n    return x + 2\n', 'def f(y):\n    return y + 1\n',
                  'def f(x):\n    "Doc."\n    return "x + 1"\n'):
        assert cache.normalised_source(code) != cache.normalised_source(other)


def _faithfulness_run(model, ids, root, counter):
    from cwcore import faithfulness as fa
    with cache.caching(root):
        return fa.faithfulness_curve(model, None, ids, metric=["contribution", "random"], ratios=[0, 0.3],
                                     mode="comprehensiveness", batch_size=4, progress=False).per_sequence


def test_exporter_docstring_and_comment_edits_keep_every_cached_piece_and_a_ranking_edit_recomputes(
        package_copy, tmp_path, monkeypatch):
    import torch

    from cwcore.faithfulness import sweep
    from tiny_models import VOCAB, tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (6, 12), generator=torch.Generator().manual_seed(0))
    points = []
    original = sweep.Sweep._point
    monkeypatch.setattr(sweep.Sweep, "_point", lambda self, *a, **k: points.append(1) or original(self, *a, **k))
    first = _faithfulness_run(model, ids, tmp_path / "cache", points)
    computed = len(points)
    assert computed > 0

    # an exporter (real code), a docstring and a comment of the ranking module
    exporter = package_copy / "faithfulness" / "cli.py"
    exporter.write_text(exporter.read_text() + "\nEXPORTED_COLUMNS = ('an', 'edit')\n")
    ranking = package_copy / "faithfulness" / "ranking.py"
    text = ranking.read_text()
    assert text.startswith('"""')
    text = '"""An edited docstring."""\n' + text.split('"""', 2)[2]
    ranking.write_text(text.replace("\n\n\n", "\n\n\n# an edited comment\n", 1))
    code_keys._code_hash.cache_clear()
    again = _faithfulness_run(model, ids, tmp_path / "cache", points)
    assert len(points) == computed  # every piece read back
    pd.testing.assert_frame_equal(first, again)

    # a change of the ranking code (a statement) makes a new key: everything is computed again
    ranking.write_text(text + "\n_RANKING_EDIT = 1\n")
    code_keys._code_hash.cache_clear()
    _faithfulness_run(model, ids, tmp_path / "cache", points)
    assert len(points) == 2 * computed


@pytest.mark.slow  # a subprocess that imports torch and runs the producers
def test_every_module_a_sweep_loads_is_in_its_key_or_declared_non_producing(tmp_path):
    """The import walk is static; this runs the producers and checks what Python actually loaded."""
    import json
    import os
    import subprocess
    import sys

    script = """
import json, sys, torch
sys.path.insert(0, "tests")
from tiny_models import VOCAB, tiny_model
from cwcore import faithfulness as fa
model = tiny_model("llama")
ids = torch.randint(0, VOCAB, (4, 10), generator=torch.Generator().manual_seed(0))
fa.faithfulness_curve(model, None, ids, ratios=[0.3], mode="comprehensiveness", progress=False).table
print(json.dumps(sorted(m for m in sys.modules if m == "cwcore" or m.startswith("cwcore."))))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                         cwd=PACKAGE.parent, check=True).stdout
    loaded = json.loads(out.strip().splitlines()[-1])
    covered = set(cache.code_files("faithfulness")) | set(cache.NOT_PRODUCING)
    for module in loaded:
        parts = module.split(".")[1:]
        file = "/".join(parts) + ".py" if (PACKAGE.joinpath(*parts).with_suffix(".py")).is_file() \
            else "/".join(parts + ["__init__.py"])
        assert file in covered, f"{module} was loaded by a faithfulness sweep but is not in its cache key"


def test_every_module_declared_non_producing_exists():
    """A stale entry would silently exclude from every key a future module of that name."""
    missing = [name for name in cache.NOT_PRODUCING if not (PACKAGE / name).exists()]
    assert missing == []
