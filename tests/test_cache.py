import gc
import os
from pathlib import Path

import pandas as pd
import pytest

from cwcore.cache import ResultCache, atomic_write_bytes, parameters_key


@pytest.fixture(autouse=True)
def _caching_on(monkeypatch):
    """These tests exercise the result cache itself, which caches only when asked: asked here."""
    monkeypatch.setenv("CWCORE_CACHING", "1")


def test_key_depends_on_every_parameter_and_not_on_order():
    base = {"model": "m", "ratios": [0.1, 0.2], "seed": 0}
    assert parameters_key(base) == parameters_key(dict(reversed(list(base.items()))))
    for changed in ({"model": "n"}, {"ratios": [0.1, 0.3]}, {"seed": 1}):
        assert parameters_key({**base, **changed}) != parameters_key(base)


def test_pieces_round_trip_and_compute_once(tmp_path):
    cache = ResultCache("demo", {"a": 1}, root=tmp_path)
    calls = []

    def compute():
        calls.append(1)
        return pd.DataFrame({"x": [1.5, 2.5]})

    first = cache.get_or_compute("piece", compute)
    again = ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("piece", compute)
    pd.testing.assert_frame_equal(first, again)
    assert len(calls) == 1
    assert ResultCache("demo", {"a": 2}, root=tmp_path).get("piece") is None


def test_interrupted_write_leaves_no_piece(tmp_path, monkeypatch):
    target = tmp_path / "out.parquet"

    def failing_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(target, b"data")
    assert list(tmp_path.iterdir()) == []


def _age(folder: Path, seconds: float) -> None:
    """Make every file of a run look ``seconds`` old."""
    import time

    for f in folder.iterdir():
        os.utime(f, (time.time() - seconds, time.time() - seconds))


def test_prune_deletes_runs_of_other_code_versions_only(tmp_path, capsys, monkeypatch):
    import json

    from cwcore import cli
    from cwcore.cache import code_version, prune, result_runs

    current = ResultCache("demo", {"a": 1}, root=tmp_path)
    current.put("p0", pd.DataFrame({"x": [1.0]}))
    old = ResultCache("demo", {"a": 2}, root=tmp_path)
    old.put("p0", pd.DataFrame({"x": [2.0]}))
    old.put("p1", pd.DataFrame({"x": [3.0]}))
    meta = old.directory / "parameters.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "code": "an-older-version"}))
    fresh_old = ResultCache("other", {"b": 1}, root=tmp_path)  # stale, but being written right now
    fresh_old.put("p0", pd.DataFrame({"x": [4.0]}))
    fresh_meta = fresh_old.directory / "parameters.json"
    fresh_meta.write_text(json.dumps({**json.loads(fresh_meta.read_text()), "code": "older"}))
    for run in (current, old):
        _age(run.directory, 3600)
    for run in (current, old, fresh_old):
        run.release()  # done with them: not in use
    # before, `fresh_old` kept its lock, so it was spared as "in use" and the age rule was never what spared it;
    # released, only its age (written just now) can keep it
    (tmp_path / "models").mkdir()  # converted models are never touched
    (tmp_path / "models" / "weights.safetensors").write_bytes(b"w")

    runs = result_runs(tmp_path).set_index("key")
    assert runs.loc[current.directory.name, "current"] and not runs.loc[old.directory.name, "current"]
    assert runs.loc[old.directory.name, "pieces"] == 2
    assert runs.loc[old.directory.name, "bytes"] == sum(f.stat().st_size for f in old.directory.iterdir())

    would = prune(tmp_path, dry_run=True)
    assert list(would["key"]) == [old.directory.name] and old.directory.exists()
    gone = prune(tmp_path)
    assert list(gone["key"]) == [old.directory.name]
    assert not old.directory.exists() and current.directory.exists() and fresh_old.directory.exists()
    assert current.get("p0")["x"].tolist() == [1.0] and (tmp_path / "models" / "weights.safetensors").exists()
    current.release()
    assert code_version() in (current.directory / "parameters.json").read_text()

    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "1 runs (1 current)" in out
    _age(current.directory, 3600)
    assert cli.main(["cache", "prune", "--all"]) == 0
    out = capsys.readouterr().out
    assert "deleted 1 cached run(s)" in out  # `other` is too recent to touch, and that is said
    assert "spared 1 run(s) written in the last minute" in out
    assert not current.directory.exists() and fresh_old.directory.exists()


