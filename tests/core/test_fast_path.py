"""A model configured for SDPA keeps its SDPA forward inside a session: untouched layers run it, observed layers
return its output (checked against the eager arithmetic cwcore decomposes), whatever layers were asked for."""

import re

import pytest
import torch
import transformers
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cwcore
from cwcore.core.decomposition import prepare_inputs
from cwcore.core import attention
from tiny_models import VOCAB, as_transformers_kernel, tiny_model

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
    # the recorded layer returned the model's own SDPA output: the forward is the model's own
    torch.testing.assert_close(d.outputs.logits, sdpa_logits, rtol=0, atol=0)
    everything = cwcore.decompose(model, **inputs)  # all layers observed: each returns SDPA's output too
    torch.testing.assert_close(d[1].inter, everything[1].inter, rtol=0, atol=0, equal_nan=True)


def test_the_fast_path_is_the_models_own_sdpa_function_whatever_layers_are_touched():
    model = tiny_model("llama")
    session = attention.AttentionSession(model, observers={0: [lambda c: None]})
    with attention.cwcore_attention(model, session):
        assert session.fast_path is None  # configured eager: cwcore's function is eager's arithmetic
    model = _sdpa("llama")
    for observers in (attention.every_layer(model, lambda c: None), {0: [lambda c: None]}):
        session = attention.AttentionSession(model, observers=observers)
        with attention.cwcore_attention(model, session):
            assert session.fast_path is ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert model.config._attn_implementation == "sdpa"  # restored


def _first_output(outputs):
    return outputs.logits if getattr(outputs, "logits", None) is not None else outputs.last_hidden_state


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("gemma3", torch.float32),
                                          ("gpt2", torch.float32), ("bert", torch.float32),
                                          # SDPA's softmax is float64 there, cwcore's (eager's) float32
                                          ("llama", torch.float64)])
@pytest.mark.parametrize("padded", [False, True])
def test_one_answer_per_layer_whatever_layers_asks(family, dtype, padded):
    """On a model configured for SDPA, an observed layer returns the model's own SDPA output to the forward (its
    decomposition checked against it), so the forward is the model's own bit for bit, and a layer's numbers do
    not depend on which other layers were asked for: the middle and the last layer of three, alone or with all."""
    model = tiny_model(family, num_layers=3, dtype=dtype)
    model.config._attn_implementation = "sdpa"
    mask = torch.ones_like(IDS)
    if padded:
        mask[1, :3] = 0
    inputs = dict(input_ids=IDS, attention_mask=mask)
    with torch.no_grad():
        own = _first_output(model(**prepare_inputs(model, inputs)))  # the model's own plain SDPA forward
    everything = cwcore.decompose(model, **inputs)
    assert everything.layers == [0, 1, 2]
    torch.testing.assert_close(_first_output(everything.outputs), own, rtol=0, atol=0)
    for layer in (1, 2):
        alone = cwcore.decompose(model, layers=[layer], **inputs)
        torch.testing.assert_close(_first_output(alone.outputs), own, rtol=0, atol=0)
        for name in ("attention", "inter", "intra", "output_norm", "head_output_norm"):
            torch.testing.assert_close(getattr(alone[layer], name), getattr(everything[layer], name), rtol=0, atol=0,
                                       equal_nan=True, msg=lambda m: f"layer {layer} {name}: {m}")
    summary = cwcore.summarize(model, **inputs)  # the summary mode too
    torch.testing.assert_close(_first_output(summary.outputs), own, rtol=0, atol=0)


def _bfloat16_sdpa(calls):
    """transformers' SDPA function run in bfloat16 on a float32 model, as a half-precision kernel computes it: a
    material difference from eager (about 1e-2 relative). Records each call's inputs and output."""
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def sdpa(module, query, key, value, attention_mask, **kwargs):
        output, weights = real(module, query.bfloat16(), key.bfloat16(), value.bfloat16(), attention_mask, **kwargs)
        output = output.to(query.dtype)
        calls.append((query, key, value, attention_mask, kwargs.get("scaling"), output))
        return output, weights
    return as_transformers_kernel(sdpa)


