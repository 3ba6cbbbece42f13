"""``make evidence``'s own steps (cwbook.evidence_build): PROVENANCE counts every process's cache
reads, and a committed ladder cell is taken only when a recomputed 2-document slice equals it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest
import torch

from cwcore import cache as cw_cache
from cwcore import runs
from cwbook import evidence_build as eb
from cwbook import evidence_export as ee
from cwbook.evidence_files import HASH_FIELD, content_hash
from cwbook import evidence_frames as ef
from cwcore.cache import ResultCache
from cwbook import ladder as evidence
from cwbook.cached import cached_downstream_eval, per_sequence_curve

ROOT = Path(__file__).resolve().parents[1]
CHILD = ("import sys; from cwcore.cache import ResultCache; import pandas as pd\n"
         "c = ResultCache('tally-test', {'n': int(sys.argv[1])})\n"
         "for piece in ('a', 'b', 'c'):\n"
         "    if c.get(piece) is None: c.put(piece, pd.DataFrame({'x': [1]}))\n")


def _read(root, namespace, item):
    return ResultCache(namespace, {"item": item}, root=root).get("piece")


def test_provenance_sums_the_cache_reads_of_every_process_and_is_written_atomically(tmp_path, monkeypatch):
    cache_dir, out = tmp_path / "cache", tmp_path / "out"
    monkeypatch.setenv("CWCORE_CACHE", str(cache_dir))
    monkeypatch.setenv(cw_cache.CACHING_ENV_VAR, "1")  # as in the book's kernels: caching on
    calls = []

    def build(**kwargs):  # stands in for the book build: a kernel-like child process, and forked ranks
        calls.append(kwargs)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}  # with the build's $CWCORE_CACHE_TALLY, as a kernel
        for _ in range(2):  # 3 misses, then 3 hits
            subprocess.run([sys.executable, "-c", CHILD, "1"], check=True, env=env)
        monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
        runs.shard_map(range(5), lambda item: _read(cache_dir, "tally-ranks", item))  # 5 misses, 2 ranks
        monkeypatch.delenv(runs.JOBS_ENV_VAR)
        ResultCache("tally-ranks", {"item": 0}, root=cache_dir).put("piece", pd.DataFrame({"x": [0]}))
        assert _read(cache_dir, "tally-ranks", 0) is not None  # this process: 1 hit

    def tables(folder):
        path = Path(folder) / "table.csv"
        cw_cache.write_csv(pd.DataFrame({"a": [1]}), path)
        return [path]

    path = eb.build_evidence(models=["tiny"], only="04_faith", out=out, build=build, tables=tables, force=True)
    assert calls == [{"profile": "evidence", "models": ["tiny"], "only": "04_faith", "force": True}]
    builds = json.loads(path.read_text())["builds"]
    assert len(builds) == 1 and builds[0]["chapters"] == ["04_faithfulness"]
    record = builds[0]
    assert path == out / "PROVENANCE"
    assert record["cache"]["hits"] == 3 + 1 and record["cache"]["misses"] == 3 + 5
    assert record["cache"]["processes"] >= 4  # 2 children, this process, the forked rank
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record["commit"] == commit
    assert record["code_hashes"]["faithfulness"] == cw_cache.code_version(("faithfulness",))
    assert record["launch"] == runs.launch_info() and record["launch"]["launcher"] == "single"
    assert record["written"] == ["table.csv"] and record["wall_s"] > 0 and record["machine"]["cpus"] >= 1
    assert sorted(p.name for p in out.iterdir()) == ["PROVENANCE", "table.csv"]  # no temporary file left
    assert cw_cache.TALLY_ENV_VAR not in os.environ and cw_cache._process_tally is None

    def failing(**kwargs):
        raise RuntimeError("a notebook failed")

    with pytest.raises(RuntimeError, match="notebook failed"):
        eb.build_evidence(out=out, build=failing, tables=tables)
    assert json.loads(path.read_text())["builds"] == [record]  # a failed build leaves the old PROVENANCE


def test_provenance_keeps_each_chapter_described_by_the_build_that_made_it(tmp_path):
    path = tmp_path / "PROVENANCE"
    path.write_text("chapters 05_sink_decomposition, 06_sinks_as_suppressors and 09_findings: commit aaa, 64 documents\n"
                    "chapter 04_faithfulness: not built yet\n")  # the plain-text file of earlier rounds
    sinks = {"chapters": ["05_sink_decomposition", "06_sinks_as_suppressors", "09_findings"], "commit": "b" * 40}
    eb.write_provenance(path, sinks)
    found = eb.read_provenance(path)
    assert found["builds"] == [sinks] and found["earlier"] == ["chapter 04_faithfulness: not built yet"]
    ladder = {"chapters": ["04_faithfulness", "09_findings"], "commit": "c" * 40, "wall_s": 5.0}
    eb.write_provenance(path, ladder)
    found = eb.read_provenance(path)
    assert found["earlier"] == []  # the chapter-4 line is superseded
    assert found["builds"] == [{**sinks, "chapters": ["05_sink_decomposition", "06_sinks_as_suppressors"]}, ladder]
    lines = eb.provenance_lines(path)
    assert len(lines) == 2 and lines[0].startswith("chapters 05_sink_decomposition, 06_sinks_as_suppressors: commit bbbb")
    eb.write_provenance(path, {**sinks, "chapters": ["05_sink_decomposition", "06_sinks_as_suppressors"]})
    assert [b["commit"][0] for b in eb.read_provenance(path)["builds"]] == ["c", "b"]  # replaced, not added


# -- resuming from a committed export ---------------------------------------------------------------
METRICS = ["attention", "contribution", "random"]
RATIOS = [0.1, 0.4]


@pytest.fixture(scope="module")
def cell():
    sys.path.insert(0, str(ROOT / "tests" / "faithfulness"))
    from faith_helpers import peaked_llama, self_sampled

    model = peaked_llama()
    ids = self_sampled(model, n=4, length=12)
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                         "document": [7, 3, 11, 5]})
    rows = evidence.ladder_sweep(model, None, blocks, METRICS, RATIOS, batch_size=2, cache=False, progress=False)
    return model, blocks, rows


def _commit(rows, out, model="tiny", data="toy"):
    """An export as evidence_export.export writes it (8 significant digits), with its JSON."""
    csv, js = ee.paths(model, data, out)
    csv.parent.mkdir(parents=True, exist_ok=True)
    table = rows.assign(data=data, model=model, delta_nll=rows["nll"] - rows["clean_nll"])
    table.to_csv(csv, index=False, float_format="%.8g", compression={"method": "gzip", "mtime": 0})
    js.write_text(json.dumps({"profile": "evidence", "model": model, "data": data, "seq_len": 12, "seed": 0,
                              "dtype": "float32", "documents": int(rows["document"].nunique()),
                              "document_ids": [7, 3, 11, 5], "modes": sorted(rows["mode"].unique()),
                              "rows": len(table), HASH_FIELD: content_hash(csv.read_bytes())}))


def test_an_export_of_fewer_cells_keeps_the_committed_cells_it_did_not_run(cell, capsys):
    """A build whose configuration asks for fewer cells (no variants) exports its own cells and keeps the
    committed export's others, rows and record; cells of another sample are dropped, with a line."""
    _, _, rows = cell
    table = rows.assign(data="toy", model="tiny", delta_nll=rows["nll"] - rows["clean_nll"])
    assert set(table["variant"]) == {"main"}
    variant = table.assign(variant="token-unit", nll=table["nll"] + 1.0)
    committed = pd.concat([variant, table], ignore_index=True)
    sample = {"profile": "evidence", "seq_len": 12, "seed": 0, "dtype": "float32", "document_ids": [7, 3, 11, 5]}
    record = {"default/token-unit": {"documents": 4}}
    meta = {**sample, "model": "tiny", "data": "toy", "protocols": ["default"], "variants": [],
            "importances": sorted(set(table["importance"])), "metrics": list(dict.fromkeys(table["metric"])),
            "rows": len(table), "cells": dict(record)}
    got, got_meta = ee.keep_other_cells(table, dict(meta), committed, {**sample, "cells": record})
    assert len(got) == 2 * len(table) and got_meta["rows"] == len(got)
    pd.testing.assert_frame_equal(got.iloc[:len(table)], table)  # the run's own rows first, as it wrote them
    kept = got.iloc[len(table):].reset_index(drop=True)
    pd.testing.assert_frame_equal(kept, variant[table.columns].reset_index(drop=True))
    assert got_meta["variants"] == ["token-unit"] and got_meta["kept_cells"] == ["default/token-unit"]
    assert got_meta["cells"] == record
    # a committed export of another sample: its other cells are not mixed in
    got, got_meta = ee.keep_other_cells(table, dict(meta, cells=dict(record)), committed, {**sample, "seed": 1})
    assert len(got) == len(table) and "default/token-unit" not in got_meta["cells"]
    assert "not kept" in capsys.readouterr().out
    # nothing else committed: the export is the run's alone
    got, got_meta = ee.keep_other_cells(table, dict(meta), table, sample)
    assert got is table and "kept_cells" not in got_meta


