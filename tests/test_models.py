"""Tests of cwcore.models: the atomic model cache, name resolution, and the packaged models.

The cache-logic tests use tiny randomly initialised models in temporary CWCORE_CACHE folders.
Tests marked slow load the real packaged models from the default cache (converted on first use).
"""

import json
import os
import threading
import time

import pytest
import torch

from cwcore import models
from cwcore.models import (
    CACHE_MARKER,
    PACKAGED_MODELS,
    ModelNotFoundError,
    ensure_cached_folder,
    load_model,
    read_cache_marker,
    resolve_dtype,
)

ENGLISH = "Once upon a time, there was a little girl who lived in a small house near the forest."


# --------------------------------------------------------------------------- tiny helpers


def tiny_tokenizer(with_pad: bool):
    """A word-level fast tokenizer over a dozen words, with an eos and optionally a pad token."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "</s>", "<pad>"] + "the cat sat on a mat and dog ran to house .".split()
    backend = Tokenizer(tk_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    extra = {"pad_token": "<pad>"} if with_pad else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>",
                                   **extra)


def tiny_llama(tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tie, bos_token_id=None, eos_token_id=1, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    # Random init leaves lm_head tied; make the embeddings non-trivial all the same.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_()
    return model


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64)
    return BertModel(config).eval()


@pytest.fixture
def temp_cache(tmp_path, monkeypatch):
    """A fresh CWCORE_CACHE root for one test."""
    root = tmp_path / "cwcore-cache"
    monkeypatch.setenv("CWCORE_CACHE", str(root))
    return root


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def leftovers(parent):
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids).reshape(1, -1)).logits


def perplexity(model, tokenizer, text):
    encoded = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        loss = model(**encoded, labels=encoded.input_ids).loss
    return loss.exp().item()


# --------------------------------------------------------------------------- names, dtypes, paths


def test_packaged_names_are_listed_with_descriptions_default_first():
    assert models.list_models() == list(PACKAGED_MODELS)
    assert models.list_models()[0] == models.DEFAULT_MODEL == "smollm2-135m"
    assert set(PACKAGED_MODELS) == {"smollm2-135m", "gemma3-270m", "minilm-l6"}
    assert all(isinstance(d, str) and d and "\n" not in d for d in PACKAGED_MODELS.values())


@pytest.mark.parametrize("given, expected", [
    (None, torch.float32), ("float32", torch.float32), ("fp32", torch.float32),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16),
    ("torch.float16", torch.float16), (" BFloat16 ", torch.bfloat16), (torch.float64, torch.float64),
    ("float64", torch.float64), ("double", torch.float64),  # the name of a dtype the object form accepts
    ("fp16", torch.float16), ("half", torch.float16), ("float", torch.float32), ("fp64", torch.float64),
])
def test_dtype_names_resolve(given, expected):
    assert resolve_dtype(given) is expected


@pytest.mark.parametrize("bad", ["float8", "int", 32, "auto", torch.float8_e4m3fn, torch.int64, torch.complex64])
def test_unknown_dtype_is_rejected(bad):
    # a torch.dtype object passed as it was: float8 failed deep in the load ("couldn't find storage object")
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad)


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CWCORE_CACHE", raising=False)
    assert models.cache_root() == models.Path.home() / ".cache" / "cwcore"
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    assert models.model_cache_dir() == tmp_path / "models"


# --------------------------------------------------------------------------- atomic cache


def save_tiny_llama(folder):
    model = tiny_llama()
    model.save_pretrained(folder)
    return {"kind": "tiny-llama"}


def test_cached_folder_is_built_once_and_reloads_exactly(temp_cache):
    from transformers import AutoModelForCausalLM

    target = temp_cache / "models" / "tiny"
    source = {"file": "tiny.gguf", "size": 123}
    builds = []

    def build(folder):
        builds.append(folder)
        return save_tiny_llama(folder)

    assert ensure_cached_folder(target, source, build) == target
    assert ensure_cached_folder(target, source, build) == target
    assert len(builds) == 1
    assert not builds[0].exists(), "the temporary build folder must be renamed away"
    marker = read_cache_marker(target, source)
    assert marker["source"] == source and marker["kind"] == "tiny-llama"
    assert marker["transformers_version"]
    assert leftovers(target.parent) == []
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    ids = [3, 4, 5, 6, 7]
    torch.testing.assert_close(logits(reloaded, ids), logits(tiny_llama(), ids), rtol=0, atol=0)


def test_folder_without_marker_is_ignored_and_rebuilt(temp_cache):
    target = temp_cache / "models" / "tiny"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"half written")
    assert read_cache_marker(target) is None

    ensure_cached_folder(target, {"v": 1}, save_tiny_llama)
    assert read_cache_marker(target, {"v": 1}) is not None
    assert (target / "model.safetensors").stat().st_size > 1000
    assert leftovers(target.parent) == []


def test_marker_of_another_source_or_format_triggers_rebuild(temp_cache):
    target = temp_cache / "models" / "tiny"
    builds = []

    def build(folder):
        builds.append(1)
        (folder / "payload.txt").write_text(str(len(builds)))

    ensure_cached_folder(target, {"v": 1}, build)
    ensure_cached_folder(target, {"v": 2}, build)
    assert len(builds) == 2 and (target / "payload.txt").read_text() == "2"
    assert read_cache_marker(target, {"v": 1}) is None
    marker = json.loads((target / CACHE_MARKER).read_text())
    marker["format"] = -1
    (target / CACHE_MARKER).write_text(json.dumps(marker))
    ensure_cached_folder(target, {"v": 2}, build)
    assert len(builds) == 3


def test_failed_build_leaves_nothing_behind(temp_cache):
    target = temp_cache / "models" / "tiny"

    def broken_build(folder):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("conversion crashed")

    with pytest.raises(RuntimeError, match="conversion crashed"):
        ensure_cached_folder(target, {"v": 1}, broken_build)
    assert not target.exists()
    assert leftovers(target.parent) == []


def test_losing_the_race_keeps_the_winners_folder(temp_cache):
    target = temp_cache / "models" / "tiny"
    source = {"v": 1}

    def winning_build(folder):
        (folder / "who.txt").write_text("winner")

    def slow_build(folder):
        # Meanwhile another process completes the same cache.
        ensure_cached_folder(target, source, winning_build)
        (folder / "who.txt").write_text("loser")

    assert ensure_cached_folder(target, source, slow_build) == target
    assert (target / "who.txt").read_text() == "winner"
    assert leftovers(target.parent) == []


def test_concurrent_builders_agree_on_one_complete_folder(temp_cache):
    target = temp_cache / "models" / "tiny"
    source = {"v": 1}
    both_building = threading.Barrier(2, timeout=30)
    errors = []

    def build(folder):
        both_building.wait()  # both threads are past the marker check and building
        (folder / "who.txt").write_text(threading.current_thread().name)
        (folder / "data.bin").write_bytes(threading.current_thread().name.encode() * 10000)

    def worker():
        try:
            ensure_cached_folder(target, source, build)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=worker, name=f"builder-{i}") for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    who = (target / "who.txt").read_text()
    assert who in {"builder-0", "builder-1"}
    assert (target / "data.bin").read_bytes() == who.encode() * 10000
    assert read_cache_marker(target, source) is not None
    assert leftovers(target.parent) == []


def test_abandoned_temporary_folders_are_cleaned_up(temp_cache):
    parent = temp_cache / "models"
    old, fresh = parent / ".tiny.tmp-dead", parent / ".tiny.tmp-alive"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x")
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old, (two_days_ago, two_days_ago))

    ensure_cached_folder(parent / "tiny", {"v": 1}, lambda f: None)
    assert not old.exists()
    assert fresh.exists(), "a young temporary folder may belong to a running conversion"


def test_packaged_model_path_converts_into_cwcore_cache_once(temp_cache, monkeypatch, capsys):
    calls = []

    def fake_convert(locate_gguf, folder):
        calls.append(locate_gguf(folder))
        save_tiny_llama(folder)
        return {"gguf_file": calls[-1].name}

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    path = models.packaged_model_path("smollm2-135m")
    assert path == temp_cache / "models" / "smollm2-135m"
    assert calls[0].name == "SmolLM2-135M-Instruct.Q4_1.gguf" and calls[0].is_file()
    err = capsys.readouterr().err
    assert "converting smollm2-135m" in err and "once, cached at" in err and str(path) in err
    assert models.packaged_model_path("SmolLM2-135M") == path  # case-insensitive, no rebuild
    assert len(calls) == 1 and "converting" not in capsys.readouterr().err
    marker = read_cache_marker(path)
    assert marker["source"]["size"] == calls[0].stat().st_size
    assert (path.stat().st_mode & 0o777) == (0o777 & ~models._current_umask())


def test_save_plain_model_keeps_tied_embeddings_and_drops_quantization(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = tiny_llama(tie=True)
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "tiny.gguf"}
    models.save_plain_model(model, tiny_tokenizer(with_pad=True), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    ids = [3, 5, 7, 9, 11, 13]
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(tmp_path)("the cat sat").input_ids == [3, 4, 5]
    assert AutoTokenizer.from_pretrained(tmp_path).model_max_length == 64


# --------------------------------------------------------------------------- hub ids and folders


def test_local_decoder_folder_loads_eager_eval_with_pad_token(tmp_path):
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=False).save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config._attn_implementation == "eager"
    assert not model.training and model.dtype == torch.float32 and model.device.type == "cpu"
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"
    batch = tokenizer(["the cat sat on a mat", "the dog ran"], padding=True, return_tensors="pt")
    assert batch.input_ids.shape == (2, 6) and batch.attention_mask.sum().item() == 9
    ids = [3, 4, 5]  # the reference runs sdpa attention, hence float32 rounding differences
    torch.testing.assert_close(logits(model, ids), logits(tiny_llama(), ids), rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype, expected", [
    ("bfloat16", torch.bfloat16), ("float16", torch.float16), (torch.float16, torch.float16),
    ("float32", torch.float32),
])
def test_dtype_strings_reach_the_model(tmp_path, dtype, expected):
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {expected}
    assert tokenizer.pad_token == "<pad>"


def test_gemma3_in_float16_warns_about_overflow(tmp_path):
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM

    config = Gemma3TextConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="float16 range"):
        load_model(tmp_path, dtype="float16")


def test_local_encoder_folder_loads_without_lm_head(tmp_path):
    tiny_bert().save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path))
    assert type(model).__name__ == "BertModel"
    assert model.get_output_embeddings() is None
    assert model.config._attn_implementation == "eager"


def test_an_encoder_decoder_folder_loads_whole_and_a_checkpoint_missing_weights_is_refused(tmp_path):
    """A saved BartForConditionalGeneration loaded as BartForCausalLM: the encoder dropped, the decoder's
    embeddings and head random (two loads differed), with only a log line."""
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(vocab_size=16, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    torch.manual_seed(0)
    saved = BartForConditionalGeneration(config).eval()
    saved.save_pretrained(tmp_path / "bart")
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path / "bart")
    model, _ = load_model(tmp_path / "bart")
    assert type(model).__name__ == "BartForConditionalGeneration"
    reference = saved.state_dict()
    assert set(model.state_dict()) == set(reference)
    assert all(torch.equal(value, reference[key]) for key, value in model.state_dict().items())
    llama = tiny_llama()
    llama.save_pretrained(tmp_path / "lossy", state_dict={k: v for k, v in llama.state_dict().items()
                                                          if k != "model.norm.weight"})
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path / "lossy")
    with pytest.raises(ValueError, match="1 weights of LlamaForCausalLM are not in the checkpoint "
                                         "\\(model.norm.weight\\); they would be random"):
        load_model(tmp_path / "lossy")


def test_loader_defaults_are_safe(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path)
    seen = {}
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(kwargs)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    load_model(str(tmp_path))
    assert seen["trust_remote_code"] is False
    assert seen["use_safetensors"] is True
    assert seen["attn_implementation"] == "eager"
    assert seen["dtype"] is torch.float32


def test_conflicting_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="device_map"):
        load_model("minilm-l6", device="cpu", device_map="auto")
    with pytest.raises(ValueError, match="'eager', 'sdpa'"):  # sdpa is one of the two (the manual's SDPA path, How it works)
        load_model("minilm-l6", attn_implementation="flex_attention")
    with pytest.raises(ValueError, match=r"^device: "):  # torch's own words for a device it does not know
        load_model("minilm-l6", device="cpux")


def test_hub_download_options_are_refused_for_a_packaged_model(monkeypatch):
    # before: from_pretrained of the converted local folder dropped them without a word, so
    # load_model("smollm2-135m", revision="v2") returned the packaged weights
    import cwcore.models as models

    loads = []
    monkeypatch.setattr(models, "_load_packaged", lambda *args: loads.append(args) or (None, None))
    with pytest.raises(ValueError, match=r"^revision does not apply to 'minilm-l6': a packaged model \(.*\), converted "
                                         r"into CWCORE_CACHE's folder, not downloaded from the hub; load a hub id"):
        load_model("minilm-l6", revision="v2")
    with pytest.raises(ValueError, match=r"^cache_dir, token do not apply to 'smollm2-135m'"):
        load_model("smollm2-135m", cache_dir="/tmp/hub", token="hf_x")
    assert loads == []  # refused before anything was converted or loaded
    # an option that holds for a local conversion passes through to from_pretrained
    monkeypatch.setattr(models, "_load_packaged", lambda key, dtype, kwargs, variant: loads.append(dict(kwargs))
                        or (torch.nn.Linear(1, 1), object()))
    monkeypatch.setattr(models, "_ensure_pad_token", lambda tokenizer: None)
    load_model("minilm-l6", local_files_only=True, revision=None)
    assert loads == [{"local_files_only": True, "revision": None, "attn_implementation": "eager"}]


def test_hub_download_options_are_refused_for_a_local_folder(tmp_path, monkeypatch):
    """A local folder is read as it is: before, revision, token, cache_dir and force_download were passed to
    from_pretrained, which drops them for a folder, so load_model(folder, revision="v2") loaded the folder."""
    import cwcore.models as models

    loads = []
    monkeypatch.setattr(models, "_load_from_hub_or_folder", lambda *args: loads.append(args) or (None, None))
    with pytest.raises(ValueError, match=r"^force_download, revision do not apply to the local folder .* which is "
                                         r"read as it is"):
        load_model(str(tmp_path), revision="v2", force_download=True)
    assert loads == []
    monkeypatch.setattr(models, "_load_from_hub_or_folder",  # the control: a hub id passes them on
                        lambda name, dtype, kwargs: loads.append(dict(kwargs)) or (torch.nn.Linear(1, 1), object()))
    monkeypatch.setattr(models, "_ensure_pad_token", lambda tokenizer: None)
    load_model("someone/some-model", revision="v2")
    assert loads and loads[0]["revision"] == "v2"


def test_a_device_this_torch_lacks_is_one_sentence_before_the_load(monkeypatch):
    # before: torch's "Torch not compiled with CUDA enabled" AssertionError from inside .to(), after the load
    # (the test let the load run, so a check made after it passed too, and it was skipped where CUDA is there:
    # now loading fails the test and CUDA is made absent everywhere)
    import cwcore.models as models

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(models, "_load_packaged", lambda *args: pytest.fail("loaded before the device was checked"))
    with pytest.raises(ValueError, match=r"^device='cuda': this torch \(.*\) has no cuda device available; load on "
                                         r"'cpu', or install a torch build for that device$"):
        load_model("smollm2-135m", device="cuda")


@pytest.mark.skipif(getattr(torch, "xpu", None) is not None and torch.xpu.is_available(), reason="an XPU is there")
def test_an_xpu_this_torch_lacks_is_one_sentence_before_the_load(monkeypatch):
    # before: "Torch not compiled with XPU enabled" from .to(), after the whole load
    import cwcore.models as models

    monkeypatch.setattr(models, "_load_packaged", lambda *args: pytest.fail("loaded before the device was checked"))
    with pytest.raises(ValueError, match=r"^device='xpu': this torch \(.*\) has no xpu device available"):
        load_model("smollm2-135m", device="xpu")


def test_a_folder_loads_as_transformers_loads_it_with_config_overrides_a_config_and_a_tilde(tmp_path, monkeypatch):
    """``num_hidden_layers=1`` reached the model's __init__ (refused: "unexpected keyword argument") and
    ``config=`` was passed twice ("multiple values"); ``~/folder`` was looked up on the hub. The reference is
    transformers' own from_pretrained with the same arguments."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "tiny"
    tiny_llama(tie=False).save_pretrained(folder)
    tiny_tokenizer(with_pad=True).save_pretrained(folder)
    ids = [3, 4, 5, 6, 7]
    reference = AutoModelForCausalLM.from_pretrained(folder, num_hidden_layers=1, attn_implementation="eager").eval()
    assert reference.config.num_hidden_layers == 1
    model, _ = load_model(str(folder), num_hidden_layers=1)
    assert model.config.num_hidden_layers == 1 and len(model.model.layers) == 1
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=0, atol=0)
    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 1
    model, _ = load_model(str(folder), config=config)
    assert len(model.model.layers) == 1
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), rtol=0, atol=0)
    with pytest.raises(TypeError, match="^config must be a transformers PretrainedConfig"):
        load_model(str(folder), config={"num_hidden_layers": 1})
    monkeypatch.setenv("HOME", str(tmp_path))
    whole, _ = load_model("~/tiny")
    assert len(whole.model.layers) == 2
    eager = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(whole, ids), logits(eager, ids), rtol=0, atol=0)


