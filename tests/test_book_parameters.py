"""The run parameters of a chapter: one reader of run.yml (cwbook.parameters), the runner's
``run_parameters`` dict for the chapters that share a set of them (5-7, cwbook.notebook.SinkRun)."""

from __future__ import annotations

from pathlib import Path

import pytest

import cwbook as book

from cwcore import sinks
from cwbook.notebook import SinkRun
from cwbook.parameters import declared_defaults, profile_models, run_parameters

REPO = Path(__file__).resolve().parents[1]
SINK_CHAPTERS = ("05_sink_decomposition", "06_sinks_as_suppressors", "07_semantic_cone")


def test_a_notebook_declaring_run_parameters_receives_every_undeclared_one_there():
    chapter = book.Chapter("05_x", "per_model")
    run = book.Run(chapter, "m", Path("05_x.ipynb"), Path("out/m.ipynb"),
                   {"seed": 3, "n_sequences": 2, "n_bootstrap": 50, "profile": "p", "model": "m",
                    "output_dir": "figures/m", "results_file": "r.csv", "results_dir": "."},
                   explicit=frozenset({"n_sequences", "n_bootstrap"}))
    given = book.injected_parameters(run, {"model", "profile", "n_bootstrap", book.RUN_PARAMETERS})
    # the names it declares directly, the others in the dict, none of the runner's own
    assert given == {"model": "m", "profile": "p", "n_bootstrap": 50,
                     book.RUN_PARAMETERS: {"seed": 3, "n_sequences": 2}}
    # without the dict, a parameter set for this notebook that it does not declare is still a typo
    with pytest.raises(book.BookError, match=r"does not declare \['n_sequences'\]"):
        book.injected_parameters(run, {"model", "profile", "n_bootstrap"})


def test_the_sink_chapters_share_one_run_and_refuse_an_unknown_parameter():
    for profile in ("smoke", "default", "evidence"):
        runs = {c: SinkRun.of(run_parameters(c, profile, "smollm2-135m")[book.RUN_PARAMETERS]) for c in SINK_CHAPTERS}
        assert len(set(map(repr, runs.values()))) == 1, f"{profile}: chapters 5-7 run different passes {runs}"
    smoke = SinkRun.of(run_parameters("05_sink_decomposition", "smoke", "smollm2-135m")[book.RUN_PARAMETERS])
    assert (smoke.n_sequences, smoke.seq_len, smoke.batch_size, smoke.seed) == (2, 24, 2, 0)
    assert smoke.datasets == SinkRun().datasets == ("gsm8k", "web-text")
    with pytest.raises(TypeError, match=r"\['n_sequnces'\]"):
        SinkRun.of({"n_sequnces": 4})
    # the options are SinkOptions with the run's sizes and the given fields (eps changed here)
    options = SinkRun.of({"seq_len": 24, "batch_size": 2, "sink_options": {"eps": 0.2}}).options()
    assert options == sinks.SinkOptions(block_size=24, batch_size=2, seed=0, progress=False, eps=0.2)
    # none of 5-7 declares a shared run parameter by name any more
    shared = {f for f in SinkRun.__dataclass_fields__}
    for chapter in SINK_CHAPTERS:
        declared = declared_defaults(REPO / "notebooks" / f"{chapter}.ipynb")
        assert not shared & set(declared) and declared[book.RUN_PARAMETERS] == {}


def test_run_parameters_are_the_runners_over_the_notebooks_defaults():
    config = book.load_config(REPO / "book" / "run.yml")
    params = run_parameters("04_faithfulness", "default", "gemma3-270m", config=config)
    defaults = declared_defaults(REPO / "notebooks" / "04_faithfulness.ipynb")
    profile = config["profiles"]["default"]
    expected = {**defaults, **profile["params"], **profile["notebooks"]["04_faithfulness"], "profile": "default",
                "model": "gemma3-270m", "output_dir": "figures/gemma3-270m"}
    expected.pop("results_file")
    assert {k: params[k] for k in expected} == expected
    assert params["results_file"].endswith("results/default/04_faithfulness/gemma3-270m.csv")
    assert profile_models("default", config=config) == ["smollm2-135m", "gemma3-270m"]
    with pytest.raises(book.BookError, match="does not run"):
        run_parameters("04_faithfulness", "default", None, config=config)


def test_plan_refuses_a_profile_parameter_no_chapter_takes_and_one_chapters_5_7_would_refuse(tmp_path, capsys):
    """A typo in a profile's ``params`` was left out of every notebook without a word (chapters 2-4 and 8
    ran without it; 5-7 failed only when executed): ``plan`` and ``build`` refuse it before anything runs."""
    import yaml

    config = book.load_config(REPO / "book" / "run.yml")
    config["profiles"]["smoke"]["params"]["n_sequence"] = 2  # meant: n_sequences
    path = tmp_path / "run.yml"
    path.write_text(yaml.safe_dump(config))
    for only in ("04_faithfulness", "08"):  # neither chapter collects run_parameters
        assert book.main(["plan", "--profile", "smoke", "--config", str(path), "--only", only]) == 2
        err = capsys.readouterr().err
        assert "params ['n_sequence'] are declared by no chapter" in err and "did you mean 'n_sequences'" in err
    # a name chapters 5-7 would refuse, set for one of them alone
    config["profiles"]["smoke"]["params"].pop("n_sequence")
    config["profiles"]["smoke"]["notebooks"]["05_sink_decomposition"] = {"n_sequnces": 2}
    path.write_text(yaml.safe_dump(config))
    assert book.main(["plan", "--profile", "smoke", "--config", str(path), "--only", "05"]) == 2
    assert "run parameters ['n_sequnces'] are not among those of chapters 5-7" in capsys.readouterr().err
    # a name only the collectors take (SinkRun's cache) and the real run.yml pass
    config["profiles"]["smoke"]["notebooks"]["05_sink_decomposition"] = {"cache": False}
    config["profiles"]["smoke"]["params"]["sink_options"] = {}
    path.write_text(yaml.safe_dump(config))
    assert book.main(["plan", "--profile", "smoke", "--config", str(path), "--only", "05"]) == 0
    for profile in ("smoke", "default", "evidence", "confirmatory"):
        assert book.main(["plan", "--profile", profile]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):  # plan builds nothing: it takes no --build-dir
        book.main(["plan", "--build-dir", str(tmp_path)])
