"""cwcore.attribute, the one entry point to every registered method, against naive implementations
written in tests/faithfulness/test_methods.py (loops over the model's own modules and eager forwards):
head-level methods give [batch, head, query, key], token-level ones [batch, query, key] (never copied
into heads), padding follows cwcore.decompose, and a wrong name or keyword fails in one line."""

from __future__ import annotations

import pytest
import torch

import cwcore
import cwcore.faithfulness as fa
from cwcore.faithfulness import methods
from test_methods import _alti_row, _decoder_layers, _eager, _ids, _model, _terms
from tiny_models import VOCAB


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_alti_is_token_level_and_matches_loops(family):
    model, ids = _model(family), _ids(seed=2)
    got = cwcore.attribute(model, method="alti", input_ids=ids)
    assert got.level == "token" and got.layers == [0, 1] and got.dims == ("batch", "layer", "query", "key")
    assert tuple(got.tensor.shape) == (2, 2, 9, 9)
    attentions, values, inputs, _ = _eager(model, ids)
    b, n = ids.shape
    for layer in range(2):
        block = _decoder_layers(model)[layer]
        seen = {}
        after = block.pre_feedforward_layernorm if family == "gemma3" else block.post_attention_layernorm
        handle = after.register_forward_pre_hook(lambda mod, args: seen.__setitem__("y", args[0].clone()))
        with torch.no_grad():
            model(input_ids=ids)
        handle.remove()
        terms = _terms(model, layer, attentions[layer], values[layer]).sum(1).detach()
        naive = torch.zeros(b, n, n, dtype=torch.float64)
        for r in range(b):
            for i in range(n):
                with torch.no_grad():
                    naive[r, i] = _alti_row(family, block, terms[r, i], block.self_attn.o_proj.bias,
                                            inputs[layer][r, i], seen["y"][r, i], i, n)
        assert got[layer].shape == (b, n, n)
        torch.testing.assert_close(got[layer].double(), naive, rtol=1e-5, atol=1e-7)
        # one number per token pair: a query's scores sum to 1 over keys, not to the number of heads
        torch.testing.assert_close(got[layer].double().sum(-1), torch.ones(b, n, dtype=torch.float64))
        torch.testing.assert_close(got.tensor[:, layer], got[layer])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_alti_of_a_bf16_model_is_its_geometry_in_float64_within_float32_rounding(family):
    # before: ALTI ran in the model's dtype; a score is ||y_i||_1 - ||y_i - T_i(x_j)||_1, two nearly equal sums,
    # and bf16 sums were off by up to 2.4e-2 here (17% of the largest score on a bf16 GPT-2); Gemma 3's
    # post-attention norm is read at float32 precision too (its gain, its output)
    model, ids = _model(family).to(torch.bfloat16), _ids(seed=2)
    got = cwcore.attribute(model, method="alti", input_ids=ids)
    _, values, inputs, _ = _eager(model, ids)  # the bf16 model's own values and layer inputs
    # cwcore keeps a half-precision layer's probabilities in float32 (eager rounds them to bf16 for alpha V)
    attentions = cwcore.decompose(model, input_ids=ids).attention
    b, n = ids.shape
    for layer in range(2):
        block = _decoder_layers(model)[layer]
        weight, bias = block.self_attn.o_proj.weight.double(), block.self_attn.o_proj.bias
        d = values[layer].shape[-1]
        terms = torch.zeros(b, n, n, weight.shape[0], dtype=torch.float64)  # sum_h alpha^h_ij W_O^h v^h_j
        for h in range(attentions[layer].shape[1]):
            projected = values[layer][:, h].double() @ weight[:, h * d:(h + 1) * d].T
            terms += attentions[layer][:, h, :, :, None].double() * projected[:, None]
        naive = torch.zeros(b, n, n, dtype=torch.float64)
        for r in range(b):
            for i in range(n):
                with torch.no_grad():
                    naive[r, i] = _alti_row(family, block, terms[r, i], None if bias is None else bias.double(),
                                            inputs[layer][r, i].double(), None, i, n)
        assert got[layer].dtype == torch.float32
        # float32 arithmetic on the same bf16 inputs: 3.8e-7 at most here (the old bf16 sums: 2.4e-2 and 9.2e-3)
        torch.testing.assert_close(got[layer].double(), naive, rtol=0, atol=2e-6)


