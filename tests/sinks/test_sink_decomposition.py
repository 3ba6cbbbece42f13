"""The decomposition of c_ij for sink and tail tokens (cwcore.sinks.decomposition)."""

import numpy as np
import pytest
import torch

from cwcore import sinks
from sink_fixtures import (E, FAST, T, cos as _cos, expected_alpha, naive_run, planted_ids, planted_model,
                           random_ids)
from tiny_models import tiny_model


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


def test_joint_shares_match_a_naive_least_squares_on_every_pair():
    from cwcore.sinks.decomposition import joint_shares

    model, ids = tiny_model("llama"), random_ids(n=4)
    results = sinks.run_analyses(model, None, ids, ["decomposition"], raw=True, batch_size=2, quantile_sample=10_000,
                                 sample_size=10**6, **FAST)
    raw = results["raw"]["decomposition"]
    joint = joint_shares(raw["stats"], eps=0.0, n_resamples=200, seed=0)  # eps 0: every head is a sink head
    sample = raw["sample"]  # every (query, key) pair of every head (quantile_sample exceeds their number)
    for cls in ("sink", "tail"):
        pairs = sample[sample["token_class"] == cls]
        logs = np.log(np.abs(pairs[["alpha", "relative_norm", "cosine"]].to_numpy(float)))
        logs = logs[np.isfinite(logs).all(1)]
        L = logs.sum(1)
        row = joint[(joint["group"] == "sink_heads") & (joint["token_class"] == cls)].iloc[0]
        assert row["n"] == len(L)
        for k, f in enumerate(("alpha", "relative_norm", "cosine")):
            share = np.cov(logs[:, k], L, bias=True)[0, 1] / L.var()
            assert row[f"share_{f}"] == pytest.approx(share, rel=1e-4, abs=1e-6)

        def r2(columns):
            x = np.column_stack([np.ones(len(L)), logs[:, columns]])
            fit = np.linalg.lstsq(x, L, rcond=None)[0]
            return 1 - ((L - x @ fit) ** 2).sum() / ((L - L.mean()) ** 2).sum()

        assert row["r2_alpha"] == pytest.approx(r2([0]), rel=1e-4, abs=1e-6)
        assert row["r2_cosine"] == pytest.approx(r2([2]), rel=1e-4, abs=1e-6)
        assert row["r2_joint"] == pytest.approx(r2([0, 2]), rel=1e-4, abs=1e-6)
        assert row["share_alpha_low"] <= row["share_alpha"] <= row["share_alpha_high"]
        assert row["n_sequences"] == 4
    assert set(joint["group"]) == {"sink_heads", "all"}  # eps = 0: every head is a sink head


def test_the_null_baseline_class_holds_one_seeded_random_key_per_query_and_its_shares_are_naive():
    """The registered null baseline of the decomposition: class ``null`` is one key drawn from 1..i for
    every query i >= 1 (seeded per sequence, the same in every layer and head); its pooled factor shares
    equal a naive covariance over exactly those pairs, recomputed from the model's materialised vectors."""
    model, ids = tiny_model("llama"), random_ids()
    tables = sinks.sink_decomposition(model, None, ids, batch_size=2, **FAST)
    reference, _ = naive_run(model, ids)
    a = torch.stack([r["attention"] for r in reference]).double()  # [l, b, h, q, k]
    v = torch.stack([r["values"] for r in reference]).double()
    o = torch.stack([r["outputs"] for r in reference]).double()
    n_layers, b, heads, T, _ = a.shape
    logs = []
    for s in range(b):
        keys = np.random.default_rng([0, s, 1]).integers(1, np.arange(2, T + 1))  # the registered draw
        assert ((keys >= 1) & (keys <= np.arange(1, T))).all()
        q, k = torch.arange(1, T), torch.as_tensor(keys)
        alpha = a[:, s, :, q, k]  # [l, h, T-1]
        vj, oi = v[:, s][:, :, k], o[:, s][:, :, q]
        rel = vj.norm(dim=-1) / oi.norm(dim=-1)
        cos = (vj * oi).sum(-1) / (vj.norm(dim=-1) * oi.norm(dim=-1))
        logs.append(torch.stack([alpha.log(), rel.log(), cos.abs().log()], -1).reshape(-1, 3))
    logs = torch.cat(logs).numpy()
    total = logs.sum(1)
    pooled = tables.summary[(tables.summary["scope"] == "model") & (tables.summary["token_class"] == "null")]
    pooled = pooled.set_index("factor")
    assert int(pooled.loc["alpha", "n"]) == len(logs) == n_layers * b * heads * (T - 1)
    for j, factor in enumerate(["alpha", "relative_norm", "cosine"]):
        share = np.cov(logs[:, j], total, bias=True)[0, 1] / total.var()
        assert pooled.loc[factor, "share"] == pytest.approx(share, abs=1e-4)


