"""Committed evidence is verified by its content on every read: each table's JSON records its SHA-256, and
the counts (rows, documents, units) are checked against the JSON; PROVENANCE's recorded cell hashes too."""
from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cwbook import evidence_export as ee
from cwbook import evidence_frames as ef
from cwbook.evidence_files import HASH_FIELD, CommittedFileError, committed_pairs, content_hash, record_hashes

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "data" / "results" / "evidence"
MODEL, DATA = "smollm2-135m", "gsm8k"


@pytest.fixture
def evidence(tmp_path):
    out = tmp_path / "evidence"
    shutil.copytree(COMMITTED, out, ignore=shutil.ignore_patterns("0*"))
    return out


def test_every_committed_table_records_and_matches_its_hash():
    pairs = committed_pairs(COMMITTED)
    assert len(pairs) >= 20
    for table, meta in pairs:
        assert json.loads(meta.read_text())[HASH_FIELD] == content_hash(table.read_bytes()), table.name


def _rewrite(csv: Path, edit) -> None:
    table = pd.read_csv(csv)
    table = edit(table)
    rows = io.BytesIO()
    table.to_csv(rows, index=False, float_format="%.8g", compression={"method": "gzip", "mtime": 0})
    csv.write_bytes(rows.getvalue())


def _last_document(table):
    return table[table["document"] != table["document"].iloc[-1]]


def test_a_number_changed_outside_any_slice_is_refused(evidence):
    csv, js = ee.paths(MODEL, DATA, evidence)
    _rewrite(csv, lambda t: t.assign(nll=t["nll"].where(t.index != len(t) - 1, t["nll"] + 0.5)))
    with pytest.raises(CommittedFileError, match="does not match the SHA-256"):
        ee.read_committed(MODEL, DATA, evidence)
    with pytest.raises(CommittedFileError):
        ee.tables(evidence, [MODEL])


def test_an_export_that_lost_a_document_is_refused_even_with_its_hash_and_rows_updated(evidence):
    csv, js = ee.paths(MODEL, DATA, evidence)
    _rewrite(csv, _last_document)
    meta = json.loads(js.read_text())
    rows = len(pd.read_csv(csv))
    js.write_text(json.dumps({**meta, "rows": rows, HASH_FIELD: content_hash(csv.read_bytes())}))
    with pytest.raises(CommittedFileError, match="63 documents, its JSON records 64"):
        ee.read_committed(MODEL, DATA, evidence)
    assert ee.main(["tables", "--out", str(evidence), "--models", MODEL]) == 2


def test_a_bench_frame_missing_a_sequence_is_refused_and_recomputed(evidence):
    csv, js = ef.frame_paths(ef.BENCH, MODEL, DATA, evidence)
    _rewrite(csv, lambda t: t[~((t["sequence"] == 5) & (t["metric"] == t["metric"].iloc[0]))])
    meta = json.loads(js.read_text())
    js.write_text(json.dumps({**meta, "rows": len(pd.read_csv(csv)), HASH_FIELD: content_hash(csv.read_bytes())}))
    with pytest.raises(CommittedFileError, match="lacks 1 of its 64 documents"):
        ef.read_frame(ef.BENCH, MODEL, DATA, evidence)
    computed, said = [], []
    out = ef.committed_frame(ef.BENCH, lambda: computed.append(1) or pd.DataFrame({"x": [1]}), lambda: None,
                             model=MODEL, data=DATA, settings=meta["settings"], wanted={"metric": meta["metrics"]},
                             exports=evidence, log=said.append)
    assert computed == [1] and list(out["x"]) == [1]
    assert "refused" in said[0] and "lacks" in said[0] and "\n" not in said[0]


def test_a_kill_between_the_table_and_its_json_leaves_a_pair_that_is_refused(evidence, monkeypatch):
    csv, js = ef.frame_paths(ef.ANATOMY, MODEL, DATA, evidence)
    table, meta = ef.read_frame(ef.ANATOMY, MODEL, DATA, evidence)
    real = ef.cw_cache.atomic_write_bytes

    def killed_before_the_json(path, data):
        if Path(path).suffix == ".json":
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(ef.cw_cache, "atomic_write_bytes", killed_before_the_json)
    changed = table.assign(**{ef.MEASURES[0]: table[ef.MEASURES[0]] + 1.0})
    with pytest.raises(KeyboardInterrupt):
        ef.write_frame(ef.ANATOMY, changed, {k: v for k, v in meta.items() if k != HASH_FIELD}, MODEL, DATA, evidence)
    monkeypatch.setattr(ef.cw_cache, "atomic_write_bytes", real)
    with pytest.raises(CommittedFileError, match="interrupted between the two files"):
        ef.read_frame(ef.ANATOMY, MODEL, DATA, evidence)


def test_provenance_cell_hashes_are_compared(evidence):
    csv, js = ee.paths(MODEL, DATA, evidence)
    ee.read_committed(MODEL, DATA, evidence)  # as committed: PROVENANCE's cell hashes hold
    record = json.loads((evidence / "PROVENANCE").read_text())
    taken = next(c for c in record["builds"][-1]["committed_cells"]["taken"]
                 if (c["model"], c["data"], c.get("variant")) == (MODEL, DATA, None) and "cell_sha256" in c)
    taken["cell_sha256"] = "0" * 64
    (evidence / "PROVENANCE").write_text(json.dumps(record))
    with pytest.raises(CommittedFileError, match="PROVENANCE records"):
        ee.read_committed(MODEL, DATA, evidence)


def test_recording_hashes_changes_only_the_jsons(evidence):
    csvs = {p: p.read_bytes() for p in evidence.glob("*.csv.gz")}
    for _, js in committed_pairs(evidence):
        meta = json.loads(js.read_text())
        del meta[HASH_FIELD]
        js.write_text(json.dumps(meta, indent=1) + "\n")
    with pytest.raises(CommittedFileError, match="records no csv_sha256"):
        ee.read_committed(MODEL, DATA, evidence)
    assert len(record_hashes(evidence)) == len(committed_pairs(evidence))
    assert {p: p.read_bytes() for p in evidence.glob("*.csv.gz")} == csvs
    assert ee.read_committed(MODEL, DATA, evidence) is not None


def test_tables_name_a_missing_folder_or_model_in_one_line(tmp_path):
    for argv in (["tables", "--out", str(tmp_path / "nowhere")], ["tables", "--out", str(tmp_path)],
                 ["tables", "--out", str(COMMITTED), "--models", "no-such-model"]):
        done = subprocess.run([sys.executable, "-m", "cwbook.evidence_export", *argv], capture_output=True,
                              text=True, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
        assert "Traceback" not in done.stderr