def test_writing_rows_the_export_already_holds_leaves_it_untouched_and_a_change_is_written(cell, tmp_path):
    """A rebuild that takes every committed cell writes nothing: the rows come back in another order, with
    their columns moved and ``delta_nll`` derived again from values read at 8 digits, and the files keep
    their bytes (the JSON too). A changed value is written, in the one order every writer uses."""
    _, _, rows = cell
    out = tmp_path / "out"
    sample = dict(protocol="default", profile="evidence", seq_len=12, seed=0, dtype="float32",
                  document_ids=[7, 3, 11, 5], out=out)
    csv, js = ee.merge_cell("tiny", "toy", rows, **sample)
    before, record = csv.read_bytes(), js.read_bytes()
    written, _ = ee.read_committed("tiny", "toy", out)
    again = written.drop(columns=["data", "model", "delta_nll"]).sample(frac=1.0, random_state=0)
    again = again[list(reversed(again.columns))]
    derived = (again["nll"] - again["clean_nll"]).map(lambda x: "%.8g" % x)
    kept = written.loc[again.index, "delta_nll"].map(lambda x: "%.8g" % x)
    assert (derived != kept).any()  # without keeping the written differences the bytes would change
    ee.merge_cell("tiny", "toy", again, **sample)
    assert csv.read_bytes() == before and js.read_bytes() == record
    # written by an export (another writer, its rows in the sweep's order): the same bytes
    table = rows.assign(data="toy", model="tiny", delta_nll=rows["nll"] - rows["clean_nll"])
    assert ee._write(csv, js, table, {"document_ids": [7, 3, 11, 5]}) is False
    changed = again.copy()
    changed.loc[changed.index[0], "nll"] += 1e-3
    ee.merge_cell("tiny", "toy", changed, **sample)
    assert csv.read_bytes() != before
    now, _ = ee.read_committed("tiny", "toy", out)
    pd.testing.assert_frame_equal(now, ee.canonical_rows(now, [7, 3, 11, 5]))  # already in the one order
    assert list(now["document"].iloc[:4]) == [7, 3, 11, 5]
    assert (now["nll"] != written["nll"]).sum() == 1


def _run(model, blocks, out, tmp_path, monkeypatch, seen_keys=(), **extra):
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    seen = []

    def sweep(lm, tokenizer, blocks, *args, **kwargs):
        seen.append((list(blocks["document"]), kwargs["cache"], *(kwargs.get(k) for k in seen_keys)))
        return evidence.ladder_sweep(lm, tokenizer, blocks, *args, **kwargs)

    got = eb.ladder_cell(model, None, blocks, METRICS, RATIOS, model="tiny", data="toy", profile="evidence",
                         exports=out, sweep=sweep, batch_size=2, cache=False, progress=False, log=None, **extra)
    decision = json.loads((tmp_path / "cells" / "cell-tiny-toy-default.json").read_text())
    return got, seen, decision


def test_a_committed_cell_is_taken_when_two_recomputed_documents_equal_it(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell
    _commit(rows, tmp_path / "out")
    got, seen, decision = _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch)
    assert seen == [([7, 3], False)]  # only the 2-document slice ran, without the cache
    assert decision["decision"] == "committed" and decision["slice_rows"] == len(rows) // 2
    assert decision["max_abs_diff_nll"] < 1e-6
    assert list(got.columns) == list(rows.columns) and len(got) == len(rows)
    np.testing.assert_allclose(got["nll"], rows["nll"], rtol=1e-7, atol=0)  # the export's 8 digits
    assert (got[["metric", "mode", "ratio", "document", "importance"]].values
            == rows[["metric", "mode", "ratio", "document", "importance"]].values).all()


def test_float32_rounding_drift_is_taken_but_a_change_is_not(cell, tmp_path, monkeypatch):
    # an engine change that reorders a float32 sum moves rows by ~1e-7 of their value: that cell is taken
    model, blocks, rows = cell
    drifted = rows.copy()
    drifted["nll"] = drifted["nll"] * (1 + 8e-7)
    assert (drifted["nll"] - rows["nll"]).abs().max() > eb.ATOL  # beyond the absolute part alone
    _commit(drifted, tmp_path / "out")
    got, seen, decision = _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch)
    assert seen == [([7, 3], False)] and decision["decision"] == "committed"
    changed = rows.copy()
    changed["nll"] = changed["nll"] * (1 + 3e-6)  # three times the float32 allowance: recomputed
    _commit(changed, tmp_path / "out")
    got, seen, decision = _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch)
    assert decision["decision"] == "recomputed"
    pd.testing.assert_frame_equal(got, rows)


def test_a_perturbed_or_incomplete_committed_cell_is_recomputed(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell
    perturbed = rows.copy()
    first = perturbed.index[(perturbed["document"] == 3) & (perturbed["metric"] == "contribution")][0]
    perturbed.loc[first, "nll"] += 1e-4  # beyond 1e-6 nats + 1e-6 relative, in the slice
    _commit(perturbed, tmp_path / "out")
    got, seen, decision = _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch)
    assert seen == [([7, 3], False), ([7, 3, 11, 5], False)]  # checked, then the whole cell computed
    assert decision["decision"] == "recomputed" and "1 of" in decision["reason"]
    pd.testing.assert_frame_equal(got, rows)
    _commit(rows[rows["metric"] != "random"], tmp_path / "out")  # a cell the export does not hold whole
    got, seen, decision = _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch)
    assert seen == [([7, 3, 11, 5], False)] and "rows" in decision["reason"]
    pd.testing.assert_frame_equal(got, rows)


def test_a_refused_export_is_refused_before_any_document_is_computed(cell, tmp_path, monkeypatch):
    """A torn pair (a kill between merge_cell's two writes) was taken for "computing the cell": 16 documents
    were swept, then the first merge into the same export was refused, on every rerun."""
    from cwbook.evidence_files import CommittedFileError

    model, blocks, rows = cell
    _commit(rows, tmp_path / "out")
    csv, _ = ee.paths("tiny", "toy", tmp_path / "out")
    table = pd.read_csv(csv)
    table.loc[0, "nll"] += 1.0
    table.to_csv(csv, index=False, float_format="%.8g", compression={"method": "gzip", "mtime": 0})
    with pytest.raises(CommittedFileError, match="none can be merged into it: restore it from git"):
        _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch)
    assert not (tmp_path / "cells").exists() or not list((tmp_path / "cells").iterdir())


def test_the_evidence_profile_builds_through_build_evidence(monkeypatch):
    import cwbook as book

    assert book.PROFILE_MODULES["evidence"] == eb.__name__  # imported by the runner when the profile is built
    assert book.PROFILE_BUILDS["evidence"] is eb.build_evidence
    seen = []
    monkeypatch.setitem(book.PROFILE_BUILDS, "evidence", lambda **kwargs: seen.append(kwargs))
    monkeypatch.setattr(book, "build", lambda **kwargs: seen.append(("plain", kwargs["profile"])))
    assert book.main(["build", "--profile", "evidence", "--only", "09", "--no-html"]) == 0
    assert seen[0]["profile"] == "evidence" and seen[0]["only"] == "09" and seen[0]["html"] is False
    assert book.main(["build", "--profile", "smoke", "--only", "09", "--no-html"]) == 0
    assert seen[1] == ("plain", "smoke")


