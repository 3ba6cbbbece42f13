"""The zoo: every family in tests/zoo_models.py is decomposed exactly or refused, never wrong.

Exact means, row by row against the model's own unpadded eager run (``output_attentions=True``):
the model's outputs are unchanged; o_i + b equals what the output projection really returned, and
each head's o^h_i equals the projection applied to that head's slice of its real input (both
captured by hooks on the module the model calls, named in the zoo independently of cwcore's
registry); the attention equals the eager maps; inter weights sum to one over (head, key), intra
weights over keys; and a padded batch row (left padding for decoders, right for encoders) equals
the same sequence decomposed alone, unpadded. Refused means an ``UnsupportedModelError`` with the
expected message, from ``decompose`` and from ``intervene``.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import cwcore
from cwcore.core.architectures import attention_blocks, decomposable_layers
from cwcore.core.attention import cwcore_attention
from zoo_models import SEQ, VOCAB, ZOO, projection_of, zoo_model

ATOL_OUT = 1e-6  # the model's own outputs: the same arithmetic as eager
ATOL, RTOL = 1e-5, 1e-4  # sums of tens of float32 terms in another order
SUM_ATOL = 1e-4

# Families the engine does not (yet) get right. Each entry is the exact failure measured; the lead
# removes it when cwcore/core is fixed (strict: a fixed family makes the xfail fail, as a reminder).
KNOWN_FAILURES: dict[tuple[str, str], str] = {
}


def _params(test: str, names):
    out = []
    for name in names:
        reason = KNOWN_FAILURES.get((test, name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def _inputs(species, batch=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    if species.kind == "vision":
        return dict(pixel_values=torch.randn(batch, 3, 16, 16, generator=generator))
    return dict(input_ids=torch.randint(2, VOCAB, (batch, SEQ), generator=generator))


def _first_output(outputs):
    return outputs.logits if getattr(outputs, "logits", None) is not None else outputs.last_hidden_state


class _Projections:
    """Hooks on each block's real output projection: its input and output in every forward."""

    def __init__(self, model, species):
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.modules = {}
        self._handles = []
        for block in attention_blocks(model):
            if block.unsupported is not None:
                continue
            module = projection_of(block.module, block.parent, species.projection)
            self.modules[block.layer] = module
            self._handles.append(module.register_forward_hook(self._hook(block.layer)))

    def _hook(self, layer):
        def hook(module, args, output):
            self.seen[layer] = (args[0].detach().clone(), output.detach().clone())
        return hook

    def head_outputs(self, layer, heads):
        """o^h_i = W_O^h z^h_i from the projection's real input: the projection of head h's slice alone."""
        received, _ = self.seen[layer]
        module = self.modules[layer]
        with torch.no_grad():
            zero = module(torch.zeros_like(received[..., :1, :]))
            out = []
            for h, part in enumerate(received.chunk(heads, -1)):
                alone = torch.zeros_like(received)
                alone[..., h * part.shape[-1]:(h + 1) * part.shape[-1]] = part
                out.append(module(alone) - zero)
        return torch.stack(out, 1)  # [batch, head, query, model]

    def close(self):
        for handle in self._handles:
            handle.remove()


def test_the_zoo_has_at_least_20_families_of_every_kind():
    kinds = {s.kind for s in ZOO.values()}
    assert len(ZOO) >= 20 and kinds == {"decoder", "encoder", "vision"}
    assert any(s.refused for s in ZOO.values()) and sum(not s.refused for s in ZOO.values()) >= 20


EXACT = [name for name, s in ZOO.items() if s.refused is None]
REFUSED = [name for name, s in ZOO.items() if s.refused is not None]
PADDED = [name for name in EXACT if ZOO[name].kind != "vision"]


@pytest.mark.parametrize("name", _params("exact", EXACT))
def test_decomposition_is_exact_against_the_eager_run(name):
    species, model = ZOO[name], zoo_model(name)
    inputs = _inputs(species)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    eager_maps = [a for a in eager.attentions if a is not None]  # hybrids: softmax layers only
    decomposable = [layer for layer in range(species.blocks) if layer not in species.undecomposable]
    assert len(eager_maps) == len(decomposable)
    hooks = _Projections(model, species)
    listed = pytest.warns(UserWarning, match="is not decomposed") if species.undecomposable else contextlib.nullcontext()
    try:
        with listed:  # a block cwcore numbers but cannot decompose is named before the forward, never dropped
            d = cwcore.decompose(model, **inputs)
    finally:
        hooks.close()
    assert d.layers == decomposable  # exactly the softmax layers, in order
    assert sorted(d.undecomposable) == list(species.undecomposable)
    if species.layers is not None:  # hybrids: the blocks say which decoder layers they are
        names = [block.name for block in attention_blocks(model)]
        assert [int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in names] == list(species.layers), names
    reference = _first_output(eager)
    torch.testing.assert_close(_first_output(d.outputs), reference, rtol=0, atol=ATOL_OUT)
    for index, layer in enumerate(d.layers):
        ld = d[layer]
        heads = ld.attention.shape[1]
        torch.testing.assert_close(ld.attention, eager_maps[index].float(), rtol=0, atol=1e-6)
        _, returned = hooks.seen[layer]
        bias = 0 if ld.output_bias is None else ld.output_bias
        torch.testing.assert_close(ld.geometry.output + bias, returned, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ld.output_norm, (returned - bias).norm(dim=-1), rtol=RTOL, atol=ATOL)
        head_outputs = hooks.head_outputs(layer, heads)
        torch.testing.assert_close(ld.head_output_norm, head_outputs.norm(dim=-1), rtol=RTOL, atol=ATOL)
        inter = ld.inter.sum((1, 3))
        torch.testing.assert_close(inter, torch.ones_like(inter), rtol=0, atol=SUM_ATOL)
        intra = ld.intra.sum(-1)
        torch.testing.assert_close(intra, torch.ones_like(intra), rtol=0, atol=SUM_ATOL)


