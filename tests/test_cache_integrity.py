"""Caches that cannot silently go wrong: checksummed pieces and converted models, damaged
files recomputed with a warning, unwritable caches degrading to uncached runs, the user's umask, stale
partial files, `cwcore cache verify`."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch

import cwbook as book

from cwcore import cache, cli, folder_cache, models, runs
from cwcore.cache import CacheWarning, ResultCache, atomic_write_bytes


@pytest.fixture(autouse=True)
def _caching_on(monkeypatch):
    """These tests exercise the result cache itself, which caches only when asked: asked here."""
    monkeypatch.setenv("CWCORE_CACHING", "1")

FRAME = pd.DataFrame({"x": [1.5, 2.5, 3.5], "name": ["a", "b", "c"]})


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Every test starts with no cache marked unwritable and no model marked verified."""
    monkeypatch.setattr(cache, "_unwritable", {})
    monkeypatch.setattr(folder_cache, "_verified", {})
    monkeypatch.delenv("CWCORE_NO_CACHE", raising=False)


def counting(frame=FRAME):
    calls = []

    def compute():
        calls.append(1)
        return frame.copy()

    return compute, calls


# --------------------------------------------------------------------------------------------------
# pieces: checksum written with the piece, damage detected, deleted and recomputed
# --------------------------------------------------------------------------------------------------
def test_piece_carries_the_sha256_of_its_bytes(tmp_path):
    import hashlib

    store = ResultCache("demo", {"a": 1}, root=tmp_path)
    store.put("p", FRAME)
    piece = store.directory / "p.parquet"
    place = f"cwcore-piece:demo/{store.directory.name}/p.parquet\n".encode()
    assert (store.directory / "p.parquet.sha256").read_text().strip() == hashlib.sha256(place + piece.read_bytes()).hexdigest()
    assert cache.verify_piece(piece) is None


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, problem", [
    (_truncate, "checksum does not match"),
    (_flip, "checksum does not match"),
    (lambda p: p.with_name(p.name + ".sha256").unlink(), "no checksum"),
    (lambda p: (p.write_bytes(b"not parquet"),
                p.with_name(p.name + ".sha256").write_text(cache.piece_checksum(p, b"not parquet"))),
     "not a readable table"),
])
def test_a_damaged_piece_is_deleted_and_recomputed_with_a_warning(tmp_path, damage, problem):
    compute, calls = counting()
    first = ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute)
    piece = ResultCache("demo", {"a": 1}, root=tmp_path).directory / "p.parquet"
    damage(piece)
    assert problem in cache.verify_piece(piece)
    with pytest.warns(CacheWarning, match=f"damaged .*{problem}.*computing it again"):
        again = ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute)
    pd.testing.assert_frame_equal(first, again)
    assert len(calls) == 2  # computed again, not read from the damaged file
    assert cache.verify_piece(piece) is None  # and stored soundly
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute)
    assert len(calls) == 2


def test_a_damaged_part_makes_its_batch_compute_again(tmp_path):
    batches = [torch.full((2, 3), i) for i in range(3)]
    calls = []

    def compute(batch):
        calls.append(int(batch[0, 0]))
        return {"x": pd.DataFrame({"v": [int(batch[0, 0])]}), "y": pd.DataFrame({"w": [2 * int(batch[0, 0])]})}

    store = runs.PieceStore("demo", {"p": 1}, cache_root=tmp_path)
    list(runs.for_each_batch(batches, compute, store, show_progress=False))
    _flip(store.directory / f"{runs.tensor_digest(batches[1])}.y.parquet")
    with pytest.warns(CacheWarning, match="damaged"):
        got = [f["y"]["w"].item() for _, f in runs.for_each_batch(batches, compute, store, show_progress=False)]
    assert got == [0, 2, 4] and calls == [0, 1, 2, 1]


def test_a_writer_killed_between_checksum_and_piece_leaves_a_missing_piece(tmp_path, monkeypatch):
    store = ResultCache("demo", {"a": 1}, root=tmp_path)
    store.put("other", FRAME)  # parameters.json exists
    real = cache.atomic_write_bytes
    written = []

    def dies_on_the_piece(path, data):
        if Path(path).suffix == ".parquet":
            raise KeyboardInterrupt
        written.append(Path(path).name)
        real(path, data)

    monkeypatch.setattr(cache, "atomic_write_bytes", dies_on_the_piece)
    with pytest.raises(KeyboardInterrupt):
        store.put("p", FRAME)
    monkeypatch.setattr(cache, "atomic_write_bytes", real)
    assert written == ["p.parquet.sha256"] and not (store.directory / "p.parquet").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing piece is not damage: no warning
        assert store.get("p") is None


