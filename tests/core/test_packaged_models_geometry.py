"""The decomposition on the real packaged models: the model's own outputs are the reference."""

import pytest
import torch

import cwcore
from cwcore.core.decomposition import prepare_inputs
from cwcore.core.architectures import attention_blocks
from test_decompose import ATOL, RTOL, capture_projections

TEXT = "Contribution weights account for the geometry of value vectors, not only for attention."


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "minilm-l6"])
def test_packaged_model_decomposition_reconstructs_its_outputs(name):
    model, tokenizer = cwcore.load_model(name)
    inputs = dict(tokenizer([TEXT, TEXT[:40]], return_tensors="pt", padding=True))
    inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    layers = [0, len(attention_blocks(model)) - 1]
    d = cwcore.decompose(model, layers=layers, **inputs)
    with torch.no_grad():
        plain = model(**prepare_inputs(model, inputs))
    first = "logits" if hasattr(plain, "logits") else "last_hidden_state"
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(getattr(d.outputs, first)[valid], getattr(plain, first)[valid], rtol=0, atol=1e-5)
    captured = capture_projections(model, **prepare_inputs(model, inputs))
    for layer in layers:
        output = captured[layer][1]
        torch.testing.assert_close(d.output_norm[layer][valid], output.norm(dim=-1)[valid], rtol=RTOL, atol=1e-4)
        inter_sum = d.inter[layer].sum((1, 3))[valid]
        torch.testing.assert_close(inter_sum, torch.ones_like(inter_sum), rtol=RTOL, atol=ATOL)
        intra_sum = d.intra[layer].sum(-1).transpose(1, 2)[valid]
        finite = intra_sum.isfinite()
        assert finite.float().mean() > 0.99  # NaN only where a head's output norm is exactly zero
        torch.testing.assert_close(intra_sum[finite], torch.ones_like(intra_sum[finite]), rtol=RTOL, atol=1e-4)
