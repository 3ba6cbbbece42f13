"""Suppression, both readings, at the head, the attention output and after the post-attention norm
(cwcore.sinks.suppression)."""

import numpy as np
import pandas as pd
import pytest
import torch

from cwcore import sinks, stats
from cwcore.sinks import suppression
from cwbook.sink_claims import pooled_suppression
from cwcore.sinks.convexity import SUPPRESSION, _claim_rows as convexity_rows
from sink_fixtures import FAST, P_TAIL, Q_SINK, V0, VT, expected_alpha, naive_run, planted_ids, planted_model, random_ids
from tiny_models import tiny_model


def _run(model, ids, **options):
    out = sinks.run_analyses(model, None, ids, ["convexity"], raw=True, **FAST, **options)
    return out["convexity"].fits, out["raw"]["convexity"]


def test_post_attention_norm_is_found_by_observation_not_by_name():
    gemma = tiny_model("gemma3")
    found = suppression.post_attention_norms(gemma)
    assert all(found[l] is layer.post_attention_layernorm for l, layer in enumerate(gemma.model.layers))
    # Llama's "post_attention_layernorm" is the MLP's pre-norm (after the residual add): not a post-attention norm
    llama = tiny_model("llama")
    assert hasattr(llama.model.layers[0], "post_attention_layernorm")
    assert set(suppression.post_attention_norms(llama).values()) == {None}


def test_block_points_match_the_models_own_outputs_and_a_naive_sum_over_heads():
    model, ids = tiny_model("gemma3"), random_ids(length=10)
    _, raw = _run(model, ids, min_range=0.0)
    block = raw["block"].set_index(["layer", "sequence", "query"]).sort_index()
    reference, _ = naive_run(model, ids)
    real = {}  # what the model's post-attention norms really returned
    handles = [layer.post_attention_layernorm.register_forward_hook(
        lambda m, i, o, l=l: real.__setitem__(l, o.detach().double())) for l, layer in enumerate(model.model.layers)]
    with torch.inference_mode():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    assert list(raw["layers"]["post_norm"]) == [True, True]
    for l, ref in enumerate(reference):
        a = ref["attention"][:, :, :, :1]  # [b, h, q, 1]
        v0 = ref["values"][:, :, :1]  # [b, h, 1, m]
        o = ref["outputs"]  # [b, h, q, m]
        s = o - a * v0
        expected = {"out": o.sum(1), "raw": s.sum(1), "renorm": (s / (1 - a)).sum(1)}
        got = block.loc[l]
        norm = model.model.layers[l].post_attention_layernorm
        for name, x in expected.items():
            np.testing.assert_allclose(got[name].to_numpy(), x[:, 1:].norm(dim=-1).reshape(-1).numpy(), rtol=1e-4)
            with torch.no_grad():
                after = norm(x.float()).double()[:, 1:].norm(dim=-1).reshape(-1).numpy()
            np.testing.assert_allclose(got[f"post_{name}"].to_numpy(), after, rtol=1e-4)
        np.testing.assert_allclose(got["post_out"].to_numpy(), real[l][:, 1:].norm(dim=-1).reshape(-1).numpy(), rtol=1e-4)
        np.testing.assert_allclose(got["alpha0"].to_numpy(), a[:, :, 1:, 0].mean(1).reshape(-1).numpy(), atol=1e-6)


def test_a_bf16_models_post_norm_points_are_normed_at_float32():
    """The post-attention norm ran in bfloat16 on a bf16 model: the float32 geometry rounded to bf16 and normed
    there (0.7% off on gemma3-270m). Reference: the same block vectors through a float32 copy of each norm."""
    import copy

    import cwcore.sinks.convexity as convexity

    model, ids = tiny_model("gemma3").to(torch.bfloat16), random_ids(length=10)
    _, raw = _run(model, ids, min_range=0.0)
    copies = {l: copy.deepcopy(layer.post_attention_layernorm).float() for l, layer in enumerate(model.model.layers)}
    original = convexity.block_points
    try:
        convexity.block_points = lambda s, start, norm, bias, sink=0: original(
            s, start, copies[s.layer] if norm is not None else None, bias, sink)
        _, reference = _run(model, ids, min_range=0.0)
    finally:
        convexity.block_points = original
    for column in ("post_out", "post_raw", "post_renorm"):
        np.testing.assert_allclose(raw["block"][column].to_numpy(), reference["block"][column].to_numpy(), rtol=1e-6)


