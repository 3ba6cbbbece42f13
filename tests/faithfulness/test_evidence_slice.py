"""The committed evidence, recomputed: the first two documents of the exported per-document table
(data/results/evidence/per_document_smollm2-135m_gsm8k.csv.gz, written by
``book/cwbook/evidence_export.py export`` from the evidence profile's cached run) are run again
by the current code, without any cache, and every per-document row of the slice must match.

The slice (both main protocols, r = 0.05, both modes, both importance signs, rungs 2-4: eighteen
forwards of two 128-token blocks) is sized for about a minute on 2 CPU cores (48 s measured while
three other jobs shared the cores; the largest difference was 4.7e-8 nats); the export holds every
ratio and metric.
Tolerance: :data:`ATOL` nats on ``nll``, ``clean_nll`` and ``delta_nll`` (float32 model, float64
means), exact on the integer columns. Batches of 2 against the export's batches of 8 differed here
by at most 5e-8 nats, the CSV's 8 significant digits; the tolerance leaves room for another CPU's
float32 kernels while any change to the rankings, masks or scoring moves values by far more.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from cwbook import evidence_export as es

pytestmark = pytest.mark.slow

MODEL, DATA = "smollm2-135m", "gsm8k"
DOCUMENTS = 2
PROTOCOLS = ("default", "per-head")
RATIOS = (0.05,)
# rungs 2-4 (rung 3 shares rung 2's masks under the default protocol, so it costs no forward)
METRICS = ("value_weighted", "value_weighted_output_normalized", "contribution")
ATOL = 1e-4  # nats


@pytest.fixture(scope="module")
def committed():
    found = es.read_committed(MODEL, DATA)
    if found is None:
        csv, js = es.paths(MODEL, DATA)
        pytest.skip(f"the committed evidence export is absent ({csv} and {js.name}): write it with "
                    "`python -m cwbook.evidence_export export` (see data/results/README.md)")
    return found


@pytest.fixture(scope="module")
def loaded(committed):
    from cwcore.models import load_model

    return load_model(MODEL, dtype=committed[1]["dtype"], device="cpu")


@pytest.fixture(scope="module")
def recomputed(committed, loaded):
    _, meta = committed
    return es.per_document(meta["profile"], MODEL, DATA, DOCUMENTS, PROTOCOLS, meta["importances"], RATIOS,
                           METRICS, cache=False, loaded=loaded, variants=())  # the export's main cells


def test_the_export_states_its_provenance_and_is_consistent(committed):
    table, meta = committed
    assert len(meta["commit"]) == 40 and meta["cache"]["code_hash"]
    assert meta["rows"] == len(table) and meta["documents"] >= DOCUMENTS
    assert table.sort_values("sequence", kind="stable")["document"].drop_duplicates().tolist() == meta["document_ids"]
    # every cell whole: its documents x signs x its metrics (the random control's extra seeds where it ran
    # them) x modes x ratios
    n = sum(part["document"].nunique() * part["metric"].nunique()
            for _, part in table.groupby(["protocol", "variant"]))
    n *= len(meta["importances"]) * len(meta["modes"]) * len(meta["ratios"])
    assert len(table) == n and not table.duplicated(list(es.KEYS)).any()
    for name, cell in meta.get("cells", {}).items():  # cells merged while the build ran say what they hold
        protocol, _, variant = name.partition("/")
        part = table[(table["protocol"] == protocol) & (table["variant"] == (variant or "main"))]
        assert part["document"].nunique() == cell["documents"] and sorted(part["metric"].unique()) == cell["metrics"]
    assert set(PROTOCOLS) <= set(meta["protocols"]) and set(RATIOS) <= set(meta["ratios"])
    assert set(METRICS) <= set(meta["metrics"])
    assert np.allclose(table["delta_nll"], table["nll"] - table["clean_nll"], atol=1e-6, rtol=0)
    # one clean pass per document and cell; cells computed at different commits (merged while the build
    # ran) agree to float32 rounding of the clean pass (a summation order changed by the engine)
    assert (table.groupby(["protocol", "variant", "document"])["clean_nll"].nunique() == 1).all()
    spread = table.groupby("document")["clean_nll"].agg(lambda c: c.max() - c.min())
    assert spread.max() < 1e-5


def test_the_profile_still_runs_what_was_exported(committed, recomputed):
    _, meta = committed
    used = recomputed.attrs["parameters"]
    changed = {k: (meta[k], used[k]) for k in ("seed", "dtype", "seq_len") if meta[k] != used[k]}
    assert not changed, (f"book/run.yml's {meta['profile']} profile changed since the export {changed} "
                         "(exported, now): export the evidence again")
    assert recomputed.sort_values("sequence")["document"].drop_duplicates().tolist() == meta["document_ids"][:DOCUMENTS]


def test_first_two_documents_match_the_committed_rows(committed, recomputed):
    table, meta = committed
    expected = DOCUMENTS * len(PROTOCOLS) * len(meta["importances"]) * len(METRICS) * 2 * len(RATIOS)
    assert len(recomputed) == expected
    bad = es.compare(table, recomputed, atol=ATOL)
    assert bad.empty, f"{len(bad)} of {len(recomputed)} recomputed rows differ from the committed evidence:\n" \
                      f"{bad.to_string()}"
    merged = recomputed.merge(table, on=list(es.KEYS), suffixes=("", "_committed"))
    assert len(merged) == expected  # every recomputed row was compared
    worst = max(float((merged[c] - merged[f"{c}_committed"]).abs().max()) for c in es.FLOATS)
    print(f"evidence slice: {expected} rows, largest difference {worst:.2e} nats (tolerance {ATOL:g})")


def test_clean_nll_is_the_models_own_next_token_loss(committed, loaded):
    """Independent of the sweep: the plain forward's mean next-token cross-entropy on each committed block,
    in float64 (float32 ``cross_entropy`` over a ``[batch, vocab, token]`` view is off by ~1e-4 here)."""
    from cwcore import load_dataset
    from cwcore.data import document_blocks

    table, meta = committed
    lm, tokenizer = loaded
    blocks = document_blocks(load_dataset(DATA), tokenizer, meta["seq_len"], DOCUMENTS, seed=meta["seed"])
    ids = torch.tensor(blocks["input_ids"])
    with torch.inference_mode():
        logits = lm(input_ids=ids).logits.double()
    nll = -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    own = dict(zip(blocks["document"], nll.mean(-1).tolist()))
    clean = table.drop_duplicates("document").set_index("document")["clean_nll"]
    for document, value in own.items():
        assert clean[document] == pytest.approx(value, abs=ATOL)


def test_a_perturbed_committed_value_is_caught(committed, recomputed):
    """The comparison can fail: a committed nll moved by 1e-2, a delta_nll by 1e-2, a count by 1 and a
    dropped row are each reported, and only those rows."""
    table, _ = committed
    keys = list(es.KEYS)
    picked = recomputed[keys].iloc[[1, 3, 7, 11]].reset_index(drop=True)
    where = table.reset_index().merge(picked, on=keys)["index"].tolist()
    assert len(where) == 4
    moved = table.copy()
    moved.loc[where[0], "nll"] += 1e-2
    moved.loc[where[1], "delta_nll"] -= 1e-2
    moved.loc[where[2], "n_removed"] += 1
    moved = moved.drop(index=where[3])
    bad = es.compare(moved, recomputed, atol=ATOL)
    assert sorted(bad["problem"]) == ["delta_nll", "missing from committed", "n_removed", "nll"]
    found = bad[keys].sort_values(keys).reset_index(drop=True)
    pd.testing.assert_frame_equal(found, picked.sort_values(keys).reset_index(drop=True), check_dtype=False)
    assert es.compare(table, recomputed, atol=ATOL).empty  # the unperturbed table still matches
