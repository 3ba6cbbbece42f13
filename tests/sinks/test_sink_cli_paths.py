"""``python -m cwcore.sinks``'s outputs: file names from slugs, confined to their folder, the default folder in
the working folder (never a repository's committed tables), every argument checked before a model loads,
and ``--help`` without torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cwcore.sinks import cli
from sink_fixtures import word_tokenizer as _word_tokenizer
from tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [" ".join(f"w{(i * 5 + j) % 20}" for j in range(40)) for i in range(4)]


def _fake_loading(monkeypatch):
    import cwcore.data
    import cwcore.models

    monkeypatch.setattr(cwcore.models, "load_model",
                        lambda name, dtype=None, device=None: (tiny_model("llama"), _word_tokenizer()))
    monkeypatch.setattr(cwcore.data, "load_dataset", lambda name: TEXTS)
    monkeypatch.setattr(cwcore.data, "missing_local_file", lambda name: False)  # the data are the texts above


ARGS = ["--num-sequences", "2", "--block-size", "12", "--batch-size", "2", "--no-cache", "--analyses", "rates"]


def test_names_become_slugs_and_stay_in_their_folder(tmp_path, monkeypatch):
    _fake_loading(monkeypatch)
    out = tmp_path / "deep" / "out"
    assert cli.main(["--model", "../../org/My Model", "--data", "../data/x.txt", *ARGS, "--out", str(out),
                     "--raw", str(tmp_path / "raw")]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    tables = [w for w in written if not w.startswith("raw/")]
    assert tables == sorted(f"deep/out/sinks_{s}_org-my-model_data-x-txt.csv" for s in ("rates", "summary"))
    assert {Path(w).parts[1] for w in written if w.startswith("raw/")} == {"org-my-model_data-x-txt"}


def test_the_default_folder_is_in_the_working_folder(tmp_path, monkeypatch):
    _fake_loading(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["--model", "tiny", "--data", "words", *ARGS]) == 0
    assert sorted(p.name for p in (tmp_path / cli.DEFAULT_OUT).iterdir()) == \
        ["sinks_rates_tiny_words.csv", "sinks_summary_tiny_words.csv"]
    assert cli.DEFAULT_OUT == "cwcore-results" and not (tmp_path / "data").exists()


def test_an_out_that_is_a_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    import cwcore.models

    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    (tmp_path / "a.txt").write_text("x")
    assert cli.main(["--model", "m", "--data", "d", "--out", str(tmp_path / "a.txt")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert cli.main(["--model", "m", "--data", "d", "--out", str(tmp_path / "a.txt" / "sub")]) == 2


def test_help_answers_without_importing_torch():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "cwcore.sinks", "--help"], capture_output=True,
                          text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "--num-sequences" in done.stdout
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "pandas" not in imported


def test_the_declared_flags_are_the_options_of_the_analyses():
    from cwcore.sinks import SinkOptions

    declared = {n: (o.default, o.help, o.choices) for n, o in SinkOptions.OPTIONS.items() if o.cli}
    assert declared == cli.CLI_OPTIONS
    assert tuple(cli.ANALYSIS_NAMES) == tuple(__import__("cwcore.sinks", fromlist=["ANALYSES"]).ANALYSES)


def test_the_faithfulness_command_line_shares_the_rules(tmp_path, monkeypatch, capsys):
    import cwcore.models
    from cwcore.faithfulness import cli as fcli

    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    (tmp_path / "a.txt").write_text("x")
    assert fcli.main(["--out", str(tmp_path / "a.txt")]) == 2
    assert "is a file" in capsys.readouterr().err
    monkeypatch.setattr(fcli.models, "load_model", lambda *a, **k: (tiny_model("llama"), _word_tokenizer()))
    monkeypatch.setattr(fcli.data, "load_dataset", lambda *a, **k: TEXTS)
    monkeypatch.chdir(tmp_path)
    assert fcli.main(["--model", "org/x", "--data", "toy", "--num-sequences", "2", "--block-size", "8", "--metrics",
                      "attention", "--ratios", "0.1", "--no-cache", "--no-progress", "--n-bootstrap", "10"]) == 0
    assert sorted(p.name for p in (tmp_path / "cwcore-results").iterdir()) == \
        [f"{kind}_org_x_toy.csv" for kind in ("aopc", "faithfulness", "ladder")]


@pytest.mark.parametrize("module", ["cwcore.faithfulness.anatomy", "cwcore.sinks.claims"])
def test_a_module_that_is_gone_does_not_answer_with_its_packages_help(module):
    """``python -m cwcore.faithfulness.anatomy --help`` (a module moved to the book) printed the faithfulness
    command's help with status 0: the package's fast help answered for any module below it."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and f"No module named {module}" in done.stderr and "usage" not in done.stdout


