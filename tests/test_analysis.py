"""cwbook.analysis against naive computations: scipy's rank correlations row by row, and per-sequence
statistics recomputed with Python loops over the decomposition of tiny models (padding included)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import kendalltau, rankdata, spearmanr

import cwcore
from cwbook import analysis
from cwcore.cache import caching
from tiny_models import VOCAB, tiny_model


# --------------------------------------------------------------------------------------------------
# Rank correlations per row
# --------------------------------------------------------------------------------------------------
def rows_with_ties(seed=0, rows=60, keys=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, keys, generator=g, dtype=torch.float64)
    y = x + 0.4 * torch.rand(rows, keys, generator=g, dtype=torch.float64) - 0.2
    x[::3, :4] = 0.5  # ties in x
    y[1::4, 3:7] = -0.1  # ties in y
    visible = torch.rand(rows, keys, generator=g) > 0.3
    visible[0] = True
    visible[1, 2:] = False  # two keys: below min_keys=3
    y[2, 5] = float("nan")  # an undefined weight
    visible[2, 5] = True
    x[4] = 0.7  # constant row
    return x, y, visible


def test_ranks_and_rank_correlations_match_scipy():
    x, y, visible = rows_with_ties()
    ranks = analysis.average_ranks(x, visible)
    rho = analysis.spearman_rows(x, y, visible)
    tau = analysis.kendall_rows(x, y, visible, chunk_elements=300)  # several chunks
    checked = 0
    for i in range(x.shape[0]):
        m = visible[i].numpy()
        xi, yi = x[i].numpy()[m], y[i].numpy()[m]
        np.testing.assert_allclose(ranks[i].numpy()[m], rankdata(xi) - 1)
        assert ranks[i][~visible[i]].isnan().all()
        if m.sum() < 3 or not np.isfinite(yi).all() or np.ptp(xi) == 0:
            assert rho[i].isnan() and tau[i].isnan(), i
            continue
        assert rho[i].item() == pytest.approx(spearmanr(xi, yi).statistic, abs=1e-12)
        assert tau[i].item() == pytest.approx(kendalltau(xi, yi).statistic, abs=1e-12)
        checked += 1
    assert checked > 40
    assert rho[1].isnan() and rho[2].isnan() and rho[4].isnan()


def test_rank_correlations_broadcast_a_causal_mask_over_leading_axes():
    g = torch.Generator().manual_seed(1)
    x = torch.rand(2, 3, 8, 8, generator=g)
    y = torch.rand(2, 3, 8, 8, generator=g)
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    rho = analysis.spearman_rows(x, y, causal)
    tau = analysis.kendall_rows(x, y, causal)
    assert rho.shape == tau.shape == (2, 3, 8)
    assert rho[..., :2].isnan().all()  # queries 0 and 1 see fewer than 3 keys
    assert rho[1, 2, 7].item() == pytest.approx(spearmanr(x[1, 2, 7], y[1, 2, 7]).statistic, abs=1e-6)
    assert tau[0, 1, 5].item() == pytest.approx(kendalltau(x[0, 1, 5, :6], y[0, 1, 5, :6]).statistic, abs=1e-6)


# --------------------------------------------------------------------------------------------------
# Per-layer statistics against loops
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def padded_decomposition():
    """A tiny Llama on three right-padded sequences (lengths 10, 7, 10)."""
    model = tiny_model("llama", seed=3)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = 0
    ids[1, 7:] = 0
    return cwcore.decompose(model, input_ids=ids, attention_mask=mask), ids, mask


def naive_statistics(layer, lengths, group_keys, min_keys=2, rank_min_keys=5):
    """The documented definitions, one sequence, head, query and key at a time."""
    alpha, intra, inter = layer.attention.double(), layer.intra.double(), layer.inter.double()
    out = {}
    heads = alpha.shape[1]
    for b, n in enumerate(lengths):
        queries = [i for i in range(n) if i + 1 >= min_keys]  # causal: query i sees i + 1 keys
        token_alpha = alpha[b].mean(0)
        token_c = inter[b].sum(0)
        rows = {"intra": [(alpha[b, h, i, : i + 1], intra[b, h, i, : i + 1]) for h in range(heads) for i in queries],
                "inter": [(alpha[b, h, i, : i + 1], inter[b, h, i, : i + 1]) for h in range(heads) for i in queries],
                "token": [(token_alpha[i, : i + 1], token_c[i, : i + 1]) for i in queries]}
        for view, pairs in rows.items():
            weights = torch.cat([c for _, c in pairs])
            out[(b, "negative_share", view, "")] = (weights < 0).double().mean().item()
            out[(b, "negative_mass", view, "")] = np.mean([-c.clamp(max=0).sum().item() for _, c in pairs])
            rhos = [spearmanr(a.numpy(), c.numpy()).statistic for a, c in pairs if len(a) >= rank_min_keys]
            out[(b, "spearman", view, "")] = np.mean(rhos)
            taus = [kendalltau(a.numpy(), c.numpy()).statistic for a, c in pairs if len(a) >= rank_min_keys]
            out[(b, "kendall", view, "")] = np.mean(taus)
        for group, keys in group_keys[b].items():
            for view, pairs in (("attention", [(a, a) for a, _ in rows["intra"]]), ("intra", rows["intra"]),
                                ("token", rows["token"])):
                out[(b, "mass", view, group)] = np.mean([c[[k for k in keys if k < len(c)]].sum().item()
                                                         for _, c in pairs])
    return out


def test_layer_statistics_match_loops_with_padding(padded_decomposition):
    d, ids, mask = padded_decomposition
    lengths = mask.sum(1).tolist()
    groups = analysis.first_token_group(3, 10)
    groups.update(analysis.token_groups(ids, {"vocab 3-20": range(3, 21)}))
    group_keys = [{"first": [0], "vocab 3-20": [k for k in range(n) if 3 <= ids[b, k] <= 20]}
                  for b, n in enumerate(lengths)]
    for layer in d.values():
        table = analysis.layer_statistics(layer, groups, kendall_views=analysis.VIEWS, sequence_offset=10)
        assert set(table["sequence"]) == {10, 11, 12} and set(table["layer"]) == {layer.layer}
        expected = naive_statistics(layer, lengths, group_keys)
        got = {(r.sequence - 10, r.statistic, r.view, r.group): r.value for r in table.itertuples()}
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_layer_statistics_of_an_encoder_see_every_key():
    model = tiny_model("bert", seed=1)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    layer = cwcore.decompose(model, input_ids=ids)[1]
    assert analysis.visible_keys(layer.attention).all()
    table = analysis.layer_statistics(layer, analysis.first_token_group(2, 6), rank_min_keys=5)
    rows = table.set_index(["sequence", "statistic", "view", "group"])["value"]
    # every query counts, including query 0: the token-level contribution of key 0, averaged
    expected = layer.inter.sum(1)[0, :, 0].mean().item()
    assert rows[(0, "mass", "token", "first")] == pytest.approx(expected, rel=1e-6)
    rho = np.mean([spearmanr(layer.attention.mean(1)[1, i], layer.inter.sum(1)[1, i]).statistic for i in range(6)])
    assert rows[(1, "spearman", "token", "")] == pytest.approx(rho, rel=1e-5)


def test_undefined_weights_are_left_out():
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[:, :16] = 0  # head 0 projects to nothing
    layer = cwcore.decompose(model, input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]))[0]
    assert layer.intra[0, 0].isnan().all()
    table = analysis.layer_statistics(layer, analysis.first_token_group(1, 6)).set_index(
        ["statistic", "view", "group"])["value"]
    intra = layer.intra[0, 1:, 1:, :]  # heads 1..3, queries 1..5
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[1:]
    values = intra[causal.expand_as(intra)]
    assert table[("negative_share", "intra", "")] == pytest.approx((values < 0).double().mean().item())
    assert table[("mass", "intra", "first")] == pytest.approx(intra[..., 0].mean().item(), rel=1e-6)
    assert np.isfinite(table.to_numpy()).all()


def test_factor_sample_is_stratified_and_exact(padded_decomposition):
    d, ids, mask = padded_decomposition
    layer = d[1]
    groups = analysis.first_token_group(3, 10)
    sample = analysis.factor_sample(layer, groups, kind="intra", per_group=40, seed=4, sequence_offset=5)
    again = analysis.factor_sample(layer, groups, kind="intra", per_group=40, seed=4, sequence_offset=5)
    pd.testing.assert_frame_equal(sample, again)
    counts = sample.groupby(["sequence", "group"]).size()
    assert counts[(5, "first")] == 9 * 4  # queries 1..9 of 4 heads see key 0: all drawn (fewer than 40)
    assert counts[(6, "first")] == 6 * 4  # the padded sequence has 7 real tokens
    assert (counts.xs("other", level="group") == 40).all()
    assert (sample.loc[sample.group == "first", "key"] == 0).all() and (sample.loc[sample.group == "other", "key"] > 0).all()
    assert (sample["key"] <= sample["query"]).all() and (sample["query"] >= 1).all()
    assert not ((sample.sequence == 6) & (sample["query"] >= 7)).any()
    b = sample["sequence"].to_numpy() - 5
    idx = (b, sample["head"].to_numpy(), sample["query"].to_numpy(), sample["key"].to_numpy())
    np.testing.assert_allclose(sample["attention"], layer.attention.numpy()[idx])
    np.testing.assert_allclose(sample["relative_norm"], layer.relative_norm("intra").numpy()[idx], rtol=1e-6)
    np.testing.assert_allclose(sample["cosine"], layer.cosine("intra").numpy()[idx], rtol=1e-5, atol=1e-6)
    product = sample["attention"] * sample["relative_norm"] * sample["cosine"]
    np.testing.assert_allclose(product, sample["contribution"], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Error bars
# --------------------------------------------------------------------------------------------------
def test_bootstrap_ci_is_the_stats_one_and_summarize_keeps_its_columns():
    from cwcore import stats as S

    assert analysis.bootstrap_ci is S.bootstrap_ci  # one bootstrap in the project, old name kept
    values = np.array([0.1, 0.5, 0.2, 0.9, 0.4, np.nan])
    mean, low, high = analysis.bootstrap_ci(values, n_resamples=2000, seed=1)
    assert mean == pytest.approx(np.nanmean(values)) and low < mean < high
    one = analysis.bootstrap_ci([0.3])  # the stats contract: one value, no interval
    assert one[0] == pytest.approx(0.3) and np.isnan(one[1]) and np.isnan(one[2])
    assert all(np.isnan(analysis.bootstrap_ci([np.nan])))

    stats = pd.DataFrame({"sequence": [0, 1, 2, 0, 1, 2, 0], "layer": [0, 0, 0, 1, 1, 1, 2],
                          "statistic": "spearman", "view": "token", "group": "",
                          "value": [0.1, 0.2, 0.6, 0.5, 0.5, 0.5, 0.7]})
    summary = analysis.summarize(stats, n_bootstrap=500)
    assert list(summary.columns) == ["layer", "statistic", "view", "group", "mean", "low", "high", "n"]
    assert summary["mean"].tolist() == pytest.approx([0.3, 0.5, 0.7]) and summary["n"].tolist() == [3, 3, 1]
    expected = S.bootstrap_ci([0.1, 0.2, 0.6], n_resamples=500, seed=0)
    assert (summary.loc[0, "low"], summary.loc[0, "high"]) == pytest.approx((expected.low, expected.high))
    assert summary.loc[1, "low"] == pytest.approx(0.5) and summary.loc[1, "high"] == pytest.approx(0.5)
    assert np.isnan(summary.loc[2, "low"]) and np.isnan(summary.loc[2, "high"])  # one sequence: no interval


def test_collect_numbers_sequences_across_batches_and_reads_the_cache(tmp_path, monkeypatch):
    model = tiny_model("llama", seed=2)
    ids = torch.randint(3, VOCAB, (3, 8), generator=torch.Generator().manual_seed(9))
    batches = [{"input_ids": ids[:2], "attention_mask": torch.ones(2, 8, dtype=torch.long)},
               {"input_ids": ids[2:], "attention_mask": torch.ones(1, 8, dtype=torch.long)}]
    seen = []
    with caching(tmp_path):
        stats, factors = analysis.collect(model, batches, factor_samples=10, progress=seen.append)
    assert seen == [2, 3]
    assert sorted(stats["sequence"].unique()) == [0, 1, 2] and sorted(factors["sequence"].unique()) == [0, 1, 2]
    # the numbers of the last sequence are those of a direct decomposition of it alone
    layer = cwcore.decompose(model, input_ids=ids[2:])[1]
    direct = analysis.layer_statistics(layer, analysis.first_token_group(1, 8), sequence_offset=2)
    mine = stats[stats.layer == 1].reset_index(drop=True)
    pd.testing.assert_frame_equal(mine[mine.sequence == 2].reset_index(drop=True), direct, rtol=1e-5)

    # a second run reads every batch back from the cache: the model is not run again
    def boom(*args, **kwargs):
        raise AssertionError("decompose called although the results are cached")

    monkeypatch.setattr(analysis, "decompose", boom)
    with caching(tmp_path):
        again = analysis.collect(model, batches, factor_samples=10)
    pd.testing.assert_frame_equal(again[0], stats)
    pd.testing.assert_frame_equal(again[1], factors)
    with pytest.raises(AssertionError, match="cached"), caching(tmp_path):  # other options, other cache entries
        analysis.collect(model, batches, factor_samples=11)
    with pytest.raises(AssertionError, match="cached"):  # outside caching(): nothing is read
        analysis.collect(model, batches, factor_samples=10)

    def odd(batch):  # chapter 8 passes its own groups: they were left out of the key, the default's served
        return {"odd": torch.zeros_like(batch["input_ids"], dtype=torch.bool)}

    with pytest.raises(AssertionError, match="cached"), caching(tmp_path):
        analysis.collect(model, batches, factor_samples=10, key_groups=odd)


def test_the_factor_sample_is_the_same_whatever_the_batches():
    """The sample was seeded by a sequence's index in its batch: at batch_size=1 every sequence drew the same
    (head, query, key) positions, and chapters 3 and 8's quoted medians moved with batch_size (1.80, 2.01, 2.06)."""
    model = tiny_model("llama", seed=2)
    ids = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(9))
    ones = torch.ones_like(ids)

    def factors(size):
        batches = [{"input_ids": ids[start:start + size], "attention_mask": ones[start:start + size]}
                   for start in range(0, 4, size)]
        sample = analysis.collect(model, batches, factor_samples=6)[1]
        return sample.sort_values(["sequence", "layer", "group", "head", "query", "key"]).reset_index(drop=True)

    one, two, four = factors(1), factors(2), factors(4)
    pd.testing.assert_frame_equal(one, four)
    pd.testing.assert_frame_equal(two, four)
    drawn = [tuple(map(tuple, f[["head", "query", "key"]].to_numpy())) for _, f in one.groupby("sequence")]
    assert len(set(drawn)) == 4  # each sequence draws its own positions


def test_collect_keys_cover_this_modules_code_not_its_docstrings(tmp_path, monkeypatch):
    # the module lives in the book, outside the library's code keys: its own normalised code is in the key
    from pathlib import Path

    source = Path(analysis.__file__).read_text()
    assert analysis.code_key() == analysis.code_key(source)
    assert analysis.code_key(source.replace('"""Per-layer', '"""An edited docstring. Per-layer', 1)) == analysis.code_key()
    assert analysis.code_key(source + "\n_AN_EDIT = 1\n") != analysis.code_key()

    model = tiny_model("llama", seed=2)
    batches = [{"input_ids": torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))}]
    with caching(tmp_path):
        first = analysis.collect(model, batches, factor_samples=4)
    monkeypatch.setattr(analysis, "code_key", lambda source=None: "edited")
    calls = []
    monkeypatch.setattr(analysis, "decompose", lambda *a, **k: calls.append(1) or cwcore.decompose(*a, **k))
    with caching(tmp_path):
        again = analysis.collect(model, batches, factor_samples=4)
    assert calls == [1]  # another code key: computed again, the same numbers
    pd.testing.assert_frame_equal(again[0], first[0])