def test_the_null_baseline_part_is_the_sink_margin_minus_the_random_keys(monkeypatch):
    """The claim part ``sink_geometry_minus_null`` is, per sink head, (geometry − attention) at the sink
    minus the same at the random key, averaged over sink heads (a naive recomputation from the per-head
    shares); a model whose sink is no different from a random key reads about zero, and the part can fail."""
    from cwcore.sinks import decomposition as D

    heads = []
    for layer in range(6):
        for head in range(2):
            for cls, geometry, alpha in (("sink", 0.8, 0.2), ("null", 0.5 + 0.01 * layer, 0.5), ("tail", 0.3, 0.7)):
                heads.append({"layer": layer, "head": head, "token_class": cls, "sink_rate": 0.6,
                              "geometry": geometry, "alpha": alpha})
    import pandas as pd

    rows = D._claim_rows(pd.DataFrame(heads), eps=0.3)
    part = [r for r in rows if r["key"] == "sink_geometry_minus_null"][0]
    expected = np.mean([(0.8 - 0.2) - (0.5 + 0.01 * layer - 0.5) for layer in range(6) for _ in range(2)])
    assert part["estimate"] == pytest.approx(expected) and part["verdict"] == "holds"
    # the control: a sink whose margin is a random key's does not pass the null
    same = pd.DataFrame([{**h, "geometry": 0.5 + 0.01 * h["layer"], "alpha": 0.5} if h["token_class"] == "sink" else h
                         for h in heads])
    part = [r for r in D._claim_rows(same, eps=0.3) if r["key"] == "sink_geometry_minus_null"][0]
    assert part["estimate"] == pytest.approx(0.0, abs=1e-12) and part["verdict"] != "holds"


def test_the_summary_reads_the_runs_sink_heads_not_a_fixed_rate():
    """sink_heads_*_share_of_heads_geometry_dominates took the heads with rate > 0.3 whatever eps the run used:
    with eps=0.15 every head of this model is a sink head and both rows were NaN."""
    model = tiny_model("llama", seed=2)
    ids = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(7))
    for eps in (0.15, 0.3):
        summary, _ = sinks.sink_decomposition(model, None, ids, eps=eps, progress=False)
        got = sinks.summarize({"decomposition": summary}).set_index("statistic")["value"]
        heads = summary[summary.scope == "head"]
        rate = heads.groupby(["layer", "head"])["sink_rate"].first()
        for cls in ("sink", "tail"):
            shares = heads[heads.token_class == cls].pivot_table(index=["layer", "head"], columns="factor",
                                                                  values="share")
            dominates = (shares["relative_norm"] + shares["cosine"]) > shares["alpha"]
            chosen = rate.reindex(dominates.index) > eps
            expected = dominates[chosen].mean() if chosen.any() else np.nan
            np.testing.assert_equal(got[f"sink_heads_{cls}_share_of_heads_geometry_dominates"], expected)
    assert (rate > 0.15).all() and not (rate > 0.3).all()  # the control: the two runs choose different heads
