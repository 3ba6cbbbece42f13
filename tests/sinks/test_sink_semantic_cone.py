"""The semantic cone (cwcore.sinks.sink_semantic_cone): interventions, bins and raw points."""

import math

import numpy as np
import pytest
import torch

from cwcore import sinks
from sink_fixtures import (E, FAST, P_TAIL, Q_SINK, T, V0, VT, cos as _cos, expected_alpha, naive_run,
                           planted_ids, planted_model, random_ids)
from tiny_models import VOCAB, tiny_model


# -- 5. semantic cone ------------------------------------------------------------------------------


def test_semantic_cone_collapses_into_the_cone_and_differs_from_the_control():
    """The control's rows were checked only by bounds a run that removes nothing also meets (cos_after < 0.99
    and abs(delta_cos) below half the sink's). Now its head 1 is checked against the planted output of
    removing key r: a_i v0 + (1 - a_i - 1 / (E + i)) vt for queries i > r (r read from the raw sequences)."""
    model, ids = planted_model(), planted_ids()
    result = sinks.run_analyses(model, None, ids, ["semantic_cone"], raw=True, **FAST)
    tables = result["semantic_cone"]
    heads = tables.heads.set_index(["condition", "head"])
    # head 1: removing the sink leaves (1 - a) vt, exactly on the cone's axis; before, the angle is planted
    assert heads.loc[("sink", 1), "cos_after"] == pytest.approx(1.0, abs=1e-5)
    assert heads.loc[("sink", 1), "cos_clean"] < 0.99
    assert heads.loc[("sink_renorm", 1), "cos_after"] == pytest.approx(1.0, abs=1e-5)
    assert heads.loc[("sink_renorm", 1), "norm_after"] == pytest.approx(np.linalg.norm(VT), rel=1e-5)  # s^ = vt
    # the control removes one tail token: the output keeps its sink component
    assert heads.loc[("control", 1), "cos_after"] < 0.99
    assert abs(heads.loc[("control", 1), "delta_cos"]) < 0.5 * heads.loc[("sink", 1), "delta_cos"]
    # ... and it does remove key r: every tail value is vt (the cone's axis), alpha_ir = 1 / (E + i)
    v0, vt = np.array(V0), np.array(VT)
    after, before = [], []
    for r in result["raw"]["semantic_cone"]["sequences"]["control_key"]:
        i = np.arange(r + 1, T)
        a = E / (E + i)
        after.append(np.outer(a, v0) + np.outer(1 - a - 1 / (E + i), vt))
        before.append(np.outer(a, v0) + np.outer(1 - a, vt))
    after, before = np.concatenate(after), np.concatenate(before)
    cos_vt = after @ vt / (np.linalg.norm(after, axis=1) * np.linalg.norm(vt))
    assert heads.loc[("control", 1), "norm_after"] == pytest.approx(np.linalg.norm(after, axis=1).mean(), rel=1e-5)
    assert heads.loc[("control", 1), "cos_after"] == pytest.approx(cos_vt.mean(), abs=1e-5)
    delta = cos_vt.mean() - (before @ vt / (np.linalg.norm(before, axis=1) * np.linalg.norm(vt))).mean()
    assert delta < -1e-3  # the control: removing key r turns the output off the axis (a no-op would give 0)
    assert heads.loc[("control", 1), "delta_cos"] == pytest.approx(delta, abs=1e-5)
    a = expected_alpha()
    # head 0: the norm after removing the sink term is (1 - a) P for every query
    assert heads.loc[("sink", 0), "norm_after"] == pytest.approx(np.mean((1 - a) * P_TAIL), rel=1e-5)
    assert heads.loc[("sink", 0), "norm_clean"] == pytest.approx(np.mean(np.abs((1 - a) * P_TAIL - a * Q_SINK)), rel=1e-5)
    assert set(tables.ppl["condition"]) == {"sink", "sink_renorm", "control", "control_mass"}
    # the mass-matched control removes min(a, 1 - a) of tail mass from every row: head 1's output becomes
    # a v0 + (1 - a - min(a, 1 - a)) vt
    mass = [np.linalg.norm(ai * np.array(V0) + (1 - ai - min(ai, 1 - ai)) * np.array(VT)) for ai in a]
    assert heads.loc[("control_mass", 1), "norm_after"] == pytest.approx(np.mean(mass), rel=1e-4)
    for binning in ("within_head", "across_heads"):
        by_q = tables.by_quantile[tables.by_quantile["binning"] == binning]
        assert (by_q.groupby("condition")["n"].sum().loc["sink"]) == 2 * 3 * (T - 1)
    within = tables.by_quantile[tables.by_quantile["binning"] == "within_head"]
    assert set(within["quantile"]) == {1, 2, 3, 4, 5}
    across = tables.by_quantile[tables.by_quantile["binning"] == "across_heads"]
    assert set(across["quantile"]) == {3, 5}  # two heads: ranks 1/2 and 2/2


