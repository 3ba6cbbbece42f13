"""Sink rates (cwcore.sinks.rates) on the planted model and against eager attention maps."""

import numpy as np
import pandas as pd
import pytest
import torch

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
    """Also the quantiles q10 / median / q90 over queries >= 1 (numpy's linear quantile): q10 and q90 were
    read by no test."""
    model, ids = tiny_model("llama"), random_ids()
    table = sinks.sink_rates(model, None, ids, batch_size=2, **FAST).set_index(["layer", "head"])
    reference, _ = naive_run(model, ids)
    for l, ref in enumerate(reference):
        a0 = ref["attention"][:, :, :, 0]
        np.testing.assert_allclose(table.loc[l, "sink_rate"], a0[:, :, 1:].mean((0, 2)).numpy(), atol=1e-6)
        np.testing.assert_allclose(table.loc[l, "sink_rate_all_queries"], a0.mean((0, 2)).numpy(), atol=1e-6)
        later = a0[:, :, 1:].permute(1, 0, 2).reshape(4, -1).numpy()  # [head, sequence x query]
        for column, q in (("q10", 0.1), ("median", 0.5), ("q90", 0.9)):
            np.testing.assert_allclose(table.loc[l, column], np.quantile(later, q, axis=1), atol=1e-6)
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


def test_block_size_cuts_text_and_is_refused_for_blocks_of_another_length():
    # block_size applies to text; token blocks keep their length. Before, block_size=8 on 16-token blocks was
    # ignored without a word (the table said block_size 16)
    model, tokenizer = tiny_model("llama"), _word_tokenizer()
    ids = random_ids()
    length = ids.shape[1]
    plain = sinks.sink_rates(model, None, ids, **FAST)
    assert (plain["block_size"] == length).all()
    pd.testing.assert_frame_equal(sinks.sink_rates(model, None, ids, block_size=length, **FAST), plain)
    for wrong in (length - 1, length + 1):
        with pytest.raises(ValueError, match=rf"^block_size={wrong} applies to text; these blocks are already "
                                             rf"tokenised, {length} tokens each"):
            sinks.sink_rates(model, None, ids, block_size=wrong, **FAST)
    texts = [" ".join(f"w{(i * 7 + j) % 20}" for j in range(300)) for i in range(2)]
    from cwcore.sinks.engine import token_blocks

    assert token_blocks(texts, tokenizer).ids.shape[1] == 128  # text without block_size: blocks of 128 tokens
    assert (sinks.sink_rates(model, tokenizer, texts, block_size=40, **FAST)["block_size"] == 40).all()


# -- where the mass goes, layer types, learned sinks --------------------------------------------------


def test_key_masses_and_token_classes_match_eager_attention_maps():
    from cwcore.sinks.engine import TOKEN_CLASSES, token_classes

    model, tok = tiny_model("llama"), _word_tokenizer()
    ids = torch.tensor([[0, 3, 4, 1, 5, 6, 3, 1, 7, 8], [0, 5, 5, 6, 1, 3, 4, 9, 1, 2]])  # 0 = <bos>, 1 = <eos>
    table = sinks.sink_rates(model, tok, ids, **FAST).set_index(["layer", "head"])
    classes = token_classes(ids, tok)
    assert classes[0, 0] == "bos" and classes[0, 3] == "special" and classes[0, 1] == "word"
    clean, _ = naive_run(model, ids)
    n = ids.shape[1]
    for layer in range(2):
        attention = clean[layer]["attention"][:, :, 1:, :].numpy()  # queries >= 1
        key_mass = attention.mean(2)  # [b, h, k]
        for head in range(attention.shape[1]):
            row = table.loc[(layer, head)]
            mean = key_mass[:, head].mean(0)
            assert row["top_key"] == int(np.argmax(mean)) and row["top_key_mass"] == pytest.approx(mean.max(), abs=1e-5)
            assert row["top_later_mass"] == pytest.approx(mean[1:].max(), abs=1e-5)
            total = 0.0
            for c in TOKEN_CLASSES:
                expected = np.mean([key_mass[s, head][classes[s] == c].sum() for s in range(2)])
                assert row[f"mass_{c}"] == pytest.approx(expected, abs=1e-5), c
                total += row[f"mass_{c}"]
            assert total == pytest.approx(1.0, abs=1e-5)
    # the uniform baseline: query i >= 1 gives 1/(i+1) to each of its keys, for every class (only "special"
    # was checked, so key 0's baseline, which only "bos" holds, could count query 0 too)
    uniform = np.zeros((2, n))
    for i in range(1, n):
        uniform[:, : i + 1] += 1 / (i + 1) / (n - 1)
    for c in TOKEN_CLASSES:
        expected = np.mean([uniform[s][classes[s] == c].sum() for s in range(2)])
        assert table[f"uniform_{c}"].iloc[0] == pytest.approx(expected), c
    assert sum(table[f"uniform_{c}"].iloc[0] for c in TOKEN_CLASSES) == pytest.approx(1.0)
    assert (table["layer_type"] == "global").all() and table["learned_sink_mass"].isna().all()


def test_layer_types_and_learned_sink_mass_from_the_zoo():
    from cwcore.sinks.engine import layer_types
    from zoo_models import zoo_model

    gemma = zoo_model("gemma3")
    assert layer_types(gemma) == {0: "sliding", 1: "global"}
    assert set(layer_types(tiny_model("llama")).values()) == {"global"}
    model = zoo_model("gpt_oss")
    assert layer_types(model) == {0: "sliding", 1: "global"}
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    table = sinks.sink_rates(model, None, ids, **FAST)
    assert list(table.drop_duplicates("layer")["layer_type"]) == ["sliding", "global"]
    # naive: the learned sink logit joins the softmax; its mass is what the keys' probabilities miss
    captured = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, a, o, l=l: captured.__setitem__(l, o[1]))
             for l, layer in enumerate(model.model.layers)]
    before = model.config._attn_implementation
    try:
        with torch.inference_mode():
            model.config._attn_implementation = "eager"
            model(input_ids=ids, output_attentions=True)
    finally:
        model.config._attn_implementation = before  # the zoo's model is shared by other tests
        for h in hooks:
            h.remove()
    for l in range(2):
        missing = 1 - captured[l][:, :, 1:, :].sum(-1)  # [b, h, q]: eager probs exclude the sink column
        expected = missing.mean((0, 2)).numpy()
        got = table[table["layer"] == l].sort_values("head")["learned_sink_mass"].to_numpy()
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert (got > 0).all()
