"""Sweeps split over torch.distributed ranks return the single-process frame, bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from cwbook import analysis
from cwcore import runs
from cwcore.cache import caching
from cwcore import faithfulness as fa
from cwcore.faithfulness.layers import per_layer_curve
from tiny_models import VOCAB, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _ids(rows=10, length=12, seed=0):
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _curve(model, ids):
    return fa.faithfulness_curve(model, None, ids, metric=["attention", "contribution", "random"], ratios=[0, 0.2, 0.5],
                                 batch_size=2, progress=False).per_sequence


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks are single-threaded; the reference is too
    yield
    torch.set_num_threads(threads)


def test_shard_map_splits_items_round_robin_over_forked_ranks_and_keeps_the_order(monkeypatch):
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    got = runs.shard_map(range(5), lambda i: (i * i, os.getpid()))
    assert [v for v, _ in got] == [0, 1, 4, 9, 16]
    pids = [p for _, p in got]
    assert pids[0::2] == [os.getpid()] * 3  # rank 0 is this process
    assert len(set(pids[1::2])) == 1 and pids[1] != os.getpid()  # rank 1 is one forked helper
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed"):
        runs.shard_map(range(4), lambda i: 1 / (i % 2 - 1))  # rank 1's items divide by zero


def test_a_forked_rank_killed_mid_sweep_is_one_clear_error(monkeypatch):
    """A helper rank killed outright (the out-of-memory killer's SIGKILL) or leaving with an exit status ends the
    sweep in one sentence naming the rank and how it ended (it was gloo's 'Connection closed by peer ... GLHF'),
    and the next sweep of this process runs."""
    import re
    import signal

    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    parent = os.getpid()

    def killed(i):
        if os.getpid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return i

    def leaves(i):
        if os.getpid() != parent:
            os._exit(3)
        return i

    advice = ("during the sweep, so its share of the results never came back; run it again (finished cached pieces "
              "are kept), or with fewer ranks ($CWCORE_JOBS=1 runs in this process alone)")
    with pytest.raises(RuntimeError) as killed_error:
        runs.shard_map(range(4), killed)
    assert str(killed_error.value) == ("$CWCORE_JOBS: rank 1 of 2 was killed by SIGKILL (out of memory, or killed "
                                       f"from outside) {advice}")
    with pytest.raises(RuntimeError, match=re.escape(f"$CWCORE_JOBS: rank 1 of 2 exited with status 3 {advice}")):
        runs.shard_map(range(4), leaves)
    assert runs.shard_map(range(3), lambda i: i * 10) == [0, 10, 20]

_DIES_BEFORE_JOINING = """
import os, sys
from cwcore import runs
runs._die_with_parent = lambda: os._exit(5)  # the forked rank is gone before it joins the group
try:
    runs.shard_map(range(4), lambda i: i)
except RuntimeError as err:
    print(err)
"""


def _run_with_two_ranks(script: str, timeout: float) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter with $CWCORE_JOBS=2; a failure if it runs past ``timeout`` seconds
    (rank 0 still waiting for a forked rank that was gone)."""
    env = {**os.environ, runs.JOBS_ENV_VAR: "2", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 still waited for a forked rank that was gone")


def test_a_forked_rank_gone_before_joining_is_one_clear_error_not_a_wait_of_a_day(tmp_path):
    """Rank 0 waited for a rank that died before joining the group for $CWCORE_RANK_TIMEOUT (a day); now it says
    which rank and how it ended, at once (the subprocess is given 60 s: before the fix it ran out of them)."""
    done = _run_with_two_ranks(_DIES_BEFORE_JOINING, timeout=60)
    assert done.stdout.strip() == ("$CWCORE_JOBS: rank 1 of 2 exited with status 5 before it joined the sweep; run "
                                   "it again, or with fewer ranks ($CWCORE_JOBS=1 runs in this process alone)"), done.stderr

def test_two_forked_ranks_give_the_single_process_faithfulness_frame(monkeypatch, one_thread):
    model, ids = tiny_model("llama"), _ids()
    alone = _curve(model, ids)
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    assert runs.launch_info()["launcher"] == "jobs" and runs.launch_info()["world_size"] == 2
    shared = _curve(model, ids)
    pd.testing.assert_frame_equal(alone, shared, check_exact=True)
    options = dict(metric=["contribution"], ratios=[0.5], mode="comprehensiveness", batch_size=3,
                   progress=False)
    shared = per_layer_curve(model, None, ids, **options)
    monkeypatch.delenv(runs.JOBS_ENV_VAR)
    pd.testing.assert_frame_equal(per_layer_curve(model, None, ids, **options), shared, check_exact=True)


def test_two_forked_ranks_give_the_single_process_anatomy_frame(monkeypatch, one_thread):
    import datasets

    from cwbook.anatomy import selection_anatomy

    model, ids = tiny_model("llama"), _ids(rows=5)
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                         "document": [40, 10, 30, 20, 50]})
    options = dict(ratios=[0.1, 0.5], modes=("comprehensiveness", "sufficiency"), batch_size=2, progress=False)
    alone = selection_anatomy(model, blocks, **options)
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    shared = selection_anatomy(model, blocks, **options)
    assert list(dict.fromkeys(shared["document"])) == [40, 10, 30, 20, 50]  # three batches, two ranks, in order
    pd.testing.assert_frame_equal(alone, shared, check_exact=True)


def test_two_forked_ranks_fill_the_cache_and_the_batch_driver_yields_every_batch(tmp_path, monkeypatch, one_thread):
    model = tiny_model("llama")
    batches = [{"input_ids": _ids(2, 9, seed)} for seed in range(5)]
    alone = analysis.collect(model, batches)
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    with caching(tmp_path):
        shared = analysis.collect(model, batches)
    for a, b in zip(alone, shared):
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    monkeypatch.delenv(runs.JOBS_ENV_VAR)
    calls = []
    monkeypatch.setattr(analysis, "decompose", lambda *a, **k: calls.append(1))
    with caching(tmp_path):
        again = analysis.collect(model, batches)  # every piece written by either rank
    assert calls == []
    for a, b in zip(alone, again):
        pd.testing.assert_frame_equal(a, b, check_exact=True)


SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from tiny_models import VOCAB, tiny_model
from cwcore import faithfulness as fa, runs
ids = torch.randint(0, VOCAB, (10, 12), generator=torch.Generator().manual_seed(0))
frame = fa.faithfulness_curve(tiny_model("llama"), None, ids, metric=["attention", "contribution", "random"],
                              ratios=[0, 0.2, 0.5], batch_size=2, progress=False).per_sequence
info = runs.launch_info()
frame.to_parquet(sys.argv[1] + f"/rank{{info['rank']}}-of-{{info['world_size']}}-{{info['launcher']}}.parquet")
"""


@pytest.mark.slow  # starts two processes that import torch
def test_torchrun_with_two_ranks_gives_the_single_process_frame_on_every_rank(tmp_path, one_thread):
    script = tmp_path / "sweep.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop(runs.JOBS_ENV_VAR, None)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(script), str(tmp_path)], env=env, check=True, capture_output=True, timeout=600)
    alone = _curve(tiny_model("llama"), _ids())
    for rank in (0, 1):
        got = pd.read_parquet(tmp_path / f"rank{rank}-of-2-torchrun.parquet")
        pd.testing.assert_frame_equal(alone, got, check_exact=True)


def test_book_build_jobs_sets_the_ranks_of_every_kernel(monkeypatch):
    import cwbook as book
    seen = {}
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "1")  # restored after the test, whatever main sets
    monkeypatch.setattr(book, "build", lambda **kwargs: seen.update(jobs=os.environ.get(runs.JOBS_ENV_VAR)))
    assert book.main(["build", "--profile", "smoke", "--jobs", "2", "--no-html"]) == 0
    assert seen["jobs"] == "2" and runs.local_jobs() == 2
    assert book.main(["build", "--jobs", "0"]) == 2  # one line (argparse's usage came first)


_ORPHAN = """
import os, sys, time
from cwcore import runs
folder = sys.argv[1]
def compute(item):
    with open(os.path.join(folder, f"rank-{item}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    return item
runs.shard_map([0, 1], compute)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state  # a zombie has stopped computing; only its exit status is left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_forked_rank_dies_with_its_parent(tmp_path):
    """A build killed outright (SIGKILL: no clean-up runs) must not leave its forked ranks computing."""
    import signal
    import time

    env = {**os.environ, runs.JOBS_ENV_VAR: "2", "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN, str(tmp_path)], env=env)
    try:
        helper_file = tmp_path / "rank-1.pid"
        deadline = time.monotonic() + 120
        while not (helper_file.is_file() and helper_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.2)
        helper = int(helper_file.read_text())
        assert helper != parent.pid and _alive(helper)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(helper), "the forked rank outlived its killed parent"
    finally:
        parent.kill()
        parent.wait()


def test_the_per_layer_sweep_moves_its_progress_bar_by_each_finished_batchs_points(monkeypatch, one_thread):
    """per_layer_curve's bar (points) advanced only inside faithfulness sweeps, so it stood at 0 while
    the per-layer batches finished; it now reaches its total, alone and with 2 ranks."""
    from cwcore.faithfulness import sweep as sweep_module

    counts = []

    class Recorder:
        def __init__(self, total, *args, **kwargs):
            self.total, self.n = total, 0
            counts.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    monkeypatch.setattr(sweep_module, "progress_bar", Recorder)
    model, ids = tiny_model("llama"), _ids(rows=5)
    options = dict(metric=["attention", "contribution"], ratios=[0.2, 0.5], mode="comprehensiveness", batch_size=2,
                   progress=True)
    per_layer_curve(model, None, ids, **options)
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    per_layer_curve(model, None, ids, **options)
    assert [(bar.total, bar.n) for bar in counts] == [(3 * 2 * 2, 3 * 2 * 2)] * 2  # 3 batches x 4 points


_DIES_WHILE_JOINING = """
import os
import torch.distributed as dist
from cwcore import runs
runs.SETUP_TIMEOUT_SECONDS = 3.0
parent, real = os.getpid(), dist.init_process_group
def init_process_group(*args, **kwargs):
    if os.getpid() != parent:
        os._exit(6)  # the forked rank said it joins, and is gone inside the group's set-up
    return real(*args, **kwargs)
dist.init_process_group = init_process_group
try:
    runs.shard_map(range(4), lambda i: i)
except RuntimeError as err:
    print(err)
dist.init_process_group = real
print(runs.shard_map(range(3), lambda i: i * 10))  # the next sweep of this process runs
"""


def test_a_forked_rank_gone_while_the_group_forms_is_named_after_the_set_up_not_a_day(tmp_path):
    """Rank 0 waited in the group's rendezvous for $CWCORE_RANK_TIMEOUT (a day) for a rank that died after it
    said it joins; now the set-up waits SETUP_TIMEOUT_SECONDS (3 s here) and names the rank."""
    done = _run_with_two_ranks(_DIES_WHILE_JOINING, timeout=90)
    assert done.stdout.strip().splitlines() == [
        "$CWCORE_JOBS: rank 1 of 2 exited with status 6 while the ranks formed their group; run it again, or with "
        "fewer ranks ($CWCORE_JOBS=1 runs in this process alone)", "[0, 10, 20]"], done.stderr


_DIVERGED = """
import sys
import torch.distributed as dist
from cwcore import runs
dist.init_process_group("gloo")
rank = dist.get_rank()
items = list(range(4)) if rank == 0 else list(range(2))  # as a rank that took another branch of a book cell
try:
    print("returned", runs.shard_map(items, lambda i: i * 10))
except RuntimeError as err:
    print(err)
"""


@pytest.mark.slow  # starts two processes that import torch
def test_ranks_that_map_different_items_are_refused_not_merged(tmp_path):
    """Under torchrun, a book cell whose ranks decided differently (a committed export read on one rank before
    the other wrote it) paired the exchanges of two different maps: rank 0 returned another sweep's rows with
    success. Now every rank raises, naming what each mapped."""
    script = tmp_path / "diverged.py"
    script.write_text(_DIVERGED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    env.pop(runs.JOBS_ENV_VAR, None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "returned" not in done.stdout, done.stdout + done.stderr  # the two ranks' prints may interleave
    assert done.stdout.count("the ranks mapped different work in one exchange (rank 0: 4 items; rank 1: 2 items)") == 2


def test_mean_removal_splits_its_stand_in_pass_over_the_ranks_and_gives_the_same_frame(monkeypatch, one_thread):
    """removal="mean" first sums every batch's values for the stand-ins: each rank ran that pass over all the
    batches (20 forwards for 15 on 2 ranks of 5 documents); it is shared out now, with the same numbers."""
    from cwcore.faithfulness import sweep as sweep_module

    model, ids = tiny_model("llama"), _ids(rows=5)
    options = dict(metric=["contribution"], ratios=[0.5], mode="comprehensiveness", batch_size=1, progress=False,
                   removal="mean")
    alone = fa.faithfulness_curve(model, None, ids, **options).per_sequence
    calls = []
    real = sweep_module.value_sums
    monkeypatch.setattr(sweep_module, "value_sums", lambda *a, **k: calls.append(os.getpid()) or real(*a, **k))
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")
    shared = fa.faithfulness_curve(model, None, ids, **options).per_sequence
    pd.testing.assert_frame_equal(alone, shared, check_exact=True)
    assert len(calls) == 3  # this process (rank 0) summed batches 0, 2 and 4 itself, the forked rank 1 and 3
