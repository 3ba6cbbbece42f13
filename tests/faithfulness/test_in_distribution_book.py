"""The committed in-distribution removal check (``python -m cwbook.in_distribution``): its table is what its
per-document rows give (AOPC recomputed by hand: the trapezoid mean of each document's Delta NLL curve with
(0, 0) in front, averaged over documents), and chapter 4's sentences quote the table. Skips where it is not
committed."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cwbook.chapters import ch04_faithfulness as ch04

MODELS = ["smollm2-135m", "gemma3-270m"]


def _committed(model):
    path = ch04.in_distribution_path(model)
    rows = path.with_name(path.stem + "_per_document.csv.gz")
    if not path.is_file() or not rows.is_file():
        pytest.skip(f"no committed in-distribution table for {model}")
    return pd.read_csv(path, keep_default_na=False, na_values=[""]), pd.read_csv(rows)


@pytest.mark.parametrize("model", MODELS)
def test_the_aopc_rows_are_what_the_per_document_rows_give(model):
    table, rows = _committed(model)
    areas = table[table["quantity"] == "aopc"]
    assert set(areas["removal"]) == {"zero", "mean"}
    for _, area in areas.iterrows():
        part = rows[(rows["removal"] == area["removal"]) & (rows["metric"] == area["metric"])
                    & (rows["mode"] == area["mode"])]
        if area["range"] == "low":
            part = part[part["ratio"] <= 0.05]
        per_document = []
        for _, doc in part.groupby("document"):
            doc = doc.sort_values("ratio")
            r = np.concatenate([[0.0], doc["ratio"].to_numpy()])
            delta = np.concatenate([[0.0], (doc["nll"] - doc["clean_nll"]).to_numpy()])
            per_document.append(np.sum((r[1:] - r[:-1]) * (delta[1:] + delta[:-1]) / 2) / r[-1])
        assert len(per_document) == area["n_units"]
        assert np.mean(per_document) == pytest.approx(area["estimate"], abs=1e-6)


@pytest.mark.parametrize("model", MODELS)
def test_the_chapter_quotes_the_committed_steps(model):
    table, _ = _committed(model)
    shown, quoted = ch04.committed_in_distribution(model)
    pd.testing.assert_frame_equal(shown, table)
    steps = table[(table["quantity"] == "step") & (table["range"] == "full")]
    assert len(steps) == 2 * 2 * 2  # two steps, two removals, two modes
    for _, step in steps.iterrows():
        cell = (f"{step['mode']} {step['estimate']:+.3f} nats [{step['ci_low']:+.3f}, {step['ci_high']:+.3f}] "
                f"({step['verdict']})")
        assert cell in quoted["in_distribution"]


def test_the_zeroing_rows_are_read_verified_from_the_committed_export(tmp_path, monkeypatch):
    """chapter 4 takes its zeroing rows from the committed ladder export only through the verified reader: the
    rows equal a plain read of the same file, and a copy with one changed byte is refused, never taken."""
    import gzip
    import shutil

    from cwbook import findings
    from cwbook.evidence_files import CommittedFileError

    model = "smollm2-135m"
    stem = f"per_document_{model}_{ch04.IN_DISTRIBUTION_DATA}"
    csv, meta = findings.EVIDENCE_DIR / f"{stem}.csv.gz", findings.EVIDENCE_DIR / f"{stem}.json"
    if not csv.is_file():
        pytest.skip("no committed exploratory export")
    plain = pd.read_csv(csv)
    documents, ratios = sorted(plain["document"].unique())[:3], sorted(plain["ratio"].unique())[-3:]
    got = ch04.committed_zero_rows(model, documents, ratios=ratios, seq_len=128, dtype="float32")
    # another block length or dtype is another input: --seq-len 160 took the 128-token rows beside its own
    assert ch04.committed_zero_rows(model, documents, ratios=ratios, seq_len=160, dtype="float32") is None
    assert ch04.committed_zero_rows(model, documents, ratios=ratios, seq_len=128, dtype="bfloat16") is None
    plain = plain[(plain["protocol"] == "default") & (plain["importance"] == "absolute") & (plain["variant"] == "main")
                  & plain["metric"].isin(ch04.IN_DISTRIBUTION_METRICS) & plain["document"].isin(documents)
                  & plain["ratio"].isin(ratios)]
    assert got is not None and len(got) == len(plain) == 3 * len(ch04.IN_DISTRIBUTION_METRICS) * 2 * 3
    np.testing.assert_array_equal(got["nll"].to_numpy(), plain["nll"].to_numpy())
    # the same files with one changed number: the recorded SHA-256 no longer matches
    monkeypatch.setattr(findings, "EVIDENCE_DIR", tmp_path)
    shutil.copy(meta, tmp_path / meta.name)
    text = gzip.decompress(csv.read_bytes()).decode()
    first_line_end = text.index("\n", text.index("\n") + 1)
    tampered = text[:first_line_end - 1] + ("1" if text[first_line_end - 1] != "1" else "2") + text[first_line_end:]
    (tmp_path / csv.name).write_bytes(gzip.compress(tampered.encode()))
    with pytest.raises(CommittedFileError, match="SHA-256"):
        ch04.committed_zero_rows(model, documents, ratios=ratios, seq_len=128, dtype="float32")


@pytest.mark.parametrize("argv, message", [(["--documents", "0"], "--documents must be at least 1"),
                                           (["--ratios", "2"], "ratios must lie in [0, 1]"),
                                           (["--seq-len", "1"], "--seq-len must be at least 2")])
def test_the_command_line_refuses_bad_sizes_in_one_line_before_a_model_loads(argv, message, monkeypatch, capsys):
    """They failed after the first model loaded, in a traceback (the module had no error path of its own)."""
    import cwcore

    from cwbook import in_distribution

    monkeypatch.setattr(cwcore, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    assert in_distribution.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cwbook.in_distribution: error: ") and message in err and err.count("\n") == 1
