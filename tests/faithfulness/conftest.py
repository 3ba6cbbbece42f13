"""Fixtures of the faithfulness tests: a peaked tiny Llama on its own samples, and one sweep over it."""

from __future__ import annotations

import pytest

from cwcore import faithfulness as fa
from faith_helpers import peaked_llama, self_sampled


@pytest.fixture(scope="session")
def peaked():
    model = peaked_llama()
    return model, self_sampled(model)


@pytest.fixture(scope="session")
def sweep(peaked):
    model, ids = peaked
    return fa.faithfulness_curve(model, None, ids, ratios=[0, 0.2, 0.5], batch_size=6, progress=False).per_sequence