def test_the_runners_help_and_plan_do_not_load_torch():
    """``python -m cwbook --help`` answers at once: the profiles' builds (which load torch) are imported only
    when their profile is built."""
    probe = ("import runpy, sys\nsys.argv = ['cwbook', '--help']\n"
             "try:\n    runpy.run_module('cwbook', run_name='__main__')\nexcept SystemExit as done:\n"
             "    print(done.code, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["0", "False"], out.stdout + out.stderr


def test_a_committed_cell_of_one_random_seed_is_completed_by_the_missing_seeds_only(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell  # committed with one seed of the random control
    _commit(rows, tmp_path / "out")
    got, seen, decision = _run(model, blocks, tmp_path / "out", tmp_path, monkeypatch,
                               seen_keys=("random_seeds", "extra_seeds_only"), random_seeds=3)
    # the slice checks what the export holds (one seed), then only seeds 1 and 2 run on every document
    assert seen == [([7, 3], False, 1, None), ([7, 3, 11, 5], False, 3, True)]
    assert decision["decision"] == "committed" and decision["seeds_computed"] == ["random_s1", "random_s2"]
    fresh = evidence.ladder_sweep(model, None, blocks, METRICS, RATIOS, batch_size=2, cache=False, progress=False,
                                  random_seeds=3)
    keys = ["importance", "metric", "mode", "ratio", "document"]
    assert set(got["metric"]) == set(fresh["metric"]) == {*METRICS, "random_s1", "random_s2"}
    got, fresh = (t.sort_values(keys).reset_index(drop=True) for t in (got, fresh))
    assert (got[keys].values == fresh[keys].values).all()
    np.testing.assert_allclose(got["nll"], fresh["nll"], rtol=1e-7, atol=0)  # the export's 8 digits
    # the tables average the random rung over the three seeds
    areas, _ = evidence.evidence_tables(got, n_bootstrap=50, n_permutations=0)
    assert set(areas.loc[areas["metric"] == "random", "n_seeds"]) == {3}
    assert not areas["metric"].str.startswith(evidence.RANDOM_PREFIX).any()


def test_the_sink_chapters_tables_of_the_build_are_copied_into_the_evidence_folder(tmp_path):
    import cwbook as book
    config = book.load_config(ROOT / "book" / "run.yml")
    _, _, planned = book.plan(config, profile="evidence", only="05,06,07_semantic_cone,04_faith",
                              generated_dir=tmp_path / "generated", book_dir=ROOT / "book")
    written = {}
    for run in planned:
        if run.chapter.name == ee.CHAPTER:
            continue
        source = run.output.parent / run.parameters["results_file"]
        source.parent.mkdir(parents=True, exist_ok=True)
        written[(run.chapter.name, run.model)] = f"{run.chapter.name},{run.model}\n"
        source.write_text(written[(run.chapter.name, run.model)])
        source.with_suffix(".json").write_text("{}")
    got = eb.copy_chapter_tables(planned, tmp_path / "evidence")
    assert len(got) == 2 * len(written) == 2 * 3 * len(config["profiles"]["evidence"]["models"])
    for (chapter, model), text in written.items():
        assert (tmp_path / "evidence" / chapter / f"{book.slug(model)}.csv").read_text() == text
    assert not (tmp_path / "evidence" / ee.CHAPTER).exists()  # chapter 4's table is remade from the exports


def test_a_variant_cell_is_never_taken_from_the_main_protocols_rows(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell
    _commit(rows, tmp_path / "out")  # the main protocol's rows only (an export without a variant column)
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    got = eb.ladder_cell(model, None, blocks, METRICS, RATIOS, model="tiny", data="toy", profile="evidence",
                         exports=tmp_path / "out", protocol_change={"unit": "token"}, batch_size=2, cache=False,
                         progress=False, log=None)
    decision = json.loads((tmp_path / "cells" / "cell-tiny-toy-default-token-unit.json").read_text())
    assert decision["decision"] == "recomputed" and decision["variant"] == "token-unit"
    assert set(got["variant"]) == {"token-unit"} and len(got) == len(rows)


def test_an_export_breaking_an_identity_of_the_protocol_is_recomputed_though_its_slice_matches(cell, tmp_path,
                                                                                                monkeypatch):
    # under the default protocol rungs 2 and 3 rank alike by construction: their rows must be equal; an
    # export made before the rung-tie fix breaks that by a few 1e-6 nats, which a 2-document slice at
    # 1e-6 nats need not see (here: 1e-7, on a document outside the slice)
    model, blocks, _ = cell
    pair = ["value_weighted", "value_weighted_output_normalized"]
    rows = evidence.ladder_sweep(model, None, blocks, pair, [0.4], batch_size=2, cache=False, progress=False)
    stale = rows.copy()
    where = stale.index[(stale["metric"] == pair[1]) & (stale["document"] == 11)][0]
    stale.loc[where, "nll"] += 1e-7
    _commit(stale, tmp_path / "out")
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    got = eb.ladder_cell(model, None, blocks, pair, [0.4], model="tiny", data="toy", profile="evidence",
                         exports=tmp_path / "out", batch_size=2, cache=False, progress=False, log=None)
    decision = json.loads((tmp_path / "cells" / "cell-tiny-toy-default.json").read_text())
    assert decision["decision"] == "recomputed" and "identical rungs" in decision["reason"]
    assert "differ in 1 rows" in decision["reason"]
    pd.testing.assert_frame_equal(got, rows)
    _commit(rows, tmp_path / "out")  # the same rows, equal: taken
    eb.ladder_cell(model, None, blocks, pair, [0.4], model="tiny", data="toy", profile="evidence",
                   exports=tmp_path / "out", batch_size=2, cache=False, progress=False, log=None)
    assert json.loads((tmp_path / "cells" / "cell-tiny-toy-default.json").read_text())["decision"] == "committed"


# -- checkpoints: a cell merged into its export every few documents, resumed from what was merged -----
def test_a_slice_of_a_sample_with_its_first_sequence_gives_the_whole_runs_rows(cell):
    model, blocks, rows = cell
    tail = evidence.ladder_sweep(model, None, blocks.select(range(2, 4)), METRICS, RATIOS, batch_size=2, cache=False,
                                 progress=False, first_sequence=2)
    whole = rows[rows["document"].isin([11, 5])].reset_index(drop=True)
    pd.testing.assert_frame_equal(tail, whole)  # bit-identical: the same batches, the same random control
    shifted = evidence.ladder_sweep(model, None, blocks.select(range(2, 4)), ["random"], RATIOS, batch_size=2,
                                    cache=False, progress=False)
    assert not np.array_equal(shifted["nll"], whole.loc[whole["metric"] == "random", "nll"])  # the control differs


def test_sweep_order_is_the_order_ladder_sweep_returns(cell):
    model, blocks, rows = cell
    shuffled = rows.sample(frac=1.0, random_state=0)
    pd.testing.assert_frame_equal(evidence.sweep_order(shuffled, METRICS), rows)
    seeded = evidence.ladder_sweep(model, None, blocks, METRICS, RATIOS, batch_size=2, cache=False, progress=False,
                                   random_seeds=3)
    labels = [*METRICS, "random_s1", "random_s2"]
    pd.testing.assert_frame_equal(evidence.sweep_order(seeded.sample(frac=1.0, random_state=1), labels), seeded)


def _checkpointed(model, blocks, out, tmp_path, monkeypatch, fail_after=None, **extra):
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    seen = []

    def sweep(lm, tokenizer, part, *args, **kwargs):
        if fail_after is not None and len(seen) >= fail_after:
            raise KeyboardInterrupt("the build was stopped")
        seen.append((list(part["document"]), kwargs.get("first_sequence", 0), kwargs.get("extra_seeds_only")))
        return evidence.ladder_sweep(lm, tokenizer, part, *args, **kwargs)

    got = eb.ladder_cell(model, None, blocks, METRICS, RATIOS, model="tiny", data="toy", profile="evidence",
                         exports=out, sweep=sweep, batch_size=2, cache=False, progress=False, log=None, checkpoint=2,
                         **extra)
    return got, seen, json.loads((tmp_path / "cells" / "cell-tiny-toy-default.json").read_text())


def test_a_checkpointed_cell_is_merged_slice_by_slice_and_resumes_from_what_was_merged(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):  # stopped after its first slice of 2 documents
        _checkpointed(model, blocks, out, tmp_path, monkeypatch, fail_after=1)
    merged, meta = ee.read_committed("tiny", "toy", out)
    assert sorted(merged["document"].unique()) == [3, 7] and meta["cells"]["default"]["documents"] == 2
    assert meta["document_ids"] == [7, 3, 11, 5]
    np.testing.assert_allclose(merged.sort_values(["importance", "metric", "mode", "ratio", "document"])["nll"],
                               rows[rows["document"].isin([7, 3])].sort_values(
                                   ["importance", "metric", "mode", "ratio", "document"])["nll"], rtol=1e-7)
    # a new machine: the merged documents are checked on a slice and taken, only the rest is computed
    got, seen, decision = _checkpointed(model, blocks, out, tmp_path, monkeypatch)
    assert seen == [([7, 3], 0, None), ([11, 5], 2, None)]
    assert decision["decision"] == "resumed" and decision["documents_taken"] == 2 and decision["merged"]
    assert list(got.columns) == list(rows.columns) and len(got) == len(rows)
    keys = ["importance", "metric", "mode", "ratio", "document", "sequence"]
    assert (got[keys].values == rows[keys].values).all()  # the sweep's order
    np.testing.assert_allclose(got["nll"], rows["nll"], rtol=1e-7, atol=0)
    merged, meta = ee.read_committed("tiny", "toy", out)
    assert len(merged) == len(rows) and meta["cells"]["default"]["documents"] == 4
    # an export the checkpoints created carries the provenance the tables read (no KeyError in tables())
    assert meta["commit"] == meta["cells"]["default"]["commit"] and "cwcore_modified" in meta and meta["created"]
    # the same build asks again (the exporter): taken from its record, nothing recomputed
    again, seen, _ = _checkpointed(model, blocks, out, tmp_path, monkeypatch)
    assert seen == [] and (again[keys].values == rows[keys].values).all()


def test_a_checkpointed_cell_whose_slice_differs_is_recomputed_from_scratch(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell
    out = tmp_path / "out"
    _checkpointed(model, blocks, out, tmp_path, monkeypatch)
    merged, _ = ee.read_committed("tiny", "toy", out)
    merged.loc[merged["document"] == 7, "nll"] += 1e-3  # a stale export
    ee._write(*ee.paths("tiny", "toy", out), merged, ee.read_committed("tiny", "toy", out)[1])
    (tmp_path / "cells" / "cell-tiny-toy-default.json").unlink()
    got, seen, decision = _checkpointed(model, blocks, out, tmp_path, monkeypatch)
    assert seen == [([7, 3], 0, None), ([7, 3], 0, None), ([11, 5], 2, None)]  # checked, then both slices
    assert decision["decision"] == "recomputed"
    pd.testing.assert_frame_equal(got, rows)
    merged, _ = ee.read_committed("tiny", "toy", out)
    assert len(merged) == len(rows)  # the stale rows were replaced, none left over
    np.testing.assert_allclose(merged.loc[merged["document"] == 7, "nll"].sort_values(),
                               rows.loc[rows["document"] == 7, "nll"].sort_values(), rtol=1e-7)


def test_a_checkpointed_cell_completes_the_missing_seeds_slice_by_slice(cell, tmp_path, monkeypatch):
    model, blocks, rows = cell
    _commit(rows, tmp_path / "out")  # one seed, every document
    got, seen, decision = _checkpointed(model, blocks, tmp_path / "out", tmp_path, monkeypatch, random_seeds=3)
    assert seen == [([7, 3], 0, None), ([7, 3], 0, True), ([11, 5], 2, True)]
    fresh = evidence.ladder_sweep(model, None, blocks, METRICS, RATIOS, batch_size=2, cache=False, progress=False,
                                  random_seeds=3)
    keys = ["importance", "metric", "mode", "ratio", "document"]
    assert (got[keys].values == fresh[keys].values).all()
    np.testing.assert_allclose(got["nll"], fresh["nll"], rtol=1e-7, atol=0)
    merged, meta = ee.read_committed("tiny", "toy", tmp_path / "out")
    assert len(merged) == len(fresh) and {"random_s1", "random_s2"} <= set(meta["cells"]["default"]["metrics"])


def test_checkpoints_are_whole_batches_on_every_rank(monkeypatch):
    monkeypatch.delenv(eb.CHECKPOINT_ENV_VAR, raising=False)
    monkeypatch.delenv(runs.JOBS_ENV_VAR, raising=False)
    assert eb.checkpoint_documents(None, 8) == 0  # off unless the evidence build sets it
    monkeypatch.setenv(eb.CHECKPOINT_ENV_VAR, "16")
    assert eb.checkpoint_documents(None, 8) == 16 and eb.checkpoint_documents(None, 6) == 18
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "4")
    assert eb.checkpoint_documents(None, 8) == 32 and eb.checkpoint_documents(10, 2) == 16


def test_the_tables_leave_out_extra_seeds_that_do_not_yet_cover_the_cell(cell):
    _, _, rows = cell
    extra = rows[rows["metric"] == "random"].assign(metric="random_s1")
    table = pd.concat([rows, extra[extra["document"] != 5]], ignore_index=True).assign(variant="main")
    assert ee.whole_seeds(table)["metric"].isin(["random_s1"]).sum() == 0
    whole = pd.concat([rows, extra], ignore_index=True).assign(variant="main")
    assert ee.whole_seeds(whole).equals(whole)


def test_the_tables_judge_a_cell_only_once_it_holds_every_document(cell, tmp_path, monkeypatch):
    """A checkpoint of a cell is committed so another machine resumes it, but its verdicts wait for the
    sample's every document: the tables leave its rows out and list it as in progress."""
    model, blocks, rows = cell
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):  # stopped after 2 of 4 documents
        _checkpointed(model, blocks, out, tmp_path, monkeypatch, fail_after=1)
    merged, meta = ee.read_committed("tiny", "toy", out)
    judged, partial = ee._judged(merged.assign(variant="main"), meta)
    assert partial == {"default": 2} and judged.empty
    # another cell of the same export that holds all four documents is judged; the partial one still not
    whole = rows.assign(protocol="per-head")
    ee.merge_cell("tiny", "toy", whole, protocol="per-head", profile="evidence", seq_len=12, seed=0, dtype="float32",
                  document_ids=[7, 3, 11, 5], out=out)
    merged, meta = ee.read_committed("tiny", "toy", out)
    judged, partial = ee._judged(merged, meta)
    assert partial == {"default": 2} and set(judged["protocol"]) == {"per-head"}
    assert len(judged) == len(rows) and sorted(judged["document"].unique()) == [3, 5, 7, 11]
    # an export written whole by `export` has no cells record: all of it is judged
    _commit(rows, tmp_path / "whole")
    merged, meta = ee.read_committed("tiny", "toy", tmp_path / "whole")
    assert ee._judged(merged, meta)[0].equals(merged) and ee._judged(merged, meta)[1] == {}


# -- the chapter's other sweeps as committed frames: downstream tasks, per-layer interventions -----------
TASKS, DOWN_METRICS, DOWN_RATIOS = ["mmlu", "boolq"], ["attention", "contribution", "random"], [0.3]
DOWN_CALL = dict(num_examples=3, data_seed=0, max_length=40, batch_size=8, seed=0, n_bootstrap=50, progress=False,
                 cache=False)


@pytest.fixture(scope="module")
def downstream():
    """The tiny model with a word tokenizer, and the plain per-example table of two packaged tasks."""
    sys.path.insert(0, str(ROOT / "tests" / "faithfulness"))
    from faith_helpers import peaked_llama, word_tokenizer

    from cwcore import faithfulness as faith

    model, tokenizer = peaked_llama(), word_tokenizer()
    plain = cached_downstream_eval(model, tokenizer, TASKS, DOWN_METRICS, DOWN_RATIOS, per_example=True, **DOWN_CALL)
    return model, tokenizer, plain


def _downstream(model, tokenizer, out, tmp_path, monkeypatch, tasks=TASKS, metrics=DOWN_METRICS, **change):
    """downstream_cell as the notebook calls it, with the calls it made to downstream_eval and each task's
    decision (``{task: decision}``)."""
    from cwcore import faithfulness as faith

    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    seen = []

    def evaluate(lm, tokenizer, dataset, *args, **kwargs):
        what = dataset if isinstance(dataset, (str, list)) else (kwargs["task"], len(dataset))
        seen.append((what, kwargs["cache"]))
        return cached_downstream_eval(lm, tokenizer, dataset, *args, **kwargs)

    got = eb.downstream_cell(model, tokenizer, tasks, metrics, DOWN_RATIOS, model="tiny", profile="evidence",
                             exports=out, evaluate=evaluate, log=None, **{**DOWN_CALL, **change})
    decisions = {t: json.loads((tmp_path / "cells" / f"cell-downstream-tiny-{t}.json").read_text()) for t in tasks}
    return got, seen, decisions


def test_a_committed_downstream_frame_is_taken_once_two_examples_per_task_recompute_equal(downstream, tmp_path,
                                                                                          monkeypatch):
    model, tokenizer, plain = downstream
    out = tmp_path / "out"
    got, seen, decisions = _downstream(model, tokenizer, out, tmp_path, monkeypatch)
    assert seen == [(["mmlu"], False), (["boolq"], False)]  # nothing committed: each task's plain call
    for task, decision in decisions.items():
        assert decision["decision"] == "recomputed" and decision["reason"] == "no committed export"
        assert decision["written"] == f"downstream_tiny_{task}.csv.gz"
    pd.testing.assert_frame_equal(got, plain, check_exact=True)
    for task in TASKS:
        meta = json.loads((out / f"downstream_tiny_{task}.json").read_text())
        assert meta["tasks"] == [task] and meta["metrics"] == DOWN_METRICS and meta["ratios"] == DOWN_RATIOS
        assert meta["modes"] == ["comprehensiveness", "sufficiency"]
        assert meta["rows"] == (plain["task"] == task).sum() and meta["data"] == task
        assert meta["example_ids"] == {task: [0, 1, 2]} and set(meta["samples"]) == {task}
        assert meta["settings"]["num_examples"] == 3 and meta["settings"]["max_length"] == 40
        assert meta["settings"]["protocol"]["seed"] == 0 and "batch_size" not in meta["settings"]
        assert meta["call"]["batch_size"] == 8 and meta["profile"] == "evidence" and len(meta["commit"]) == 40
    # a new machine: the first 2 examples of each task's sample recomputed without the cache, then taken
    got, seen, decisions = _downstream(model, tokenizer, out, tmp_path, monkeypatch)
    assert seen == [(("mmlu", 2), False), (("boolq", 2), False)]
    assert all(d["decision"] == "committed" for d in decisions.values())
    assert sum(d["slice_rows"] for d in decisions.values()) == len(plain) * 2 // 3
    assert max(d["max_abs_diff_nll"] for d in decisions.values()) < eb.ATOL
    pd.testing.assert_frame_equal(got, plain, check_exact=False, rtol=1e-7)  # columns, dtypes, order; 8 digits
    assert (plain["kind"] == "").any()  # an empty text reads back as the sweep wrote it, not as NaN
    # a subset of its tasks and metrics, in another order, is served in the order the sweep gives it
    subset = ["contribution", "attention"]
    got, seen, decisions = _downstream(model, tokenizer, out, tmp_path, monkeypatch, tasks=["boolq"], metrics=subset)
    assert seen == [(("boolq", 2), False)] and decisions["boolq"]["decision"] == "committed"
    from cwcore import faithfulness as faith

    fresh = cached_downstream_eval(model, tokenizer, ["boolq"], subset, DOWN_RATIOS, per_example=True, **DOWN_CALL)
    pd.testing.assert_frame_equal(got, fresh, check_exact=False, rtol=1e-7)
    # PROVENANCE lists the decisions among the committed cells taken
    cells = eb._cells(tmp_path / "cells")
    assert [(c["sweep"], c["data"]) for c in cells] == [("downstream", "boolq"), ("downstream", "mmlu")]
    record = eb.provenance_record(profile="evidence", models=None, only=None, wall_s=1.0, cells=cells,
                                  tally={"hits": 0, "misses": 0, "processes": 1})
    assert record["committed_cells"]["taken"] == cells
    assert ef.frame_paths(ef.DOWNSTREAM, "tiny", "mmlu", out=out) == (out / "downstream_tiny_mmlu.csv.gz",
                                                                       out / "downstream_tiny_mmlu.json")
    both, metas = ef.read_downstream("tiny", ["mmlu", "winogrande", "boolq"], out)  # winogrande: no frame
    pd.testing.assert_frame_equal(both, plain, check_exact=False, rtol=1e-7)
    assert list(metas) == TASKS and ef.read_downstream("tiny", ["winogrande"], out) is None


def test_a_finished_task_is_kept_when_the_next_one_is_interrupted(downstream, tmp_path, monkeypatch):
    """Each task's frame is written as soon as it is finished: a run stopped in the second task resumes
    from the first task's frame (after its slice check) and computes only the second."""
    model, tokenizer, plain = downstream
    out = tmp_path / "out"
    _downstream(model, tokenizer, out, tmp_path, monkeypatch)
    (out / "downstream_tiny_boolq.csv.gz").unlink()  # as if the run had stopped inside boolq
    (out / "downstream_tiny_boolq.json").unlink()
    got, seen, decisions = _downstream(model, tokenizer, out, tmp_path, monkeypatch)
    assert seen == [(("mmlu", 2), False), (["boolq"], False)]
    assert decisions["mmlu"]["decision"] == "committed" and decisions["boolq"]["decision"] == "recomputed"
    pd.testing.assert_frame_equal(got, plain, check_exact=False, rtol=1e-7)


def test_a_tampered_or_other_downstream_frame_is_recomputed(downstream, tmp_path, monkeypatch):
    model, tokenizer, plain = downstream
    out = tmp_path / "out"
    _downstream(model, tokenizer, out, tmp_path, monkeypatch)
    table, meta = ef.read_frame(ef.DOWNSTREAM, "tiny", "boolq", out=out)
    tampered = table.copy()
    where = tampered.index[(tampered["metric"] == "contribution") & (tampered["example"] == 1)][0]
    tampered.loc[where, "nll"] += 1e-4  # beyond 1e-6 nats + 1e-6 relative, in the slice
    ef.write_frame(ef.DOWNSTREAM, tampered, meta, "tiny", "boolq", out=out)
    got, seen, decisions = _downstream(model, tokenizer, out, tmp_path, monkeypatch)
    assert seen == [(("mmlu", 2), False), (("boolq", 2), False), (["boolq"], False)]  # checked, then computed
    assert decisions["mmlu"]["decision"] == "committed"
    assert decisions["boolq"]["decision"] == "recomputed" and decisions["boolq"]["reason"].startswith("1 of ")
    pd.testing.assert_frame_equal(got, plain, check_exact=False, rtol=1e-7)  # mmlu read back at 8 digits
    boolq = got["task"] == "boolq"  # boolq computed again: the sweep's own numbers
    pd.testing.assert_frame_equal(got[boolq].reset_index(drop=True), plain[boolq].reset_index(drop=True),
                                  check_exact=True)
    rewritten, _ = ef.read_frame(ef.DOWNSTREAM, "tiny", "boolq", out=out)  # the tampered row is gone from the export
    pd.testing.assert_frame_equal(rewritten, plain[plain["task"] == "boolq"].reset_index(drop=True),
                                  check_exact=False, rtol=1e-7)
    # another sample size: another sample, never taken (no slice is run)
    got, seen, decisions = _downstream(model, tokenizer, out, tmp_path, monkeypatch, num_examples=4)
    assert seen == [(["mmlu"], False), (["boolq"], False)]
    assert all("num_examples" in d["reason"] and "sample" in d["reason"] for d in decisions.values())
    assert got["example"].nunique() == 4


def test_a_committed_per_layer_frame_is_taken_after_its_slice_and_a_changed_one_is_recomputed(cell, tmp_path,
                                                                                              monkeypatch):
    from cwbook.cached import cached_per_layer_curve as per_layer_curve

    model, blocks, _ = cell
    options = dict(batch_size=2, max_length=12, seed=0, cache=False)
    plain = per_layer_curve(model, None, blocks, METRICS, RATIOS, "comprehensiveness", **options)
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    seen = []

    def curve(lm, tokenizer, part, *args, **kwargs):
        seen.append((list(part["document"]), kwargs["cache"]))
        return per_layer_curve(lm, tokenizer, part, *args, **kwargs)

    def run():
        seen.clear()
        got = eb.per_layer_cell(model, None, blocks, METRICS, RATIOS, "comprehensiveness", model="tiny", data="toy",
                                profile="evidence", exports=tmp_path / "out", curve=curve, log=None, **options)
        return got, json.loads((tmp_path / "cells" / "cell-per-layer-tiny-toy.json").read_text())

    got, decision = run()
    assert seen == [([7, 3, 11, 5], False)] and decision["decision"] == "recomputed"
    pd.testing.assert_frame_equal(got, plain, check_exact=True)
    got, decision = run()
    assert seen == [([7, 3], False)] and decision["decision"] == "committed"  # the first 2 documents only
    pd.testing.assert_frame_equal(got, plain, check_exact=False, rtol=1e-7)
    table, meta = ef.read_frame(ef.PER_LAYER, "tiny", "toy", tmp_path / "out")
    assert meta["document_ids"] == [7, 3, 11, 5] and meta["settings"]["seq_len"] == 12
    table.loc[(table["document"] == 3) & (table["layer"] == 1), "nll"] *= 1 + 3e-6  # three times the allowance
    ef.write_frame(ef.PER_LAYER, table, meta, "tiny", "toy", tmp_path / "out")
    got, decision = run()
    assert seen == [([7, 3], False), ([7, 3, 11, 5], False)] and decision["decision"] == "recomputed"
    pd.testing.assert_frame_equal(got, plain, check_exact=True)


def test_a_committed_bench_frame_is_taken_after_its_slice_and_a_changed_one_is_recomputed(cell, tmp_path,
                                                                                          monkeypatch):
    """Chapter 4b's bench (faithfulness_curve per sequence, one data set) as a committed frame: written,
    taken after its first 2 documents recompute equal, recomputed when a number of the slice moved or
    when the call changes a number (another metric list is another request, ``max_length`` another setting)."""
    from cwcore import faithfulness as faith
    model, blocks, _ = cell
    metrics = ["attention", "value_zeroing", "grad_x_input", "random"]
    options = dict(batch_size=2, max_length=12, seed=0, cache=False, progress=False)
    plain = per_sequence_curve(model, None, blocks, metrics, RATIOS, per_sequence=True, **options)
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    seen = []

    def curve(lm, tokenizer, part, *args, **kwargs):
        seen.append((list(part["document"]), kwargs["cache"]))
        return per_sequence_curve(lm, tokenizer, part, *args, **kwargs)

    def run(**change):
        seen.clear()
        got = ef.bench_cell(model, None, blocks, metrics, RATIOS, model="tiny", data="toy", profile="evidence",
                            exports=tmp_path / "out", curve=curve, log=None, **{**options, **change})
        return got, json.loads((tmp_path / "cells" / "cell-bench-tiny-toy.json").read_text())

    got, decision = run()
    assert seen == [([7, 3, 11, 5], False)] and decision["decision"] == "recomputed"
    assert decision["written"] == "bench_tiny_toy.csv.gz"
    pd.testing.assert_frame_equal(got, plain, check_exact=True)
    got, decision = run()
    assert seen == [([7, 3], False)] and decision["decision"] == "committed"  # the first 2 documents only
    pd.testing.assert_frame_equal(got, plain, check_exact=False, rtol=1e-7)
    table, meta = ef.read_frame(ef.BENCH, "tiny", "toy", tmp_path / "out")
    assert meta["document_ids"] == [7, 3, 11, 5] and meta["settings"]["per_sequence"] is True
    assert meta["metrics"] == metrics and meta["rows"] == len(plain)
    table.loc[(table["document"] == 3) & (table["metric"] == "value_zeroing"), "nll"] *= 1 + 3e-6
    ef.write_frame(ef.BENCH, table, meta, "tiny", "toy", tmp_path / "out")
    got, decision = run()
    assert seen == [([7, 3], False), ([7, 3, 11, 5], False)] and decision["decision"] == "recomputed"
    pd.testing.assert_frame_equal(got, plain, check_exact=True)
    # another setting: not taken, no slice run (20, not a shorter 10: a max_length shorter than the 12-token
    # blocks is refused, since it truncates text only)
    got, decision = run(max_length=20)
    assert seen == [([7, 3, 11, 5], False)] and "max_length" in decision["reason"]
    with pytest.raises(ValueError, match="per_sequence=True"):
        ef.bench_cell(model, None, blocks, metrics, RATIOS, model="tiny", data="toy", profile="evidence",
                      per_sequence=False, log=None, **options)


def test_the_protocol_variants_frame_is_each_variants_curve_and_is_taken_after_its_slice(cell, tmp_path, monkeypatch):
    """Table 8's sweep (sensitivity_cell): one faithfulness_curve per variant, its rows under the variant's
    name (``change``) in the order of the variants, bit for bit; written, then taken after the first 2 documents
    recompute equal under every variant; recomputed when one of its numbers moved, or when a variant
    changes or is added (the variants' resolved protocols are a setting)."""
    from cwcore import faithfulness as faith
    model, blocks, _ = cell
    variants = {"default": {}, "unit = token": {"unit": "token"}, "scope = layer": {"scope": "layer"}}
    options = dict(batch_size=2, max_length=12, seed=0, cache=False, progress=False)
    plain = {name: per_sequence_curve(model, None, blocks, METRICS, RATIOS, per_sequence=True,
                                            **{**options, **change}) for name, change in variants.items()}
    assert not plain["default"]["nll"].equals(plain["unit = token"]["nll"])  # the variants differ
    monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / "cells"))
    seen = []

    def curve(lm, tokenizer, part, *args, **kwargs):
        seen.append((list(part["document"]), kwargs.get("unit", "head_key"), kwargs["cache"]))
        return per_sequence_curve(lm, tokenizer, part, *args, **kwargs)

    def run(variants=variants, **change):
        seen.clear()
        got = ef.sensitivity_cell(model, None, blocks, METRICS, RATIOS, variants=variants, model="tiny", data="toy",
                                  profile="evidence", exports=tmp_path / "out", curve=curve, log=None,
                                  **{**options, **change})
        return got, json.loads((tmp_path / "cells" / "cell-sensitivity-tiny-toy.json").read_text())

    got, decision = run()
    assert [s[1] for s in seen] == ["head_key", "token", "head_key"] and decision["decision"] == "recomputed"
    assert decision["written"] == "sensitivity_tiny_toy.csv.gz"
    want = pd.concat([f.assign(change=n)[["change", *f.columns]] for n, f in plain.items()], ignore_index=True)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    got, decision = run()
    assert [s[0] for s in seen] == [[7, 3]] * 3 and decision["decision"] == "committed"
    pd.testing.assert_frame_equal(got, want, check_exact=False, rtol=1e-7)
    table, meta = ef.read_frame(ef.SENSITIVITY, "tiny", "toy", tmp_path / "out")
    assert meta["variants"] == {n: dict(c) for n, c in variants.items()} and meta["document_ids"] == [7, 3, 11, 5]
    assert meta["settings"]["variants"]["unit = token"]["protocol"]["unit"] == "token"
    got, decision = run(dict(reversed(variants.items())))  # the same variants in another order: taken
    assert decision["decision"] == "committed"
    pd.testing.assert_frame_equal(got, pd.concat([want[want["change"] == n] for n in reversed(variants)],
                                                 ignore_index=True), check_exact=False, rtol=1e-7)
    table.loc[(table["document"] == 11) & (table["change"] == "unit = token"), "nll"] += 1e-3  # past the slice
    ef.write_frame(ef.SENSITIVITY, table, meta, "tiny", "toy", tmp_path / "out")
    got, decision = run()
    assert decision["decision"] == "committed"  # the slice check only sees documents 7 and 3
    table.loc[(table["document"] == 3) & (table["change"] == "unit = token"), "nll"] *= 1 + 3e-6
    ef.write_frame(ef.SENSITIVITY, table, meta, "tiny", "toy", tmp_path / "out")
    got, decision = run()
    assert decision["decision"] == "recomputed" and "differ" in decision["reason"]
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    got, decision = run({**variants, "unit = token": {"unit": "key"}})  # the same name, another protocol
    assert decision["decision"] == "recomputed" and "variants" in decision["reason"]
    run()  # back to the written frame of the three variants
    got, decision = run({**variants, "kind = intra": {"kind": "intra"}})
    assert decision["decision"] == "recomputed" and "variants" in decision["reason"]
    with pytest.raises(ValueError, match="per_sequence=True"):
        ef.sensitivity_cell(model, None, blocks, METRICS, RATIOS, variants=variants, model="tiny", data="toy",
                            profile="evidence", per_sequence=False, log=None, **options)


