"""`cwcore explain`: the drawn matrices are the decomposition's, and bad input gives one clean line."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import cwcore
from cwcore.cli import UsageError, explain, main
from tiny_models import tiny_model

WORDS = ["[UNK]", "<s>", "</s>"] + "the cat sat on a mat and dog ran far away".split()


def tiny_tokenizer():
    vocab = {word: i for i, word in enumerate(WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>",
                                   eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer, saved as an ordinary local model folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def run_cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "cwcore.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_python_dash_m_cwcore_is_the_command_line():
    """``python -m cwcore`` runs the ``cwcore`` command (before: "No module named cwcore.__main__"), for an
    environment whose scripts folder is not on PATH: the same output and status as ``python -m cwcore.cli``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for args in (["models"], ["explain"]):  # a listing, and a usage error (--out is required): status 2
        package = subprocess.run([sys.executable, "-m", "cwcore", *args], capture_output=True, text=True, env=env,
                                 timeout=300)
        module = run_cli(*args)
        assert (package.returncode, package.stdout, package.stderr) == (module.returncode, module.stdout,
                                                                         module.stderr)
    assert package.returncode == 2
    assert package.stderr == "cwcore: error: the following arguments are required: --out\n"
    assert "smollm2-135m" in run_cli("models").stdout


def test_explain_draws_the_decomposition():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    fig, attention, contribution, tokens = explain("the cat sat on the mat", model, tokenizer, layer=1, head=2)
    d = cwcore.decompose(model, layers=1, **tokenizer("the cat sat on the mat", return_tensors="pt"))
    causal = np.triu(np.ones((6, 6), dtype=bool), 1)
    assert tokens == ["the", "cat", "sat", "on", "the", "mat"]
    np.testing.assert_allclose(attention[~causal], d.attention[1][0, 2].numpy()[~causal], rtol=1e-6)
    np.testing.assert_allclose(contribution[~causal], d.inter[1][0, 2].numpy()[~causal], rtol=1e-6)
    assert np.isnan(contribution[causal]).all()  # keys a query cannot see are not drawn as weights
    token_fig, _, token_level, _ = explain("the cat sat", model, tokenizer, layer=0)
    np.testing.assert_allclose(np.nansum(token_level, axis=1), 1.0, rtol=1e-5)
    assert len(fig.axes) >= 2


