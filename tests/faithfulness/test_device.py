"""On a model that is not on the CPU every verb gives the CPU's numbers: the faithfulness sweeps build their
batches on the model's device, and the engine, the attribution methods and the sink analyses move what they
make. The device is emulated on the CPU (tests/emulated_device.py: it refuses a CPU tensor beside its own as
CUDA does); there SDPA takes its math path rather than the CPU's fused kernel, so the results equal the CPU's
to float32 rounding (1e-5)."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf
from torch.utils._pytree import tree_map

import cwcore
from cwcore import explorer, sinks
from cwcore import faithfulness as fa
from cwcore.faithfulness.layers import per_layer_curve
from cwcore.faithfulness.methods import method_scores
from emulated_device import emulated_device
from faith_helpers import mc_dataset, word_tokenizer

TEXTS = ["the cat sat on the mat and ran away", "the dog ran far so it got away",
         "one two three four five six seven eight nine ten", "hello world it is always so",
         "a cat is on a mat and a dog is on it", "it was a dog"]
SWEEP = dict(ratios=[0.2, 0.5], max_length=12, progress=False, batch_size=4)


def _model(family: str, tied: bool = True):
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa")
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=2))
    else:  # a sliding layer and a sandwich norm (ALTI's post-attention norm)
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                                         layer_types=["sliding_attention", "full_attention"],
                                                         tie_word_embeddings=tied))
    return model.eval(), tokenizer


def _split(model, device):
    """The model split over two devices as ``device_map`` splits it: the embeddings and layer 0 stay on the CPU,
    layer 1, the final norm and the head go to ``device``, and a pre-hook on each moves its inputs there (as
    accelerate's hooks do)."""
    def move(module, args, kwargs):
        return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, (args, kwargs))

    for module in (model.model.layers[1], model.model.norm, model.lm_head):
        module.to(device)
        module.register_forward_pre_hook(move, with_kwargs=True)
    return model


def _same(on_device, on_cpu, on_device_too=True):
    if isinstance(on_cpu, torch.Tensor):
        assert isinstance(on_device, torch.Tensor) and (on_device.device.type != "cpu" or not on_device_too)
        torch.testing.assert_close(on_device.cpu(), on_cpu, rtol=1e-5, atol=1e-5, equal_nan=True)
    elif isinstance(on_cpu, pd.DataFrame):
        pd.testing.assert_frame_equal(on_device, on_cpu, check_exact=False, rtol=1e-5, atol=1e-5)
    elif isinstance(on_cpu, dict):
        assert set(on_device) == set(on_cpu)
        for key in on_cpu:
            _same(on_device[key], on_cpu[key])
    elif isinstance(on_cpu, np.ndarray):
        np.testing.assert_allclose(on_device, on_cpu, rtol=1e-5, atol=1e-5)
    else:
        assert on_device == on_cpu