def test_provenance_names_the_cpu_kind_by_family_model_and_the_flags_that_set_its_speed():
    """Two EPYC kinds both read "AMD EPYC" (the AVX2 one and the Zen 5 one with avx512_bf16, about 1.9x
    apart on these forwards): the record keeps the first processor's family, model and speed flags."""
    zen5 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512vl\n\nprocessor\t: 1\ncpu family\t: 25\n"
            "model name\t: other\nflags\t\t: avx2\n")
    assert ef.cpu_description(zen5) == "AMD EPYC (family 26, model 2; avx2 avx512f avx512_bf16)"
    avx2 = "processor\t: 0\ncpu family\t: 23\nmodel\t\t: 49\nmodel name\t: AMD EPYC\nflags\t\t: sse2 avx2 fma\n"
    assert ef.cpu_description(avx2) == "AMD EPYC (family 23, model 49; avx2)"
    assert ef.cpu_description("Processor\t: AArch64\nModel name\t: Neoverse-V2\n") == "Neoverse-V2"
    assert ef.cpu_description("") is None
    record = eb.provenance_record(profile="evidence", models=None, only=None, wall_s=1.0,
                                  tally={"hits": 0, "misses": 0, "processes": 1}, cells=[])
    assert record["machine"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_provenance_records_the_command_line_models_and_a_run_configuration_of_its_own(tmp_path):
    """`--models smollm2-135m` arrives as a string (it was recorded letter by letter); a `--config` other than
    book/run.yml may change what the profile computes, so the record names it with its content's hash."""
    config = tmp_path / "run-subset.yml"
    config.write_text("profiles: {}\n")
    tally = {"hits": 0, "misses": 0, "processes": 1}
    record = eb.provenance_record(profile="evidence", models="smollm2-135m, gemma3-270m", only=None, wall_s=1.0,
                                  tally=tally, cells=[], config=config)
    assert record["models"] == ["smollm2-135m", "gemma3-270m"]
    import hashlib
    assert record["config"] == {"path": str(config), "sha256": hashlib.sha256(config.read_bytes()).hexdigest()}
    plain = eb.provenance_record(profile="evidence", models=None, only=None, wall_s=1.0, tally=tally, cells=[])
    assert plain["models"] is None and "config" not in plain


def test_the_export_lists_each_models_committed_frames_and_only_complete_ones(tmp_path, monkeypatch):
    """``export_and_tables`` returns the downstream and per-layer frames the notebook wrote (on the profile's
    first data set) beside the ladder exports, and leaves out a frame whose JSON is missing."""
    import cwbook as book
    from cwbook.evidence_frames import BENCH, DOWNSTREAM, PER_LAYER, frame_paths

    calls = []
    monkeypatch.setattr(eb, "export", lambda profile, model, data, *a, **k: calls.append((model, data)) or [])
    monkeypatch.setattr(eb, "copy_chapter_tables", lambda planned, out: [])
    monkeypatch.setattr(eb, "export_tables", lambda out: pytest.fail("no per-document export was written"))
    out = tmp_path / "evidence"
    models = book.load_config(ROOT / "book" / "run.yml")["profiles"]["evidence"]["models"]
    first, second = models[:2]
    p = ee.notebook_parameters("evidence", first, ROOT / "book" / "run.yml")
    complete = [*frame_paths(DOWNSTREAM, first, p["tasks"][0], out), *frame_paths(PER_LAYER, first, p["datasets"][0], out)]
    half = frame_paths(DOWNSTREAM, second, p["tasks"][0], out)[0]  # its JSON is missing: not a frame
    other_data = frame_paths(PER_LAYER, first, p["datasets"][-1], out)  # per-layer runs on the first data set only
    bench = [*frame_paths(BENCH, second, p["datasets"][-1], out)]  # chapter 4b's, one per data set
    for path in [*complete, half, *other_data, *bench]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    written = eb.export_and_tables(out, profile="evidence", models=[first, second], only="04_faith")
    assert written == [*complete, out / "STATUS.md"]  # and the status of the folder, written last
    written = eb.export_and_tables(out, profile="evidence", models=[first, second], only="04_faith,04b")
    assert sorted(written[:-1]) == sorted([*complete, *bench]) and written[-1] == out / "STATUS.md"
    status = (out / "STATUS.md").read_text()
    assert f"| {first} | {p['tasks'][0]} |  | 0 / {p['n_examples']} examples | **unreadable (" in status  # "x" is no JSON
    variants = ee.weight_variant_names(first, p)
    assert {model for model, _ in calls} == {first, second, *variants}
    assert {data for model, data in calls if model == first} == set(p["datasets"])


# -- a restarted build does not check again what this machine checked ---------------------------------
def _embedding_calls(model):
    """A list that grows by one at every forward of ``model`` (its token embedding runs once per forward)."""
    calls = []
    embedding = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding))
    return calls, embedding.register_forward_pre_hook(lambda *_: calls.append(1))