# Families loaded with SDPA (transformers' default) in the test below; clip_text is the case where only the call's
# `is_causal` says that attention is causal
SDPA = ["clip_text", "llama", "gemma3", "gpt2", "bert", "vit"]


@pytest.mark.parametrize("name", _params("sdpa-one-layer", SDPA))
def test_one_layer_of_an_sdpa_model_is_exact_against_the_eager_run(name):
    """With one layer recorded, the others run SDPA, whose masks leave a plain causal pattern to the call (None):
    the recorded layer must still equal the eager maps, and the outputs the eager run's."""
    species, model = ZOO[name], ZOO[name].build()  # not the cached model: its attention implementation changes
    inputs = _inputs(species)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    for layer, eager_map in enumerate(eager.attentions):
        d = cwcore.decompose(model, layers=layer, **inputs)
        assert d.layers == [layer]
        torch.testing.assert_close(d.attention[layer], eager_map.float(), rtol=0, atol=1e-6)
        torch.testing.assert_close(_first_output(d.outputs), _first_output(eager), rtol=RTOL, atol=ATOL)


# Exact families whose transformers class refuses set_attn_implementation("sdpa") (no SDPA support to keep)
NO_SDPA = {"gemma2", "gpt_oss", "granite_swa"}


@pytest.mark.parametrize("name", _params("sdpa-every-layer", EXACT))
def test_an_sdpa_model_keeps_its_own_forward_and_one_answer_per_layer(name):
    """Configured for SDPA, every layer observed (layers=None): each observed layer returns the model's own SDPA
    output (its decomposition checked against it), so the forward is the model's own SDPA forward bit for bit, and
    the last layer's numbers equal those of layers=[-1]: the same answer whatever ``layers`` asks."""
    species, model = ZOO[name], ZOO[name].build()  # not the cached model: its attention implementation changes
    if name in NO_SDPA:
        with pytest.raises(ValueError, match="does not support an attention implementation through"):
            model.set_attn_implementation("sdpa")
        return
    model.set_attn_implementation("sdpa")
    inputs = _inputs(species)
    with torch.no_grad():
        own = _first_output(model(**inputs))
    listed = pytest.warns(UserWarning, match="is not decomposed") if species.undecomposable else contextlib.nullcontext()
    with listed:
        everything = cwcore.decompose(model, **inputs)
    torch.testing.assert_close(_first_output(everything.outputs), own, rtol=0, atol=0)
    last = everything.layers[-1]
    alone = cwcore.decompose(model, layers=[last], **inputs)
    torch.testing.assert_close(_first_output(alone.outputs), own, rtol=0, atol=0)
    for field in ("attention", "inter", "intra"):
        torch.testing.assert_close(getattr(alone[last], field), getattr(everything[last], field), rtol=0, atol=0,
                                   equal_nan=True, msg=lambda m: f"{field}: {m}")


def _padded_batch(species, side):
    """Row 0: a full sequence; row 1: a 6-token sequence padded by 3 on ``side`` with the pad id."""
    ids = _inputs(species)["input_ids"]
    short = ids[1, :6]
    pad = torch.full((SEQ - 6,), species.pad_token, dtype=torch.long)
    row = torch.cat([pad, short]) if side == "left" else torch.cat([short, pad])
    valid = torch.cat([torch.zeros(SEQ - 6), torch.ones(6)]) if side == "left" else torch.cat(
        [torch.ones(6), torch.zeros(SEQ - 6)])
    mask = torch.stack([torch.ones(SEQ), valid]).long()
    return torch.stack([ids[0], row]), mask, ids[0], short, valid.bool()