def test_semantic_cone_matches_naive_interventions():
    """The control was checked only through its count of touched queries (bookkeeping, not the intervention):
    a control run that removed nothing passed. Now its outputs and perplexity are compared with a naive run of
    the model that removes key r of each sequence for queries i > r (r read from the raw sequences)."""
    model, ids = tiny_model("llama"), random_ids()
    result = sinks.run_analyses(model, None, ids, ["semantic_cone"], raw=True, batch_size=2, **FAST)
    tables = result["semantic_cone"]
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
    # the control's seeded key r, removed for later queries only
    keys = result["raw"]["semantic_cone"]["sequences"].sort_values("sequence")["control_key"].to_numpy()
    removed = torch.zeros(b, 4, n, n, dtype=torch.bool)
    for seq, r in enumerate(keys):
        removed[seq, :, r + 1:, r] = True
    after, after_logits = naive_run(model, ids, masks={0: removed, 1: removed})
    control = tables.heads[tables.heads["condition"] == "control"].set_index(["layer", "head"])
    touched = torch.arange(n)[None, :] > torch.tensor(keys)[:, None]  # [b, q]
    assert (control["n"] == int(touched.sum())).all()
    for l in range(2):
        norm = after[l]["outputs"].norm(dim=-1)  # [b, h, q]
        v = after[l]["values"][:, :, 1:]
        axis = v.cumsum(2) / torch.arange(1, n, dtype=v.dtype)[None, None, :, None]
        cos = _cos(after[l]["outputs"][:, :, 1:], axis)  # [b, h, q - 1]
        for h in range(4):
            expected_norm = norm[:, h][touched].mean()
            expected_cos = cos[:, h][touched[:, 1:]].mean()
            assert control.loc[(l, h), "norm_after"] == pytest.approx(float(expected_norm), rel=1e-4), (l, h)
            assert control.loc[(l, h), "cos_after"] == pytest.approx(float(expected_cos), abs=1e-5), (l, h)
        assert not np.allclose(control.loc[l, "norm_after"], control.loc[l, "norm_clean"], rtol=1e-4)  # it acts
    row = tables.ppl.set_index("condition").loc["control"]
    assert row["ppl"] == pytest.approx(ppl(after_logits), rel=1e-5)
    assert row["ppl"] != pytest.approx(row["ppl_clean"], rel=1e-6)


def _remove_sink_mass(p, order):
    """Naive: walk the keys in ``order``, zeroing their attention until alpha_i0 of mass (or all the tail's) is gone."""
    kept, left = p.astype(float).copy(), float(p[0])
    for j in order:
        take = min(left, kept[j])
        kept[j] -= take
        left -= take
    return kept