def test_value_zeroing_is_token_level_and_matches_zeroing_the_value_rows():
    model, ids = _model("llama"), _ids(n=1, length=6)
    got = cwcore.attribute(model, {"input_ids": ids}, method="value_zeroing")
    _, _, _, clean = _eager(model, ids)
    n = ids.shape[1]
    assert got.level == "token"
    for layer in range(2):
        naive = torch.zeros(1, n, n, dtype=torch.float64)
        v_proj = _decoder_layers(model)[layer].self_attn.v_proj
        for j in range(n):  # key 0 included: the user's attribution scores every causal pair
            handle = v_proj.register_forward_hook(lambda mod, args, out, j=j: out.index_fill(1, torch.tensor([j]), 0.0))
            _, _, _, altered = _eager(model, ids)
            handle.remove()
            naive[:, j:, j] = (1 - torch.nn.functional.cosine_similarity(clean[layer], altered[layer], dim=-1))[:, j:]
        assert naive[:, :, 0].abs().max() > 1e-4
        torch.testing.assert_close(got[layer].double(), naive, rtol=1e-5, atol=1e-8)


def test_rollout_is_the_layer_product_and_needs_no_earlier_layer_asked():
    model, ids = _model("llama"), _ids(seed=3)
    attentions, _, _, _ = _eager(model, ids)
    eye = torch.eye(ids.shape[1], dtype=torch.float64)
    product = None
    for layer in range(2):
        a = 0.5 * attentions[layer].mean(1) + 0.5 * eye
        a = a / a.sum(-1, keepdim=True)
        product = a if product is None else a @ product
    got = cwcore.attribute(model, method="rollout", layers=1, input_ids=ids)
    assert got.layers == [1] and got[1].dim() == 3
    torch.testing.assert_close(got[1].double(), product, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["inter", "intra"])
def test_head_level_methods_match_the_eager_maps_and_the_terms(kind):
    model, ids = _model("llama"), _ids(seed=4)
    attentions, values, _, _ = _eager(model, ids)
    attention = cwcore.attribute(model, method="attention", input_ids=ids)
    contribution = cwcore.attribute(model, method="contribution", input_ids=ids, kind=kind)
    assert attention.level == contribution.level == "head"
    assert tuple(contribution.tensor.shape) == (2, 2, 4, 9, 9)
    for layer in range(2):
        torch.testing.assert_close(attention[layer].double(), attentions[layer], rtol=1e-6, atol=1e-9)
        terms = _terms(model, layer, attentions[layer], values[layer]).detach()  # [b, h, i, j, m]
        if kind == "inter":
            output = terms.sum((1, 3))  # o_i without bias
            naive = torch.einsum("bim,bhijm->bhij", output, terms) / (output ** 2).sum(-1)[:, None, :, None]
        else:
            output = terms.sum(3)  # o^h_i
            naive = torch.einsum("bhim,bhijm->bhij", output, terms) / (output ** 2).sum(-1)[..., None]
        torch.testing.assert_close(contribution[layer].double(), naive, rtol=1e-5, atol=1e-8)


