"""decompose's entry: inputs given positionally, a torch.compile'd model, a model without weights, and the
NaN-at-padding convention (each reproduced against the model's own eager call or its unpadded sequence)."""
from __future__ import annotations

import pytest
import torch

import cwcore
from cwcore.core.inputs import InputError
from tiny_models import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _inputs():
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second row left-padded
    return {"input_ids": ids, "attention_mask": mask}


def test_inputs_as_one_mapping_equal_the_keywords(model):
    from transformers import BatchEncoding

    enc = BatchEncoding(_inputs())
    by_keywords = cwcore.decompose(model, **enc)
    for given in (enc, dict(enc)):
        positional = cwcore.decompose(model, given)
        for layer in by_keywords.layers:
            torch.testing.assert_close(positional[layer].attention, by_keywords[layer].attention, equal_nan=True)
    with pytest.raises(InputError, match="input_ids=tensor"):
        cwcore.decompose(model, enc["input_ids"])


def test_a_compiled_model_is_decomposed_through_the_module_it_wraps(model):
    compiled = torch.compile(model, backend="eager")
    ids = _inputs()["input_ids"]
    got = cwcore.decompose(compiled, input_ids=ids)
    want = cwcore.decompose(model, input_ids=ids)
    for layer in want.layers:
        torch.testing.assert_close(got[layer].contribution("inter"), want[layer].contribution("inter"))


def test_a_compiled_model_is_decomposed_eagerly_under_its_modules_own_block_names(model):
    """The test above compares numbers only, and backend="eager" runs cwcore's hooks faithfully through dynamo, so a
    decompose that never unwrapped the compiled model passed it. Here a backend counts the graphs dynamo hands it:
    none while decomposing (the wrapped module runs eagerly), and the block names carry no "_orig_mod." prefix.
    A plain call of the compiled model afterwards is the control that the counter does count."""
    import torch._dynamo

    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    torch._dynamo.reset()  # no graph cached by an earlier test is reused without reaching the backend
    try:
        compiled = torch.compile(model, backend=counting)
        ids = _inputs()["input_ids"]
        got = cwcore.decompose(compiled, input_ids=ids)
        dynamo_graphs = len(graphs)
        want = cwcore.decompose(model, input_ids=ids)
        assert [got[layer].block_name for layer in got.layers] == [want[layer].block_name for layer in want.layers]
        assert got[0].block_name == "model.layers.0.self_attn"
        assert dynamo_graphs == 0, f"dynamo compiled {dynamo_graphs} graphs while decomposing"
        with torch.no_grad():
            compiled(input_ids=ids)
        assert len(graphs) > 0  # the control: the compiled forward does go through the counting backend
    finally:
        torch._dynamo.reset()


def test_a_model_without_weights_is_refused_in_one_line():
    with torch.device("meta"):
        empty = tiny_model("llama")
    with pytest.raises(InputError, match="meta device.*load them first"):
        cwcore.decompose(empty, input_ids=torch.ones(1, 4, dtype=torch.long))


def test_padded_query_rows_are_nan_and_the_real_rows_equal_the_unpadded_sequence_term_by_term(model):
    """The NaN-safe sum of the padded row equalled the unpadded sequence's sum, but both are the number of real
    queries (inter weights sum to one per query), so weights moved to other keys (the key axis reversed) passed.
    The real block is now compared entry by entry with the unpadded sequence, and the padded keys weigh zero."""
    inputs = _inputs()
    d = cwcore.decompose(model, **inputs)
    weights = d[0].contribution("inter")  # [batch, head, query, key]
    assert torch.isnan(weights[1, :, :2]).all() and not torch.isnan(weights[0]).any()
    assert torch.isnan(weights.sum())
    alone = cwcore.decompose(model, input_ids=inputs["input_ids"][1:, 2:])[0].contribution("inter")
    torch.testing.assert_close(weights[1, :, 2:, 2:], alone[0], rtol=1e-5, atol=1e-6)
    assert (weights[1, :, 2:, :2] == 0).all()  # the padded keys: real queries give them exactly zero weight
    torch.testing.assert_close(weights[1:].nansum(), alone.sum(), rtol=1e-5, atol=1e-5)
