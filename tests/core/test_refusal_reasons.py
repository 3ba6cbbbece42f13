"""Refusals name the measured cause: each refusal class is checked against a recorded probe of the attention
calls (their count, query and key sizes: a recording attention function registered with transformers,
independent of cwcore) or of what the module cwcore took as W_O received.
"""

from __future__ import annotations

import re

import pytest
import torch

import cwcore
from cwcore.core.architectures import attention_blocks
from zoo_models import VOCAB, qwen2_vl, qwen2_vl_inputs, qwen2_vl_row, recorded_attention_calls, zoo_model


def test_a_vision_tower_with_several_images_is_refused_for_its_per_image_calls():
    """Two images: the tower calls attention once per image; the refusal must say so with the measured query
    sizes (not 'as differential attention does'), and the language layers stay decomposable."""
    model, row = qwen2_vl(), qwen2_vl_row(images=2)
    inputs = qwen2_vl_inputs(row)
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(**inputs)
    tower = model.model.visual.blocks[0].attn
    sizes = [(c.queries, c.keys) for c in calls if c.module is tower]
    assert len(sizes) == 2 and all(q == k for q, k in sizes)  # the probe: 2 calls, one per image
    tokens = row["pixel_values"].shape[0]
    assert sum(q for q, _ in sizes) == tokens
    expected = (rf"'model.visual.blocks.0.attn' \(VisionAttention\) calls the attention function {len(sizes)} times per "
                rf"layer, once per segment of its {tokens} tokens \(query sizes {re.escape(str([q for q, _ in sizes]))}")
    with pytest.raises(cwcore.UnsupportedModelError, match=expected) as refusal:
        cwcore.decompose(model, **inputs)
    assert "differential" not in str(refusal.value)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    d = cwcore.decompose(model, layers=[2, 3], **inputs)  # the language layers: exact
    torch.testing.assert_close(d.outputs.logits, eager.logits, rtol=0, atol=1e-6)
    for layer, eager_map in zip((2, 3), eager.attentions):
        torch.testing.assert_close(d.attention[layer], eager_map, rtol=0, atol=1e-6)


def test_differential_attention_is_refused_for_its_two_maps_over_the_same_queries():
    model = zoo_model("diffllama")
    ids = torch.randint(2, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(input_ids=ids)
    first = model.model.layers[0].self_attn
    sizes = [(c.queries, c.keys) for c in calls if c.module is first]
    assert sizes == [(7, 7), (7, 7)]  # the probe: two maps over all 7 queries
    with pytest.raises(cwcore.UnsupportedModelError,
                       match=r"calls the attention function 2 times per layer, each time over all its 7 queries: it "
                             r"combines 2 attention maps into one output \(as differential attention does"):
        cwcore.decompose(model, input_ids=ids)


@pytest.mark.parametrize("padded", [False, True])
def test_a_grouped_low_rank_output_projection_is_refused_before_any_geometry(padded):
    """DeepSeek-V4 applies W_O as a grouped low-rank pair (o_a_proj per group, then o_b_proj); cwcore's structural
    guess takes o_b_proj. Padded, the head geometry was built before the shape check and crashed (RuntimeError):
    both must be the refusal, with the widths the probe measures."""
    model = zoo_model("deepseek_v4")
    ids = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    inputs = dict(input_ids=ids)
    if padded:
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, :3] = 0
        inputs["attention_mask"] = mask
    attention = model.model.layers[0].self_attn
    received = []
    handle = attention.o_b_proj.register_forward_pre_hook(lambda module, args: received.append(args[0].shape[-1]))
    try:
        with torch.no_grad(), recorded_attention_calls(model) as calls:
            model(**inputs)
    finally:
        handle.remove()
    heads, head_dim = attention.config.num_attention_heads, attention.head_dim
    assert len([c for c in calls if c.module is attention]) == 1  # one softmax map per layer...
    assert received[0] != heads * head_dim  # ...but o_b_proj does not receive the attention output
    expected = (rf"`o_b_proj`, which cwcore took as its output projection W_O .* takes inputs of width {received[0]}, "
                rf"but the attention output has {heads} heads x {head_dim} = {heads * head_dim} values per token")
    with pytest.raises(cwcore.UnsupportedModelError, match=expected):
        cwcore.decompose(model, **{k: v for k, v in inputs.items()})