def test_a_one_head_model_keeps_its_head_axis_and_a_token_level_method_stays_token_level():
    """On a one-head model a head-level method's [batch, 1, query, key] was squeezed to token level (level
    "token", [batch, query, key]) against the docstring; the reference is decompose's own tensor."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64,
                            attn_implementation="eager")
    model = tf.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    got = cwcore.attribute(model, method="contribution", input_ids=ids)
    assert got.level == "head" and tuple(got[0].shape) == (2, 1, 5, 5)
    torch.testing.assert_close(got[0], cwcore.decompose(model, input_ids=ids)[0].contribution(), rtol=0, atol=0)
    rollout = cwcore.attribute(model, method="rollout", input_ids=ids)  # the control: token level as before
    assert rollout.level == "token" and tuple(rollout[1].shape) == (2, 5, 5)


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: ALTI's post-attention norm fitted on real rows
def test_padding_rows_are_nan_and_padded_keys_zero_as_in_decompose(family):
    # float32: a left-padded float64 eager Llama leaves NaN in its own outputs from layer 1 on, which is refused
    model, ids = _model(family).float(), _ids(n=1, length=7, seed=5)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones_like(ids)], 1)
    # grad_x_input: its refusal of models that attend to later keys must not read the padded queries (a
    # left-padded row with every key masked may be given all keys)
    for method in ("alti", "contribution", "grad_x_input"):
        alone = cwcore.attribute(model, method=method, input_ids=ids)
        batch = cwcore.attribute(model, method=method, input_ids=padded, attention_mask=mask)
        for layer in range(2):
            real = batch[layer][..., 2:, 2:]
            torch.testing.assert_close(real, alone[layer], rtol=1e-5, atol=1e-6)
            assert batch[layer][..., :2, :].isnan().all()
            assert (batch[layer][..., 2:, :2] == 0).all()


def test_a_masked_language_model_is_refused_by_the_next_token_methods():
    import transformers as tf

    from cwcore.core.architectures import UnsupportedModelError
    from tiny_models import tiny_model

    torch.manual_seed(0)
    config = tiny_model("bert").config
    masked_lm = tf.BertForMaskedLM(config).eval()
    ids = torch.tensor([[5, 7, 9, 11, 13, 2]])
    # before: its masked-LM logits were read as next-token scores, a plausible attribution of nothing the model does
    with pytest.raises(UnsupportedModelError, match=r"^grad_x_input: attention layer 0 attends to later keys"):
        cwcore.attribute(masked_lm, method="grad_x_input", input_ids=ids)
    with pytest.raises(UnsupportedModelError, match=r"^faithfulness: attention layer 0 attends to later keys"):
        fa.faithfulness_curve(masked_lm, None, ids, metric=["random"], ratios=[0.1], mode="comprehensiveness",
                              progress=False)
    # the control: the methods that do not read a next token take it
    torch.testing.assert_close(cwcore.attribute(masked_lm, method="contribution", input_ids=ids)[0],
                               cwcore.decompose(masked_lm, input_ids=ids)[0].contribution("inter"))


def test_method_scores_keeps_the_sweeps_head_copies_and_attribute_does_not():
    model, ids = _model("llama"), _ids(seed=6)
    copied = methods.method_scores(model, "alti", ids, keep_first_token=False)
    got = cwcore.attribute(model, method="alti", input_ids=ids)
    heads = model.config.num_attention_heads
    for layer in range(2):
        torch.testing.assert_close(copied[layer], got[layer][:, None].expand_as(copied[layer]))
        # the trap attribute removes: summed over heads like contribution weights, the copies give H per query
        expected = torch.full((2, 9), float(heads), dtype=copied[layer].dtype)
        torch.testing.assert_close(copied[layer].sum((1, 3)), expected)


def test_names_and_keywords_fail_in_one_line():
    model, ids = _model("llama"), _ids()
    assert cwcore.list_attribution_methods() == methods.available_methods()
    assert {"alti", "value_zeroing", "rollout", "contribution", "attention", "grad_x_input"} <= set(
        cwcore.list_attribution_methods())
    with pytest.raises(ValueError, match=r"unknown method 'altii'; registered methods: attention, .*alti") as err:
        cwcore.attribute(model, method="altii", input_ids=ids)
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match="method 'alti' takes no option 'kind'"):
        cwcore.attribute(model, method="alti", input_ids=ids, kind="intra")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'layer' \(did you mean 'layers'\?\)"):
        cwcore.attribute(model, method="alti", input_ids=ids, layer=1)
    with pytest.raises(ValueError, match="give the inputs once"):
        cwcore.attribute(model, {"input_ids": ids}, method="alti", attention_mask=torch.ones_like(ids))
    # beside the inputs as one mapping, a misspelt option is named, not taken for a second set of inputs
    with pytest.raises(TypeError, match=r"^attribute\(\) got unexpected keyword argument\(s\) 'layer' \(did you mean "
                       r"'layers'\?\)"):
        cwcore.attribute(model, {"input_ids": ids}, method="alti", layer=1)
    with pytest.raises(ValueError, match="kind must be 'inter' or 'intra'"):
        cwcore.attribute(model, method="contribution", input_ids=ids, kind="outer")
    # faithfulness_curve's spelling "contribution_intra": before, only the list of registered names
    with pytest.raises(ValueError, match=r"^attribute: unknown method 'contribution_intra'; the kind is its own "
                                         r"keyword here: method='contribution', kind='intra'$"):
        cwcore.attribute(model, method="contribution_intra", input_ids=ids)


def test_a_block_cwcore_cannot_decompose_is_skipped_by_default_and_refused_when_asked_for():
    from cwcore.core.architectures import attention_blocks, forget_model

    model, ids = _model("llama"), _ids()
    try:
        attention_blocks(model)[0].unsupported = "a reason measured elsewhere"  # as for nn.MultiheadAttention
        with pytest.warns(UserWarning, match=r"^cwcore\.attribute: layer 0 \('model\.layers\.0\.self_attn', "
                                             r"LlamaAttention\) is not attributed: a reason measured elsewhere"):
            got = cwcore.attribute(model, method="alti", input_ids=ids)
        assert got.layers == [1]
        torch.testing.assert_close(got[1], cwcore.attribute(model, method="alti", layers=1, input_ids=ids)[1])
        with pytest.raises(cwcore.UnsupportedModelError, match="a reason measured elsewhere"):
            cwcore.attribute(model, method="alti", layers=[0, 1], input_ids=ids)
    finally:
        forget_model(model)


def test_layers_are_numbered_as_in_a_decomposition():
    """``a[-1]`` is the last layer, as ``d[-1]`` is; a layer that was not attributed is refused by name."""
    from cwcore.core.decomposition import LayerNotDecomposedError

    model, ids = _model("llama"), _ids(seed=3)
    got = cwcore.attribute(model, method="contribution", input_ids=ids)
    assert got[-1] is got[1] and got[-2] is got[0]
    torch.testing.assert_close(got[-1], cwcore.decompose(model, input_ids=ids)[-1].contribution("inter"),
                               rtol=0, atol=0, equal_nan=True)
    only = cwcore.attribute(model, method="contribution", input_ids=ids, layers=[0])
    with pytest.raises(LayerNotDecomposedError, match="layers=1"):
        only[1]


def test_methods_a_bare_encoder_cannot_support_are_refused_with_the_true_reason():
    from cwcore.core.architectures import UnsupportedModelError
    from tiny_models import tiny_model

    bert = tiny_model("bert")  # BertModel: no LM head, W_O in BertSelfOutput outside the attention module
    ids = torch.tensor([[5, 7, 9, 11, 13, 2]])  # every id below the hidden size (64)
    # before: its hidden states were read as logits, and 64-dim "log-probabilities" gave plausible scores
    with pytest.raises(UnsupportedModelError, match=r"^grad_x_input: BertModel has no language-model head \(its "
                                                    r"output has no logits\)"):
        cwcore.attribute(bert, method="grad_x_input", input_ids=ids)
    # before: "did not run through cwcore's attention function", false: cwcore.decompose takes this model
    assert cwcore.decompose(bert, input_ids=ids).layers == [0, 1]
    with pytest.raises(UnsupportedModelError, match=r"^value_zeroing: attention block 'encoder\.layer\.0\.attention"
                                                    r"\.self' applies its output projection outside the attention "
                                                    r"module \(in BertAttention\)"):
        cwcore.attribute(bert, method="value_zeroing", input_ids=ids)
    # before: ALTI kept keys 0..i only and read the residual as a decoder's, x_i + a_i, where BERT computes
    # LayerNorm(x_i + a_i): every later key got 0 (on the packaged MiniLM, 2.3 of a layer's attention mass)
    assert bool(cwcore.decompose(bert, input_ids=ids).attention[0].triu(1).sum() > 0.1)  # the control
    with pytest.raises(UnsupportedModelError, match=r"^alti: attention layer 0 is post-LN: its residual enters a norm "
                                                    r"with the attention output, y_i = LN\(x_i \+ a_i\)"):
        cwcore.attribute(bert, method="alti", input_ids=ids)


@pytest.mark.parametrize("method", cwcore.list_attribution_methods())
def test_every_method_scores_a_bfloat16_model_under_sdpa_as_under_eager(method):
    """A bfloat16 model configured for SDPA hands cwcore its layers' values in float32 (SDPA's precision); the
    methods that rerun the model's own modules take them back to its dtype. Before, value zeroing failed there
    with "expected m1 and m2 to have the same dtype". Against the same model configured eager: the scores agree
    to bfloat16's rounding (the two differ only in how the scores before the softmax are rounded)."""
    model = _model("llama").to(torch.bfloat16)
    ids = _ids(seed=5)
    model.config._attn_implementation = "eager"
    eager = cwcore.attribute(model, method=method, input_ids=ids)
    model.config._attn_implementation = "sdpa"
    sdpa = cwcore.attribute(model, method=method, input_ids=ids)
    assert sdpa.layers == eager.layers == [0, 1]
    for layer in sdpa:
        assert sdpa[layer].dtype == eager[layer].dtype and sdpa[layer].shape == eager[layer].shape
        scale = float(eager[layer].float().abs().max())
        torch.testing.assert_close(sdpa[layer].float(), eager[layer].float(), rtol=0, atol=3e-2 * scale)


