"""Signed direct logit attribution (cwcore.logit_attribution) against a naive model-space computation."""

from __future__ import annotations

import pytest
import torch

from cwcore.core.architectures import UnsupportedModelError, post_attention_norms
from cwcore.logit_attribution import frozen_norm, logit_attribution, naive_logit_attribution
from tiny_models import VOCAB, tiny_model


def _ids(seed=0, batch=2, length=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "gpt2", "gpt_neox"])
def test_head_space_dla_equals_the_naive_model_space_computation(family):
    model = tiny_model(family)
    ids = _ids()
    att = logit_attribution(model, input_ids=ids, compute_dtype=torch.float64)
    assert sorted(att.by_layer) == [0, 1]
    assert (att.targets[:, :-1] == ids[:, 1:]).all()  # the next token, then the model's top prediction
    assert (att.targets[:, -1] == att.decomposition.outputs.logits[:, -1].argmax(-1)).all()
    for layer in (0, 1):
        fast, naive = att[layer], naive_logit_attribution(att, layer)
        assert fast.shape == (2, 4, 7, 7)
        torch.testing.assert_close(fast.double(), naive, rtol=1e-9, atol=1e-9)
        # causal: keys after the query push nothing; the signed values do both
        assert (fast.triu(1) == 0).all() and (fast < 0).any() and (fast > 0).any()
    # gemma3 freezes its post-attention (sandwich) norm too; the others have none
    assert bool(att.post_norms) == (family == "gemma3")


def test_dla_sums_to_the_frozen_direct_effect_of_the_block_output():
    """Independent of the head split: sum over heads and keys = <W_U[t], L_i(o_i)> with o_i taken
    from the model itself (the output projection's input, hooked) and the final norm frozen by hand."""
    model = tiny_model("llama")
    ids = _ids(1, batch=1, length=6)
    with torch.no_grad():
        model.model.norm.weight.normal_(1.0, 0.3)  # a gain that is not all ones
    assert model.model.layers[1].self_attn.o_proj.bias is None
    post_attention_norms(model)  # its probe pass (once per model, cached) before the hooks below
    seen = {}
    block = model.model.layers[1].self_attn

    def keep(name, which):
        def hook(module, args, out):
            seen.setdefault(name, (out if which == "out" else args[0]).detach())  # the first call: the clean run
        return hook

    h = block.o_proj.register_forward_hook(keep("o", "out"))  # no bias: the block output o_i
    h2 = model.model.norm.register_forward_hook(keep("x", "in"))
    att = logit_attribution(model, layers=[1], input_ids=ids)
    h.remove(), h2.remove()
    norm = model.model.norm
    x = seen["x"].double()
    rms = (x.pow(2).mean(-1) + norm.variance_epsilon).sqrt()  # the clean run's RMS, frozen
    direct = norm.weight.double() * seen["o"].double() / rms[..., None]
    w_u = model.lm_head.weight.double()[att.targets[0]]
    expected = (direct[0] * w_u).sum(-1)  # [query]
    torch.testing.assert_close(att.token_level(1)[0].sum(-1).double(), expected, rtol=1e-4, atol=1e-5)


