"""``STATUS.md`` (cwbook.evidence_status): every part the evidence profile plans, against what the
committed files hold, counted independently here from run.yml and the files themselves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import io

import pandas as pd
import pytest

from cwbook import evidence_export as ee
from cwbook import evidence_status as es
from cwbook import load_config
from cwbook.evidence_files import HASH_FIELD, content_hash
from cwbook.evidence_frames import BENCH, DOWNSTREAM, PER_LAYER, SENSITIVITY, frame_paths
from cwbook.findings import BENCH_CHAPTER
from cwbook.parameters import run_parameters

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "book" / "run.yml"
COMMITTED = ROOT / "data" / "results" / "evidence"


def _profile():
    return load_config(CONFIG)["profiles"]["evidence"]


def test_the_ladder_rows_are_the_profiles_cells_with_the_documents_each_export_records():
    table = es.evidence_status(COMMITTED)
    ladder = table[table["part"] == "ladder"]
    expected = {}
    for model in _profile()["models"]:
        p = ee.notebook_parameters("evidence", model, CONFIG)
        variants = p["variants"] if p["variant_models"] is None or model in p["variant_models"] else []
        weights = p["weight_variants"] if p["weight_variant_models"] is None or model in p["weight_variant_models"] else []
        for data in p["datasets"]:
            for cell in [*p["protocols"], *(f"default/{v}" for v in variants)]:
                expected[(model, data, cell)] = p["n_sequences"]
            for w in weights:
                for cell in p["protocols"]:
                    expected[(f"{model}-{w}", data, cell)] = p["n_sequences"]
    got = {(r.model, r.data, r.cell): r for r in ladder.itertuples()}
    assert set(got) == set(expected)
    for key, row in got.items():
        assert row.planned == expected[key]
        js = COMMITTED / f"per_document_{key[0]}_{key[1]}.json"
        record = json.loads(js.read_text())["cells"].get(key[2]) if js.is_file() else None
        assert row.held == (record["documents"] if record else 0)
        assert row.state == ("done" if row.held == row.planned else "in progress" if row.held else "not started")
        if record:
            assert record["commit"].startswith(row.commit) and row.created == record["created"]


def test_the_committed_status_page_is_the_one_the_committed_files_give():
    """STATUS.md is generated: committing an export without remaking it is caught here."""
    page = COMMITTED / es.STATUS_FILE
    if not page.is_file():
        pytest.skip("no STATUS.md committed")
    assert page.read_text() == es.status_markdown(es.evidence_status(COMMITTED))


def _pair(js: Path, table: pd.DataFrame, meta: dict) -> None:
    """A committed pair as the writers leave it: the gzipped table and its JSON with rows and SHA-256."""
    csv = js.with_name(js.name[: -len(".json")] + ".csv.gz")
    rows = io.BytesIO()
    table.to_csv(rows, index=False, compression={"method": "gzip", "mtime": 0})
    csv.write_bytes(rows.getvalue())
    js.write_text(json.dumps({**meta, "rows": len(table), HASH_FIELD: content_hash(rows.getvalue())}))


def _units(n: int, unit: str = "sequence", **keys) -> pd.DataFrame:
    frame = pd.DataFrame({unit: range(n), **({"document": range(n)} if unit == "sequence" else {})})
    return frame.assign(**{"metric": "attention", "mode": "comprehensiveness", "ratio": 0.1, **keys})


def test_partial_cells_frames_chapters_and_damaged_files_are_reported_as_such(tmp_path):
    out = tmp_path / "evidence"
    out.mkdir()
    model = _profile()["models"][0]
    p = ee.notebook_parameters("evidence", model, CONFIG)
    data = p["datasets"][0]
    # a ladder export holding one cell whole and another in part
    ids = list(range(p["n_sequences"]))
    ladder = pd.concat([_units(p["n_sequences"], protocol="default", variant="main", importance="signed"),
                        _units(16, protocol="per-head", variant="main", importance="signed")])
    _pair(out / f"per_document_{model}_{data}.json", ladder.assign(nll=1.0, clean_nll=0.5), {
        "document_ids": ids, "documents": p["n_sequences"], "protocols": p["protocols"],
        "cells": {"default": {"documents": p["n_sequences"], "commit": "a" * 40, "created": "t1"},
                  "per-head": {"documents": 16, "commit": "b" * 40, "created": "t2"}}})
    # the downstream frames: the first task whole, the second with 40 examples, the third absent
    tasks = p["tasks"]
    for task, n in ((tasks[0], p["n_examples"]), (tasks[1], 40)):
        _pair(frame_paths(DOWNSTREAM, model, task, out)[1], _units(n, "example", task=task),
              {"example_ids": {task: list(range(n))}, "commit": "c" * 40})
    # the per-layer frame's JSON is damaged
    _pair(frame_paths(PER_LAYER, model, data, out)[1], _units(4, layer=0), {"document_ids": [0, 1, 2, 3]})
    frame_paths(PER_LAYER, model, data, out)[1].write_text("{not json")
    # Table 8's protocol variants, whole
    n = p["sensitivity_sequences"]
    _pair(frame_paths(SENSITIVITY, model, data, out)[1],
          pd.concat([_units(n, change="default"), _units(n, change="unit = token")]), {
              "variants": {"default": {}, "unit = token": {"unit": "token"}}, "commit": "d" * 40,
              "document_ids": list(range(n))})
    # the bench: the first data set's frame whole, the second's absent (each is written when it completes)
    bench = run_parameters(BENCH_CHAPTER, "evidence", model, config=CONFIG)
    _pair(frame_paths(BENCH, model, bench["datasets"][0], out)[1], _units(bench["n_sequences"]), {
        "document_ids": list(range(bench["n_sequences"])), "commit": "e" * 40, "created": "t3"})
    # chapter 5's table ran at 8 documents
    from cwbook.findings import save_results

    save_results(out / "05_sink_decomposition" / f"{model}.csv", pd.DataFrame({"claim": ["x"]}),
                 chapter="05_sink_decomposition", model=model, parameters={"n_documents": 8, "data": "gsm8k"})
    # chapter 6's JSON without its table: it was read as done from the JSON alone
    (out / "06_sinks_as_suppressors").mkdir()
    (out / "06_sinks_as_suppressors" / f"{model}.json").write_text(json.dumps({"parameters": {"n_documents": 64}}))
    table = es.evidence_status(out)
    rows = {(r.part, r.model, r.data, r.cell): r for r in table.itertuples()}
    assert rows[("ladder", model, data, "default")].state == "done"
    partial = rows[("ladder", model, data, "per-head")]
    assert (partial.held, partial.planned, partial.state, partial.commit) == (16, p["n_sequences"], "in progress", "bbbbbbb")
    assert rows[("ladder", model, p["datasets"][1], "default")].state == "not started"
    down = [rows[("downstream", model, t, "")] for t in tasks]
    assert [(r.held, r.state) for r in down] == [(p["n_examples"], "done"), (40, "in progress"), (0, "not started")]
    layer = rows[("per-layer", model, data, "")]
    assert layer.state.startswith("unreadable (") and layer.held == 0
    variants = rows[("protocol variants", model, data, "2 variants")]
    assert (variants.held, variants.planned, variants.state, variants.commit) == \
        (p["sensitivity_sequences"], p["sensitivity_sequences"], "done", "ddddddd")
    assert rows[("protocol variants", _profile()["models"][1], data, "variants")].state == "not started"
    benches = [rows[(BENCH_CHAPTER, model, d, "")] for d in bench["datasets"]]
    assert [(r.held, r.planned, r.state, r.commit) for r in benches] == \
        [(bench["n_sequences"], bench["n_sequences"], "done", "eeeeeee")] + \
        [(0, bench["n_sequences"], "not started", "")] * (len(bench["datasets"]) - 1)
    chapter = rows[("05_sink_decomposition", model, "gsm8k", "")]
    assert (chapter.held, chapter.planned, chapter.state) == (8, _profile()["params"]["n_sequences"], "in progress")
    lost = rows[("06_sinks_as_suppressors", model, "", "")]
    assert lost.state.startswith("unreadable (") and "has no" in lost.state and lost.held == 0
    page = es.status_markdown(table)
    done = int((table["state"] == "done").sum())
    assert f"**{done} of {len(table)} parts done**" in page
    assert f"| {model} | {data} | per-head | 16 / {p['n_sequences']} documents | **in progress** | bbbbbbb | t2 |" in page


def test_the_command_line_prints_and_writes_the_page(tmp_path, capsys):
    out = tmp_path / "evidence"
    shutil.copytree(COMMITTED, out, ignore=shutil.ignore_patterns("*.csv.gz", "*.csv", es.STATUS_FILE))
    assert es.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert es.main(["--out", str(out), "--write"]) == 0
    assert (out / es.STATUS_FILE).read_text().rstrip("\n") == printed.rstrip("\n")


@pytest.mark.parametrize("damage", ["number", "lost document", "torn"])
def test_a_changed_or_torn_pair_is_not_work_done(tmp_path, damage):
    """A number changed by hand, a document's rows removed (with the JSON's rows count edited to match), or a
    new table beside the old JSON (a kill between the two writes) is reported unreadable with its reason, not
    done; a committed pair as written is done."""
    out = tmp_path / "evidence"
    out.mkdir()
    model = _profile()["models"][0]
    bench = run_parameters(BENCH_CHAPTER, "evidence", model, config=CONFIG)
    data, n = bench["datasets"][0], bench["n_sequences"]
    js = frame_paths(BENCH, model, data, out)[1]
    _pair(js, _units(n).assign(nll=1.5), {"document_ids": list(range(n)), "commit": "e" * 40})

    def state():
        return es.evidence_status(out).set_index(["part", "model", "data"]).loc[(BENCH_CHAPTER, model, data), "state"]

    assert state() == "done"
    meta = json.loads(js.read_text())
    if damage == "number":
        table = _units(n).assign(nll=1.5)
        table.loc[n - 1, "nll"] = 2.5  # outside any slice a check would recompute
        _pair(js, table, meta)
        js.write_text(json.dumps(meta))  # the old JSON: its hash is the old table's
    elif damage == "lost document":
        _pair(js, _units(n).iloc[:-1], {**meta, "rows": n - 1})  # rows and hash made to agree: units do not
    else:
        csv = frame_paths(BENCH, model, data, out)[0]
        rows = io.BytesIO()
        _units(n).assign(nll=9.0).to_csv(rows, index=False, compression={"method": "gzip", "mtime": 0})
        csv.write_bytes(rows.getvalue())
    assert state().startswith("unreadable (")
    reason = state()
    assert ("lacks 1 of its" in reason) if damage == "lost document" else ("SHA-256" in reason)


def test_a_mistyped_out_folder_fails(tmp_path, capsys):
    assert es.main(["--out", str(tmp_path / "evidnce")]) == 2
    assert "no such folder" in capsys.readouterr().err


def test_exports_are_judged_only_by_the_profile_they_were_made_under(tmp_path, capsys):
    """``--profile smoke --write`` replaced the committed STATUS.md with "16 of 16 parts done" (the smoke plan,
    judged from the evidence profile's files), ``--profile confirmatory`` with "24 of 24"."""
    out = tmp_path / "evidence"
    shutil.copytree(COMMITTED, out, ignore=shutil.ignore_patterns("*.csv.gz", "*.csv"))
    before = (out / es.STATUS_FILE).read_bytes()
    for profile in ("smoke", "confirmatory"):
        assert es.main(["--out", str(out), "--profile", profile, "--write"]) == 2
        assert f"made under profile evidence, not '{profile}'" in capsys.readouterr().err
        with pytest.raises(ValueError, match="made under profile evidence"):
            es.write_status(out, profile=profile)
    assert (out / es.STATUS_FILE).read_bytes() == before
    assert es.main(["--out", str(out), "--profile", "evidence"]) == 0  # the control: its own profile


def test_a_profile_run_yml_lacks_and_a_mistyped_confirmatory_folder_are_one_line(tmp_path, capsys):
    """``--profile nope`` ended in a BookError traceback; ``python -m cwbook.confirmatory status --out <typo>``
    created the folder and wrote "0 of 10 parts done" into it."""
    from cwbook import confirmatory

    assert es.main(["--profile", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cwbook.evidence_status: error: profile 'nope' is not in run.yml")
    assert confirmatory.main(["status", "--out", str(tmp_path / "confirmatroy")]) == 2
    assert "no such folder" in capsys.readouterr().err and not (tmp_path / "confirmatroy").exists()
