"""Shared fixtures: the tiny randomly initialised models every test folder uses.

``tests/`` is on ``sys.path`` (this file's folder, pytest's rootdir conftest), so test modules in
any sub-folder import the factories directly (``from tiny_models import tiny_model``) or take the
fixtures below.
"""

from __future__ import annotations

import pytest

from tiny_models import DECODERS, FAMILIES, VOCAB, tiny_model, tiny_vit  # noqa: F401  (re-exported)


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
