"""Per-layer interventions: remove a metric's terms in one layer at a time, :func:`per_layer_curve`.

Each intervened forward for layer l starts from the clean residual stream entering decoder layer l:
the clean pass records every decoder layer's output (a forward hook), and while layer l is intervened
the decoder layers before it return their recorded clean output instead of computing (their
``forward`` is replaced for that call only). Layers l..L-1, the final norm and the head run as usual,
so layer l costs about (L - l) / L of a forward (plus the embedding and the head) and a sweep over all
L layers about (L + 1) / 2 forwards per (metric, mode, ratio) point instead of L.

The decoder layers are found generically (:func:`decoder_layers`): the ``nn.ModuleList`` whose
elements each hold exactly one of the model's attention blocks, in order. With an empty mask the
skipped forward is bit-identical to a full forward (tested), and layer l's result is that of a full
forward with ``layers=[l]`` (tested against :func:`~cwcore.faithfulness.faithfulness_curve`).
Scores come from the clean run (``scores="clean"``); the rest of the protocol is :class:`Protocol`'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Sequence

import pandas as pd
from torch import nn

from ..core.architectures import attention_blocks, input_device
from ..core.thread_state import holding
from ..core.inputs import check_layers, check_sweep_arguments, check_texts, check_token_sequences, own_options
from .lm import DEFAULT_MAX_LENGTH, _documents, _lm_scorer, _lm_sequences, pad_id
from .protocol import (Protocol, as_protocol, modes as parse_modes, ratios as parse_ratios, refuse_removed,
                       refuse_unknown, specs as parse_specs)
from .methods.registry import check_precomputed_fit
from .ranking import removal_mask
from .summary import aopc
from ..runs import bars_off, shard_map
from .sweep import Sweep, canonical_order, pad_batch, piece_store

__all__ = ["decoder_layers", "skip_to", "per_layer_curve", "per_layer_aopc", "forward_equivalents"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of decoder layers: each element holds exactly one attention block, in the
    order of :func:`cwcore.core.architectures.attention_blocks`."""
    blocks = [b.module for b in attention_blocks(model)]
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) != len(blocks):
            continue
        held = []
        for element in module:
            inside = [i for i, b in enumerate(blocks) if any(m is b for m in element.modules())]
            held.append(inside)
        if all(h == [i] for i, h in enumerate(held)):
            return module
    raise ValueError("cannot find the decoder layers: no ModuleList holds one attention block per element")


@contextmanager
def skip_to(layers: nn.ModuleList, start: int, outputs: Sequence):
    """Inside the block, decoder layers ``< start`` return ``outputs[i]`` (their recorded clean output)
    instead of computing."""
    saved = []
    try:
        for i in range(start):
            layer = layers[i]
            saved.append((layer, layer.__dict__.get("forward")))
            layer.forward = (lambda out: (lambda *args, **kwargs: out))(outputs[i])
        yield
    finally:
        for layer, original in saved:
            if original is None:
                del layer.forward
            else:
                layer.forward = original


def _record_outputs(layers: nn.ModuleList):
    outputs: list = [None] * len(layers)
    handles = [layer.register_forward_hook(lambda mod, args, out, i=i: outputs.__setitem__(i, out))
               for i, layer in enumerate(layers)]
    return outputs, handles


def forward_equivalents(num_layers: int, layers: Iterable[int] | None = None) -> float:
    """Decoder-layer work of a per-layer sweep over ``layers`` (default all), in full forwards per point:
    sum of (L - l) / L (embedding and head not counted)."""
    chosen = range(num_layers) if layers is None else list(layers)
    return float(sum((num_layers - l) / num_layers for l in chosen))


class _PointsOfBatches:
    """:func:`cwcore.runs.shard_map`'s progress, counted in batches, on the sweep's bar, counted in
    (metric, mode, ratio) points: each finished batch moves it by its points."""

    def __init__(self, bar, points: int):
        self.bar, self.points = bar, points

    def update(self, batches: int = 1) -> None:
        self.bar.update(batches * self.points)


