"""The attention session: transforms change a layer, observers read it; both against eager and naive sums."""

import pytest
import torch

import cwcore
from cwcore.core.attention import AttentionSession, cwcore_attention, every_layer
from cwcore.core.decomposition import LayerDecomposition
from tiny_models import VOCAB, tiny_model


def _ids(batch=2, length=7, seed=3):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_observers_see_every_layer_with_eager_probabilities():
    model = tiny_model("llama")
    ids = _ids()
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True)
    seen = {}
    session = AttentionSession(model, observers=every_layer(model, lambda call: seen.setdefault(call.layer, call.probs.clone())))
    with torch.no_grad(), cwcore_attention(model, session):
        out = model(input_ids=ids)
    assert torch.equal(out.logits, eager.logits)  # observing changes nothing, to the bit
    assert sorted(seen) == [0, 1]
    for layer, probs in seen.items():
        torch.testing.assert_close(probs, eager.attentions[layer], rtol=0, atol=1e-7)


def test_transforms_run_in_order_and_observers_see_their_result():
    model = tiny_model("llama")
    ids = _ids()
    order, final = [], {}

    def halve(call):
        order.append("halve")
        return call.probs * 0.5

    def zero_first_key(call):
        order.append("zero")
        probs = call.probs.clone()
        probs[..., 0] = 0
        return probs

    def observe(call):
        order.append("observe")
        final["probs"] = call.probs.clone()
        final["decomposition"] = LayerDecomposition.from_call(call)

    session = AttentionSession(model, transforms={1: [halve, zero_first_key]}, observers={1: [observe]})
    with torch.no_grad(), cwcore_attention(model, session):
        model(input_ids=ids)
    assert order == ["halve", "zero", "observe"]
    with torch.no_grad():
        clean = model(input_ids=ids, output_attentions=True).attentions[1]
    expected = clean * 0.5
    expected[..., 0] = 0
    torch.testing.assert_close(final["probs"], expected, rtol=0, atol=1e-7)
    # the decomposition an observer builds describes the transformed layer
    torch.testing.assert_close(final["decomposition"].attention, expected, rtol=0, atol=1e-7)


def test_a_transform_equals_the_same_intervention_mask():
    model = tiny_model("qwen2")
    ids = _ids()
    mask = torch.zeros(1, 4, 7, 7, dtype=torch.bool)
    mask[..., 2] = True
    with torch.no_grad(), cwcore.intervene(model, {0: mask}):
        by_mask = model(input_ids=ids).logits
    session = AttentionSession(model, transforms={0: [lambda call: call.probs.masked_fill(mask, 0.0)]})
    with torch.no_grad(), cwcore_attention(model, session):
        by_transform = model(input_ids=ids).logits
    assert torch.equal(by_mask, by_transform)


def test_observers_passed_to_intervene_see_the_clean_run_without_any_mask():
    model = tiny_model("llama")
    ids = _ids()
    got = {}
    with torch.no_grad(), cwcore.intervene(model, {}, observers=every_layer(model, lambda c: got.__setitem__(c.layer, LayerDecomposition.from_call(c)))):
        logits = model(input_ids=ids).logits
    reference = cwcore.decompose(model, input_ids=ids)
    assert torch.equal(logits, reference.outputs.logits)
    for layer in reference.layers:
        assert torch.equal(got[layer].inter, reference.inter[layer])


def test_out_of_range_layers_are_refused_with_the_layer_count():
    model = tiny_model("llama")
    with pytest.raises(IndexError, match="2 attention layers"):
        AttentionSession(model, observers={5: [lambda call: None]})
