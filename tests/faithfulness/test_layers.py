"""Per-layer interventions: the skipped forward starts from the clean residual stream (bit-identical on
an empty mask), and layer l's rows are those of a full forward that intervenes in layer l only."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from cwcore import faithfulness as fa
from cwcore.cache import caching
from cwcore.faithfulness import layers as pl
from cwcore.faithfulness.sweep import pad_batch, Sweep
from cwcore.faithfulness.protocol import Protocol


def test_decoder_layers_are_found_generically(peaked):
    model, _ = peaked
    stack = pl.decoder_layers(model)
    assert stack is model.model.layers
    assert pl.forward_equivalents(2) == pytest.approx(1.5)
    assert pl.forward_equivalents(30) == pytest.approx(15.5)


def test_skipped_forward_is_bit_identical_on_an_empty_mask(peaked):
    model, ids = peaked
    stack = pl.decoder_layers(model)
    batch = pad_batch(0, ids[:4].tolist(), [0, 1, 2, 3], 0, "right")
    sweep = Sweep(model, [], ["comprehensiveness"], [0.5], Protocol(), None, False, 1)
    outputs, handles = pl._record_outputs(stack)
    full = sweep._forward(batch)
    for h in handles:
        h.remove()
    computed = []  # the layers whose attention really ran: a skip_to that skipped nothing gave the same output
    hooks = [layer.self_attn.register_forward_hook(lambda *_, i=i: computed.append(i)) for i, layer in enumerate(stack)]
    for start in range(len(stack) + 1):
        empty = torch.zeros(4, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
        computed.clear()
        with pl.skip_to(stack, start, outputs):
            skipped = sweep._forward(batch, {min(start, len(stack) - 1): empty})
        assert torch.equal(skipped, full)
        assert computed == list(range(start, len(stack))), (start, computed)  # layers before start never ran
    for h in hooks:
        h.remove()
    assert "forward" not in stack[0].__dict__  # restored


def test_per_layer_rows_equal_full_forwards_on_one_layer(peaked):
    model, ids = peaked
    kw = dict(batch_size=5)
    table = pl.per_layer_curve(model, None, ids, ["attention", "contribution", "random"], [0.2, 0.5], **kw)
    assert set(table["layer"]) == {0, 1}
    for layer in (0, 1):
        full = fa.faithfulness_curve(model, None, ids, ["attention", "contribution", "random"], [0.2, 0.5],
                                     layers=[layer], progress=False, **kw).per_sequence
        mine = table[table.layer == layer].reset_index(drop=True)
        # n_candidates too: each row removes terms of one layer (it counted every layer's, twice too many here)
        for column in ("sequence", "metric", "mode", "ratio", "nll", "clean_nll", "n_removed", "n_candidates"):
            pd.testing.assert_series_equal(mine[column], full[column], check_dtype=False)
    areas = pl.per_layer_aopc(table, n_bootstrap=100)
    assert set(areas["layer"]) == {0, 1} and (areas["n_documents"] == len(ids)).all()


def test_per_layer_rows_are_cached_per_batch_and_a_longer_run_reuses_them(peaked, tmp_path, monkeypatch):
    model, ids = peaked
    kw = dict(batch_size=5, seed=3)
    metrics, ratios = ["attention", "contribution", "random"], [0.2, 0.5]
    fresh = pl.per_layer_curve(model, None, ids, metrics, ratios, **kw)  # outside caching(): nothing stored
    with caching(tmp_path):
        first = pl.per_layer_curve(model, None, ids[:5], metrics, ratios, **kw)  # one batch, stored
    forwards = []
    original = Sweep._forward
    monkeypatch.setattr(Sweep, "_forward", lambda self, *a, **k: forwards.append(1) or original(self, *a, **k))
    with caching(tmp_path):
        longer = pl.per_layer_curve(model, None, ids, metrics, ratios, **kw)  # first batch read back
    pd.testing.assert_frame_equal(longer, fresh)
    pd.testing.assert_frame_equal(longer[longer["sequence"] < 5].reset_index(drop=True),
                                  first.reset_index(drop=True))
    n_batches = -(-len(ids) // 5)
    per_batch = 1 + 2 * len(metrics) * len(ratios) * 2  # clean pass + layers x metrics x modes x ratios
    assert len(forwards) == (n_batches - 1) * per_batch
    forwards.clear()
    with caching(tmp_path):
        again = pl.per_layer_curve(model, None, ids, metrics, ratios, **kw)
    pd.testing.assert_frame_equal(again, fresh)
    assert forwards == []  # everything read from the cache
