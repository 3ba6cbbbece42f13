"""Shared fixtures: the tiny randomly initialised models every test folder uses.

``tests/`` is on ``sys.path`` (this file's folder, pytest's rootdir conftest), so test modules in
any sub-folder import the factories directly (``from tiny_models import tiny_model``) or take the
fixtures below.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tiny_models import DECODERS, FAMILIES, VOCAB, tiny_model, tiny_vit  # noqa: F401  (re-exported)

#: torch's own number of intra-op threads, kept for the `slow` tests (packaged models, whose matrix products a
#: second thread does speed up on an idle machine)
DEFAULT_THREADS = torch.get_num_threads()
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)  # the test modules' imports (some build a tiny model), before the first test


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """One intra-op thread for every test not marked `slow`, unless OMP_NUM_THREADS says otherwise: their models
    are tiny, so a second thread only adds synchronisation, and on a busy machine each parallel region waits for
    a descheduled thread (measured under load: the quick tier's CPU time 59 s against more than 200 s with 2
    threads, the zoo's 136 tests 1.7 s against 40 s). The ranks of cwcore.runs are single-threaded too."""
    if "OMP_NUM_THREADS" not in os.environ:
        threads = DEFAULT_THREADS if item.get_closest_marker("slow") else 1
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# Test tiers: `make check` runs `-m "not slow and not browser and not book"` (the edit loop, minutes);
# `make test` runs everything. A test that needs the real smoke book is marked `book` here, from its
# fixtures, so that no test has to remember it.
# --------------------------------------------------------------------------------------------------
QUICK_TIER = "not slow and not browser and not book"
#: the library's own quick tier (`make check-library`): no test of the book's production or of the repository
LIBRARY_TIER = QUICK_TIER + " and not production"
#: test files about the repository around the library (its pages, workflows, release, layout), not the library
REPOSITORY_TESTS = {"test_layout.py", "test_project.py", "test_release.py", "test_workflows.py", "test_user_text.py",
                    "test_readme.py", "test_thin_notebooks.py", "test_thin_notebooks_sinks.py", "test_exercises.py"}
_IMPORTS_THE_BOOK = re.compile(r"^\s*(?:import cwbook|from cwbook[ .])", re.M)


def _is_production(path) -> bool:
    """A test file of the book's production (it imports cwbook) or of the repository around the library."""
    name = str(path)
    if name not in _PRODUCTION:
        text = path.read_text(encoding="utf-8") if path.suffix == ".py" else ""
        _PRODUCTION[name] = path.name in REPOSITORY_TESTS or bool(_IMPORTS_THE_BOOK.search(text))
    return _PRODUCTION[name]


_PRODUCTION: dict[str, bool] = {}


def _excludes_production(markexpr: str) -> bool:
    """Whether ``-m`` deselects every ``production`` test whatever its other markers: ``not production`` is one
    of the expression's top-level ``and`` terms (an expression with ``or`` or parentheses is not analysed)."""
    if "(" in markexpr or re.search(r"\bor\b", markexpr):
        return False
    return "not production" in {" ".join(term.split()) for term in re.split(r"\band\b", markexpr)}


def pytest_ignore_collect(collection_path, config):
    """`make check-library` does not import the test files it would deselect whole (the book's production
    imports cwbook, papermill and the notebook machinery): seconds of collection saved, the same tests run."""
    if (collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and _excludes_production(config.getoption("markexpr") or "") and _is_production(collection_path)):
        return True
    return None


try:  # what pandas 3 says pandas 4 will refuse (text or bools filled into a float column, ...) fails a test here
    from pandas.errors import Pandas4Warning  # noqa: F401
    _PANDAS_4 = pytest.mark.filterwarnings("error::pandas.errors.Pandas4Warning")
except ImportError:  # pandas 2, which pyproject.toml allows, has no such warning
    _PANDAS_4 = None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _PANDAS_4 is not None:
            item.add_marker(_PANDAS_4)
        if "smoke_book" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.book)
        if _is_production(item.path):
            item.add_marker(pytest.mark.production)


@pytest.fixture
def tiny():
    """The factory ``tiny(family, seed=0, dtype=torch.float32)`` of 2-layer, 4-head, width-64 models."""
    return tiny_model


@pytest.fixture(params=DECODERS)
def tiny_decoder(request):
    """One tiny decoder per supported family (parametrised)."""
    return tiny_model(request.param)


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


# --------------------------------------------------------------------------------------------------
# The real book, built once per test session with the smoke profile (tests/test_book.py,
# tests/test_exercises.py)
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smoke_code_version():
    """cwcore's code hash when the session's smoke book was built. A test that rebuilds it sets
    ``cwcore.cache.code_version`` to this, so that edits to cwcore/ while the tests run (a developer's
    tree) do not make the rebuild execute the notebooks again."""
    from cwcore import cache

    return cache.code_version()


@pytest.fixture(scope="session")
def smoke_book(tmp_path_factory, smoke_code_version):
    """The real book (book/*.md, _config.yml, run.yml, notebooks/) built with the smoke profile, once
    per session: ``(book_dir, build_dir, html_dir)``; the executed notebooks are in
    ``book_dir/generated``."""
    import shutil
    from pathlib import Path

    import cwbook as book

    from cwcore import cache
    repo = Path(__file__).resolve().parent.parent
    root = tmp_path_factory.mktemp("smoke")
    bookdir = root / "book"
    shutil.copytree(repo / "book", bookdir, ignore=shutil.ignore_patterns("_build", "generated", "_toc.yml"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache, "code_version", lambda: smoke_code_version)
        html = book.build(profile="smoke", book_dir=bookdir, build_dir=root / "build")
    return bookdir, root / "build", html
