"""Exact or refused: every decompose/intervene checks itself against what the model computed.

Each family is a tiny random model; the references are the model's own eager run and the
output projection's actual input and output.
"""

import pytest
import torch
import transformers as tf
from torch import nn

import cwcore
from cwcore.core import architectures
from cwcore.core.attention import AttentionSession, cwcore_attention, every_layer
from tiny_models import VOCAB, tiny_model

IDS = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64)


def _model(config_cls, model_cls, **extra):
    torch.manual_seed(0)
    model = model_cls(config_cls(**COMMON, **extra)).eval()
    model.config._attn_implementation = "eager"
    return model


def gpt_oss():
    return _model(tf.GptOssConfig, tf.GptOssForCausalLM, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                  num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4)


def test_learned_sink_logits_are_exact_and_their_mass_is_exposed():
    model = gpt_oss()
    with torch.no_grad():
        eager = model(input_ids=IDS, output_attentions=True)
    d = cwcore.decompose(model, input_ids=IDS)
    assert torch.equal(d.outputs.logits, eager.logits)  # the model computes what it always computes
    masses = {}
    session = AttentionSession(model, observers=every_layer(model, lambda c: masses.__setitem__(c.layer, (c.probs, c.learned_sink_mass))))
    with torch.no_grad(), cwcore_attention(model, session):
        model(input_ids=IDS)
    for layer in d.layers:
        torch.testing.assert_close(d.attention[layer], eager.attentions[layer], rtol=0, atol=1e-7)
        probs, mass = masses[layer]
        assert float(mass.min()) > 0  # the sink absorbs some mass, so alpha sums to less than 1
        torch.testing.assert_close(mass, 1 - probs.sum(-1), rtol=0, atol=1e-6)
        # the terms still sum to o_i: contribution weights sum to one
        sums = d.inter[layer].sum((1, 3))
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4)



@pytest.mark.parametrize("layers", [[0], [1]])
def test_learned_sinks_stay_in_the_layers_a_session_does_not_touch(layers):
    """Recording some layers of GPT-OSS (eager) never changes its logits, sinks included."""
    model = gpt_oss()
    with torch.no_grad():
        eager = model(input_ids=IDS).logits
    d = cwcore.decompose(model, layers=layers, input_ids=IDS)
    torch.testing.assert_close(d.outputs.logits, eager, rtol=0, atol=1e-5)
    session = AttentionSession(model, observers={layer: [lambda call: None] for layer in layers})
    with torch.no_grad(), cwcore_attention(model, session):
        torch.testing.assert_close(model(input_ids=IDS).logits, eager, rtol=0, atol=1e-5)


def test_learned_sinks_under_sdpa_are_refused_with_the_reason():
    """transformers' SDPA function drops `s_aux`, so GPT-OSS configured for SDPA by hand (transformers refuses
    set_attn_implementation("sdpa") for it) computes something else than its eager forward: neither can be
    matched while the other is claimed, so cwcore refuses instead of changing the model's outputs."""
    model = gpt_oss()
    with torch.no_grad():
        eager = model(input_ids=IDS).logits
        model.config._attn_implementation = "sdpa"
        own_sdpa = model(input_ids=IDS).logits
    assert (own_sdpa - eager).abs().max() > 1e-2  # the model's SDPA forward really leaves the sinks out
    for layers in ([0], None):
        with pytest.raises(cwcore.UnsupportedModelError, match=r"learned sink logits \(s_aux\).*'sdpa'.*eager"):
            cwcore.decompose(model, layers=layers, input_ids=IDS)
    with torch.no_grad():  # the refusal left the model as it was
        torch.testing.assert_close(model(input_ids=IDS).logits, own_sdpa, rtol=0, atol=0)


