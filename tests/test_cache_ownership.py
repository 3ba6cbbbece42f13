"""The result cache deletes only what it wrote, and serves a piece only under the key it was written for."""
import json
import os
import shutil
import time
import warnings

import pandas as pd
import pytest

from cwcore import cache, folder_cache
from cwcore.cache import CacheWarning, ResultCache


@pytest.fixture(autouse=True)
def _caching_on(monkeypatch):
    """These tests exercise the result cache itself, which caches only when asked: asked here."""
    monkeypatch.setenv("CWCORE_CACHING", "1")


def _age(folder, seconds):
    old = time.time() - seconds
    for path in [folder, *folder.iterdir()]:
        os.utime(path, (old, old))


def test_prune_and_repair_leave_folders_the_cache_did_not_write(tmp_path):
    """A cache root pointed at a folder shaped like ``results/<a>/<b>`` holding one's own tables: prune
    (even ``everything``) and ``verify --repair`` touch none of its files; a run's foreign file survives too."""
    tables = tmp_path / "results" / "04_faithfulness" / "tables"
    tables.mkdir(parents=True)
    files = {"smollm2.csv": b"a,b\n1,2\n", "smollm2.json": b"{}", "x.parquet": b"not a piece",
             "x.parquet.sha256": b"0" * 64, ".y.tmp": b"tmp", "parameters.json": b'{"parameters": {}, "code": "c"}'}
    for name, data in files.items():
        (tables / name).write_bytes(data)
    run = ResultCache("demo", {"a": 1}, root=tmp_path)
    run.put("p", pd.DataFrame({"x": [1.0]}))
    # a user's backup of the run under another name: the cache's marker inside, but the key of another folder
    # (before, only a folder without the marker was offered, so the key half of the ownership rule went unchecked);
    # its piece edited since, so verify --repair would delete it if it took the copy for a run of its own
    backup = run.directory.parent / "my-backup"
    shutil.copytree(run.directory, backup, ignore=shutil.ignore_patterns(".in-use"))
    pd.DataFrame({"x": [5.0]}).to_parquet(backup / "p.parquet")
    kept = {p.name: p.read_bytes() for p in backup.iterdir()}
    (run.directory / "notes.txt").write_text("mine")
    for folder in (tables, run.directory, backup):
        _age(folder, 7200)
    run.release()  # done with it: not in use

    problems = cache.verify(tmp_path, repair=True)
    assert not [p for p in problems if str(tables) in p["path"] or str(backup) in p["path"]]
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == kept
    gone = cache.prune(tmp_path, everything=True)
    assert list(gone["key"]) == [run.directory.name]
    assert sorted(p.name for p in tables.iterdir()) == sorted(files)
    assert all((tables / n).read_bytes() == d for n, d in files.items())
    assert [p.name for p in run.directory.iterdir()] == ["notes.txt"]  # the cache's files went, not the user's
    assert {p.name: p.read_bytes() for p in backup.iterdir()} == kept



def test_a_users_temporary_file_in_a_run_folder_is_left_alone(tmp_path):
    """Only the cache's own temporary names (``.<piece>.parquet.<random>.tmp``) are a killed writer's
    left-overs: an hour-old ``.notes.tmp`` of the user's in a run folder survives ``verify --repair`` and
    ``prune(everything=True)`` (both deleted it before)."""
    run = ResultCache("demo", {"a": 1}, root=tmp_path)
    run.put("p", pd.DataFrame({"x": [1.0]}))
    (run.directory / ".notes.tmp").write_text("mine")
    (run.directory / ".p.parquet.k3j9x0qa.tmp").write_bytes(b"half a piece")  # a killed writer's
    _age(run.directory, 7200)
    run.release()  # done with it: not in use

    problems = cache.verify(tmp_path, repair=True)
    assert [(os.path.basename(p["path"]), p["action"]) for p in problems] == [(".p.parquet.k3j9x0qa.tmp", "deleted")]
    assert sorted(p.name for p in run.directory.iterdir()) == [".in-use", ".notes.tmp", "p.parquet",
                                                              "p.parquet.sha256", "parameters.json"]
    _age(run.directory, 7200)
    assert list(cache.prune(tmp_path, everything=True)["key"]) == [run.directory.name]
    assert [p.name for p in run.directory.iterdir()] == [".notes.tmp"]
    assert (run.directory / ".notes.tmp").read_text() == "mine"


