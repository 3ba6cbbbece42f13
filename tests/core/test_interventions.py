"""The intervention primitive ``cwcore.intervene`` against independent references.

Removing a term alpha^h_ij v~^h_j zeroes one post-softmax probability without renormalising, so the
input of the output projection must be exactly sum_j alpha_ij (1 - m_ij) v_j with alpha taken from the
model's own eager attention maps and v from a hook on the value projection.
"""

import numpy as np
import pytest
import torch

import cwcore
from cwcore.core.decomposition import prepare_inputs
from tiny_models import VOCAB, tiny_model

FAMILIES = ["llama", "qwen2", "gpt2", "bert"]
ATOL, RTOL = 1e-5, 1e-4


def _output(out):
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _ids(batch=2, length=9, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _value_and_projection(model, family, layer):
    """(module producing the values, output projection, function extracting values from its output)."""
    if family in ("llama", "qwen2"):
        attn = model.model.layers[layer].self_attn
        return attn.v_proj, attn.o_proj, lambda out: out
    if family == "gpt2":
        attn = model.transformer.h[layer].attn
        width = model.config.n_embd
        return attn.c_attn, attn.c_proj, lambda out: out[..., 2 * width:]
    if family == "bert":
        block = model.encoder.layer[layer].attention
        return block.self.value, block.output.dense, lambda out: out
    raise ValueError(family)


def _heads(model):
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or cfg.n_head
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv


def _padded_removal(model):
    """(ids [2, 7], a padding mask whose second row pads 3 tokens, a removal of key 5 in every head
    [2, head, 7, 7]): the set-up of the tests of intervene's padding mask."""
    heads, _ = _heads(model)
    ids = _ids(batch=2, length=7, seed=6)
    padding = torch.tensor([[1] * 7, [0] * 3 + [1] * 4])
    removed = torch.zeros(2, heads, 7, 7, dtype=torch.bool)
    removed[..., 5] = True
    return ids, padding, removed


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_mask_is_bit_identical_to_eager(family):
    model = tiny_model(family)
    ids = _ids()
    heads, _ = _heads(model)
    with torch.inference_mode():
        reference = _output(model(input_ids=ids))
        with cwcore.intervene(model, {}):
            empty = _output(model(input_ids=ids))
        with cwcore.intervene(model, {0: torch.zeros(2, heads, 9, 9, dtype=torch.bool), 1: torch.zeros((), dtype=torch.bool)}):
            zeros = _output(model(input_ids=ids))
        # a callable that sees the live decomposition and removes nothing, with recording on
        with cwcore.intervene(model, {1: lambda layer: torch.zeros_like(layer.attention, dtype=torch.bool)}, record=[0, 1]):
            live = _output(model(input_ids=ids))
    for out in (empty, zeros, live):
        assert torch.equal(out, reference)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layer", [0, 1])
def test_removed_terms_match_a_naive_sum_of_remaining_values(family, layer):
    """o_proj input == sum_j alpha_ij (1 - m_ij) v_j, alpha from eager attention maps, v from a hook."""
    model = tiny_model(family)
    ids = _ids(length=8, seed=3)
    heads, kv = _heads(model)
    b, n = ids.shape
    with torch.no_grad():
        alpha = model(input_ids=ids, output_attentions=True).attentions[layer].double()  # [b, h, q, k]
    mask = torch.rand(b, heads, n, n, generator=torch.Generator().manual_seed(4)) < 0.4
    value_module, projection, extract = _value_and_projection(model, family, layer)
    captured = {}
    handles = [
        value_module.register_forward_hook(lambda m, a, out: captured.__setitem__("v", extract(out).detach())),
        projection.register_forward_pre_hook(lambda m, args: captured.__setitem__("z", args[0].detach())),
    ]
    try:
        with torch.no_grad(), cwcore.intervene(model, {layer: mask}):
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    head_dim = captured["v"].shape[-1] // kv
    v = captured["v"].double().reshape(b, n, kv, head_dim).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
    expected = (alpha * (~mask)) @ v  # [b, h, q, d]
    got = captured["z"].double().reshape(b, n, heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    # and the removal did something
    assert (got - alpha @ v).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_removing_every_term_of_a_row_zeroes_its_head_output(family):
    model = tiny_model(family)
    ids = _ids(length=6)
    heads, _ = _heads(model)
    mask = torch.zeros(2, heads, 6, 6, dtype=torch.bool)
    mask[0, 1, 4, :] = True
    with cwcore.intervene(model, {0: mask}, record=[0]) as session:
        with torch.no_grad():
            model(input_ids=ids)
    layer = session.recorded[0]  # decomposition after the removal
    assert layer.head_output_norm[0, 1, 4] == 0
    assert torch.equal(layer.attention[0, 1, 4], torch.zeros(6))
    assert layer.head_output_norm[0, 1, 3] > 0


def test_later_layer_masks_leave_earlier_layers_alone():
    model = tiny_model("llama")
    ids = _ids()
    mask = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    clean = cwcore.decompose(model, input_ids=ids)
    with torch.no_grad(), cwcore.intervene(model, {1: mask}, record=[0, 1]) as session:
        model(input_ids=ids)
    assert torch.equal(session.recorded[0].attention, clean[0].attention)
    assert session.recorded[1].output_norm.abs().max() == 0  # every term of layer 1 removed


def test_callable_mask_sees_the_live_intervened_state():
    model = tiny_model("llama")
    ids = _ids()
    seen = {}

    def spy(name):
        def callback(layer):
            seen[name] = layer.attention.clone()
            return torch.zeros((), dtype=torch.bool)
        return callback

    clean = cwcore.decompose(model, input_ids=ids)
    removal = torch.rand(2, 4, 9, 9, generator=torch.Generator().manual_seed(0)) < 0.5
    with torch.no_grad():
        with cwcore.intervene(model, {1: spy("clean")}):
            model(input_ids=ids)
        with cwcore.intervene(model, {0: removal, 1: spy("after_layer0")}):
            model(input_ids=ids)
        with cwcore.intervene(model, {0: lambda layer: (seen.__setitem__("layer0", layer.attention.clone()), removal)[1]}):
            model(input_ids=ids)
    # without upstream removal the callable sees the clean decomposition
    torch.testing.assert_close(seen["clean"], clean[1].attention, rtol=0, atol=0)
    # masking layer 0 changes what layer 1's callable sees
    assert (seen["after_layer0"] - clean[1].attention).abs().max() > 1e-4
    # a layer's callable sees that layer before its own removal
    torch.testing.assert_close(seen["layer0"], clean[0].attention, rtol=0, atol=0)


def test_callable_mask_from_live_scores_equals_the_precomputed_mask_in_the_first_layer():
    model = tiny_model("qwen2")
    ids = _ids()
    clean = cwcore.decompose(model, input_ids=ids)
    fixed = clean[0].contribution("inter") < 0.05
    with torch.inference_mode():
        with cwcore.intervene(model, {0: fixed}):
            a = model(input_ids=ids).logits
        with cwcore.intervene(model, {0: lambda layer: layer.contribution("inter") < 0.05}):
            b = model(input_ids=ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_equal_single_sequences(family, side):
    """A mask on the real positions of a padded row acts exactly as on the unpadded sequence."""
    model = tiny_model(family)
    heads, _ = _heads(model)
    lengths = [9, 6]
    full = 9
    generator = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=generator) for n in lengths]
    masks = [torch.rand(heads, n, n, generator=generator) < 0.3 for n in lengths]
    ids = torch.zeros(2, full, dtype=torch.long)
    attention_mask = torch.zeros(2, full, dtype=torch.long)
    batch_mask = torch.zeros(2, heads, full, full, dtype=torch.bool)
    spans = []
    for row, (seq, mask) in enumerate(zip(seqs, masks)):
        n = len(seq)
        span = slice(full - n, full) if side == "left" else slice(0, n)
        spans.append(span)
        ids[row, span] = seq
        attention_mask[row, span] = 1
        batch_mask[row, :, span, span] = mask
    inputs = prepare_inputs(model, {"input_ids": ids, "attention_mask": attention_mask})
    with torch.inference_mode():
        with cwcore.intervene(model, {0: batch_mask, 1: batch_mask}, attention_mask=attention_mask):
            batched = model(**inputs).logits
        for row, (seq, mask) in enumerate(zip(seqs, masks)):
            with cwcore.intervene(model, {0: mask[None], 1: mask[None]}):
                single = model(input_ids=seq[None]).logits[0]
            torch.testing.assert_close(batched[row, spans[row]], single, rtol=RTOL, atol=ATOL)
            with torch.no_grad():
                clean = model(input_ids=seq[None]).logits[0]
            assert (single - clean).abs().max() > 1e-4


def test_a_compiled_model_is_intervened_as_its_eager_module():
    """``torch.compile`` wraps the model (``_orig_mod``): the removal reaches the compiled forward, which
    gives the eager module's intervened logits; a control shows the removal changed them."""
    model = tiny_model("llama").eval()
    ids = _ids(batch=1, length=8, seed=3)
    compiled = torch.compile(model, backend="eager")  # dynamo's tracing, no C compiler needed
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    mask[..., 0] = True  # every query loses its first key's terms in layer 0
    clean = model(input_ids=ids).logits
    with cwcore.intervene(model, {0: mask}):
        eager = model(input_ids=ids).logits
    with cwcore.intervene(compiled, {0: mask}):
        through_compile = compiled(input_ids=ids).logits
    assert (eager - clean).abs().max() > 1e-3  # the control: the removal moves the logits
    torch.testing.assert_close(through_compile, eager, atol=ATOL, rtol=RTOL)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # transformers' own, for the old name
@pytest.mark.parametrize("cache_keyword", ["cache", "past_key_values"])
def test_a_cached_call_under_either_cache_keyword_is_intervened(cache_keyword):
    """transformers 5 names the key/value cache ``cache`` (``past_key_values`` still accepted). intervene's
    ``attention_mask`` then covers the cached and the new tokens, so it cannot equal the new tokens' shape; before,
    a call passing ``cache=`` was refused ("attention_mask has shape (1, 12) but the model was called on inputs
    (1, 4)"). The removal on the new queries must equal the same removal in one uncached run."""
    model = tiny_model("llama")
    heads, _ = _heads(model)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(7))
    removed = torch.zeros(1, heads, 12, 12, dtype=torch.bool)
    removed[..., 8:, :6] = True  # the new queries lose the first 6 keys, all of them cached
    attention_mask = torch.ones_like(ids)
    with torch.no_grad():
        cache = model(input_ids=ids[:, :8], use_cache=True).cache
        with cwcore.intervene(model, {0: removed}, attention_mask=attention_mask):
            whole = model(input_ids=ids).logits[:, 8:]
        with cwcore.intervene(model, {0: removed[..., 8:, :]}, attention_mask=attention_mask):
            cached = model(input_ids=ids[:, 8:], attention_mask=attention_mask, **{cache_keyword: cache}).logits
        clean = model(input_ids=ids).logits[:, 8:]
    torch.testing.assert_close(cached, whole, rtol=RTOL, atol=ATOL)
    assert (whole - clean).abs().max() > 1e-4  # the control: the removal changed the logits
    with pytest.raises(cwcore.core.inputs.InputError, match=r"attention_mask has shape \(1, 12\) but the model was "
                                                            r"called on inputs \(1, 4\)"):
        with cwcore.intervene(model, {}, attention_mask=attention_mask):
            model(input_ids=ids[:, 8:])  # no cache: the mask describes other tokens