@pytest.mark.parametrize("method", ["alti", "value_zeroing", "rollout", "contribution_rollout"])
def test_a_float64_compute_dtype_reaches_every_method(method):
    """``compute_dtype=torch.float64`` on a float32 model: before, these four methods returned float32 scores
    (ALTI and value zeroing bit for bit those of float32, ALTI 5e-7 off the float64 model's), the keyword
    accepted and not applied. The reference: the same model in float64. The control: the float32 run differs."""
    import copy

    model = _model("llama").float()
    ids = _ids(seed=3)
    wide = cwcore.attribute(model, method=method, compute_dtype=torch.float64, input_ids=ids)
    single = cwcore.attribute(model, method=method, compute_dtype=torch.float32, input_ids=ids)
    reference = cwcore.attribute(copy.deepcopy(model).double(), method=method, input_ids=ids)
    for layer in wide:
        assert wide[layer].dtype == torch.float64 and single[layer].dtype == torch.float32
        assert not torch.equal(wide[layer], single[layer].double())  # the control
        torch.testing.assert_close(wide[layer], reference[layer], rtol=0, atol=2e-7, equal_nan=True)


@pytest.mark.parametrize("method", ["contribution", "alti", "value_zeroing"])
def test_a_key_value_cache_is_refused_before_the_forward(method):
    """The scores index input_ids' tokens against themselves: a cache's earlier keys have no place in them.
    Before: each method failed after the whole forward, with its own shape error."""
    model = _model("llama")
    ids = _ids(seed=2)[:1]
    with torch.no_grad():
        past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(cwcore.core.inputs.InputError, match=r"^attribute: a key/value cache holds \d+ earlier"):
        cwcore.attribute(model, method=method, input_ids=ids[:, -1:], past_key_values=past)
    assert not calls