def test_the_meta_device_is_refused_before_the_load(monkeypatch):
    # before: accepted, the weights dropped by .to("meta"), and decompose refused the model later
    # (the test let the load run, so a refusal made after it passed too: now loading fails the test)
    import cwcore.models as models

    monkeypatch.setattr(models, "_load_packaged", lambda *args: pytest.fail("loaded before the device was checked"))
    with pytest.raises(ValueError, match=r"^device='meta' holds shapes, not weights"):
        load_model("smollm2-135m", device="meta")


@pytest.mark.parametrize("name", ["no-such-org/no-such-model-cwcore", "smollm3-135m",
                                  "./no/such/folder"])
def test_unknown_name_fails_fast_with_one_sentence_listing_packaged_models(name, offline):
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError) as caught:
        load_model(name)
    assert time.perf_counter() - started < 10
    message = str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert name in message and "could not be found locally or on the Hugging Face hub" in message
    assert "(offline mode is on)" in message  # why the hub was not asked
    assert all(repr(packaged) in message for packaged in PACKAGED_MODELS)
    assert message.endswith(".") and message.count(". ") == 0 and "\n" not in message


def test_unreachable_hub_fails_fast_without_retries(monkeypatch):
    import huggingface_hub.constants

    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    from cwcore import hub

    monkeypatch.setattr(hub, "reachable", lambda timeout=3.0: False)
    started = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="not reachable"):
        load_model("no-such-org/no-such-model-cwcore")
    assert time.perf_counter() - started < 10


