"""cwcore.summarize against the reduction of the dense decomposition, per summary.

The reference is :func:`cwcore.decompose`'s ``[batch, head, query, key]`` tensors reduced with plain torch
(:func:`cwcore.core.summary.dense_summary`: sums over the real queries, one ``topk`` over all (head, key)
terms, indexing of the rows); the summary computes the same blockwise without those tensors. Tolerance:
1e-5 relative to the largest entry of each tensor (float32 sums in another order); top-k indices equal.
"""

import warnings

import pytest
import torch
import transformers as tf

import cwcore
from cwcore.core.inputs import InputError
from cwcore.core.summary import ROW_FIELDS, dense_summary, relative_differences, summary_fields
from tiny_models import DECODERS, VOCAB, as_transformers_kernel, tiny_model

RELATIVE = 1e-5
IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
LEFT_PADDED = torch.ones_like(IDS)
LEFT_PADDED[1, :3] = 0


def assert_equal_to_dense(summary, decomposition, mask, **options):
    for layer in summary.layers:
        reference = dense_summary(decomposition[layer], mask, **options)
        differences = relative_differences(summary[layer], reference, decomposition[layer])
        wrong = {name: value for name, value in differences.items() if value > RELATIVE}
        assert not wrong, f"layer {layer}: {wrong}"