def test_a_check_this_machine_passed_is_not_run_again_until_the_rows_the_model_or_the_flag_change(cell, tmp_path,
                                                                                                 monkeypatch):
    """``make evidence`` restarted after an interruption (a new build: a new cells folder) takes a committed
    cell whose 2-document check this machine passed with the same code, model, rows and libraries without
    a forward; ``$CWCORE_RECHECK=1``, other weights or an edited row of the slice run the check again, and
    ``cache=False`` remembers nothing."""
    import copy

    model, blocks, rows = cell
    out = tmp_path / "out"
    _commit(rows, out)
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path / "cache"))
    builds = iter(range(100))

    def run(lm=model, **extra):
        monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / f"cells-{next(builds)}"))
        calls, hook = _embedding_calls(lm)
        try:
            got = eb.ladder_cell(lm, None, blocks, METRICS, RATIOS, model="tiny", data="toy", profile="evidence",
                                 exports=out, batch_size=2, progress=False, log=None, **extra)
        finally:
            hook.remove()
        folder = Path(os.environ[eb.CELLS_ENV_VAR])
        return got, json.loads((folder / "cell-tiny-toy-default.json").read_text()), len(calls)

    first, decision, forwards = run()
    assert decision["decision"] == "committed" and "checked_before" not in decision and forwards > 0
    assert len(list((tmp_path / "cache" / "checks").iterdir())) == 1
    again, decision, forwards = run()
    assert decision["decision"] == "committed" and forwards == 0  # no forward at all: the check was remembered
    assert decision["checked_before"].endswith("Z") and decision["slice_rows"] == len(rows) // 2
    pd.testing.assert_frame_equal(again, first, check_exact=True)
    monkeypatch.setenv("CWCORE_RECHECK", "1")
    _, decision, forwards = run()
    assert "checked_before" not in decision and forwards > 0
    monkeypatch.delenv("CWCORE_RECHECK")
    _, decision, forwards = run(cache=False)  # an uncached call neither reads nor remembers a check
    assert "checked_before" not in decision and forwards > 0
    other = copy.deepcopy(model)
    with torch.no_grad():
        next(other.parameters()).add_(1e-9)  # other weights: another model, though its rows may not move
    _, decision, forwards = run(other)
    assert "checked_before" not in decision and forwards > 0
    edited = rows.copy()
    edited.loc[edited.index[edited["document"] == 7][0], "nll"] += 1e-3  # a row of the slice
    _commit(edited, out)
    _, decision, forwards = run()
    assert decision["decision"] == "recomputed" and "differ" in decision["reason"]