def test_gemma3s_frozen_sandwich_norm_matches_the_models_own_norms():
    """The frozen post-attention (sandwich) norm, independent of cwcore's own norm objects: the naive reference above
    reads att.post_norms, so a wrong frozen gain or RMS there passed it (doubling every post-norm scale did). Here
    o_i is hooked from the model, both RMS are taken from the clean run by hand, and Gemma's gains are 1 + weight."""
    model = tiny_model("gemma3")
    ids = _ids(3, batch=1, length=6)
    layer = model.model.layers[1]
    with torch.no_grad():  # gains that are not all ones
        layer.post_attention_layernorm.weight.normal_(0.0, 0.5)
        model.model.norm.weight.normal_(0.0, 0.5)
    post_attention_norms(model)  # its probe pass (once per model, cached) before the hooks below
    seen = {}

    def keep(name, which):
        def hook(module, args, out):
            seen.setdefault(name, (out if which == "out" else args[0]).detach())  # the first call: the clean run
        return hook

    handles = [layer.self_attn.o_proj.register_forward_hook(keep("o", "out")),  # no bias: the block output o_i
               model.model.norm.register_forward_hook(keep("x", "in"))]
    att = logit_attribution(model, layers=[1], input_ids=ids)
    for h in handles:
        h.remove()

    def frozen(norm, x, rms_of):
        rms = (rms_of.double().pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # the clean run's RMS, frozen
        return (1.0 + norm.weight.double()) * x / rms

    o = seen["o"].double()
    direct = frozen(model.model.norm, frozen(layer.post_attention_layernorm, o, o), seen["x"])
    expected = (direct[0] * model.lm_head.weight.double()[att.targets[0]]).sum(-1)  # [query]
    torch.testing.assert_close(att.token_level(1)[0].sum(-1).double(), expected, rtol=1e-4, atol=1e-5)


def test_chosen_target_and_layernorm_centring():
    model = tiny_model("gpt2")
    ids = _ids(2, batch=1, length=5)
    att = logit_attribution(model, targets=3, input_ids=ids)
    assert (att.targets == 3).all() and att.final_norm.centred  # GPT-2's ln_f is a LayerNorm
    torch.testing.assert_close(att[0].double(), naive_logit_attribution(att, 0), rtol=1e-5, atol=1e-6)
    llama = logit_attribution(tiny_model("llama"), input_ids=ids)
    assert not llama.final_norm.centred


def test_norms_that_are_not_affine_at_frozen_scale_are_refused():
    class Tanh(torch.nn.Module):
        weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return torch.tanh(x) * self.weight

    x = torch.randn(1, 3, 8) * 3
    with pytest.raises(UnsupportedModelError, match="not of the form"):
        frozen_norm(Tanh(), x, Tanh()(x))


def test_encoders_without_a_language_model_head_are_refused():
    with pytest.raises(UnsupportedModelError, match="no language-model head"):
        logit_attribution(tiny_model("bert"), input_ids=_ids(batch=1))


def test_softcapped_logits_are_refused():
    model = tiny_model("gemma3")
    model.config.final_logit_softcapping = 0.5
    with pytest.raises(UnsupportedModelError, match="softcaps its logits"):
        logit_attribution(model, input_ids=_ids(batch=1))
    model.config.final_logit_softcapping = None  # a cap the config does not name: the measured check finds it
    model.lm_head.register_forward_hook(lambda module, args, out: 0.5 * torch.tanh(out / 0.5))
    with pytest.raises(UnsupportedModelError, match="softcapped or scaled logits"):
        logit_attribution(model, input_ids=_ids(batch=1))


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_a_padded_batch_gives_each_sequence_its_own_attribution(family):
    """Before: a left-padded Gemma 3 under SDPA was refused as "Gemma3RMSNorm is not of the form g * P(x) / s + b
    (relative error nan)": SDPA gives NaN to a padding query that sees no key, and the norms were fitted on every
    row. They are fitted on the real tokens; a padding query's row is NaN."""
    model = tiny_model(family)
    model.config._attn_implementation = "sdpa"
    ids = torch.tensor([[0, 0, 5, 9, 2, 7], [3, 8, 5, 9, 2, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    padded = logit_attribution(model, input_ids=ids, attention_mask=mask)
    for row, start in ((0, 2), (1, 0)):
        alone = logit_attribution(model, input_ids=ids[row:row + 1, start:])
        for layer in alone.by_layer:
            torch.testing.assert_close(padded[layer][row, :, start:, start:], alone[layer][0], rtol=1e-5, atol=1e-6)
            assert padded[layer][row, :, :start].isnan().all()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_right_padded_sequence_targets_its_own_top_prediction_at_its_last_token(family):
    """The default targets are the next tokens and, at a sequence's last token, the model's top prediction. Before,
    a right-padded sequence's last real token took the padding id as its target (the top prediction went to the
    last column, a padding token's), and its row of every layer was another logit's attribution (0.1 off). The
    reference: each sequence alone, whose last column is its last token."""
    model = tiny_model(family)
    ids = torch.tensor([[5, 9, 2, 7, 0, 0], [3, 8, 5, 9, 2, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    padded = logit_attribution(model, input_ids=ids, attention_mask=mask)
    for row, length in ((0, 4), (1, 6)):
        alone = logit_attribution(model, input_ids=ids[row:row + 1, :length])
        assert torch.equal(padded.targets[row, :length], alone.targets[0])
        for layer in alone.by_layer:
            torch.testing.assert_close(padded[layer][row, :, :length, :length], alone[layer][0], rtol=1e-5, atol=1e-6)
    assert padded.targets[0, 3] != 0  # the control: the pad id (0) is not the model's top prediction there


def test_granites_residual_multiplier_scales_the_direct_effect():
    """Granite adds m * attn(h) to the residual: the direct effect of the last block's output o_i (hooked from the
    model, no head split) through the frozen final norm is m <W_U[t], L(o_i)>; DLA came out 1/m times too large."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.GraniteConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              attn_implementation="eager", residual_multiplier=0.25, logits_scaling=1.0,
                              embedding_multiplier=1.0, attention_multiplier=0.3)
    model = tf.GraniteForCausalLM(config).eval()
    ids = _ids(0, batch=1, length=8)
    att = logit_attribution(model, input_ids=ids, compute_dtype=torch.float64)
    seen = {}
    hooks = [model.model.layers[1].self_attn.o_proj.register_forward_hook(
                 lambda m, a, o: seen.__setitem__("o", o.detach().double())),
             model.model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("x", a[0].detach().double()))]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    norm = model.model.norm
    rms = (seen["x"].pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    direct = 0.25 * seen["o"] * norm.weight.detach().double() / rms  # [batch, query, model]
    expected = (direct[0] * model.lm_head.weight.detach().double()[att.targets[0]]).sum(-1)
    torch.testing.assert_close(att.token_level(1)[0].sum(-1).double(), expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(att[1].double(), naive_logit_attribution(att, 1), rtol=1e-9, atol=1e-12)
    assert att[-1] is att[1] and torch.equal(att.token_level(-2), att.token_level(0))  # numbers from the end
    # the factor the layers apply, not the config's: an edit after loading doubled the attribution (no refusal)
    model.config.residual_multiplier = 0.5
    edited = logit_attribution(model, input_ids=ids, compute_dtype=torch.float64)
    torch.testing.assert_close(edited.token_level(1)[0].sum(-1).double(), expected, rtol=1e-6, atol=1e-9)


def test_return_dict_logits_to_keep_an_encoding_as_targets_and_softcaps_are_refused_not_unchecked():
    """return_dict=False hid the logits and skipped the check (a Cohere's scaled logits attributed 16x);
    logits_to_keep=1 was refused as 'scaled logits'; a small softcapped logit passed the global check."""
    model, ids = tiny_model("llama"), _ids(batch=1)
    with pytest.raises(ValueError, match="leave return_dict out"):
        logit_attribution(model, targets=5, input_ids=ids, return_dict=False)
    with pytest.raises(ValueError, match="leave logits_to_keep out"):
        logit_attribution(model, input_ids=ids, logits_to_keep=1)
    with pytest.raises(ValueError, match="the second positional argument is targets"):
        logit_attribution(model, {"input_ids": ids})
    gemma = tiny_model("gemma3")
    gemma.config.final_logit_softcapping = 1e4  # far above these logits: the check alone would pass it
    with pytest.raises(UnsupportedModelError, match="softcaps its logits"):
        logit_attribution(gemma, input_ids=ids)


def test_truncate_cuts_the_ids_the_targets_are_read_from():
    model = tiny_model("llama")
    limit = model.config.max_position_embeddings
    ids = torch.randint(0, VOCAB, (1, limit + 6), generator=torch.Generator().manual_seed(4))
    att = logit_attribution(model, input_ids=ids, truncate=True)
    alone = logit_attribution(model, input_ids=ids[:, :limit])
    assert torch.equal(att.targets, alone.targets) and att.targets.shape == (1, limit)
    torch.testing.assert_close(att[1], alone[1], rtol=0, atol=0)


def test_a_float64_model_is_attributed_in_float64_as_decompose_does():
    """logit_attribution computed a float64 model in float32 (3e-7 from its own precision); decompose,
    summarize, attribute and intervene default to the model's own float64."""
    model = tiny_model("llama").double()
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    default, float64 = logit_attribution(model, input_ids=ids), logit_attribution(model, input_ids=ids,
                                                                                   compute_dtype=torch.float64)
    assert default[1].dtype == torch.float64
    torch.testing.assert_close(default[1], float64[1], rtol=0, atol=0)
    assert logit_attribution(tiny_model("llama"), input_ids=ids)[1].dtype == torch.float32  # the control
    with pytest.raises(ValueError, match="compute_dtype must be torch.float32 or torch.float64"):
        logit_attribution(model, input_ids=ids, compute_dtype=torch.float16)


def test_an_encoder_decoder_and_a_projection_after_the_final_norm_are_refused_with_their_reason():
    """T5 failed inside transformers (the norm probe ran without decoder inputs); OPT's project_out failed in a
    matrix product."""
    import transformers as tf
    from zoo_models import bart

    ids = _ids(batch=1)
    with pytest.raises(UnsupportedModelError, match="has cross-attention"):
        logit_attribution(bart(), input_ids=ids, decoder_input_ids=ids)
    config = tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, word_embed_proj_dim=32, num_hidden_layers=2,
                          ffn_dim=96, num_attention_heads=4, max_position_embeddings=64)
    with pytest.raises(UnsupportedModelError, match="final norm gives width 64, its unembedding reads 32"):
        logit_attribution(tf.OPTForCausalLM(config).eval(), input_ids=ids)