def test_the_controls_draw_their_key_and_removal_order_from_the_seed():
    """The controls' randomness was never checked: a control key fixed at 1 and a mass-matched control that
    removes keys in index order passed (test_mass_matched_removal... walks given scores, not the drawn ones).
    The references re-draw the registered streams here: the key r = default_rng([seed, sequence]).integers(1,
    T - 1); the removal priorities default_rng([seed, sequence, 1]).random((heads, T, T)), walked naively over
    the eager attention map of layer 0 (nothing upstream changed there) to give the expected output norms.
    The controls: the keys vary over sequences and seeds, and removing in index order gives other norms."""
    model, ids = tiny_model("llama"), random_ids(n=4, length=12)
    b, n = ids.shape
    clean, _ = naive_run(model, ids)
    probs, values = clean[0]["attention"], clean[0]["values"]  # [b, h, q, k], [b, h, k, m]
    heads_n = probs.shape[1]
    keys = {}
    for seed in (0, 1):
        raw = sinks.run_analyses(model, None, ids, ["semantic_cone"], raw=True, batch_size=2, seed=seed,
                                 **FAST)["raw"]["semantic_cone"]
        keys[seed] = raw["sequences"].sort_values("sequence")["control_key"].to_numpy()
        expected = [np.random.default_rng([seed, s]).integers(1, n - 1) for s in range(b)]
        np.testing.assert_array_equal(keys[seed], expected)
        assert ((keys[seed] >= 1) & (keys[seed] <= n - 2)).all()  # a non-sink key with a later query
        mass = raw["points"][(raw["points"]["condition"] == "control_mass") & (raw["points"]["layer"] == 0)]
        got = mass.set_index(["sequence", "head", "query"])["norm_after"]
        in_order = []  # abs(difference) from removing keys 1..i in index order
        for seq in range(b):
            scores = np.random.default_rng([seed, seq, 1]).random((heads_n, n, n))
            for h in range(heads_n):
                v = values[seq, h].numpy()
                for i in range(1, n):
                    p = probs[seq, h, i].numpy()
                    drawn = sorted(range(1, i + 1), key=scores[h, i].__getitem__)
                    norm = np.linalg.norm(_remove_sink_mass(p, drawn) @ v)
                    assert got.loc[(seq, h, i)] == pytest.approx(norm, rel=1e-4, abs=1e-6), (seed, seq, h, i)
                    by_index = np.linalg.norm(_remove_sink_mass(p, range(1, i + 1)) @ v)
                    in_order.append(abs(got.loc[(seq, h, i)] - by_index))
        assert max(in_order) > 1e-3  # the control: the order of removal matters here
    assert len(set(keys[0]) | set(keys[1])) > 1 and (keys[0] != keys[1]).any()


def test_sink_heads_scope_only_touches_heads_above_the_threshold():
    model, ids = tiny_model("llama"), random_ids()
    reference, _ = naive_run(model, ids)
    rates = torch.stack([r["attention"][:, :, 1:, 0].mean(-1) for r in reference])  # [layer, sequence, head]
    highest = rates.max(1).values  # [layer, head]
    threshold = float(highest.median())
    tables = sinks.sink_semantic_cone(model, None, ids, heads="sink", threshold=threshold, **FAST)
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


def test_mass_matched_removal_takes_exactly_the_sink_mass_in_random_order():
    from cwcore.sinks.semantic_cone import mass_matched_removal

    rng = np.random.default_rng(0)
    b, h, n = 2, 3, 9
    logits = torch.as_tensor(rng.normal(size=(b, h, n, n)) * 2, dtype=torch.float32)
    logits[..., 0] += torch.as_tensor(rng.uniform(0, 3, size=(b, h, n)), dtype=torch.float32)
    causal = torch.ones(n, n).tril().bool()
    probs = torch.where(causal, logits, torch.tensor(float("-inf"))).softmax(-1)
    scores = torch.as_tensor(rng.random((b, h, n, n)), dtype=torch.float32)
    rows = torch.tensor([[True, False, True], [True, True, False]])
    out = mass_matched_removal(probs, scores, rows)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                p, o = probs[bi, hi, i].numpy().astype(float), out[bi, hi, i].numpy().astype(float)
                if not rows[bi, hi] or i == 0:
                    np.testing.assert_array_equal(o, p)
                    continue
                expected, left = p.copy(), p[0]  # naive: walk the keys 1..i by increasing score
                for j in sorted(range(1, i + 1), key=lambda j: scores[bi, hi, i, j].item()):
                    take = min(left, p[j])
                    expected[j] -= take
                    left -= take
                np.testing.assert_allclose(o, expected, atol=1e-6)
                assert o[0] == p[0]  # the sink term is kept
                assert p.sum() - o.sum() == pytest.approx(min(p[0], 1 - p[0]), abs=1e-5)


