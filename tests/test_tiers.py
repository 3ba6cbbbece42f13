"""The test tiers' own machinery in tests/conftest.py: one torch thread for quick tests, production files not
imported when `-m` deselects them whole."""

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture
def root_conftest(pytestconfig):
    """tests/conftest.py as pytest loaded it (``import conftest`` may find a sub-folder's)."""
    return pytestconfig.pluginmanager.get_plugin(str(Path(__file__).resolve().parent / "conftest.py"))


@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="OMP_NUM_THREADS sets the threads instead")
def test_a_quick_test_runs_on_one_torch_thread():
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("markexpr, excluded", [
    ("not slow and not browser and not book and not production", True),  # make check-library
    ("not  production", True),
    ("not slow and not browser and not book", False),  # make check
    ("production", False),
    ("not slow or not production", False),  # an `or` is not analysed: nothing is skipped at collection
    ("not (slow and production)", False),
    ("not productionish", False),
    ("", False),
])
def test_only_an_expression_that_deselects_every_production_test_skips_their_files(root_conftest, markexpr,
                                                                                  excluded):
    assert root_conftest._excludes_production(markexpr) is excluded
