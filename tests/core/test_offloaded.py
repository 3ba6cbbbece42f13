"""A model whose weights accelerate offloads (to the CPU or to disk: on the meta device until their module runs,
as ``device_map="auto"`` does for a model larger than its GPUs) gives the numbers of the same model held in
memory. Before, every decomposition refused it with a false reason: W_O was found by its memory address, and
all meta weights sit at address 0, so the query projection was taken for W_O."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import transformers as tf

import cwcore
from cwcore import explorer, sinks
from cwcore import faithfulness as fa
from cwcore.cli import explain
from cwcore.core.architectures import input_device
from cwcore.logit_attribution import logit_attribution
from faithfulness.faith_helpers import word_tokenizer

TEXTS = ["the cat sat on the mat and ran away", "the dog ran far so it got away",
         "one two three four five six seven eight nine ten", "hello world it is always so"]


def _model(family: str, vocabulary: int):
    torch.manual_seed(0)
    common = dict(vocab_size=vocabulary, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa")
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=2)).eval()
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**common, num_key_value_heads=1, head_dim=16, sliding_window=4,
                                                    layer_types=["sliding_attention", "full_attention"])).eval()


def _offloaded(model, where: str, folder):
    from accelerate import cpu_offload, disk_offload

    if where == "cpu":
        cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        disk_offload(model, str(folder), execution_device=torch.device("cpu"))
    assert model.model.layers[0].self_attn.o_proj.weight.device.type == "meta"
    return model


def _maps(drawn) -> dict:
    """The maps of :func:`cwcore.cli.explain`'s ``(figure, attention, contribution, tokens)``; the figure closed."""
    import matplotlib.pyplot as plt

    plt.close(drawn[0])
    return {"attention": torch.as_tensor(drawn[1]), "contribution": torch.as_tensor(drawn[2])}


def _same(got, expected):
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, equal_nan=True)
    elif isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=0, atol=1e-6)
    else:
        assert set(got) == set(expected)
        for key in expected:
            _same(torch.as_tensor(got[key]), torch.as_tensor(expected[key]))


@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_an_offloaded_model_gives_the_numbers_of_the_model_in_memory(family, where, tmp_path):
    tokenizer = word_tokenizer()
    tokenizer.padding_side = "left"
    enc = dict(tokenizer(TEXTS[:3], return_tensors="pt", padding=True))
    sweep = dict(ratios=[0.3], max_length=12, progress=False)
    calls = {
        "decompose": lambda m: cwcore.decompose(m, **enc)[1].contribution("inter"),
        "summarize": lambda m: cwcore.summarize(m, **enc, top_k=3)[1].received(),
        "alti": lambda m: cwcore.attribute(m, method="alti", **enc)[1],
        "value zeroing": lambda m: cwcore.attribute(m, method="value_zeroing", **enc)[1],
        "faithfulness": lambda m: fa.faithfulness_curve(m, tokenizer, TEXTS, metric=["contribution", "alti"],
                                                        **sweep).per_sequence,
        "sink rates": lambda m: sinks.sink_rates(m, tokenizer, TEXTS, block_size=8, num_sequences=4, progress=False),
        "explorer": lambda m: explorer.explorer_data(m, tokenizer, TEXTS[0])["arrays"],
        "logit attribution": lambda m: logit_attribution(m, input_ids=enc["input_ids"][2:])[1],
        "explain's figure": lambda m: _maps(explain(TEXTS[0], m, tokenizer, layer=1, head=0)),
    }
    in_memory = _model(family, len(tokenizer))
    expected = {name: call(in_memory) for name, call in calls.items()}
    model = _offloaded(_model(family, len(tokenizer)), where, tmp_path / "offload")
    assert input_device(model) == torch.device("cpu")  # the hooks' execution device, not the weights' meta
    for name, call in calls.items():
        _same(call(model), expected[name])
