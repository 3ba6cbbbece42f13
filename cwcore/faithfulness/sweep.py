"""The sweep engine: one clean pass per batch, then one forward per (metric, mode, ratio) point.

The clean pass runs the unmodified model with an *observer* on every intervened layer
(:class:`cwcore.core.attention.LayerCall`): it ranks the layer's terms by every metric and keeps
the selection buckets (:func:`~cwcore.faithfulness.ranking.selection`, one uint8 per term and
mode). Each point then runs with fixed boolean masks (``scores="clean"``) or with a mask callable
that ranks the live decomposition inside the intervened run (``scores="live"``). Pieces (the
clean frame, each point's frame) are cached per batch in a :class:`cwcore.runs.PieceStore` inside a
:func:`cwcore.cache.caching` block, named by the batch's content, so a rerun is free and an interrupted run resumes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import pandas as pd
import torch
from torch import nn

from ..core.architectures import UnsupportedModelError, attention_blocks, require_causal
from ..core.decomposition import METRICS, LayerDecomposition, prepare_inputs
from ..core.interventions import intervene, removal, value_sums
from ..cache import caching_enabled
from ..runs import PieceStore, shard_map, tensor_digest
from ..runs import bars_off, progress as progress_bar
from .methods import get_method, scoring
from .methods.registry import lm_logits
from .protocol import MetricSpec, Protocol, layer_windows, ranking_identity
from .ranking import candidate_mask, layer_heads, removal_mask, require_window, selection

__all__ = ["Batch", "Scorer", "Sweep", "pad_batch", "run_sweep", "canonical_order", "piece_store", "stand_ins",
           "sample_identity"]


@dataclass
class Batch:
    """One padded batch: ``input_ids``/``attention_mask`` ``[rows, length]`` plus what the scorer needs."""

    index: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    groups: torch.Tensor  # [rows] ids for the random control (sequence or example ids)
    meta: Any = None  # scorer-specific (downstream: the examples in the batch)
    digest: str = ""  # content hash: token ids, padding, group ids (and the scored choices)

    @property
    def positions(self) -> torch.Tensor:
        """``[rows, length]`` position of each token among its row's real tokens."""
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)


#: ``scorer(logits [rows, length, vocab], batch, removed [rows]) -> frame`` (one row per sequence/example)
Scorer = Callable[[torch.Tensor, Batch, torch.Tensor], pd.DataFrame]


def pad_batch(index, rows: list[list[int]], groups: list[int], pad: int, side: str, meta=None,
              device: torch.device | str | None = None) -> Batch:
    """Token id lists padded on ``side`` into one :class:`Batch` (its digest covers ``meta`` too), its
    tensors on ``device`` (the model's input device, :func:`cwcore.core.inputs.input_device`; default the CPU)."""
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    groups = torch.tensor(groups, dtype=torch.long)
    digest = tensor_digest(ids, mask, groups)
    if meta is not None:
        digest = hashlib.sha256((digest + repr(meta)).encode()).hexdigest()[:20]
    return Batch(index, ids.to(device), mask.to(device), groups.to(device), meta, digest)


