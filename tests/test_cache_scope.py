"""Cache keys cover the code that produces a result, and nothing else."""

import shutil
from pathlib import Path

import pytest

from cwcore import cache

PACKAGE = Path(cache.__file__).parent


@pytest.fixture
def package_copy(tmp_path, monkeypatch):
    copy = tmp_path / "cwcore"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache, "_PACKAGE", copy)
    cache._code_hash.cache_clear()
    yield copy
    cache._code_hash.cache_clear()


def _edit(path: Path) -> None:
    path.write_text(path.read_text() + "\n# an edit\n")
    cache._code_hash.cache_clear()


def test_plotting_book_and_cli_edits_keep_every_result_key(package_copy):
    scopes = ["faithfulness", "sinks", "analysis"]
    before = {s: cache.code_version(s) for s in scopes}
    whole = cache.code_version()
    for name in ("plotting.py", "book/__init__.py", "cli.py", "book/notebook.py", "book/findings.py",
                 "book/evidence_export.py"):
        if (package_copy / name).exists():
            _edit(package_copy / name)
    assert {s: cache.code_version(s) for s in scopes} == before
    assert cache.code_version() != whole  # a book page (whole-package stamp) is re-rendered


@pytest.mark.parametrize("edited, changes, keeps", [
    ("core/geometry.py", ["faithfulness", "sinks", "analysis"], []),
    ("stats.py", ["faithfulness", "sinks", "analysis"], []),
    ("analysis.py", ["analysis"], ["faithfulness", "sinks"]),
])
def test_producing_code_edits_invalidate_exactly_their_results(package_copy, edited, changes, keeps):
    before = {s: cache.code_version(s) for s in changes + keeps}
    _edit(package_copy / edited)
    for s in changes:
        assert cache.code_version(s) != before[s], s
    for s in keeps:
        assert cache.code_version(s) == before[s], s


def test_a_subpackage_scope_covers_all_its_files(package_copy):
    name = "faithfulness" if (package_copy / "faithfulness").is_dir() else None
    if name is None:
        pytest.skip("faithfulness is a single module")
    before = cache.code_version(name)
    files = sorted((package_copy / name).glob("*.py"))
    _edit(files[-1])
    assert cache.code_version(name) != before
