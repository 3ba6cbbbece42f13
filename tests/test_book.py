"""The book runner (cwbook): run configuration, table of contents, stamps, atomic execution,
an end-to-end build of the real book with the smoke profile, and headless Chromium on the result."""

from __future__ import annotations

import functools
import html as htmllib
import http.server
import json
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest
import yaml

import cwbook as book
REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------------
# Helpers: a tiny book in tmp_path
# --------------------------------------------------------------------------------------------------
def write_notebook(path: Path, parameters: str, *body: str, title: str = "A tiny chapter") -> Path:
    cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\nSome text.")]
    params = nbformat.v4.new_code_cell(parameters)
    params.metadata["tags"] = ["parameters"]
    cells.append(params)
    cells += [nbformat.v4.new_code_cell(src) for src in body]
    nb = nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "language": "python",
                                                                         "display_name": "Python 3"}})
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


RUN_YML = {
    "default_profile": "small",
    "chapters": [
        {"notebook": "01_once", "runs": "once"},
        {"notebook": "02_models", "runs": "per_model"},
        {"notebook": "03_encoder", "runs": "per_model", "models": ["minilm-l6"]},
    ],
    "profiles": {
        "small": {
            "models": ["smollm2-135m", "Qwen/Qwen3-8B"],
            "params": {"seed": 1, "device": "cpu", "n_sequences": 2},
            "notebooks": {"01_once": {"n_trials": 5}},
        },
        "other": {"models": ["gemma3-270m"], "params": {"seed": 2},
                  "notebooks": {"02_models": {"models": ["only-this"]}}},
    },
}


@pytest.fixture
def tiny(tmp_path):
    """A run.yml with a once chapter, a per-model chapter and a pinned per-model chapter."""
    nbdir = tmp_path / "notebooks"
    write_notebook(nbdir / "01_once.ipynb", 'seed = 0\nprofile = "x"\noutput_dir = "."\nn_trials = 1',
                   "print('once', seed, n_trials, profile)")
    write_notebook(nbdir / "02_models.ipynb", 'model = "m"\nseed = 0\nn_sequences = 1\ndevice = "cpu"',
                   "print('model', model, seed, n_sequences)", title="Per model")
    write_notebook(nbdir / "03_encoder.ipynb", 'model = "m"', "print(model)", title="Encoders")
    bookdir = tmp_path / "book"
    bookdir.mkdir()
    (bookdir / "run.yml").write_text(yaml.safe_dump(RUN_YML))
    return bookdir, nbdir


def plan_tiny(tiny, **kw):
    bookdir, nbdir = tiny
    config = book.load_config(bookdir / "run.yml")
    return book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated", **kw)


# --------------------------------------------------------------------------------------------------
# Run configuration and table of contents (no kernel)
# --------------------------------------------------------------------------------------------------
def test_plan_resolves_models_and_parameters(tiny):
    bookdir, _ = tiny
    name, chapters, runs = plan_tiny(tiny)
    assert name == "small" and [c.name for c in chapters] == ["01_once", "02_models", "03_encoder"]
    assert [(r.chapter.name, r.model) for r in runs] == [
        ("01_once", None), ("02_models", "smollm2-135m"), ("02_models", "Qwen/Qwen3-8B"),
        ("03_encoder", "minilm-l6")]
    once, small, qwen, enc = runs
    assert once.output == bookdir / "generated" / "01_once.ipynb"
    assert once.parameters == {"seed": 1, "device": "cpu", "n_sequences": 2, "n_trials": 5,
                               "profile": "small", "models": ["smollm2-135m", "Qwen/Qwen3-8B"],
                               "output_dir": "figures/01_once", "results_file": "results/small/01_once.csv",
                               "results_dir": "results/small"}
    assert once.explicit == {"n_trials"}
    assert qwen.output == bookdir / "generated" / "02_models" / "qwen-qwen3-8b.ipynb"
    assert qwen.parameters["model"] == "Qwen/Qwen3-8B" and qwen.parameters["output_dir"] == "figures/qwen-qwen3-8b"
    # result tables: relative to the run's working directory, one folder per profile
    assert qwen.parameters["results_file"] == "../results/small/02_models/qwen-qwen3-8b.csv"
    assert qwen.parameters["results_dir"] == "../results/small"
    assert (qwen.output.parent / qwen.parameters["results_file"]).resolve() == \
        book.results_path(bookdir / "generated" / "results" / "small", "02_models", "Qwen/Qwen3-8B").resolve()
    assert "n_trials" not in small.parameters

    # --models replaces the profile's models, not a chapter's pinned list
    _, _, runs = plan_tiny(tiny, models="a,b")
    assert [r.model for r in runs] == [None, "a", "b", "minilm-l6"]
    assert runs[0].parameters["models"] == ["a", "b"]  # a once-chapter sees the models of the book
    # a profile may fix a chapter's models
    _, _, runs = plan_tiny(tiny, profile="other")
    assert [r.model for r in runs] == [None, "only-this", "minilm-l6"]
    # --only takes names or unique prefixes
    _, chapters, runs = plan_tiny(tiny, only="03,01_once")
    assert [c.name for c in chapters] == ["01_once", "03_encoder"] and len(runs) == 2


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(profiles={"p": {}}), "profile 'small' is not in run.yml"),
    (lambda c: c["chapters"].append({"notebook": "09_missing"}), "09_missing.ipynb does not exist"),
    (lambda c: c["chapters"].append({"notebook": "01_once"}), "more than once"),
    (lambda c: c["chapters"][0].update(runs="twice"), "runs must be one of"),
    (lambda c: c["chapters"][0].update(models=["x"]), "for per_model chapters"),
    (lambda c: c["profiles"]["small"]["notebooks"].update({"07_nope": {}}), "are not chapters"),
])
def test_plan_rejects_bad_configurations(tiny, change, message):
    bookdir, nbdir = tiny
    config = yaml.safe_load(yaml.safe_dump(RUN_YML))
    change(config)
    with pytest.raises(book.BookError, match=re.escape(message)):
        book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated")