def test_a_padding_mask_given_to_intervene_must_reach_the_forward():
    """Padding is read from each forward's own mask. Before, intervene's ``attention_mask`` was only compared with
    the inputs' shape: a forward called without it, or with another mask of the same shape, ran unpadded (a
    padded row's logits 0.2 off) without a word. The control: the padded run differs from the unpadded one."""
    from cwcore.core.decomposition import prepare_inputs
    from cwcore.core.inputs import InputError

    model = tiny_model("llama")
    ids, padding, removed = _padded_removal(model)
    with torch.no_grad(), cwcore.intervene(model, {0: removed}, attention_mask=padding):
        padded = model(**prepare_inputs(model, dict(input_ids=ids, attention_mask=padding))).logits
        with pytest.raises(InputError, match="called without one, so it would be ignored"):
            model(input_ids=ids)
        with pytest.raises(InputError, match="called with another attention_mask"):
            model(input_ids=ids, attention_mask=padding.flip(0))
    with torch.no_grad(), cwcore.intervene(model, {0: removed}):
        unpadded = model(input_ids=ids).logits
    assert (padded[1, 3:] - unpadded[1, 3:]).abs().max() > 1e-3  # the control


def test_mask_keys_of_any_integer_type_name_their_layer():
    """np.int64(-1) and torch.tensor(-1) were "out of range" and torch.tensor(1) blamed the block; the same
    layer under a plain int is the reference. skip_first_token="no" ran the skipping stand-in."""
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, 4, 6, 6, dtype=torch.bool)
    mask[..., 1] = True
    with cwcore.intervene(model, {1: mask}):
        expected = model(input_ids=ids).logits
    for key in (np.int64(1), np.int64(-1), torch.tensor(1), torch.tensor(-1), -1):
        with cwcore.intervene(model, {key: mask}):
            torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="names one layer twice"):
        cwcore.intervene(model, {torch.tensor(-1): mask, 1: mask}).__enter__()
    from cwcore.core.interventions import mean_values

    with pytest.raises(TypeError, match="skip_first_token must be True or False"):
        mean_values(model, ids, skip_first_token="no")