def test_value_zeroing_scores_every_key_of_an_encoder_layer():
    """An encoder's query attends to later keys too; value zeroing scored keys 0..i only and gave every later
    key 0. The reference zeroes v_j (every head) and reruns the whole block (DistilBERT)."""
    from zoo_models import zoo_model

    model = zoo_model("distilbert")
    ids = torch.randint(2, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    got = cwcore.attribute(model, method="value_zeroing", layers=0, input_ids=ids)[0][0].double()
    block = model.transformer.layer[0]
    captured = {}
    handle = block.register_forward_pre_hook(lambda m, args, kw: captured.update(args=args, kw=kw), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
    handle.remove()

    def run(zeroed=None):
        def zero(module, args, out):
            if zeroed is None:
                return out
            out = out.clone()
            out[:, zeroed] = 0.0
            return out
        hook = block.attention.v_lin.register_forward_hook(zero)
        with torch.no_grad():
            out = block(*captured["args"], **captured["kw"])
        hook.remove()
        return (out[0] if isinstance(out, tuple) else out)[0].double()

    clean = run()
    expected = torch.stack([1 - torch.nn.functional.cosine_similarity(clean, run(j), dim=-1) for j in range(7)], -1)
    assert expected.triu(1).max() > 1e-6  # the control: later keys matter in an encoder
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=3e-7)


@pytest.mark.parametrize("method", ["contribution", "rollout", "value_zeroing", "grad_x_input"])
def test_an_encoder_decoder_is_refused_by_the_attribution_methods(method):
    """The methods score one stack over input_ids and their mask: on BART the encoder's mask made real decoder
    rows NaN, rollout multiplied the encoder's layers into the decoder's, grad_x_input differentiated the token
    after the decoder's target, and value zeroing failed inside torch. decompose reads the model as it is."""
    from zoo_models import bart

    model = bart()
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids.flip(-1))
    with pytest.raises(cwcore.UnsupportedModelError, match="is an encoder-decoder: the attribution methods score"):
        cwcore.attribute(model, method=method, **inputs)
    assert cwcore.decompose(model, **inputs).layers  # the control: the model itself is decomposed


