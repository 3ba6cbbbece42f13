"""The anatomy of a selection against independent computations: the attention output an intervened
forward actually produces, and naive loops over the removed terms."""

from __future__ import annotations

import datasets
import numpy as np
import pandas as pd
import pytest
import torch

import cwcore
from cwcore.core.architectures import attention_blocks
from cwcore.faithfulness import anatomy
from cwcore.faithfulness.ranking import candidate_mask, removal_mask, selection
from faith_helpers import NON_RANDOM

RATIOS = (0.1, 0.3)


@pytest.fixture(scope="module")
def sample(peaked):
    model, ids = peaked
    blocks = datasets.Dataset.from_dict({"input_ids": ids[:6].tolist(), "attention_mask": torch.ones_like(ids[:6]).tolist(),
                                         "document": [10, 11, 12, 13, 14, 15]})
    return model, ids[:6], blocks


@pytest.fixture(scope="module")
def table(sample):
    model, _, blocks = sample
    return anatomy.selection_anatomy(model, blocks, NON_RANDOM, RATIOS, ("comprehensiveness", "sufficiency"),
                                     protocol="per-head", batch_size=4, progress=False)


def _mask(model, ids, layer, metric, mode, ratio, kind="intra"):
    d = cwcore.decompose(model, input_ids=ids)
    scores = d[layer].metric(metric, kind)
    cand = candidate_mask(torch.ones_like(ids))
    chosen = selection(scores, cand, RATIOS, (mode,))
    return d, removal_mask(chosen.buckets[mode], RATIOS.index(ratio)) & cand


def _attention_output(model, ids, layer, masks):
    """The input of layer ``layer``'s output projection's result: o_i (no bias in the tiny Llama)."""
    block = attention_blocks(model)[layer]
    seen = {}
    handle = block.output_module().register_forward_hook(lambda m, a, out: seen.setdefault("o", out.detach()))
    try:
        with torch.inference_mode(), cwcore.intervene(model, masks):
            model(input_ids=ids)
    finally:
        handle.remove()
    return seen["o"]


def test_columns_and_sizes(table, sample):
    model, ids, _ = sample
    layers = len(attention_blocks(model))
    assert len(table) == 6 * layers * len(NON_RANDOM) * 2 * len(RATIOS)
    assert set(table["document"]) == {10, 11, 12, 13, 14, 15}
    assert (table["protocol"] == "per-head").all() and (table["importance"] == "signed").all()
    assert table["removed_share"].between(0, 1).all()


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("metric", ["value_weighted", "value_weighted_output_normalized", "contribution"])
def test_output_shift_is_what_the_intervened_forward_changes(table, sample, layer, metric):
    """With only this layer intervened, everything upstream is clean, so the change of the attention output
    is exactly the removed terms' sum: ||o_clean - o_removed|| / ||o_clean||, averaged over the queries
    that have candidates (query 0 sees only the first token, which is kept)."""
    model, ids, _ = sample
    for mode in ("comprehensiveness", "sufficiency"):
        for ratio in RATIOS:
            _, mask = _mask(model, ids, layer, metric, mode, ratio)
            clean = _attention_output(model, ids, layer, {})
            removed = _attention_output(model, ids, layer, {layer: mask})
            per_query = (clean - removed).norm(dim=-1) / clean.norm(dim=-1)  # [b, q]
            expected = per_query[:, 1:].double().mean(-1).numpy()
            got = table[(table["layer"] == layer) & (table["metric"] == metric) & (table["mode"] == mode)
                        & (table["ratio"] == ratio)].sort_values("sequence")["output_shift"].to_numpy()
            np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)


def test_shares_norms_and_sink_by_naive_loops(table, sample):
    model, ids, _ = sample
    layer, metric, mode, ratio = 1, "value_weighted_output_normalized", "comprehensiveness", 0.3
    d, mask = _mask(model, ids, layer, metric, mode, ratio)
    ld = d[layer]
    alpha, vnorm, hnorm = ld.attention.double(), ld.value_norm.double(), ld.head_output_norm.double()
    b, h, q, k = alpha.shape
    rows = table[(table["layer"] == layer) & (table["metric"] == metric) & (table["mode"] == mode)
                 & (table["ratio"] == ratio)].sort_values("sequence")
    for s in range(b):
        taken = total = 0.0
        norms, sinks, n = [], [], 0
        for hh in range(h):
            for i in range(q):
                for j in range(1, i + 1):  # candidates: causal, first token kept
                    mass = float(alpha[s, hh, i, j] * vnorm[s, hh, j])
                    total += mass
                    if mask[s, hh, i, j]:
                        taken += mass
                        n += 1
                        norms.append(float(hnorm[s, hh, i] / hnorm[s, :, i].mean()))
                        sinks.append(float(alpha[s, hh, i, 0]))
        row = rows.iloc[s]
        assert row["n_removed"] == n
        assert row["removed_share"] == pytest.approx(taken / total, rel=1e-5)
        assert row["head_norm"] == pytest.approx(np.mean(norms), rel=1e-5)
        assert row["first_token_attention"] == pytest.approx(np.mean(sinks), rel=1e-5)


