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
        assert done.stderr.startswith("python -m cwbook.evidence_export: error: ") and done.stderr.count("\n") == 1, \
            done.stderr
        assert "Traceback" not in done.stderr


# -- findings.csv, the anatomy's explanations and their held-out tests: verified like the exports ---------
def test_the_plain_committed_tables_have_their_json_and_are_verified_on_read(evidence):
    """findings.csv, explain_*.csv and held_out_*.csv were read as plain CSVs: a changed number was taken. Each
    now has a JSON with its SHA-256 and rows; every reader goes through read_checked_csv."""
    from cwbook import headline
    from cwbook.evidence_files import CHECKED_TABLES, read_checked_csv

    checked = [t for pattern in CHECKED_TABLES for t in COMMITTED.glob(pattern)]
    assert len(checked) >= 9 and all(t.with_suffix(".json").is_file() for t in checked)
    assert {t for t, _ in committed_pairs(COMMITTED)} >= set(checked)
    findings = headline.committed_findings(evidence)
    assert findings.equals(pd.read_csv(evidence / "findings.csv"))  # the same rows as a plain read
    # one changed verdict: refused by the headline's reader and by chapter 4's
    text = (evidence / "findings.csv").read_text()
    (evidence / "findings.csv").write_text(text.replace(",holds,", ",contradicted,", 1))
    with pytest.raises(CommittedFileError, match="does not match the SHA-256"):
        headline.committed_findings(evidence)
    held = next(evidence.glob("held_out_*.csv"))
    held.with_suffix(".json").unlink()  # a table whose JSON is missing (an interrupted write) is not taken
    with pytest.raises(CommittedFileError, match="has no .*json beside it"):
        read_checked_csv(held)


def test_a_checked_table_written_and_read_back_and_its_rows_checked(tmp_path):
    from cwbook.evidence_files import read_checked_csv, write_checked_csv

    table = pd.DataFrame({"claim": ["a", "b"], "estimate": [0.125, -1.5]})
    paths = write_checked_csv(table, tmp_path / "findings.csv", "two rows")
    assert paths == [tmp_path / "findings.csv", tmp_path / "findings.json"]
    assert read_checked_csv(tmp_path / "findings.csv").equals(table)
    meta = json.loads((tmp_path / "findings.json").read_text())
    assert meta == {"what": "two rows", "rows": 2, HASH_FIELD: content_hash((tmp_path / "findings.csv").read_bytes())}
    (tmp_path / "findings.json").write_text(json.dumps({**meta, "rows": 3}))
    with pytest.raises(CommittedFileError, match="holds 2 rows, its JSON records 3"):
        read_checked_csv(tmp_path / "findings.csv")


def _rehash(csv: Path, js: Path) -> None:
    meta = json.loads(js.read_text())
    js.write_text(json.dumps({**meta, "rows": len(pd.read_csv(csv)), HASH_FIELD: content_hash(csv.read_bytes())}))


@pytest.mark.parametrize("damage, message", [
    # every row of one metric at one ratio: the counts per present combination held, four verdicts flipped
    (lambda t: t[~((t.protocol == "default") & (t.metric == "contribution") & (t.ratio == 0.05))],
     "cell default lacks documents in 4 of its importance x metric x mode x ratio combinations"),
    (lambda t: pd.concat([t, t.iloc[:1].assign(nll=t.nll.iloc[0] + 5)]), "cell \\S+ holds a .* twice"),
    (lambda t: t[~((t.protocol == "default") & (t.metric == "random_s2") & (t.document == t.document.iloc[0]))],
     "seed random_s2 covers other documents"),
])
def test_an_export_missing_a_combination_doubled_or_with_a_holed_seed_is_refused(evidence, damage, message):
    csv, js = ee.paths(MODEL, DATA, evidence)
    _rewrite(csv, damage)
    _rehash(csv, js)
    (evidence / "PROVENANCE").unlink()  # as in the confirmatory folder: the counts alone must catch it
    with pytest.raises(CommittedFileError, match=message):
        ee.read_committed(MODEL, DATA, evidence)