@pytest.mark.parametrize("kind", ["inter", "intra"])
@pytest.mark.parametrize("family", DECODERS)
def test_every_summary_equals_the_dense_reduction_in_a_padded_batch(family, kind):
    model = tiny_model(family)
    options = dict(top_k=5, rows=[-1, 5, 1], token_rows=[3, -2, 0], kind=kind)
    with pytest.warns(UserWarning, match=r"padding \(position 0 in sequences \[1\]; position 1 in sequences \[1\]\)"):
        s = cwcore.summarize(model, input_ids=IDS, attention_mask=LEFT_PADDED, **options)
    d = cwcore.decompose(model, input_ids=IDS, attention_mask=LEFT_PADDED)
    assert s.layers == d.layers == [0, 1]
    assert_equal_to_dense(s, d, LEFT_PADDED, **options)
    # padded query rows are NaN (row 1 is padded in the second sequence) and padded keys receive nothing
    assert torch.isnan(s[0].rows["contribution"][1, :, 2]).all()
    assert (s[0].top.head[1, :3] == -1).all() and torch.isnan(s[0].top.contribution[1, :3]).all()
    assert (s[0].contribution_received[1, :, :3] == 0).all()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_blocks_of_a_few_queries_give_the_same_summary(family, monkeypatch):
    # the block size is a speed choice only: blocks of 3 queries (4 per sequence, padded rows inside a block)
    from cwcore.core import summary as summary_module

    monkeypatch.setattr(summary_module, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(summary_module, "ROWS_PER_DIM", 0)
    monkeypatch.setattr(summary_module, "MIN_BLOCK", 3)
    spans = list(summary_module._block_spans(None, True, 0, 12, 12, 4, 16))
    assert [(start, stop) for start, stop, *_ in spans] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    model = tiny_model(family)
    options = dict(top_k=5, rows=[-1, 5, 1], token_rows=[3, -2, 0])
    with pytest.warns(UserWarning, match="chosen rows are padding"):
        s = cwcore.summarize(model, input_ids=IDS, attention_mask=LEFT_PADDED, **options)
    assert_equal_to_dense(s, cwcore.decompose(model, input_ids=IDS, attention_mask=LEFT_PADDED), LEFT_PADDED,
                          **options)


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_inter_contributions_received_add_up_to_one_per_real_query(family):
    # an invariant independent of the dense path: c_ij sums to 1 over (head, key) for each query
    s = cwcore.summarize(tiny_model(family), input_ids=IDS, attention_mask=LEFT_PADDED)
    for layer in s.layers:
        totals = s[layer].received("contribution").sum(-1)
        torch.testing.assert_close(totals, LEFT_PADDED.sum(-1).to(totals.dtype), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s[layer].received("attention").sum(-1), 4 * LEFT_PADDED.sum(-1).float(),
                                   rtol=1e-5, atol=1e-5)


def _long_model(family: str, sliding_window: int | None = None):
    """A 2-layer random model with a long context and a large vocabulary (few repeated tokens, so few tied
    terms), configured for SDPA as the packaged models are when they run long inputs."""
    torch.manual_seed(0)
    common = dict(vocab_size=4000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=2048, num_key_value_heads=2)
    if family == "gemma3":
        config = tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=sliding_window,
                                     layer_types=["sliding_attention", "full_attention"])
    else:
        config = tf.LlamaConfig(**common)
    config._attn_implementation = "sdpa"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper attention than the initialisation's near-uniform maps
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(8)
    return model


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_long_inputs_use_the_grouped_top_k_and_sliding_spans_exactly(family, absolute):
    model = _long_model(family, sliding_window=300)
    ids = torch.randint(0, 4000, (2, 700), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    options = dict(top_k=8, rows=[-1, 400], absolute=absolute)
    s = cwcore.summarize(model, input_ids=ids, attention_mask=mask, **options)
    d = cwcore.decompose(model, input_ids=ids, attention_mask=mask)
    assert_equal_to_dense(s, d, mask, **options)
    if family == "gemma3":  # the sliding layer: a query far from the start has no term outside its window
        keys = s[0].top.key[0, 600:]
        assert (keys > torch.arange(600, 700)[:, None] - 300).all()


def test_the_model_computes_what_it_computes_without_a_session():
    model = _long_model("llama")
    ids = torch.randint(0, 4000, (1, 300), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    s = cwcore.summarize(model, input_ids=ids)
    torch.testing.assert_close(s.outputs.logits, expected, rtol=1e-4, atol=1e-5)


def test_rows_and_token_rows_index_by_position():
    model = tiny_model("llama")
    s = cwcore.summarize(model, input_ids=IDS, rows=[-1, 4], token_rows=[4])
    d = cwcore.decompose(model, input_ids=IDS)
    torch.testing.assert_close(s[1].row(-1), d[1].contribution("inter")[:, :, -1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s[1].row(4, "attention"), d[1].attention[:, :, 4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s[1].token_row(4), d[1].token_level()[:, 4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s[-1].token_row(4, "attention"), d[1].token_level("attention")[:, 4],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="was not kept"):
        s[1].row(3)
    # a field a row does not hold is named (before: a bare KeyError 'cosine' from token_row)
    with pytest.raises(InputError, match=r"^token_row name must be one of 'contribution', 'attention', got 'cosine'$"):
        s[1].token_row(4, "cosine")
    with pytest.raises(InputError, match=r"^row name must be one of 'contribution', .*'cosine'.*, got 'alpha'$"):
        s[1].row(-1, "alpha")
    torch.testing.assert_close(s[1].row(-1, "cosine"), d[1].cosine("inter")[:, :, -1], rtol=1e-5, atol=1e-6)
    assert set(s[0].rows) == set(ROW_FIELDS)


def test_a_chosen_row_that_is_padding_warns_and_stays_nan():
    # right padding: the default rows=-1 is a padded query of the shorter sequence, whose row is NaN
    model = tiny_model("llama")
    right_padded = torch.ones_like(IDS)
    right_padded[1, 9:] = 0
    with pytest.warns(UserWarning, match=r"position 11 in sequences \[1\]") as caught:
        s = cwcore.summarize(model, input_ids=IDS, attention_mask=right_padded, token_rows=[2, 10])
    message = str(caught[0].message)
    assert "position 10 in sequences [1]" in message and "position 2 " not in message
    assert "padding_side = 'left'" in message  # the hint of right padding
    assert torch.isnan(s[0].row(-1)[1]).all() and not torch.isnan(s[0].row(-1)[0]).any()
    # the real rows are untouched: token row 2 of the padded sequence is that of the sequence alone
    alone = cwcore.summarize(model, input_ids=IDS[1:, :9], layers=[0], rows=[8], token_rows=[2])
    torch.testing.assert_close(s[0].token_row(2)[1, :9], alone[0].token_row(2)[0], rtol=1e-5, atol=1e-6)
    assert torch.all(s[0].token_row(2)[1, 9:] == 0)
    assert not torch.isnan(alone[0].row(-1)).any()
    # with a key/value cache the mask covers the cached tokens too: new query 0 of the left-padded sequence is
    # real (the mask's column 0 is not its column), so nothing is warned and its row is a number
    from cwcore.core.decomposition import prepare_inputs

    with torch.no_grad():
        cache = model(**prepare_inputs(model, dict(input_ids=IDS[:, :8], attention_mask=LEFT_PADDED[:, :8])),
                      use_cache=True).cache
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached = cwcore.summarize(model, input_ids=IDS[:, 8:], attention_mask=LEFT_PADDED, cache=cache, rows=[0, -1])
    assert not torch.isnan(cached[0].row(0)).any()
    # left padding puts every sequence's last token at -1: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cwcore.summarize(model, input_ids=IDS, attention_mask=LEFT_PADDED, layers=[0])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_one_new_token_after_a_cache_sees_every_cached_key(family, implementation):
    """One new token after a key/value cache, no padding: transformers passes no mask (one query may see every
    key). Before, the summary read the missing mask as SDPA's top-left causal pattern, so the token saw key 0
    only: every summary was wrong and, on an eager model, so was the model's own output (logits off by 0.5);
    an SDPA model was refused with a false reason. The reference: the dense decomposition of the same call and
    the model's full forward. The control: the new token's attention is spread over its keys, not all on key 0."""
    import copy

    model = tiny_model(family)
    model.config._attn_implementation = implementation
    with torch.no_grad():
        cache = model(input_ids=IDS[:1, :11], use_cache=True).cache
        full = model(input_ids=IDS[:1]).logits[0, -1]
    options = dict(top_k=3, rows=[-1], token_rows=[-1])
    s = cwcore.summarize(model, input_ids=IDS[:1, 11:], cache=copy.deepcopy(cache), **options)
    d = cwcore.decompose(model, input_ids=IDS[:1, 11:], cache=copy.deepcopy(cache))
    assert (d[0].attention[0, :, -1, 1:].sum(-1) > 0.5).all()  # the control: most of the mass off key 0
    torch.testing.assert_close(s.outputs.logits[0, -1], full, rtol=0, atol=1e-5)
    assert_equal_to_dense(s, d, None, **options)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_a_relative_position_bias_enters_the_summary_as_it_enters_the_model(family, implementation):
    """T5 and UMT5 add a relative position bias to the scores (``position_bias``). Before, the summary left it
    out: its alpha, totals and top terms were those of another model (totals off by 0.1 on a tiny T5), the
    model's own output under the summary changed (0.2), and an SDPA-configured T5 was refused with a false
    reason. The reference: each layer's dense reduction (encoder, decoder and cross attention, a padded encoder
    batch) and the model's forward without cwcore."""
    from zoo_models import relative_bias_model

    model = relative_bias_model(family)
    model.config._attn_implementation = implementation
    generator = torch.Generator().manual_seed(1)
    # distinct tokens: a token repeated at two distances of one bucket ties exactly, and a tie at the k-th term
    # may enter either way
    ids = torch.stack([torch.randperm(VOCAB - 3, generator=generator)[:9] + 3 for _ in range(2)])
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:], ids[1, 6:] = 0, 0
    decoder_ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
    with torch.no_grad():
        plain = model(**inputs).last_hidden_state
    options = dict(top_k=3, rows=[-1, 2], token_rows=[1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the encoder's padded last row is asked for
        s = cwcore.summarize(model, **inputs, **options)
    d = cwcore.decompose(model, **inputs)
    torch.testing.assert_close(s.outputs.last_hidden_state, plain, rtol=0, atol=1e-5)
    assert s.layers == d.layers == list(range(6))
    for layer in s.layers:
        query_mask = mask if layer < 2 else None  # the encoder's queries are padded; the decoder's are not
        reference = dense_summary(d[layer], query_mask, **options)
        differences = relative_differences(s[layer], reference, d[layer])
        wrong = {name: value for name, value in differences.items() if value > RELATIVE}
        assert not wrong, f"layer {layer}: {wrong}"


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_new_tokens_that_are_padding_after_a_cache_are_padded_rows_not_a_refusal(implementation):
    """A key/value cache, then new tokens of which the first two are still left padding in one sequence (its
    padding is longer than the cache). Those queries see no key: padded rows, NaN by the convention, as in the
    dense decomposition. Before, the summary took them for real rows and refused the whole call ("the terms ...
    do not reproduce the output projection's result"). The reference: the dense reduction of the same call."""
    import copy

    from cwcore.core.decomposition import prepare_inputs

    model = tiny_model("llama")
    model.config._attn_implementation = implementation
    mask = torch.ones_like(IDS)
    mask[1, :10] = 0
    with torch.no_grad():
        cache = model(**prepare_inputs(model, dict(input_ids=IDS[:, :8], attention_mask=mask[:, :8])),
                      use_cache=True).cache
    options = dict(top_k=3, rows=[0, -1], token_rows=[-1])
    with pytest.warns(UserWarning, match="padding"):  # row 0 of the second sequence is asked for
        s = cwcore.summarize(model, input_ids=IDS[:, 8:], attention_mask=mask, cache=copy.deepcopy(cache), **options)
    d = cwcore.decompose(model, input_ids=IDS[:, 8:], attention_mask=mask, cache=copy.deepcopy(cache))
    assert torch.isnan(s[0].output_norm[1, :2]).all() and not torch.isnan(s[0].output_norm[1, 2:]).any()
    assert_equal_to_dense(s, d, mask[:, 8:], **options)


@pytest.mark.parametrize("kind", ["intra", "inter"])
def test_the_top_terms_skip_a_silent_heads_nan_terms(kind):
    """A head whose output is zero (here: its key/value head's values zeroed) has no c within the head (NaN, intra).
    torch.topk ranks NaN above every number, so before, those NaN terms filled the top terms of nearly every query
    and the largest real terms were not reported. The reference: the largest finite c of the dense decomposition.
    The control: the silent head's intra c is NaN, so the test can tell the two apart."""
    model = tiny_model("llama")  # 4 heads on 2 key/value heads
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[:16].zero_()  # key/value head 0: query heads 0 and 1 silent
    s = cwcore.summarize(model, layers=[1], input_ids=IDS[:1], top_k=4, kind=kind)
    d = cwcore.decompose(model, layers=[1], input_ids=IDS[:1])
    c = d[1].contribution(kind)[0]  # [head, query, key]
    assert c[:2].isnan().all() == (kind == "intra")  # the control
    expected = c.nan_to_num(nan=-torch.inf).masked_fill(d[1].attention[0] == 0, -torch.inf)
    expected = expected.transpose(0, 1).flatten(1).topk(4, dim=-1).values  # [query, 4]
    got = s[1].top.contribution[0]
    torch.testing.assert_close(got[4:], expected[4:].to(got.dtype), rtol=1e-5, atol=1e-6)  # 4 terms from query 3 on
    assert not got[4:].isnan().any()
    assert_equal_to_dense(s, d, None, top_k=4, kind=kind)


@pytest.mark.parametrize("arguments, message", [
    (dict(rows=[12]), "rows must be query positions"),
    # before: "'float' object is not iterable", with no word of rows
    (dict(rows=1.5), r"^rows must be a query position or a list of them \(ints\), got 1.5$"),
    (dict(rows="-1"), r"^rows must be a query position or a list of them .* got '-1'$"),
    (dict(kind="both"), "kind must be"),
    (dict(top_k=0), "top_k must be at least 1"),
    (dict(layers=[5]), "out of range|layer"),
])
def test_bad_arguments_are_refused(arguments, message):
    with pytest.raises((InputError, IndexError, ValueError, TypeError), match=message):
        cwcore.summarize(tiny_model("llama"), input_ids=IDS, **arguments)


def test_the_tokenizers_output_as_one_argument_is_the_inputs_as_for_decompose():
    """summarize takes "the same inputs" as decompose, which reads decompose(model, enc); summarize(model, enc)
    refused it: "layers must hold layer numbers (int), got 'input_ids'"."""
    model = tiny_model("llama")
    enc = {"input_ids": IDS[:1], "attention_mask": torch.ones_like(IDS[:1])}
    given, keywords = cwcore.summarize(model, enc, top_k=3), cwcore.summarize(model, top_k=3, **enc)
    assert list(given) == list(keywords) == [0, 1]
    torch.testing.assert_close(given[1].top.contribution, keywords[1].top.contribution, rtol=0, atol=0)
    with pytest.raises(InputError, match=r"^summarize: give the inputs once"):
        cwcore.summarize(model, enc, input_ids=IDS[:1])
    # a misspelt option beside the mapping is named as such (it said "give the inputs once"), in both calls
    for call in (cwcore.summarize, cwcore.decompose):
        with pytest.raises(TypeError, match=rf"^{call.__name__}\(\) got unexpected keyword argument\(s\) 'layer' "
                           r"\(did you mean 'layers'\?\)"):
            call(model, enc, layer=[1])
    with pytest.raises(InputError, match=r"^summarize\(model, tensor\): the second positional argument is layers"):
        cwcore.summarize(model, IDS[:1])


def test_a_summary_that_does_not_add_up_is_refused():
    model = tiny_model("qwen2")
    projection = model.model.layers[1].self_attn.o_proj
    handle = projection.register_forward_hook(lambda module, args, output: output * 1.01)
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"do not reproduce .*refuses to report this summary"):
            cwcore.summarize(model, input_ids=IDS)
        with pytest.raises(cwcore.UnsupportedModelError, match="do not reproduce"):  # as the dense path does
            cwcore.decompose(model, input_ids=IDS)
    finally:
        handle.remove()


def test_a_gate_before_the_output_projection_is_refused_as_by_decompose():
    model = tiny_model("llama")
    projection = model.model.layers[0].self_attn.o_proj
    handle = projection.register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match="received something other than the attention output"):
            cwcore.summarize(model, input_ids=IDS)
    finally:
        handle.remove()


def test_summary_fields_are_small():
    # per layer: O(query * top_k + head * key * rows), nothing of size query * key
    s = cwcore.summarize(tiny_model("llama"), input_ids=IDS, top_k=3, rows=[-1])
    for name, tensor in summary_fields(s[0]).items():
        assert tensor.numel() <= 2 * 4 * 12 * 3, name


@pytest.mark.slow
def test_smollm2_summary_equals_the_dense_reduction():
    model, tokenizer = cwcore.load_model("smollm2-135m")
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 7, return_tensors="pt")["input_ids"][:, :64]
    options = dict(top_k=8, rows=[-1, 30])
    s = cwcore.summarize(model, input_ids=ids, **options)
    d = cwcore.decompose(model, input_ids=ids)
    assert_equal_to_dense(s, d, None, **options)


@pytest.mark.parametrize("pad_decoder", [False, True])
def test_an_encoder_decoders_padding_is_read_from_each_call_not_matched_by_length(pad_decoder):
    """Encoder and decoder of 9 tokens, the encoder padded (and the decoder too): the encoder's mask must pad
    encoder queries only, the decoder's mask the decoder's self- and cross-attention queries; every row the
    summary gives is the decomposition's (matching masks by length padded real decoder rows)."""
    from zoo_models import VOCAB as BART_VOCAB, bart

    model = bart()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, BART_VOCAB, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:], ids[1, 6:] = 0, 1
    inputs = dict(input_ids=ids, attention_mask=mask,
                  decoder_input_ids=torch.randint(3, BART_VOCAB, (2, 9), generator=generator))
    if pad_decoder:
        inputs["decoder_attention_mask"] = torch.ones(2, 9, dtype=torch.long)
        inputs["decoder_attention_mask"][0, 7:] = 0
    # rows=-1 is padding of the encoder's second sequence (and of the decoder's first, when padded)
    with pytest.warns(UserWarning, match=r"position 8 in sequences \[1\] of the encoder"
                      + (r"; position 8 in sequences \[0\] of the decoder" if pad_decoder else r"\), so")):
        summary = cwcore.summarize(model, **inputs)
    d = cwcore.decompose(model, **inputs)
    assert summary.layers == d.layers == [0, 1, 2, 3, 4, 5]
    for layer in d.layers:
        expected = d[layer].output_norm
        assert torch.equal(summary[layer].output_norm.isnan(), expected.isnan()), layer
        torch.testing.assert_close(summary[layer].output_norm.nan_to_num(0), expected.nan_to_num(0), rtol=1e-5,
                                   atol=1e-6)
    assert d[3].output_norm.isnan().sum() == (2 if pad_decoder else 0)  # the control: real decoder rows stay real
    assert d[0].output_norm[1, 6:].isnan().all()


def test_summarize_enters_as_decompose_does_a_compiled_model_and_one_without_weights():
    """One entry check for decompose, summarize and attribute: a torch.compile'd model is summarised as its
    module (the same numbers), and a model whose weights are on the meta device is refused in one line."""
    import transformers
    from cwcore.core.inputs import InputError
    from tiny_models import VOCAB as TINY_VOCAB, tiny_model

    model = tiny_model("llama").eval()
    ids = torch.randint(0, TINY_VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    plain = cwcore.summarize(model, input_ids=ids, top_k=3)
    compiled = cwcore.summarize(torch.compile(model, backend="eager"), input_ids=ids, top_k=3)
    for layer in plain.layers:
        torch.testing.assert_close(compiled[layer].contribution_received, plain[layer].contribution_received,
                                   rtol=0, atol=0)
    # numbers alone pass through dynamo's eager backend too: the module itself was summarised, under its own names
    assert [compiled[layer].block_name for layer in compiled.layers] == ["model.layers.0.self_attn",
                                                                          "model.layers.1.self_attn"]
    with torch.device("meta"):
        empty = transformers.AutoModelForCausalLM.from_config(model.config)
    with pytest.raises(InputError, match="meta device"):
        cwcore.summarize(empty, input_ids=ids)


def _adoptions(monkeypatch):
    """A list of (layer, adopted) per summarised layer call: whether the layer took the model's SDPA output as z."""
    from cwcore.core import summary as summary_module

    real, seen = summary_module._summarise_layer, []

    def spy(session, block, *args):
        result = real(session, block, *args)
        seen.append((block.layer, result[-1]))
        return result

    monkeypatch.setattr(summary_module, "_summarise_layer", spy)
    return seen


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_sdpa_models_own_output_is_adopted_and_the_summary_still_equals_the_dense_reduction(family, monkeypatch):
    """Without padding, an SDPA-configured layer's z is the model's own SDPA output (no alpha @ V of its own), and
    every summary is still the dense reduction; with a padded key the layer computes alpha @ V itself."""
    model = _long_model(family, sliding_window=300)
    ids = torch.randint(0, 4000, (2, 700), generator=torch.Generator().manual_seed(3))
    seen = _adoptions(monkeypatch)
    options = dict(top_k=8, rows=[-1, 400])
    s = cwcore.summarize(model, input_ids=ids, **options)
    assert seen == [(0, True), (1, True)]
    assert_equal_to_dense(s, cwcore.decompose(model, input_ids=ids), None, **options)
    with torch.no_grad():  # the forward is the model's own, bit for bit
        torch.testing.assert_close(s.outputs.logits, model(input_ids=ids).logits, rtol=0, atol=0)
    seen.clear()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    cwcore.summarize(model, input_ids=ids, attention_mask=mask, **options)
    assert seen == [(0, False), (1, False)]  # the control: padded keys, so alpha @ V is computed and compared


def test_an_sdpa_output_wrong_in_one_entry_is_refused_by_the_check_along_random_directions(monkeypatch):
    """The adopted output is checked: an SDPA whose output is off by 1e-3 (relative to its largest entry) in
    a single entry of one head, one query, one dimension is refused, with about that error measured; off by 1e-6
    it passes (float32's tolerance is 1e-4)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    real = ALL_ATTENTION_FUNCTIONS["sdpa"]
    model = _long_model("llama")
    ids = torch.randint(0, 4000, (1, 200), generator=torch.Generator().manual_seed(5))
    seen = _adoptions(monkeypatch)

    def off_by(size):
        def sdpa(module, query, key, value, attention_mask, **kwargs):
            output, weights = real(module, query, key, value, attention_mask, **kwargs)
            output = output.clone()
            output[0, 123, 2, 7] += size * output.abs().max()  # [batch, query, head, dim]
            return output, weights
        return as_transformers_kernel(sdpa)

    try:
        AttentionInterface.register("sdpa", off_by(1e-3))
        with pytest.raises(cwcore.UnsupportedModelError,
                           match=r"different outputs \(relative error ([0-9.e+-]+) > 0.0001 .*8 random directions") as raised:
            cwcore.summarize(model, input_ids=ids)
        measured = float(str(raised.value).split("relative error ")[1].split(" ")[0])
        assert 2e-4 < measured < 1e-2 and "model.layers.0.self_attn" in str(raised.value)
        AttentionInterface.register("sdpa", off_by(1e-6))
        cwcore.summarize(model, input_ids=ids)
        assert seen == [(0, True), (1, True)]
    finally:
        AttentionInterface.register("sdpa", real)


def test_a_long_input_shows_a_bar_over_the_layers_and_the_summary_is_unchanged(capsys, monkeypatch):
    # before: summarize took no `progress` and showed nothing, minutes long at 32k tokens
    from cwcore.core import summary as summary_module

    model = tiny_model("llama")
    quiet = cwcore.summarize(model, input_ids=IDS, progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(summary_module, "PROGRESS_TOKENS", IDS.numel())  # 24 tokens count as long
    shown = cwcore.summarize(model, input_ids=IDS)
    err = capsys.readouterr().err
    assert "summarize (24 tokens)" in err and "/2 " in err  # a bar over the model's 2 layers
    for layer in (0, 1):
        assert torch.equal(shown[layer].contribution_received, quiet[layer].contribution_received)
    cwcore.summarize(model, input_ids=IDS[:1])  # 12 tokens: below the threshold, no bar
    assert capsys.readouterr().err == ""
    with pytest.raises(InputError, match=r"^progress must be True, False or None, got 'yes'$"):
        cwcore.summarize(model, input_ids=IDS, progress="yes")


@pytest.mark.parametrize("padded", [False, True])
def test_three_heads_per_key_value_head_and_a_scaling_that_is_no_power_of_two(padded, monkeypatch):
    # the summary computes a block one key/value head at a time (its 3 query heads stacked as the rows of one
    # product, as on SmolLM2) and merges the groups' top terms; head_dim 12 gives scaling 12^-0.5, applied to the
    # products as the dense path does, not to the queries. Blocks of 16 queries (MIN_BLOCK): many blocks and groups
    # per layer (BLOCK_ELEMENTS at its default gave one block of all 200 queries, so no merge across blocks was seen)
    from cwcore.core import summary as summary_module

    monkeypatch.setattr(summary_module, "ROWS_PER_DIM", 0)
    monkeypatch.setattr(summary_module, "BLOCK_ELEMENTS", 1)
    spans = [(start, stop) for start, stop, *_ in summary_module._block_spans(None, True, 0, 200, 200, 3, 12)]
    assert spans[:2] == [(0, 16), (16, 32)] and len(spans) == 13
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=4000, hidden_size=72, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    assert model.model.layers[0].self_attn.scaling == 12 ** -0.5
    ids = torch.randint(0, 4000, (2, 200), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :21] = 0
    options = dict(top_k=8, rows=[-1, 77], token_rows=[5, -1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = cwcore.summarize(model, input_ids=ids, attention_mask=mask, **options)
    # padded: token row 5 is padding of the first sequence, and only that is warned
    assert [str(w.message).split(")")[0] for w in caught] == (
        ["cwcore.summarize: chosen rows are padding (position 5 in sequences [0]"] if padded else [])
    assert_equal_to_dense(s, cwcore.decompose(model, input_ids=ids, attention_mask=mask), mask, **options)


@pytest.mark.parametrize("kind", ["inter", "intra"])
def test_a_small_but_nonzero_output_keeps_its_contributions(kind):
    """NaN where ||o_i|| <= ZERO_NORM (1e-12), as documented. Before, ||o_i||^2 was compared with it, so outputs
    below 1e-6 (the last layer's W_O scaled by 1e-7, which leaves c unchanged) made every c NaN, in decompose
    and in summarize, while the relative norm and the cosine stayed finite."""
    model = tiny_model("llama")
    before = cwcore.decompose(model, input_ids=IDS)[1].contribution(kind)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight.mul_(1e-7)
    d = cwcore.decompose(model, input_ids=IDS)
    assert 1e-12 < d[1].output_norm.max() < 1e-6
    torch.testing.assert_close(d[1].contribution(kind), before, rtol=1e-4, atol=1e-6, equal_nan=True)
    s = cwcore.summarize(model, input_ids=IDS, top_k=5, rows=[-1], kind=kind)
    assert_equal_to_dense(s, d, torch.ones_like(IDS), top_k=5, rows=[-1], kind=kind)
    kept = s[1].top.head >= 0  # the first query has 4 terms for 5 places
    assert torch.isfinite(s[1].top.cosine[kept]).all() and torch.isfinite(s[1].contribution_received).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_softcapped_scores_of_a_half_precision_model_are_capped_in_its_dtype_as_the_model_caps_them(dtype):
    """Gemma 2 caps its attention scores (tanh(s / cap) cap). The eager forward, and decompose with it, caps the
    bf16/fp16 scores; the summary cast them to float32 first: its alpha was not the model's (rows off by 2e-3 in
    bf16) and the logits it returned differed from the model's own by 6e-3."""
    config = tf.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                             attn_logit_softcapping=50.0, sliding_window=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = tf.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # scores of a few units, where the cap bends them
            layer.self_attn.q_proj.weight.mul_(12)
            layer.self_attn.k_proj.weight.mul_(12)
    model = model.to(dtype)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    options = dict(top_k=5, rows=[-1, 5])
    s = cwcore.summarize(model, layers=0, input_ids=ids, **options)
    assert_equal_to_dense(s, cwcore.decompose(model, layers=0, input_ids=ids), torch.ones_like(ids), **options)
    with torch.no_grad():
        own = model(input_ids=ids).logits
    torch.testing.assert_close(s.outputs.logits, own, rtol=0, atol=0)


def test_a_float64_eager_model_that_turns_padding_into_nan_is_refused_as_decompose_refuses_it():
    """transformers' eager attention adds float64's minimum as its mask and takes the softmax in float32, where it
    is -inf: a left-padded row that sees no key is NaN, and the NaN reaches the real tokens through the next
    layer's values (the model's own logits are NaN). decompose refuses that; summarize filled the mask with
    float32's minimum and returned finite summaries and logits the model never computed."""
    from cwcore.core.decomposition import prepare_inputs

    model = tiny_model("llama", dtype=torch.float64)
    with torch.no_grad():
        own = model(**prepare_inputs(model, dict(input_ids=IDS, attention_mask=LEFT_PADDED))).logits
    assert own[1, 3:].isnan().any()  # the model's own forward
    with pytest.raises(cwcore.UnsupportedModelError) as dense:
        cwcore.decompose(model, input_ids=IDS, attention_mask=LEFT_PADDED)
    with pytest.raises(cwcore.UnsupportedModelError) as streamed:
        cwcore.summarize(model, input_ids=IDS, attention_mask=LEFT_PADDED)
    assert str(streamed.value) == str(dense.value)
    assert "holds NaN or inf" in str(streamed.value)
    # the control: in float32 the rows that see no key stay finite, in the model and in the summary
    s = cwcore.summarize(tiny_model("llama"), input_ids=IDS, attention_mask=LEFT_PADDED)
    assert torch.isfinite(s.outputs.logits[1, 3:]).all()


@pytest.mark.parametrize("encoder, decoder", [(6, 9), (9, 6)])
def test_an_encoder_decoders_chosen_rows_are_each_layers_own_queries(encoder, decoder):
    """rows=-1 was resolved against the encoder's length for every layer: with a longer encoder, the decoder's
    layers kept a row "8" of zeros that no query has; with a shorter one, -1 named decoder query 5, not its last."""
    from cwcore.core.summary import dense_summary
    from zoo_models import bart

    model = bart()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, encoder), generator=generator)
    decoder_ids = torch.randint(3, VOCAB, (1, decoder), generator=generator)
    d = cwcore.decompose(model, input_ids=ids, decoder_input_ids=decoder_ids)
    s = cwcore.summarize(model, rows=-1, input_ids=ids, decoder_input_ids=decoder_ids)
    for layer in s.layers:
        queries = d[layer].attention.shape[2]
        assert s[layer].row_positions == (queries - 1,)
        reference = dense_summary(d[layer], None, rows=(-1,))
        torch.testing.assert_close(s[layer].row(-1), reference.row(-1), rtol=1e-5, atol=1e-6, equal_nan=True)
    with pytest.raises(InputError, match=f"has {min(encoder, decoder)} queries"):
        cwcore.summarize(model, rows=max(encoder, decoder) - 1, input_ids=ids, decoder_input_ids=decoder_ids)


def test_a_vision_models_pixels_are_summarised_as_decompose_reads_them():
    """summarize failed with an AttributeError on inputs without input_ids (pixel_values, input_features)."""
    from tiny_models import tiny_vit

    vit = tiny_vit()
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    d = cwcore.decompose(vit, pixel_values=pixels)
    s = cwcore.summarize(vit, pixel_values=pixels, rows=[0, -1])
    assert_equal_to_dense(s, d, None, top_k=8, rows=[0, -1])
