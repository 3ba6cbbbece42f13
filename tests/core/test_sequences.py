"""Positions, masks and sequences: cwcore never substitutes a model's positions, and applies each mask to the
attention call and sequence it belongs to, never to another sequence of the same length.

References are the model's own eager runs on the same inputs, padded or not.
"""

from __future__ import annotations

import pytest
import torch

import cwcore
from cwcore.core.architectures import attention_blocks
from cwcore.core.decomposition import prepare_inputs
from zoo_models import VOCAB, bart, qwen2_vl, qwen2_vl_inputs, qwen2_vl_row

ATOL = 1e-5


# ---- left padding on a model with absolute positions --------------------------------------------------------
def test_left_padding_counts_real_tokens_unless_the_caller_gives_positions():
    """GPT-2 adds a learned embedding per position, so left padding moves every real token's position unless
    position ids count real tokens (as ``generate`` does). Without ``position_ids`` the padded row must equal its
    unpadded sequence; with the caller's own ``position_ids`` (here 0..n-1, counting the padding) the run must
    be exactly ``model(**enc, position_ids=...)``: cwcore keeps what it is given. The control: the two runs
    differ, so the test could tell them apart."""
    from tiny_models import VOCAB as TINY_VOCAB, tiny_model

    model = tiny_model("gpt2")
    ids = torch.randint(0, TINY_VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    own = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        alone = model(input_ids=ids[1:, 3:]).logits[0]
        counting_padding = model(input_ids=ids, attention_mask=mask, position_ids=own).logits[1, 3:]
    assert (alone - counting_padding).abs().max() > 1e-2  # the control
    d = cwcore.decompose(model, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(d.outputs.logits[1, 3:], alone, rtol=0, atol=1e-5)
    given = cwcore.decompose(model, input_ids=ids, attention_mask=mask, position_ids=own)
    torch.testing.assert_close(given.outputs.logits[1, 3:], counting_padding, rtol=0, atol=1e-5)
    s = cwcore.summarize(model, input_ids=ids, attention_mask=mask, position_ids=own, layers=[1])
    torch.testing.assert_close(s.outputs.logits[1, 3:], counting_padding, rtol=0, atol=1e-5)
    torch.testing.assert_close(s[1].row(-1), given[1].inter[:, :, -1], rtol=1e-5, atol=1e-6)


def test_a_row_with_a_hole_in_its_mask_keeps_its_numbers_beside_a_left_padded_row():
    """A row whose first token is real but whose mask has a hole is numbered 0..n-1 alone (the model's own
    positions: nothing is left-padded). Beside a left-padded row it must keep those positions, and so its
    numbers: before, the whole batch was renumbered by counting real tokens, so that row's positions and every
    one of its contributions changed with the row next to it. The control: renumbering that row (as before)
    changes its logits, so the test can tell the two apart."""
    from tiny_models import VOCAB as TINY_VOCAB, tiny_model

    model = tiny_model("gpt2")
    ids = torch.randint(0, TINY_VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    hole = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1])
    padded = torch.tensor([0, 0, 1, 1, 1, 1, 1, 1])
    real = hole.bool()
    with torch.no_grad():
        renumbered = model(input_ids=ids[:1], attention_mask=hole[None],
                           position_ids=(hole.cumsum(-1) - 1).clamp_min(0)[None]).logits[0, real]
    alone = cwcore.decompose(model, input_ids=ids[:1], attention_mask=hole[None])
    beside = cwcore.decompose(model, input_ids=ids, attention_mask=torch.stack([hole, padded]))
    assert (alone.outputs.logits[0, real] - renumbered).abs().max() > 1e-2  # the control
    torch.testing.assert_close(beside.outputs.logits[0, real], alone.outputs.logits[0, real], rtol=0, atol=1e-5)
    for layer in range(len(attention_blocks(model))):
        got, expected = beside[layer].contribution("inter")[0], alone[layer].contribution("inter")[0]
        torch.testing.assert_close(got[:, real][:, :, real], expected[:, real][:, :, real], rtol=0, atol=1e-5)
    with torch.no_grad():  # and the left-padded row still equals its unpadded sequence
        unpadded = model(input_ids=ids[1:, 2:]).logits[0]
    torch.testing.assert_close(beside.outputs.logits[1, 2:], unpadded, rtol=0, atol=1e-5)


# ---- multimodal positions: the model's own, never cwcore's --------------------------------------------------
def test_multimodal_positions_are_the_models_own_on_a_left_padded_batch():
    """Qwen2-VL computes ``[3, batch, sequence]`` positions for its image tokens from the mask itself; cwcore's
    plain 2-D positions would replace them (logits off, silently). The padded row must equal the model's own
    forward on the same inputs and the row alone."""
    model, row = qwen2_vl(), qwen2_vl_row()
    pad = 3
    alone, padded = qwen2_vl_inputs(row), qwen2_vl_inputs(row, pad=pad)
    assert "position_ids" not in prepare_inputs(model, padded)  # with an image, the model numbers positions
    text_only = dict(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"])
    assert "position_ids" in prepare_inputs(model, text_only)  # text only: plain positions, expanded by the model
    with torch.no_grad():
        own_alone = model(**alone).logits
        own_padded = model(**padded).logits
    torch.testing.assert_close(own_padded[:, pad:], own_alone, rtol=0, atol=ATOL)  # the model handles padding
    d_alone, d_padded = cwcore.decompose(model, **alone), cwcore.decompose(model, **padded)
    torch.testing.assert_close(d_padded.outputs.logits, own_padded, rtol=0, atol=1e-6)  # what the model computes
    torch.testing.assert_close(d_alone.outputs.logits, own_alone, rtol=0, atol=1e-6)
    for layer in (2, 3):  # the language layers (0, 1: the vision tower)
        for field in ("attention", "inter", "intra"):
            torch.testing.assert_close(getattr(d_padded[layer], field)[:, :, pad:, pad:], getattr(d_alone[layer], field),
                                       rtol=1e-4, atol=ATOL, msg=lambda m: f"layer {layer} {field}: {m}")
        assert d_padded[layer].inter[0, :, :pad].isnan().all()  # padded queries are not tokens


# ---- masks keyed to the call, not to a length -----------------------------------------------------------
def test_a_text_as_long_as_the_image_patches_keeps_its_mask_off_the_vision_tower():
    """16 image patches, and a left-padded text of 16 tokens: the text's padding must not be applied to the
    vision tower's keys and queries (a refusal 'terms do not reproduce' before)."""
    model, row = qwen2_vl(), qwen2_vl_row()
    padded = qwen2_vl_inputs(row, pad=16 - len(row["input_ids"]))
    assert padded["input_ids"].shape[1] == row["pixel_values"].shape[0] == 16
    with torch.no_grad():
        eager = model(**padded, output_attentions=True)
    d = cwcore.decompose(model, **padded)
    torch.testing.assert_close(d.outputs.logits, eager.logits, rtol=0, atol=1e-6)
    for layer in (0, 1):  # the vision tower: every patch is a real token
        assert not d[layer].inter.isnan().any()
        sums = d[layer].inter.sum((1, 3))
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4)
    pad = 16 - len(row["input_ids"])
    for layer, eager_map in zip((2, 3), eager.attentions):  # padded query rows are NaN by design
        torch.testing.assert_close(d.attention[layer][:, :, pad:], eager_map[:, :, pad:], rtol=0, atol=1e-6)
        assert d[layer].inter[0, :, :pad].isnan().all()


@pytest.mark.parametrize("decoder_length", [9, 10])
def test_an_encoder_decoder_with_equal_lengths_keeps_the_encoder_mask_on_the_encoder(decoder_length):
    """Encoder and decoder of 9 tokens, the encoder padded: its padding must mask encoder keys only, never
    decoder queries (cross-attention gave NaN for exactly the padded count of real decoder tokens)."""
    model = bart()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:], ids[1, 6:] = 0, 1
    inputs = dict(input_ids=ids, attention_mask=mask,
                  decoder_input_ids=torch.randint(3, VOCAB, (2, decoder_length), generator=generator))
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    d = cwcore.decompose(model, **inputs)
    assert [d[layer].block_name.split(".")[-1] for layer in d.layers] == [
        "self_attn", "self_attn", "self_attn", "encoder_attn", "self_attn", "encoder_attn"]
    torch.testing.assert_close(d.outputs.last_hidden_state, eager.last_hidden_state, rtol=0, atol=1e-6)
    maps = [*eager.encoder_attentions, eager.decoder_attentions[0], eager.cross_attentions[0],
            eager.decoder_attentions[1], eager.cross_attentions[1]]
    for layer, eager_map in zip(d.layers, maps):
        real = slice(None) if layer >= 2 else slice(0, 6)  # the encoder's padded query rows are NaN by design
        torch.testing.assert_close(d.attention[layer][:, :, real], eager_map[:, :, real], rtol=0, atol=1e-6)
        if layer < 2:  # encoder: padded queries NaN, real ones sum to one
            assert d[layer].inter[1, :, 6:].isnan().all() and not d[layer].inter[1, :, :6].isnan().any()
        else:  # decoder: every query is a real token
            assert not d[layer].inter.isnan().any(), f"layer {layer}: NaN rows for real decoder tokens"
            sums = d[layer].inter.sum((1, 3))
            torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4)
        if d[layer].block_name.endswith("encoder_attn"):  # padded encoder keys weigh nothing
            assert (d.attention[layer][1, :, :, 6:] == 0).all()
            assert d[layer].value_norm[1, :, 6:].isnan().all()