def test_weak_token_curve_matches_a_naive_sum_of_the_weakest_terms():
    from cwcore.sinks.semantic_cone import weak_token_counts

    model, ids = tiny_model("llama"), random_ids(n=2)
    results = sinks.run_analyses(model, None, ids, ["semantic_cone"], raw=True, batch_size=2, **FAST)
    weak = results["raw"]["semantic_cone"]["weak"]
    clean, _ = naive_run(model, ids)
    n = ids.shape[1]
    ks = weak_token_counts(n)
    assert ks == [k for k in (1, 2, 4, 8, 16, 32) if k <= (n - 1) // 2]
    row = weak[(weak["layer"] == 1) & (weak["sequence"] == 1) & (weak["head"] == 2)].set_index("query")
    probs, values = clean[1]["attention"][1, 2], clean[1]["values"][1, 2]  # [q, k], projected values [k, model]
    for i in (ks[-1], n - 1):
        order = sorted(range(1, i + 1), key=lambda j: probs[i, j].item())
        axis = values[1:i + 1].mean(0)
        for k in [*ks, None]:
            chosen = order if k is None else order[:k]
            z = sum(probs[i, j] * values[j] for j in chosen)
            expected = float(torch.nn.functional.cosine_similarity(z, axis, dim=0))
            assert row.loc[i, f"cos_k{k if k is not None else 'all'}"] == pytest.approx(expected, abs=1e-4)


# -- controls that could fail --------------------------------------------------------------------


def _cone_points(model, ids):
    results = sinks.run_analyses(model, None, ids, ["semantic_cone"], raw=True, batch_size=2, **FAST)
    return sinks.cone_points(results["raw"]["semantic_cone"], quantiles=5), results


def test_random_direction_control_matches_a_naive_replacement_in_model_space():
    model, ids = tiny_model("llama"), random_ids(n=2)
    points, _ = _cone_points(model, ids)
    clean, _ = naive_run(model, ids)
    rows = points[points["condition"] == "sink"].set_index(["layer", "sequence", "head", "query"])
    heads_, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    for layer in (0, 1):
        w = model.model.layers[layer].self_attn.o_proj.weight.detach().double()
        w_h = w.reshape(w.shape[0], heads_, dim).permute(1, 0, 2)  # [h, model, d]
        for seq in (0, 1):
            g = torch.as_tensor(np.random.default_rng([0, seq, 2, layer]).standard_normal((heads_, ids.shape[1], dim)))
            for head in (0, 2):
                probs, values = clean[layer]["attention"][seq, head], clean[layer]["values"][seq, head]
                out = clean[layer]["outputs"][seq, head]
                for i in (1, 5, ids.shape[1] - 1):
                    a = probs[i, 0]
                    u = w_h[head] @ g[head, i]
                    s = out[i] - a * values[0]
                    replaced = s + a * values[0].norm() * u / u.norm()
                    axis = values[1:i + 1].mean(0)
                    expected = float(torch.nn.functional.cosine_similarity(replaced, axis, dim=0))
                    assert rows.loc[(layer, seq, head, i), "cos_random_clean"] == pytest.approx(expected, abs=1e-4)
                    naive_clean = float(torch.nn.functional.cosine_similarity(out[i], axis, dim=0))
                    assert rows.loc[(layer, seq, head, i), "sink_vs_random"] == pytest.approx(expected - naive_clean,
                                                                                               abs=1e-4)


def test_random_direction_control_can_contradict_the_cone_claim():
    from cwbook import sink_claims as SC

    # head 0 of the planted model: the sink value points exactly against the tail values, so the sink term
    # holds the output out of the cone more than a random term of its norm would ...
    model, ids = planted_model(), planted_ids(n=6)
    points, results = _cone_points(model, ids)
    head0 = points[(points["condition"] == "sink") & (points["head"] == 0) & (points["alpha0_clean"] > 0.5)]
    assert (head0["sink_vs_random"] > 0).all()
    # ... and with the sink value turned to point along the tail values, it keeps the output inside the cone
    # better than a random term would: the control's part of the claim is contradicted
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[0, 0] *= -1
        model.model.layers[0].self_attn.v_proj.weight[8:, 0] = 0
        model.model.layers[0].self_attn.v_proj.weight[8, 0] = VT[0] / math.sqrt(16)
    points, results = _cone_points(model, ids)
    claims = SC.cone_claims(results["raw"]["semantic_cone"], 5, n_resamples=200, seed=0)
    row = claims[claims["key"] == "dcos_sink_minus_random_direction"].iloc[0]
    assert row["high"] < 0 and row["verdict"] == "contradicted"


def test_weak_token_null_matches_a_naive_sum_on_random_keys():
    from cwcore.sinks.semantic_cone import drift_points, weak_token_counts

    model, ids = tiny_model("llama"), random_ids(n=2)
    results = sinks.run_analyses(model, None, ids, ["semantic_cone"], raw=True, batch_size=2, **FAST)
    raw = results["raw"]["semantic_cone"]
    weak = raw["weak"]
    clean, _ = naive_run(model, ids)
    n = ids.shape[1]
    ks = weak_token_counts(n)
    first = ks[-1]
    layer, seq, head = 1, 1, 2
    row = weak[(weak["layer"] == layer) & (weak["sequence"] == seq) & (weak["head"] == head)].set_index("query")
    scores = np.random.default_rng([0, seq, 3, layer]).random((model.config.num_attention_heads, n - first, n))
    probs, values = clean[layer]["attention"][seq, head], clean[layer]["values"][seq, head]
    for i in (first, n - 1):
        weights = sorted(probs[i, j].item() for j in range(1, i + 1))  # the weakest first
        drawn = sorted(range(1, i + 1), key=lambda j: scores[head, i - first, j])  # random tail keys
        axis = values[1:i + 1].mean(0)
        for k in ks:
            z = sum(w * values[j] for w, j in zip(weights[:k], drawn[:k]))
            expected = float(torch.nn.functional.cosine_similarity(z, axis, dim=0))
            assert row.loc[i, f"null_k{k}"] == pytest.approx(expected, abs=1e-4)
    long = drift_points(raw, 5)
    at = long[(long["layer"] == layer) & (long["sequence"] == seq) & (long["head"] == head) & (long["k"] == first)]
    np.testing.assert_allclose(at["cos_minus_null"], at["cos"] - at["cos_null"], equal_nan=True)
    assert np.isnan(long.loc[long["k"] == 0, "cos_null"]).all()  # all tail tokens: no null


def test_leaving_the_sink_out_keeps_a_learned_sinks_mass_in_the_softmax():
    """``sink_renorm`` is the softmax without key 0: alpha_ij / (1 - alpha_i0). With a learned sink logit
    (GPT-OSS) the keys' probabilities sum to 1 - learned mass, and before, the tail was divided by its own sum,
    which also dropped what the learned sink absorbs (layer outputs 0.1 off on a tiny GPT-OSS)."""
    from types import SimpleNamespace

    import torch

    from cwcore.sinks.engine import exclude_sink

    probs = torch.tensor([[[[1.0, 0.0, 0.0], [0.3, 0.2, 0.1], [0.1, 0.3, 0.2]]]])  # [b, h, q, k]
    learned = 1 - probs.sum(-1)  # [b, h, q]: 0, 0.4, 0.4
    transform = exclude_sink(torch.ones(1, 1))
    got = transform(SimpleNamespace(probs=probs, learned_sink_mass=learned, sink_scales_output=False))
    expected = probs.clone()
    expected[..., 1:, 0] = 0
    expected[..., 1:, 1:] = probs[..., 1:, 1:] / (1 - probs[..., 1:, :1])
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(got[..., 1:, 1:].sum(-1), torch.ones(1, 1, 2))  # the learned sink keeps its share


@pytest.mark.parametrize("name", ["gpt_oss", "granite_swa"])
def test_leaving_the_sink_out_of_a_real_learned_sink_model_divides_by_one_less_alpha_0(name):
    """On the models themselves: the probabilities a transform sees are the softmax over keys and learned sink
    with the sink's column dropped, for GPT-OSS and for Granite SWA alike (whose own maps sum to one and scale
    the output: the same arithmetic). Before, Granite's tail was divided by its own sum, which dropped the learned
    sink's mass (its semantic part's norm_after came out 37% too large)."""
    import torch

    from cwcore.sinks import engine
    from zoo_models import zoo_model

    model = zoo_model(name)
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    seen = {}
    engine.forward(model, ids, on_layer=lambda s: seen.setdefault("clean", s.probs) if s.layer == 0 else None)
    engine.forward(model, ids, renormalise={0: torch.ones(2, seen["clean"].shape[1])},
                   on_layer=lambda s: seen.setdefault("renorm", s.probs) if s.layer == 0 else None)
    clean, renorm = seen["clean"], seen["renorm"]
    learned = 1 - clean.sum(-1)
    assert learned[..., 1:].min() > 0.01  # the control: a learned sink that takes mass
    expected = clean[..., 1:, 1:] / (1 - clean[..., 1:, :1])
    torch.testing.assert_close(renorm[..., 1:, 1:], expected, rtol=1e-5, atol=1e-7)
    assert (renorm[..., 1:, 0] == 0).all()
