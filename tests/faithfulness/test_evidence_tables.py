"""Chapter 4's evidence tables from the per-document exports (``evidence_slice tables``).

The ladder's point estimates are checked against a naive AOPC (numpy's trapezoid over each
document's curve, origin included, divided by r_max; the mean over documents of higher minus lower
rung) on a slice of the committed smollm2 GSM8K export (8 documents, both protocols, every ratio);
the verdicts against their intervals; ``findings.csv`` against the ladder it was made from; and the
committed ``04_faithfulness`` tables against a recomputation from the committed exports; and the
downstream tasks' steps, added from their committed frame, against a naive AOPC over examples (never in
the primary family). Tolerance: 1e-9 nats on the means (float64 over the CSV's 8-digit values).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from cwbook import findings
from cwbook import results_path
from cwbook import evidence_export as es
from cwbook import evidence_frames as ef
from cwbook.evidence_files import HASH_FIELD, content_hash
from cwbook import ladder as evidence
from faith_helpers import forest_points, peaked_llama, word_tokenizer

MODEL, DATA, DOCUMENTS = "smollm2-135m", "gsm8k", 8

# the committed evidence recomputed into tables: minutes of the quick tier's time, so in `make test` only
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    """A folder holding the first 8 documents of the committed export, as an export of 8 documents."""
    found = es.read_committed(MODEL, DATA)
    if found is None:
        pytest.skip("the committed export per_document_smollm2-135m_gsm8k is absent")
    rows, meta = found
    keep = meta["document_ids"][:DOCUMENTS]
    rows = rows[rows["document"].isin(keep)]
    out = tmp_path_factory.mktemp("evidence")
    csv, js = es.paths(MODEL, DATA, out)
    rows.to_csv(csv, index=False, compression="gzip")
    cells = {name: {**cell, "documents": DOCUMENTS} for name, cell in meta.get("cells", {}).items()}
    js.write_text(json.dumps({**meta, "documents": DOCUMENTS, "document_ids": keep, "rows": len(rows),
                              "cells": cells, HASH_FIELD: content_hash(csv.read_bytes())}))
    written = es.tables(out, all_models=[MODEL])
    return out, rows, written


def naive_aopc(rows: pd.DataFrame, max_ratio: float | None, unit: str = "document") -> pd.Series:
    """AOPC per document (or per ``unit``): trapezoid of (0, 0) + the measured (ratio, nll - clean_nll)
    points, over r_max (the tables recompute the delta from the two NLLs, as the notebook has them, not
    from the rounded ``delta_nll`` column)."""
    if max_ratio is not None:
        rows = rows[rows["ratio"] <= max_ratio + 1e-12]
    out = {}
    for doc, g in rows.groupby(unit):
        g = g.sort_values("ratio")
        r = np.concatenate([[0.0], g["ratio"].to_numpy(float)])
        d = np.concatenate([[0.0], (g["nll"] - g["clean_nll"]).to_numpy(float)])
        out[doc] = np.sum((r[1:] - r[:-1]) * (d[1:] + d[:-1]) / 2) / r[-1]
    return pd.Series(out)


def test_tables_write_the_books_layout(sliced):
    out, _, written = sliced
    path = results_path(out, "04_faithfulness", MODEL)
    assert written == [path, path.with_suffix(".json"), out / "findings.csv", out / "findings.json"]
    got = findings.load_results(out, "04_faithfulness", MODEL)
    assert got.metadata["profile"] == "evidence" and got.metadata["chapter"] == "04_faithfulness"
    params = got.metadata["parameters"]
    meta = json.loads(es.paths(MODEL, DATA, out)[1].read_text())  # the main protocols, then the variant cells
    assert meta["protocols"] == ["default", "per-head"]
    assert params["cells"] == [f"{DATA} x {p} ({DOCUMENTS} documents)" for p in meta["protocols"]] + [
        f"{DATA} x default, {v} ({DOCUMENTS} documents)" for v in meta.get("variants", [])]
    assert params["n_bootstrap"] == es.notebook_parameters("evidence", MODEL)["n_bootstrap"]
    assert set(got.table["range"]) == {"low", "full"} and set(got.table["protocol"]) == {"default", "per-head"}


def test_ladder_estimates_are_the_naive_paired_aopc_difference(sliced):
    out, rows, _ = sliced
    ladder = findings.load_results(out, "04_faithfulness", MODEL).table
    checked = 0
    for _, step in ladder.iterrows():
        max_ratio = evidence.LOW_MAX if step["range"] == "low" else None
        part = rows[(rows["protocol"] == step["protocol"]) & (rows["importance"] == step["importance"])
                    & (rows["mode"] == step["mode"]) & (rows["variant"] == step.get("variant", "main"))]
        hi = naive_aopc(part[part["metric"] == step["higher"]], max_ratio)
        if step["lower"] == "random":  # the random rung: the mean over the random control's seeds
            seeds = [m for m in part["metric"].unique() if m == "random" or m.startswith(evidence.RANDOM_PREFIX)]
            lo = sum(naive_aopc(part[part["metric"] == m], max_ratio) for m in seeds) / len(seeds)
        else:
            lo = naive_aopc(part[part["metric"] == step["lower"]], max_ratio)
        diff = (hi - lo).dropna()
        assert len(diff) == step["n"] == DOCUMENTS
        assert step["difference"] == pytest.approx(diff.mean(), abs=1e-9)
        assert step["ci_low"] <= step["difference"] + 1e-12 and step["difference"] <= step["ci_high"] + 1e-12
        checked += 1
    # 2 protocols x 2 signs x 2 modes x 2 ranges, several pairs each
    assert checked >= 16 * 4


def test_verdicts_follow_the_interval_and_the_mode(sliced):
    out, _, _ = sliced
    ladder = findings.load_results(out, "04_faithfulness", MODEL).table
    seen = set()
    for _, step in ladder.iterrows():
        above, below = step["ci_low"] > 0, step["ci_high"] < 0
        claimed, other = (above, below) if step["mode"] == "comprehensiveness" else (below, above)
        margin = evidence.MARGINS[step["mode"]]
        assert step["margin"] == margin
        inside = -margin < step["ci_low"] and step["ci_high"] < margin
        by_construction = (step["protocol"] == "default" and step["lower"] == "value_weighted"
                           and step["higher"] == "value_weighted_output_normalized")
        expected = ("not measured" if by_construction else "negligible" if inside else "holds" if claimed
                    else "contradicted" if other else "inconclusive")
        assert step["verdict"] == expected, step.to_dict()
        seen.add(expected)
    assert {"not measured", "negligible", "holds", "contradicted"} <= seen  # the rule's branches are exercised


def test_findings_csv_rows_are_the_ladders_steps(sliced):
    out, _, _ = sliced
    table = pd.read_csv(out / "findings.csv")
    assert list(table.columns) == findings.FAITHFULNESS_COLUMNS
    ladder = findings.load_results(out, "04_faithfulness", MODEL).table
    step = ladder[(ladder["lower"] == "attention") & (ladder["higher"] == "value_weighted")
                  & (ladder["protocol"] == "per-head") & (ladder["importance"] == "signed")
                  & (ladder["range"] == "low") & (ladder["mode"] == "comprehensiveness")].iloc[0]
    row = table[(table["claim"] == "step 1->2") & (table["protocol"] == "per-head") & (table["importance"] == "signed")
                & (table["range"] == "low") & (table["mode"] == "comprehensiveness")].iloc[0]
    assert row["estimate"] == pytest.approx(step["difference"], rel=1e-12)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx((step["ci_low"], step["ci_high"]), rel=1e-12)
    assert row["n_units"] == DOCUMENTS and row["unit"] == "document" and row["profile"] == "evidence"
    assert row["verdict"] == step["verdict"] and row["margin"] == step["margin"] and row["p"] == step["p"]
    # every step row of findings.csv takes the ladder's verdict (one table derives from the other),
    # except the pre-registered primary rows, decided with Holm's adjustment over the family
    steps = {"step 1->2": ("attention", "value_weighted"),
             "step 2->3": ("value_weighted", "value_weighted_output_normalized"),
             "step 3->4": ("value_weighted_output_normalized", "contribution"),
             "contribution beats random": ("random", "contribution")}
    keys = ["protocol", "importance", "range", "mode", "variant"]
    ladder = ladder.assign(variant=ladder["variant"].fillna("main")) if "variant" in ladder else ladder.assign(variant="main")
    merged = table[table["claim"].isin(steps) & ~table["primary"]].assign(
        lower=lambda t: t["claim"].map(lambda c: steps[c][0]), higher=lambda t: t["claim"].map(lambda c: steps[c][1]))
    merged = merged.merge(ladder, on=[*keys, "lower", "higher"], suffixes=("", "_ladder"))
    assert len(merged) == (table["claim"].isin(steps) & ~table["primary"]).sum() > 0
    assert (merged["verdict"] == merged["verdict_ladder"]).all()
    primary = table[table["primary"]]
    assert len(primary) == 4 * 2 and primary["p_holm"].notna().all() and table.loc[~table["primary"], "p_holm"].isna().all()
    # every (data, protocol, sign, range, mode) group has its three steps, random, ordering and cosine
    # gain, plus the chain of the pre-registered steps per mode
    variants = table["variant"].nunique()  # main, and each variant cell of the export (default protocol only)
    # and one "not measured" row per claim of the sink chapters, which this export did not build
    unbuilt = table["measured"].astype(str).str.contains("was not built")
    assert set(table.loc[unbuilt, "verdict"]) == {"not measured"}
    assert len(table) - unbuilt.sum() == 2 * 2 * 2 * 2 * 6 + 2 + (variants - 1) * 2 * 2 * 2 * 6


def test_tables_add_the_committed_downstream_steps_to_findings_never_primary(sliced, tmp_path, monkeypatch):
    out, _, _ = sliced
    for path in es.paths(MODEL, DATA, out):
        shutil.copy(path, tmp_path)
    # a downstream frame committed under the model's name (computed by a tiny model: the tables only read it)
    monkeypatch.delenv(ef.CELLS_ENV_VAR, raising=False)
    tasks, examples = ["mmlu", "boolq"], 5
    per_example = ef.downstream_cell(peaked_llama(), word_tokenizer(), tasks,
                                     ["attention", "value_weighted", "contribution", "random"], [0.1, 0.3],
                                     model=MODEL, profile="evidence", exports=tmp_path, num_examples=examples,
                                     max_length=40, batch_size=8, seed=0, progress=False, cache=False, log=None)
    es.tables(tmp_path, all_models=[MODEL])
    got = findings.load_results(tmp_path, "04_faithfulness", MODEL)
    params = got.metadata["parameters"]
    assert params["cells"][-2:] == [f"downstream {t} ({examples} examples)" for t in tasks]
    assert "downstream" not in params["not_included"] and "per-layer interventions" in params["not_included"]
    assert params["tasks"] == "mmlu,boolq" and params["n_examples"] == examples and params["task_ratios"] == [0.1, 0.3]
    table = pd.read_csv(tmp_path / "findings.csv")
    down = table[table["data"].isin(tasks)]
    # every (task, mode) has the ladder's claims: three steps, random, ordering and cosine gain
    assert len(down) == len(tasks) * 2 * 6 and set(down["variant"]) == {"main"}
    measured = down[down["n_units"].notna()]  # rungs 2->3 and 3->4: "pair not in the table" (rung 3 was not run)
    assert len(measured) == len(tasks) * 2 * 4 and (measured["n_units"] == examples).all()
    assert set(measured["unit"]) == {"example"}
    assert set(down["protocol"]) == {"default"} and set(down["importance"]) == {"signed"} and set(down["range"]) == {"full"}
    assert not down["primary"].any() and down["p_holm"].isna().all()  # never in the pre-registered family
    # the estimates are the naive paired AOPC differences over examples
    steps = {"step 1->2": ("attention", "value_weighted"), "contribution beats random": ("random", "contribution")}
    for (task, mode, claim), row in down[down["claim"].isin(steps)].set_index(["data", "mode", "claim"]).iterrows():
        part = per_example[(per_example["task"] == task) & (per_example["mode"] == mode)]
        lower, higher = steps[claim]
        diff = naive_aopc(part[part["metric"] == higher], None, "example") - naive_aopc(
            part[part["metric"] == lower], None, "example")
        assert row["estimate"] == pytest.approx(diff.mean(), abs=1e-7)  # the frame's 8 significant digits
        assert row["ci_low"] <= row["estimate"] <= row["ci_high"]
    assert (down.loc[down["claim"].isin(["step 2->3", "step 3->4"]), "verdict"] == "not measured").all()
    # the primary family and its Holm decision are those of the table without the downstream rows
    before = pd.read_csv(out / "findings.csv")
    pd.testing.assert_frame_equal(table[table["primary"]].reset_index(drop=True),  # n_units: float beside NaNs
                                  before[before["primary"]].reset_index(drop=True), check_dtype=False)


def test_the_committed_tables_are_those_of_the_committed_exports(tmp_path):
    committed = es.DEFAULT_OUT
    def from_exports(model):  # written by `evidence_slice tables` (the full build's notebook adds downstream rows)
        got = findings.load_results(committed, "04_faithfulness", model)
        return got is not None and got.metadata["parameters"].get("source", "").startswith("per-document exports")

    models = [m for m in ("smollm2-135m", "gemma3-270m") if from_exports(m)]
    if not models:
        pytest.skip("no chapter 4 evidence table made from the exports is committed")
    for js in committed.glob("per_document_*.json"):
        shutil.copy(js, tmp_path / js.name)
        shutil.copy(js.with_name(js.name.replace(".json", ".csv.gz")), tmp_path)
    for frame in committed.glob("downstream_*"):  # the downstream tasks' committed frames, where there are any
        shutil.copy(frame, tmp_path)
    for anatomy_frame in committed.glob("anatomy_*"):  # the anatomy frames (.csv.gz and .json)
        shutil.copy(anatomy_frame, tmp_path)
    es.tables(tmp_path, models)
    held_out = sorted(p.name for p in committed.glob("held_out_*.csv"))
    assert held_out == sorted(p.name for p in tmp_path.glob("held_out_*.csv"))  # one per committed anatomy
    for name in held_out:  # the committed held-out tests are those of the committed anatomy and exports
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / name), pd.read_csv(committed / name))
    for model in models:
        mine = findings.load_results(tmp_path, "04_faithfulness", model)
        theirs = findings.load_results(committed, "04_faithfulness", model)
        assert mine.metadata == theirs.metadata
        pd.testing.assert_frame_equal(mine.table, theirs.table, check_exact=False, rtol=1e-12, atol=1e-15)


def test_the_forest_plot_draws_every_measured_step_in_the_papers_direction(sliced):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cwbook.forests import VERDICT_COLOURS, ladder_forest

    out, _, _ = sliced
    claims = pd.read_csv(out / "findings.csv")
    fig = ladder_forest(claims)
    drawn = claims[claims["claim"].str.startswith("step") | (claims["claim"] == "contribution beats random")]
    drawn = drawn[(drawn["verdict"] != "not measured") & (drawn["variant"] == "main")]  # variants: not on its lines
    points = forest_points(fig)
    expected = [(round(float(e) * (-1 if m == "sufficiency" else 1), 12), VERDICT_COLOURS[v].lower())
                for e, m, v in zip(drawn["estimate"], drawn["mode"], drawn["verdict"])]
    assert sorted(points) == sorted(expected)
    assert len(fig.axes) == 2  # one data set x two modes
    plt.close(fig)