def per_layer_curve(model: nn.Module, tokenizer, texts, metric=None, ratios=None, mode=None, *,
                    layers: Iterable[int] | None = None, protocol: Protocol | None = None, batch_size: int = 16,
                    max_length: int | None = DEFAULT_MAX_LENGTH, padding_side: str = "right", progress: bool = False,
                    **protocol_keywords) -> pd.DataFrame:
    """Per-sequence table like :func:`~cwcore.faithfulness.faithfulness_curve` (its ``.per_sequence`` table)
    with a ``layer`` column: each row's terms were removed in that one layer only. ``layers``: which
    layers to intervene in (default all); every layer is ranked as under the full protocol.
    Inside :func:`cwcore.cache.caching` each batch's rows are stored in the result cache (namespace ``faithfulness-per-layer``,
    named by the batch's content), so an interrupted run resumes and a longer one reuses its batches.
    ``protocol`` (or its fields as keywords, as in ``faithfulness_curve``): clean scores and all layers
    ranked (``layers`` here picks where to intervene), so ``scores="live"`` or ``protocol.layers`` are refused."""
    refuse_removed("per_layer_curve", protocol_keywords, ("cache", "cache_dir"))
    refuse_unknown("per_layer_curve", protocol_keywords, own_options(per_layer_curve))
    check_sweep_arguments(model, caller="per_layer_curve", metric=metric, ratios=ratios, mode=mode, layers=layers,
                          batch_size=batch_size, padding_side=padding_side)
    protocol = as_protocol(protocol, **protocol_keywords)
    if protocol.scores != "clean" or protocol.layers is not None:
        raise ValueError("per-layer interventions rank on clean scores in every layer: use scores='clean', "
                         "layers=None in the protocol (the layers argument picks where to intervene)")
    if protocol.removal != "zero":
        raise ValueError(f"per_layer_curve removes terms by zeroing only, not removal={protocol.removal!r}: "
                         "use faithfulness_curve for an in-distribution removal")
    kind, seed, scope = protocol.kind, protocol.seed, protocol.scope
    specs, modes, ratio_list = parse_specs(metric, kind), parse_modes(mode), parse_ratios(ratios)
    sequences = check_token_sequences(_lm_sequences(check_texts(texts, "per_layer_curve"), tokenizer, max_length,
                                                    "per_layer_curve"),
                                      model, caller="per_layer_curve", min_length=2)
    check_precomputed_fit(specs, sequences, len(attention_blocks(model)))
    documents = _documents(texts, list(range(len(sequences))))
    pad = pad_id(tokenizer)
    stack = decoder_layers(model)
    n_layers = len(stack)
    chosen = check_layers(layers, n_layers, allow_empty=False)
    device = input_device(model)
    batches = [pad_batch(i // batch_size, sequences[i:i + batch_size],
                         list(range(i, min(i + batch_size, len(sequences)))), pad, padding_side, device=device)
               for i in range(0, len(sequences), batch_size)]
    store = piece_store("faithfulness-per-layer", {
        **protocol.columns(), "kind": kind, "seed": seed, "layers": chosen, "metrics": [sp.label for sp in specs],
        "metric_keys": [sp.piece_key for sp in specs],  # what each metric is, not only its label
        "modes": list(modes), "ratios": [float(r) for r in ratio_list],
        "max_length": None if max_length is None else int(max_length),
        "padding_side": padding_side}, model)
    sweep = Sweep(model, specs, modes, ratio_list, protocol, None, progress, len(batches))
    layer_scope = scope == "layer"

    def layer_scorer(batch, candidates, layer):
        """Rows of ``layer``'s interventions: its own candidate terms (each row removes terms in that layer only;
        the sum over the layers made ``n_removed / n_candidates`` the layer count times too small)."""
        return _lm_scorer({batch.index: candidates[layer].sum((1, 2, 3)).long() * sweep.heads[layer]})

    def one(batch) -> pd.DataFrame:
        """Every (layer, metric, mode, ratio) row of one batch, read from the store or computed."""
        stored = None if store is None else store.get_group(f"{batch.digest}-per-layer")
        if stored is not None:
            return stored["rows"]
        # the recording hooks and the frozen layers are the model's for the whole batch: another thread's cwcore
        # call on the same model waits (it saw them: wrong numbers, layers reported missing)
        with holding(model):
            return computed(batch)

    def computed(batch) -> pd.DataFrame:
        frames = []
        candidates = sweep.candidates(batch)
        outputs, handles = _record_outputs(stack)
        try:
            logits, buckets, _ = sweep.clean_pass(batch, specs, candidates)
        finally:
            for h in handles:
                h.remove()
        nothing = batch.input_ids.new_zeros(batch.input_ids.shape[0])
        scorers = {layer: layer_scorer(batch, candidates, layer) for layer in chosen}
        cleans = {layer: scorers[layer](logits, batch, nothing) for layer in chosen}
        del logits
        for layer in chosen:
            clean, scorer = cleans[layer], scorers[layer]
            for spec in specs:
                for m in modes:
                    for ratio in ratio_list:
                        if ratio == 0:
                            frame = clean.copy()
                        else:
                            t = sweep.nonzero.index(ratio)
                            bucket = buckets[spec.label][layer][m]
                            mask = removal_mask(bucket, t, candidates[layer] if layer_scope else None)
                            # a mask shared by the heads ([b, 1, q, k]) removes the term from each head
                            removed = mask.flatten(1).sum(-1).long() * (sweep.heads[layer] // mask.shape[1])
                            with skip_to(stack, layer, outputs):
                                logits = sweep._forward(batch, {layer: mask})
                            frame = scorer(logits, batch, removed)
                        frames.append(frame.assign(metric=spec.label, kind=spec.kind, mode=m, ratio=ratio,
                                                   layer=layer, clean_nll=clean["nll"].to_numpy()))
        rows = pd.concat(frames, ignore_index=True)
        if store is not None:
            store.put_group(f"{batch.digest}-per-layer", {"rows": rows})
        return rows

    try:  # split over ranks when there are any (cwcore.runs.shard_map); the order stays the batches'
        points = _PointsOfBatches(sweep.bar, len(specs) * len(modes) * len(ratio_list))
        with bars_off(not progress):  # the methods' bars too
            frames = shard_map(batches, one, progress=points)
    finally:
        sweep.close()
    table = pd.concat(frames, ignore_index=True)
    table = pd.concat([canonical_order(g, specs, modes, "sequence") for _, g in table.groupby("layer", sort=True)],
                      ignore_index=True)
    table["document"] = table["sequence"].map(dict(enumerate(documents)))
    for key, value in protocol.columns().items():
        if key != "layers":
            table[key] = value
    return table


def per_layer_aopc(per_layer: pd.DataFrame, n_bootstrap: int = 1000, seed: int = 0,
                   max_ratio: float | None = None) -> pd.DataFrame:
    """:func:`~cwcore.faithfulness.aopc` of each layer's curves (column ``layer``), intervals over documents."""
    parts = [aopc(g.drop(columns="layer").assign(layers=str(layer)), n_bootstrap=n_bootstrap, seed=seed,
                  max_ratio=max_ratio).assign(layer=layer)
             for layer, g in per_layer.groupby("layer", sort=True)]
    return pd.concat(parts, ignore_index=True)