def _eager_difference(query, key, value, attention_mask, scaling, output) -> float:
    """max |eager attention - output| / max |output|, eager computed independently in float64."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    query, key, value = query.double(), key.double(), value.double()
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    allowed = (torch.ones(scores.shape[-2:], dtype=torch.bool).tril() if attention_mask is None
               else attention_mask[..., : key.shape[-2]])
    eager = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ value).transpose(1, 2)
    return float((eager - output.double()).abs().max() / output.double().abs().max())


@pytest.fixture
def bfloat16_sdpa():
    """transformers' "sdpa" attention function replaced, for this test only, by :func:`_bfloat16_sdpa` (through the
    public registry, the one the model and cwcore look it up in); yields the list of its recorded calls."""
    real, calls = ALL_ATTENTION_FUNCTIONS["sdpa"], []
    AttentionInterface.register("sdpa", _bfloat16_sdpa(calls))
    try:
        yield calls
    finally:
        AttentionInterface.register("sdpa", real)


def test_an_sdpa_that_differs_from_eager_is_refused_whatever_layers_asks(bfloat16_sdpa):
    """A model whose configured SDPA function differs materially from its eager attention is refused with the
    measured difference, under layers=None and layers=[-1] alike (never decomposed by eager arithmetic that its
    forward does not do), and the same model loaded eager is exact."""
    model = tiny_model("llama", num_layers=3)
    inputs = dict(input_ids=IDS)
    with torch.no_grad():
        eager = model(**inputs).logits
    calls = bfloat16_sdpa
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        own = model(**inputs).logits
    assert (own - eager).abs().max() > 1e-3  # the model's SDPA forward really is another computation
    refusal = (r"'sdpa' attention and the eager arithmetic cwcore decomposes give this layer different outputs "
               r"\(relative error ([0-9.e+-]+) > 0.0001 .*sdpa and eager attention differ.*attn_implementation='eager'")
    for layers, refused_layer in ((None, 0), ([-1], 2)):
        calls.clear()
        with pytest.raises(cwcore.UnsupportedModelError, match=refusal) as raised:
            cwcore.decompose(model, layers=layers, **inputs)
        assert f"model.layers.{refused_layer}.self_attn" in str(raised.value)
        measured = float(re.search(refusal, str(raised.value)).group(1))
        assert measured == pytest.approx(_eager_difference(*calls[-1]), rel=2e-2)  # the refused call's own difference
        assert measured > 1e-3
    with pytest.raises(cwcore.UnsupportedModelError, match=refusal):
        cwcore.summarize(model, **inputs)
    with torch.no_grad():  # a refusal leaves the model as it was
        torch.testing.assert_close(model(**inputs).logits, own, rtol=0, atol=0)
    model.config._attn_implementation = "eager"
    everything, last = cwcore.decompose(model, **inputs), cwcore.decompose(model, layers=[-1], **inputs)
    torch.testing.assert_close(everything.outputs.logits, eager, rtol=0, atol=0)
    torch.testing.assert_close(last.outputs.logits, eager, rtol=0, atol=0)
    torch.testing.assert_close(last[2].inter, everything[2].inter, rtol=0, atol=0, equal_nan=True)


def _shared_score_gpt2(dtype, offset: float = 32.0):
    """A GPT-2 in ``dtype`` whose query and key biases lie along one direction per head, so that every score of a
    query shares a term of about ``offset`` (after the 1/sqrt(head_dim) scaling): nothing to an exact softmax, but
    eager attention rounds scores near 32 to 0.125 apart in bfloat16 before it, moving alpha by percents."""
    model = tiny_model("gpt2", dtype=dtype)
    direction = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    bias = (direction / direction.norm(dim=-1, keepdim=True) * 2 * offset ** 0.5).reshape(64).to(dtype)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.bias[:64] = bias  # the queries' bias
            block.attn.c_attn.bias[64:128] = bias  # the keys'
    model.config._attn_implementation = "sdpa"
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_under_sdpa_is_decomposed_at_sdpa_precision(dtype):
    """SDPA computes a half-precision model's scores in float32; eager rounds them to the model's dtype first. An
    observed layer returns SDPA's output to the forward, so cwcore's alpha is SDPA's, from float32 scores: before,
    it was eager's and, in bfloat16 with a large score every key shares, 4.3e-2 from SDPA's output, past the
    3e-2 tolerance, so the model was refused though its forward was plain SDPA (Gemma 3 270M in bfloat16 at
    1,024 tokens of text measured 3.0e-2, at the edge)."""
    model = _shared_score_gpt2(dtype)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(4))
    queries_and_keys = {}
    handles = [block.attn.c_attn.register_forward_hook(
        lambda module, args, out, i=i: queries_and_keys.__setitem__(i, out.detach()))
        for i, block in enumerate(model.transformer.h)]
    try:
        d = cwcore.decompose(model, input_ids=ids)  # before: refused in bfloat16
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        own = model(input_ids=ids).logits
    torch.testing.assert_close(d.outputs.logits, own, rtol=0, atol=0)  # the forward is the model's own SDPA
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for layer in d:
        q, k, _ = queries_and_keys[layer].double().split(64, dim=-1)
        q, k = (t.unflatten(-1, (4, 16)).transpose(1, 2) for t in (q, k))  # [batch, head, position, 16]
        exact = torch.softmax((q @ k.transpose(-1, -2) / 4).masked_fill(~causal, -torch.inf), -1)
        rounded = torch.softmax((q.to(dtype) @ k.to(dtype).transpose(-1, -2) / 4).double()
                                .masked_fill(~causal, -torch.inf), -1)  # eager's scores, in the model's dtype
        # the control: the two arithmetics are far apart here (in float16 less so, its rounding is finer)
        assert (rounded - exact).abs().max() > (3e-2 if dtype == torch.bfloat16 else 3e-3)
        torch.testing.assert_close(d[layer].attention.double(), exact, rtol=0, atol=2e-6)
    summary = cwcore.summarize(model, input_ids=ids, rows=[-1])  # the summary computes its alpha the same way
    torch.testing.assert_close(summary.outputs.logits, own, rtol=0, atol=0)
    for layer in summary:
        torch.testing.assert_close(summary[layer].row(-1, "attention"), d[layer].attention[:, :, -1],
                                   rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_intervention_on_a_half_precision_sdpa_model_changes_only_what_it_removes(dtype):
    """A layer an intervention changes ran eager's arithmetic (scores rounded to bf16) while the clean forward ran
    SDPA's: removing nothing moved 90% of layer 0's outputs (by up to 10 units in the last place) and the logits
    by 4e-3, more than removing the 1% smallest terms did. Now an empty mask is the clean forward to the last bit,
    and a removal moves the head outputs by the removed terms alpha_ij v_j (in float32) only."""
    model = _shared_score_gpt2(dtype)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(4))
    seen = {}
    model.transformer.h[0].attn.c_proj.register_forward_hook(
        lambda module, args, out: seen.setdefault("z", []).append(args[0].detach().clone()))
    model.transformer.h[0].attn.c_attn.register_forward_hook(
        lambda module, args, out: seen.setdefault("qkv", out.detach().clone()))
    with torch.no_grad():
        clean = model(input_ids=ids).logits
        with cwcore.intervene(model, {0: torch.zeros(1, 1, 1, 1, dtype=torch.bool),
                                      1: torch.zeros(1, 1, 1, 1, dtype=torch.bool)}):
            empty = model(input_ids=ids).logits
    torch.testing.assert_close(empty, clean, rtol=0, atol=0)
    mask = torch.zeros(1, 4, 64, 64, dtype=torch.bool)
    mask[0, 1, 10:, 3] = True  # head 1 drops key 3 for the queries from 10 on
    d = cwcore.decompose(model, layers=[0], input_ids=ids)
    with torch.no_grad(), cwcore.intervene(model, {0: mask}):
        model(input_ids=ids)
    clean_z, removed_z = seen["z"][0].float(), seen["z"][-1].float()  # [batch, query, model] before W_O
    moved = (removed_z - clean_z).unflatten(-1, (4, 16))  # [batch, query, head, dim]
    assert moved[:, :, [0, 2, 3]].abs().max() == 0 and moved[:, :10].abs().max() == 0  # nothing else moved
    value_3 = seen["qkv"][:, 3, 128:].float().unflatten(-1, (4, 16))[:, 1]  # [batch, dim]: head 1's v_3
    expected = -d[0].attention[:, 1, 10:, 3, None] * value_3[:, None]  # [batch, query, dim]: - alpha_i3 v_3
    # the changed output is rounded to the model's dtype once: half a unit in the last place of each entry
    half_unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    bound = half_unit * removed_z.unflatten(-1, (4, 16))[:, 10:, 1].abs() + 1e-6
    assert ((moved[:, 10:, 1] - expected).abs() <= bound).all()
    assert (expected.abs() > 4 * bound).float().mean() > 0.5  # the control: most removals lie far above it


def test_a_half_precision_sdpa_that_differs_is_refused_naming_the_float32_arithmetic():
    """A bfloat16 model whose configured SDPA returns 10% more than attention computes is refused, and the
    reason names what cwcore compared it with: eager's formula at float32 precision, as SDPA computes a
    half-precision model's attention (before, "the eager arithmetic", which rounds the scores to bfloat16)."""
    model = _shared_score_gpt2(torch.bfloat16)
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def larger(module, query, key, value, attention_mask, **kwargs):
        output, weights = real(module, query, key, value, attention_mask, **kwargs)
        return output * 1.1, weights

    AttentionInterface.register("sdpa", as_transformers_kernel(larger))
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"'sdpa' attention and the eager arithmetic at float32 "
                           r"precision \(as SDPA computes a half-precision model's attention\) that cwcore decomposes "
                           r"give this layer different outputs \(relative error 0.09\d* > 0.03 for a torch.bfloat16"):
            cwcore.decompose(model, input_ids=IDS)
    finally:
        AttentionInterface.register("sdpa", real)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