def test_the_faithfulness_help_answers_without_torch_and_its_flags_agree():
    from cwcore.faithfulness import cli as fcli
    from cwcore.faithfulness.protocol import DEFAULT_METRICS, DEFAULT_RATIOS, KINDS
    from cwcore.faithfulness.ranking import MODES, SCOPES, UNITS

    assert fcli.CHOICES == {"metrics": tuple(DEFAULT_METRICS), "ratios": tuple(DEFAULT_RATIOS), "kinds": tuple(KINDS),
                            "modes": tuple(MODES), "scopes": tuple(SCOPES), "units": tuple(UNITS)}
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "cwcore.faithfulness", "--help"],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and "--num-sequences" in done.stdout
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "pandas" not in imported


def test_a_threshold_that_heads_all_would_not_read_is_refused(tmp_path, capsys):
    """The semantic cone reads ``threshold`` only with ``heads="sink"``. Before, ``--threshold 0.05`` (and
    ``sink_semantic_cone(threshold=0.05)``) with the default heads "all" ran and wrote the tables of the
    default, byte for byte, without a word."""
    from cwcore import sinks

    assert sinks.main(["--model", "tiny", "--data", "gsm8k", "--analyses", "semantic_cone", "--threshold", "0.05",
                       "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--threshold is read only with --heads 'sink'" in err and err.count("\n") == 1  # one line, no usage
    # an option SinkOptions refuses: argparse's 15 lines of usage came first, then the error
    assert sinks.main(["--model", "tiny", "--data", "gsm8k", "--eps", "1.5", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m cwcore.sinks: error: ") and "eps" in err and err.count("\n") == 1
    with pytest.raises(ValueError, match="threshold is read only with heads 'sink'"):
        sinks.sink_semantic_cone(None, None, None, threshold=0.05)


def test_a_missing_data_file_and_an_unread_kind_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """Both command lines found a missing --data file only after loading the model; the faithfulness one ran
    with --kind although no metric it was given reads a kind; an abbreviated --debug showed no traceback."""
    import cwcore.models
    from cwcore.cli import debug_requested
    from cwcore.faithfulness.cli import main as faithfulness_main

    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: pytest.fail("loaded before the check"))
    missing = str(tmp_path / "nothing.txt")
    assert cli.main(["--model", "tiny", "--data", missing, "--out", str(tmp_path / "a")]) == 2
    assert f"--data {missing}: no such file" in capsys.readouterr().err
    assert faithfulness_main(["--model", "tiny", "--data", missing, "--out", str(tmp_path / "b")]) == 2
    assert f"--data {missing}: no such file" in capsys.readouterr().err
    assert faithfulness_main(["--model", "tiny", "--metrics", "attention", "random", "--kind", "intra",
                              "--out", str(tmp_path / "c")]) == 2
    assert "--kind applies to the metrics with a kind" in capsys.readouterr().err
    # a metric whose name fixes its kind does not read --kind: the tables were those of a run without it
    assert faithfulness_main(["--model", "tiny", "--metrics", "contribution_inter", "random", "--kind", "intra",
                              "--out", str(tmp_path / "d")]) == 2
    assert "named without _inter or _intra" in capsys.readouterr().err
    assert debug_requested(["--model", "x", "--debu"]) and not debug_requested(["--model", "x"])