def test_gated_attention_is_refused_with_the_reason():
    model = _model(tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, num_key_value_heads=2, head_dim=16,
                   layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=4,
                   linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    with pytest.raises(cwcore.UnsupportedModelError, match="output projection received something other"):
        cwcore.decompose(model, input_ids=IDS)


class _OwnAttention(nn.Module):
    """Computes attention itself instead of calling transformers' attention interface."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.o_proj = nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o_proj(torch.softmax(q @ k.transpose(1, 2), -1) @ v)


class _OwnModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.attn = _OwnAttention()

    def forward(self, input_ids):
        return self.attn(self.embed(input_ids))


def test_a_block_that_bypasses_the_attention_interface_is_refused_not_empty():
    with pytest.raises(cwcore.UnsupportedModelError, match="did not run through cwcore's attention function"):
        cwcore.decompose(_OwnModel().eval(), input_ids=torch.tensor([[1, 2, 3]]))


def test_a_finder_returning_a_weight_no_module_of_the_block_owns_is_refused_as_not_a_module_of_the_block():
    """A finder that returns a bare weight of another layer is refused structurally, before any forward: no module
    of the block owns it, so cwcore could not check it. (This test was named for the reconstruction check, which
    it never reached; the next test is the reconstruction check's.)"""
    model = tiny_model("llama")

    def wrong(module, parent):  # W_O of the *other* layer: plausible shapes, wrong numbers
        layers = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
        if module in layers:
            other = layers[1 - layers.index(module)]
            return other.o_proj.weight, None
        return None

    finders = list(architectures._FINDERS)
    architectures.forget_model(model)
    cwcore.register_output_projection(wrong)
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match="not a module of the block"):
            cwcore.decompose(model, input_ids=IDS)
    finally:
        architectures._FINDERS[:] = finders
        architectures.forget_model(model)


def _decompose_with_finder(model, finder):
    finders = list(architectures._FINDERS)
    architectures.forget_model(model)
    cwcore.register_output_projection(finder)
    try:
        return cwcore.decompose(model, input_ids=IDS)
    finally:
        architectures._FINDERS[:] = finders
        architectures.forget_model(model)


@pytest.mark.parametrize("wrong", ["transposed", "applied_otherwise"])
def test_a_wrong_output_projection_of_a_real_linear_module_is_caught_by_the_reconstruction_check(wrong):
    """W_O read from the block's own o_proj (an nn.Linear that runs in the forward, so every structural check
    passes) but with the wrong numbers: its weight transposed (a finder with the Conv1D convention mixed up; the
    view shares o_proj's memory, so o_proj is found as its module), or o_proj applying other numbers than the
    weight it holds when cwcore reads it. Only the reconstruction check (terms plus bias against o_proj's result)
    can see this. The control: the same finder returning the weight as it is decomposes, and equals the default."""
    model = tiny_model("llama")
    blocks = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]

    def finder(transpose):
        def find(module, parent):
            if module not in blocks:
                return None
            return (module.o_proj.weight.t() if transpose else module.o_proj.weight), None
        return find

    right = _decompose_with_finder(model, finder(False))  # the control: the finder's scaffolding itself is fine
    default = cwcore.decompose(model, input_ids=IDS)
    for layer in default.layers:
        torch.testing.assert_close(right[layer].contribution("inter"), default[layer].contribution("inter"),
                                   rtol=0, atol=0, equal_nan=True)
    handles = []
    if wrong == "applied_otherwise":  # o_proj applies its weight with the input columns reversed, then restores it
        for block in blocks:
            held = {}

            def swap(module, args, held=held):
                held["weight"] = module.weight
                module.weight = nn.Parameter(module.weight.detach().flip(1), requires_grad=False)

            def restore(module, args, output, held=held):
                module.weight = held.pop("weight")

            handles += [block.o_proj.register_forward_pre_hook(swap), block.o_proj.register_forward_hook(restore)]
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"do not reproduce the output projection's result"):
            _decompose_with_finder(model, finder(wrong == "transposed"))
    finally:
        for handle in handles:
            handle.remove()


def test_a_decomposition_that_does_not_add_up_is_refused(monkeypatch):
    from cwcore.core import geometry, layer_call

    def off_by_one_percent(*args):
        g = geometry.head_space_geometry(*args)
        g.output = g.output * 1.01
        return g

    monkeypatch.setattr(layer_call, "head_space_geometry", off_by_one_percent)
    with pytest.raises(cwcore.UnsupportedModelError, match=r"do not reproduce .*relative error 0\.0"):
        cwcore.decompose(tiny_model("qwen2"), input_ids=IDS)


def test_interventions_are_checked_too():
    model = _OwnModel().eval()
    with pytest.raises(cwcore.UnsupportedModelError, match="did not run through"):
        with cwcore.intervene(model, {0: torch.zeros((), dtype=torch.bool)}):
            model(input_ids=torch.tensor([[1, 2, 3]]))