def test_nested_ratios_take_more(table):
    wide = table.pivot_table(index=["document", "layer", "metric", "mode"], columns="ratio", values="removed_share")
    assert (wide[RATIOS[1]] >= wide[RATIOS[0]] - 1e-7).all()


def test_explain_step_pairs_documents():
    """rho and the gaps against scipy and numpy on a made-up table where damage follows the shift."""
    rng = np.random.default_rng(0)
    docs = np.arange(12)
    shift = {"a": rng.normal(0.5, 0.1, 12), "b": rng.normal(0.4, 0.1, 12)}
    anat = pd.DataFrame([{"document": d, "metric": m, "mode": "comprehensiveness", "ratio": 0.05, "layer": 0,
                          "output_shift": shift[m][d], "removed_share": 0.0, "head_norm": 1.0,
                          "first_token_attention": 0.0} for m in shift for d in docs])
    curves = pd.DataFrame([{"document": d, "metric": m + "_intra", "mode": "comprehensiveness", "ratio": 0.05,
                            "nll": 2 + 3 * shift[m][d] + 0.01 * rng.normal(), "clean_nll": 2.0}
                           for m in shift for d in docs])
    out = anatomy.explain_step(anat, curves, "a", "b", n_bootstrap=200)
    assert len(out) == 1
    row = out.iloc[0]
    gap = shift["b"] - shift["a"]
    assert row["measure_gap"] == pytest.approx(gap.mean())
    damage = curves.pivot_table(index="document", columns="metric", values="nll")
    from scipy import stats as sps
    assert row["rho"] == pytest.approx(sps.spearmanr(gap, damage["b_intra"] - damage["a_intra"]).statistic)
    assert row["rho"] > 0.9 and row["rho_verdict"] == "holds" and row["n_units"] == 12


def test_bad_input_is_refused(sample):
    model, _, blocks = sample
    with pytest.raises(ValueError, match="protocol"):
        anatomy.selection_anatomy(model, blocks, protocol="nope", progress=False)
    with pytest.raises(ValueError, match="ascending"):
        anatomy.selection_anatomy(model, blocks, ratios=(0.3, 0.1), progress=False)


@pytest.mark.slow
def test_evidence_files_on_the_committed_export(tmp_path):
    """The command line's files on the first documents of the committed smollm2 GSM8K export: the damage
    gaps are the export's own per-document rows, the anatomy rows are the documents of the sample."""
    from cwcore.book import evidence_export as es

    csv, _ = es.paths("smollm2-135m", "gsm8k")
    if not csv.is_file():
        pytest.skip(f"{csv} is absent")
    rows = pd.read_csv(csv)
    if not (rows["protocol"] == "per-head").any():
        pytest.skip("the committed export has no per-head rows")
    written = anatomy.evidence_files("smollm2-135m", "gsm8k", 5, csv, tmp_path, ratios=[0.01],
                                     modes=["comprehensiveness"], n_bootstrap=200)
    table, explained = pd.read_csv(written[0]), pd.read_csv(written[1])
    first = rows.drop_duplicates("document").sort_values("sequence")["document"].tolist()[:5]
    assert sorted(table["document"].unique()) == sorted(first)
    assert len(explained) == 3 and (explained["n_units"] == 5).all()
    ph = rows[(rows["protocol"] == "per-head") & (rows["importance"] == "signed") & (rows["mode"] == "comprehensiveness")
              & np.isclose(rows["ratio"], 0.01) & rows["document"].isin(first)]
    by = ph.assign(metric=ph["metric"].str.replace("_intra", "")).pivot_table(index="document", columns="metric",
                                                                               values="delta_nll")
    step = explained[explained["higher"] == "value_weighted_output_normalized"].iloc[0]
    expected = (by["value_weighted_output_normalized"] - by["value_weighted"]).mean()
    assert step["damage_gap"] == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="not in"):
        anatomy.evidence_files("smollm2-135m", "gsm8k", 5, _only(rows, first[:2], tmp_path), tmp_path / "x",
                               ratios=[0.01], modes=["comprehensiveness"], n_bootstrap=50)


def _only(rows, documents, folder):
    path = folder / "subset.csv"
    rows[rows["document"].isin(documents)].to_csv(path, index=False)
    return path