def test_packaged_model_path_rejects_other_names():
    with pytest.raises(ModelNotFoundError, match="not a packaged model.*'minilm-l6'"):
        models.packaged_model_path("gpt2")


# --------------------------------------------------------------------------- packaged models


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


@pytest.mark.slow
def test_smollm2_cache_reproduces_gguf_logits(smollm2):
    from transformers import AutoModelForCausalLM

    model, tokenizer = smollm2
    path = models.packaged_model_path("smollm2-135m")
    marker = read_cache_marker(path)
    assert marker["source"] == models._smollm2_source()[0]
    assert marker["max_abs_logit_difference_to_gguf"] <= 1e-5
    gguf_path = models._smollm2_source()[1](path)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
    ids = tokenizer("Contribution weights split attention into value vectors.").input_ids
    torch.testing.assert_close(logits(model, ids), logits(gguf_model, ids), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_smollm2_is_an_eager_llama_with_tied_embeddings_and_sane_predictions(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config._attn_implementation == "eager"
    assert not model.training and model.dtype == torch.float32
    assert (model.config.num_hidden_layers, model.config.num_attention_heads,
            model.config.num_key_value_heads) == (30, 9, 3)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # BOS is <|im_start|> and is NOT prepended; chat-formatted text starts with it anyway.
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert tokenizer(ENGLISH).input_ids[0] != tokenizer.bos_token_id
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.startswith("<|im_start|>system")
    assert tokenizer.model_max_length == 8192
    assert perplexity(model, tokenizer, ENGLISH) < 30
    ids = tokenizer("The capital of France is").input_ids
    assert tokenizer.decode(logits(model, ids)[0, -1].argmax()) == " Paris"


@pytest.mark.slow
def test_smollm2_in_bfloat16_predicts_the_same_next_token():
    model, tokenizer = load_model("smollm2-135m", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    ids = tokenizer("The capital of France is").input_ids
    assert tokenizer.decode(logits(model, ids)[0, -1].argmax()) == " Paris"


@pytest.mark.slow
def test_gemma3_loads_from_gguf_with_bos_and_sane_perplexity():
    model, tokenizer = load_model("gemma3-270m")
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config._attn_implementation == "eager"
    assert not model.training and model.dtype == torch.float32
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.sliding_window) == (18, 4, 1, 256, 512)
    assert config.layer_types.count("full_attention") == 3
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert read_cache_marker(models.packaged_model_path("gemma3-270m"))[
        "max_abs_logit_difference_to_gguf"] <= 1e-5
    ids = tokenizer(ENGLISH).input_ids
    assert ids[0] == tokenizer.bos_token_id == 2  # Gemma's tokenizer prepends <bos>
    assert tokenizer.pad_token == "<pad>" and tokenizer.padding_side == "left"
    with_bos = perplexity(model, tokenizer, ENGLISH)
    assert with_bos < 30
    without_bos = torch.tensor([ids[1:]])
    with torch.no_grad():
        no_bos_ppl = model(input_ids=without_bos, labels=without_bos).loss.exp().item()
    assert no_bos_ppl > 3 * with_bos, "Gemma depends on its <bos> token"
    top5 = logits(model, tokenizer("The capital of France is").input_ids)[0, -1].topk(5).indices
    assert " Paris" in [tokenizer.decode(i) for i in top5]


@pytest.mark.slow
def test_minilm_is_an_eager_bert_encoder_with_meaningful_embeddings():
    model, tokenizer = load_model("minilm-l6")
    assert type(model).__name__ == "BertModel" and model.get_output_embeddings() is None
    assert model.config._attn_implementation == "eager" and not model.training
    sentences = ["A man is playing a guitar.", "Someone plays an acoustic guitar on stage.",
                 "The stock market fell sharply today."]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    assert hidden.shape == (3, batch.input_ids.shape[1], 384)
    mask = batch.attention_mask.unsqueeze(-1).float()
    embeddings = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    similar, unrelated = embeddings[0] @ embeddings[1], embeddings[0] @ embeddings[2]
    assert similar > 0.5 > unrelated + 0.3


def test_a_model_loaded_with_sdpa_decomposes_as_its_eager_load(tmp_path):
    """The SDPA path of the manual (How it works): load_model(..., attn_implementation="sdpa") loads, keeps SDPA, and its
    decomposition equals the eager load's (float32 rounding); other implementations are refused by name."""
    import cwcore

    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    tiny_tokenizer(with_pad=True).save_pretrained(folder)
    sdpa, tok = models.load_model(str(folder), attn_implementation="sdpa")
    eager, _ = models.load_model(str(folder))
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    enc = tok(["a b c d", "b c"], return_tensors="pt", padding=True)
    got, want = cwcore.decompose(sdpa, **enc), cwcore.decompose(eager, **enc)
    for layer in want.layers:
        torch.testing.assert_close(got[layer].contribution("inter"), want[layer].contribution("inter"),
                                   rtol=1e-4, atol=1e-5, equal_nan=True)
    with pytest.raises(ValueError, match="attn_implementation must be one of 'eager', 'sdpa'"):
        models.load_model(str(folder), attn_implementation="flash_attention_2")


def test_a_folder_without_tokenizer_files_is_refused_in_one_sentence_before_the_weights_load(tmp_path, monkeypatch):
    tiny_llama().save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    def never(*args, **kwargs):
        raise AssertionError("the weights were loaded first")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(ValueError, match="no tokenizer could be loaded from it") as caught:
        load_model(tmp_path)
    assert "\n" not in str(caught.value)


def test_the_older_torch_dtype_keyword_reaches_the_model_and_cannot_be_given_with_dtype(tmp_path):
    # torch_dtype was popped and forgotten without a test noticing: the model stayed float32
    tiny_llama().save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path)
    model, _ = load_model(tmp_path, torch_dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="^pass either dtype or torch_dtype, not both$"):
        load_model(tmp_path, dtype="float32", torch_dtype="bfloat16")


def test_a_packaged_model_takes_dtype_and_from_pretrained_keywords():
    # the packaged path dropped config overrides and attn_implementation without a word (only its
    # caller was tested, with _load_packaged replaced); minilm-l6 is small enough to load here
    model, tokenizer = load_model("minilm-l6", dtype="float64", num_hidden_layers=1, attn_implementation="sdpa")
    assert type(model).__name__ == "BertModel" and len(model.encoder.layer) == 1
    assert model.config._attn_implementation == "sdpa" and not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert tokenizer.pad_token == "[PAD]"


def test_a_local_folders_subfolder_is_read_not_refused_as_a_hub_option(tmp_path):
    # subfolder is the one download option a local folder honours (from_pretrained reads folder/subfolder)
    tiny_llama().save_pretrained(tmp_path / "sub")
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path / "sub")
    model, tokenizer = load_model(tmp_path, subfolder="sub")
    assert tokenizer("the cat sat").input_ids == [3, 4, 5]
    ids = [3, 4, 5]  # the reference runs sdpa attention, hence float32 rounding differences
    torch.testing.assert_close(logits(model, ids), logits(tiny_llama(), ids), rtol=0, atol=1e-6)