def test_explain_defaults_to_the_middle_block_it_can_decompose(monkeypatch):
    """A model may number blocks cwcore refuses (a pooling head, a W_O no finder locates): with no --layer the
    map is drawn for the middle decomposable block, not for the middle number (which may be a refused one)."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    from cwcore.core import architectures

    monkeypatch.setattr(architectures, "decomposable_layers", lambda m: [0])  # as if block 1 were refused
    _, attention, _, _ = explain("the cat sat", model, tokenizer, head=0)
    d = cwcore.decompose(model, layers=0, **tokenizer("the cat sat", return_tensors="pt"))
    np.testing.assert_allclose(np.nan_to_num(attention), np.nan_to_num(d.attention[0][0, 0].numpy()), rtol=1e-6)
    monkeypatch.setattr(architectures, "decomposable_layers", lambda m: [])
    with pytest.raises(UsageError, match="no attention block of this model can be decomposed"):
        explain("the cat sat", model, tokenizer)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(text="   "), "text is empty"),
        (dict(layer=2), "layer 2 out of range"),
        (dict(layer=-3), "layer -3 out of range"),  # -1 and -2 count from the end of the 2 layers
        (dict(head=4), "head 4 out of range"),
        (dict(head=-5), "head -5 out of range"),  # -1..-4 count from the end of the 4 heads
        (dict(kind="intra"), "needs --head"),
        # called from Python: True drew layer 1, 1.5 failed in torch's indexing
        (dict(layer=True), "layer must be an integer"),
        (dict(head=1.5), "head must be an integer"),
        (dict(layer="1"), "layer must be an integer"),
    ],
)
def test_explain_rejects_bad_input(kwargs, message):
    args = dict(text="the cat", layer=0, head=None, kind="inter") | kwargs
    with pytest.raises(UsageError, match=message):
        explain(args.pop("text"), tiny_model("llama"), tiny_tokenizer(), **args)


def test_explain_counts_a_negative_head_from_the_end_as_it_counts_layers():
    # before: layer=-1 was the last layer but head=-1 was refused as out of range
    import matplotlib.pyplot as plt

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    last, last_attention, last_contribution, _ = explain("the cat sat", model, tokenizer, layer=-1, head=-1)
    third, attention, contribution, _ = explain("the cat sat", model, tokenizer, layer=1, head=3)
    plt.close(last), plt.close(third)
    np.testing.assert_array_equal(last_attention, attention)
    np.testing.assert_array_equal(last_contribution, contribution)


@pytest.mark.slow  # saves and loads a model folder, draws a figure
def test_cli_writes_a_png_from_a_local_model(local_model, tmp_path):
    out = tmp_path / "fig.png"
    result = run_cli("explain", "the cat sat on the mat", "--model", str(local_model), "--layer", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]  # no temporary file left behind


def test_explain_loads_the_model_in_the_dtype_asked_for(local_model, tmp_path, monkeypatch, capsys):
    # before: `cwcore explain` had no --dtype: a large model could only be loaded in float32
    import cwcore.models

    seen = []
    load = cwcore.models.load_model
    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: seen.append(k.get("dtype")) or load(*a, **k))
    for dtype, page in ((None, "a.png"), ("bfloat16", "b.png"), ("bf16", "c.html")):
        extra = [] if dtype is None else ["--dtype", dtype]
        assert main(["explain", "the cat sat", "--model", str(local_model), "--out", str(tmp_path / page), *extra]) == 0
    assert seen == [None, "bfloat16", "bf16"]
    assert main(["explain", "the cat", "--model", str(local_model), "--out", str(tmp_path / "d.png"),
                 "--dtype", "float8"]) == 2
    assert "dtype must be None, a torch.dtype or one of" in capsys.readouterr().err
    assert not (tmp_path / "d.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model-anywhere-xyz"], "smollm2-135m"),  # lists the packaged names
        (["--layer", "7"], "layer 7 out of range"),
        (["--head", "9"], "head 9 out of range"),
        (["--out", "/nonexistent-folder/fig.png"], "does not exist"),
        (["--out", "fig.txt"], "must end in one of"),
    ],
)
def test_cli_errors_are_one_line(local_model, tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = {"--model": str(local_model), "--out": str(tmp_path / "f.png")}
    pairs = dict(zip(args[::2], args[1::2]))
    assert main(["explain", "the cat"] + [x for k, v in (base | pairs).items() for x in (k, v)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cwcore: error: ") and message in lines[0], lines


@pytest.mark.slow  # two `cwcore` processes, each importing torch and transformers
def test_cli_process_exits_without_traceback(local_model, tmp_path):
    for args, message in ((["--model", "no-such-model-anywhere-xyz"], "could not be found"),
                          (["--model", str(local_model), "--layer", "7"], "out of range")):
        result = run_cli("explain", "the cat", *args, "--out", str(tmp_path / "f.png"))
        assert result.returncode == 2
        assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("cwcore: error: "), result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args, message", [
    ([], "no text: give the text, or --file with a UTF-8 text file"),
    (["the cat", "--file", "t.txt"], "give the text, or --file with a UTF-8 text file, not both"),  # as before
])
def test_explain_says_the_text_is_missing_or_given_twice(tmp_path, capsys, args, message):
    # before: "give the text, or --file with a UTF-8 text file, not both" when neither was given
    out = tmp_path / "f.png"
    assert main(["explain", *args, "--model", str(tmp_path / "no-such-model"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == ["cwcore: error: " + message]
    assert not out.exists()


def test_cli_rejects_empty_text_and_unwritable_path(local_model, tmp_path):
    assert main(["explain", "", "--model", str(local_model), "--out", str(tmp_path / "f.png")]) == 2
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permission bits: use a path under a file instead
            target = str(tmp_path / "f.png" / "x.png")
            (tmp_path / "f.png").write_bytes(b"")
        else:
            target = str(locked / "f.png")
        assert main(["explain", "the cat", "--model", str(local_model), "--out", target]) == 2
    finally:
        locked.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
@pytest.mark.parametrize("name", ["f.png", "f.html"])
def test_explain_refuses_a_folder_that_takes_no_file_before_loading_the_model(tmp_path, capsys, name):
    # before: (as root, who passes the access check) the model loaded, the page was computed, and then
    # "cwcore: error: No such file or directory: /proc/.f.png.x8mxnss_.tmp", a file the user never named
    out = f"/proc/{name}"
    assert main(["explain", "the cat", "--model", str(tmp_path / "no-such-model"), "--out", out]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"cwcore: error: cannot write {out}: "), lines
    assert ".tmp" not in lines[0]


def test_explain_names_the_users_file_when_writing_it_fails(local_model, tmp_path, capsys, monkeypatch):
    # the folder takes files, then the disk fills up while the figure is written
    import errno

    from cwcore import cache

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "f.png"
    main(["explain", "the cat", "--model", str(local_model), "--out", str(out)])  # the model converted, cached
    capsys.readouterr()
    monkeypatch.setattr(cache.os, "fsync", full)
    out.unlink()
    assert main(["explain", "the cat", "--model", str(local_model), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"cwcore: error: cannot write {out}: No space left on device"]
    assert list(tmp_path.iterdir()) == []  # no temporary file left
    monkeypatch.undo()

    def refused(src, dst):  # the explorer's page: the rename into place fails (an error naming the temporary file)
        raise PermissionError(errno.EACCES, "Permission denied", str(src), None, str(dst))

    monkeypatch.setattr(cache.os, "replace", refused)
    page = tmp_path / "f.html"
    assert main(["explain", "the cat", "--model", str(local_model), "--out", str(page)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"cwcore: error: cannot write {page}: Permission denied"]
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "d.png").mkdir()
    assert main(["explain", "the cat", "--model", str(tmp_path / "no-such-model"), "--out",
                 str(tmp_path / "d.png")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"cwcore: error: cannot write {tmp_path / 'd.png'}: it is a folder"]


# --------------------------------------------------------------------------------------------------
# labels of multi-byte text, the figure's width, one line for every user error
# --------------------------------------------------------------------------------------------------
def byte_tokenizer():
    """A byte-level BPE without merges: every UTF-8 byte is one token, so an emoji is 4 tokens."""
    from tokenizers import decoders

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="!", pad_token="!")


def wide_llama(vocab=256, positions=1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    return LlamaForCausalLM(config).eval()


TEXT = "pizza 🍕 in 東京, très bien"


def test_token_labels_show_every_character_of_multi_byte_text():
    from cwcore.tokens import token_labels

    tokenizer = byte_tokenizer()
    ids = tokenizer(TEXT).input_ids
    assert len(ids) == len(TEXT.encode("utf-8"))  # one token per byte
    naive = [tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in "".join(naive)  # the bug: one token at a time shows replacement characters
    labels = token_labels(tokenizer, TEXT)
    assert len(labels) == len(ids) and "\ufffd" not in "".join(labels)
    assert "".join(label for label in labels if not label.startswith("+")) == TEXT
    emoji = [label for label in labels if "🍕" in label]
    assert emoji == ["🍕", "+🍕", "+🍕", "+🍕"]  # the space before it is a token of its own
    assert token_labels(tokenizer, ids) == labels == token_labels(tokenizer, torch.tensor([ids]))
    assert token_labels(tiny_tokenizer(), "the cat sat") == ["the", "cat", "sat"]


def test_a_replacement_character_of_the_text_and_a_split_non_breaking_space_keep_their_own_labels():
    """From ids, a literal U+FFFD glued the next token to it ('b' shown as '+\ufffdb'); a non-breaking space split
    over two byte tokens was labelled '+' (stripped to nothing)."""
    from cwcore.tokens import token_labels

    tokenizer = byte_tokenizer()
    text = "a\ufffdb x\u00a0y"
    ids = tokenizer(text).input_ids
    labels = token_labels(tokenizer, ids)
    assert labels == token_labels(tokenizer, text)
    assert "".join(label for label in labels if not label.startswith("+")) == text
    assert labels[labels.index("b") - 1].startswith("+\ufffd") and "+\u00a0" in labels


def test_explain_labels_multi_byte_text():
    fig, _, _, tokens = explain(TEXT, wide_llama(), byte_tokenizer(), layer=0)
    assert "🍕" in tokens and "+東" in tokens and not any("\ufffd" in t for t in tokens)
    shown = {t.get_text() for t in fig.axes[0].get_xticklabels()}
    assert "🍕" in "".join(shown)


def test_explain_caps_the_figure_width_and_refuses_very_long_texts():
    model, tokenizer = wide_llama(vocab=len(WORDS), positions=2048), tiny_tokenizer()
    short, *_ = explain("the cat sat", model, tokenizer, layer=0)
    assert short.get_size_inches()[0] == pytest.approx(10.0)
    text = " ".join(["the cat sat on a mat"] * 50)  # 300 tokens: 196 inches uncapped
    fig, attention, _, tokens = explain(text, model, tokenizer, layer=0)
    assert len(tokens) == 300 and attention.shape == (300, 300)
    assert fig.get_size_inches()[0] == pytest.approx(40.0)
    assert "300 tokens, one label per 8" in fig._suptitle.get_text()
    with pytest.raises(UsageError, match="has 300 tokens.*shorter text, or raise --max-tokens \\(now 100\\)"):
        explain(text, model, tokenizer, layer=0, max_tokens=100)


def test_cli_refuses_inputs_longer_than_the_context_in_one_line(tmp_path, capsys):
    folder = tmp_path / "short-context"
    wide_llama(vocab=len(WORDS), positions=16).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    capsys.readouterr()
    text = " ".join(["the cat sat on a mat"] * 5)
    assert main(["explain", text, "--model", str(folder), "--out", str(tmp_path / "f.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cwcore: error: ") and "30 tokens but the model reads at most 16" in err[0], err
    assert main(["explain", text, "--model", str(folder), "--out", str(tmp_path / "f.png"), "--max-tokens", "10"]) == 2
    assert "raise --max-tokens (now 10)" in capsys.readouterr().err


def test_every_page_refuses_a_text_longer_than_the_context_in_the_commands_words(tmp_path):
    """The explorer page and the long-document page as the figure: one line saying how long the text is. Before,
    --summary printed transformers' "Token indices sequence length is longer ..." warning first, then summarize's
    hint to pass truncate=True (no such flag), and .html said "the text is longer than --max-tokens 512"."""
    folder = tmp_path / "short-context"
    wide_llama(vocab=len(WORDS), positions=16).save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.model_max_length = 16  # so that the tokenizer itself warns about a longer text
    tokenizer.save_pretrained(folder)
    text = " ".join(["the cat sat on a mat"] * 5)  # 30 tokens
    for page, extra, message in (
            ("f.html", ["--summary"], "the text has 30 tokens but the model reads at most 16; give a shorter text"),
            ("f.html", [], "the text has 30 tokens but the model reads at most 16; give a shorter text"),
            ("f.html", ["--max-tokens", "10"], "the text has 30 tokens and the maps would have 30x30 cells; give a "
                                               "shorter text, or raise --max-tokens (now 10)")):
        done = run_cli("explain", text, "--model", str(folder), "--out", str(tmp_path / page), *extra)
        assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"cwcore: error: {message}"], done.stderr
        assert not (tmp_path / page).exists()


def test_user_errors_are_one_line_bugs_say_so_and_debug_shows_the_traceback(local_model, tmp_path, capsys,
                                                                              monkeypatch):
    from cwcore import cli

    def refused(args):
        from cwcore.core.inputs import check_compute_dtype

        check_compute_dtype("float16")  # a ValueError raised by cwcore: the user's input

    def bug(args):
        return {}["missing"]  # a KeyError: cwcore's fault

    def library_value_error(args):
        import json

        json.loads("{")  # a ValueError raised inside a library: not a refused input

    for handler, code, start in ((refused, 2, "cwcore: error: compute_dtype must be"),
                                 (bug, 1, "cwcore: error: internal error KeyError"),
                                 (library_value_error, 1, "cwcore: error: internal error JSONDecodeError")):
        monkeypatch.setattr(cli, "_models_command", handler)
        assert main(["models"]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(start), err
        with pytest.raises(Exception):
            main(["models", "--debug"])
        monkeypatch.setenv("CWCORE_DEBUG", "1")
        with pytest.raises(Exception):
            main(["models"])
        monkeypatch.delenv("CWCORE_DEBUG")


_TERMINATED = """
import os, signal, sys, time
from cwcore.cli import run_command
def body():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        return 0
    finally:
        print("cleaned up", flush=True)