@pytest.mark.parametrize("post_ln", [True, False])
def test_alti_refuses_a_post_ln_decoder_found_by_the_probe(post_ln):
    """OPT-350m's layers (do_layer_norm_before=False) add the residual inside their LayerNorm, y_i = LN(x_i + a_i):
    ALTI, written for y_i = x_i + N(a_i), scored them without a word (only encoders were refused). The control:
    the same architecture with its norms before the attention is scored."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=not post_ln,
                          attn_implementation="eager")
    model = tf.OPTForCausalLM(config).eval()
    ids = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    if post_ln:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"^alti: attention layer 0 is post-LN: its residual "
                                                               r"enters a norm with the attention output"):
            cwcore.attribute(model, method="alti", input_ids=ids)
    else:
        scores = cwcore.attribute(model, method="alti", input_ids=ids)
        torch.testing.assert_close(scores[0].sum(-1), torch.ones(1, 7))


def test_alti_refuses_a_layer_whose_block_output_a_hook_changes_and_the_sweep_does_too():
    """A forward hook that doubled an attention block's output left ALTI's scores bit for bit those of the unhooked
    model: it builds y_i = x_i + a_i from the output projection's result, while the model's residual received 2 a_i.
    The controls: the same layer unhooked is scored, and a method that does not model the residual update
    (contribution weights, a decomposition of the projection's output) still scores the hooked model."""
    model, ids = _model("llama"), _ids(n=1, length=7)
    unhooked = cwcore.attribute(model, method="alti", input_ids=ids)
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda module, args, out: (out[0] * 2, *out[1:]))
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"^alti models what attention layer 1 adds to the "
                           r"residual stream as its output projection's result, but .* \(relative difference 1\)"):
            cwcore.attribute(model, method="alti", input_ids=ids)
        # live scores: ALTI scores the intervened forward, where a layer's removal changes its probabilities (the
        # session's reconstruction check then skips it; the block's own output is still compared)
        for scores in ("clean", "live"):
            with pytest.raises(cwcore.UnsupportedModelError, match="alti models what attention layer 1 adds"):
                fa.faithfulness_curve(model, None, ids, metric=["alti"], ratios=[0.5], mode="comprehensiveness",
                                      n_bootstrap=2, progress=False, scores=scores)
        assert cwcore.attribute(model, method="contribution", input_ids=ids).layers == [0, 1]
        torch.testing.assert_close(cwcore.attribute(model, method="alti", input_ids=ids, layers=0)[0], unhooked[0])
    finally:
        handle.remove()
    torch.testing.assert_close(cwcore.attribute(model, method="alti", input_ids=ids)[1], unhooked[1])


