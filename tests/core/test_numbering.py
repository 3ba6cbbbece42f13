"""Blocks are numbered by behaviour, not by class name: a block that calls the attention interface or computes a
softmax is a softmax attention block; a linear-attention block named "...Attention" in a hybrid is not numbered,
so ``layers=None`` decomposes every softmax layer of the hybrid exactly.
"""

from __future__ import annotations

import torch

import cwcore
from cwcore.core.architectures import _SoftmaxProbe, attention_blocks
from zoo_models import VOCAB, ZOO, minimax_hybrid, recorded_attention_calls, zoo_model

IDS = torch.randint(2, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))


def test_a_linear_attention_block_named_attention_is_not_numbered():
    model = minimax_hybrid()
    lightning, softmax = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert type(lightning).__name__ == "MiniMaxLightningAttention"  # the name says attention...
    with torch.no_grad(), recorded_attention_calls(model) as calls:
        model(input_ids=IDS)
    with torch.no_grad():
        eager = model(input_ids=IDS, output_attentions=True)
    assert [c.module for c in calls] == [softmax]  # ...but only layer 1 calls the attention interface
    blocks = attention_blocks(model)
    assert [(b.layer, b.module) for b in blocks] == [(0, softmax)]
    d = cwcore.decompose(model, input_ids=IDS)  # layers=None: every softmax layer, exact
    assert d.layers == [0] and d[0].block_name == "model.layers.1.self_attn"
    torch.testing.assert_close(d.outputs.logits, eager.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(d.attention[0], eager.attentions[1], rtol=0, atol=1e-6)
    sums = d.inter[0].sum((1, 3))
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4)
    torch.testing.assert_close(cwcore.decompose(model, layers=[-1], input_ids=IDS).inter[0], d.inter[0],
                               rtol=0, atol=0)


def test_a_block_with_its_own_softmax_code_keeps_its_number_and_is_refused_when_it_runs():
    """GPT-Neo computes softmax attention in its own code: numbered (the probe sees its softmax), then refused
    at run time because it does not call the attention interface."""
    model = zoo_model("gpt_neo")
    blocks = attention_blocks(model)
    assert len(blocks) == ZOO["gpt_neo"].blocks
    probe = _SoftmaxProbe([b.module for b in blocks])
    try:
        with torch.no_grad(), probe:
            model(input_ids=IDS)
    finally:
        for handle in probe.handles:
            handle.remove()
    assert probe.softmax == {id(b.module) for b in blocks}
