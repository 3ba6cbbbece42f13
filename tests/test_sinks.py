"""The sink analyses (cwcore.sinks) on planted geometries and against naive model-space references.

The planted model is a one-layer Llama whose weights are set by hand (see :func:`planted_model`):
every query attends to the first token with score ln(E) and to every other token with score 0, so
alpha_i0 = E / (E + i) exactly; head 0's sink value is exactly anti-parallel to every tail value and
head 1's sink value makes a known angle with them, so its output norm
||a v0 + (1 - a) vt|| has its minimum at a* = <vt, vt - v0> / ||vt - v0||^2.
The naive references materialise projected values in model space from hooks on ``v_proj`` and
``o_proj`` and take attention maps from the model's own eager implementation.
"""

import math

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf

import cwcore
from cwcore import sinks
from tiny_models import VOCAB, tiny_model

E = 8.0  # planted exp(score) of the sink
T = 48  # sequence length of the planted tests
P_TAIL = 1.0  # head 0: tail value = +P_TAIL e, sink value = -Q_SINK e
Q_SINK = 1.0
VT = (1.0, 0.0)  # head 1: tail value and sink value in the head's first two dimensions
V0 = (-0.5, 1.0)
FAST = dict(cache=False, progress=False)


def planted_model(seed: int = 0) -> tf.LlamaForCausalLM:
    """One layer, hidden 16, two heads of dimension 8, o_proj = identity, MLP off."""
    hidden, heads, dim, vocab = 16, 2, 8, 12
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=dim, rms_norm_eps=1e-12,
        rope_theta=1e10, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = torch.zeros(vocab, hidden)
        emb[0, 0] = 1.0  # token 0 (the sink / BOS): e_0, so its normed input is sqrt(H) e_0
        noise = torch.randn(vocab, hidden - 2, generator=g)
        emb[1:, 1] = 1.0  # every other token: e_1 + a unit vector in dims 2.. (same norm for all)
        emb[1:, 2:] = noise[1:] / noise[1:].norm(dim=-1, keepdim=True)
        model.model.embed_tokens.weight.copy_(emb)
        x0 = math.sqrt(hidden)  # normed sink input on dim 0
        x1 = math.sqrt(hidden / 2)  # normed tail input on dim 1
        attn = model.model.layers[0].self_attn
        # dimension 3 of each head is rotated by RoPE's lowest frequency: ~0 with rope_theta = 1e10
        score = math.log(E)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight.zero_()
        for h in range(heads):
            attn.q_proj.weight[h * dim + 3, 1] = score * math.sqrt(dim) / (x1 * x0)
            attn.k_proj.weight[h * dim + 3, 0] = 1.0
        # head 0: tail value +P e_0, sink value -Q e_0
        attn.v_proj.weight[0, 1] = P_TAIL / x1
        attn.v_proj.weight[0, 0] = -Q_SINK / x0
        # head 1: tail value VT, sink value V0 (dims 0 and 1 of the head)
        attn.v_proj.weight[dim + 0, 1] = VT[0] / x1
        attn.v_proj.weight[dim + 1, 1] = VT[1] / x1
        attn.v_proj.weight[dim + 0, 0] = V0[0] / x0
        attn.v_proj.weight[dim + 1, 0] = V0[1] / x0
        attn.o_proj.weight.copy_(torch.eye(hidden))
        model.model.layers[0].mlp.down_proj.weight.zero_()
    return model


