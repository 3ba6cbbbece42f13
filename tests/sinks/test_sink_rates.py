"""Sink rates (cwcore.sinks.rates) on the planted model and against eager attention maps."""

import numpy as np
import pandas as pd
import pytest

from cwcore import sinks
from sink_fixtures import (FAST, T, expected_alpha, naive_run, planted_ids, planted_model, random_ids,
                           word_tokenizer as _word_tokenizer)
from tiny_models import tiny_model


# -- 1. sink rates ---------------------------------------------------------------------------------


def test_sink_rates_recover_the_planted_rate_and_sink_eps():
    model, ids = planted_model(), planted_ids()
    expected = expected_alpha().mean()
    table = sinks.sink_rates(model, None, ids, eps=expected - 0.01, **FAST)
    assert len(table) == 2
    np.testing.assert_allclose(table["sink_rate"], expected, atol=1e-5)
    np.testing.assert_allclose(table["sink_rate_all_queries"], (expected * (T - 1) + 1) / T, atol=1e-5)
    np.testing.assert_allclose(table["median"], np.median(expected_alpha()), atol=1e-5)
    np.testing.assert_allclose(table["sink_rate_sequence_std"], 0, atol=1e-6)  # same pattern in every sequence
    assert table["sink_eps"].iloc[0] == 1.0
    assert sinks.sink_rates(model, None, ids, eps=expected + 0.01, **FAST)["sink_eps"].iloc[0] == 0.0


def test_sink_rates_match_eager_attention_maps():
    model, ids = tiny_model("llama"), random_ids()
    table = sinks.sink_rates(model, None, ids, batch_size=2, **FAST).set_index(["layer", "head"])
    reference, _ = naive_run(model, ids)
    for l, ref in enumerate(reference):
        a0 = ref["attention"][:, :, :, 0]
        np.testing.assert_allclose(table.loc[l, "sink_rate"], a0[:, :, 1:].mean((0, 2)).numpy(), atol=1e-6)
        np.testing.assert_allclose(table.loc[l, "sink_rate_all_queries"], a0.mean((0, 2)).numpy(), atol=1e-6)
        np.testing.assert_allclose(table.loc[l, "sink_rate_std"], a0[:, :, 1:].permute(1, 0, 2).reshape(4, -1).std(1, unbiased=False).numpy(), atol=1e-6)
    rates = table["sink_rate"]
    assert table["sink_eps"].iloc[0] == pytest.approx(float((rates > 0.3).mean()))


def test_add_bos_is_a_parameter_and_is_recorded():
    model, tokenizer = tiny_model("llama"), _word_tokenizer()
    texts = [" ".join(f"w{(i * 7 + j) % 20}" for j in range(30)) for i in range(4)]
    with_bos = sinks.sink_rates(model, tokenizer, texts, block_size=10, num_sequences=3, add_bos=True, **FAST)
    without = sinks.sink_rates(model, tokenizer, texts, block_size=10, num_sequences=3, add_bos=False, **FAST)
    default = sinks.sink_rates(model, tokenizer, texts, block_size=10, num_sequences=3, **FAST)  # tokenizer adds none
    assert bool(with_bos["add_bos"].iloc[0]) and with_bos["first_token_is_bos"].iloc[0] == 1.0
    assert not bool(without["add_bos"].iloc[0]) and without["first_token_is_bos"].iloc[0] == 0.0
    pd.testing.assert_frame_equal(default, without)
    assert not np.allclose(with_bos["sink_rate"], without["sink_rate"])
    assert (with_bos["num_sequences"] == 3).all() and (with_bos["block_size"] == 10).all()
    with pytest.raises(ValueError, match="already tokenised"):
        sinks.sink_rates(model, None, random_ids(), add_bos=True, **FAST)