def test_a_half_pair_is_refused_by_the_tables_and_the_verifier_and_a_lost_chapter_is_not_measured(tmp_path, capsys):
    """A per-document JSON without its table dropped the data set from chapter 4's table (the primary family
    went from 32 to 24 tests); a chapter's lost table left its claims out of findings.csv; the verifier
    printed 'all verified' and exited 0 for both."""
    from cwbook import evidence_files, findings

    out = tmp_path / "evidence"
    shutil.copytree(COMMITTED, out)
    ee.paths("gemma3-270m", "web-text", out)[0].unlink()
    with pytest.raises(CommittedFileError, match="per_document_gemma3-270m_web-text.json has no"):
        ee.tables(out, ["gemma3-270m"])
    assert evidence_files.main([str(out)]) == 1
    assert "per_document_gemma3-270m_web-text.json (its table is missing)" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()  # a mistyped folder: it verified "0 of 0 committed tables", status 0
    assert evidence_files.main([str(tmp_path / "empty")]) == 2
    assert "holds no committed table" in capsys.readouterr().err
    chapter = out / "05_sink_decomposition" / "gemma3-270m.csv"
    chapter.unlink()
    with pytest.raises(CommittedFileError, match="gemma3-270m.json has no gemma3-270m.csv beside it"):
        findings.load_results(out, "05_sink_decomposition", "gemma3-270m")
    chapter.with_suffix(".json").unlink()  # both gone: the chapter was not built, and its claims say so
    table = findings.findings_csv(out, ["gemma3-270m"], "evidence")
    lost = table[table["measured"].astype(str).str.contains("chapter 5 was not built")]
    assert len(lost) and set(lost["verdict"]) == {"not measured"}


def test_a_frames_json_that_would_change_its_values_or_drop_a_column_is_refused(evidence):
    """dtypes.nll = "int64" read 7.078 as 7 and was accepted; columns without clean_correct dropped it."""
    csv, js = ef.frame_paths(ef.DOWNSTREAM, MODEL, "mmlu", evidence)
    meta = json.loads(js.read_text())
    js.write_text(json.dumps({**meta, "dtypes": {**meta["dtypes"], "nll": "int64"}}))
    with pytest.raises(CommittedFileError, match="records column nll as int64, which would change its values"):
        ef.read_frame(ef.DOWNSTREAM, MODEL, "mmlu", evidence)
    js.write_text(json.dumps({**meta, "columns": [c for c in meta["columns"] if c != "clean_correct"]}))
    with pytest.raises(CommittedFileError, match="are not the ones its JSON records"):
        ef.read_frame(ef.DOWNSTREAM, MODEL, "mmlu", evidence)
    js.write_text(json.dumps(meta))
    assert ef.read_frame(ef.DOWNSTREAM, MODEL, "mmlu", evidence)[0]["nll"].dtype == "float64"  # the control


def test_the_export_command_line_answers_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    """``export --profile nope`` ended in a BookError traceback (status 1); ``check --profile`` was accepted and
    ignored (check recomputes with the profile its export records): it is no option of check any more."""
    assert ee.main(["export", "--profile", "nope", "--documents", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cwbook.evidence_export: error: profile 'nope' is not in run.yml")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):
        ee.main(["check", "--profile", "nope"])
    assert "unrecognized arguments: --profile nope" in capsys.readouterr().err
    # the one error path of the command lines (cwcore.cli.run_command): a bug is one line and status 1, an
    # interrupt status 130, --debug the traceback (they each kept their own, and an interrupt was a traceback)
    def bug(args):
        raise RuntimeError("a bug")

    def interrupted(args):
        raise KeyboardInterrupt

    for body, status, line in ((bug, 1, "internal error RuntimeError: a bug"), (interrupted, 130, "interrupted")):
        monkeypatch.setattr(ee, "_main", body)
        assert ee.main(["tables", "--out", str(tmp_path)]) == status
        assert line in capsys.readouterr().err
    monkeypatch.setattr(ee, "_main", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        ee.main(["tables", "--out", str(tmp_path), "--debug"])