def test_a_committed_frame_check_is_remembered_for_a_cwcore_function_and_never_for_another(cell, tmp_path,
                                                                                           monkeypatch):
    """The committed frames (here the per-layer sweep's) remember a passed check like the ladder cells, when
    the slice is computed by cwcore's own function; a caller's own function is checked every time."""
    from cwbook.cached import cached_per_layer_curve as per_layer_curve

    model, blocks, _ = cell
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path / "cache"))
    builds = iter(range(100))

    def own(*args, **kwargs):
        return per_layer_curve(*args, **kwargs)

    def run(**extra):
        monkeypatch.setenv(eb.CELLS_ENV_VAR, str(tmp_path / f"cells-{next(builds)}"))
        calls, hook = _embedding_calls(model)
        try:
            got = eb.per_layer_cell(model, None, blocks, METRICS, RATIOS, "comprehensiveness", model="tiny",
                                    data="toy", profile="evidence", exports=tmp_path / "out", log=None,
                                    batch_size=2, max_length=12, seed=0, **extra)
        finally:
            hook.remove()
        folder = Path(os.environ[eb.CELLS_ENV_VAR])
        return got, json.loads((folder / "cell-per-layer-tiny-toy.json").read_text()), len(calls)

    written, decision, forwards = run()
    assert decision["decision"] == "recomputed" and forwards > 0
    _, decision, forwards = run()
    assert decision["decision"] == "committed" and "checked_before" not in decision and forwards > 0
    taken, decision, forwards = run()
    assert decision["decision"] == "committed" and "checked_before" in decision and forwards == 0
    pd.testing.assert_frame_equal(taken, written, check_exact=False, rtol=1e-7)
    _, decision, forwards = run(curve=own)
    assert decision["decision"] == "committed" and "checked_before" not in decision and forwards > 0