# --------------------------------------------------------------------------------------------------
# unwritable caches and uncached runs on request
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC, errno.EACCES])
@pytest.mark.parametrize("where", ["replace", "mkstemp"])
def test_an_unwritable_cache_runs_uncached_with_one_warning(tmp_path, monkeypatch, code, where):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os if where == "replace" else tempfile, where, refuse)
    batches = [torch.full((1, 2), i) for i in range(5)]
    calls = []

    def compute(batch):
        calls.append(int(batch[0, 0]))
        return {"x": pd.DataFrame({"v": [int(batch[0, 0])]})}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two stores (two experiments of one notebook) on the same cache root
            store = runs.PieceStore("demo", {"p": len(calls)}, cache_root=tmp_path)
            got = [f["x"]["v"].item() for _, f in runs.for_each_batch(batches, compute, store, show_progress=False)]
            assert got == [0, 1, 2, 3, 4]
    mine = [w for w in caught if issubclass(w.category, CacheWarning)]
    assert len(mine) == 1, [str(w.message) for w in mine]
    assert "cannot be written" in str(mine[0].message) and "uncached" in str(mine[0].message)
    assert calls == [0, 1, 2, 3, 4] * 2
    assert not list(tmp_path.rglob("*.parquet"))


def _caught(call):
    """(the CacheWarnings ``call`` issues, the line of this file that called it)."""
    import inspect

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_back.f_lineno
        call()
    return [w for w in caught if issubclass(w.category, CacheWarning)], line


def test_a_cache_warning_names_the_users_line(tmp_path, monkeypatch):
    compute, _ = counting()
    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only")))
        patched.setattr(cache, "_unwritable", {})
        mine, line = _caught(lambda: ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute))
    assert len(mine) == 1 and "cannot be written" in str(mine[0].message)
    assert (mine[0].filename, mine[0].lineno) == (__file__, line)  # not a line of cwcore/cache.py

    # a damaged piece, read through the cache's own frames
    ResultCache("demo", {"a": 2}, root=tmp_path / "sound").get_or_compute("p", compute)
    _truncate(ResultCache("demo", {"a": 2}, root=tmp_path / "sound").directory / "p.parquet")
    mine, line = _caught(lambda: ResultCache("demo", {"a": 2}, root=tmp_path / "sound").get_or_compute("p", compute))
    assert len(mine) == 1 and "was damaged" in str(mine[0].message)
    assert (mine[0].filename, mine[0].lineno) == (__file__, line)


def test_user_stacklevel_skips_cwcore_torch_and_the_standard_library():
    """A warning raised in cwcore, called from torch's frames (a hook, a forward) and the standard library's,
    names the user's line; with no user frame on the stack, the warning's own line."""
    import functools
    import threading

    scope = {}
    exec(compile("import warnings\nfrom cwcore.cache import CacheWarning, user_stacklevel\n"
                 "def warner():\n    warnings.warn('x', CacheWarning, stacklevel=user_stacklevel())\n",
                 str(Path(cache.__file__).parent / "_a_warner.py"), "exec"), scope)
    exec(compile("def through(f):\n    return f()\n", str(Path(torch.__file__).parent / "_a_caller.py"), "exec"),
         scope)
    mine, line = _caught(lambda: scope["through"](functools.partial(scope["warner"])))
    assert (mine[0].filename, mine[0].lineno) == (__file__, line)
    with warnings.catch_warnings(record=True) as caught:  # a thread's stack holds no user frame
        warnings.simplefilter("always")
        thread = threading.Thread(target=scope["through"], args=(scope["warner"],))
        thread.start()
        thread.join()
    assert [(w.filename, w.lineno) for w in caught] == [(str(Path(cache.__file__).parent / "_a_warner.py"), 4)]


def test_a_real_read_only_folder_runs_uncached(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as root: permission bits do not stop writes (the monkeypatched test covers it)")
        compute, calls = counting()
        with pytest.warns(CacheWarning, match="cannot be written"):
            ResultCache("demo", {"a": 1}, root=locked).get_or_compute("p", compute)
        assert calls == [1]
    finally:
        locked.chmod(0o700)


def test_no_cache_environment_variable_reads_and_writes_nothing(tmp_path, monkeypatch):
    compute, calls = counting()
    ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute)
    monkeypatch.setenv("CWCORE_NO_CACHE", "1")
    store = runs.PieceStore("demo", {"a": 2}, cache_root=tmp_path)
    store.put("q", FRAME)
    assert store.get("q") is None and not store.directory.exists()
    ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute)
    assert len(calls) == 2  # the stored piece was not read either
    monkeypatch.setenv("CWCORE_NO_CACHE", "0")
    ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("p", compute)
    assert len(calls) == 2


