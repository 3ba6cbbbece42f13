"""The test tiers' own machinery in tests/conftest.py: one torch thread for quick tests, production files not
imported when `-m` deselects them whole."""

import os

import pytest
import torch

import conftest


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
def test_only_an_expression_that_deselects_every_production_test_skips_their_files(markexpr, excluded):
    assert conftest._excludes_production(markexpr) is excluded