@pytest.mark.parametrize("padded", [False, True])
def test_blockwise_probabilities_of_an_sdpa_model_equal_eager(family, padded, monkeypatch):
    """A model configured for SDPA gets its recorded layers' softmax a block of queries at a time (keys every
    row of a block masks are skipped); blocks of 3 queries here, so causal, padded and sliding-window
    blocks all occur. Against the same model configured eager (eager's own arithmetic): probabilities to
    float32 rounding, exact zeros where eager has them, and every output within the self-check's tolerance."""
    from cwcore.core import blockwise

    # the module that reads it: the name attention.py re-exports is a copy, patching it changed no block (one block
    # of 64 queries covered the 11 tokens, so no causal, padded or sliding-window block occurred)
    monkeypatch.setattr(blockwise, "QUERY_BLOCK", 3)
    assert blockwise._block_rows(4, 11) == 3
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


@pytest.mark.parametrize("layers", [None, [1]])
def test_the_outputs_of_an_sdpa_model_asked_for_its_attentions_are_the_models_own(layers):
    """An SDPA model returns no attention maps (``output_attentions=True`` gives ``()``). Before, the layers cwcore
    observed returned theirs and the others none, so ``d.outputs.attentions`` held only the observed layers'
    maps, its index 0 layer 1's with ``layers=[1]``. The control: an eager model returns every layer's map."""
    model = _sdpa("llama")
    with torch.no_grad():
        own = model(input_ids=IDS, output_attentions=True)
    d = cwcore.decompose(model, input_ids=IDS, output_attentions=True, layers=layers)
    assert tuple(own.attentions or ()) == () and tuple(d.outputs.attentions or ()) == ()
    torch.testing.assert_close(d.outputs.logits, own.logits, rtol=0, atol=1e-5)
    eager = tiny_model("llama")
    assert len(cwcore.decompose(eager, input_ids=IDS, output_attentions=True, layers=layers).outputs.attentions) == 2
    # under an intervention too: the changed layer returned its map alone (attentions[0] was layer 1's)
    mask = torch.zeros(2, 4, 11, 11, dtype=torch.bool)
    mask[..., 2:, 1] = True
    with cwcore.intervene(model, {1: mask}), torch.no_grad():
        assert tuple(model(input_ids=IDS, output_attentions=True).attentions or ()) == ()