def test_cli_no_cache_flag_sets_the_variable(monkeypatch, capsys):
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert cli.main(["models", "--no-cache"]) == 0
    assert os.environ["CWCORE_NO_CACHE"] == "1" and cache.caching_disabled()


# --------------------------------------------------------------------------------------------------
# file modes follow the umask
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_written_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "plain.txt", b"x")
        store = ResultCache("demo", {"a": 1}, root=tmp_path / "cache")
        store.put("p", FRAME)
        files = [tmp_path / "plain.txt", store.directory / "p.parquet", store.directory / "p.parquet.sha256",
                 store.directory / "parameters.json"]
        for f in files:
            assert f.stat().st_mode & 0o777 == 0o666 & ~umask, (f, oct(f.stat().st_mode))
    finally:
        os.umask(old)


# --------------------------------------------------------------------------------------------------
# cwcore cache verify
# --------------------------------------------------------------------------------------------------
def test_cache_verify_reports_one_line_per_problem_and_repairs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    store = ResultCache("demo", {"a": 1}, root=tmp_path)
    for name in ("good", "short", "flipped"):
        store.put(name, FRAME)
    assert cli.main(["cache", "verify"]) == 0
    assert "verifies" in capsys.readouterr().out
    _truncate(store.directory / "short.parquet")
    _flip(store.directory / "flipped.parquet", 0.3)
    leftover = store.directory / ".p.parquet.abc.tmp"
    leftover.write_bytes(b"half")
    os.utime(leftover, (time.time() - 7200, time.time() - 7200))

    assert cli.main(["cache", "verify"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and "3 problem(s)" in lines[-1], lines
    assert any("short.parquet: its checksum does not match" in line and "[would delete]" in line for line in lines)
    assert any("flipped.parquet" in line for line in lines) and any("killed writer" in line for line in lines)
    assert (store.directory / "short.parquet").exists()  # only reported

    assert cli.main(["cache", "verify", "--repair"]) == 0
    assert "3 repaired" in capsys.readouterr().out
    assert sorted(p.name for p in store.directory.glob("*.parquet")) == ["good.parquet"]
    assert cli.main(["cache", "verify"]) == 0
    compute, calls = counting()
    store.get_or_compute("short", compute)
    assert calls == [1]



def test_repair_of_a_read_only_cache_says_it_could_not_delete(tmp_path, monkeypatch, capsys):
    """A damaged piece that cannot be deleted (a read-only cache) is not reported as deleted and repaired:
    ``verify --repair`` names the reason and exits 1, and a read says it could not delete the piece (both
    said 'deleted' before, and the repair exited 0)."""
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    store = ResultCache("demo", {"a": 1}, root=tmp_path)
    store.put("short", FRAME)
    _truncate(store.directory / "short.parquet")
    size = (store.directory / "short.parquet").stat().st_size
    unlink = Path.unlink

    def read_only(self, missing_ok=False):
        if self.parent == store.directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", read_only)
    assert cli.main(["cache", "verify", "--repair"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"{store.directory / 'short.parquet'}: its checksum does not match (truncated, overwritten, or "
                     f"copied from another key or piece: {size} bytes) [could not delete: Read-only file system]",
                     f"1 problem(s) under {tmp_path}, 0 repaired"]
    with pytest.warns(CacheWarning, match=r"could not delete it \(Read-only file system\), computing it again"):
        assert store.get("short") is None
    assert (store.directory / "short.parquet").exists()


def test_a_file_in_place_of_the_cache_folder_is_named_as_such(tmp_path, monkeypatch):
    """caching() pointed at a file: the run goes on uncached with one warning that says a file stands in the
    way (it advised fixing the folder's permissions), and the result is the computed one."""
    monkeypatch.setattr(cache, "_unreadable", {})
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    compute, calls = counting()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with cache.caching(blocker):
            for _ in range(2):
                pd.testing.assert_frame_equal(ResultCache("demo", {"a": 1}).get_or_compute("p", compute), FRAME)
    assert calls == [1, 1]
    assert [str(w.message) for w in caught] == [
        f"cwcore: the result cache {blocker} cannot be read (Not a directory: p.parquet); its pieces are computed "
        "again (a file stands where the cache's folder or one inside it should be: point caching() or $CWCORE_CACHE "
        "at a folder, or set CWCORE_NO_CACHE=1)"]

# --------------------------------------------------------------------------------------------------
# converted models: checksums in the marker, damage detected and converted again
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def tiny_packaged(tmp_path, monkeypatch):
    """`smollm2-135m` stands for a tiny Llama converted in seconds into a temporary CWCORE_CACHE."""
    from test_models import tiny_llama, tiny_tokenizer

    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    calls = []

    def convert(locate, folder):
        calls.append(1)
        tiny_llama().save_pretrained(folder)
        tiny_tokenizer(with_pad=True).save_pretrained(folder)
        return {"note": "tiny"}

    monkeypatch.setitem(models._GGUF_SOURCES, "smollm2-135m", lambda: ({"package": "tiny", "version": 1}, None))
    monkeypatch.setattr(models, "_convert_gguf", convert)
    return tmp_path / "cache" / "models" / "smollm2-135m", calls


def test_marker_lists_every_file_with_its_checksum(tiny_packaged):
    folder, calls = tiny_packaged
    assert models.packaged_model_path("smollm2-135m") == folder and calls == [1]
    marker = json.loads((folder / models.CACHE_MARKER).read_text())
    names = sorted(p.name for p in folder.iterdir() if p.name != models.CACHE_MARKER)
    assert sorted(marker["files"]) == names and "model.safetensors" in names
    assert marker["files"]["model.safetensors"]["size"] == (folder / "model.safetensors").stat().st_size
    assert models.verify_cached_folder(folder) is None


@pytest.mark.parametrize("damage, problem", [(_truncate, "truncated"), (_flip, "overwritten in place")])
def test_a_damaged_converted_model_is_converted_again(tiny_packaged, damage, problem):
    folder, calls = tiny_packaged
    model, tokenizer = models.load_model("smollm2-135m")
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        reference = model(ids).logits
    damage(folder / "model.safetensors")
    assert problem in models.verify_cached_folder(folder)
    with pytest.warns(CacheWarning, match=f"{folder}.*damaged.*{problem}.*converting it again"):
        again, _ = models.load_model("smollm2-135m")
    assert calls == [1, 1]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, reference, rtol=0, atol=0)
    assert models.verify_cached_folder(folder) is None
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # the damaged copy is gone


def test_an_old_marker_without_checksums_is_converted_again(tiny_packaged):
    folder, calls = tiny_packaged
    models.packaged_model_path("smollm2-135m")
    marker = json.loads((folder / models.CACHE_MARKER).read_text())
    marker["format"] = 1
    del marker["files"]
    (folder / models.CACHE_MARKER).write_text(json.dumps(marker))
    models.packaged_model_path("smollm2-135m")
    assert calls == [1, 1] and models.verify_cached_folder(folder) is None


def _refuse_writes(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(folder_cache, "_displace", refuse)


def test_a_damaged_model_in_a_read_only_cache_is_one_line_from_explain(tiny_packaged, monkeypatch, tmp_path, capsys):
    folder, calls = tiny_packaged
    models.packaged_model_path("smollm2-135m")
    _truncate(folder / "model.safetensors")
    _refuse_writes(monkeypatch)
    capsys.readouterr()
    code = cli.main(["explain", "the cat sat", "--out", str(tmp_path / "f.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 2, err  # the warning and the error, one line each
    assert err[0].startswith(f"cwcore: the converted model at {folder} is damaged") and "converting it again" in err[0]
    assert err[1].startswith("cwcore: error: the converted model at") and "cache verify --repair" in err[1]
    with pytest.raises(models.ModelCacheError):  # --debug: the real exception, with its traceback
        with pytest.warns(CacheWarning):
            cli.main(["explain", "the cat sat", "--out", str(tmp_path / "f.png"), "--debug"])


def test_a_read_only_model_cache_converts_into_a_temporary_folder(tiny_packaged, monkeypatch):
    folder, calls = tiny_packaged
    real = tempfile.mkdtemp

    def refuse_in_cache(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == folder.parent:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", refuse_in_cache)
    monkeypatch.setattr(folder_cache, "_uncached_builds", {})
    with pytest.warns(CacheWarning, match="cannot be written.*temporary folder"):
        path = models.packaged_model_path("smollm2-135m")
    assert path != folder and models.verify_cached_folder(path) is None and not folder.exists()
    assert models.packaged_model_path("smollm2-135m") == path and calls == [1]  # once per process


def test_cache_verify_repairs_a_damaged_model(tiny_packaged, monkeypatch, capsys):
    folder, calls = tiny_packaged
    models.packaged_model_path("smollm2-135m")
    _flip(folder / "model.safetensors")
    incomplete = folder.parent / "gemma3-270m"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    assert cli.main(["cache", "verify"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith(f"{folder}: model.safetensors does not match") and "would convert again" in line
               for line in lines), lines
    assert any(str(incomplete) in line and "no valid" in line for line in lines)
    monkeypatch.setitem(models._GGUF_SOURCES, "gemma3-270m", lambda: ({"package": "tiny-gemma"}, None))
    assert cli.main(["cache", "verify", "--repair"]) == 0
    out = capsys.readouterr().out
    assert out.count("[converted again]") == 2, out
    assert calls == [1, 1, 1] and models.verify_cached_folder(folder) is None


def test_verification_is_fast_and_once_per_process(tiny_packaged, monkeypatch):
    folder, calls = tiny_packaged
    models.packaged_model_path("smollm2-135m")
    hashed = []
    real = folder_cache._hash_file
    monkeypatch.setattr(folder_cache, "_hash_file", lambda path, algorithm: hashed.append(path.name) or real(path, algorithm))
    folder_cache._verified.clear()
    models.packaged_model_path("smollm2-135m")
    models.packaged_model_path("smollm2-135m")
    assert sorted(hashed) == sorted(json.loads((folder / models.CACHE_MARKER).read_text())["files"])
    os.utime(folder / "model.safetensors")  # a changed file is hashed again
    models.packaged_model_path("smollm2-135m")
    assert hashed.count("model.safetensors") == 2


def test_an_empty_model_folder_says_there_is_no_config(tmp_path, capsys):
    empty = tmp_path / "my-model"
    empty.mkdir()
    with pytest.raises(models.ModelNotFoundError, match=f"no config.json in {empty} \\(the folder is empty\\)"):
        models.load_model(str(empty))
    (empty / "weights.bin").write_bytes(b"")
    capsys.readouterr()
    assert cli.main(["explain", "the cat", "--model", str(empty), "--out", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cwcore: error: no config.json in {empty} (it holds weights.bin): a model folder holds "
                   "config.json and the weights, as written by save_pretrained"]


# --------------------------------------------------------------------------------------------------
# the book: stale partial copies, modes of executed copies
# --------------------------------------------------------------------------------------------------
def test_stale_partial_copies_are_removed_and_live_ones_kept(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "generated" / "03"
    folder.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = folder / f".smollm2.{dead.pid}.abc123.partial.ipynb"
    live = folder / f".smollm2.{os.getppid()}.def456.partial.ipynb"
    old_style = folder / ".smollm2.xyz789.partial.ipynb"  # written by an older cwcore: no pid
    young_old_style = folder / ".gemma.uvw000.partial.ipynb"
    for f in (stale, live, old_style, young_old_style):
        f.write_text("{}")
    os.utime(old_style, (time.time() - 7200, time.time() - 7200))
    removed = book.remove_stale_partials(tmp_path / "generated")
    assert sorted(removed) == sorted([stale, old_style])
    assert live.exists() and young_old_style.exists()


def test_a_build_removes_a_killed_builds_partial_copy_and_writes_with_the_umask(tmp_path, capsys):
    import subprocess
    import sys

    import yaml
    from test_book import write_notebook

    nbdir = tmp_path / "notebooks"
    write_notebook(nbdir / "01_once.ipynb", "seed = 0", "print(seed)")
    bookdir = tmp_path / "book"
    bookdir.mkdir()
    (bookdir / "run.yml").write_text(yaml.safe_dump({"chapters": [{"notebook": "01_once"}],
                                                     "profiles": {"p": {"params": {"seed": 1}}}}))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = bookdir / "generated" / f".01_once.{dead.pid}.k1ll3d.partial.ipynb"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")
    old = os.umask(0o027)
    try:
        book.build(profile="p", book_dir=bookdir, notebooks_dir=nbdir, html=False)
    finally:
        os.umask(old)
    assert not stale.exists() and "removed 1 partial copies left by a killed build" in capsys.readouterr().out
    executed = bookdir / "generated" / "01_once.ipynb"
    assert executed.stat().st_mode & 0o777 == 0o640
    assert not list((bookdir / "generated").glob(".*partial*"))