def test_padded_decoder_tokens_are_padded_queries_of_cross_attention_too():
    """A right-padded decoder (``decoder_attention_mask``): its padded tokens are padded query rows in the
    decoder's self-attention *and* in its cross-attention (NaN by the decomposition's convention), whose own
    mask describes the encoder's keys only; every real row is the eager model's."""
    model = bart()
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 7), generator=generator)
    decoder_ids = torch.randint(3, VOCAB, (2, 8), generator=generator)
    decoder_mask = torch.ones(2, 8, dtype=torch.long)
    decoder_mask[1, 5:], decoder_ids[1, 5:] = 0, 1
    inputs = dict(input_ids=ids, decoder_input_ids=decoder_ids, decoder_attention_mask=decoder_mask)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    d = cwcore.decompose(model, **inputs)
    cross = [layer for layer in d.layers if d[layer].block_name.endswith("encoder_attn")]
    assert cross == [3, 5]
    for layer, eager_map in zip(cross, eager.cross_attentions):
        assert d[layer].inter[1, :, 5:].isnan().all()  # padded decoder tokens
        assert not d[layer].inter[0].isnan().any() and not d[layer].inter[1, :, :5].isnan().any()
        torch.testing.assert_close(d.attention[layer][1, :, :5], eager_map[1, :, :5], rtol=0, atol=1e-6)
        sums = d[layer].inter[1, :, :5].sum((0, 2))
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4)
    # the control: the same tokens without the decoder's mask are all real rows
    unmasked = cwcore.decompose(model, input_ids=ids, decoder_input_ids=decoder_ids)
    assert not unmasked[3].inter.isnan().any()