def _softmax_one(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with an implicit zero logit in the softmax (rows sum to less than 1): what a researcher's
    modified attention computes."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : key.shape[-2]]
    scores = torch.cat([scores, torch.zeros_like(scores[..., :1])], -1)
    weights = torch.softmax(scores, -1, dtype=torch.float32)[..., :-1].to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def test_an_attention_function_cwcore_cannot_check_is_refused_not_replaced_by_eager(monkeypatch):
    """A function registered with AttentionInterface, SDPA re-registered, or a family's eager function patched:
    cwcore replaced each by eager arithmetic without a check (logits 0.2 relative from the model's own, an empty
    intervention changed them). Each is refused, and the model is left as it was."""
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    inputs = dict(input_ids=IDS)
    with torch.no_grad():
        eager = model(**inputs).logits
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "softmax_one", _softmax_one)
    monkeypatch.setitem(transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "softmax_one",
                        transformers.masking_utils.eager_mask)
    model.config._attn_implementation = "softmax_one"
    with torch.no_grad():
        own = model(**inputs).logits
    assert (own - eager).abs().max() / eager.abs().max() > 1e-2  # the model really computes something else
    refusal = r"configured for 'softmax_one' attention, which cwcore would replace by eager arithmetic"
    calls = (lambda: cwcore.decompose(model, **inputs), lambda: cwcore.summarize(model, **inputs),
             lambda: cwcore.attribute(model, inputs, method="contribution"),
             lambda: cwcore.intervene(model, {0: torch.zeros(2, 4, 11, 11, dtype=torch.bool)}).__enter__())
    for call in calls:
        with pytest.raises(cwcore.UnsupportedModelError, match=refusal):
            call()
        assert model.config._attn_implementation == "softmax_one"
        with torch.no_grad():
            torch.testing.assert_close(model(**inputs).logits, own, rtol=0, atol=0)

    model.config._attn_implementation = "sdpa"
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    AttentionInterface.register("sdpa", _softmax_one)
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"the 'sdpa' attention function is replaced by "
                                                               r"'_softmax_one' \(module '[\w.]*test_fast_path'\)"):
            cwcore.decompose(model, **inputs)
    finally:
        AttentionInterface.register("sdpa", real)
    # control: transformers' own SDPA is decomposed exactly
    torch.testing.assert_close(cwcore.decompose(model, **inputs).outputs.logits, eager, rtol=1e-5, atol=1e-5)

    model.config._attn_implementation = "eager"
    monkeypatch.setattr(modeling_llama, "eager_attention_forward", _softmax_one)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, own, rtol=0, atol=0)  # the model computes the patch
    with pytest.raises(cwcore.UnsupportedModelError, match=r"modeling_llama.eager_attention_forward is replaced by "
                                                           r"'_softmax_one'"):
        cwcore.decompose(model, **inputs)
    monkeypatch.undo()
    torch.testing.assert_close(cwcore.decompose(model, **inputs).outputs.logits, eager, rtol=0, atol=0)