def test_prune_leaves_a_run_in_use_however_long_its_piece_takes(tmp_path, monkeypatch, capsys):
    # before: a run whose current piece took longer than a minute looked abandoned, and prune --all deleted
    # the pieces it had finished while it computed on
    from cwcore import cli
    from cwcore.cache import IN_USE, prune

    busy = ResultCache("demo", {"a": 1}, root=tmp_path)
    busy.put("p0", pd.DataFrame({"x": [1.0]}))
    idle = ResultCache("demo", {"a": 2}, root=tmp_path)
    idle.put("p0", pd.DataFrame({"x": [2.0]}))
    busy_directory, idle_directory = busy.directory, idle.directory
    del idle  # its process is done with it
    gc.collect()
    for folder in (busy_directory, idle_directory):
        _age(folder, 3600)
    assert list(prune(tmp_path, everything=True, dry_run=True)["key"]) == [idle_directory.name]
    gone = prune(tmp_path, everything=True)
    assert list(gone["key"]) == [idle_directory.name] and not idle_directory.exists()  # the control
    assert busy.get("p0")["x"].tolist() == [1.0] and (busy_directory / IN_USE).is_file()
    assert gone.attrs["in_use"] == 1  # spared, and said: `cwcore cache prune` printed only "deleted 0"
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    assert cli.main(["cache", "prune", "--all"]) == 0
    out = capsys.readouterr().out
    assert "deleted 0 cached run(s)" in out and "spared 1 run(s) a running process is using" in out
    del busy  # the run ends: its lock goes with it
    gc.collect()
    assert list(prune(tmp_path, everything=True)["key"]) == [busy_directory.name] and not busy_directory.exists()


def test_a_run_in_use_by_another_process_is_left_alone(tmp_path):
    import multiprocessing

    from cwcore.cache import prune

    context = multiprocessing.get_context("fork")
    ready, done = context.Event(), context.Event()

    def hold():
        cache = ResultCache("demo", {"a": 1}, root=tmp_path)
        cache.put("p0", pd.DataFrame({"x": [1.0]}))
        ready.set()
        done.wait(60)

    child = context.Process(target=hold)
    child.start()
    try:
        assert ready.wait(60)
        folder = next((tmp_path / "results" / "demo").iterdir())
        _age(folder, 3600)
        assert prune(tmp_path, everything=True).empty and folder.exists()
    finally:
        done.set()
        child.join(60)
    assert list(prune(tmp_path, everything=True)["key"]) == [folder.name]  # its process ended


def test_prune_on_a_file_system_without_locks_falls_back_to_the_age_rule(tmp_path, monkeypatch):
    import errno

    from cwcore import cache

    run = ResultCache("demo", {"a": 1}, root=tmp_path)
    run.put("p0", pd.DataFrame({"x": [1.0]}))
    run.release()
    _age(run.directory, 3600)

    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cache.fcntl, "flock", no_locks)
    # before, only an old run was offered: nothing showed that the age rule is what spares a fresh one here
    fresh = ResultCache("demo", {"a": 2}, root=tmp_path)
    fresh.put("p0", pd.DataFrame({"x": [2.0]}))
    fresh.release()  # its lock could not protect it anyway: flock fails
    assert list(cache.prune(tmp_path, everything=True)["key"]) == [run.directory.name]  # not taken for "in use"
    assert not run.directory.exists() and fresh.directory.exists() and fresh.get("p0")["x"].tolist() == [2.0]