def _padding_cases():
    cases = []
    for name in PADDED:
        side = "left" if ZOO[name].kind == "decoder" else "right"
        cases += [(name, side)]
    cases.append(("roberta", "left"))  # the case: offset positions under left padding
    out = []
    for name, side in cases:
        reason = KNOWN_FAILURES.get((f"padded-{side}", name))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(name, side, marks=marks, id=f"{name}-{side}"))
    return out


@pytest.mark.parametrize("name,side", _padding_cases())
def test_a_padded_row_equals_its_sequence_decomposed_alone(name, side):
    species, model = ZOO[name], zoo_model(name)
    ids, mask, full, short, valid = _padded_batch(species, side)
    batch = cwcore.decompose(model, input_ids=ids, attention_mask=mask)
    alone_full = cwcore.decompose(model, input_ids=full[None])
    alone_short = cwcore.decompose(model, input_ids=short[None])
    # the unpadded row is untouched by its padded neighbour
    torch.testing.assert_close(_first_output(batch.outputs)[0], _first_output(alone_full.outputs)[0],
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(_first_output(batch.outputs)[1][valid], _first_output(alone_short.outputs)[0],
                               rtol=RTOL, atol=ATOL)
    for layer in batch.layers:
        torch.testing.assert_close(batch.attention[layer][0], alone_full.attention[layer][0], rtol=RTOL, atol=ATOL)
        rows = batch[layer]
        for field in ("attention", "inter", "intra"):
            padded = getattr(rows, field)[1][:, valid][:, :, valid]
            torch.testing.assert_close(padded, getattr(alone_short[layer], field)[0], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"layer {layer} {field}: {m}")
        torch.testing.assert_close(rows.output_norm[1][valid], alone_short[layer].output_norm[0], rtol=RTOL, atol=ATOL)
        # padding never leaks: padded keys weigh exactly zero, padded queries are NaN
        assert (rows.attention[1][:, valid][:, :, ~valid] == 0).all()
        assert rows.inter[1][:, ~valid].isnan().all()


@pytest.mark.parametrize("name", _params("refused", REFUSED))
def test_unsupported_families_are_refused_with_the_reason(name):
    species, model = ZOO[name], zoo_model(name)
    inputs = _inputs(species)
    with torch.no_grad():
        before = _first_output(model(**inputs))
    with pytest.raises(cwcore.UnsupportedModelError, match=species.refused):
        cwcore.decompose(model, **inputs)
    with pytest.raises(cwcore.UnsupportedModelError, match=species.refused):
        with cwcore.intervene(model, {0: torch.zeros((), dtype=torch.bool)}), torch.no_grad():
            model(**inputs)
    with torch.no_grad():  # a refusal leaves the model as it was
        torch.testing.assert_close(_first_output(model(**inputs)), before, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(ZOO))
def test_entering_the_attention_context_never_changes_the_outputs(name):
    """With no session, cwcore's attention is the model's eager arithmetic: the same outputs, or a refusal (a
    keyword it does not implement), never different numbers."""
    species, model = ZOO[name], zoo_model(name)
    inputs = _inputs(species)
    with torch.no_grad():
        before = _first_output(model(**inputs))
        try:
            with cwcore_attention(model):
                inside = _first_output(model(**inputs))
        except cwcore.UnsupportedModelError as refusal:
            assert species.refused is not None and re.search(species.refused, str(refusal)), str(refusal)
            return
    torch.testing.assert_close(inside, before, rtol=0, atol=ATOL_OUT)


UNDECOMPOSABLE = [name for name, s in ZOO.items() if s.undecomposable]


@pytest.mark.parametrize("name", UNDECOMPOSABLE)
def test_a_block_that_cannot_be_decomposed_is_refused_by_name_when_asked_for(name):
    species, model = ZOO[name], zoo_model(name)
    inputs = _inputs(species)
    layer = species.undecomposable[-1]
    reason = r"cannot be decomposed: torch\.nn\.MultiheadAttention computes its attention inside torch"
    for asked in (layer, layer - species.blocks, [0, layer]):  # its number, counted from the end, in a list
        with pytest.raises(cwcore.UnsupportedModelError, match=reason):
            cwcore.decompose(model, layers=asked, **inputs)
    with pytest.raises(cwcore.UnsupportedModelError, match=reason):
        cwcore.intervene(model, {layer: torch.zeros((), dtype=torch.bool)}).__enter__()
    with pytest.warns(UserWarning):
        d = cwcore.decompose(model, **inputs)
    assert decomposable_layers(model) == d.layers == [n for n in range(species.blocks) if n != layer]
    for read in (lambda: d[layer], lambda: d[-1], lambda: d.inter[-1], lambda: d.attention[layer]):
        with pytest.raises(KeyError, match=r"^layer 2 cannot be decomposed: torch\.nn\.MultiheadAttention"):
            read()
    torch.testing.assert_close(d.inter[-2], d[species.blocks - 2].inter)  # negative numbers count all blocks
