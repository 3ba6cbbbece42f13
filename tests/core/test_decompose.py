"""The decomposition engine against independent computations: naive model-space sums, the model's
own eager attention maps, and the output projection's actual input and output (captured by hooks).

Tolerances: float32 models are compared at rtol 1e-4 / atol 1e-5 (sums of ~10-100 float32 terms);
float64 geometry at 1e-10.
"""

import pytest
import torch

import cwcore
from cwcore.core.architectures import attention_blocks
from cwcore.core.geometry import head_space_geometry, naive_geometry, split_output_projection
from tiny_models import DECODERS, FAMILIES, VOCAB, tiny_model, tiny_vit

ATOL, RTOL = 1e-5, 1e-4


def projection_module(block):
    for name in ("o_proj", "c_proj", "dense", "out_proj"):
        if hasattr(block.module, name):
            return getattr(block.module, name)
    return block.parent.output.dense


def capture_projections(model, **inputs):
    """The output projection's input [b, q, h*d] and output minus bias [b, q, model] per layer."""
    captured, handles = {}, []
    for block in attention_blocks(model):
        proj = projection_module(block)

        def hook(module, args, output, layer=block.layer):
            bias = getattr(module, "bias", None)
            captured[layer] = (args[0].detach(), (output - (0 if bias is None else bias)).detach())

        handles.append(proj.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def test_head_space_identities_match_naive_sums():
    torch.manual_seed(0)
    b, h, q, d, m = 2, 3, 5, 4, 7
    alpha = torch.softmax(torch.randn(b, h, q, q, dtype=torch.float64), -1)
    values = torch.randn(b, h, q, d, dtype=torch.float64)
    w_o = torch.randn(h, m, d, dtype=torch.float64)
    fast, naive = head_space_geometry(alpha, values, w_o), naive_geometry(alpha, values, w_o)
    for field in ("value_norm", "head_output_norm", "output_norm", "intra_dot", "inter_dot", "output"):
        torch.testing.assert_close(getattr(fast, field), getattr(naive, field), rtol=1e-10, atol=1e-10)


def test_split_output_projection_matches_column_slices():
    weight = torch.arange(6 * 8.0).reshape(6, 8)
    per_head = split_output_projection(weight, 4)
    assert per_head.shape == (4, 6, 2)
    torch.testing.assert_close(per_head[2], weight[:, 4:6])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_attention_and_outputs_match_the_model(family):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True)
    d = cwcore.decompose(model, input_ids=ids)
    assert d.layers == [0, 1]
    # The model runs unchanged through cwcore's attention function.
    first = "logits" if hasattr(eager, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(d.outputs, first), getattr(eager, first), rtol=0, atol=1e-6)
    captured = capture_projections(model, input_ids=ids)
    for layer in d.layers:
        torch.testing.assert_close(d.attention[layer], eager.attentions[layer].float(), rtol=RTOL, atol=ATOL)
        mixed, output = captured[layer]
        torch.testing.assert_close(d.output_norm[layer], output.norm(dim=-1), rtol=RTOL, atol=ATOL)
        # per-head outputs o^h = W_O^h z^h from the projection's own input
        weight, _ = attention_blocks(model)[layer].output_projection()
        heads = d.attention[layer].shape[1]
        w_o = split_output_projection(weight.detach(), heads)
        z = mixed.reshape(*mixed.shape[:2], heads, -1)
        head_out = torch.einsum("bqhd,hmd->bhqm", z, w_o)
        torch.testing.assert_close(d.head_output_norm[layer], head_out.norm(dim=-1), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weights_sum_to_one(family):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(2))
    d = cwcore.decompose(model, input_ids=ids)
    for layer in d.values():
        ones = torch.ones_like(layer.output_norm)
        torch.testing.assert_close(layer.intra.sum(-1), torch.ones_like(layer.head_output_norm), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(layer.inter.sum((1, 3)), ones, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(layer.token_level("contribution", "inter").sum(-1), ones, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(layer.attention.sum(-1), torch.ones_like(layer.head_output_norm), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_every_field_matches_a_naive_model_space_computation(family):
    """Values from a hook on v_proj (bias included for Qwen2), alpha from eager: all fields agree."""
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    values = {}
    handles = [
        layer.self_attn.v_proj.register_forward_hook(lambda m, a, out, i=i: values.__setitem__(i, out.detach()))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True)
    for handle in handles:
        handle.remove()
    d = cwcore.decompose(model, input_ids=ids, compute_dtype=torch.float64)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for layer in d.values():
        v = values[layer.layer].double().reshape(2, 7, cfg.num_key_value_heads, head_dim).transpose(1, 2)
        v = v.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1)
        w_o = split_output_projection(model.model.layers[layer.layer].self_attn.o_proj.weight.double(), cfg.num_attention_heads)
        alpha = eager.attentions[layer.layer].double()
        naive = naive_geometry(alpha, v, w_o)
        projected = torch.einsum("bhkd,hmd->bhkm", v, w_o)
        o = naive.output[:, None, :, None, :]
        cos = torch.nn.functional.cosine_similarity(o, projected[:, :, None], dim=-1)
        expected_inter = alpha * (projected[:, :, None] * o).sum(-1) / naive.output_norm[:, None, :, None] ** 2
        tol = dict(rtol=1e-5, atol=1e-6)  # alpha comes from float32 eager
        torch.testing.assert_close(layer.value_norm, naive.value_norm, **tol)
        torch.testing.assert_close(layer.inter, expected_inter, **tol)
        torch.testing.assert_close(layer.inter_cosine, cos, **tol)
        torch.testing.assert_close(layer.inter_relative_norm, naive.value_norm[:, :, None, :] / naive.output_norm[:, None, :, None], **tol)
        torch.testing.assert_close(layer.value_weighted, alpha * naive.value_norm[:, :, None, :], **tol)
        torch.testing.assert_close(layer.intra, alpha * naive.intra_dot / naive.head_output_norm[..., None] ** 2, **tol)
        # the three factors multiply back to the weight
        torch.testing.assert_close(layer.attention * layer.intra_relative_norm * layer.intra_cosine, layer.intra, **tol)


def test_output_bias_is_reported_separately():
    model = tiny_model("qwen2")  # Qwen2 has no o_proj bias; GPT-2 and BERT do
    d = cwcore.decompose(tiny_model("gpt2"), input_ids=torch.tensor([[1, 2, 3]]))
    torch.testing.assert_close(d.output_bias[0], tiny_model("gpt2").transformer.h[0].attn.c_proj.bias.float())
    assert cwcore.decompose(model, input_ids=torch.tensor([[1, 2, 3]])).output_bias[0] is None


def test_sliding_window_is_respected():
    model = tiny_model("mistral")  # sliding_window=4
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    d = cwcore.decompose(model, input_ids=ids)
    q = torch.arange(10)[:, None]
    k = torch.arange(10)[None, :]
    outside = (k > q) | (q - k >= 4)
    assert d.attention[0][..., outside].abs().max() == 0
    assert d.attention[0][..., ~outside].min() > 0


def test_gemma3_alternates_sliding_and_full_layers():
    model = tiny_model("gemma3")  # layer 0 sliding (window 4), layer 1 full
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    d = cwcore.decompose(model, input_ids=ids)
    assert d.attention[0][0, :, 9, 0].abs().max() == 0
    assert d.attention[1][0, :, 9, 0].min() > 0


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "bert"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_the_unpadded_sequence(family, side):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(6)
    short, long = torch.randint(3, VOCAB, (5,), generator=gen), torch.randint(3, VOCAB, (8,), generator=gen)
    pad = torch.zeros(3, dtype=torch.long)
    padded_short = torch.cat([pad, short]) if side == "left" else torch.cat([short, pad])
    mask_short = (torch.arange(8) >= 3) if side == "left" else (torch.arange(8) < 5)
    batch = dict(input_ids=torch.stack([padded_short, long]), attention_mask=torch.stack([mask_short, torch.ones(8, dtype=torch.bool)]).long())
    d = cwcore.decompose(model, **batch)
    alone = cwcore.decompose(model, input_ids=short[None])
    long_alone = cwcore.decompose(model, input_ids=long[None])
    real = mask_short.nonzero().squeeze(1)
    for layer in d.layers:
        for field in ("attention", "inter", "intra", "value_weighted"):
            got = getattr(d[layer], field)[0][:, real][:, :, real]
            torch.testing.assert_close(got, getattr(alone[layer], field)[0], rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(getattr(d[layer], field)[1], getattr(long_alone[layer], field)[0], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(d.value_norm[layer][0][:, real], alone.value_norm[layer][0], rtol=RTOL, atol=ATOL)
        # padding never leaks: padded queries are NaN, padded keys weigh exactly zero
        padded = ~mask_short
        assert d.inter[layer][0][:, padded].isnan().all()
        assert (d.inter[layer][0][:, real][:, :, padded] == 0).all()
        assert d.value_norm[layer][0][:, padded].isnan().all()


def test_layer_selection_keeps_only_requested_layers():
    model = tiny_model("llama")
    d = cwcore.decompose(model, layers=1, input_ids=torch.tensor([[1, 2, 3]]))
    assert d.layers == [1]
    with pytest.raises(KeyError, match="not decomposed"):
        d.inter[0]
    with pytest.raises(IndexError, match="out of range"):
        cwcore.decompose(model, layers=[5], input_ids=torch.tensor([[1, 2, 3]]))


def test_bfloat16_model_gets_float32_geometry():
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(7))
    d = cwcore.decompose(model, input_ids=ids)
    assert d.outputs.logits.dtype == torch.bfloat16
    assert d.inter[0].dtype == torch.float32
    torch.testing.assert_close(d.inter[0].sum((1, 3)), torch.ones(1, 6), rtol=1e-5, atol=1e-5)
    d64 = cwcore.decompose(model, compute_dtype=torch.float64, input_ids=ids)
    assert d64.intra[1].dtype == torch.float64
    torch.testing.assert_close(d64.intra[1].sum(-1), torch.ones(1, 4, 6, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_zero_output_norm_gives_nan_not_inf():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[:, :16] = 0  # head 0 projects to nothing
    d = cwcore.decompose(model, input_ids=torch.tensor([[5, 6, 7]]))
    assert d.intra[0][0, 0].isnan().all()
    assert not d.intra[0][0, 1:].isnan().any()
    assert not d.inter[0].isinf().any()


def test_a_tiny_nonzero_output_norm_below_the_documented_zero_gives_nan_in_every_divided_view():
    """The test above zeroes W_O exactly, so 0/0 is NaN by IEEE arithmetic with or without the guard. Here head 0's
    W_O is scaled by 1e-14: its output norm is nonzero but below the documented zero (1e-12, written here), so only
    the guard turns the views divided by it into NaN (unguarded they are finite: the intra weights are scale-free)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[:, :16] *= 1e-14
    d = cwcore.decompose(model, input_ids=torch.tensor([[5, 6, 7]]))
    layer = d[0]
    norm = layer.head_output_norm[0, 0]
    assert (norm > 0).all() and (norm <= 1e-12).all()  # the case reaches the window between 0 and the documented zero
    assert (layer.head_output_norm[0, 1:] > 1e-3).all()  # the other heads are ordinary
    for name, view in [("contribution", layer.contribution("intra")), ("relative_norm", layer.relative_norm("intra")),
                       ("cosine", layer.cosine("intra")),
                       ("value_weighted_output_normalized", layer.value_weighted_output_normalized("intra"))]:
        assert view[0, 0].isnan().all(), name
        assert view[0, 1:].isfinite().all(), name
    # the combined output still has the other heads: inter weights are finite and sum to one per query
    torch.testing.assert_close(layer.contribution("inter").sum((1, 3)), torch.ones(1, 3), rtol=RTOL, atol=ATOL)


def test_vision_transformer():
    model = tiny_vit()
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(8))
    d = cwcore.decompose(model, pixel_values=pixels)
    assert d.attention[0].shape == (2, 4, 17, 17)  # 16 patches + CLS, all keys visible
    assert d.attention[0].min() > 0
    torch.testing.assert_close(d.inter[1].sum((1, 3)), torch.ones(2, 17), rtol=RTOL, atol=ATOL)
    captured = capture_projections(model, pixel_values=pixels)
    torch.testing.assert_close(d.output_norm[1], captured[1][1].norm(dim=-1), rtol=RTOL, atol=ATOL)


def test_attention_implementation_is_restored():
    model = tiny_model("llama")
    cwcore.decompose(model, input_ids=torch.tensor([[1, 2]]))
    assert model.config._attn_implementation == "eager"
    with pytest.raises(RuntimeError):
        with cwcore.intervene(model, {0: lambda layer: (_ for _ in ()).throw(RuntimeError("boom"))}):
            model(input_ids=torch.tensor([[1, 2]]))
    assert model.config._attn_implementation == "eager"
