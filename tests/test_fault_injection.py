"""Fault injection: a smoke build of chapter 3 killed inside its notebook, one cached piece and
the converted model damaged, then rebuilt, gives the numbers of an undisturbed build.

Chapter 3 is the cheapest chapter that uses the result cache (``analysis.collect``'s PieceStore, one
batch in the smoke profile: its ``stats`` and ``factors`` pieces and the ``.done`` marker). The two
builds run in subprocesses, each in its own copy of book/ and its own CWCORE_CACHE seeded with a
copy of the converted SmolLM2 (about 3 minutes in all, most of it the disturbed build converting the
damaged model again).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
CHAPTER = "03_contribution_maps"


def glued(executed: Path) -> dict:
    """Every value a notebook glued (name -> its data), i.e. the numbers and phrases the prose quotes."""
    nb = json.loads(executed.read_text())
    values = {}
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            name = output.get("metadata", {}).get("scrapbook", {}).get("name")
            if name:
                values[name] = output["data"]
    return values


def stderr_text(executed: Path) -> str:
    nb = json.loads(executed.read_text())
    return "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stderr")


def pieces(cache: Path) -> dict[str, pd.DataFrame]:
    return {p.name: pd.read_parquet(p) for p in sorted((cache / "results").rglob("*.parquet"))}


@pytest.mark.slow
def test_a_killed_and_damaged_build_gives_the_numbers_of_an_undisturbed_one(tmp_path):
    from cwcore import models

    converted = models.packaged_model_path("smollm2-135m")  # the user's cache; converted once if needed

    def prepare(name: str) -> tuple[Path, list[str], dict]:
        root = tmp_path / name
        shutil.copytree(REPO / "book", root / "book", ignore=shutil.ignore_patterns("_build", "generated", "_toc.yml"))
        shutil.copytree(converted, root / "cache" / "models" / "smollm2-135m")
        command = [sys.executable, "-m", "cwbook", "build", "--profile", "smoke", "--only", CHAPTER[:2],
                   "--no-html", "--book-dir", str(root / "book")]
        env = {**os.environ, "CWCORE_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1"}
        env.pop("CWCORE_NO_CACHE", None)
        return root, command, env

    ref, ref_command, ref_env = prepare("reference")
    dis, dis_command, dis_env = prepare("disturbed")
    reference = subprocess.Popen(ref_command, env=ref_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    disturbed = subprocess.Popen(dis_command, env=dis_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)  # its own process group: the kernel dies with it

    # Kill the disturbed build inside the notebook, as soon as its first batch is complete in the cache.
    deadline = time.monotonic() + 400
    while not list((dis / "cache" / "results").rglob("*.done.parquet")):
        assert disturbed.poll() is None, "the build ended before its first batch was cached"
        assert time.monotonic() < deadline, "no cached batch after 400 s"
        time.sleep(0.05)
    assert disturbed.poll() is None
    os.killpg(disturbed.pid, signal.SIGKILL)
    disturbed.wait()
    generated = dis / "book" / "generated"
    partial = list(generated.rglob("*.partial.ipynb"))
    assert len(partial) == 1 and not (generated / CHAPTER / "smollm2-135m.ipynb").exists()

    # Damage one cached piece (truncated) and the converted model (bytes flipped in place, same size).
    stats = next((dis / "cache" / "results").rglob("*.stats.parquet"))
    stats.write_bytes(stats.read_bytes()[:-100])
    weights = dis / "cache" / "models" / "smollm2-135m" / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\xff" * 4096)
    assert weights.stat().st_size == size

    rebuilt = subprocess.run(dis_command, env=dis_env, capture_output=True, text=True, timeout=600)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr
    assert "removed 1 partial copies left by a killed build" in rebuilt.stdout
    assert not list(generated.rglob("*.partial.ipynb"))
    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out

    executed = generated / CHAPTER / "smollm2-135m.ipynb"
    warned = stderr_text(executed)
    assert "converted model at" in warned and "damaged" in warned and "converting it again" in warned
    assert f"cached piece {stats}" in warned.replace("\n", "") and "was damaged" in warned
    assert models.verify_cached_folder(weights.parent) is None  # converted again, and sound

    want, got = glued(ref / "book" / "generated" / CHAPTER / "smollm2-135m.ipynb"), glued(executed)
    assert len(want) > 50 and got == want  # every number and phrase of the chapter
    ref_pieces, dis_pieces = pieces(ref / "cache"), pieces(dis / "cache")
    assert sorted(ref_pieces) == sorted(dis_pieces) and len(ref_pieces) == 3
    for name, frame in ref_pieces.items():
        pd.testing.assert_frame_equal(dis_pieces[name], frame, check_exact=True)