def test_planted_shares_of_both_readings_at_head_and_attention_output():
    model, ids = planted_model(), planted_ids()
    fits, raw = _run(model, ids)
    a = expected_alpha()
    table = suppression.suppression_table(fits, raw["points"], raw["block"], eps=0.1,
                                          n_resamples=200).set_index(["place", "reading"])
    # head 0: o = (1 - a) P e - a Q e, s = (1 - a) P e, s^ = P e; head 1: o = a V0 + (1 - a) VT, s^ = VT
    o0, o1 = np.abs((1 - a) * P_TAIL - a * Q_SINK), np.linalg.norm(np.outer(a, V0) + np.outer(1 - a, VT), axis=1)
    s0, s1 = (1 - a) * P_TAIL, (1 - a) * np.linalg.norm(VT)
    raw_share = np.mean(np.concatenate([o0 < s0, o1 < s1]))
    renorm_share = np.mean(np.concatenate([o0 < P_TAIL, o1 < np.linalg.norm(VT)]))
    assert table.loc[("head", "raw"), "share"] == pytest.approx(raw_share)
    assert table.loc[("head", "renormalised"), "share"] == pytest.approx(renorm_share)
    # the two heads write orthogonal dimensions (o_proj = identity): the block norm is the root sum of squares
    block_out, block_raw, block_ren = np.hypot(o0, o1), np.hypot(s0, s1), np.hypot(P_TAIL, np.linalg.norm(VT))
    # (at a = 4/7 the planted block output ties with the raw counterfactual: float32 decides that query)
    tie = np.isclose(block_out, block_raw, rtol=1e-9)
    assert tie.sum() == 1
    share = table.loc[("attention output", "raw"), "share"]
    assert np.mean(block_out < block_raw) - 1e-9 <= share <= np.mean((block_out < block_raw) | tie) + 1e-9
    assert table.loc[("attention output", "renormalised"), "share"] == pytest.approx(np.mean(block_out < block_ren))
    ratio = np.exp(np.mean(np.log(block_out / block_ren)))
    assert table.loc[("attention output", "renormalised"), "geo_ratio"] == pytest.approx(ratio, rel=1e-4)
    # Llama has no post-attention norm: said, not computed
    post = table.loc["after post-norm"]
    assert post["share"].isna().all() and set(post["why"]) == {suppression.NO_POST_NORM}


def test_suppression_claims_raw_head_row_is_the_pooled_share_and_others_degrade():
    model, ids = tiny_model("llama"), random_ids(n=4, length=12)
    fits, raw = _run(model, ids, min_range=0.0)
    eps = float(fits[fits["scope"] == "head"]["sink_rate"].median())  # half the heads are "sink heads"
    rows = pd.DataFrame(convexity_rows(fits, raw["points"], eps, 200, 0, raw["block"], raw["layers"]))
    primary = rows[rows["key"] == "shortened"].iloc[0]
    assert primary["claim"] == SUPPRESSION
    share, low, high = pooled_suppression(fits, raw["points"], eps, 200, 0)
    assert (primary["estimate"], primary["low"], primary["high"]) == pytest.approx((share, low, high))
    post = rows[rows["key"].str.endswith("@after_post-norm")]
    assert len(post) == 2 and set(post["verdict"]) == {stats.NOT_MEASURED}
    assert set(post["why"]) == {suppression.NO_POST_NORM}
    # no sink heads at all: every suppression part says so, nothing crashes
    none = pd.DataFrame(convexity_rows(fits, raw["points"], 1.0, 200, 0, raw["block"], raw["layers"]))
    supp = none[none["key"].str.startswith("shortened")]
    assert len(supp) == 6 and set(supp["verdict"]) == {stats.NOT_MEASURED}
    assert set(supp["why"]) == {"no sink heads at eps=1"}


def test_lowest_norm_ratio_against_a_naive_loop():
    rng = np.random.default_rng(0)
    n = 400
    points = pd.DataFrame({"layer": rng.integers(0, 2, n), "head": rng.integers(0, 2, n), "sequence": rng.integers(0, 5, n),
                           "alpha0": rng.uniform(0, 0.9, n), "norm": rng.uniform(0.1, 2, n),
                           "s_sq": rng.uniform(0.1, 2, n) ** 2, "v0_sq": np.ones(n)})
    got = suppression.lowest_norm_ratio(points, quantiles=4, n_resamples=300)
    renorm, out = [], []
    for _, g in points.groupby(["layer", "head"]):
        low = g[g["norm"] <= g["norm"].quantile(0.25)]
        renorm += list(np.sqrt(low["s_sq"]) / (1 - low["alpha0"]))
        out += list(low["norm"])
    assert got.estimate == pytest.approx(np.mean(renorm) / np.mean(out))
    assert got.low < got.estimate < got.high


