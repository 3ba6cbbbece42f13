"""The re-quantised weight variant of the packaged GGUF models (a sensitivity check of the 4-bit confound)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cwcore import models
from tiny_models import tiny_model


def _linear_weights(model):
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_requantize_moves_every_decoder_projection_onto_a_4_bit_grid_and_nothing_else():
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    changes = models.requantize_weights(model, "Q4_0", original="Q4_1")
    assert set(changes) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for name, param in model.named_parameters():
        moved = not torch.equal(param, before[name])
        assert moved == (".layers." in f".{name}" and name.endswith("proj.weight")), name
        if moved:
            blocks = param.detach().reshape(-1, 32).numpy()
            # Q4_0: each block of 32 is d * (q - 8) with q in 0..15: at most 16 levels, one common step
            assert max(len(np.unique(b)) for b in blocks) <= 16
            change = torch.linalg.norm(param - before[name]) / torch.linalg.norm(before[name])
            assert 0.01 < change < 0.25, name
    for values in changes.values():
        assert 0.01 < values["relative_change"] < 0.25 and 0.01 < values["proxy_original_error"] < 0.25
    again = _linear_weights(model)
    models.requantize_weights(model, "Q4_0")  # weights already on the Q4_0 grid stay where they are
    for name, weight in _linear_weights(model).items():
        assert torch.equal(weight, again[name]), name


def test_variants_are_refused_where_they_do_not_exist():
    with pytest.raises(ValueError, match="variant must be one of"):
        models.load_model("smollm2-135m", variant="half")
    with pytest.raises(ValueError, match="packaged GGUF models"):
        models.load_model("minilm-l6", variant="requantized")
