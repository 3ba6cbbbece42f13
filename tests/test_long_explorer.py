"""The long-document page (cwcore.explorer.long_explorer_*, `cwcore explain --summary`): its numbers are
cwcore.summarize's, within the page's stated precision (float16: relative 2^-11; cosines: 1/254)."""

from __future__ import annotations

import numpy as np
import torch

import cwcore
from cwcore.explorer import long_explorer_data, long_explorer_html, read_payload
from test_explorer import TEXT, tiny_tokenizer
from tiny_models import tiny_model


def test_the_long_page_carries_the_summary_within_its_precision():
    """received_attention (alpha summed over queries and heads, one of the page's two heat strips) was never
    compared, so a page whose attention strip showed the contribution totals passed. It is now compared with
    the decomposition's own alpha, summed here (independent of the summary's streaming code)."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    data = long_explorer_data(model, tokenizer, TEXT, top_k=4, model_name="tiny")
    page = long_explorer_html(data, query=3)
    # a negative layer counts from the end of the page's layers (it was refused as "not summarised")
    assert read_payload(long_explorer_html(data, layer=-1))["meta"]["start"]["layer"] == len(data["meta"]["layers"]) - 1
    back = read_payload(page)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    s = cwcore.summarize(model, input_ids=ids, top_k=4, rows=None)
    arrays = back["arrays"]
    assert back["meta"]["layers"] == [0, 1] and back["meta"]["start"] == {"query": 3, "layer": 1}
    d = cwcore.decompose(model, input_ids=ids)
    for index, layer in enumerate(s.layers):
        expected = s[layer]
        # float32 sums of 4 heads x 12 queries in another order: rtol 1e-5
        np.testing.assert_allclose(arrays["received_attention"][index], d[layer].attention[0].sum((0, 1)).numpy(),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(arrays["received"][index], expected.received()[0].numpy())
        np.testing.assert_array_equal(arrays["top_key"][index], expected.top.key[0].numpy())
        np.testing.assert_array_equal(arrays["top_head"][index], expected.top.head[0].numpy())
        for name in ("contribution", "attention", "relative_norm"):
            np.testing.assert_allclose(arrays[f"top_{name}"][index], getattr(expected.top, name)[0].numpy(),
                                       rtol=2 ** -11, atol=1e-7, equal_nan=True)
        np.testing.assert_allclose(arrays["top_cosine"][index], expected.top.cosine[0].numpy(), atol=1 / 254 + 1e-7,
                                   equal_nan=True)
    assert "default-src 'none'" in page  # the page loads nothing


def test_cli_summary_writes_the_long_page_from_a_file(tmp_path, capsys):
    from cwcore.cli import main

    folder = tmp_path / "model"
    tiny_model("gemma3").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    document = tmp_path / "doc.txt"
    document.write_text(" ".join([TEXT] * 4), encoding="utf-8")
    out = tmp_path / "doc.html"
    assert main(["explain", "--file", str(document), "--summary", "--model", str(folder), "--out", str(out),
                 "--top-k", "3", "--query", "-2"]) == 0
    from cwcore.cli import _size

    # the page's size as the explorer's line gives it (before: "(0.0 MB)" for any page under 50 KB)
    assert capsys.readouterr().out.strip() == f"wrote {out} ({_size(out.stat().st_size)})"
    assert _size(out.stat().st_size).endswith(" KB")
    back = read_payload(out)
    n = len(back["meta"]["tokens"])
    assert back["meta"]["start"]["query"] == n - 2 and back["arrays"]["top_key"].shape == (2, n, 3)
    assert main(["explain", "--file", str(document), "--summary", "--model", str(folder), "--out",
                 str(tmp_path / "x.png")]) == 2
    assert "--summary writes the long-document page" in capsys.readouterr().err
    assert main(["explain", "the cat", "--file", str(document), "--model", str(folder), "--out", str(out)]) == 2
    assert "not both" in capsys.readouterr().err


def test_both_pages_number_layers_as_cwcore_does_when_a_middle_layer_is_not_decomposed():
    """The pages' layer axis holds the decomposable layers only. Before, the explorer page labelled them by
    position: with layer 1 of 0..2 undecomposable, "layer 1" showed layer 2's numbers, layer 2 was refused as
    out of range, and -2 meant another layer on the long page than everywhere else."""
    import pytest
    from cwcore.core.architectures import attention_blocks, forget_model
    from cwcore.explorer import explorer_data, explorer_html

    model, tokenizer = tiny_model("llama", num_layers=3), tiny_tokenizer()
    try:
        attention_blocks(model)[1].unsupported = "a reason measured elsewhere"
        with pytest.warns(UserWarning, match="layer 1"):
            data = explorer_data(model, tokenizer, TEXT)
        assert data["meta"]["layer_numbers"] == [0, 2] and data["meta"]["undecomposable"] == {
            "1": "a reason measured elsewhere"}
        ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
        with pytest.warns(UserWarning):
            d = cwcore.decompose(model, input_ids=ids)
        page = read_payload(explorer_html(data, start={"layer": 2}))
        position = page["meta"]["start"]["layer"]
        np.testing.assert_allclose(np.nan_to_num(page["arrays"]["attention"][position]), d[2].attention[0].numpy(),
                                   rtol=2e-3, atol=1e-6)
        assert read_payload(explorer_html(data, start={"layer": -1}))["meta"]["start"]["layer"] == position
        for layer in (1, -2):  # -2 is layer 1 here, as d[-2] is
            with pytest.raises(ValueError, match="^layer 1 cannot be decomposed: a reason measured elsewhere$"):
                explorer_html(data, start={"layer": layer})
        with pytest.warns(UserWarning):
            long = long_explorer_data(model, tokenizer, TEXT, top_k=2)
        assert long["meta"]["layers"] == [0, 2]
        assert read_payload(long_explorer_html(long, layer=-1))["meta"]["start"]["layer"] == 1  # layer 2
        with pytest.raises(ValueError, match="^layer 1 cannot be decomposed"):
            long_explorer_html(long, layer=-2)
    finally:
        forget_model(model)