def test_suppression_per_layer_type_equals_the_share_over_that_types_layers():
    # a Gemma 3 with one sliding and one global layer: each type's row is the share over its own layer's queries
    model, ids = tiny_model("gemma3"), random_ids(n=4, length=12)
    fits, raw = _run(model, ids, min_range=0.0)
    eps = float(fits[fits["scope"] == "head"]["sink_rate"].min()) - 1e-6  # every head is a sink head
    rows = pd.DataFrame(convexity_rows(fits, raw["points"], eps, 200, 0, raw["block"], raw["layers"]))
    types = dict(zip(raw["layers"]["layer"], raw["layers"]["layer_type"]))
    assert sorted(set(types.values())) == ["global", "sliding"]
    block = raw["block"]
    for layer_type in ("sliding", "global"):
        mine = block[block["layer"].map(types) == layer_type]
        for reading, cf in (("raw", "raw"), ("renormalised", "renorm")):
            key = f"shortened_{reading}@attention_output@{layer_type}"
            row = rows[rows["key"] == key]
            assert len(row) == 1, key
            assert row["claim"].iloc[0].endswith(f"[{layer_type} layers]")
            assert row["estimate"].iloc[0] == pytest.approx(np.mean(mine["out"] < mine[cf]))
            assert row["unit"].iloc[0] == "document" and row["n_units"].iloc[0] == 4
    # the paper's reading (raw, per head, all layers) is still the one unbracketed suppression part
    assert (rows["claim"] == SUPPRESSION).sum() == 1
    # a model with one layer type gets no per-type rows
    llama_fits, llama_raw = _run(tiny_model("llama"), ids, min_range=0.0)
    llama = pd.DataFrame(convexity_rows(llama_fits, llama_raw["points"], eps, 200, 0, llama_raw["block"],
                                        llama_raw["layers"]))
    assert not llama["key"].str.contains("@global|@sliding").any()


def test_suppression_beyond_the_head_reads_only_the_layers_that_hold_a_sink_head():
    """The rows at the attention output and after the post-norm are "outputs of layers with a sink head", but
    every test made every layer hold one (eps below every rate, or one layer), so dropping the layer filter
    passed. Here eps is the highest sink rate of the sliding layer (a sink rate must lie above eps): only the
    global layer holds sink heads. The reference: the shares over that layer's block rows alone; the control:
    the shares over both layers differ."""
    model, ids = tiny_model("gemma3"), random_ids(n=4, length=12)
    fits, raw = _run(model, ids, min_range=0.0)
    heads = fits[fits["scope"] == "head"]
    eps = float(heads.loc[heads["layer"] == 0, "sink_rate"].max())
    assert (heads.loc[heads["layer"] == 1, "sink_rate"] > eps).all()  # layer 1: every head a sink head
    rows = pd.DataFrame(convexity_rows(fits, raw["points"], eps, 200, 0, raw["block"], raw["layers"])).set_index("key")
    block = raw["block"]
    mine = block[block["layer"] == 1]
    for place, prefix in (("attention_output", ""), ("after_post-norm", "post_")):
        for reading, cf in (("raw", "raw"), ("renormalised", "renorm")):
            expected = np.mean(mine[f"{prefix}out"] < mine[f"{prefix}{cf}"])
            everywhere = np.mean(block[f"{prefix}out"] < block[f"{prefix}{cf}"])
            assert abs(expected - everywhere) > 0.02  # the control: the filter changes the share
            key = f"shortened_{reading}@{place}"
            assert rows.loc[key, "estimate"] == pytest.approx(expected, abs=1e-12), key
            assert rows.loc[key, "n"] == len(mine)
    # the head row: the sink heads' own queries, all in layer 1
    points = raw["points"][raw["points"]["layer"] == 1]
    assert rows.loc["shortened", "estimate"] == pytest.approx(np.mean(points["norm"] < np.sqrt(points["s_sq"])))


def test_a_query_with_all_its_attention_on_the_sink_has_no_renormalised_reading():
    """s^_i = s_i / (1 - a_i) is undefined where all attention is on the sink; head_points leaves it NaN where
    1 - a_i is 1e-6 or less (as the convexity fits' usable points), so the query counts in no renormalised
    share. No test had such a query: dividing anyway passed. The control: a query just inside is renormalised."""
    points = pd.DataFrame({"layer": 0, "head": 0, "sequence": [0, 1, 2], "alpha0": [1 - 1e-9, 1 - 1e-5, 0.5],
                           "norm": 1.0, "s_sq": [1e-18, 1e-10, 0.25], "v0_sq": 1.0})
    heads = suppression.head_points(points)
    assert np.isnan(heads["renorm"].iloc[0])
    np.testing.assert_allclose(heads["renorm"].iloc[1:], [1e-5 / 1e-5, 0.5 / 0.5], rtol=1e-6)
    np.testing.assert_allclose(heads["raw"], np.sqrt(points["s_sq"]), rtol=1e-12)