def test_a_three_dimensional_mask_is_refused_as_ambiguous():
    """``[n, query, key]`` broadcast as ``[head, query, key]``: a per-sequence mask of a batch as large as the
    head count (4 here) removed each sequence's terms from the wrong head, silently. The 4-D spellings decide."""
    model = tiny_model("llama")
    heads, _ = _heads(model)
    ids = _ids(batch=heads, length=6)
    per_sequence = torch.zeros(heads, 6, 6, dtype=torch.bool)
    for row in range(heads):
        per_sequence[row, :, row + 1] = True  # sequence b loses key b + 1 in every head
    with pytest.raises(ValueError, match="3-D mask is ambiguous"):
        cwcore.intervene(model, {0: per_sequence}).__enter__()
    with pytest.raises(ValueError, match="3-D mask is ambiguous"), cwcore.intervene(model, {0: lambda _: per_sequence}):
        model(input_ids=ids)
    with torch.no_grad(), cwcore.intervene(model, {0: per_sequence[:, None]}):
        batched = model(input_ids=ids).logits
    for row in range(heads):  # the reference: each sequence alone with its own 2-D mask
        with torch.no_grad(), cwcore.intervene(model, {0: per_sequence[row]}):
            alone = model(input_ids=ids[row:row + 1]).logits
        torch.testing.assert_close(batched[row:row + 1], alone, rtol=RTOL, atol=ATOL)
    with torch.no_grad(), cwcore.intervene(model, {0: per_sequence[:1]}):  # a leading 1 stays unambiguous
        one = model(input_ids=ids).logits
    with torch.no_grad(), cwcore.intervene(model, {0: per_sequence[0]}):
        torch.testing.assert_close(model(input_ids=ids).logits, one, rtol=0, atol=0)