# ---- relative position bias (T5's position_bias): additive on the scores ---------------------------------
@pytest.mark.parametrize("family", ["t5", "umt5"])
def test_relative_position_bias_is_exact_against_the_eager_run(family):
    """T5 and UMT5 pass their relative position bias to attention as ``position_bias`` (refused before); the
    decomposition must equal the eager maps and outputs, on a padded encoder batch with equal lengths, eager and
    SDPA-configured, whatever layers are asked."""
    from zoo_models import relative_bias_model

    model = relative_bias_model(family)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:], ids[1, 6:] = 0, 0
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(3, VOCAB, (2, 9), generator=generator))
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    maps = [*eager.encoder_attentions, eager.decoder_attentions[0], eager.cross_attentions[0],
            eager.decoder_attentions[1], eager.cross_attentions[1]]
    outputs = {}
    handles = [model.get_submodule(b.name).o.register_forward_hook(
        lambda module, args, out, layer=b.layer: outputs.__setitem__(layer, out.detach().clone()))
        for b in attention_blocks(model)]
    try:
        d = cwcore.decompose(model, **inputs)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(d.outputs.last_hidden_state, eager.last_hidden_state, rtol=0, atol=1e-6)
    for layer, eager_map in zip(d.layers, maps):
        real = slice(None) if layer >= 2 else slice(0, 6)  # the encoder's padded query rows are NaN by design
        for row in (0, 1):
            rows = slice(None) if row == 0 else real
            torch.testing.assert_close(d.attention[layer][row, :, rows], eager_map[row, :, rows], rtol=0, atol=1e-6)
            torch.testing.assert_close(d[layer].geometry.output[row, rows], outputs[layer][row, rows], rtol=1e-4,
                                       atol=1e-5)
        sums = d.inter[layer].sum((1, 3))[0]
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-4)
    sdpa = relative_bias_model(family)
    sdpa.set_attn_implementation("sdpa")
    for layers in ([0], [3], None):  # recorded layers blockwise, the others through SDPA with the bias
        chosen = cwcore.decompose(sdpa, layers=layers, **inputs)
        torch.testing.assert_close(chosen.outputs.last_hidden_state, eager.last_hidden_state, rtol=1e-4, atol=1e-5)
        for layer in chosen.layers:
            torch.testing.assert_close(chosen.attention[layer], d.attention[layer], rtol=0, atol=1e-6, equal_nan=True)
