"""The anatomy of a selection against independent computations: the attention output an intervened
forward actually produces, and naive loops over the removed terms."""

from __future__ import annotations

import json
import datasets
import numpy as np
import pandas as pd
import pytest
import torch

import cwcore
from cwcore.core.architectures import attention_blocks
from cwbook import anatomy
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


def test_the_anatomy_frame_is_the_layer_average_in_key_order_and_a_committed_one_is_taken_after_its_slice(
        sample, tmp_path, monkeypatch):
    """anatomy_cell: the layer averages of selection_anatomy per document (with its place), written once
    and taken back after 2 documents recompute equal; a tampered frame is recomputed."""
    from cwbook import evidence_frames as ef

    model, _, blocks = sample
    monkeypatch.setenv(ef.CELLS_ENV_VAR, str(tmp_path / "cells"))
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path / "cache"))  # the passed checks it remembers
    out = tmp_path / "evidence"
    kw = dict(model="tiny", data="toy", profile="evidence", batch_size=4, exports=out, log=None)
    ratios = list(RATIOS)
    first = ef.anatomy_cell(model, blocks, NON_RANDOM, ratios, **kw)
    naive = anatomy.layer_average(anatomy.selection_anatomy(model, blocks, NON_RANDOM, ratios,
                                                            ("comprehensiveness", "sufficiency"), batch_size=4,
                                                            progress=False))
    merged = first.merge(naive, on=["metric", "mode", "ratio", "document"], suffixes=("", "_naive"))
    assert len(merged) == len(first) == len(naive) == 6 * len(NON_RANDOM) * 2 * len(RATIOS)
    for measure in anatomy.MEASURES:
        np.testing.assert_array_equal(merged[measure], merged[f"{measure}_naive"])
    assert (first["sequence"] == first["document"] - 10).all()  # the documents' places in the sample
    rank = {m: i for i, m in enumerate(NON_RANDOM)}
    keys = first[["metric", "mode", "ratio", "sequence"]].assign(metric=first["metric"].map(rank))
    assert keys.equals(keys.sort_values(list(keys.columns)).reset_index(drop=True))  # the frame's key order
    assert ef.frame_paths(ef.ANATOMY, "tiny", "toy", out)[0].is_file()
    again = ef.anatomy_cell(model, blocks, NON_RANDOM, ratios, **kw)
    decision = json.loads((tmp_path / "cells" / "cell-anatomy-tiny-toy.json").read_text())
    assert decision["decision"] == "committed" and decision["max_abs_diff"] < ef.ATOL
    pd.testing.assert_frame_equal(again, first, check_exact=False, rtol=1e-7, atol=0)  # 8 digits
    # a frame whose numbers were changed is not taken
    table, meta = ef.read_frame(ef.ANATOMY, "tiny", "toy", out)
    ef.write_frame(ef.ANATOMY, table.assign(output_shift=table["output_shift"] * 1.01), meta, "tiny", "toy", out)
    ef.anatomy_cell(model, blocks, NON_RANDOM, ratios, **kw)
    decision = json.loads((tmp_path / "cells" / "cell-anatomy-tiny-toy.json").read_text())
    assert decision["decision"] == "recomputed" and "differ" in decision["reason"]


def test_the_explained_steps_pair_the_anatomy_with_the_exports_per_head_signed_rows(sample):
    """anatomy_explained: each step's damage gap is the per-document export's own delta_nll, per-head and
    signed only (another protocol's or sign's rows of the same documents do not enter)."""
    from cwbook import evidence_frames as ef

    model, _, blocks = sample
    frame = anatomy.layer_average(anatomy.selection_anatomy(model, blocks, list(anatomy.LADDER), [0.1],
                                                            ("comprehensiveness",), batch_size=4, progress=False))
    rng = np.random.default_rng(0)
    rows = []
    for protocol, importance in (("per-head", "signed"), ("default", "signed"), ("per-head", "absolute")):
        for metric in anatomy.LADDER:
            for document in blocks["document"]:
                nll = 3.0 + rng.normal()
                rows.append({"protocol": protocol, "variant": "main", "importance": importance,
                             "metric": metric + ("_intra" if protocol == "per-head" else ""),
                             "mode": "comprehensiveness", "ratio": 0.1, "document": document, "nll": nll,
                             "clean_nll": 2.5, "delta_nll": nll - 2.5})
    rows = pd.DataFrame(rows)
    explained = ef.anatomy_explained(frame, rows, n_bootstrap=100, seed=0)
    assert len(explained) == 3 and (explained["n_units"] == 6).all()
    own = rows[(rows["protocol"] == "per-head") & (rows["importance"] == "signed")]
    by = own.assign(metric=own["metric"].str.replace("_intra", "")).pivot_table(index="document", columns="metric",
                                                                                 values="delta_nll")
    step = explained[explained["higher"] == "value_weighted_output_normalized"].iloc[0]
    assert step["damage_gap"] == pytest.approx((by["value_weighted_output_normalized"] - by["value_weighted"]).mean())
    assert ef.anatomy_explained(frame, rows[rows["protocol"] == "default"], n_bootstrap=10, seed=0).empty