class Sweep:
    """Runs every (metric, mode, ratio) point over batches, with a piece store and a progress bar."""

    def __init__(self, model, specs, modes, ratios, protocol: Protocol, store, progress, total_batches):
        self.model = model
        self.specs, self.modes, self.ratios, self.protocol = specs, modes, ratios, protocol
        self.store = store
        self.num_layers = len(attention_blocks(model))
        layers = range(self.num_layers) if protocol.layers is None else protocol.layers
        for layer in layers:
            if not 0 <= layer < self.num_layers:
                raise IndexError(f"layer {layer} out of range: the model has {self.num_layers} attention layers")
        self.layers = list(layers)
        self.windows = layer_windows(model, self.num_layers)
        self.heads = layer_heads(model, self.num_layers)  # as each layer computes them (pruned heads)
        self.nonzero = [r for r in ratios if r > 0]
        self.deduplicate = True
        #: ``{batch index: {layer: [rows, head, dim]}}``: the stand-in values of ``removal="mean"`` (:func:`stand_ins`)
        self.stand_ins: dict[int, dict[int, torch.Tensor]] = {}
        points = len(specs) * len(modes) * len(ratios)
        self.bar = progress_bar(total_batches * points, "faithfulness", "point", enabled=bool(progress), leave=False)

    # -- pieces ------------------------------------------------------------------------------------
    @staticmethod
    def _piece(batch: Batch, spec: MetricSpec | None = None, mode: str = "", ratio: float = 0.0) -> str:
        """Pieces are named by the batch's content digest, so a longer run reuses a shorter one's batches."""
        if spec is None:
            return f"{batch.digest}-clean"
        short = f"{ratio:.6g}"  # every digit where 6 do not give the ratio back: 0.3 and 0.3000001 are two pieces
        return f"{batch.digest}-{spec.piece_key}-{mode}-r{short if float(short) == ratio else repr(float(ratio))}"

    def _get(self, piece):
        return None if self.store is None else self.store.get(piece)

    def _put(self, piece, frame):
        if self.store is not None:
            self.store.put(piece, frame)

    def close(self):
        self.bar.close()

    # -- scores ------------------------------------------------------------------------------------
    def _ranked_method(self, spec: MetricSpec):
        """(method, kind) whose scores rank ``spec``: its own, or those of the rung it ranks as by
        construction under this protocol (:func:`~cwcore.faithfulness.protocol.ranking_identity`: rung 3
        is rung 2 divided by a norm constant within each ranked group), so that identical rankings tie
        exactly alike."""
        kind = spec.kind or self.protocol.kind  # a kind-less metric's context says the protocol's (a callable's)
        if spec.name in METRICS and spec.method is get_method(spec.name):
            rung, identity_kind = ranking_identity(spec.name, kind, self.protocol.unit, self.protocol.scope)
            if rung != spec.name:
                return get_method(rung), identity_kind or kind
        return spec.method, kind

    def _scores(self, layer_decomposition: LayerDecomposition, spec: MetricSpec, context, call=None) -> torch.Tensor:
        """``[batch, head, query, key]`` ranking scores of ``spec`` (|scores| for absolute importance)."""
        method, kind = self._ranked_method(spec)
        scores = context.scores(method, layer_decomposition, call, kind)
        return scores.abs() if context.importance == "absolute" else scores

    def _scoring(self, batch: Batch, specs, candidates):
        """The :func:`~cwcore.faithfulness.methods.scoring` context of one forward of ``batch``."""
        context = scoring(self.model, [s.method for s in specs], batch.input_ids, batch.attention_mask,
                          layers=self.layers, groups=batch.groups, candidates=candidates, kind=self.protocol.kind,
                          seed=self.protocol.seed)
        return context

    def _observed(self, specs) -> dict[int, list[MetricSpec]]:
        """``{layer: specs scored there}``: the intervened layers, and every earlier layer for methods that
        build state over layers (rollout)."""
        wanted = {layer: list(specs) for layer in self.layers}
        if self.layers:
            for layer in range(max(self.layers) + 1):
                if layer not in wanted:
                    chained = [s for s in specs if "earlier_layers" in s.method.needs]
                    if chained:
                        wanted[layer] = chained
        return dict(sorted(wanted.items()))

    def candidates(self, batch: Batch) -> dict[int, torch.Tensor]:
        """``{layer: [batch, 1, query, key]}`` candidate terms of every intervened layer."""
        return {
            layer: candidate_mask(batch.attention_mask, self.protocol.keep_first_token, self.windows[layer])
            for layer in self.layers
        }

    def _stand_in(self, batch: Batch, layer: int) -> torch.Tensor | None:
        """The stand-in values ``[rows, head, dim]`` of ``layer``'s removed terms in ``batch`` (None: zeroing)."""
        if self.protocol.removal == "zero":
            return None
        if batch.index not in self.stand_ins:
            raise RuntimeError(f"removal={self.protocol.removal!r} needs the stand-in values of batch {batch.index}: "
                               "run the sweep through run_sweep, which estimates them")
        return self.stand_ins[batch.index][layer]

    def _forward(self, batch: Batch, masks=None, observers=None, transforms=None, context=None) -> torch.Tensor:
        """The logits of one forward of ``batch`` under ``intervene``; ``context``: the scoring context of that
        forward, which reads its session's changed block outputs (see :func:`~cwcore.faithfulness.methods.scoring`)."""
        inputs = prepare_inputs(self.model, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
        masks = masks or {}
        stand_in = None if self.protocol.removal == "zero" else {layer: self._stand_in(batch, layer) for layer in masks}
        with torch.inference_mode(), intervene(self.model, masks, attention_mask=batch.attention_mask,
                                               observers=observers or {}, transforms=transforms or {},
                                               stand_in=stand_in) as session:
            if context is not None:
                context.changed_outputs = session.changed_outputs
            out = self.model(**inputs)
        return lm_logits(self.model, out, "faithfulness", "there is no perplexity or answer score to measure")

    def clean_pass(self, batch: Batch, specs: list[MetricSpec], candidates):
        """Clean logits, ``{label: {layer: {mode: bucket}}}`` and ``{label: {mode: removed}}`` (terms each
        ratio removes per sequence, summed over layers: ``[batch, n_ratios]``) from one observed forward."""
        buckets: dict[str, dict[int, dict[str, torch.Tensor]]] = {s.label: {} for s in specs}
        removed = {s.label: {m: batch.input_ids.new_zeros(batch.input_ids.shape[0], len(self.nonzero))
                             for m in self.modes} for s in specs}
        unit, scope = self.protocol.unit, self.protocol.scope
        observed = self._observed(specs) if specs and self.nonzero else {}
        intervened = set(self.layers)

        with self._scoring(batch, specs if observed else [], candidates) as context:
            context.importance = self.protocol.importance

            def ranker(call):
                layer_decomposition = LayerDecomposition.from_call(call)
                for spec in observed[call.layer]:
                    scores = self._scores(layer_decomposition, spec, context, call)
                    if call.layer not in intervened:
                        continue
                    chosen = selection(scores, candidates[call.layer], self.nonzero, self.modes, unit, scope)
                    buckets[spec.label][call.layer] = chosen.buckets
                    for mode, count in chosen.removed.items():  # counted on the layer's device
                        removed[spec.label][mode] += count.to(removed[spec.label][mode].device)

            refused: list[UnsupportedModelError] = []

            def causal(call):  # a next-token objective: a model that reads later keys has none
                if not refused:
                    try:
                        require_causal(call.probs, call.layer, "faithfulness",
                                       "there is no next-token perplexity to measure", call.valid_queries())
                        require_window(call.probs, call.layer, self.windows[call.layer], call.valid_queries())
                        if call.probs.shape[1] != self.heads[call.layer]:  # the removed fractions count them
                            raise UnsupportedModelError(
                                f"faithfulness: attention layer {call.layer} computes {call.probs.shape[1]} heads, "
                                f"where its output projection's width says {self.heads[call.layer]}")
                    except UnsupportedModelError as error:
                        refused.append(error)

            observers = {layer: [causal] for layer in self.layers}
            for layer in observed:
                observers.setdefault(layer, []).append(ranker)
            # a model without logits is refused for that first
            logits = self._forward(batch, observers=observers, context=context)
            if refused:
                raise refused[0]
        return logits, buckets, removed

    # -- one batch ---------------------------------------------------------------------------------
    def run(self, batch: Batch, scorer: Scorer) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
        """(clean frame, one frame per point) for one batch, each computed or read from the store."""
        rows = batch.input_ids.shape[0]
        frames: list[pd.DataFrame] = []
        clean_piece = self._piece(batch)
        clean = self._get(clean_piece)
        missing = {
            (s.label, m, r): self._get(self._piece(batch, s, m, r))
            for s in self.specs for m in self.modes for r in self.nonzero
        }
        todo = [key for key, frame in missing.items() if frame is None]
        candidates = self.candidates(batch)
        buckets, removed = {}, {}
        if clean is None or (todo and self.protocol.scores == "clean"):
            need = [s for s in self.specs if any(k[0] == s.label for k in todo)] if self.protocol.scores == "clean" else []
            logits, buckets, removed = self.clean_pass(batch, need, candidates)
            if clean is None:
                clean = scorer(logits, batch, batch.input_ids.new_zeros(rows))
                self._put(clean_piece, clean)
            del logits
        alias = self._aliases(buckets) if self.deduplicate else {}
        for spec in self.specs:
            for mode in self.modes:
                for ratio in self.ratios:
                    if ratio == 0:
                        frame = clean.copy()
                    else:
                        frame = missing[(spec.label, mode, ratio)]
                        if frame is None:
                            source = alias.get(spec.label)
                            if source is not None and missing.get((source, mode, ratio)) is not None:
                                frame = missing[(source, mode, ratio)]
                            else:
                                frame = self._point(batch, scorer, spec, mode, ratio, buckets.get(spec.label),
                                                    removed.get(spec.label), candidates)
                            self._put(self._piece(batch, spec, mode, ratio), frame)
                            missing[(spec.label, mode, ratio)] = frame
                    self.bar.update(1)
                    frames.append(frame.assign(metric=spec.label, kind=spec.kind, mode=mode, ratio=ratio))
        return clean, frames

    def _aliases(self, buckets) -> dict[str, str]:
        """Metrics whose buckets equal an earlier metric's in every layer and mode (same masks)."""
        alias, labels = {}, list(buckets)
        for i, label in enumerate(labels):
            for earlier in labels[:i]:
                if earlier in alias:
                    continue
                same = all(
                    torch.equal(buckets[label][layer][mode], buckets[earlier][layer][mode])
                    for layer in buckets[label] for mode in buckets[label][layer]
                )
                if same and buckets[label]:
                    alias[label] = earlier
                    break
        return alias

    def _point(self, batch, scorer, spec, mode, ratio, buckets, removed_counts, candidates) -> pd.DataFrame:
        rows = batch.input_ids.shape[0]
        layer_scope = self.protocol.scope == "layer"
        if self.protocol.scores == "clean":
            t = self.nonzero.index(ratio)
            masks = {
                layer: removal_mask(buckets[layer][mode], t, candidates[layer] if layer_scope else None)
                for layer in self.layers
            }
            logits = self._forward(batch, masks)
            removed = removed_counts[mode][:, t].clone()
        else:
            removed = batch.input_ids.new_zeros(rows)
            unit, scope = self.protocol.unit, self.protocol.scope
            observed = self._observed([spec])
            intervened = set(self.layers)

            with self._scoring(batch, [spec], candidates) as context:
                context.importance = self.protocol.importance

                def live(call):
                    nonlocal removed
                    scores = self._scores(LayerDecomposition.from_call(call), spec, context, call)
                    if call.layer not in intervened:
                        return None
                    chosen = selection(scores, candidates[call.layer], [ratio], [mode], unit, scope)
                    removed = removed + chosen.removed[mode][:, 0].to(removed.device)
                    mask = removal_mask(chosen.buckets[mode], 0, candidates[call.layer] if layer_scope else None)
                    return removal(mask, self._stand_in(batch, call.layer))(call)

                logits = self._forward(batch, transforms={layer: [live] for layer in observed}, context=context)
        return scorer(logits, batch, removed)

    def candidate_terms(self, batch: Batch) -> torch.Tensor:
        """``[rows]`` candidate terms (head, query, key) per row, summed over the intervened layers."""
        total = batch.input_ids.new_zeros(batch.input_ids.shape[0])
        for layer, mask in self.candidates(batch).items():
            total += mask.sum((1, 2, 3)).long() * self.heads[layer]
        return total


def stand_ins(model, batches: list[Batch], layers, documents: dict[int, int] | None = None, *,
              skip_first_token: bool = True) -> dict[int, dict[int, torch.Tensor]]:
    """``{batch index: {layer: [rows, head, dim]}}`` (float64): for each row, each head's mean value vector
    (:func:`cwcore.core.interventions.value_sums`) over the real tokens of every *other document* of
    ``batches`` (leave one document out), the stand-in that ``removal="mean"`` puts in place of its removed
    terms. So no document's removed terms are replaced by an average that contains its own values.
    ``documents`` maps each row's group id (``Batch.groups``) to its document (default: each group its own);
    ``skip_first_token`` leaves out each sequence's first token (the faithfulness protocol's
    ``keep_first_token``: the stand-in averages the values of the terms that may be removed). One forward
    per batch; at least two documents are needed."""
    documents = documents or {}
    per_document: dict[int, dict[int, torch.Tensor]] = {}
    counts: dict[int, int] = {}
    rows_of: dict[int, list[int]] = {}
    # one forward per batch, split over the ranks as the sweep's own batches are (every rank ran them all before)
    summed = shard_map(batches, lambda batch: value_sums(model, batch.input_ids, batch.attention_mask, layers=layers,
                                                         skip_first_token=skip_first_token))
    for batch, (sums, n) in zip(batches, summed):
        docs = [documents.get(int(g), int(g)) for g in batch.groups]
        rows_of[batch.index] = docs
        for row, doc in enumerate(docs):
            held = per_document.setdefault(doc, {layer: 0.0 for layer in sums})
            for layer, summed in sums.items():
                held[layer] = held[layer] + summed[row]
            counts[doc] = counts.get(doc, 0) + int(n[row])
    if len(per_document) < 2:
        raise ValueError("removal='mean' estimates each document's stand-in values on the other documents: give "
                         f"texts of at least two documents (got {len(per_document)})")
    total_count = sum(counts.values())
    totals = {layer: sum(held[layer] for held in per_document.values()) for layer in layers}
    out = {}
    for index, docs in rows_of.items():
        others = torch.tensor([total_count - counts[d] for d in docs], dtype=torch.float64)
        if bool((others == 0).any()):
            raise ValueError("removal='mean': the other documents have no token to average (one token each)")
        out[index] = {layer: torch.stack([totals[layer] - per_document[d][layer] for d in docs]) / others[:, None, None]
                      for layer in layers}
    return out


def sample_identity(protocol: Protocol, batches: list[Batch], documents: dict | None = None) -> dict:
    """What a cached piece depends on beyond its own batch: nothing under zeroing; under ``removal="mean"``
    the whole sample (every batch's digest, each row's document), whose other documents give the stand-ins."""
    if protocol.removal == "zero":
        return {}
    text = repr(([b.digest for b in batches], sorted((documents or {}).items())))
    return {"stand_in_sample": hashlib.sha256(text.encode()).hexdigest()[:20]}


def run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches, deduplicate, make_scorer,
              documents: dict[int, int] | None = None):
    """Run every batch through one :class:`Sweep`; returns (point frames, clean frames).

    ``make_scorer({batch index: candidate terms [rows]})`` builds the :data:`Scorer`. ``documents``
    (``{group id: document}``, default each group its own) is where ``removal="mean"`` leaves one out.
    """
    sweep = Sweep(model, specs, modes, ratio_list, protocol, store, progress, len(batches))
    sweep.deduplicate = deduplicate
    if protocol.removal != "zero":
        sweep.stand_ins = stand_ins(model, batches, sweep.layers, documents,
                                    skip_first_token=protocol.keep_first_token)
    scorer = make_scorer({b.index: sweep.candidate_terms(b) for b in batches})
    frames, cleans = [], []
    try:  # split over ranks when there are any (cwcore.runs.shard_map); the order stays the batches'
        with bars_off(not progress):  # progress=False silences the methods' bars too (value zeroing's)
            for clean, points in shard_map(batches, lambda batch: sweep.run(batch, scorer)):
                cleans.append(clean)
                frames.extend(points)
    finally:
        sweep.close()
    return frames, cleans


def canonical_order(table: pd.DataFrame, specs, modes, unit: str) -> pd.DataFrame:
    """Rows ordered by (metric as requested, mode as requested, ratio, sequence/example), whatever
    the batching."""
    order = {s.label: i for i, s in enumerate(specs)}
    mode_order = {m: i for i, m in enumerate(modes)}
    keys = pd.DataFrame({"m": table["metric"].map(order), "o": table["mode"].map(mode_order),
                         "r": table["ratio"], "u": table[unit]})
    return table.loc[keys.sort_values(["m", "o", "r", "u"], kind="stable").index].reset_index(drop=True)


def piece_store(namespace: str, parameters: dict, model: nn.Module):
    """The :class:`cwcore.runs.PieceStore` of one run inside a :func:`cwcore.cache.caching` block, else None
    (then nothing is read or written, and the model's weights are not hashed)."""
    if not caching_enabled():
        return None
    return PieceStore(namespace, parameters, model=model, code=("faithfulness",))