def test_the_decomposition_a_callable_mask_receives_keeps_the_clean_probabilities_after_the_removal():
    """The callable's LayerDecomposition shares the softmax output; zeroing in place (saving a copy) would rewrite the
    decomposition the user holds. The reference: decompose's clean attention; the control: the removal took place."""
    model = tiny_model("llama")
    ids = _ids()
    clean = cwcore.decompose(model, input_ids=ids)
    held = {}

    def remove_first_key(layer):
        held["layer"] = layer  # kept as given, not cloned, as a user may
        mask = torch.zeros_like(layer.attention, dtype=torch.bool)
        mask[..., 0] = True
        return mask

    with torch.no_grad(), cwcore.intervene(model, {0: remove_first_key}, record=[0]) as session:
        model(input_ids=ids)
    assert session.recorded[0].attention[..., 0].abs().max() == 0  # the control: key 0 was removed
    torch.testing.assert_close(held["layer"].attention, clean[0].attention, rtol=0, atol=0)


def test_a_probe_forward_inside_intervene_is_not_held_to_its_attention_mask():
    """Finding a model's post-attention norms runs a probe forward on its own [1, 4] tokens; inside intervene with a
    [2, 7] padding mask it would be refused as a forward on other tokens. The control: the padded forward itself is
    still checked (a forward without the mask is refused)."""
    from cwcore.core.architectures import post_attention_norms
    from cwcore.core.inputs import InputError

    model = tiny_model("gemma3")  # a fresh model: the probe has not run, its result is not cached yet
    ids, padding, _ = _padded_removal(model)
    with torch.no_grad(), cwcore.intervene(model, {}, attention_mask=padding):
        norms = post_attention_norms(model)
        with pytest.raises(InputError, match="called without one"):
            model(input_ids=ids)
    assert set(norms) == {0, 1} and all(norm is model.model.layers[i].post_attention_layernorm
                                        for i, norm in norms.items())