def planted_ids(n=3, length=T, seed=0):
    ids = torch.randint(1, 12, (n, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 0
    return ids


def expected_alpha(length=T):
    i = np.arange(1, length)
    return E / (E + i)


def random_ids(n=3, length=12, seed=1):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


# -- naive model-space references ----------------------------------------------------------------


def naive_run(model, ids, masks=None):
    """Per layer: attention [b,h,q,k] (eager maps), projected values [b,h,k,m], head outputs [b,h,q,m]; logits."""
    layers = model.model.layers
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    captured = {}
    handles = []
    for l, layer in enumerate(layers):
        attn = layer.self_attn
        handles.append(attn.v_proj.register_forward_hook(lambda m, i, o, l=l: captured.__setitem__(("v", l), o.detach())))
        handles.append(attn.o_proj.register_forward_pre_hook(lambda m, i, l=l: captured.__setitem__(("z", l), i[0].detach())))
    try:
        with torch.inference_mode():
            if masks:
                with cwcore.intervene(model, masks):
                    out = model(input_ids=ids, output_attentions=True)
            else:
                out = model(input_ids=ids, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    result = []
    b, n = ids.shape
    for l, layer in enumerate(layers):
        w = layer.self_attn.o_proj.weight.detach().double()  # [m, heads*dim]
        w_h = w.reshape(w.shape[0], heads, dim).permute(1, 0, 2)  # [h, m, d]
        v = captured[("v", l)].double().reshape(b, n, kv, dim).transpose(1, 2).repeat_interleave(heads // kv, 1)
        z = captured[("z", l)].double().reshape(b, n, heads, dim).transpose(1, 2)
        result.append({
            "attention": out.attentions[l].double(),
            "values": torch.einsum("bhkd,hmd->bhkm", v, w_h),
            "outputs": torch.einsum("bhqd,hmd->bhqm", z, w_h),
        })
    return result, out.logits.double()


def _cos(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


# -- 1. sink rates ---------------------------------------------------------------------------------


def test_sink_rates_recover_the_planted_rate_and_sink_eps():
    model, ids = planted_model(), planted_ids()
    expected = expected_alpha().mean()
    table = sinks.sink_rates(model, None, ids, eps=expected - 0.01, **FAST)
    assert len(table) == 2
    np.testing.assert_allclose(table["sink_rate"], expected, atol=1e-5)
    np.testing.assert_allclose(table["sink_rate_all_queries"], (expected * (T - 1) + 1) / T, atol=1e-5)
    np.testing.assert_allclose(table["median"], np.median(expected_alpha()), atol=1e-5)
    np.testing.assert_allclose(table["sink_rate_sequence_std"], 0, atol=1e-6)  # same pattern in every sequence
    assert table["sink_eps"].iloc[0] == 1.0
    assert sinks.sink_rates(model, None, ids, eps=expected + 0.01, **FAST)["sink_eps"].iloc[0] == 0.0


def test_sink_rates_match_eager_attention_maps():
    model, ids = tiny_model("llama"), random_ids()
    table = sinks.sink_rates(model, None, ids, batch_size=2, **FAST).set_index(["layer", "head"])
    reference, _ = naive_run(model, ids)
    for l, ref in enumerate(reference):
        a0 = ref["attention"][:, :, :, 0]
        np.testing.assert_allclose(table.loc[l, "sink_rate"], a0[:, :, 1:].mean((0, 2)).numpy(), atol=1e-6)
        np.testing.assert_allclose(table.loc[l, "sink_rate_all_queries"], a0.mean((0, 2)).numpy(), atol=1e-6)
        np.testing.assert_allclose(table.loc[l, "sink_rate_std"], a0[:, :, 1:].permute(1, 0, 2).reshape(4, -1).std(1, unbiased=False).numpy(), atol=1e-6)
    rates = table["sink_rate"]
    assert table["sink_eps"].iloc[0] == pytest.approx(float((rates > 0.3).mean()))


def _word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


def test_add_bos_is_a_parameter_and_is_recorded():
    model, tokenizer = tiny_model("llama"), _word_tokenizer()
    texts = [" ".join(f"w{(i * 7 + j) % 20}" for j in range(30)) for i in range(4)]
    with_bos = sinks.sink_rates(model, tokenizer, texts, block_size=10, num_sequences=3, add_bos=True, **FAST)
    without = sinks.sink_rates(model, tokenizer, texts, block_size=10, num_sequences=3, add_bos=False, **FAST)
    default = sinks.sink_rates(model, tokenizer, texts, block_size=10, num_sequences=3, **FAST)  # tokenizer adds none
    assert bool(with_bos["add_bos"].iloc[0]) and with_bos["first_token_is_bos"].iloc[0] == 1.0
    assert not bool(without["add_bos"].iloc[0]) and without["first_token_is_bos"].iloc[0] == 0.0
    pd.testing.assert_frame_equal(default, without)
    assert not np.allclose(with_bos["sink_rate"], without["sink_rate"])
    assert (with_bos["num_sequences"] == 3).all() and (with_bos["block_size"] == 10).all()
    with pytest.raises(ValueError, match="already tokenised"):
        sinks.sink_rates(model, None, random_ids(), add_bos=True, **FAST)


# -- 2. decomposition ------------------------------------------------------------------------------


def test_decomposition_factors_match_naive_products_and_shares_sum_to_one():
    model, ids = tiny_model("llama"), random_ids()
    tables = sinks.sink_decomposition(model, None, ids, batch_size=2, quantile_sample=10_000, sample_size=10**6, **FAST)
    summary, sample = tables.summary, tables.sample
    reference, _ = naive_run(model, ids)
    # every (query, key) pair is in the sample: compare each factor with the materialised vectors
    a = torch.stack([r["attention"] for r in reference])  # [l, b, h, q, k]
    v = torch.stack([r["values"] for r in reference])  # [l, b, h, k, m]
    o = torch.stack([r["outputs"] for r in reference])  # [l, b, h, q, m]
    idx = [torch.as_tensor(sample[c].to_numpy(np.int64)) for c in ("layer", "sequence", "head", "query", "key")]
    vj = v[idx[0], idx[1], idx[2], idx[4]]
    oi = o[idx[0], idx[1], idx[2], idx[3]]
    alpha = a[tuple(idx)]
    np.testing.assert_allclose(sample["alpha"], alpha, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(sample["relative_norm"], vj.norm(dim=-1) / oi.norm(dim=-1), rtol=1e-4)
    np.testing.assert_allclose(sample["cosine"], _cos(oi, vj), atol=1e-5)
    np.testing.assert_allclose(sample["contribution"], alpha * (oi * vj).sum(-1) / (oi * oi).sum(-1), atol=1e-5)
    assert (sample["token_class"] == "sink").sum() == 2 * 4 * 3 * 11  # layers * heads * sequences * queries
    assert (sample["token_class"] == "tail").sum() == 2 * 4 * 3 * (11 * 12 // 2)
    # the shares of the three factors add up to one, per head and pooled
    for (scope, layer, head, cls), group in summary[summary["factor"] != "contribution"].groupby(
            ["scope", "layer", "head", "token_class"], dropna=False):
        assert group["share"].sum() == pytest.approx(1.0, abs=1e-6)
    # the pooled sink shares equal a naive covariance computation over every sink pair
    sink = sample[sample["token_class"] == "sink"]
    logs = np.log(np.abs(sink[["alpha", "relative_norm", "cosine"]].to_numpy(np.float64)))
    total = logs.sum(1)
    model_rows = summary[(summary["scope"] == "model") & (summary["token_class"] == "sink")].set_index("factor")
    for k, factor in enumerate(["alpha", "relative_norm", "cosine"]):
        share = np.cov(logs[:, k], total, bias=True)[0, 1] / total.var()
        assert model_rows.loc[factor, "share"] == pytest.approx(share, abs=1e-3)
        assert model_rows.loc[factor, "mean_log"] == pytest.approx(logs[:, k].mean(), abs=1e-4)
        assert model_rows.loc[factor, "median"] == pytest.approx(np.median(np.abs(sink[factor])) if factor != "cosine"
                                                                  else np.median(sink[factor]), abs=1e-5)
    assert model_rows.loc["contribution", "frac_negative"] == pytest.approx((sink["contribution"] < 0).mean())


def test_decomposition_separates_sink_and_tail_on_the_planted_model():
    model, ids = planted_model(), planted_ids()
    summary = sinks.sink_decomposition(model, None, ids, **FAST).summary
    rows = summary[summary["scope"] == "head"].set_index(["head", "token_class", "factor"])
    # head 0: o_i and v0 are collinear, so |cos| = 1 and the cosine explains no variance
    assert rows.loc[(0, "sink", "cosine"), "share"] == pytest.approx(0.0, abs=1e-4)
    assert rows.loc[(0, "sink", "alpha"), "median"] == pytest.approx(np.median(expected_alpha()), abs=1e-5)
    # tail values are identical, so the tail's alpha is 1 / (E + i) for every key
    i = np.arange(1, T)
    assert rows.loc[(1, "tail", "alpha"), "n"] == 3 * (T - 1) * T // 2
    assert rows.loc[(1, "tail", "alpha"), "mean"] == pytest.approx(
        np.sum(i / (E + i)) / np.sum(i), rel=0.05)  # mean over the sample of 1/(E+i), weighted by i keys


# -- 3. anti-alignment -----------------------------------------------------------------------------


def test_anti_alignment_recovers_the_planted_cosines():
    model, ids = planted_model(), planted_ids()
    table = sinks.anti_alignment(model, None, ids, **FAST).set_index("head")
    np.testing.assert_allclose(table["sink_rate"], expected_alpha().mean(), atol=1e-5)
    assert table.loc[0, "cos_value_mean"] == pytest.approx(-1.0, abs=1e-5)
    assert table.loc[0, "cos_semantic_mean"] == pytest.approx(-1.0, abs=1e-5)
    assert table.loc[0, "cos_value_frac_negative"] == 1.0
    planted = np.dot(V0, VT) / (np.linalg.norm(V0) * np.linalg.norm(VT))
    for column in ("cos_value_mean", "cos_value_median", "cos_semantic_mean", "cos_axis_mean"):
        assert table.loc[1, column] == pytest.approx(planted, abs=1e-5)
    assert table.loc[0, "relative_sink_value_norm"] == pytest.approx(Q_SINK / P_TAIL, rel=1e-5)
    assert table.loc[1, "sink_value_norm"] == pytest.approx(np.linalg.norm(V0), rel=1e-5)


def test_anti_alignment_matches_naive_cosines():
    model, ids = tiny_model("llama"), random_ids()
    table = sinks.anti_alignment(model, None, ids, batch_size=2, **FAST).set_index(["layer", "head"])
    reference, _ = naive_run(model, ids)
    for l, ref in enumerate(reference):
        v, o, a = ref["values"], ref["outputs"], ref["attention"]
        v0 = v[:, :, :1]
        cos_v = _cos(v0, v)[:, :, 1:]  # [b, h, k-1]
        s = o - a[..., :1] * v0  # [b, h, q, m]
        cos_s = _cos(v0, s)[:, :, 1:]
        axis = v[:, :, 1:].mean(2, keepdim=True)
        np.testing.assert_allclose(table.loc[l, "cos_value_mean"], cos_v.mean((0, 2)), atol=1e-5)
        np.testing.assert_allclose(table.loc[l, "cos_semantic_mean"], cos_s.mean((0, 2)), atol=1e-5)
        np.testing.assert_allclose(table.loc[l, "cos_axis_mean"], _cos(v0, axis)[..., 0].mean(0), atol=1e-5)
        ratio = v0[..., 0, :].norm(dim=-1) / v[:, :, 1:].norm(dim=-1).median(-1).values
        np.testing.assert_allclose(table.loc[l, "relative_sink_value_norm"], ratio.mean(0), rtol=1e-4)


# -- 4. convexity ----------------------------------------------------------------------------------


def test_convexity_fit_recovers_the_planted_interior_minimum():
    model, ids = planted_model(), planted_ids()
    vt, v0 = np.array(VT), np.array(V0)
    a_star = vt @ (vt - v0) / ((vt - v0) @ (vt - v0))  # 0.4615...
    exact = sinks.convexity(model, None, ids, fit_on="squared_norm", **FAST)
    fits = exact.fits.set_index("scope").loc["head"].set_index("head")
    assert fits.loc[1, "alpha_star"] == pytest.approx(a_star, abs=1e-3)
    assert fits.loc[1, "curvature"] == pytest.approx((vt - v0) @ (vt - v0), rel=1e-3)  # ||vt - v0||^2
    assert fits.loc[1, "r2"] == pytest.approx(1.0, abs=1e-6)
    assert fits.loc[1, "two_vector_alpha_star"] == pytest.approx(a_star, abs=1e-4)
    assert fits.loc[1, "reference_alpha_star"] == pytest.approx(a_star, abs=0.005)
    assert bool(fits.loc[1, "interior_minimum"]) and bool(fits.loc[1, "minimum_in_range"])
    # on the norm itself (not exactly quadratic) the vertex is still close
    norm_fit = sinks.convexity(model, None, ids, **FAST).fits
    head1 = norm_fit[(norm_fit["scope"] == "head") & (norm_fit["head"] == 1)].iloc[0]
    assert head1["alpha_star"] == pytest.approx(a_star, abs=0.05) and head1["curvature"] > 0
    # head 0: anti-parallel values, the norm |(1 - a) P - a Q| vanishes at P / (P + Q)
    assert fits.loc[0, "two_vector_alpha_star"] == pytest.approx(P_TAIL / (P_TAIL + Q_SINK), abs=1e-4)
    # ... and |(1 - a) - a| < (1 - a) (the sink shortens the output) exactly when a < 2/3
    assert fits.loc[0, "share_sink_suppresses"] == pytest.approx(np.mean(expected_alpha() < 2 / 3))
    assert fits.loc[1, "median_norm_over_semantic"] == pytest.approx(np.median(np.linalg.norm(
        np.outer(expected_alpha(), v0) + np.outer(1 - expected_alpha(), vt), axis=1) / (1 - expected_alpha())), rel=1e-4)
    # the binned curves: observed norms follow the two-vector formula, and the reference at each centre
    curves = exact.curves[(exact.curves["scope"] == "head") & (exact.curves["head"] == 1)]
    c = curves["bin_centre"].to_numpy()
    expected_ref = np.linalg.norm(np.outer(c, v0) + np.outer(1 - c, vt), axis=1)
    np.testing.assert_allclose(curves["reference_norm"], expected_ref, atol=1e-4)
    seen = curves[curves["n"] > 0]
    np.testing.assert_allclose(seen["norm_mean"], np.linalg.norm(
        np.outer(seen["alpha_mean"], v0) + np.outer(1 - seen["alpha_mean"], vt), axis=1), rtol=0.05)
    assert curves["n"].sum() == 3 * (T - 1)


def test_convexity_points_match_naive_head_output_norms():
    model, ids = tiny_model("gemma3"), random_ids(length=10)
    fits = sinks.convexity(model, None, ids, min_range=0.0, **FAST).fits
    reference, _ = naive_run(model, ids)
    heads = fits[fits["scope"] == "head"].set_index(["layer", "head"])
    for l, ref in enumerate(reference):
        a0 = ref["attention"][:, :, 1:, 0]
        norm = ref["outputs"][:, :, 1:].norm(dim=-1)
        for h in range(a0.shape[1]):
            c2, c1, c0 = np.polyfit(a0[:, h].reshape(-1).numpy(), norm[:, h].reshape(-1).numpy(), 2)
            assert heads.loc[(l, h), "curvature"] == pytest.approx(c2, rel=1e-3, abs=1e-6)
            assert heads.loc[(l, h), "alpha_star"] == pytest.approx(-c1 / (2 * c2), rel=1e-3, abs=1e-6)


# -- 5. semantic cone ------------------------------------------------------------------------------


def test_semantic_cone_collapses_into_the_cone_and_differs_from_the_control():
    model, ids = planted_model(), planted_ids()
    tables = sinks.semantic_cone(model, None, ids, **FAST)
    heads = tables.heads.set_index(["condition", "head"])
    # head 1: removing the sink leaves (1 - a) vt, exactly on the cone's axis; before, the angle is planted
    assert heads.loc[("sink", 1), "cos_after"] == pytest.approx(1.0, abs=1e-5)
    assert heads.loc[("sink", 1), "cos_clean"] < 0.99
    assert heads.loc[("sink_renorm", 1), "cos_after"] == pytest.approx(1.0, abs=1e-5)
    assert heads.loc[("sink_renorm", 1), "norm_after"] == pytest.approx(np.linalg.norm(VT), rel=1e-5)  # s^ = vt
    # the control removes one tail token: the output keeps its sink component
    assert heads.loc[("control", 1), "cos_after"] < 0.99
    assert abs(heads.loc[("control", 1), "delta_cos"]) < 0.5 * heads.loc[("sink", 1), "delta_cos"]
    # head 0: the norm after removing the sink term is (1 - a) P for every query
    a = expected_alpha()
    assert heads.loc[("sink", 0), "norm_after"] == pytest.approx(np.mean((1 - a) * P_TAIL), rel=1e-5)
    assert heads.loc[("sink", 0), "norm_clean"] == pytest.approx(np.mean(np.abs((1 - a) * P_TAIL - a * Q_SINK)), rel=1e-5)
    assert set(tables.ppl["condition"]) == {"sink", "sink_renorm", "control"}
    for binning in ("within_head", "across_heads"):
        by_q = tables.by_quantile[tables.by_quantile["binning"] == binning]
        assert (by_q.groupby("condition")["n"].sum().loc["sink"]) == 2 * 3 * (T - 1)
    within = tables.by_quantile[tables.by_quantile["binning"] == "within_head"]
    assert set(within["quantile"]) == {1, 2, 3, 4, 5}
    across = tables.by_quantile[tables.by_quantile["binning"] == "across_heads"]
    assert set(across["quantile"]) == {3, 5}  # two heads: ranks 1/2 and 2/2


def test_semantic_cone_matches_naive_interventions():
    model, ids = tiny_model("llama"), random_ids()
    tables = sinks.semantic_cone(model, None, ids, batch_size=2, **FAST)
    clean, clean_logits = naive_run(model, ids)
    b, n = ids.shape
    mask = torch.zeros(b, 4, n, n, dtype=torch.bool)
    mask[:, :, 1:, 0] = True
    after, after_logits = naive_run(model, ids, masks={0: mask, 1: mask})
    heads = tables.heads[tables.heads["condition"] == "sink"].set_index(["layer", "head"])
    for l in range(2):
        np.testing.assert_allclose(heads.loc[l, "norm_clean"], clean[l]["outputs"][:, :, 1:].norm(dim=-1).mean((0, 2)), rtol=1e-4)
        np.testing.assert_allclose(heads.loc[l, "norm_after"], after[l]["outputs"][:, :, 1:].norm(dim=-1).mean((0, 2)), rtol=1e-4)
        drift = _cos(clean[l]["outputs"], after[l]["outputs"])[:, :, 1:].mean((0, 2))
        np.testing.assert_allclose(heads.loc[l, "drift"], drift, atol=1e-5)
        v = after[l]["values"][:, :, 1:]
        axis = v.cumsum(2) / torch.arange(1, n, dtype=v.dtype)[None, None, :, None]
        cos = _cos(after[l]["outputs"][:, :, 1:], axis).mean((0, 2))
        np.testing.assert_allclose(heads.loc[l, "cos_after"], cos, atol=1e-5)

    def ppl(logits):
        return math.exp(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).item())

    row = tables.ppl.set_index("condition").loc["sink"]
    assert row["ppl_clean"] == pytest.approx(ppl(clean_logits), rel=1e-5)
    assert row["ppl"] == pytest.approx(ppl(after_logits), rel=1e-5)
    # sink_renorm in layer 0 (nothing upstream changed): the output is s_i / (1 - alpha_i0)
    renorm = tables.heads[tables.heads["condition"] == "sink_renorm"].set_index(["layer", "head"])
    a, o, v = clean[0]["attention"], clean[0]["outputs"], clean[0]["values"]
    s_hat = (o - a[..., :1] * v[:, :, :1]) / (1 - a[..., :1])
    np.testing.assert_allclose(renorm.loc[0, "norm_after"], s_hat[:, :, 1:].norm(dim=-1).mean((0, 2)), rtol=1e-4)
    # the control's seeded key, removed for later queries only
    control = tables.heads[tables.heads["condition"] == "control"]
    assert (control["n"] < heads["n"].to_numpy()).all()


def test_sink_heads_scope_only_touches_heads_above_the_threshold():
    model, ids = tiny_model("llama"), random_ids()
    reference, _ = naive_run(model, ids)
    rates = torch.stack([r["attention"][:, :, 1:, 0].mean(-1) for r in reference])  # [layer, sequence, head]
    highest = rates.max(1).values  # [layer, head]
    threshold = float(highest.median())
    tables = sinks.semantic_cone(model, None, ids, heads="sink", threshold=threshold, **FAST)
    for condition in sinks.CONDITIONS:
        touched = tables.heads[tables.heads["condition"] == condition]
        expected = {(l, h) for l in range(2) for h in range(4) if highest[l, h] > threshold}
        assert set(zip(touched["layer"], touched["head"])) == expected
        assert 0 < len(expected) < 8
    sink = tables.heads[tables.heads["condition"] == "sink"].set_index(["layer", "head"])
    for (l, h), row in sink.iterrows():
        chosen = rates[l, :, h] > threshold
        assert row["selected"] == pytest.approx(float(chosen.float().mean()))
        assert row["n"] == int(chosen.sum()) * (ids.shape[1] - 1)


# -- determinism, cache, batch size ----------------------------------------------------------------


def test_results_are_deterministic_cached_and_batch_size_invariant(tmp_path, monkeypatch):
    model, ids = tiny_model("llama"), random_ids(n=4)
    kwargs = dict(cache=True, cache_root=tmp_path, progress=False, batch_size=2)
    first = sinks.run_analyses(model, None, ids, **kwargs)
    second = sinks.run_analyses(model, None, ids, **{**kwargs, "cache": False})
    for name in sinks.ANALYSES:
        for a, b in zip(*(r[name] if isinstance(r[name], tuple) else (r[name],) for r in (first, second))):
            pd.testing.assert_frame_equal(a, b)

    def boom(*args, **kwargs):
        raise AssertionError("recomputed instead of reading the cache")

    monkeypatch.setattr(sinks, "_forward", boom)
    cached = sinks.semantic_cone(model, None, ids, **kwargs)  # the single function reads run_analyses' pieces
    pd.testing.assert_frame_equal(cached.ppl, first["semantic_cone"].ppl)
    monkeypatch.undo()
    other = sinks.sink_decomposition(model, None, ids, batch_size=3, sample_size=50, **FAST)
    pd.testing.assert_frame_equal(other.summary, first["decomposition"].summary, atol=1e-5, rtol=1e-4)
    assert (sinks.model_fingerprint(model) != sinks.model_fingerprint(tiny_model("llama", seed=1)))


def test_decomposition_scopes_split_heads_by_sink_rate():
    model, ids = tiny_model("llama"), random_ids()
    rates = sinks.sink_rates(model, None, ids, **FAST)
    eps = float(rates["sink_rate"].median())
    summary = sinks.sink_decomposition(model, None, ids, eps=eps, **FAST).summary
    heads = summary[(summary["scope"] == "head") & (summary["token_class"] == "sink") & (summary["factor"] == "alpha")]
    np.testing.assert_allclose(heads.sort_values(["layer", "head"])["sink_rate"], rates["sink_rate"], atol=1e-6)
    pooled = summary[(summary["factor"] == "alpha")].set_index(["scope", "token_class"])
    for cls in ("sink", "tail"):
        assert pooled.loc[("sink_heads", cls), "n"] + pooled.loc[("other_heads", cls), "n"] == pooled.loc[("model", cls), "n"]
        assert pooled.loc[("sink_heads", cls), "num_heads"] == int((rates["sink_rate"] > eps).sum())
        assert pooled.loc[("model", cls), "num_heads"] == 8


def test_command_line_writes_tables_and_rebuilds_them_from_raw(tmp_path, monkeypatch):
    import cwcore.data
    import cwcore.models

    texts = [" ".join(f"w{(i * 5 + j) % 20}" for j in range(40)) for i in range(6)]
    monkeypatch.setattr(cwcore.models, "load_model", lambda name: (tiny_model("llama"), _word_tokenizer()))
    monkeypatch.setattr(cwcore.data, "load_dataset", lambda name: texts)
    args = ["--model", "tiny", "--data", "words", "--num-sequences", "3", "--block-size", "12", "--batch-size", "2",
            "--add-bos", "yes", "--no-cache", "--raw", str(tmp_path / "raw")]
    assert sinks.main([*args, "--out", str(tmp_path / "a")]) == 0
    written = sorted(p.name for p in (tmp_path / "a").iterdir())
    stems = ["anti_alignment", "convexity", "convexity-curves", "decomposition", "decomposition-sample", "rates",
             "semantic_cone", "semantic_cone-heads", "semantic_cone-ppl", "summary"]
    assert written == sorted(f"sinks_{s}_tiny_words.csv" for s in stems)
    rates = pd.read_csv(tmp_path / "a" / "sinks_rates_tiny_words.csv")
    assert rates["add_bos"].all() and (rates["first_token_is_bos"] == 1.0).all() and (rates["model"] == "tiny").all()
    summary = pd.read_csv(tmp_path / "a" / "sinks_summary_tiny_words.csv")
    assert {"sink_rate", "decomposition", "anti_alignment", "convexity", "semantic_cone"} <= set(summary["claim"])
    monkeypatch.setattr(cwcore.models, "load_model", lambda name: pytest.fail("--from-raw must not load the model"))
    assert sinks.main([*args, "--from-raw", "--out", str(tmp_path / "b")]) == 0
    for name in written:
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "a" / name), pd.read_csv(tmp_path / "b" / name))


# ---------------------------------------------------------------------------------------------------
# intervals and verdicts used by the book's sink chapters
# ---------------------------------------------------------------------------------------------------


def test_verdict_rule_and_combination():
    assert sinks.verdict(0.1, 0.4) == "holds"
    assert sinks.verdict(-0.4, -0.1) == "does not hold"
    assert sinks.verdict(-0.4, 0.0) == "does not hold"  # touching the threshold from below is not above it
    assert sinks.verdict(-0.1, 0.2) == "inconclusive"
    assert sinks.verdict(-0.4, -0.1, side="below") == "holds"
    assert sinks.verdict(0.55, 0.7, threshold=0.5, side="below") == "does not hold"
    assert sinks.verdict(0.52, 0.7, threshold=0.5) == "holds"
    assert sinks.verdict(float("nan"), 0.3) == sinks.UNMEASURED
    with pytest.raises(ValueError, match="side"):
        sinks.verdict(0, 1, side="left")
    assert sinks.combine_verdicts(["holds", "holds"]) == "holds"
    assert sinks.combine_verdicts(["holds", "does not hold"]) == "holds partly"
    assert sinks.combine_verdicts(["holds", "inconclusive"]) == "holds partly"
    assert sinks.combine_verdicts(["inconclusive", "does not hold"]) == "does not hold"
    assert sinks.combine_verdicts(["inconclusive", sinks.UNMEASURED]) == "inconclusive"
    assert sinks.combine_verdicts([sinks.UNMEASURED]) == sinks.UNMEASURED


def test_share_ci_is_the_wilson_interval():
    share, low, high = sinks.share_ci([True] * 8 + [False] * 2)
    assert share == pytest.approx(0.8)
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    share, low, high = sinks.share_ci([True] * 20 + [None])  # NaN/None dropped; no collapse at 1
    assert share == 1.0 and high == 1.0 and low == pytest.approx(0.8389, abs=1e-4)
    assert np.isnan(sinks.share_ci([])[0])


def test_spearman_and_bootstrap_intervals():
    x = np.arange(30.0)
    rho, low, high = sinks.spearman_ci(x, x**3)  # monotone: rho = 1 in every resample
    assert (rho, low, high) == (1.0, 1.0, 1.0)
    rho, low, high = sinks.spearman_ci(x, -np.exp(x / 10), n_bootstrap=200)
    assert (rho, low, high) == (-1.0, -1.0, -1.0)
    rng = np.random.default_rng(0)
    a = rng.normal(size=200)
    b = a + rng.normal(size=200)
    rho, low, high = sinks.spearman_ci(a, b, seed=1)
    from scipy.stats import spearmanr

    assert rho == pytest.approx(spearmanr(a, b).statistic)
    assert low < rho < high and 0.5 < low and high < 0.85
    assert sinks.spearman_ci(a, b, seed=1) == (rho, low, high)  # seeded
    est, low, high = sinks.bootstrap_ci([1.0, 2.0, 3.0, np.nan, 10.0])
    assert est == 2.5 and 1.0 <= low <= est <= high <= 10.0
    assert sinks.bootstrap_ci([4.0], np.mean)[0] == 4.0 and np.isnan(sinks.bootstrap_ci([4.0])[1])


def test_sequence_bootstrap_pools_rows_and_resamples_whole_sequences():
    # sequence 0: three rows of 1.0 in group "a"; sequence 1: one row of 5.0 in "a"; "b" doubles "a"
    points = pd.DataFrame({"sequence": [0, 0, 0, 1] * 2, "g": ["a"] * 4 + ["b"] * 4,
                           "x": [1.0, 1.0, 1.0, 5.0, 2.0, 2.0, 2.0, 10.0], "w": [1.0, 1.0, 1.0, 3.0] * 2})
    boot = sinks.sequence_bootstrap(points, ["x"], by="g", n_bootstrap=500)
    table = boot.table.set_index("g")
    assert table.loc["a", "x"] == pytest.approx(2.0)  # pooled over rows: (1 + 1 + 1 + 5) / 4
    assert table.loc["b", "x"] == pytest.approx(4.0)
    assert list(table["n"]) == [4, 4] and list(table["n_sequences"]) == [2, 2]
    # a resample holds sequence 0 k times and sequence 1 (2 - k) times: means 1, 2 or 5 only
    assert set(np.round(np.unique(boot.replicates["x"][:, 0]), 6)) <= {1.0, 2.0, 5.0}
    assert table.loc["a", "x_low"] == 1.0 and table.loc["a", "x_high"] == 5.0
    # the same resamples for every group: "b" is exactly twice "a" in every replicate
    assert np.allclose(boot.replicates["x"][:, 1], 2 * boot.replicates["x"][:, 0])
    weighted = sinks.sequence_bootstrap(points, "x", by="g", weight="w", n_bootstrap=10).table
    assert weighted["x"].iloc[0] == pytest.approx((3 * 1.0 + 3 * 5.0) / 6)
    one = sinks.sequence_bootstrap(points[points["sequence"] == 0], ["x"]).table
    assert one["x"].iloc[0] == pytest.approx(1.5) and np.isnan(one["x_low"].iloc[0])


def test_raw_material_and_cone_points_reproduce_the_tables():
    model = planted_model()
    ids = planted_ids(n=4, length=20)
    result = sinks.run_analyses(model, None, ids, ["semantic_cone", "convexity"], batch_size=2, raw=True, **FAST)
    assert set(result) == {"semantic_cone", "convexity", "raw"}
    points = sinks.cone_points(result["raw"]["semantic_cone"], quantiles=5)
    by_quantile = result["semantic_cone"].by_quantile
    within = by_quantile[by_quantile["binning"] == "within_head"].set_index(["condition", "quantile"])
    mine = points.groupby(["condition", "quantile"])[["delta_cos", "norm_after"]].mean()
    assert np.allclose(mine["delta_cos"], within.loc[mine.index, "delta_cos"], atol=1e-6)
    assert np.allclose(mine["norm_after"], within.loc[mine.index, "norm_after"], rtol=1e-5)
    # head 0: o_i = a_i (-e) + (1 - a_i) e and s_i = (1 - a_i) e, so ||s_i|| / ||o_i|| = (1 - a) / |1 - 2a|
    sink = points[(points["condition"] == "sink") & (points["head"] == 0)]
    sink = sink[sink["query"] != E]  # a = 1/2: the clean output is zero
    a = E / (E + sink["query"].to_numpy(float))
    assert np.allclose(sink["log_norm_ratio"], np.log((1 - a) / np.abs(1 - 2 * a)), atol=1e-4)
    assert "points" in result["raw"]["convexity"]


def test_precompute_fills_the_cache_for_later_calls(tmp_path, monkeypatch):
    model = planted_model()
    ids = planted_ids(n=2, length=16)
    options = dict(batch_size=2, cache_root=tmp_path, progress=False)
    first = sinks.run_analyses(model, None, ids, ["rates"], precompute=sinks.ANALYSES, **options)
    assert set(first) == {"rates"}  # tables only for what was asked

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran although the cache was filled")

    monkeypatch.setattr(sinks, "_forward", no_forward)
    later = sinks.run_analyses(model, None, ids, ["convexity", "semantic_cone"], raw=True, **options)
    assert set(later) == {"convexity", "semantic_cone", "raw"} and set(later["raw"]) == {"convexity", "semantic_cone"}
    monkeypatch.undo()
    fresh = sinks.convexity(model, None, ids, batch_size=2, cache=False, progress=False)
    pd.testing.assert_frame_equal(later["convexity"].fits, fresh.fits)
    with pytest.raises(ValueError, match="unknown analyses"):
        sinks.run_analyses(model, None, ids, ["rates"], precompute=["nonsense"], **options)