def test_the_confirmatory_tables_step_keeps_every_exploratory_row(tmp_path):
    """Both samples' findings.csv is rewritten by whichever sample's tables step runs last. The confirmatory
    step listed the exploratory sample's models by its own (the two packaged models) and dropped the 192 rows
    of smollm2-135m's re-quantised weights, which only the exploratory folder holds. Now each folder's rows
    cover every model it holds a chapter table for: the exploratory rows come out as committed."""
    import shutil

    from cwbook import findings, registration

    exploratory, trial = tmp_path / "evidence", tmp_path / "confirmatory"
    shutil.copytree(findings.EVIDENCE_DIR, exploratory, ignore=shutil.ignore_patterns("*.gz"))
    shutil.copytree(findings.CONFIRMATORY_DIR, trial, ignore=shutil.ignore_patterns("*.gz"))
    committed = pd.read_csv(findings.EVIDENCE_DIR / "findings.csv")
    committed = committed[committed["sample"] == registration.EXPLORATORY].reset_index(drop=True)
    assert (committed["variant"] == "requantized").sum() > 0  # the rows the old code dropped
    ee.write_findings(trial, registration.CONFIRMATORY, {}, list(registration.CONFIRMATORY_MODELS))
    both = pd.read_csv(exploratory / "findings.csv")
    pd.testing.assert_frame_equal(both[both["sample"] == registration.EXPLORATORY].reset_index(drop=True), committed,
                                  check_dtype=False)
    assert (both["sample"] == registration.CONFIRMATORY).any()


