"""One validation layer for every public entry, one error path for every command line,
atomic outputs, the cache command on odd caches, the explorer's escaping, the checkout warning.

Each refusal is checked at every entry that takes the argument (an input one entry refuses is refused by
all, with the project's own :class:`~cwcore.core.inputs.InputError`), and each valid neighbour of a
refused input still gives the reference result (the control: the checks refuse only what is wrong).
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pandas as pd
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import cwcore
from cwcore import sinks
from cwcore.core.inputs import (InputError, check_attention_mask, check_fraction, check_layers, check_ratios,
                                check_targets, check_token_sequences)
from cwcore.faithfulness import downstream_eval, faithfulness_curve
from cwcore.faithfulness.layers import per_layer_curve
from cwcore.logit_attribution import logit_attribution
from tiny_models import VOCAB, tiny_model

FC = dict(progress=False, n_bootstrap=10, batch_size=2)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


WORDS = ["[UNK]", "<s>", "</s>"] + "the cat sat on a mat and dog ran far away <!--<script> </script> --> " \
    "__DATA__ __META__ a\u2028b x".split(" ")


def word_tokenizer(words=WORDS):
    backend = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(words))}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")  # U+2028 stays inside its word
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")


# --------------------------------------------------------------------------------------------------
# the shared checks
# --------------------------------------------------------------------------------------------------
def test_checks_accept_the_valid_and_refuse_the_rest_in_one_sentence():
    assert check_ratios([0.5, 0.1, 0.5]) == [0.1, 0.5] and check_ratios(0.2) == [0.2]
    assert check_fraction(0.3, "eps") == 0.3 and check_layers(-1, 2) == [1]
    for bad in ([], [1.5], [float("nan")], ["a"], [True]):
        with pytest.raises(InputError, match="ratios"):
            check_ratios(bad)
    with pytest.raises(InputError, match=r"eps must be a number in \[0, 1\], got nan"):
        check_fraction(float("nan"), "eps")
    with pytest.raises(InputError, match="layers is empty"):
        check_layers([], 2, allow_empty=False)
    assert check_layers([], 2) == []  # decompose's own contract keeps working
    with pytest.raises(InputError, match="integer token ids"):
        check_token_sequences([[1.0, 2.5]])
    assert check_token_sequences(torch.tensor([[1, 2]])) == [[1, 2]]
    with pytest.raises(InputError, match="0 \\(padding\\) and 1"):
        check_attention_mask(torch.full((1, 3), 0.5), (1, 3))
    # targets: an int is one id for every position, negative ids are refused (not counted from the end)
    assert torch.equal(check_targets(3, (2, 4), 10), torch.full((2, 4), 3))
    for bad, message in ((-1, "lie in \\[0, 10\\)"), (10, "lie in"), (1.5, "integer"), (True, "integer"),
                         (torch.ones(3, dtype=torch.long), "shape")):
        with pytest.raises(InputError, match=message):
            check_targets(bad, (2, 4), 10)
    # the typed errors stay the built-in ones, so code that caught those keeps working
    with pytest.raises(TypeError):
        check_token_sequences([[1.5]])
    with pytest.raises(IndexError):
        check_layers([7], 2)


# every entry point that reads token data, called with that data (all other arguments valid)
def _entries(model):
    return {
        "faithfulness_curve": lambda d: faithfulness_curve(model, None, d, ["contribution"], 0.1, "comprehensiveness",
                                                           **FC),
        "per_layer_curve": lambda d: per_layer_curve(model, None, d, ["contribution"], 0.1, "comprehensiveness"),
        "sink_rates": lambda d: sinks.sink_rates(model, None, d, progress=False),
        "sink_decomposition": lambda d: sinks.sink_decomposition(model, None, d, progress=False),
        "decompose": lambda d: cwcore.decompose(model, input_ids=d),
        "logit_attribution": lambda d: logit_attribution(model, input_ids=d),
    }


@pytest.mark.parametrize("entry", ["faithfulness_curve", "per_layer_curve", "sink_rates", "sink_decomposition",
                                   "decompose", "logit_attribution"])
@pytest.mark.parametrize("case", ["float ids with fractions", "integral float ids", "out of vocabulary",
                                  "negative", "longer than the context"])
def test_every_entry_refuses_the_same_token_ids(model, ids, entry, case):
    bad = {"float ids with fractions": ids.float() + 0.5, "integral float ids": ids.float(),
           "out of vocabulary": ids + VOCAB, "negative": ids - VOCAB,
           "longer than the context": torch.randint(1, VOCAB, (1, 80))}[case]
    with pytest.raises(InputError):
        _entries(model)[entry](bad)


def test_float_ids_as_lists_and_float_masks_are_refused_not_cut(model, ids):
    with pytest.raises(InputError, match="integer token ids"):
        faithfulness_curve(model, None, {"input_ids": (ids.float() + 0.3).tolist()}, "contribution", 0.1, **FC)
    with pytest.raises(InputError, match="0 \\(padding\\) and 1"):
        faithfulness_curve(model, None, {"input_ids": ids, "attention_mask": torch.full(ids.shape, 0.5)},
                           "contribution", 0.1, **FC)
    # the control: the same ids as integers give the curve of the tensor form
    as_dict = faithfulness_curve(model, None, {"input_ids": ids.tolist()}, "contribution", 0.1, **FC).table
    as_tensor = faithfulness_curve(model, None, ids, "contribution", 0.1, **FC).table
    pd.testing.assert_frame_equal(as_dict, as_tensor)


def test_an_empty_text_is_named_as_such_not_as_float_ids(model):
    # before: "" tokenises to no ids, torch makes [] float32, and the sweeps said "texts must hold integer token
    # ids, got torch.float32; use tokenizer(..., return_tensors='pt')"
    tokenizer = word_tokenizer()
    texts = ["the cat sat on a mat", "", "the dog ran far away"]
    message = r"every sequence of texts needs at least 2 tokens; sequence 1 has 0 \(an empty text\?\)$"
    with pytest.raises(InputError, match=message):
        faithfulness_curve(model, tokenizer, texts, "contribution", 0.1, **FC)
    with pytest.raises(InputError, match=message):
        per_layer_curve(model, tokenizer, texts, metric="contribution", ratios=0.1)
    with pytest.raises(InputError, match="sequence 0 has 1$"):  # one token: no next-token prediction
        faithfulness_curve(model, tokenizer, ["cat", "the cat sat"], "contribution", 0.1, **FC)
    # the control: the two real texts give a curve
    assert len(faithfulness_curve(model, tokenizer, [texts[0], texts[2]], "contribution", 0.1, **FC).table) == 2


def test_columns_the_sweeps_would_drop_are_refused(model, ids):
    # before: {"input_ids", "attention_mask", "labels"} with -100 on the prompt ran, scoring every token: the
    # sweeps read input_ids and attention_mask only
    labels = ids.clone()
    labels[:, :4] = -100
    given = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with pytest.raises(InputError, match=r"^faithfulness_curve: texts holds 'labels', which the sweep does not read: "
                                         r"every next token of a sequence is scored \(no -100 masking\); leave it out$"):
        faithfulness_curve(model, None, given, "contribution", 0.1, **FC)
    with pytest.raises(InputError, match=r"^per_layer_curve: texts holds 'labels', 'position_ids'"):
        per_layer_curve(model, None, {**given, "position_ids": torch.arange(8).repeat(2, 1)}, metric="contribution",
                        ratios=0.1)
    import datasets

    table = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    with pytest.raises(InputError, match="texts holds 'labels'"):
        faithfulness_curve(model, None, table, "contribution", 0.1, **FC)
    # the control: the columns the sweeps read, and a document column, pass and give the tensor's curve
    kept = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "document": [0, 1]}
    pd.testing.assert_frame_equal(faithfulness_curve(model, None, kept, "contribution", 0.1, **FC).table,
                                  faithfulness_curve(model, None, ids, "contribution", 0.1, **FC).table)


@pytest.mark.parametrize("argument, value, message", [
    ("layers", [], "layers is empty"), ("layers", [5], "out of range"), ("layers", ["a"], "layer numbers"),
    ("ratios", [], "ratios is empty"), ("ratios", 1.5, "ratios must be a number in"), ("ratios", "a", "ratios"),
    ("metric", [], "metric is empty"), ("mode", "compre", "mode must be"), ("batch_size", 0, "batch_size"),
    ("batch_size", 1.5, "batch_size"),
])
def test_the_sweeps_refuse_the_same_arguments(model, ids, argument, value, message):
    sweep = dict(metric=["contribution"], ratios=0.1, mode="comprehensiveness")
    extra = {}
    (sweep if argument in sweep else extra)[argument] = value
    with pytest.raises(InputError, match=message):
        faithfulness_curve(model, None, ids, **sweep, **{**FC, **extra})
    with pytest.raises(InputError, match=message):
        per_layer_curve(model, None, ids, **sweep, **extra)
    with pytest.raises(InputError, match=message):  # refused before any data set is read
        downstream_eval(model, word_tokenizer(), "boolq", **sweep, progress=False, **extra)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_metric_returning_non_finite_scores_is_refused_at_its_layer(model, ids, value):
    def broken(layer_decomposition, layer, **_):
        scores = layer_decomposition.attention.clone()
        if layer == 1:
            scores[0, 0, -1, 0] = value  # one visible (query, key) in the last layer
        return scores

    with pytest.raises(InputError, match="returned 1 NaN or infinite score\\(s\\) at layer 1"):
        faithfulness_curve(model, None, ids, {"broken": broken}, 0.1, "comprehensiveness", **FC)

    def masked(layer_decomposition, **_):  # -inf where a key is hidden (causal mask) is no ranking of it: allowed
        a = layer_decomposition.attention
        return a.masked_fill(a == 0, -float("inf"))

    def plain(layer_decomposition, **_):
        return layer_decomposition.attention

    got = faithfulness_curve(model, None, ids, {"m": masked}, [0.1, 0.5], "comprehensiveness", **FC).table
    want = faithfulness_curve(model, None, ids, {"m": plain}, [0.1, 0.5], "comprehensiveness", **FC).table
    pd.testing.assert_frame_equal(got, want)


def test_intervene_refuses_its_own_attention_mask_when_wrong(model, ids):
    def run(**kw):
        with cwcore.intervene(model, {}, record=[1], **kw) as session:
            return model(input_ids=ids).logits, session

    with pytest.raises(InputError, match="attention_mask has shape \\(2, 3\\) but the model was called on inputs "
                                         "\\(2, 8\\)"):
        run(attention_mask=torch.ones(2, 3))
    with pytest.raises(InputError, match="0 \\(padding\\) and 1"):
        run(attention_mask=torch.full((2, 8), 0.5))
    # the control: the right mask changes nothing and the hook is gone afterwards
    logits, session = run(attention_mask=torch.ones(2, 8, dtype=torch.long))
    assert torch.equal(logits, model(input_ids=ids).logits) and 1 in session.recorded
    assert not model._forward_pre_hooks


def test_logit_attribution_refuses_negative_and_out_of_vocabulary_targets(model, ids):
    for bad in (-1, VOCAB, 1.5, True, torch.ones(3, dtype=torch.long)):
        with pytest.raises(InputError, match="targets"):
            logit_attribution(model, targets=bad, input_ids=ids)
    with pytest.raises(InputError, match="needs input_ids"):
        logit_attribution(model, inputs_embeds=torch.randn(2, 8, 64))
    # the reference: an int target is that id at every position, and V-1 stays reachable
    one = logit_attribution(model, targets=VOCAB - 1, input_ids=ids)
    full = logit_attribution(model, targets=torch.full(ids.shape, VOCAB - 1), input_ids=ids)
    assert torch.equal(one.targets, full.targets)
    for layer in one.by_layer:
        torch.testing.assert_close(one.by_layer[layer], full.by_layer[layer], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# the command lines: one error path
# --------------------------------------------------------------------------------------------------
def _no_model(*_, **__):
    raise AssertionError("the model was loaded before the arguments were checked")


def _one_error_line(capsys, prog):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("wrote ")]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--ratios", "2"], "--ratios must be a number in [0, 1], got 2.0"),
    (["--ratios", "0.1", "nan"], "--ratios must be a number in [0, 1], got nan"),
    (["--metrics", "bogus"], "unknown metric 'bogus'"),
    (["--modes", "both"], "mode must be"),
    (["--batch-size", "0"], "batch_size must be at least 1"),
    (["--num-sequences", "0"], "--num-sequences must be at least 1"),
    # a flag the named data do not read (before: ignored without a word)
    (["--data", "gsm8k", "--max-length", "40"], "--max-length applies to the multiple-choice tasks (mmlu, "
                                                "winogrande, boolq), and --data names none: add one, or leave it out"),
    (["--data", "boolq", "--block-size=64", "--sampl", "stream"],
     "--block-size and --sampling apply to language-model data sets"),
    (["--data", "web-text", "--downstream-ratios", "0.1", "--num-examples", "5"],
     "--num-examples and --downstream-ratios apply to the multiple-choice tasks"),
])
def test_faithfulness_cli_refuses_bad_input_in_one_line_before_loading(argv, message, monkeypatch, capsys, tmp_path):
    from cwcore.faithfulness import cli

    monkeypatch.setattr(cli.models, "load_model", _no_model)
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in _one_error_line(capsys, "python -m cwcore.faithfulness")


def test_faithfulness_cli_takes_each_flag_where_the_data_read_it():
    # the control of the refusals above: with both kinds of data every flag is read, and defaults never count
    from cwcore.faithfulness import cli

    both = ["--data", "gsm8k", "boolq", "--max-length", "40", "--block-size", "64", "--num-examples", "5"]
    assert cli._refuse_unread_flags(both, ["gsm8k", "boolq"]) is None
    assert cli._refuse_unread_flags(["--data", "gsm8k"], ["gsm8k"]) is None
    assert cli._refuse_unread_flags(["--data", "boolq"], ["boolq"]) is None


def test_faithfulness_cli_layers_data_and_debug(monkeypatch, capsys, tmp_path):
    from cwcore.faithfulness import cli

    monkeypatch.setattr(cli.models, "load_model", lambda *a, **k: (tiny_model("llama"), word_tokenizer()))
    assert cli.main(["--layers", "9", "--out", str(tmp_path)]) == 2
    assert "--layers: layer 9 out of range" in _one_error_line(capsys, "python -m cwcore.faithfulness")
    assert cli.main(["--data", "no-such-data-set", "--out", str(tmp_path)]) == 2
    assert "no-such-data-set" in _one_error_line(capsys, "python -m cwcore.faithfulness")
    with pytest.raises(InputError):  # --debug: the exception itself, with its traceback
        cli.main(["--layers", "9", "--out", str(tmp_path), "--debug"])


def test_a_full_disk_leaves_no_partial_table(monkeypatch, capsys, tmp_path):
    """The sweep's tables are written atomically: when the disk fills up at the second table, the first is
    complete, the second absent (not 0 bytes), no temporary file is left, and the command says so in one line."""
    from cwcore import cache
    from cwcore.faithfulness import cli

    texts = [" ".join(WORDS[3:14][(i + j) % 11] for j in range(12)) for i in range(6)]
    monkeypatch.setattr(cli.models, "load_model", lambda *a, **k: (tiny_model("llama"), word_tokenizer()))
    monkeypatch.setattr(cli.data, "load_dataset", lambda *a, **k: texts)
    calls = []
    real_fsync = os.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(cache.os, "fsync", fsync)
    argv = ["--data", "toy", "--num-sequences", "4", "--block-size", "8", "--metrics", "contribution", "random",
            "--ratios", "0.1", "0.5", "--n-bootstrap", "20", "--no-cache", "--no-progress", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    assert "No space left on device" in _one_error_line(capsys, "python -m cwcore.faithfulness")
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["faithfulness_smollm2-135m_toy.csv"], written  # aopc_* absent, no .tmp left
    curve = pd.read_csv(tmp_path / written[0])
    assert len(curve) == 2 * 2 * 2 and curve["delta_ppl"].notna().all()  # complete: metrics x modes x ratios
    monkeypatch.setattr(cache.os, "fsync", real_fsync)
    assert cli.main(argv) == 0  # the control: with room on the disk every table is written
    assert {p.name.split("_")[0] for p in tmp_path.iterdir()} == {"faithfulness", "aopc", "ladder"}


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "batch_size must be at least 1"),
    (["--block-size", "1"], "--block-size must be at least 2"),
    (["--analyses", "rates,nope"], "unknown analyses: nope"),  # it printed argparse's usage first
])
def test_sinks_cli_refuses_bad_input_in_one_line_before_loading(argv, message, monkeypatch, capsys, tmp_path):
    import cwcore.models
    from cwcore.sinks import cli

    monkeypatch.setattr(cwcore.models, "load_model", _no_model)
    assert cli.main(["--model", "m", "--data", "d", *argv, "--out", str(tmp_path)]) == 2
    assert message in _one_error_line(capsys, "python -m cwcore.sinks")


@pytest.mark.parametrize("argv, message", [
    (["--analyses", "rates", "--bins", "5"],
     "--bins applies to convexity, which --analyses rates does not run: add it, or leave --bins out"),
    (["--analyses", "rates,anti_alignment", "--cone-heads", "sink"], "--heads applies to semantic_cone"),
    (["--analyses", "rates", "--kind", "inter"], "--kind applies to decomposition"),
])
def test_sinks_cli_refuses_an_option_of_analyses_it_does_not_run(argv, message, monkeypatch, capsys, tmp_path):
    # before: `--analyses rates --bins 5` ran the rates and dropped --bins without a word
    import cwcore.models
    from cwcore.sinks import cli

    monkeypatch.setattr(cwcore.models, "load_model", _no_model)
    assert cli.main(["--model", "m", "--data", "d", *argv, "--out", str(tmp_path)]) == 2
    assert _one_error_line(capsys, "python -m cwcore.sinks").startswith("python -m cwcore.sinks: error: " + message)
    # the control: the same flag with its analysis run passes the check (and reaches the model)
    with pytest.raises(AssertionError, match="the model was loaded"):
        cli._main(["--model", "m", "--data", "d", *argv[:1], argv[1] + "," + {"--bins": "convexity", "--cone-heads":
                   "semantic_cone", "--kind": "decomposition"}[argv[2]], *argv[2:], "--out", str(tmp_path)])


def test_sinks_cli_from_raw_without_material_is_one_line(capsys, tmp_path):
    from cwcore.sinks import cli

    assert cli.main(["--model", "m", "--data", "d", "--raw", str(tmp_path / "raw"), "--from-raw",
                     "--out", str(tmp_path)]) == 2
    assert "no raw material" in _one_error_line(capsys, "python -m cwcore.sinks")


@pytest.mark.parametrize("content, message", [
    ("chapters: [\n  - a: b\n profiles: {", "is not valid YAML"),
    ("- just\n- a list\n", "needs a 'chapters' list"),
    (None, "does not exist"),
])
def test_book_runner_reports_a_bad_run_yml_in_one_line(content, message, tmp_path, capsys):
    import cwbook as book
    if content is not None:
        (tmp_path / "run.yml").write_text(content)
    assert book.main(["plan", "--book-dir", str(tmp_path)]) == 2
    line = _one_error_line(capsys, "python -m cwbook")
    assert message in line
    if content and "YAML" in message:
        assert "at line 2, column 3" in line  # where the mistake is


def test_a_parameter_no_notebook_declares_is_bad_input_for_plan_and_build(tmp_path, capsys):
    """A typo under notebooks: ended as "book build FAILED" with status 1 (plan too); it is bad input, one line,
    status 2, before anything runs."""
    import shutil

    import cwbook as book

    shutil.copy(book.DEFAULT_BOOK_DIR / "run.yml", tmp_path / "run.yml")
    text = (tmp_path / "run.yml").read_text()
    (tmp_path / "run.yml").write_text(text.replace("02_geometry:\n        n_trials: 5000",
                                                   "02_geometry:\n        n_trails: 5000", 1))
    assert "n_trails" in (tmp_path / "run.yml").read_text()
    for command in (["plan"], ["build", "--no-html", "--only", "02"]):
        assert book.main([*command, "--profile", "default", "--config", str(tmp_path / "run.yml")]) == 2
        assert "does not declare ['n_trails']" in _one_error_line(capsys, "python -m cwbook")
    assert book.main(["plan", "--profile", "default"]) == 0  # the control: the committed run.yml


def test_run_command_separates_bad_input_from_bugs(capsys):
    from cwcore.cli import run_command

    def refused():
        raise InputError("batch_size must be at least 1, got 0")

    def bug():
        return {}["missing"]

    assert run_command("prog", refused, debug=False) == 2
    assert _one_error_line(capsys, "prog") == "prog: error: batch_size must be at least 1, got 0"
    assert run_command("prog", bug, debug=False) == 1
    assert "internal error KeyError" in _one_error_line(capsys, "prog")
    with pytest.raises(KeyError):
        run_command("prog", bug, debug=True)
    assert run_command("prog", lambda: None, debug=False) == 0


# --------------------------------------------------------------------------------------------------
# `cwcore cache`, `cwcore explain`, the explorer
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("action", [["cache", "prune", "--dry-run"], ["cache", "prune"], ["cache", "prune", "--all"],
                                    ["cache"]])
def test_cache_commands_on_a_cache_without_results(action, tmp_path, monkeypatch, capsys):
    from cwcore import cli

    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    assert cli.main(action) == 0
    out = capsys.readouterr().out
    assert ("0 cached run(s), 0 B" in out) if "prune" in action else ("no cached results" in out)


@pytest.mark.parametrize("where", ["a file", "a missing folder"])
def test_cache_verify_fails_clearly_on_a_file_or_a_missing_folder(where, tmp_path, monkeypatch, capsys):
    from cwcore import cli

    path = tmp_path / "cache"
    if where == "a file":
        path.write_text("not a cache")
    monkeypatch.setenv("CWCORE_CACHE", str(path))
    assert cli.main(["cache", "verify"]) == 2
    line = _one_error_line(capsys, "cwcore")
    assert ("is a file" in line) if where == "a file" else ("does not exist" in line)
    path.unlink(missing_ok=True)
    path.mkdir()
    assert cli.main(["cache", "verify"]) == 0  # the control: an empty folder verifies


def test_explain_refuses_text_that_is_not_utf8_in_one_line(tmp_path, monkeypatch, capsys):
    import cwcore.models
    from cwcore import cli

    monkeypatch.setattr(cwcore.models, "load_model", _no_model)
    text = b"ab\xff\xfe cd".decode("utf-8", "surrogateescape")  # how Python passes such an argv
    assert cli.main(["explain", text, "--out", str(tmp_path / "x.png")]) == 2
    assert "not valid UTF-8" in _one_error_line(capsys, "cwcore")


@pytest.mark.parametrize("text", ["x <!--<script> x", "x </script> x", "x --> x", "x a\u2028b x",
                                  "__DATA__ x __META__"])
def test_the_explorer_page_escapes_every_script_sequence(text, model):
    from cwcore.explorer import explorer_data, explorer_html, read_payload

    tokenizer = word_tokenizer()
    page = explorer_html(explorer_data(model, tokenizer, text))
    meta = page.split('<script id="cw-meta" type="application/json">', 1)[1].split("</script>", 1)[0]
    for sequence in ("</", "<!--", "-->", "<script", "\u2028", "\u2029"):
        assert sequence not in meta.lower()
    assert page.count('<script id="cw-data"') == 1  # "__DATA__" in the text did not take the data's place
    from cwcore.data import token_labels

    tokens = read_payload(page)["meta"]["tokens"]
    assert tokens == token_labels(tokenizer, text) and len(tokens) == 3  # the labels come back unchanged
    assert "[UNK]" not in tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])


# --------------------------------------------------------------------------------------------------
# the checkout warning
# --------------------------------------------------------------------------------------------------
def _checkout(folder: Path) -> Path:
    (folder / "cwcore").mkdir(parents=True)
    (folder / "cwcore" / "__init__.py").write_text("")
    (folder / "pyproject.toml").write_text('[project]\nname = "cwcore"\n')
    return folder


def test_import_warns_only_when_another_checkouts_code_runs(tmp_path, monkeypatch):
    from cwbook.checkout import CheckoutWarning, warn_if_other_checkout

    monkeypatch.delenv("CWCORE_NO_CHECKOUT_WARNING", raising=False)
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    (b / "notebooks").mkdir()
    wheel = tmp_path / "site-packages" / "cwcore"
    wheel.mkdir(parents=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning in the silent cases fails the test
        assert warn_if_other_checkout(a / "cwcore", cwd=a) is None  # the checkout itself
        assert warn_if_other_checkout(a / "cwcore", cwd=a / "cwcore") is None  # a folder inside it
        assert warn_if_other_checkout(a / "cwcore", cwd=outside) is None  # not inside any checkout
        assert warn_if_other_checkout(wheel, cwd=b) is None  # an installed wheel: nothing to compare
    with pytest.warns(CheckoutWarning, match=f"imported from {a}.*inside the checkout {b}"):
        assert warn_if_other_checkout(a / "cwcore", cwd=b / "notebooks") == b
    monkeypatch.setenv("CWCORE_NO_CHECKOUT_WARNING", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_other_checkout(a / "cwcore", cwd=b) is None


def test_importing_this_checkout_from_inside_it_is_silent():
    import subprocess
    import sys

    root = Path(cwcore.__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "CWCORE_NO_CHECKOUT_WARNING"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "book")])
    done = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import cwcore, cwbook"], cwd=root / "tests",
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_callable_returning_the_attention_works_on_texts_of_different_lengths(model):
    """The manual's example (attribution): padded query rows are NaN by the decomposition's convention, not the metric's
    failure; the callable gives exactly the ``attention`` curve."""
    texts = [" ".join(WORDS[:3]), " ".join(WORDS[:9]), " ".join(WORDS[2:7])]
    tok = word_tokenizer()

    def mine(layer_decomposition, **_):
        return layer_decomposition.attention

    got = faithfulness_curve(model, tok, texts, {"attention": mine}, [0.1, 0.5], "comprehensiveness", **FC).table
    want = faithfulness_curve(model, tok, texts, "attention", [0.1, 0.5], "comprehensiveness", **FC).table
    pd.testing.assert_frame_equal(got, want)


def test_explain_counts_negative_layers_from_the_end_and_sizes_pages_for_people(monkeypatch, capsys, tmp_path):
    from cwcore import cli
    from cwcore.cli import explain
    import cwcore.models

    model, tok = tiny_model("llama"), word_tokenizer()
    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: (model, tok))
    text = "the cat sat on a mat"
    _, last_attention, last_contribution, _ = explain(text, model, tok, layer=-1)
    _, attention, contribution, _ = explain(text, model, tok, layer=1)  # the tiny model has 2 layers
    np.testing.assert_array_equal(last_contribution, contribution)
    assert cli.main(["explain", text, "--layer", "-1", "--out", str(tmp_path / "fig.png")]) == 0
    capsys.readouterr()
    assert cli.main(["explain", text, "--layer", "-1", "--out", str(tmp_path / "page.html")]) == 0
    size = (tmp_path / "page.html").stat().st_size
    printed = capsys.readouterr().out
    assert size < 1e6 and "0.0 MB" not in printed and f"{size / 1024:.1f} KB" in printed
    assert cli.main(["explain", text, "--layer", "-3", "--out", str(tmp_path / "fig.png")]) == 2


def test_one_document_gives_aopc_without_an_interval(monkeypatch, capsys, tmp_path):
    """aopc() of one document: the area, NaN interval (one unit has no spread), no KeyError; the command
    line with --num-sequences 1 runs through."""
    from cwcore.faithfulness import aopc
    from cwcore.faithfulness import cli

    rows = [dict(metric=m, mode="comprehensiveness", ratio=r, sequence=0, document=3, nll=2 + r, clean_nll=2.0)
            for m in ("a", "b") for r in (0.1, 0.5)]
    got = aopc(pd.DataFrame(rows))
    assert got["aopc_nll"].tolist() == pytest.approx([0.25, 0.25])  # mean height of 0, 0.1, 0.5 by trapezoids
    assert got["aopc_nll_ci_low"].isna().all() and got["n_documents"].tolist() == [1, 1]
    texts = [" ".join(WORDS[3:14][(i + j) % 11] for j in range(12)) for i in range(3)]
    monkeypatch.setattr(cli.models, "load_model", lambda *a, **k: (tiny_model("llama"), word_tokenizer()))
    monkeypatch.setattr(cli.data, "load_dataset", lambda *a, **k: texts)
    assert cli.main(["--data", "toy", "--num-sequences", "1", "--block-size", "8", "--metrics", "contribution",
                     "random", "--ratios", "0.1", "0.5", "--no-cache", "--out", str(tmp_path)]) == 0, capsys.readouterr().err


def test_run_analyses_on_short_texts_names_block_size(model):
    from cwcore.sinks import run_analyses

    with pytest.raises(ValueError, match="block_size=128"):
        run_analyses(model, word_tokenizer(), ["the cat sat", "a dog ran"], ["rates"], progress=False)


def test_value_zeroing_shows_progress_on_long_layers(model, monkeypatch):
    from cwcore.faithfulness.methods import registry
    from cwcore.faithfulness.methods import value_zeroing as vz

    bars = []

    class Bar:
        def __init__(self, total, desc, **kwargs):
            self.total, self.desc, self.enabled, self.n, self.closed = total, desc, kwargs.get("enabled"), 0, False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(vz, "progress", Bar)
    ids = torch.randint(1, VOCAB, (1, 72), generator=torch.Generator().manual_seed(1))
    registry.method_scores(model, "value_zeroing", ids, layers=[1])
    pairs = 72 * 73 // 2 - 72  # every causal pair of real tokens but key 0 (keep_first_token)
    assert [(b.desc, b.total, b.n, b.enabled, b.closed) for b in bars] == [("value zeroing, layer 1", pairs, pairs,
                                                                           True, True)]