def test_reconstruction_tolerance_holds_in_bfloat16():
    model = tiny_model("llama", dtype=torch.bfloat16)
    d = cwcore.decompose(model, input_ids=IDS)  # geometry in float32, checked against the bf16 projection
    assert d[0].attention.dtype == torch.float32


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_float16_forward_that_overflows_is_refused_for_that_reason(implementation):
    """A float16 model whose residual stream outgrows 65504 (as Gemma 3's does) gives its later layers NaN or inf
    queries. The refusal says so, naming the first such layer; before, it blamed a mismatch that was none: "the
    output projection received something other than the attention output (max |difference| nan)" (eager: NaN is
    not equal to itself) or "sdpa and eager attention differ (relative error inf)"."""
    model = tiny_model("llama", dtype=torch.float16)
    model.config._attn_implementation = implementation
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight.fill_(6e4)  # layer 0's MLP overflows float16
        hidden = model(input_ids=IDS, output_hidden_states=True).hidden_states
    assert torch.isfinite(hidden[1]).all() == torch.tensor(False) and torch.isfinite(hidden[0]).all()
    refusal = (r"^attention block 'model\.layers\.1\.self_attn': the attention output of this layer holds NaN or inf "
               r"on 18 of the 18 query rows that see a key \(its queries, keys or values held NaN or inf already, "
               r"so the forward overflowed or failed before this layer\); a torch\.float16 model whose activations "
               r"outgrow the range of its dtype computes NaN and inf: load it in bfloat16 or float32; cwcore "
               r"decomposes finite computations only$")
    for verb in (cwcore.decompose, cwcore.summarize):
        with pytest.raises(cwcore.UnsupportedModelError, match=refusal):
            verb(model, input_ids=IDS)
    assert cwcore.decompose(model, layers=0, input_ids=IDS)[0].attention.isfinite().all()  # layer 0 is finite


@pytest.mark.parametrize("family", ["roberta", "distilbert"])
def test_encoders_with_own_positions_or_projection_names_are_exact_when_padded(family):
    torch.manual_seed(0)
    if family == "roberta":  # numbers positions from padding_idx + 1 itself
        model = tf.RobertaModel(tf.RobertaConfig(**COMMON, pad_token_id=1)).eval()
    else:  # its output projection is called out_lin
        model = tf.DistilBertModel(tf.DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=96,
                                                       max_position_embeddings=64)).eval()
    model.config._attn_implementation = "eager"
    pad = model.config.pad_token_id or 0
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    padded = torch.cat([torch.full((1, 3), pad), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 8, dtype=torch.long)], 1)
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True)
    alone = cwcore.decompose(model, input_ids=ids)
    together = cwcore.decompose(model, input_ids=padded, attention_mask=mask)
    assert alone.layers == [0, 1]
    torch.testing.assert_close(alone.outputs.last_hidden_state, eager.last_hidden_state, rtol=0, atol=1e-6)
    torch.testing.assert_close(together.outputs.last_hidden_state[:, 3:], eager.last_hidden_state, rtol=1e-5, atol=1e-5)
    for layer in alone.layers:
        torch.testing.assert_close(alone.attention[layer], eager.attentions[layer], rtol=0, atol=1e-6)
        torch.testing.assert_close(together.inter[layer][:, :, 3:, 3:], alone.inter[layer], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("columns", [slice(0, 1), slice(None)])
def test_a_projection_that_changes_its_output_is_refused_by_the_projected_check(columns):
    """o_i is adopted from the output projection after a check on random directions: an output changed after
    the product (a hook scaling one channel or all by 1.01) must still be refused; without the hook it is exact."""
    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    cwcore.decompose(model, input_ids=IDS)  # control: exact

    def hook(module, args, output):
        output = output.clone()
        output[..., columns] *= 1.01
        return output

    handle = model.model.layers[0].self_attn.o_proj.register_forward_hook(hook)
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match="do not reproduce"):
            cwcore.decompose(model, input_ids=IDS)
    finally:
        handle.remove()


def test_all_finite_sees_every_nan_and_infinity_and_errs_on_the_safe_side():
    from cwcore.core.geometry import all_finite

    values = torch.randn(4, 9, 33, 64)
    assert all_finite(values)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = values.clone()
        broken[2, 5, 17, 3] = bad
        assert not all_finite(broken), bad
    both = values.clone()
    both[0, 0, 0, 0], both[1, 1, 1, 1] = float("inf"), -float("inf")  # inf + -inf is NaN: still seen
    assert not all_finite(both)
    # finite entries whose sum overflows read as not finite: the callers take their slower, exact path
    assert not all_finite(torch.full((4,), 3e38))