def test_compute_dtype_sets_the_precision_of_the_recorded_decompositions():
    """``compute_dtype=torch.float64`` on a float32 model: the recorded decompositions are float64 and agree with
    the same model in float64 to float32's rounding of its inputs; the control: the float32 record differs."""
    import copy

    model = tiny_model("llama")
    ids = _ids(seed=2)
    mask = torch.zeros(1, 1, 9, 9, dtype=torch.bool)
    mask[..., 1] = True

    def recorded(net, dtype=None):
        with torch.no_grad(), cwcore.intervene(net, {0: mask}, record=[1], compute_dtype=dtype) as session:
            net(input_ids=ids)
        return session.recorded[1].contribution("inter")

    wide, single = recorded(model, torch.float64), recorded(model, torch.float32)
    reference = recorded(copy.deepcopy(model).double())
    assert wide.dtype == reference.dtype == torch.float64 and single.dtype == torch.float32
    assert not torch.equal(wide, single.double())  # the control
    torch.testing.assert_close(wide, reference, rtol=0, atol=5e-7)


def test_positional_input_ids_and_attention_mask_are_checked_as_keywords_are():
    """model(ids, mask) passes both positionally: the mask must be read there (not taken as missing) and the tokens'
    shape compared with intervene's mask as for input_ids=... . The reference: the same call with keywords."""
    from cwcore.core.inputs import InputError

    model = tiny_model("llama")
    ids, padding, removed = _padded_removal(model)
    inputs = prepare_inputs(model, dict(input_ids=ids, attention_mask=padding))
    with torch.no_grad(), cwcore.intervene(model, {0: removed}, attention_mask=padding):
        by_keyword = model(**inputs).logits
        by_position = model(inputs["input_ids"], inputs["attention_mask"], inputs.get("position_ids")).logits
    torch.testing.assert_close(by_position, by_keyword, rtol=0, atol=0)
    with pytest.raises(InputError, match=r"attention_mask has shape \(2, 7\) but the model was called on inputs "
                                         r"\(2, 4\)"):
        with torch.no_grad(), cwcore.intervene(model, {}, attention_mask=torch.ones_like(ids)):
            model(ids[:, 3:])  # positional tokens, no mask: the all-ones mask describes other tokens


def test_record_and_mask_layers_are_numbered_as_elsewhere_and_out_of_range_ones_refused():
    """``record=[-1]`` records the last layer as masks' -1 removes from it; a layer the model lacks is refused by
    name (masks={2: ...} on two layers wrapped round to layer 0, silently)."""
    from cwcore.core.inputs import InputIndexError

    model = tiny_model("llama")
    ids = _ids(batch=1, length=6)
    mask = torch.zeros(1, 4, 6, 6, dtype=torch.bool)
    mask[..., 1] = True
    with torch.no_grad(), cwcore.intervene(model, {-1: mask}, record=[-1]) as last:
        model(input_ids=ids)
    with torch.no_grad(), cwcore.intervene(model, {1: mask}, record=[1]) as positive:
        model(input_ids=ids)
    assert list(last.recorded) == [1]
    torch.testing.assert_close(last.recorded[1].attention, positive.recorded[1].attention, rtol=0, atol=0)
    assert last.recorded[1].attention[..., 1].abs().max() == 0  # the control: the removal is what was recorded
    for bad in (2, -3):
        with pytest.raises(InputIndexError, match=f"masks: layer {bad} out of range"):
            cwcore.intervene(model, {bad: mask}).__enter__()
        with pytest.raises(InputIndexError, match=f"record: layer {bad} out of range"):
            cwcore.intervene(model, {}, record=[bad]).__enter__()


