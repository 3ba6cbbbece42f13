"""Blocks are numbered by behaviour, not by class name: a block that calls the attention interface or computes a
softmax is a softmax attention block; a linear-attention block named "...Attention" in a hybrid is not numbered,
so ``layers=None`` decomposes every softmax layer of the hybrid exactly.
"""

from __future__ import annotations

import pytest
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


def test_a_bert_decoders_cross_attention_is_numbered_and_decomposed_exactly():
    """BertCrossAttention was excluded by its class name: its BertAttention wrapper was numbered instead and
    refused as having no output projection (it has one, output.dense). It is a softmax block like the others:
    queries from the decoder, keys and values from ``encoder_hidden_states``."""
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, is_decoder=True, add_cross_attention=True)
    model = BertLMHeadModel(config).eval()
    blocks = attention_blocks(model)
    assert [b.name for b in blocks] == [f"bert.encoder.layer.{i}.{kind}.self" for i in (0, 1)
                                        for kind in ("attention", "crossattention")]
    assert all(b.unsupported is None for b in blocks)
    ids, encoder = IDS[:1, :6], torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(3))
    seen = {}
    cross = model.bert.encoder.layer[1].crossattention
    cross.register_forward_hook(lambda m, args, kwargs, out: seen.update(x=args[0] if args else
                                                                        kwargs["hidden_states"]), with_kwargs=True)
    d = cwcore.decompose(model, input_ids=ids, encoder_hidden_states=encoder)
    assert d.layers == [0, 1, 2, 3] and d.cross_attention
    # the naive cross-attention of layer 3 in float64, from the block's own input
    att = cross.self
    x, e = seen["x"][0].double(), encoder[0].double()
    heads, size = 4, 8
    q = (x @ att.query.weight.double().T + att.query.bias.double()).view(6, heads, size).transpose(0, 1)
    k = (e @ att.key.weight.double().T + att.key.bias.double()).view(5, heads, size).transpose(0, 1)
    v = (e @ att.value.weight.double().T + att.value.bias.double()).view(5, heads, size).transpose(0, 1)
    alpha = torch.softmax(q @ k.transpose(1, 2) / size ** 0.5, dim=-1)  # [head, query, key]
    w_o = cross.output.dense.weight.double().view(32, heads, size)  # [model, head, head_dim]
    projected = torch.einsum("hjd,mhd->hjm", v, w_o)  # [head, key, model]: v~_j = v_j W_O^h
    terms = alpha[..., None] * projected[:, None]  # [head, query, key, model]
    output = terms.sum((0, 2))  # [query, model], the output projection's input times W_O, no bias
    expected = torch.einsum("hqkm,qm->hqk", terms, output) / (output * output).sum(-1)[None, :, None]
    torch.testing.assert_close(d[3].attention[0].double(), alpha, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d[3].contribution("inter")[0].double(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="^to_frame: this decomposition is of a model with cross-attention"):
        d.to_frame()  # its keys are encoder states: input_ids' tokens would name them
    with pytest.raises(cwcore.UnsupportedModelError, match="has cross-attention layers, whose keys are encoder"):
        cwcore.attribute(model, method="rollout", input_ids=ids, encoder_hidden_states=encoder)


def test_cross_attention_given_no_encoder_states_did_not_run_named_by_layers_none_refused_by_number():
    """Without encoder_hidden_states BERT's decoder skips its cross-attention: every layer of that forward is
    decomposed with the two that did not run named in a warning and in ``undecomposable``; asked for by number,
    a layer that did not run is refused."""
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, is_decoder=True, add_cross_attention=True)
    model = BertLMHeadModel(config).eval()
    ids = IDS[:1, :6]
    for call in (cwcore.decompose, cwcore.summarize):
        with pytest.warns(UserWarning, match=r"attention layers \[1, 3\] .* did not run in this forward pass"):
            result = call(model, input_ids=ids)
        assert result.layers == [0, 2] and sorted(result.undecomposable) == [1, 3]
        with pytest.raises(cwcore.UnsupportedModelError, match=r"attention layers \[3\] .* did not run in the"):
            call(model, layers=[2, 3], input_ids=ids)
    with pytest.warns(UserWarning, match="did not run"):
        d = cwcore.decompose(model, input_ids=ids)
    with pytest.raises(KeyError, match="layer 3 cannot be decomposed: it did not run in this forward pass"):
        d[3]  # noqa: B018, the lookup is the test
