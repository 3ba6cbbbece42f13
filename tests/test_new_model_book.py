"""Rerunning the book on new models: the smoke book built on tiny random models saved on the fly, in three
layouts: separate q/k/v projections (Qwen2), one fused qkv projection (Phi-3) and, for the encoder
chapter, a BERT encoder.

Each model (tests/new_model.py) is of a family cwcore does not package, has random weights and so
lacks what the chapters look for: no head is a sink head at eps = 0.3, its tokenizer adds no BOS,
and all its layers are of one type. Every page must still build, and the chapters that measure sink
heads must say, in their prose, their claims tables and on the findings page, that those claims are
not measured and why, instead of raising or printing bare NaNs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

import cwbook as book
REPO = Path(__file__).resolve().parent.parent
NO_SINKS = "no sink heads at eps=0.3"
pytestmark = pytest.mark.slow


def _text(page: Path) -> str:
    html = re.sub(r"(?s)<script.*?</script>|<style.*?</style>", " ", page.read_text())
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&lt;", "<").replace("&gt;", ">")


@pytest.fixture(scope="module")
def new_model_book(tmp_path_factory):
    from new_model import save_new_model

    root = tmp_path_factory.mktemp("new-model-book")
    folders = [save_new_model(root / f"tiny-{family}", family=family) for family in DECODER_LAYOUTS]
    encoder = save_new_model(root / "tiny-bert", family="bert")
    bookdir = root / "book"
    shutil.copytree(REPO / "book", bookdir, ignore=shutil.ignore_patterns("_build", "generated", "_toc.yml"))
    config_path = bookdir / "run.yml"
    config = yaml.safe_load(config_path.read_text())
    for chapter in config["chapters"]:  # the encoder chapter pins its model: pin the new encoder instead
        if chapter.get("notebook") == "08_encoders":
            chapter["models"] = [str(encoder)]
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cwbook", "build", "--profile", "smoke", "--models", ",".join(map(str, folders)),
         "--book-dir", str(bookdir), "--build-dir", str(root / "build")],
        cwd=REPO, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    took = time.monotonic() - start
    assert done.returncode == 0, f"the smoke book failed on a new model:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    print(f"smoke book on {', '.join(f.name for f in folders)} and {encoder.name}: {took:.0f} s")
    return folders, encoder, bookdir, root / "build" / "html"


#: separate q/k/v projections, and one fused qkv projection (no ``v_proj`` to reach for)
DECODER_LAYOUTS = ("qwen2", "phi3")


def test_every_page_builds_on_a_new_model(new_model_book):
    folders, encoder, bookdir, html = new_model_book
    config = book.load_config(bookdir / "run.yml")
    models = ",".join(map(str, folders))
    _, _, runs = book.plan(config, profile="smoke", models=models, generated_dir=bookdir / "generated")
    assert {r.model for r in runs if r.chapter.runs == "per_model"} == {*map(str, folders), str(encoder)}
    for run in runs:
        page = html / Path(os.path.relpath(run.output, bookdir)).with_suffix(".html")
        assert page.is_file(), f"missing page {page}"
        text = _text(page)
        assert "Traceback" not in text and "Failed to format" not in text, page.name


def _claims(bookdir: Path, chapter: str, folder: Path) -> pd.DataFrame:
    """A chapter's claims table, its data sets split out: the chapters stack them with keys "<data>/<key>"."""
    path = book.results_path(bookdir / "generated" / "results" / "smoke", chapter, str(folder))
    table = pd.read_csv(path, keep_default_na=False)
    split = table["key"].str.rpartition("/")
    return table.assign(data=split[0], key=split[2])


@pytest.mark.parametrize("layout", range(len(DECODER_LAYOUTS)), ids=DECODER_LAYOUTS)
def test_chapters_say_what_a_model_without_sink_heads_does_not_measure(new_model_book, layout):
    folders, _, bookdir, html = new_model_book
    folder = folders[layout]
    # the premise, from chapter 5's own table: no head of the random model is a sink head, on any data set
    rates = _claims(bookdir, "05_sink_decomposition", folder)
    sink_eps = rates[rates["key"] == "sink_eps"]
    assert len(sink_eps) == rates["data"].nunique() >= 1
    assert (sink_eps["estimate"].astype(float) == 0.0).all()
    # the claims over sink heads are "not measured" on every data set, and their tables say why
    for chapter, keys in (("05_sink_decomposition", ["sink_geometry_share", "tail_attention_share"]),
                          ("06_sinks_as_suppressors", ["cos_value", "cos_semantic", "shortened"])):
        table = _claims(bookdir, chapter, folder)
        for key in keys:
            rows = table[table["key"] == key]
            assert len(rows) == table["data"].nunique() >= 1, (chapter, key)
            assert (rows["verdict"] == "not measured").all(), (chapter, key)
            assert (rows["why"] == NO_SINKS).all(), (chapter, key)
        measured = table[table["verdict"] != "not measured"]
        assert (measured["why"] == "").all()  # a measured part gives no excuse
    slug = Path(book.results_path(Path("."), "05_sink_decomposition", str(folder))).stem
    for chapter in ("05_sink_decomposition", "06_sinks_as_suppressors"):
        text = _text(html / "generated" / chapter / f"{slug}.html")
        assert f"Not measured: {NO_SINKS}." in text, chapter  # the prose says so...
        assert f"not measured: {NO_SINKS}" in text, chapter  # ...and the claims table
    findings = _text(html / "generated" / "09_findings.html")
    assert f"not measured: {NO_SINKS}" in findings