def test_user_transforms_run_after_the_removal():
    """``transforms=`` (the sweep's live removals use it) were never exercised: ignored, or run before the removal,
    every test passed. A transform renormalising each row after the removal gives, against the naive sum,
    o_proj input = sum_j alpha_ij (1 - m_ij) v_j / sum_j alpha_ij (1 - m_ij); the other order would give the
    unrenormalised removal (renormalising the untouched rows first changes nothing)."""
    model = tiny_model("llama")
    ids = _ids(length=8, seed=3)
    heads, kv = _heads(model)
    b, n = ids.shape
    with torch.no_grad():
        alpha = model(input_ids=ids, output_attentions=True).attentions[0].double()
    mask = torch.rand(b, heads, n, n, generator=torch.Generator().manual_seed(4)) < 0.4
    mask[..., 0] = False  # every row keeps a term, so the renormalised row is defined
    value_module, projection, extract = _value_and_projection(model, "llama", 0)
    captured = {}
    handles = [
        value_module.register_forward_hook(lambda m, a, out: captured.__setitem__("v", extract(out).detach())),
        projection.register_forward_pre_hook(lambda m, args: captured.__setitem__("z", args[0].detach())),
    ]

    def renormalise(call):
        return call.probs / call.probs.sum(-1, keepdim=True)

    try:
        with torch.no_grad(), cwcore.intervene(model, {0: mask}, transforms={0: [renormalise]}):
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    head_dim = captured["v"].shape[-1] // kv
    v = captured["v"].double().reshape(b, n, kv, head_dim).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
    kept = alpha * (~mask)
    expected = (kept / kept.sum(-1, keepdim=True)) @ v
    got = captured["z"].double().reshape(b, n, heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    assert (got - kept @ v).abs().max() > 1e-3  # the control: the transform changed the plain removal


def test_stand_in_layers_are_numbered_as_mask_layers():
    """``stand_in={-1: mu}`` goes with masks' -1 (the last layer), as the masks' own numbering; the reference is the
    same removal spelled with positive numbers; the control: the stand-in is not plain zeroing."""
    model = tiny_model("llama")
    heads, _ = _heads(model)
    ids = _ids(batch=1, length=6)
    mask = torch.zeros(1, heads, 6, 6, dtype=torch.bool)
    mask[..., 1:3] = True
    mu = torch.randn(heads, model.config.hidden_size // heads, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with cwcore.intervene(model, {1: mask}, stand_in={1: mu}):
            expected = model(input_ids=ids).logits
        with cwcore.intervene(model, {-1: mask}, stand_in={-1: mu}):
            negative = model(input_ids=ids).logits
        with cwcore.intervene(model, {1: mask}):
            zeroed = model(input_ids=ids).logits
    torch.testing.assert_close(negative, expected, rtol=0, atol=0)
    assert (expected - zeroed).abs().max() > 1e-4  # the control


def test_an_intervened_forward_can_be_differentiated_and_an_empty_mask_keeps_the_models_gradients():
    """Zeroing the softmax output in place saves a copy, but softmax's backward reads that output: under autograd the
    removal must not be in place (backward would fail, "modified by an inplace operation"). The reference: the
    model's own gradients, which an explicit all-False mask must leave bit for bit; the control: a removal changes
    them."""
    model = tiny_model("llama")
    ids = _ids(length=6)
    heads, _ = _heads(model)
    weight = model.model.layers[0].self_attn.q_proj.weight

    def gradient(masks=None):
        model.zero_grad()
        if masks is None:
            model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        else:
            with cwcore.intervene(model, masks):
                model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        return weight.grad.clone()

    reference = gradient()
    removed = torch.zeros(2, heads, 6, 6, dtype=torch.bool)
    try:
        torch.testing.assert_close(gradient({0: torch.zeros_like(removed)}), reference, rtol=0, atol=0)
        removed[..., 1] = True
        assert (gradient({0: removed}) - reference).abs().max() > 1e-6  # the control
    finally:
        model.zero_grad(set_to_none=True)