def test_a_run_folder_with_a_damaged_record_is_reported_and_its_next_write_restores_it(tmp_path, capsys, monkeypatch):
    """A run folder whose parameters.json is truncated is not the cache's to delete, but verify no longer says
    everything verifies while its pieces go unchecked (one line, left alone, exit 1), and the next piece stored
    there writes the record again, so verify, listing and prune see the run again (before: silent for ever)."""
    from cwcore import cli

    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    run = ResultCache("demo", {"a": 1}, root=tmp_path)
    run.put("p", pd.DataFrame({"x": [1.0]}))
    record = run.directory / "parameters.json"
    record.write_bytes(record.read_bytes()[:20])
    files = {p.name: p.read_bytes() for p in run.directory.iterdir()}

    assert cli.main(["cache", "verify", "--repair"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{record}: not a run record the cache can read (damaged?): the folder's pieces are not checked and it is "
        "never pruned; delete the folder if it is the cache's [left alone]", f"1 problem(s) under {tmp_path}, 0 repaired"]
    assert {p.name: p.read_bytes() for p in run.directory.iterdir()} == files
    assert cache.result_runs(tmp_path).empty

    again = ResultCache("demo", {"a": 1}, root=tmp_path)
    again.put("q", pd.DataFrame({"x": [2.0]}))
    assert cache.run_record(run.directory)["parameters"] == {"a": 1}
    assert list(cache.result_runs(tmp_path)["pieces"]) == [2]
    assert cli.main(["cache", "verify"]) == 0
    record.unlink()  # removed while the run goes on (a prune): its next piece writes the record again
    again.put("r", pd.DataFrame({"x": [3.0]}))
    assert cache.run_record(run.directory)["parameters"] == {"a": 1}

def test_a_piece_copied_under_another_key_is_not_served(tmp_path):
    poisoned = ResultCache("demo", {"a": 1}, root=tmp_path)
    poisoned.put("p", pd.DataFrame({"x": [666.0]}))
    target = ResultCache("demo", {"a": 2}, root=tmp_path)
    target.put("other", pd.DataFrame({"x": [0.0]}))
    for name in ("p.parquet", "p.parquet.sha256"):
        shutil.copy(poisoned.directory / name, target.directory / name)
    with pytest.warns(CacheWarning, match="copied from another key"):
        assert target.get("p") is None
    poisoned.put("q", pd.DataFrame({"x": [1.0]}))  # another piece name in the same run
    for suffix in ("", ".sha256"):
        shutil.copy(poisoned.directory / f"p.parquet{suffix}", poisoned.directory / f"q.parquet{suffix}")
    with pytest.warns(CacheWarning, match="checksum does not match"):
        assert poisoned.get("q") is None


def test_an_unreadable_cache_warns_once_per_sweep(tmp_path, monkeypatch):
    store = ResultCache("demo", {"a": 1}, root=tmp_path / "c")
    for i in range(40):
        store.put(f"p{i}", pd.DataFrame({"x": [float(i)]}))
    real = type(tmp_path).read_bytes

    def denied(self):
        if self.suffix == ".parquet":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(type(tmp_path), "read_bytes", denied)
    monkeypatch.setattr(cache, "_unreadable", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert all(store.get(f"p{i}") is None for i in range(40))
    assert len([w for w in caught if issubclass(w.category, CacheWarning)]) == 1
    assert "cannot be read" in str(caught[0].message)


class SafetensorError(Exception):
    """What safetensors raises when the disk fills (its own type, no errno)."""


def test_a_full_disk_while_converting_falls_back_to_a_temporary_folder(tmp_path):
    calls = []

    def build(folder):
        calls.append(folder)
        if len(calls) == 1:  # the cache's disk is full
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                  'message: "No space left on device" })')
        (folder / "model.safetensors").write_bytes(b"w" * 10)

    with pytest.warns(CacheWarning, match="temporary folder"):
        got = folder_cache.ensure_cached_folder(tmp_path / "models" / "m", {"v": 1}, build)
    assert got != tmp_path / "models" / "m" and (got / "model.safetensors").read_bytes() == b"w" * 10
    assert not (tmp_path / "models" / "m").exists() and len(calls) == 2


def test_a_full_disk_everywhere_is_one_line_naming_the_fix(tmp_path):
    def build(folder):
        raise SafetensorError("IoError: No space left on device")

    with pytest.warns(CacheWarning):
        with pytest.raises(folder_cache.ModelCacheError, match="no space left on the device to convert m.*CWCORE_CACHE"):
            folder_cache.ensure_cached_folder(tmp_path / "models" / "m", {"v": 1}, build)
    with pytest.raises(ValueError, match="unrelated"):  # any other failure is not taken for a full disk
        folder_cache.ensure_cached_folder(tmp_path / "models" / "n", {"v": 1}, lambda f: (_ for _ in ()).throw(ValueError("unrelated")))


def test_verify_leaves_a_users_model_folder_and_a_piece_without_checksum_alone(tmp_path, monkeypatch):
    """``cwcore cache verify --repair`` deleted a folder under ``models/`` that has no ``cwcore-cache.json``
    (the user's own weights), an old ``.my-notes.tmp-keep`` folder (its test for a killed conversion was
    ``".tmp-" in name``), and a run folder's ``mydata.parquet`` that has no checksum (the cache writes the
    checksum first, so such a file is never its); ``prune`` deleted the parquet too. The control: a damaged
    model folder the cache wrote, and a killed conversion's temporary folder, are still deleted."""
    from cwcore import models

    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    base = models.model_cache_dir()
    mine = base / "my-own-model"
    mine.mkdir(parents=True)
    (mine / "weights.bin").write_bytes(b"mine")
    notes = base / ".my-notes.tmp-keep"
    notes.mkdir()
    damaged = base / "converted-model"
    damaged.mkdir()
    (damaged / folder_cache.CACHE_MARKER).write_text("{not json")
    killed = base / ".converted-model.tmp-k3j9x0qa"
    killed.mkdir()
    for folder in (notes, killed):
        _age(folder, 3 * 86400)
    problems = {os.path.basename(p["path"]): p["action"] for p in models.verify_models(repair=True)}
    assert problems == {"my-own-model": "left alone", "converted-model": "deleted",
                        ".converted-model.tmp-k3j9x0qa": "deleted"}
    assert (mine / "weights.bin").read_bytes() == b"mine" and notes.is_dir()
    assert not damaged.exists() and not killed.exists()

    run = ResultCache("demo", {"a": 1}, root=tmp_path)
    run.put("p", pd.DataFrame({"x": [1.0]}))
    pd.DataFrame({"y": [2]}).to_parquet(run.directory / "mydata.parquet")
    _age(run.directory, 7200)
    run.release()
    actions = {os.path.basename(p["path"]): p["action"] for p in cache.verify(tmp_path, repair=True)}
    assert actions == {"mydata.parquet": "left alone"}
    assert list(cache.prune(tmp_path, everything=True)["key"]) == [run.directory.name]
    assert [p.name for p in run.directory.iterdir()] == ["mydata.parquet"]
