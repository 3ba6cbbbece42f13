"""Refusals name the measured cause: each refusal class is checked against a recorded probe of the attention
calls (their count, query and key sizes: a recording attention function registered with transformers,
independent of cwcore) or of what the module cwcore took as W_O received.
"""

from __future__ import annotations

import re

import pytest
import torch

import cwcore
from zoo_models import VOCAB, qwen2_vl, qwen2_vl_inputs, qwen2_vl_row, recorded_attention_calls, zoo_model


def test_a_vision_tower_with_several_images_is_refused_for_its_per_image_calls():
    """Two images: the tower calls attention once per image; the refusal must say so with the measured query
    sizes (not 'as differential attention does'), and the language layers stay decomposable."""
    model, row = qwen2_vl(), qwen2_vl_row(images=2)
    inputs = qwen2_vl_inputs(row)
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(**inputs)
    tower = model.model.visual.blocks[0].attn
    sizes = [(q, k) for module, q, k, _ in calls if module is tower]
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
    sizes = [(q, k) for module, q, k, _ in calls if module is first]
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
    assert len([c for c in calls if c[0] is attention]) == 1  # one softmax map per layer...
    assert received[0] != heads * head_dim  # ...but o_b_proj does not receive the attention output
    expected = (rf"`o_b_proj`, which cwcore took as its output projection W_O .* takes inputs of width {received[0]}, "
                rf"but the attention output has {heads} heads x {head_dim} = {heads * head_dim} values per token")
    with pytest.raises(cwcore.UnsupportedModelError, match=expected):
        cwcore.decompose(model, **{k: v for k, v in inputs.items()})