def test_the_random_control_scores_a_sentence_by_its_sequence_id_whatever_its_row_and_padding():
    """attribute(method="random") hashed each row's number: the same sentence got other scores in row 1 than alone
    (0.86 relative), and nothing could say which sequence a row was. ``sequence_ids`` names them, as in
    faithfulness_curve; the reference is the documented hash of (seed, sequence, layer, head, query, key) over the
    real positions, computed here for the sentence alone."""
    from cwcore.faithfulness.ranking import hashed_uniform

    model, ids = _model("llama").float(), _ids(n=2, length=7, seed=5)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[1:]], 1)  # row 1: sentence 1, left-padded
    batch = torch.cat([torch.cat([ids[:1], ids[:1, :2]], 1), padded])
    mask = torch.cat([torch.ones(1, 9, dtype=torch.long), torch.cat([torch.zeros(1, 2), torch.ones(1, 7)], 1).long()])
    got = cwcore.attribute(model, method="random", input_ids=batch, attention_mask=mask, sequence_ids=[10, 11], seed=3)
    alone = cwcore.attribute(model, method="random", input_ids=ids[1:], sequence_ids=[11], seed=3)
    positions = torch.arange(7)[None]
    for layer in range(2):
        expected = hashed_uniform(3, torch.tensor([11]), layer, 4, positions)
        torch.testing.assert_close(alone[layer], expected, rtol=0, atol=0)
        torch.testing.assert_close(got[layer][1:, :, 2:, 2:], expected, rtol=0, atol=0)
    # the control: by default the rows are the sequence numbers, so row 1 is sequence 1, not the sentence alone's 0
    default = cwcore.attribute(model, method="random", input_ids=batch, attention_mask=mask, seed=3)
    assert not torch.equal(default[0][1:, :, 2:, 2:], cwcore.attribute(model, method="random", input_ids=ids[1:],
                                                                       seed=3)[0])
    with pytest.raises(TypeError, match="method 'alti' takes no option 'sequence_ids'"):
        cwcore.attribute(model, method="alti", input_ids=ids, sequence_ids=[0, 1])
    with pytest.raises(ValueError, match="sequence_ids has 1 ids for 2 sequences: give one id per row"):
        cwcore.attribute(model, method="random", input_ids=ids, sequence_ids=[0])