sys.exit(run_command("prog", body, False))
"""


def test_sigterm_ends_a_command_through_its_clean_up():
    """`kill` (or a scheduler's time limit) runs the same clean-up as Ctrl-C: a book build shuts its notebook
    kernel down instead of leaving it computing; the command says it was terminated, status 143."""
    done = subprocess.run([sys.executable, "-c", _TERMINATED], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143
    assert "cleaned up" in done.stdout
    assert done.stderr.strip().splitlines()[-1] == "prog: terminated"


@pytest.mark.parametrize("args, message", [
    (["--top-k", "3"], "--top-k applies to the long-document page only: add --summary, or leave it out"),
    (["--query", "1", "--top-k", "3"],
     "--query and --top-k apply to the long-document page only: add --summary, or leave them out"),
    (["--summary", "--head", "1"], "--head does not apply to --summary (every head's terms, up to the model's "
                                   "context): leave it out"),
    (["--summary", "--max-tokens", "10"], "--max-tokens does not apply to --summary"),
])
def test_explain_refuses_an_option_the_chosen_page_does_not_read(local_model, tmp_path, capsys, args, message):
    # before: `--top-k 3` without --summary drew the usual figure, exit 0, the option silently dropped
    out = tmp_path / ("f.html" if "--summary" in args else "f.png")
    assert main(["explain", "the cat", "--model", str(local_model), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cwcore: error: " + message), err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "0"], "argument --max-tokens: must be at least 1, got 0"),
    (["--summary", "--top-k", "-2"], "argument --top-k: must be at least 1, got -2"),
    (["--max-tokens", "ten"], "argument --max-tokens: invalid int value: 'ten'"),
])
def test_explain_refuses_a_count_below_one_before_loading_the_model(tmp_path, capsys, args, message):
    # before: --max-tokens 0 loaded the model and then said "the text has 2 tokens ... raise --max-tokens (now 0)"
    out = tmp_path / ("f.html" if "--summary" in args else "f.png")
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "the cat", "--model", str(tmp_path / "no-such-model"), "--out", str(out), *args])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["cwcore: error: " + message]  # one line, no usage
    assert not out.exists()


def _faithfulness_main(argv):
    from cwcore.faithfulness.cli import main as faithfulness_main

    return faithfulness_main(argv)


def _sinks_main(argv):
    from cwcore.sinks.cli import main as sinks_main

    return sinks_main(argv)


@pytest.mark.parametrize("run, args, line", [
    (main, ["explain", "x", "--out", "f.png", "--summary", "--top-k", "-3"],
     "cwcore: error: argument --top-k: must be at least 1, got -3"),
    (main, ["explain", "x", "--out", "f.png", "--max-tokens", "-1"],
     "cwcore: error: argument --max-tokens: must be at least 1, got -1"),
    (main, ["explain", "x", "--out", "f.png", "--layer", "five"],
     "cwcore: error: argument --layer: invalid int value: 'five'"),
    (main, ["explain", "x", "--out", "f.png", "--modle", "m"], "cwcore: error: unrecognized arguments: --modle m"),
    (main, ["explian", "x"],
     "cwcore: error: argument command: invalid choice: 'explian' (choose from 'explain', 'models', 'cache')"),
    (main, ["cache", "purge"],
     "cwcore: error: argument action: invalid choice: 'purge' (choose from 'info', 'prune', 'verify')"),
    (_faithfulness_main, ["--block-size", "ten"],
     "python -m cwcore.faithfulness: error: argument --block-size: invalid int value: 'ten'"),
    (_faithfulness_main, ["--modle", "m"], "python -m cwcore.faithfulness: error: unrecognized arguments: --modle m"),
    (_sinks_main, ["--model", "m", "--data", "d", "--num-sequences", "x"],
     "python -m cwcore.sinks: error: argument --num-sequences: invalid int value: 'x'"),
    (_sinks_main, ["--model", "m"], "python -m cwcore.sinks: error: the following arguments are required: --data"),
])
def test_argparse_errors_are_one_line_of_every_command_line(capsys, run, args, line):
    # before: argparse's usage block (up to 30 lines) above a "cwcore explain: error: ..." line
    with pytest.raises(SystemExit) as exit_:
        run(args)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    # newer Pythons print a choice list unquoted, "(choose from explain, models, cache)": compare without the quotes
    def plain(text):
        return text.replace("'", "") if "choose from" in line else text

    assert [plain(e) for e in captured.err.splitlines()] == [plain(line)] and captured.out == ""


@pytest.mark.parametrize("args, message", [
    (["cache", "--all"], "--all belongs to `cwcore cache prune`, not to `cwcore cache info`"),
    (["cache", "verify", "--dry-run"], "--dry-run belongs to `cwcore cache prune`, not to `cwcore cache verify`"),
    (["cache", "prune", "--repair"], "--repair belongs to `cwcore cache verify`, not to `cwcore cache prune`"),
])
def test_cache_refuses_a_flag_of_another_action(tmp_path, monkeypatch, capsys, args, message):
    # before: `cwcore cache --all` printed the summary, deleted nothing and exited 0
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == "cwcore: error: " + message


def _every_option(parser):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _every_option(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser.prog, action


def test_every_command_line_option_says_what_it_does():
    # before: --kind of `cwcore explain`, the cache action, 17 flags of python -m cwcore.faithfulness (--metrics,
    # --unit, --scope, ...) and 4 of python -m cwcore.sinks showed in --help with no text at all
    from cwcore.cli import build_parser
    from cwcore.faithfulness.cli import parser as faithfulness_parser
    from cwcore.sinks.cli import parser as sinks_parser

    silent = [f"{prog} {action.option_strings[0] if action.option_strings else action.dest}"
              for parser in (build_parser(), faithfulness_parser(), sinks_parser())
              for prog, action in _every_option(parser) if not action.help]
    assert silent == []


@pytest.fixture
def no_loading_bar():
    """transformers' "Loading weights" bar off for the test, as before it after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if was:
        hf_logging.enable_progress_bar()


@pytest.mark.parametrize("command", ["faithfulness", "sinks"])
def test_a_block_size_no_document_or_context_holds_is_refused_naming_it(local_model, tmp_path, capsys, command,
                                                                        no_loading_bar):
    # before: a 2-line UserWarning ("only 0 documents of at least 100 tokens available") and then "texts holds no
    # sequence" (faithfulness) or "data holds no sequence" (sinks); the model's context was never named
    from cwcore.faithfulness.cli import main as faithfulness_main
    from cwcore.sinks.cli import main as sinks_main

    texts = tmp_path / "short.txt"
    texts.write_text("the cat sat on the mat\n\nthe dog ran far away\n", encoding="utf-8")
    run = {"faithfulness": lambda extra: faithfulness_main(["--model", str(local_model), "--num-sequences", "2",
                                                            "--out", str(tmp_path / "out"), *extra]),
           "sinks": lambda extra: sinks_main(["--model", str(local_model), "--num-sequences", "2", "--out",
                                              str(tmp_path / "out"), *extra])}[command]
    prog = f"python -m cwcore.{command}: error: "
    for extra, line in (
            (["--data", "web-text", "--block-size", "100"],
             "--block-size 100 is longer than the model's context (64 tokens): give at most 64"),
            (["--data", str(texts), "--block-size", "32"],
             f"--block-size 32: no document of {texts} is 32 tokens long; give a smaller --block-size"),
            (["--data", str(texts), "--block-size", "32", "--sampling", "stream"],
             f"--block-size 32: {texts} holds fewer than 32 tokens in all; give a smaller --block-size")):
        assert run(extra) == 2
        assert capsys.readouterr().err.splitlines() == [prog + line]
    assert not list(tmp_path.glob("out/*"))


@pytest.mark.parametrize("command", ["faithfulness", "sinks"])
def test_no_progress_hides_the_loading_bar_too(local_model, tmp_path, capsys, monkeypatch, command):
    # before: --no-progress (faithfulness; sinks had no such flag) left transformers' "Loading weights" bar on stderr
    import cwcore.models
    from cwcore.core.inputs import InputError
    from cwcore.faithfulness.cli import main as faithfulness_main
    from cwcore.sinks.cli import main as sinks_main
    from transformers.utils import logging as hf_logging

    run = {"faithfulness": faithfulness_main, "sinks": sinks_main}[command]
    load = cwcore.models.load_model

    def load_then_stop(*args, **kwargs):
        load(*args, **kwargs)
        raise InputError("stopped by the test")

    monkeypatch.setattr(cwcore.models, "load_model", load_then_stop)
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process (cwcore explain, run in-process above, turns it off)
    try:
        for extra, shown in (([], True), (["--no-progress"], False)):
            assert run(["--model", str(local_model), "--data", "web-text", "--out", str(tmp_path / "out"), *extra]) == 2
            err = capsys.readouterr().err
            assert ("Loading weights" in err) is shown, err
            assert err.splitlines()[-1] == f"python -m cwcore.{command}: error: stopped by the test"
            assert hf_logging.is_progress_bar_enabled()  # as it was: the next caller's bars are not turned off
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


@pytest.mark.parametrize("command", ["explain", "faithfulness", "sinks"])
def test_each_command_line_loads_the_model_on_the_device_asked_for(local_model, tmp_path, monkeypatch, capsys,
                                                                   command):
    # before: no command line had --device, so a GPU's user could not run any of them there
    import cwcore.models
    from cwcore.core.inputs import InputError
    from cwcore.faithfulness.cli import main as faithfulness_main
    from cwcore.sinks.cli import main as sinks_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = {"explain": lambda extra: main(["explain", "the cat sat", "--model", str(local_model), "--out",
                                          str(tmp_path / "f.png"), *extra]),
           "faithfulness": lambda extra: faithfulness_main(["--model", str(local_model), "--data", "web-text",
                                                            "--out", str(tmp_path / "out"), *extra]),
           "sinks": lambda extra: sinks_main(["--model", str(local_model), "--data", "web-text", "--out",
                                              str(tmp_path / "out"), *extra])}[command]
    seen = []

    def spy(*args, **kwargs):  # what the command asked for; stop before the run
        seen.append(kwargs.get("device"))
        raise InputError("stopped by the test")

    load = cwcore.models.load_model
    monkeypatch.setattr(cwcore.models, "load_model", spy)
    assert run([]) == 2 and run(["--device", "cpu"]) == 2 and run(["--device=cuda:1"]) == 2
    assert seen == [None, "cpu", "cuda:1"]
    monkeypatch.setattr(cwcore.models, "load_model", load)
    capsys.readouterr()
    bad = ["nodevice"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:  # refused in one line by load_model, before the model loads
        assert run(["--device", device]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "error: device" in lines[0], lines


def test_the_sinks_stream_blocks_cut_by_the_command_line_are_the_librarys(local_model, tmp_path):
    """The sinks command line cuts the stream blocks itself now (so that texts shorter than one block are refused in
    one line naming --block-size, as the documents mode and the faithfulness command do): its rates must still be
    the library's on the texts themselves, which the analyses cut into the same consecutive blocks."""
    import pandas as pd

    import cwcore
    from cwcore import sinks
    from cwcore.sinks.cli import main as sinks_main

    texts = tmp_path / "long.txt"
    texts.write_text("the cat sat on the mat and the dog ran far away\n\n" * 20, encoding="utf-8")
    out = tmp_path / "out"
    assert sinks_main(["--model", str(local_model), "--data", str(texts), "--sampling", "stream", "--block-size", "16",
                       "--num-sequences", "3", "--analyses", "rates", "--no-cache", "--no-progress",
                       "--out", str(out)]) == 0
    got = pd.read_csv(next(out.glob("sinks_rates_*.csv")))
    model, tokenizer = cwcore.load_model(str(local_model))
    want = sinks.sink_rates(model, tokenizer, cwcore.load_dataset(str(texts)), num_sequences=3, block_size=16)
    assert len(got) == len(want) > 0
    for column in ("sink_rate", "sink_rate_std"):
        assert got[column].to_numpy() == pytest.approx(want[column].to_numpy(), abs=1e-6), column
