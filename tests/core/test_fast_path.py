"""Layers a session does not touch keep the model's SDPA attention; touched layers stay exact."""

import pytest
import torch
import transformers

import cwcore
from cwcore.core.decomposition import prepare_inputs
from cwcore.core import attention
from tiny_models import VOCAB, tiny_model

IDS = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))


def _sdpa(family):
    model = tiny_model(family)
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_one_recorded_layer_runs_eager_the_others_sdpa(family, padded, monkeypatch):
    model = _sdpa(family)
    mask = torch.ones_like(IDS)
    if padded:
        mask[1, :3] = 0
    inputs = dict(input_ids=IDS, attention_mask=mask)
    eager_calls = []
    original = attention.AttentionSession.on_attention

    def counting(self, module, *args):
        eager_calls.append(self.blocks[[b.module for b in self.blocks].index(module)].layer)
        return original(self, module, *args)

    monkeypatch.setattr(attention.AttentionSession, "on_attention", counting)
    d = cwcore.decompose(model, layers=1, **inputs)
    assert eager_calls == [1]  # layer 0 went through SDPA, not cwcore's eager arithmetic
    monkeypatch.undo()
    with torch.no_grad():
        sdpa_logits = model(**prepare_inputs(model, inputs)).logits
    # the model's own SDPA forward and the decomposed one differ only by eager-vs-SDPA rounding in layer 1
    real = mask.bool()
    torch.testing.assert_close(d.outputs.logits[real], sdpa_logits[real], rtol=1e-4, atol=1e-5)
    everything = cwcore.decompose(model, **inputs)  # all layers touched: eager everywhere, no fast path
    torch.testing.assert_close(d.inter[1], everything.inter[1], rtol=1e-4, atol=1e-5, equal_nan=True)


def test_no_fast_path_for_eager_models_and_when_every_layer_is_touched():
    model = tiny_model("llama")
    session = attention.AttentionSession(model, observers={0: [lambda c: None]})
    with attention.cwcore_attention(model, session):
        assert session.fast_path is None  # configured eager: cwcore's function is eager's arithmetic
    model = _sdpa("llama")
    session = attention.AttentionSession(model, observers=attention.every_layer(model, lambda c: None))
    with attention.cwcore_attention(model, session):
        assert session.fast_path is None
    session = attention.AttentionSession(model, observers={0: [lambda c: None]})
    with attention.cwcore_attention(model, session):
        assert session.fast_path is not None
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_blockwise_probabilities_of_an_sdpa_model_equal_eager(family, padded, monkeypatch):
    """A model configured for SDPA gets its recorded layers' softmax a block of queries at a time (keys every
    row of a block masks are skipped); blocks of 3 queries here, so causal, padded and sliding-window
    blocks all occur. Against the same model configured eager (eager's own arithmetic): probabilities to
    float32 rounding, exact zeros where eager has them, and every output within the self-check's tolerance."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 3)
    mask = torch.ones_like(IDS)
    if padded:
        mask[1, :4] = 0
    inputs = dict(input_ids=IDS, attention_mask=mask)
    model = tiny_model(family)
    eager = cwcore.decompose(model, **inputs)
    model.config._attn_implementation = "sdpa"
    calls = []
    original = attention._probs_in_chunks
    monkeypatch.setattr(attention, "_probs_in_chunks", lambda *a: calls.append(1) or original(*a))
    blockwise = cwcore.decompose(model, **inputs)
    assert len(calls) == len(eager.layers)  # every layer went through the blockwise path
    for layer in eager.layers:
        a, b = eager.attention[layer], blockwise.attention[layer]
        torch.testing.assert_close(b, a, rtol=0, atol=2e-7, equal_nan=True)
        assert torch.equal(a == 0, b == 0)
        torch.testing.assert_close(blockwise.inter[layer], eager.inter[layer], rtol=1e-4, atol=1e-5, equal_nan=True)
    real = mask.bool()
    torch.testing.assert_close(blockwise.outputs.logits[real], eager.outputs.logits[real], rtol=1e-4, atol=1e-5)


def _second_call(model, cache_kind):
    """The call under test and a cache for it: 3 tokens after a 6-token prefix in a dynamic cache, or a 6-token
    prefill into an empty static cache of 16 slots (SDPA's mask is then None: keys outnumber queries)."""
    ids = IDS[:1, :9]
    if cache_kind == "dynamic":
        with torch.no_grad():
            cache = model(input_ids=ids[:, :6], use_cache=True).cache
        return dict(input_ids=ids[:, 6:], cache=cache, use_cache=True)
    return dict(input_ids=ids[:, :6], cache=transformers.StaticCache(config=model.config, max_cache_len=16),
                use_cache=True)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("layers", [[1], None])
def test_a_call_with_more_keys_than_queries_is_exact_against_eager(cache_kind, layers):
    """With a cache, keys outnumber queries. Under SDPA a static cache's prefill gets no mask (SDPA's is_causal,
    top-left aligned: query i sees keys 0..i, the empty slots never); the recorded layer must compute what the
    model computes there, as must the decomposition of a dynamic cache's second call (an explicit mask)."""
    model = tiny_model("llama")
    with torch.no_grad():
        eager = model(**_second_call(model, cache_kind), output_attentions=True)
    model.config._attn_implementation = "sdpa"
    d = cwcore.decompose(model, layers=layers, **_second_call(model, cache_kind))
    torch.testing.assert_close(d.outputs.logits, eager.logits, rtol=0, atol=1e-5)
    for layer in d.layers:
        torch.testing.assert_close(d.attention[layer], eager.attentions[layer], rtol=0, atol=1e-6)