def test_a_block_that_never_calls_the_attention_interface_is_refused_for_it():
    """GPT-Neo computes attention in its own code: the probe records no call from its blocks."""
    model = zoo_model("gpt_neo")
    ids = torch.randint(2, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(input_ids=ids)
    block = attention_blocks(model)[0]
    assert not [c for c in calls if c.module is block.module]
    with pytest.raises(cwcore.UnsupportedModelError,
                       match=rf"attention block '{re.escape(block.name)}' .*did not run through cwcore's attention "
                             "function: it does not call transformers' attention interface"):
        cwcore.decompose(model, input_ids=ids)


def test_a_keyword_cwcore_does_not_implement_is_named_as_the_call_passed_it():
    """DeepSeek-V3.2's indexer passes its top-k keys as `indices=`: the probe records the keyword."""
    model = zoo_model("deepseek_v32")
    ids = torch.randint(2, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(input_ids=ids)
    first = model.model.layers[0].self_attn
    assert "indices" in [k for c in calls if c.module is first for k in c.keywords]
    with pytest.raises(cwcore.UnsupportedModelError, match=r"'model.layers.0.self_attn' \(DeepseekV32Attention\) "
                                                           r"passes `indices` to the attention function"):
        cwcore.decompose(model, input_ids=ids)


def test_a_gate_before_the_output_projection_is_refused_with_the_measured_difference():
    """Qwen3-Next multiplies the attention output by a gate before o_proj: the refusal's max |difference| is the
    one between the probe's attention output and what o_proj received."""
    model = zoo_model("qwen3_next")
    ids = torch.randint(2, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    attention = attention_blocks(model)[0].module
    received = []
    handle = attention.o_proj.register_forward_pre_hook(lambda module, args: received.append(args[0].detach().clone()))
    try:
        with torch.no_grad(), recorded_attention_calls(model) as calls:
            model(input_ids=ids)
    finally:
        handle.remove()
    (produced,) = [c.output for c in calls if c.module is attention]
    difference = float((received[0] - produced.reshape(received[0].shape)).abs().max())
    assert difference > 1e-3
    with pytest.raises(cwcore.UnsupportedModelError, match="output projection received something other") as refusal:
        cwcore.decompose(model, input_ids=ids)
    stated = float(re.search(r"max \|difference\| ([0-9.e+-]+)", str(refusal.value)).group(1))
    assert stated == pytest.approx(difference, rel=5e-3)  # the message prints 3 significant digits


def test_a_module_shared_across_layers_is_refused_for_its_repeated_runs():
    """ALBERT runs one attention module in every layer: the probe records 2 calls from it in one forward."""
    model = zoo_model("albert")
    ids = torch.randint(2, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(input_ids=ids)
    block = attention_blocks(model)[0]
    runs = len([c for c in calls if c.module is block.module])
    assert runs == 2
    with pytest.raises(cwcore.UnsupportedModelError, match=rf"ran {runs} times in one forward pass: its weights are "
                                                           "shared across layers"):
        cwcore.decompose(model, input_ids=ids)


def test_a_wrapped_output_projection_is_named_not_replaced_by_a_guess():
    """An o_proj wrapped by a LoRA-style adapter: cwcore took v_proj (another linear child) as W_O and refused with
    "no registered name matched"; value zeroing and ALTI crashed with a bare RuntimeError on its shape."""
    import cwcore
    from torch import nn
    from tiny_models import VOCAB, tiny_model

    class Adapter(nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base_layer, self.A = base, nn.Linear(base.in_features, 2, bias=False)
            self.B = nn.Linear(2, base.out_features, bias=False)

        def forward(self, x):
            return self.base_layer(x) + self.B(self.A(x))

    model = tiny_model("llama")
    attention = model.model.layers[1].self_attn
    attention.o_proj = Adapter(attention.o_proj).eval()
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    reason = r"`o_proj` of LlamaAttention is a Adapter wrapping a linear layer .*merge_and_unload"
    with pytest.raises(cwcore.UnsupportedModelError, match=reason):
        cwcore.decompose(model, input_ids=ids, layers=[1])
    for method in ("value_zeroing", "alti"):
        with pytest.warns(UserWarning):
            scores = cwcore.attribute(model, {"input_ids": ids}, method=method)
        assert scores.layers == [0] and re.search(reason, scores.undecomposable[1])


def test_a_shared_output_projection_is_refused_for_what_it_is():
    """One o_proj module used by two layers was refused as "does not call transformers' attention interface", which
    is false (the hooks of one block fired on the other's calls of the shared module)."""
    import cwcore
    from tiny_models import VOCAB, tiny_model

    model = tiny_model("llama")
    model.model.layers[1].self_attn.o_proj = model.model.layers[0].self_attn.o_proj
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    for layers in (None, [0], [1]):
        shared = r"'model.layers.0.self_attn' and 'model.layers.1.self_attn' share one output projection"
        with pytest.raises(cwcore.UnsupportedModelError, match=shared):
            cwcore.decompose(model, input_ids=ids, layers=layers)