def test_a_variant_of_a_packaged_model_without_gguf_is_refused_by_name(offline):
    # "<packaged>-requantized" is read as a variant (case-insensitive): without that reading the name went to the
    # hub and came back "could not be found"; minilm-l6 ships no GGUF, so nothing is built here
    for name, variant in (("MiniLM-L6-requantized", None), ("minilm-l6", "requantized")):
        with pytest.raises(ValueError, match=r"^variant='requantized' exists for the packaged GGUF models "
                                             r"\(smollm2-135m, gemma3-270m\), not for "):
            load_model(name, variant=variant)
    with pytest.raises(ValueError, match=r"^variant must be one of \['requantized'\], got 'int8'$"):
        load_model("smollm2-135m", variant="int8")


def test_a_config_without_architectures_that_says_is_decoder_loads_as_a_causal_lm(tmp_path):
    # a hand-written config.json names no architectures: is_decoder=True is then what marks a decoder with a head
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, max_position_embeddings=64, is_decoder=True)
    saved = BertLMHeadModel(config).eval()
    saved.save_pretrained(tmp_path)
    tiny_tokenizer(with_pad=True).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    del written["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    model, _ = load_model(tmp_path)
    assert type(model).__name__ == "BertLMHeadModel"
    ids = [3, 4, 5]  # the reference may run sdpa attention, hence float32 rounding differences
    torch.testing.assert_close(logits(model, ids), logits(saved, ids), rtol=0, atol=1e-5)
