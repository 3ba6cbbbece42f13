"""The book's chapter modules (cwbook.chapters) on a user's own small model: the parameters a rerun passes are
honoured or refused in one line, never wrapped or ignored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cwcore
from cwbook.chapters import ch03_contribution_maps as ch03
from cwcore.cli import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parent / "faithfulness"))
from faith_helpers import peaked_llama, word_tokenizer  # noqa: E402

TEXT = "the cat sat on the mat and the dog ran away"


def test_a_layer_or_head_out_of_range_is_refused_not_wrapped():
    """layer=5 of a 2-layer model showed layer 1 and head=9 of 4 heads showed head 1 (taken modulo the count),
    while the prose said "the head set by the `head` parameter"."""
    model, tokenizer = peaked_llama(), word_tokenizer()
    layers = len(cwcore.decompose(model, **tokenizer(TEXT, return_tensors="pt")).layers)
    for layer, head in ((layers, None), (-layers - 1, None), (0, 4), (0, -5)):
        with pytest.raises(UsageError, match="layer=|head="):
            ch03.sentence_maps(model, tokenizer, TEXT, layer, head, 5, "tiny")
    maps = ch03.sentence_maps(model, tokenizer, TEXT, -1, -1, 5, "tiny")  # from the end, as Python counts
    assert (maps.layer_shown, maps.head_shown) == (layers - 1, 3)