def test_attribute_truncates_as_decompose_does_and_names_the_missing_head_before_an_input():
    """attribute refused an input longer than the model's context with "... or pass truncate=True", then refused
    truncate=True as an unknown keyword; and grad_x_input on a bare encoder blamed its token_type_ids, whose
    removal only led to the true reason, the missing language-model head."""
    from cwcore.core.architectures import UnsupportedModelError
    from tiny_models import tiny_model

    model = _model("llama").float()
    limit = model.config.max_position_embeddings
    ids = torch.randint(0, VOCAB, (1, limit + 3), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=f"the input has {limit + 3} tokens .* or pass truncate=True"):
        cwcore.attribute(model, method="contribution", input_ids=ids)
    cut = cwcore.attribute(model, method="contribution", input_ids=ids, truncate=True)
    torch.testing.assert_close(cut[1], cwcore.attribute(model, method="contribution", input_ids=ids[:, :limit])[1])
    assert cut[1].shape == (1, 4, limit, limit)
    bert = tiny_model("bert")
    enc = dict(input_ids=torch.tensor([[5, 7, 9, 2]]), token_type_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(UnsupportedModelError, match="differentiates the next-token log-likelihood, and BertModel has "
                                                    "no language-model head"):
        cwcore.attribute(bert, method="grad_x_input", **enc)


def test_the_block_output_refusal_reads_only_its_own_threads_forwards():
    """ALTI's block-output refusal reads the scored forward's session, which hooks the shared model: another thread's
    forward must not make this call's layer look changed (nor hide a real change). Here a forward with the block's
    output doubled, run in another thread inside the session, leaves the session's record empty; the control: the
    same forward in the session's thread is recorded, and attribute refuses it."""
    import threading

    from cwcore.core.interventions import intervene

    model, ids = _model("llama"), _ids(n=1, length=5)
    doubling = model.model.layers[0].self_attn.register_forward_hook(lambda module, args, out: (out[0] * 2, *out[1:]))
    try:
        geometry = {0: [lambda call: call.geometry()], 1: [lambda call: call.geometry()]}  # as ALTI reads the layers
        with torch.no_grad(), intervene(model, {}, observers=geometry) as session:
            other = threading.Thread(target=lambda: model(input_ids=ids))
            other.start()
            other.join()
            assert session.changed_outputs == {}
            model(input_ids=ids)
        assert list(session.changed_outputs) == [0] and "relative difference 1" in session.changed_outputs[0]
        with pytest.raises(cwcore.UnsupportedModelError, match="alti models what attention layer 0 adds"):
            cwcore.attribute(model, method="alti", input_ids=ids)
    finally:
        doubling.remove()


def test_a_scoring_context_whose_caller_never_hands_over_the_block_outputs_is_an_error_not_a_silent_pass():
    """The block-output refusal reads what the caller hands over from its forward's session: a caller that forgot
    (a new sweep, say) would drop the refusal silently, so scoring raises instead. The control: the same forward
    with the session's record handed over leaves scoring quietly."""
    from cwcore.core.interventions import intervene
    from cwcore.faithfulness.methods.registry import scoring

    model, ids = _model("llama"), _ids(n=1, length=5)
    mask = torch.ones_like(ids)
    with pytest.raises(RuntimeError, match="set context.changed_outputs"):
        with scoring(model, [methods.get_method("alti")], ids, mask, layers=[0]):
            with torch.no_grad():
                model(input_ids=ids)
    with scoring(model, [methods.get_method("alti")], ids, mask, layers=[0]) as context:
        with torch.no_grad(), intervene(model, {}, observers={0: [lambda call: call.geometry()]}) as session:
            context.changed_outputs = session.changed_outputs
            model(input_ids=ids)
    assert context.changed_outputs == {}


@pytest.mark.parametrize("bias_scale", [0.02, 0.5])
def test_alti_counts_the_output_projections_bias_in_the_attention_output(bias_scale):
    """y_i = x_i + a_i with a_i = sum_j sum_h alpha^h_ij v~^h_j + b: no model in these tests had a nonzero W_O bias
    (Llama and Gemma have none, a fresh OPT's is zero), so ALTI without b passed. Here a pre-LN OPT with random
    biases against the naive ALTI of tests/faithfulness/test_methods.py, fed by the model's own eager maps, values
    and layer inputs; its residual stream y_i is checked against the one the model computed. Under a large bias some
    query has every c_ij = 0 (the naive 0/0 is NaN): its row is zeros, as the docstring says, and such a row occurs."""
    import transformers as tf

    from test_methods import _alti_row

    torch.manual_seed(0)
    config = tf.OPTConfig(vocab_size=97, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
                          max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=True,
                          attn_implementation="eager")
    model = tf.OPTForCausalLM(config).eval()
    layers = model.model.decoder.layers
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.out_proj.bias.normal_(0, bias_scale)
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    got = cwcore.attribute(model, method="alti", input_ids=ids)
    seen = {}

    def keep(name, l, output=False):
        if output:
            return lambda module, args, out: seen.__setitem__((name, l), out)
        return lambda module, args: seen.__setitem__((name, l), args[0])

    handles = []
    for l, layer in enumerate(layers):  # the layer's input x, its values v, its residual stream y (the MLP's norm)
        handles += [layer.register_forward_pre_hook(keep("x", l)),
                    layer.self_attn.v_proj.register_forward_hook(keep("v", l, output=True)),
                    layer.final_layer_norm.register_forward_pre_hook(keep("y", l))]
    try:
        with torch.no_grad():
            attentions = model(input_ids=ids, output_attentions=True).attentions
    finally:
        for handle in handles:
            handle.remove()
    b, n = ids.shape
    empty_rows = 0
    for l, layer in enumerate(layers):
        out_proj = layer.self_attn.out_proj
        weight, bias = out_proj.weight.detach().double(), out_proj.bias.detach().double()
        v = seen[("v", l)].double().reshape(b, n, 4, 16)
        projected = torch.einsum("bjhd,mhd->bhjm", v, weight.reshape(64, 4, 16))  # v~^h_j = v^h_j W_O^h
        terms = torch.einsum("bhij,bhjm->bijm", attentions[l].double(), projected)
        y = seen[("y", l)].double().reshape(b, n, -1)  # OPT flattens the tokens before its MLP's norm
        naive = torch.zeros(b, n, n, dtype=torch.float64)
        for r in range(b):
            for i in range(n):
                naive[r, i] = _alti_row("opt", layer, terms[r, i], bias, seen[("x", l)][r, i].double(),
                                        y[r, i], i, n)
        undefined = naive.isnan().any(-1)  # no key contributes: nothing to normalise
        empty_rows += int(undefined.sum())
        assert bool((got[l][undefined] == 0).all())
        # float32's ||y_i||_1 - ||y_i - T_i(x_j)||_1 cancels more where a large bias makes ||y_i||_1 large (3e-5)
        torch.testing.assert_close(got[l].double(), naive.nan_to_num(0.0), rtol=1e-5,
                                   atol=1e-6 if bias_scale < 0.1 else 1e-4)
    assert (empty_rows > 0) == (bias_scale > 0.1)  # the control: the large bias does reach the empty case
