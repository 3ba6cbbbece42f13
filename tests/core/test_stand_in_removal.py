"""In-distribution removal: removed terms replaced by a stand-in value (``intervene(..., stand_in=...)``).

With stand-in mu_h, head h's output before W_O must be
sum_j alpha_ij (1 - m_ij) v_j + (sum_j alpha_ij m_ij) mu_h, alpha from the model's own eager attention maps
and v from a hook on the value projection; the logits must be those of a forward whose output projection
receives exactly that (a pre-hook substitutes it), to float32 rounding.
"""

import pytest
import torch

import cwcore
from cwcore.core import UnsupportedModelError, mean_values, value_sums
from cwcore.core.inputs import InputError
from tiny_models import VOCAB, tiny_model

ATOL, RTOL = 1e-5, 1e-4


def _parts(model, family, layer):
    """(value module, output projection, values from the value module's output, heads, kv heads)."""
    if family == "llama":
        attn = model.model.layers[layer].self_attn
        cfg = model.config
        return attn.v_proj, attn.o_proj, (lambda out: out), cfg.num_attention_heads, cfg.num_key_value_heads
    attn = model.transformer.h[layer].attn
    width = model.config.n_embd
    return attn.c_attn, attn.c_proj, (lambda out: out[..., 2 * width:]), model.config.n_head, model.config.n_head


def _setup(family, layer, seed=3):
    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    value_module, projection, extract, heads, kv = _parts(model, family, layer)
    b, n = ids.shape
    captured = {}
    handle = value_module.register_forward_hook(lambda m, a, out: captured.__setitem__("v", extract(out).detach()))
    try:
        with torch.no_grad():
            clean = model(input_ids=ids, output_attentions=True)
    finally:
        handle.remove()
    alpha = clean.attentions[layer].double()  # [b, h, q, k]
    head_dim = captured["v"].shape[-1] // kv
    v = captured["v"].double().reshape(b, n, kv, head_dim).transpose(1, 2).repeat_interleave(heads // kv, dim=1)
    mask = torch.rand(b, heads, n, n, generator=torch.Generator().manual_seed(4)) < 0.4
    return model, ids, projection, alpha, v, mask, clean.logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_stand_in_matches_a_naive_head_output_and_its_logits(family, layer, per_sequence):
    model, ids, projection, alpha, v, mask, _ = _setup(family, layer)
    b, heads, n, dim = v.shape
    shape = (b, heads, dim) if per_sequence else (heads, dim)
    mu = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    mass = (alpha * mask).sum(-1)  # [b, h, q]
    expected = (alpha * ~mask) @ v + mass[..., None] * (mu if per_sequence else mu[None]).double()[:, :, None, :]
    # the model's own forward with the naive head outputs substituted at its output projection
    naive_input = expected.transpose(1, 2).reshape(b, n, heads * dim).float()
    handle = projection.register_forward_pre_hook(lambda m, args: (naive_input,))
    try:
        with torch.no_grad():
            naive_logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    captured = {}
    handle = projection.register_forward_pre_hook(lambda m, args: captured.__setitem__("z", args[0].detach()))
    try:
        with torch.no_grad(), cwcore.intervene(model, {layer: mask}, stand_in={layer: mu}):
            logits = model(input_ids=ids).logits
    finally:
        handle.remove()
    got = captured["z"].double().reshape(b, n, heads, dim).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(logits, naive_logits, rtol=RTOL, atol=ATOL)
    # the stand-in did something beyond zeroing
    assert (got - (alpha * ~mask) @ v).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_zero_stand_in_is_zeroing_and_no_removal_is_the_clean_forward(family):
    model, ids, _, _, v, mask, clean = _setup(family, 1)
    _, heads, _, dim = v.shape
    mu = torch.randn(heads, dim, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        with cwcore.intervene(model, {1: mask}):
            zeroed = model(input_ids=ids).logits
        with cwcore.intervene(model, {1: mask}, stand_in={1: torch.zeros(heads, dim)}):
            zero_stand_in = model(input_ids=ids).logits
        with cwcore.intervene(model, {1: torch.zeros_like(mask)}, stand_in={1: mu}):
            nothing_removed = model(input_ids=ids).logits
        plain = model(input_ids=ids).logits
    assert torch.equal(zero_stand_in, zeroed)
    assert torch.equal(nothing_removed, plain)
    torch.testing.assert_close(plain, clean)  # output_attentions does not change the forward


def test_mean_values_equal_a_naive_mean_over_real_tokens_without_the_first():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 5:] = 0  # right padding
    attention_mask[2, :2] = 0  # left padding
    attn = model.model.layers[1].self_attn
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    captured = {}
    handle = attn.v_proj.register_forward_hook(lambda m, a, out: captured.__setitem__("v", out.detach()))
    try:
        with torch.no_grad():
            model(**cwcore.core.prepare_inputs(model, {"input_ids": ids, "attention_mask": attention_mask}))
    finally:
        handle.remove()
    v = captured["v"].double().reshape(3, 7, kv, -1).repeat_interleave(heads // kv, dim=2)  # [b, n, h, d]
    for skip_first, rows in ((True, [(0, range(1, 7)), (1, range(1, 5)), (2, range(3, 7))]),
                             (False, [(0, range(0, 7)), (1, range(0, 5)), (2, range(2, 7))])):
        tokens = torch.cat([v[b, list(r)] for b, r in rows])  # [tokens, h, d]
        got = mean_values(model, ids, attention_mask, layers=[1], skip_first_token=skip_first)
        torch.testing.assert_close(got[1], tokens.mean(0), rtol=1e-6, atol=1e-7)
        sums, counts = value_sums(model, ids, attention_mask, layers=[1], skip_first_token=skip_first)
        assert counts.tolist() == [len(r) for _, r in rows]
        torch.testing.assert_close(sums[1][2], v[2, list(rows[2][1])].sum(0), rtol=1e-6, atol=1e-6)


def test_stand_in_refusals():
    model, ids, _, _, v, mask, _ = _setup("llama", 1)
    _, heads, _, dim = v.shape
    with pytest.raises(InputError, match=r"stand_in for layer 1 must be floating point \[head, dim\]"):
        with torch.no_grad(), cwcore.intervene(model, {1: mask}, stand_in={1: torch.zeros(heads, dim + 1)}):
            model(input_ids=ids)
    with pytest.raises(InputError, match="one stand-in per masked layer"):
        with cwcore.intervene(model, {1: mask}, stand_in={0: torch.zeros(heads, dim)}):
            pass
    # a decomposition read after the stand-ins were added would leave them out: refused, not reported
    with pytest.raises(UnsupportedModelError, match="does not decompose a layer with stand-in values"):
        with torch.no_grad(), cwcore.intervene(model, {1: mask}, stand_in={1: torch.ones(heads, dim)}, record=[1]):
            model(input_ids=ids)