# -- a trial run elsewhere never writes into this checkout's committed evidence ---------------------
def test_findings_of_a_folder_elsewhere_pair_with_its_own_sibling_never_the_committed_evidence(tmp_path, monkeypatch):
    """``tables(out)`` of a confirmatory folder wrote both samples' findings.csv into this checkout's
    ``data/results/evidence`` whatever ``out`` was: a trial in a temporary folder overwrote committed evidence.
    Now a folder pairs with its sibling only (``evidence`` beside ``confirmatory``)."""
    from cwbook import findings, registration

    committed = findings.EVIDENCE_DIR / "findings.csv"
    before = committed.read_bytes()
    calls = []
    monkeypatch.setattr(findings, "findings_csv",
                        lambda folder, models, profile: pd.DataFrame({"claim": ["x"], "profile": [profile]}))
    monkeypatch.setattr(findings, "combined_findings", lambda exploratory, confirmatory, models: calls.append(
        (Path(exploratory), Path(confirmatory))) or pd.DataFrame({"claim": ["both"]}))
    trial = tmp_path / "confirmatory"
    trial.mkdir()
    written = ee.write_findings(trial, registration.CONFIRMATORY, {"smollm2-135m": ["gsm8k"]}, ["smollm2-135m"])
    assert written == [trial / "findings.csv", trial / "findings.json"] and calls == []  # no sibling: nothing combined
    assert committed.read_bytes() == before
    (tmp_path / "evidence").mkdir()
    written = ee.write_findings(trial, registration.CONFIRMATORY, {"smollm2-135m": ["gsm8k"]}, ["smollm2-135m"])
    assert written == [trial / "findings.csv", trial / "findings.json", tmp_path / "evidence" / "findings.csv",
                       tmp_path / "evidence" / "findings.json"]
    assert calls == [(tmp_path / "evidence", trial)]
    assert pd.read_csv(tmp_path / "evidence" / "findings.csv")["claim"].tolist() == ["both"]
    assert committed.read_bytes() == before
    # the committed folders still pair with each other, whichever of the two is built
    assert ee.sample_folders(findings.CONFIRMATORY_DIR, registration.CONFIRMATORY) == (findings.EVIDENCE_DIR,
                                                                                         findings.CONFIRMATORY_DIR)
    assert ee.sample_folders(findings.EVIDENCE_DIR, "evidence") == (findings.EVIDENCE_DIR, findings.CONFIRMATORY_DIR)


def test_an_export_that_would_lose_committed_cells_or_their_documents_is_refused(cell, tmp_path):
    """The README's hand command (--documents 8) replaced a 64-document cell with 8 and dropped the other cells
    of the sample; --ratios 0.05 kept 1 of 12 ratios; each wrote a pair its own reader refused, or worse."""
    _, _, rows = cell
    table = rows.assign(data="toy", model="tiny", delta_nll=rows["nll"] - rows["clean_nll"])
    committed = pd.concat([table.assign(variant="token-unit"), table], ignore_index=True)
    sample = {"profile": "evidence", "seq_len": 12, "seed": 0, "dtype": "float32", "document_ids": [7, 3, 11, 5]}
    assert ee.lost_by_replacing(table, dict(sample), committed, dict(sample)) == []  # the same run: nothing lost
    fewer = table[table["document"].isin([7, 3])]
    assert ee.lost_by_replacing(fewer, {**sample, "document_ids": [7, 3]}, committed, dict(sample)) == [
        "cell default holds 2 documents the run lacks", "cells default/token-unit ran with another document_ids"]
    narrower = table[table["ratio"] == RATIOS[0]]
    assert ee.lost_by_replacing(narrower, dict(sample), committed, dict(sample)) == [
        "cell default holds 1 ratios the run lacks"]