def test_page_chapters_are_listed_in_the_toc_and_never_executed(tiny):
    bookdir, nbdir = tiny
    config = yaml.safe_load(yaml.safe_dump(RUN_YML))
    config["chapters"].insert(1, {"page": "notes"})
    config["chapters"].append({"page": "rerun"})
    (bookdir / "notes.md").write_text("# Notes\n")
    (bookdir / "rerun.md").write_text("# Rerun it yourself\n")
    name, chapters, runs = book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    assert [(c.name, c.runs) for c in chapters] == [
        ("01_once", "once"), ("notes", "page"), ("02_models", "per_model"), ("03_encoder", "per_model"),
        ("rerun", "page")]
    assert [c.is_page for c in chapters] == [False, True, False, False, True]
    assert len(runs) == 4 and not [r for r in runs if r.chapter.is_page]  # pages are not executed
    entries = book.toc(chapters, runs, bookdir / "generated", bookdir)["chapters"]
    assert [e["file"] for e in entries] == ["generated/01_once", "notes", "generated/02_models/index",
                                            "generated/03_encoder/index", "rerun"]
    # --only selects pages like notebooks; a page runs nothing
    _, chapters, runs = book.plan(config, only="rerun,01", notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    assert [c.name for c in chapters] == ["01_once", "rerun"] and len(runs) == 1

    (bookdir / "rerun.md").unlink()
    with pytest.raises(book.BookError, match=r"lists page rerun but .*rerun\.md does not exist"):
        book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    for bad, message in (({"page": "notes", "runs": "once"}, "unknown keys ['runs']"),
                         ({"page": "notes.md"}, "without '.md'"),
                         ({"page": "notes"}, "more than once")):
        broken = yaml.safe_load(yaml.safe_dump(config))
        broken["chapters"].append(bad)
        with pytest.raises(book.BookError, match=re.escape(message)):
            book.plan(broken, notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    # a page takes no parameters
    config["profiles"]["small"]["notebooks"]["notes"] = {"seed": 1}
    with pytest.raises(book.BookError, match="are not chapters"):
        book.plan(config, only="01", notebooks_dir=nbdir, generated_dir=bookdir / "generated")


def test_a_page_may_live_in_a_folder_of_the_book(tiny):
    """The manual's pages, book/manual/<name>.md, are chapters `- page: manual/<name>`; a path that leaves
    book/ or points into a folder the build writes is refused."""
    bookdir, nbdir = tiny
    config = yaml.safe_load(yaml.safe_dump(RUN_YML))
    config["chapters"].append({"page": "manual/cli"})
    (bookdir / "manual").mkdir()
    (bookdir / "manual" / "cli.md").write_text("# The command line\n")
    name, chapters, runs = book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    assert (chapters[-1].name, chapters[-1].runs) == ("manual/cli", "page")
    entries = book.toc(chapters, runs, bookdir / "generated", bookdir)["chapters"]
    assert entries[-1] == {"file": "manual/cli"}
    (bookdir / "manual" / "cli.md").unlink()
    with pytest.raises(book.BookError, match=r"lists page manual/cli but .*manual/cli\.md does not exist"):
        book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    for bad in ("../notes", "manual/../notes", "/notes", "manual//cli", "generated/notes", "_build/notes",
                "manual\\cli", "manual/cli.md"):
        broken = yaml.safe_load(yaml.safe_dump(RUN_YML))
        broken["chapters"].append({"page": bad})
        with pytest.raises(book.BookError, match="inside book/ without '.md'"):
            book.plan(broken, notebooks_dir=nbdir, generated_dir=bookdir / "generated")


def test_only_must_match_one_chapter(tiny):
    with pytest.raises(book.BookError, match="matches no chapter"):
        plan_tiny(tiny, only="99")
    with pytest.raises(book.BookError, match="ambiguous"):
        plan_tiny(tiny, only="0")


def test_toc_has_a_page_per_chapter_and_a_subpage_per_model(tiny):
    bookdir, _ = tiny
    name, chapters, runs = plan_tiny(tiny)
    toc = book.toc(chapters, runs, bookdir / "generated", bookdir)
    assert toc == {
        "format": "jb-book", "root": "intro",
        "chapters": [
            {"file": "generated/01_once"},
            {"file": "generated/02_models/index", "sections": [
                {"file": "generated/02_models/smollm2-135m", "title": "smollm2-135m"},
                {"file": "generated/02_models/qwen-qwen3-8b", "title": "Qwen/Qwen3-8B"}]},
            {"file": "generated/03_encoder/index", "sections": [
                {"file": "generated/03_encoder/minilm-l6", "title": "minilm-l6"}]},
        ]}
    index = book.chapter_index(chapters[1], runs[1:3], name)
    assert index.startswith("# Per model\n")
    question = book.notebook_question(runs[1].source)  # the notebook's opening paragraph, if it has one
    assert (question in index) if question else "opens with its answer" in index
    assert "{doc}`smollm2-135m <smollm2-135m>`" in index and "{doc}`Qwen/Qwen3-8B <qwen-qwen3-8b>`" in index


def test_parameters_are_filtered_to_what_the_notebook_declares(tiny):
    _, _, runs = plan_tiny(tiny)
    once, small = runs[0], runs[1]
    declared = book.notebook_parameters(once.source)
    assert declared == {"seed", "profile", "output_dir", "n_trials"}
    assert book.injected_parameters(once, declared) == {"seed": 1, "n_trials": 5, "profile": "small",
                                                         "output_dir": "figures/01_once"}
    # a parameter set for this very notebook in run.yml but not declared by it is a typo
    with pytest.raises(book.BookError, match=r"does not declare \['n_trials'\]"):
        book.injected_parameters(once, {"seed"})
    # a per-model notebook must declare `model`
    with pytest.raises(book.BookError, match=r"does not declare \['model'\]"):
        book.injected_parameters(small, {"seed"})


def test_stamp_changes_with_notebook_parameters_and_code(tmp_path, monkeypatch):
    from cwcore import cache

    nb = write_notebook(tmp_path / "a.ipynb", "seed = 0")
    base = book.stamp(nb, {"seed": 0, "profile": "p"})
    assert base == book.stamp(nb, {"profile": "p", "seed": 0})  # key order is irrelevant
    assert base != book.stamp(nb, {"seed": 1, "profile": "p"})
    monkeypatch.setattr(cache, "code_version", lambda: "other cwcore sources")
    assert book.stamp(nb, {"seed": 0, "profile": "p"}) != base
    monkeypatch.undo()
    write_notebook(nb, "seed = 0", "print(1)")
    assert book.stamp(nb, {"seed": 0, "profile": "p"}) != base
    assert book.read_stamp(tmp_path / "missing.ipynb") is None


def test_a_page_reading_results_dir_reruns_when_a_table_changes_and_a_missing_table_reruns_its_writer(tmp_path):
    """The findings page's stamp covers the tables it reads; a writer whose table is gone runs again."""
    nbdir, bookdir = tmp_path / "notebooks", tmp_path / "book"
    write_notebook(nbdir / "04_writer.ipynb", 'model = "m"\nresults_file = None',
                   "from pathlib import Path\nPath(results_file).write_text(model)", title="Writer")
    write_notebook(nbdir / "09_reader.ipynb", 'models = []\nresults_dir = "."',
                   "from pathlib import Path\nprint(sorted(p.name for p in Path(results_dir).rglob('*.csv')))",
                   title="Reader")
    bookdir.mkdir()
    (bookdir / "run.yml").write_text(yaml.safe_dump({
        "chapters": [{"notebook": "04_writer", "runs": "per_model"}, {"notebook": "09_reader", "runs": "once"}],
        "profiles": {"p": {"models": ["a", "b"]}}, "default_profile": "p"}))
    config = book.load_config(bookdir / "run.yml")
    _, _, runs = book.plan(config, notebooks_dir=nbdir, generated_dir=bookdir / "generated")
    reader = runs[-1]
    params = book.injected_parameters(reader, book.notebook_parameters(reader.source))
    assert params == {"models": ["a", "b"], "results_dir": "results/p"}
    before = book.run_stamp(reader, params)
    table = bookdir / "generated" / "results" / "p" / "04_writer" / "a.csv"
    table.parent.mkdir(parents=True)
    table.write_text("x")
    assert book.run_stamp(reader, params) != before  # a new table
    changed = book.run_stamp(reader, params)
    table.write_text("y")
    assert book.run_stamp(reader, params) != changed  # a changed table

    kw = dict(book_dir=bookdir, notebooks_dir=nbdir, html=False)
    book.build(**kw)
    executed = bookdir / "generated" / "09_reader.ipynb"
    assert "['a.csv', 'b.csv']" in outputs_text(executed)
    (bookdir / "generated" / "results" / "p" / "04_writer" / "b.csv").unlink()
    mtime = executed.stat().st_mtime_ns
    book.build(**kw)  # b's writer runs again (its table is missing); the page then reads the same tables
    assert "['a.csv', 'b.csv']" in outputs_text(executed)
    assert executed.stat().st_mtime_ns == mtime


def test_slug():
    assert book.slug("mistralai/Mistral-7B-v0.1") == "mistralai-mistral-7b-v0-1"
    assert book.slug("smollm2-135m") == "smollm2-135m"


# --------------------------------------------------------------------------------------------------
# Execution with papermill (a kernel per notebook run: a few seconds each)
# --------------------------------------------------------------------------------------------------
def outputs_text(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_kernel_environment_waits_passively_unless_told_otherwise_and_is_restored(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("CWCORE_CACHING", raising=False)
    with book._kernel_environment():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
        assert os.environ["TQDM_DISABLE"] == "1"  # no progress bars printed into the pages
        assert os.environ["CWCORE_CACHING"] == "1"  # the chapters cache (the library caches only when asked)
        assert os.environ["PYTHONWARNINGS"] == "default,ignore:IProgress not found"
    assert "OMP_WAIT_POLICY" not in os.environ and os.environ["PYTHONWARNINGS"] == "default"
    assert "CWCORE_CACHING" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's choice wins
    with book._kernel_environment():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def _install_kernel_after(barrier, prefix: str, name: str) -> None:
    book.sys.prefix = prefix
    barrier.wait()
    book.ensure_kernel(name)


def test_a_half_written_kernelspec_is_installed_again(tmp_path, monkeypatch):
    # a build that read kernel.json while another build was writing it failed with a JSONDecodeError
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    monkeypatch.setattr(book.sys, "prefix", str(tmp_path))
    spec = tmp_path / "share" / "jupyter" / "kernels" / "cwcore-half-written" / "kernel.json"
    spec.parent.mkdir(parents=True)
    spec.write_text('{"argv": ["python", "-m", "ipyk')
    assert book.ensure_kernel("cwcore-half-written") == "cwcore-half-written"
    assert json.loads(spec.read_text())["argv"][0] == sys.executable


def test_builds_started_together_install_the_kernel_once_without_failing(tmp_path, monkeypatch):
    # builds started at once (two `make book`, or ranks) used to fail with "File exists" in all but one
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    fork = multiprocessing.get_context("fork")
    barrier = fork.Barrier(6)
    workers = [fork.Process(target=_install_kernel_after, args=(barrier, str(tmp_path), "cwcore-race-test"))
               for _ in range(6)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    assert [worker.exitcode for worker in workers] == [0] * 6
    assert (tmp_path / "share" / "jupyter" / "kernels" / "cwcore-race-test" / "kernel.json").is_file()


def test_execute_skip_and_rerun(tiny, capsys):
    bookdir, nbdir = tiny
    kw = dict(book_dir=bookdir, notebooks_dir=nbdir, html=False)
    book.build(only="01,02", **kw)
    generated = bookdir / "generated"
    once, small = generated / "01_once.ipynb", generated / "02_models" / "smollm2-135m.ipynb"
    assert "once 1 5 small" in outputs_text(once)
    assert "model Qwen/Qwen3-8B 1 2" in outputs_text(generated / "02_models" / "qwen-qwen3-8b.ipynb")
    nb = nbformat.read(small, as_version=4)
    assert nb.metadata.cwcore.model == "smollm2-135m" and nb.metadata.cwcore.stamp
    assert nb.cells[0].source.startswith("# Per model (smollm2-135m)")  # model named in the title
    tagged = [c for c in nb.cells if {"parameters", "injected-parameters"} & set(c.metadata.get("tags", []))]
    assert len(tagged) == 2 and all("hide-cell" in c.metadata.tags for c in tagged)
    assert (generated / "02_models" / "index.md").is_file() and (generated / "figures" / "01_once").is_dir()
    toc = yaml.safe_load((bookdir / "_toc.yml").read_text())
    assert [c["file"] for c in toc["chapters"]] == ["generated/01_once", "generated/02_models/index"]
    first = capsys.readouterr().out
    assert first.count("done in") == 3

    # unchanged: nothing runs, nothing is rewritten
    mtimes = {p: p.stat().st_mtime_ns for p in (once, small)}
    book.build(only="01,02", **kw)
    out = capsys.readouterr().out
    assert out.count("up to date") == 3 and "done in" not in out
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes

    # a changed parameter reruns that notebook only
    config = yaml.safe_load((bookdir / "run.yml").read_text())
    config["profiles"]["small"]["notebooks"]["01_once"]["n_trials"] = 7
    (bookdir / "run.yml").write_text(yaml.safe_dump(config))
    book.build(only="01,02", **kw)
    out = capsys.readouterr().out
    assert out.count("done in") == 1 and out.count("up to date") == 2
    assert "once 1 7 small" in outputs_text(once)


def test_failing_notebook_keeps_the_previous_copy_and_leaves_no_partial_file(tiny, capsys):
    bookdir, nbdir = tiny
    kw = dict(book_dir=bookdir, notebooks_dir=nbdir, html=False, only="01")
    book.build(**kw)
    once = bookdir / "generated" / "01_once.ipynb"
    good = once.read_bytes()

    write_notebook(nbdir / "01_once.ipynb", 'seed = 0\nprofile = "x"\noutput_dir = "."\nn_trials = 1',
                   "x = 1", "raise ValueError('broken on purpose ' + str(n_trials))")
    with pytest.raises(book.BookError) as err:
        book.build(**kw)
    message = str(err.value)
    assert "01_once" in message and "ValueError: broken on purpose 5" in message
    assert "raise ValueError('broken on purpose ' + str(n_trials))" in message  # the failing cell
    assert once.read_bytes() == good  # the previous executed copy is untouched
    assert not list((bookdir / "generated").glob(".*partial*"))  # no half-written notebook left
    failed = bookdir / "_build" / "failed" / "01_once.ipynb"
    assert "broken on purpose" in json.dumps(json.loads(failed.read_text()))

    # a notebook that never succeeded leaves no executed copy at all
    once.unlink()
    with pytest.raises(book.BookError):
        book.build(**kw)
    assert not once.exists() and not list((bookdir / "generated").glob(".*partial*"))


def test_cli_reports_failure_with_chapter_and_model(tiny, capsys):
    bookdir, nbdir = tiny
    write_notebook(nbdir / "03_encoder.ipynb", 'model = "m"', "1 / 0")
    rc = book.main(["build", "--book-dir", str(bookdir), "--notebooks-dir", str(nbdir), "--only", "03",
                    "--no-html"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "book build FAILED: 03_encoder [minilm-l6]" in err and "ZeroDivisionError" in err and "1 / 0" in err


def test_per_model_chapter_becomes_a_page_with_a_subpage_per_model(tiny):
    bookdir, nbdir = tiny
    for name in ("_config.yml", "intro.md"):
        shutil.copy(REPO / "book" / name, bookdir / name)
    shutil.copytree(REPO / "book" / "_ext", bookdir / "_ext")  # _config.yml's local Sphinx extension
    html = book.build(only="02", book_dir=bookdir, notebooks_dir=nbdir)
    chapter = html / "generated" / "02_models"
    index = parse_page(chapter / "index.html")
    assert {"smollm2-135m.html", "qwen-qwen3-8b.html"} <= set(index.links)
    page = (chapter / "qwen-qwen3-8b.html").read_text()
    assert "Per model (Qwen/Qwen3-8B)" in page and "model Qwen/Qwen3-8B 1 2" in page
    assert ">Qwen/Qwen3-8B</a>" in page  # the sidebar names the model


def test_rerun_page_lists_the_parameters_the_notebooks_declare():
    """book/rerun.md has a parameter table for some chapters: it must name exactly what they declare."""
    text = (REPO / "book" / "rerun.md").read_text()
    sections = re.findall(r"^\*\*[^*]+\*\* \(`(\w+)`[^)]*\)\n\n((?:\|.*\n)+)", text, flags=re.M)
    assert {name for name, _ in sections} >= {"02_geometry", "03_contribution_maps", "08_encoders"}
    chapters = {c.name for c in book.read_chapters(book.load_config(REPO / "book" / "run.yml"))}
    for name, table in sections:
        assert name in chapters, f"rerun.md documents {name}, which run.yml does not list"
        listed = set()
        for line in table.splitlines()[2:]:  # after the header and the |---| line
            first = line.split("|")[1]
            listed |= set(re.findall(r"`(\w+)`", first))
        declared = book.notebook_parameters(REPO / "notebooks" / f"{name}.ipynb") - {
            "profile", "output_dir", "results_file", "results_dir"}
        assert listed == declared, f"rerun.md, {name}: documents {sorted(listed)}, declared {sorted(declared)}"


# --------------------------------------------------------------------------------------------------
# End to end: the real book, smoke profile, in a temporary directory
# --------------------------------------------------------------------------------------------------
class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.links = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img" and attrs.get("src"):
            self.images.append(attrs["src"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def parse_page(path: Path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text())
    return parser


# the `smoke_book` fixture (one smoke build per session) is in tests/conftest.py


def test_smoke_book_pages_and_images(smoke_book):
    bookdir, _, html = smoke_book
    config = book.load_config(bookdir / "run.yml")
    _, _, runs = book.plan(config, profile="smoke", generated_dir=bookdir / "generated")
    assert runs, "run.yml lists no chapters"
    pages = [html / "intro.html"] + [html / Path(os.path.relpath(r.output, bookdir)).with_suffix(".html")
                                     for r in runs]
    pages += [html / f"{c.name}.html" for c in book.read_chapters(config) if c.is_page]
    assert (html / "index.html").is_file()
    for page in pages:
        assert page.is_file(), f"missing page {page}"
        parsed = parse_page(page)
        for src in parsed.images:
            if not src.startswith(("http:", "https:", "data:")):
                target = (page.parent / urllib.parse.unquote(src.split("#")[0])).resolve()
                assert target.is_file(), f"{page.name}: <img src={src}> points at nothing"
        for href in parsed.links:
            if not href.startswith(("http:", "https:", "mailto:", "#", "javascript:")):
                target = (page.parent / urllib.parse.unquote(href.split("#")[0])).resolve()
                assert target.exists(), f"{page.name}: link {href} points at nothing"
    geometry = html / "generated" / "02_geometry.html"
    assert len(parse_page(geometry).images) >= 5  # the chapter's figures are in the page
    figures = sorted(p.name for p in (bookdir / "generated" / "figures" / "02_geometry").iterdir())
    assert "sum_of_arrows.png" in figures and not [f for f in figures if f.startswith(".")]
    text = geometry.read_text()
    assert "Failed to format" not in text and "Traceback" not in text


def _valid_png(path: Path) -> bool:
    import matplotlib.image

    data = path.read_bytes()
    return data[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(path).shape[0] > 50


def _valid_svg(path: Path) -> bool:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()  # well-formed XML ...
    return root.tag == "{http://www.w3.org/2000/svg}svg" and len(list(root.iter())) > 10  # ... with drawing in it


def test_smoke_book_has_slide_ready_figures(smoke_book):
    """Every figure a run saved with save_figure is in html/figures/<chapter>/[<model>/] as PNG and SVG,
    and the index page links to each file."""
    bookdir, _, html = smoke_book
    config = book.load_config(bookdir / "run.yml")
    _, _, runs = book.plan(config, profile="smoke", generated_dir=bookdir / "generated")
    folders = [f for f in book.figure_folders(runs) if f.source.is_dir() and any(f.source.iterdir())]
    assert {f.dest for f in folders} >= {"02_geometry", "03_contribution_maps/smollm2-135m"}
    for folder in folders:
        saved = sorted(p.name for p in folder.source.iterdir() if not p.name.startswith("."))
        copied = sorted(p.name for p in (html / "figures" / folder.dest).iterdir())
        assert copied == saved, folder.dest
        stems = {Path(n).stem for n in saved}
        for stem in stems:  # save_figure writes both formats
            assert {f"{stem}.png", f"{stem}.svg"} <= set(saved), f"{folder.dest}/{stem}"
    chapter2 = html / "figures" / "02_geometry"
    assert _valid_png(chapter2 / "sum_of_arrows.png") and _valid_svg(chapter2 / "sum_of_arrows.svg")
    assert (chapter2 / "sum_of_arrows.png").read_bytes() == \
        (bookdir / "generated" / "figures" / "02_geometry" / "sum_of_arrows.png").read_bytes()
    index = html / "figures" / "index.html"
    links = parse_page(index)
    for href in links.links + links.images:
        assert (index.parent / urllib.parse.unquote(href)).resolve().is_file(), f"figures/index.html: {href}"
    listed = {href for href in links.links if href.endswith(".svg")}
    assert "02_geometry/sum_of_arrows.svg" in listed
    assert len(listed) == sum(len({Path(n).stem for n in os.listdir(f.source)}) for f in folders)


def test_unchanged_rebuild_does_nothing_and_a_failed_html_build_keeps_the_old_site(smoke_book, smoke_code_version,
                                                                                  monkeypatch, capsys):
    from cwcore import cache

    bookdir, build_dir, html = smoke_book
    monkeypatch.setattr(cache, "code_version", lambda: smoke_code_version)  # as when it was built
    capsys.readouterr()
    book.build(profile="smoke", book_dir=bookdir, build_dir=build_dir)
    out = capsys.readouterr().out
    assert "done in" not in out and "html  up to date" in out

    index = (html / "intro.html").read_bytes()
    intro = bookdir / "intro.md"
    original = intro.read_text()
    try:
        intro.write_text(original + "\nSee {doc}`a page that does not exist <nowhere>`.\n")
        with pytest.raises(book.BookError, match="warnings are errors"):
            book.build_html(bookdir, build_dir)
        assert (html / "intro.html").read_bytes() == index  # the previous site is intact
        assert not [p for p in build_dir.iterdir() if p.name.startswith(".tmp-build")]
    finally:
        intro.write_text(original)


def test_figures_are_copied_into_the_html_tree_with_an_index(tmp_path):
    """copy_figures: every figure file of each run's output_dir, under html/figures/<dest>, and one index."""
    once = tmp_path / "gen" / "figures" / "01_once"
    per = tmp_path / "gen" / "02_models" / "figures" / "m-1"
    for folder, names in ((once, ["a.png", "a.svg", ".a.partial", "notes.txt"]), (per, ["b.png", "b.svg"])):
        folder.mkdir(parents=True)
        for n in names:
            (folder / n).write_bytes(n.encode())
    folders = [book.FigureFolder("01_once", once, "Once <chapter>"),
               book.FigureFolder("02_models/m-1", per, "Per model", "m/1"),
               book.FigureFolder("03_none/x", tmp_path / "missing", "Nothing", "x")]
    html = tmp_path / "html"
    index = book.copy_figures(html, folders)
    assert sorted(p.name for p in (html / "figures" / "01_once").iterdir()) == ["a.png", "a.svg"]
    assert (html / "figures" / "02_models" / "m-1" / "b.svg").read_bytes() == b"b.svg"
    text = index.read_text()
    assert "Once &lt;chapter&gt;" in text and "<h3>m/1</h3>" in text and "Nothing" not in text  # no figures: not listed
    assert not (html / "figures" / "03_none").exists()
    links = parse_page(index)
    assert set(links.links) >= {"01_once/a.png", "01_once/a.svg", "02_models/m-1/b.svg", "../index.html"}
    assert links.images == ["01_once/a.png", "02_models/m-1/b.png"]
    # the runs of a plan name their folders: once chapters by chapter, per_model ones by chapter and model
    runs = [book.Run(book.Chapter("01_once", "once"), None, tmp_path / "01_once.ipynb",
                     tmp_path / "gen" / "01_once.ipynb", {"output_dir": "figures/01_once"}),
            book.Run(book.Chapter("02_models", "per_model"), "m/1", tmp_path / "02_models.ipynb",
                     tmp_path / "gen" / "02_models" / "m-1.ipynb", {"output_dir": "figures/m-1"})]
    assert [(f.dest, f.source) for f in book.figure_folders(runs)] == [("01_once", once), ("02_models/m-1", per)]


# --------------------------------------------------------------------------------------------------
# A real browser on the built book
# --------------------------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHECK_SCRIPT = b"""<script>
window.addEventListener("load", function () {
  var images = Array.from(document.images).map(function (im) {
    return {src: im.currentSrc || im.src, complete: im.complete, width: im.naturalWidth};
  });
  var links = Array.from(document.querySelectorAll(
      ".bd-sidebar-primary a[href], .prev-next-area a[href]")).map(function (a) { return a.href; });
  var out = document.createElement("pre");
  out.id = "cwcore-check";
  out.textContent = JSON.stringify({images: images, links: links});
  document.body.appendChild(out);
});
</script>"""


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the build; HTML pages get a script that reports images and navigation links on load."""

    def do_GET(self):
        path = Path(self.translate_path(self.path))
        if path.suffix == ".html" and path.is_file():
            body = path.read_bytes().replace(b"</body>", CHECK_SCRIPT + b"</body>", 1)
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(smoke_book):
    html = smoke_book[2]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=str(html)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def chromium(tmp_path, *args, timeout=90) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed and could not be: `make test` installs "
                                              "Debian's chromium as root (apt-get install chromium)")
def test_browser_renders_images_and_navigation(smoke_book, served, tmp_path):
    build_dir = smoke_book[1]
    checked_links = set()
    for page in ("intro.html", "generated/02_geometry.html"):
        proc = chromium(tmp_path, "--virtual-time-budget=10000", "--dump-dom", served + page)
        match = re.search(r'<pre id="cwcore-check"[^>]*>(.*?)</pre>', proc.stdout, re.S)
        assert match, f"{page}: no report from the page script\n{proc.stderr[-2000:]}"
        report = json.loads(htmllib.unescape(match.group(1)))
        broken = [im["src"] for im in report["images"] if not im["complete"] or im["width"] == 0]
        assert not broken, f"{page}: broken images {broken}"
        if page.startswith("generated/"):
            assert len(report["images"]) >= 5
        nav = {link.split("#")[0] for link in report["links"] if link.startswith(served)}
        assert served + "generated/02_geometry.html" in nav and served + "intro.html" in nav
        for link in nav - checked_links:
            with urllib.request.urlopen(link, timeout=10) as resp:
                assert resp.status == 200, link
        checked_links |= nav

    shots = build_dir / "screenshots"
    shots.mkdir(exist_ok=True)
    for page, name in (("intro.html", "intro.png"), ("generated/02_geometry.html", "02_geometry.png")):
        proc = chromium(tmp_path, "--hide-scrollbars", "--window-size=1280,1600", "--virtual-time-budget=10000",
                        f"--screenshot={shots / name}", served + page)
        assert (shots / name).is_file(), proc.stderr[-2000:]
        import matplotlib.image

        pixels = matplotlib.image.imread(shots / name)
        assert pixels.shape[0] >= 1000 and pixels.std() > 0.05, f"{name} looks blank"


# --------------------------------------------------------------------------------------------------
# The shared plotting style (cwcore.plotting)
# --------------------------------------------------------------------------------------------------
def test_save_figure_is_atomic_and_heatmap_is_centred_at_zero(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from cwcore import plotting

    plotting.set_style()
    weights = np.array([[1.0, np.nan], [1.6, -0.6]])
    fig, (ax0, ax1) = plt.subplots(1, 2)
    image = plotting.contribution_heatmap(ax0, weights, ["<s>", " cat"], "contribution")
    # symmetric about zero: -0.6 must look weaker than +1.6, not equally strong
    assert image.norm.vcenter == 0 and image.norm.vmin == -1.6 and image.norm.vmax == 1.6
    assert [t.get_text() for t in ax0.get_yticklabels()] == ["<s>", "\u2423cat"]
    attention = plotting.contribution_heatmap(ax1, [[1.0, 0.0], [0.3, 0.7]], ["$", "b"], "attention",
                                              vmin=-0.6, vmax=1.6)  # one scale for both panels
    assert attention.norm.vmin == -0.6 and ax1.get_yticklabels()[0].get_text() == r"\$"

    path = plotting.save_figure(fig, tmp_path / "figs", "heat", formats=("png", "svg"))
    assert path == tmp_path / "figs" / "heat.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "figs" / "heat.svg").is_file()
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["heat.png", "heat.svg"]  # no temp files
    with pytest.raises(ValueError):
        plotting.save_figure(fig, tmp_path, "../escape")
    with pytest.raises(ValueError):
        plotting.save_figure(fig, tmp_path / "figs", "bad", formats=("nope",))
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["heat.png", "heat.svg"]
    default = plotting.save_figure(fig, tmp_path / "both", "heat")
    assert default == tmp_path / "both" / "heat.png"
    assert sorted(p.name for p in (tmp_path / "both").iterdir()) == ["heat.png", "heat.svg"]
    first = (tmp_path / "both" / "heat.svg").read_bytes()
    plotting.save_figure(fig, tmp_path / "both", "heat")
    assert (tmp_path / "both" / "heat.svg").read_bytes() == first  # no date, fixed ids: the same bytes
    assert b"<dc:date>" not in first
    plt.close(fig)


@pytest.mark.parametrize("models", [["Qwen/Qwen3-8B", "qwen-qwen3-8b"], ["org/a.b", "org/a-b"], ["x", "x"]])
def test_models_whose_file_names_collide_are_refused_up_front(tiny, models):
    with pytest.raises(book.BookError, match="same file name|listed twice"):
        plan_tiny(tiny, models=models)


def test_a_relative_cache_resolves_against_the_working_folder_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CWCORE_CACHE", "my-cache")
    with book._kernel_environment():
        assert os.environ["CWCORE_CACHE"] == str(tmp_path / "my-cache")
    assert os.environ["CWCORE_CACHE"] == "my-cache"


def test_a_chapter_index_quotes_the_notebooks_question(tmp_path):
    """The question is the paragraph after the title, run on into a displayed formula when its sentence does;
    a notebook that opens with anything else gives none."""
    def notebook(text):
        path = tmp_path / f"nb{len(list(tmp_path.iterdir()))}.ipynb"
        path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": text}], "metadata": {},
                                    "nbformat": 4, "nbformat_minor": 5}))
        return path

    whole = notebook("# T\n\nDoes it hold?\n\nMethod details.")
    assert book.notebook_question(whole) == "Does it hold?"
    run_on = notebook("# T\n\nIt reads sinks through\n\n$$\nc = a b\n$$\n\nand claims so.\n\nMethod.")
    assert book.notebook_question(run_on) == "It reads sinks through\n\n$$\nc = a b\n$$\n\nand claims so."
    assert book.notebook_question(notebook("# T\n\n## Setup\n\nx")) == ""
