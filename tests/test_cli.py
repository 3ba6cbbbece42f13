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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(text="   "), "text is empty"),
        (dict(layer=2), "layer 2 out of range"),
        (dict(layer=-1), "layer -1 out of range"),
        (dict(head=4), "head 4 out of range"),
        (dict(kind="intra"), "needs --head"),
    ],
)
def test_explain_rejects_bad_input(kwargs, message):
    args = dict(text="the cat", layer=0, head=None, kind="inter") | kwargs
    with pytest.raises(UsageError, match=message):
        explain(args.pop("text"), tiny_model("llama"), tiny_tokenizer(), **args)


def test_cli_writes_a_png_from_a_local_model(local_model, tmp_path):
    out = tmp_path / "fig.png"
    result = run_cli("explain", "the cat sat on the mat", "--model", str(local_model), "--layer", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]  # no temporary file left behind


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
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_cli_process_exits_without_traceback(local_model, tmp_path):
    for args, message in ((["--model", "no-such-model-anywhere-xyz"], "could not be found"),
                          (["--model", str(local_model), "--layer", "7"], "out of range")):
        result = run_cli("explain", "the cat", *args, "--out", str(tmp_path / "f.png"))
        assert result.returncode == 2
        assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error: "), result.stderr
        assert message in result.stderr and "Traceback" not in result.stderr


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