def test_an_observed_layer_adopts_the_sdpa_output_checked_along_random_directions(monkeypatch):
    """An observed float32 layer of an SDPA model no longer computes alpha @ V to compare with the model's own output:
    it checks alpha against that output along random directions (alpha (V r) against z r) and adopts it as z. The
    check is as strict as the entrywise one: an output off by 1e-3 of its largest entry in one entry is refused with
    the entrywise error measured again (about 1e-3); off by 1e-6 it passes, and z is the model's output."""
    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = _sdpa("llama")
    adoptions = []
    original = attention.adopted_own_output
    monkeypatch.setattr(attention, "adopted_own_output", lambda *a: adoptions.append(a[1]) or original(*a))
    own_outputs = {}

    def off_by(size):
        def sdpa(module, query, key, value, attention_mask, **kwargs):
            output, weights = real(module, query, key, value, attention_mask, **kwargs)
            output = output.clone()
            output[1, 7, 2, 5] += size * output.abs().max()  # [batch, query, head, dim]
            own_outputs[module] = output
            return output, weights
        return as_transformers_kernel(sdpa)

    try:
        AttentionInterface.register("sdpa", off_by(1e-3))
        refusal = r"different outputs \(relative error ([0-9.e+-]+) > 0.0001 for a torch.float32 model\)"
        with pytest.raises(cwcore.UnsupportedModelError, match=refusal) as raised:
            cwcore.decompose(model, input_ids=IDS)
        assert 9e-4 < float(re.search(refusal, str(raised.value)).group(1)) < 1.1e-3  # entrywise: the entry's error
        AttentionInterface.register("sdpa", off_by(1e-6))
        adoptions.clear()
        d = cwcore.decompose(model, input_ids=IDS)
    finally:
        AttentionInterface.register("sdpa", real)
    blocks = [model.model.layers[i].self_attn for i in range(len(d))]
    assert adoptions == blocks  # every layer adopted its own output
    for layer, block in enumerate(blocks):
        mixed = d[layer].geometry.mixed  # [batch, head, query, dim]: z, the model's own output
        torch.testing.assert_close(mixed, own_outputs[block].transpose(1, 2), rtol=0, atol=0)