def test_the_emulated_device_refuses_a_cpu_tensor_beside_its_own():
    """The control: the device catches what a GPU catches, and computes what the CPU computes."""
    model, tokenizer = _model("llama")
    ids = tokenizer(TEXTS[:1], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    with emulated_device() as device:
        model.to(device)
        with pytest.raises(RuntimeError, match="same device"):
            model(input_ids=ids)
        with torch.no_grad():
            logits = model(input_ids=ids.to(device)).logits
        with pytest.raises(TypeError, match="numpy"):
            logits.numpy()
        with pytest.raises(RuntimeError, match="indices should be"):
            torch.zeros(3)[torch.tensor([0, 1], device=device)]
        _same(logits, expected)


SWEEPS = {
    "methods": lambda m, t: fa.faithfulness_curve(
        m, t, TEXTS, metric=["attention", "contribution", "random", "alti", "value_zeroing", "rollout",
                             "grad_x_input"], **SWEEP).table,
    "live, per layer, both modes": lambda m, t: fa.faithfulness_curve(
        m, t, TEXTS, metric=["contribution", "random"], scores="live", scope="layer",
        mode=["comprehensiveness", "sufficiency"], **SWEEP).table,
    "mean removal, left padding": lambda m, t: fa.faithfulness_curve(
        m, t, TEXTS, metric=["contribution"], removal="mean", padding_side="left", **SWEEP).per_sequence,
    "precomputed scores": lambda m, t: fa.faithfulness_curve(
        m, t, TEXTS, metric=[{0: torch.rand(6, 12, 12, generator=torch.Generator().manual_seed(0)),
                              1: torch.rand(6, 12, 12, generator=torch.Generator().manual_seed(1))}], **SWEEP).table,
    "per layer": lambda m, t: per_layer_curve(m, t, TEXTS, ["attention", "contribution", "random"], [0.2],
                                              "comprehensiveness", max_length=12),
    "downstream": lambda m, t: fa.downstream_eval(m, t, mc_dataset(), metric=["contribution", "random"],
                                                  ratios=[0, 0.3], progress=False, task="toy", per_example=True),
    "downstream, not collapsed": lambda m, t: fa.downstream_eval(m, t, mc_dataset(), metric=["attention"],
                                                                 ratios=[0, 0.3], progress=False, task="toy",
                                                                 collapse=False, per_example=True),
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_faithfulness_sweeps_run_on_the_models_device(family):
    """Each sweep builds its batches on the model's device: before, they stayed on the CPU and the first
    forward stopped with torch's device error."""
    model, tokenizer = _model(family)
    expected = {name: sweep(model, tokenizer) for name, sweep in SWEEPS.items()}
    with emulated_device() as device:
        model.to(device)
        for name, sweep in SWEEPS.items():
            _same(sweep(model, tokenizer), expected[name])


def test_the_engine_methods_and_sink_analyses_run_on_the_models_device():
    model, tokenizer = _model("gemma3")
    tokenizer.padding_side = "left"
    enc = dict(tokenizer(TEXTS[:3], return_tensors="pt", padding=True))
    mask = torch.zeros(3, 4, enc["input_ids"].shape[1], enc["input_ids"].shape[1], dtype=torch.bool)
    mask[:, :, 3:, 1] = True

    def intervened(m, inputs):
        with torch.no_grad(), cwcore.intervene(m, {1: mask.to(inputs["input_ids"].device)},
                                               attention_mask=inputs["attention_mask"]):
            return m(**inputs).logits

    calls = {
        "decompose": lambda m, e: cwcore.decompose(m, **e)[1].contribution("inter"),
        "summarize": lambda m, e: cwcore.summarize(m, **e, top_k=3)[1].received(),
        "intervene": intervened,
        **{f"attribute {method}": (lambda m, e, method=method: cwcore.attribute(m, method=method, **e)[0])
           for method in ("alti", "value_zeroing", "rollout", "grad_x_input", "random")},
        "method_scores": lambda m, e: method_scores(m, "contribution", e["input_ids"], e["attention_mask"])[1],
    }
    expected = {name: call(model, enc) for name, call in calls.items()}
    options = sinks.SinkOptions(block_size=8, num_sequences=4)
    expected_sinks = sinks.run_analyses(model, tokenizer, TEXTS, options=options, progress=False)
    pages = {"explorer": explorer.explorer_data, "long explorer": explorer.long_explorer_data}
    expected_pages = {name: page(model, tokenizer, TEXTS[0])["arrays"] for name, page in pages.items()}
    with emulated_device() as device:
        on_device = copy.deepcopy(model).to(device)
        inputs = {name: value.to(device) for name, value in enc.items()}
        for name, call in calls.items():
            _same(call(on_device, inputs), expected[name])
        found = sinks.run_analyses(on_device, tokenizer, TEXTS, options=options, progress=False)
        for name, page in pages.items():
            _same(page(on_device, tokenizer, TEXTS[0])["arrays"], expected_pages[name])
    assert set(found) == set(expected_sinks)
    for name, result in expected_sinks.items():  # a table, or a NamedTuple of tables
        tables = [result] if isinstance(result, pd.DataFrame) else list(result)
        others = [found[name]] if isinstance(result, pd.DataFrame) else list(found[name])
        for table, other in zip(tables, others, strict=True):
            pd.testing.assert_frame_equal(other, table, check_exact=False, rtol=1e-5, atol=1e-5)


SPLIT = {
    "methods": lambda m, t: fa.faithfulness_curve(
        m, t, TEXTS, metric=["contribution", "random", "alti", "value_zeroing", "rollout", "grad_x_input"],
        **SWEEP).per_sequence,
    "live, per layer": lambda m, t: fa.faithfulness_curve(m, t, TEXTS, metric=["contribution", "random"],
                                                          scores="live", scope="layer", **SWEEP).per_sequence,
    "mean removal": lambda m, t: fa.faithfulness_curve(m, t, TEXTS, metric=["contribution"], removal="mean",
                                                       **SWEEP).per_sequence,
    "per layer": SWEEPS["per layer"],
    "downstream": SWEEPS["downstream"],
    "attribute rollout": lambda m, t: cwcore.attribute(m, method="rollout", **dict(t(TEXTS[:2], return_tensors="pt",
                                                                                   padding=True)))[1],
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_model_split_over_two_devices_gives_the_numbers_of_one(family):
    """A model split over devices (``device_map``): each layer's scores live on its own device, the logits on the
    last one. Before, the candidate masks (on the inputs' device) met a later layer's scores, rollout multiplied
    matrices of two layers, and the NLL and the gradient method read the inputs' ids beside the last layer's
    logits: torch's device error in each."""
    model, tokenizer = _model(family, tied=False)  # a weight tied over the split would sit on one device
    expected = {name: sweep(model, tokenizer) for name, sweep in SPLIT.items()}
    with emulated_device() as device:
        _split(model, device)
        assert model.model.layers[0].self_attn.o_proj.weight.device.type == "cpu"
        assert model.model.layers[1].self_attn.o_proj.weight.device == device
        for name, sweep in SPLIT.items():
            _same(sweep(model, tokenizer), expected[name], on_device_too=False)
