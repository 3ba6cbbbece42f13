"""The confirmatory registration (book/preregistration.md, "Confirmatory registration") and the code that
holds it agree: the constants that decide a confirmatory verdict hash to the registered value (or a dated
deviation names the new hash), the sample is the registered one and disjoint from every exploratory
export, and the registration commit predates every confirmatory export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from cwbook import registration
from cwcore.data import load_dataset
from cwbook import ladder as evidence

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "book" / "preregistration.md"
EXPLORATORY_DIR = REPO / "data" / "results" / "evidence"
CONFIRMATORY_DIR = REPO / "data" / "results" / "confirmatory"


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("## Confirmatory registration")
    return text[start:text.index("\n## ", start + 1)]


def _deviations() -> str:
    section = _section()
    return section[section.index("### Deviations from the confirmatory registration"):]


def test_the_constants_hash_to_the_registered_value_or_a_dated_deviation_names_the_new_hash():
    registered = re.search(r"constants sha256 `([0-9a-f]{64})`", _section()).group(1)
    now = registration.constants_hash()
    if now != registered:
        entry = [line for line in _deviations().splitlines() if now in line]
        assert entry, (f"the registered constants changed ({registered[:12]} -> {now[:12]}) without a deviation "
                       "entry naming the new hash in book/preregistration.md")
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", entry[0]), "a deviation entry carries its date"


def test_the_hash_moves_with_every_deciding_constant(monkeypatch):
    """The control of the test above: changing a margin, a sink threshold or the sample's seed changes the
    hash (a hash that ignored them would pass whatever the code did)."""
    before = registration.constants_hash()
    monkeypatch.setitem(evidence.MARGINS, "sufficiency", 0.02)
    assert registration.constants_hash() != before
    monkeypatch.undo()
    assert registration.constants_hash() == before
    monkeypatch.setattr(registration, "CONFIRMATORY_SEED", registration.CONFIRMATORY_SEED + 1)
    assert registration.constants_hash() != before
    monkeypatch.undo()
    claims = list(registration.SINK_CLAIMS)
    claims[1] = {**claims[1], "parts": claims[1]["parts"][:-1]}  # drop the decomposition's null control
    monkeypatch.setattr(registration, "SINK_CLAIMS", tuple(claims))
    assert registration.constants_hash() != before


def test_the_page_states_the_sample_the_code_draws():
    section = " ".join(_section().split())
    assert "2026-12-05" in section and registration.REGISTERED == "2026-12-05"
    assert f"**seed {registration.CONFIRMATORY_SEED}**" in section
    assert f"**{registration.CONFIRMATORY_DOCUMENTS} documents per data set**" in section
    assert f"**{registration.CONFIRMATORY_SEQ_LEN}-token block**" in section
    assert f"first **{registration.EXPLORATORY_PREFIX} positions of the seed-0 permutation**" in section
    assert f"first **{registration.STREAM_DOCUMENTS} documents in data-set order**" in section
    for claim in registration.SINK_CLAIMS:
        assert claim["claim"] in section
    for model in registration.CONFIRMATORY_MODELS:
        for data in registration.CONFIRMATORY_DATA:
            assert re.search(rf"\| {re.escape(model)} \| {data} \| [^|]+ \| `[0-9a-f]{{64}}` \|", _section())


def _exploratory_ids() -> dict[str, set[int]]:
    found: dict[str, set[int]] = {}
    for path in EXPLORATORY_DIR.rglob("*.json"):
        meta = json.loads(path.read_text())
        if isinstance(meta, dict) and "document_ids" in meta and meta.get("data"):
            found.setdefault(meta["data"], set()).update(int(i) for i in meta["document_ids"])
    return found


def test_the_left_out_documents_cover_every_committed_exploratory_export():
    found = _exploratory_ids()
    assert set(found) >= set(registration.CONFIRMATORY_DATA)
    for data, ids in found.items():
        left_out = registration.exploratory_documents(len(load_dataset(data)))
        assert ids <= left_out, f"{data}: exploratory documents {sorted(ids - left_out)[:5]} could be drawn again"


@pytest.mark.slow
@pytest.mark.parametrize("model", registration.CONFIRMATORY_MODELS)
def test_the_confirmatory_sample_is_the_registered_one_and_disjoint(model):
    from transformers import AutoTokenizer

    from cwcore.models import packaged_model_path

    tokenizer = AutoTokenizer.from_pretrained(packaged_model_path(model))
    section, found = _section(), _exploratory_ids()
    for data in registration.CONFIRMATORY_DATA:
        ids = [int(i) for i in registration.confirmatory_blocks(data, tokenizer)["document"]]
        assert len(ids) == registration.CONFIRMATORY_DOCUMENTS == len(set(ids))
        row = re.search(rf"\| {re.escape(model)} \| {data} \| ([^|]+) \| `([0-9a-f]{{64}})` \|", section)
        assert row.group(2) == registration.document_hash(ids)
        assert row.group(1).startswith(", ".join(map(str, ids[:4])))
        assert not set(ids) & found[data]


def _git(*args) -> str | None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def test_the_registration_commit_predates_every_confirmatory_export():
    if _git("rev-parse", "HEAD") is None:
        pytest.skip("no git history here (an unpacked archive): the order of commits cannot be read")
    added = _git("log", "--format=%H %ct", "-S", "## Confirmatory registration", "--", "book/preregistration.md")
    if not added:
        pytest.skip("the registration is not committed yet")
    registered_commit, registered_at = added.splitlines()[-1].split()
    for path in sorted(CONFIRMATORY_DIR.rglob("*")) if CONFIRMATORY_DIR.is_dir() else []:
        if not path.is_file():
            continue
        first = _git("log", "--diff-filter=A", "--format=%H %ct", "--", str(path.relative_to(REPO)))
        if not first:  # not committed yet: written after the registration by construction
            continue
        commit, at = first.splitlines()[-1].split()
        assert int(at) >= int(registered_at) and commit != registered_commit, path.name
        assert _git("merge-base", "--is-ancestor", registered_commit, commit) is not None, path.name


def test_the_confirmatory_build_never_runs_the_notebooks_and_a_smoke_run_never_reads_the_sample(tmp_path,
                                                                                                 monkeypatch):
    """``--profile confirmatory`` runs the confirmatory build (the notebooks draw the exploratory samples);
    a smoke run must go elsewhere than the committed folder and its files never read as confirmatory."""
    import cwbook as book
    from cwbook import confirmatory

    assert book.PROFILE_BUILDS[registration.CONFIRMATORY] is confirmatory.build
    assert confirmatory.main(["sinks", "--smoke", "2"]) == 2  # into the committed folder: refused before any work
    for argv in (["ladder", "--smoke", "0", "--out", str(tmp_path)], ["ladder", "--jobs", "0"]):
        assert confirmatory.main(argv) == 2  # before any model loads (a traceback after it)
    from cwcore.cli import UsageError

    with pytest.raises(UsageError, match="ladder, sinks and tables"):  # one line, status 2 (a ValueError: 1)
        confirmatory.build(only="ladder,figures")
    # through python -m cwbook build: an unregistered model was written into the committed folder, and the
    # notebook build's options (--config, --force, ...) were swallowed; each is refused before any work
    def no_work(*args, **kwargs):
        raise AssertionError("a step ran")

    for step in ("ladder", "sinks", "tables", "write_status"):
        monkeypatch.setattr(confirmatory, step, no_work)
    with pytest.raises(UsageError, match="not registered: tiny-qwen2"):
        confirmatory.build(models="tiny-qwen2")
    with pytest.raises(UsageError, match=r"^--config, --force: the confirmatory build executes no notebook"):
        confirmatory.build(config_path=tmp_path / "run.yml", force=True)
    assert book.main(["build", "--profile", "confirmatory", "--models", "tiny-qwen2"]) == 2
    # --only names the build's steps (a chapter passed the up-front check, then failed as an unknown step;
    # a step failed the check); here it reaches the build, which runs that step alone
    ran = []
    monkeypatch.setattr(confirmatory, "sinks", lambda models, out: ran.append(("sinks", list(models))) or [])
    monkeypatch.setattr(confirmatory, "write_status", lambda out: ran.append("status") or tmp_path)
    assert book.main(["build", "--profile", "confirmatory", "--only", "sinks", "--models", "gemma3-270m"]) == 0
    assert ran == [("sinks", ["gemma3-270m"]), "status"]
    assert book.main(["build", "--profile", "confirmatory", "--only", "04_faithfulness"]) == 2
    assert registration.sample_of(confirmatory._profile(2)) == registration.EXPLORATORY
    assert registration.sample_of(confirmatory._profile(None)) == registration.CONFIRMATORY


def test_plan_of_the_confirmatory_profile_lists_what_its_build_computes(capsys):
    """``plan --profile confirmatory`` listed eleven notebook runs the confirmatory build never executes; it
    prints the build's ladder cells and sink passes with the parameters they run with."""
    import json

    import cwbook as book
    from cwbook import confirmatory
    from cwbook.parameters import run_parameters

    assert book.main(["plan", "--profile", "confirmatory"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "executes no notebook" in lines[0] and not any(".ipynb" in line for line in lines)
    ladder = [line for line in lines if line.startswith("ladder")]
    cells = [(m, d) for m in registration.CONFIRMATORY_MODELS for d in registration.CONFIRMATORY_DATA]
    assert len(ladder) == len(cells)
    for line, (model, data) in zip(ladder, cells):
        assert f"{model} on {data}" in line
        shown = json.loads(line[line.index("{"):])
        p = confirmatory.ladder_parameters(model)
        assert shown["ratios"] == p["ratios"] and shown["n_bootstrap"] == p["n_bootstrap"] == 2000
    sinks = [line for line in lines if line.startswith("sinks")]
    assert len(sinks) == len(registration.CONFIRMATORY_MODELS)
    shared = run_parameters("05_sink_decomposition", "confirmatory", "gemma3-270m")["run_parameters"]
    assert json.loads(sinks[1][sinks[1].index("{"):]) == shared
    assert book.main(["plan", "--profile", "confirmatory", "--only", "tables"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["tables"]
    assert book.main(["plan", "--profile", "confirmatory", "--only", "02"]) == 2  # a chapter: not a step


@pytest.mark.slow
def test_the_confirmatory_runs_draw_the_registered_sample_and_smoke_runs_the_exploratory_one():
    from transformers import AutoTokenizer

    from cwbook import confirmatory
    from cwcore.models import packaged_model_path

    tokenizer = AutoTokenizer.from_pretrained(packaged_model_path("smollm2-135m"))
    registered = list(confirmatory._sample("gsm8k", tokenizer, None)["document"])
    assert registration.document_hash(registered) == registration.document_hash(
        list(registration.confirmatory_blocks("gsm8k", tokenizer)["document"]))
    smoke = list(confirmatory._sample("gsm8k", tokenizer, 3)["document"])
    assert set(smoke) <= _exploratory_ids()["gsm8k"] and not set(smoke) & set(registered)


@pytest.mark.parametrize("owner, name, value", [
    (evidence, "ALPHA", 0.01), (evidence, "N_PERMUTATIONS", 999), (registration, "N_BOOTSTRAP", 1000),
    (registration, "SINK_RESAMPLES", 2000), (registration, "RANDOM_SEEDS", 1), (registration, "MDE_LEVEL", 0.05),
    (registration, "EXPLORATORY_PREFIX", 83), (registration, "STREAM_DOCUMENTS", 32),
    (registration, "CONFIRMATORY_DOCUMENTS", 32), (registration, "CONFIRMATORY_SEQ_LEN", 256),
])
def test_the_hash_reads_each_deciding_constant_where_it_is_defined(monkeypatch, owner, name, value):
    """A constant written into constants() as a literal would keep the registered hash however the code that
    decides changed (the level, the resamples, the control's seeds, the sample's size): each moves it."""
    before = registration.constants_hash()
    assert getattr(owner, name) != value
    monkeypatch.setattr(owner, name, value)
    assert registration.constants_hash() != before


def test_the_left_out_documents_are_the_registered_prefix_and_stream():
    # the registration's words: the first 128 positions of the seed-0 permutation and the first 64 documents
    # in data-set order; 1000 rows keep the two parts mostly apart, so a shorter part shows in the size
    n_rows = 1000
    prefix = np.random.default_rng(0).permutation(n_rows)[:128]
    expected = {int(i) for i in prefix} | set(range(64))
    assert registration.exploratory_documents(n_rows) == expected
    assert len(expected) > 128  # the stream adds documents the prefix does not hold
    # a data set shorter than the stream: all of it is left out
    assert registration.exploratory_documents(40) == set(range(40))


def test_the_confirmatory_status_counts_a_cell_done_only_with_every_registered_document(tmp_path, monkeypatch):
    """STATUS.md's "N of M parts done": a ladder cell is done when its export holds all 64 documents (one short,
    or none, is not); a model's sink part when all three chapters' tables verify (none here)."""
    from cwbook import confirmatory

    n = registration.CONFIRMATORY_DOCUMENTS
    cells = [{"model": "smollm2-135m", "data": "gsm8k", "protocol": p, "documents": d, "created": ""}
             for p, d in (("default", n), ("per-head", n - 1), ("token-unit", 0))]
    monkeypatch.setattr(confirmatory, "ladder_progress", lambda out: cells)
    page = confirmatory.status(tmp_path)
    parts = len(cells) + len(registration.CONFIRMATORY_MODELS)
    assert f"1 of {parts} parts done" in page
    assert f"| smollm2-135m | gsm8k | per-head | {n - 1} of {n} |  |" in page
    assert f"| {registration.CONFIRMATORY_MODELS[0]} | 0 of 3 | none |" in page
