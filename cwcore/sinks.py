"""The value geometry of attention sinks (PAPER.md section 6), as five analyses returning tidy tables.

Every analysis has the same signature::

    analysis(model, tokenizer, data, *, block_size=128, num_sequences=None, add_bos=None,
             batch_size=8, seed=0, cache=True, cache_root=None, progress=True, compute_dtype=float32,
             <analysis options>)

``data`` is text (a :class:`datasets.Dataset` with a ``text`` column or an iterable of strings, cut
into ``num_sequences`` blocks of ``block_size`` tokens by :func:`cwcore.data.lm_blocks`, with a BOS
token prepended when ``add_bos`` says so, None = the tokenizer's default), or ready token blocks: a
``[sequence, position]`` integer tensor, or rows with ``input_ids`` (the output of ``lm_blocks``).
``tokenizer`` may be None for ready blocks. Blocks must be unpadded (the sink is position 0).

Conventions shared by all analyses:

* The **sink** is key position 0 (the BOS token when one is prepended, otherwise the first text
  token). **Tail** tokens are keys 1..i of query i.
* **Query 0 is excluded** everywhere: in a decoder its only key is itself, so alpha_00 = 1 trivially
  and it says nothing about sink behaviour. (``sink_rate_all_queries`` in :func:`sink_rates` keeps it,
  as Gu et al. 2025 do; with 128 positions the two differ by at most 1/128.)
* Projected values v~^h_j = W_O^h v^h_j, head outputs o^h_i = sum_j alpha_ij v~^h_j and every inner
  product between them are computed in head space with the Gram matrix G_h = W_O^h^T W_O^h
  (:mod:`cwcore.geometry`); nothing ``[query, key, model]``-sized is materialised.
* Work is batched (``batch_size`` sequences a forward pass, with a tqdm bar); the raw per-batch
  material is cached as :class:`cwcore.cache.ResultCache` pieces (namespace ``sinks-<analysis>``,
  keyed by a fingerprint of the model's weights, every option and the batch's tokens), so a rerun or
  an interrupted run resumes; ``cache=False`` switches the cache off.
* Random choices (samples, the control token) use ``numpy.random.default_rng([seed, sequence index])``
  per sequence: results are deterministic and do not depend on ``batch_size`` (up to float rounding).

:func:`run_analyses` runs several analyses on one clean forward pass per batch (they fill the same
cache as the single functions). No engine code is changed: a subclass of
:class:`cwcore.attention.AttentionSession` hands each layer's post-intervention probabilities and
(GQA-repeated) values to the analyses, and renormalises rows for the ``sink_renorm`` intervention.

The command line runs all five on a named model and data set and writes small CSVs
``sinks_<table>_<model>_<data>.csv`` plus ``sinks_summary_<model>_<data>.csv`` (:func:`summarize`)::

    python -m cwcore.sinks --model smollm2-135m --data gsm8k --num-sequences 32 --out data/results/
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import warnings
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, NamedTuple

import numpy as np
import pandas as pd
import torch
from torch import nn

from .architectures import attention_blocks
from .attention import AttentionSession, cwcore_attention
from .cache import ResultCache
from .decomposition import LayerDecomposition
from .geometry import head_space_geometry, split_output_projection

__all__ = [
    "ANALYSES",
    "ConvexityTables",
    "DecompositionTables",
    "SemanticConeTables",
    "SequenceBootstrap",
    "anti_alignment",
    "bootstrap_ci",
    "combine_verdicts",
    "cone_points",
    "convexity",
    "model_fingerprint",
    "semantic_cone",
    "sink_decomposition",
    "sequence_bootstrap",
    "share_ci",
    "sink_rates",
    "spearman_ci",
    "summarize",
    "token_blocks",
    "verdict",
    "main",
    "run_analyses",
]

_FACTORS = ("alpha", "relative_norm", "cosine")


# ---------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Blocks:
    """Token blocks ``ids [sequence, position]`` and what is known about their first token."""

    ids: torch.Tensor
    add_bos: bool | None  # None: blocks were given ready-made
    first_token_is_bos: float  # share of sequences starting with tokenizer.bos_token_id (NaN: unknown)


def token_blocks(
    data,
    tokenizer=None,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
) -> _Blocks:
    """Normalise ``data`` (text or ready blocks, see the module docstring) to ``ids [n, block_size]``."""
    ready = None
    if isinstance(data, torch.Tensor):
        ready = data
    elif hasattr(data, "column_names") and "input_ids" in data.column_names:
        if "attention_mask" in data.column_names and not all(all(m) for m in data["attention_mask"]):
            raise ValueError("sink analyses need unpadded blocks: the attention mask has zeros")
        ready = torch.tensor(data["input_ids"])
    elif isinstance(data, (list, tuple)) and data and isinstance(data[0], dict) and "input_ids" in data[0]:
        if any("attention_mask" in r and not all(r["attention_mask"]) for r in data):
            raise ValueError("sink analyses need unpadded blocks: the attention mask has zeros")
        ready = torch.tensor([list(r["input_ids"]) for r in data])
    if ready is not None:
        if add_bos is not None:
            raise ValueError("add_bos applies to text; these blocks are already tokenised")
        ids = torch.as_tensor(ready).long()
        if ids.dim() != 2:
            raise ValueError(f"token blocks must be [sequence, position], got shape {tuple(ids.shape)}")
        if num_sequences is not None:
            ids = ids[:num_sequences]
        resolved = None
    else:
        if tokenizer is None:
            raise ValueError("text data needs a tokenizer")
        from .data import _resolve_bos, lm_blocks

        resolved = _resolve_bos(tokenizer, add_bos) is not None
        blocks = lm_blocks(data, tokenizer, block_size=block_size, num_blocks=num_sequences, add_bos=add_bos)
        ids = torch.tensor(blocks["input_ids"], dtype=torch.long).reshape(len(blocks), block_size)
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError(f"need at least one block of at least 2 tokens, got shape {tuple(ids.shape)}")
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    first = float("nan") if bos is None else float((ids[:, 0] == bos).float().mean())
    return _Blocks(ids, resolved, first)


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's class, configuration name and (a strided sample of) every parameter.

    Used as the model's identity in cache keys: two models with different weights never share results.
    """
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    digest.update(type(model).__name__.encode())
    digest.update(str(getattr(config, "name_or_path", "")).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // 4096)
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            digest.update(flat[::step].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:20]


def _digest(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.cpu().numpy().astype(np.int64).tobytes()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------------
# one forward pass with per-layer access to probabilities and values
# ---------------------------------------------------------------------------------------------------


class _LayerState:
    """What one attention layer did in one forward pass, in the compute dtype.

    ``probs`` ``[batch, head, query, key]`` (after any intervention), ``values`` ``[batch, head, key, dim]``
    (already repeated for grouped-query attention), ``w_o`` ``[head, model, dim]``, ``gram``
    ``[head, dim, dim]`` = W_O^h^T W_O^h. Inner products of head-space vectors x, y ``[b, h, n, dim]``
    are those of the projected vectors W_O^h x, W_O^h y.
    """

    def __init__(self, layer: int, probs: torch.Tensor, values: torch.Tensor, weight: torch.Tensor, dtype):
        self.layer = layer
        self.probs = probs.detach().to(dtype)
        self.values = values.detach().to(dtype)
        self.w_o = split_output_projection(weight.detach().to(dtype), probs.shape[1])
        self.gram = self.w_o.transpose(1, 2) @ self.w_o

    def inner(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """<W_O^h x, W_O^h y> over the last axis: ``[b, h, n, d] x [b, h, n, d] -> [b, h, n]``."""
        return ((x @ self.gram) * y).sum(-1)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, x).clamp_min(0).sqrt()

    @cached_property
    def mixed(self) -> torch.Tensor:
        """z^h_i = sum_j alpha_ij v^h_j ``[b, h, q, d]`` (o^h_i = W_O^h z^h_i)."""
        return self.probs @ self.values

    @cached_property
    def values_gram(self) -> torch.Tensor:
        """G_h v^h_j ``[b, h, k, d]``: <v~_0, v~_j> = (G v_0) . v_j."""
        return self.values @ self.gram

    @cached_property
    def value_norm(self) -> torch.Tensor:
        """||v~_j|| ``[b, h, k]``."""
        return (self.values_gram * self.values).sum(-1).clamp_min(0).sqrt()

    def sink_inner(self, x: torch.Tensor) -> torch.Tensor:
        """<v~_0, W_O^h x> for head-space vectors x ``[b, h, n, d]`` -> ``[b, h, n]``."""
        return (self.values_gram[:, :, :1, :] * x).sum(-1)

    @cached_property
    def semantic_norm(self) -> torch.Tensor:
        """||s_i|| ``[b, h, q]``."""
        return self.norm(self.semantic)

    @cached_property
    def output_norm(self) -> torch.Tensor:
        """||o^h_i|| ``[b, h, q]``."""
        return self.norm(self.mixed)

    @cached_property
    def semantic(self) -> torch.Tensor:
        """s^h_i = sum_{j>0} alpha_ij v^h_j ``[b, h, q, d]`` (head space), the non-sink component."""
        return self.mixed - self.probs[..., :1] * self.values[:, :, None, 0, :]

    @cached_property
    def decomposition(self) -> LayerDecomposition:
        return LayerDecomposition(self.layer, head_space_geometry(self.probs, self.values, self.w_o))


class _SinkSession(AttentionSession):
    """An :class:`AttentionSession` that also (a) renormalises selected rows after excluding the sink and
    (b) hands every layer's post-intervention probabilities and values to ``on_layer``.

    ``renormalise``: ``{layer: bool [batch, head]}``: in those heads, for queries i >= 1, alpha_i0 is set
    to 0 and the remaining probabilities are divided by their sum (= the softmax with key 0 left out).
    """

    def __init__(self, model, on_layer=None, masks=None, renormalise=None, compute_dtype=torch.float32):
        super().__init__(model, masks=masks, compute_dtype=compute_dtype)
        self.blocks_by_module = {id(block.module): block for block in attention_blocks(model)}
        self.on_layer = on_layer
        self.renormalise = dict(renormalise or {})

    def on_attention(self, module, probs, value):
        probs = super().on_attention(module, probs, value)  # applies the boolean masks
        block = self.blocks_by_module.get(id(module))
        if block is None:
            return probs
        rows = self.renormalise.get(block.layer)
        if rows is not None:
            probs = _exclude_sink(probs, rows.to(probs.device))
        if self.on_layer is not None:
            weight, _ = block.output_projection()
            self.on_layer(_LayerState(block.layer, probs, value, weight, self.compute_dtype))
        return probs


def _exclude_sink(probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Softmax without key 0 for queries >= 1 of the selected ``rows [batch, head]``."""
    tail = probs[..., 1:]
    total = tail.sum(-1, keepdim=True)
    renormalised = torch.cat([torch.zeros_like(probs[..., :1]), torch.where(total > 0, tail / total, tail)], -1)
    queries = torch.arange(probs.shape[-2], device=probs.device) >= 1
    selected = rows.bool()[:, :, None, None] & queries[None, None, :, None]
    return torch.where(selected, renormalised, probs)


def _backbone(model: nn.Module) -> nn.Module:
    """The model without its language-modelling head (avoids computing unused logits)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def _forward(model, ids, on_layer, masks=None, renormalise=None, logits=False, compute_dtype=torch.float32):
    """Run ``model`` on ``ids [b, T]`` through cwcore's attention; returns the logits or None."""
    session = _SinkSession(model, on_layer, masks, renormalise, compute_dtype)
    device = next(model.parameters()).device
    ids = ids.to(device)
    network = model if logits else _backbone(model)
    training = model.training
    model.eval()
    try:
        with torch.inference_mode(), cwcore_attention(model, session):
            out = network(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        model.train(training)
    return out.logits if logits else None


# ---------------------------------------------------------------------------------------------------
# the common driver: batches, one shared forward pass, cache, progress
# ---------------------------------------------------------------------------------------------------


class _Collector:
    """Collects one analysis's raw material from one batch's clean forward pass.

    Built as ``Collector(model, ids [b, T], start, dtype, **options)``; :meth:`on_layer` sees every
    layer's :class:`_LayerState`; :meth:`finish` gets the logits (None unless ``needs_logits``) and
    returns named DataFrames, the batch's cache pieces.
    """

    needs_logits = False

    def __init__(self, model, ids: torch.Tensor, start: int, dtype: torch.dtype, **options):
        self.model, self.ids, self.start, self.dtype = model, ids, start, dtype
        self.options = options

    def on_layer(self, s: _LayerState) -> None:
        raise NotImplementedError

    def finish(self, logits: torch.Tensor | None) -> dict[str, pd.DataFrame]:
        raise NotImplementedError


@dataclass
class _Spec:
    """One analysis to run: its name (cache namespace ``sinks-<name>``), collector and per-batch options."""

    name: str
    collector: type
    options: dict


_COMMON = ("block_size", "num_sequences", "add_bos", "batch_size", "cache", "cache_root", "progress", "compute_dtype")


def _run(model, tokenizer, data, specs: list[_Spec], *, block_size=128, num_sequences=None, add_bos=None,
         batch_size=8, cache=True, cache_root=None, progress=True, compute_dtype=torch.float32):
    """Compute (or read from the cache) every batch's pieces of every analysis in ``specs``.

    The analyses whose pieces are missing for a batch share one clean forward pass. Returns
    ``({analysis: {part: concatenated DataFrame}}, blocks)``.
    """
    from tqdm.auto import tqdm

    blocks = token_blocks(data, tokenizer, block_size, num_sequences, add_bos)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    fingerprint = model_fingerprint(model)
    stores = {
        spec.name: ResultCache(f"sinks-{spec.name}", {"analysis": spec.name, "model": fingerprint,
                                                      "dtype": str(compute_dtype), **spec.options},
                               root=None if cache_root is None else Path(cache_root), enabled=bool(cache))
        for spec in specs
    }
    parts: dict[str, dict[str, list[pd.DataFrame]]] = {spec.name: {} for spec in specs}
    n = blocks.ids.shape[0]
    label = "+".join(spec.name for spec in specs)
    for start in tqdm(range(0, n, batch_size), desc=f"sinks:{label}", disable=not progress, unit="batch"):
        batch = blocks.ids[start : start + batch_size]
        key = f"{start:06d}-{len(batch)}-{_digest(batch)}"
        found, todo = {}, []
        for spec in specs:
            frames = _read_pieces(stores[spec.name], key)
            if frames is None:
                todo.append(spec)
            else:
                found[spec.name] = frames
        if todo:
            collectors = [spec.collector(model, batch, start, compute_dtype, **spec.options) for spec in todo]

            def on_layer(s: _LayerState):
                for collector in collectors:
                    collector.on_layer(s)

            logits = _forward(model, batch, on_layer, logits=any(c.needs_logits for c in collectors),
                              compute_dtype=compute_dtype)
            for spec, collector in zip(todo, collectors):
                frames = collector.finish(logits)
                _write_pieces(stores[spec.name], key, frames)
                found[spec.name] = frames
            del logits, collectors
        for name, frames in found.items():
            for part, frame in frames.items():
                parts[name].setdefault(part, []).append(frame)
    joined = {name: {p: pd.concat(f, ignore_index=True) for p, f in ps.items()} for name, ps in parts.items()}
    return joined, blocks


def _read_pieces(store: ResultCache, key: str) -> dict[str, pd.DataFrame] | None:
    index = store.get(f"{key}.done")  # written last: the batch's pieces are complete
    if index is None:
        return None
    frames = {part: store.get(f"{key}.{part}") for part in index["part"]}
    return None if any(f is None for f in frames.values()) else frames


def _write_pieces(store: ResultCache, key: str, frames: dict[str, pd.DataFrame]) -> None:
    for part, frame in frames.items():
        store.put(f"{key}.{part}", frame)
    store.put(f"{key}.done", pd.DataFrame({"part": list(frames)}))


def _grid(shape: tuple[int, ...], names: tuple[str, ...], offsets: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Index columns of a C-ordered grid: ``{name: int array}``, each of length prod(shape)."""
    grids = np.meshgrid(*[np.arange(s) for s in shape], indexing="ij")
    offsets = offsets or {}
    return {n: (g.reshape(-1) + offsets.get(n, 0)).astype(np.int32) for n, g in zip(names, grids)}


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().cpu().numpy().reshape(-1)


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True)


# ---------------------------------------------------------------------------------------------------
# 1. sink rates
# ---------------------------------------------------------------------------------------------------


class _RatesCollector(_Collector):
    """Piece ``alpha0``: sequence, layer, head, query (all, 0 included), alpha0 = alpha_i0."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows = []

    def on_layer(self, s):
        a0 = s.probs[:, :, :, 0]  # [b, h, q]
        cols = _grid(tuple(a0.shape), ("sequence", "head", "query"), {"sequence": self.start})
        self.rows.append(pd.DataFrame({"layer": np.full(a0.numel(), s.layer, np.int32), **cols,
                                       "alpha0": _np(a0).astype(np.float32)}))

    def finish(self, logits):
        return {"alpha0": _concat(self.rows)}


def sink_rates(
    model,
    tokenizer,
    data,
    *,
    eps: float = 0.3,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> pd.DataFrame:
    """Per (layer, head): the attention the first token receives, and Gu et al.'s Sink_eps.

    For head h and query i >= 1, a_i = alpha^h_i0. One row per (layer, head) with
    ``sink_rate`` (mean of a_i over queries 1..T-1 and sequences), ``sink_rate_std`` (its standard
    deviation over queries and sequences), ``sink_rate_sequence_std`` (standard deviation over sequences
    of each sequence's mean), ``q10``/``median``/``q90`` of a_i, ``sink_rate_all_queries`` (mean over all
    queries 0..T-1, Gu et al.'s convention, where a_0 = 1), ``is_sink_head`` (sink_rate > eps).
    Model-level columns, constant over rows: ``sink_eps`` (share of all heads with sink_rate > eps),
    ``sink_eps_all_queries`` (the same with Gu et al.'s rate), ``eps``, ``add_bos`` (True/False, NA for
    ready-made blocks), ``first_token_is_bos`` (share of sequences; NaN without a tokenizer with a BOS),
    ``num_sequences``, ``block_size``.
    """
    del seed  # nothing random; kept for the common signature
    common = {k: v for k, v in locals().items() if k in _COMMON}
    parts, blocks = _run(model, tokenizer, data, [_Spec("rates", _RatesCollector, {})], **common)
    return _rates_table(parts["rates"]["alpha0"], eps, blocks)


def _rates_table(points: pd.DataFrame, eps: float, blocks: _Blocks) -> pd.DataFrame:
    later = points[points["query"] >= 1]
    grouped = later.groupby(["layer", "head"])["alpha0"]
    table = pd.DataFrame({
        "sink_rate": grouped.mean(),
        "sink_rate_std": grouped.std(ddof=0),
        "sink_rate_sequence_std": later.groupby(["layer", "head", "sequence"])["alpha0"].mean()
        .groupby(["layer", "head"]).std(ddof=0),
        "q10": grouped.quantile(0.1),
        "median": grouped.median(),
        "q90": grouped.quantile(0.9),
        "sink_rate_all_queries": points.groupby(["layer", "head"])["alpha0"].mean(),
    }).reset_index()
    table["is_sink_head"] = table["sink_rate"] > eps
    table["sink_eps"] = float(table["is_sink_head"].mean())
    table["sink_eps_all_queries"] = float((table["sink_rate_all_queries"] > eps).mean())
    table["eps"] = eps
    table["add_bos"] = pd.array([blocks.add_bos] * len(table), dtype="boolean")
    table["first_token_is_bos"] = blocks.first_token_is_bos
    table["num_sequences"] = int(blocks.ids.shape[0])
    table["block_size"] = int(blocks.ids.shape[1])
    return table


# ---------------------------------------------------------------------------------------------------
# 2. the three factors of c_ij for sink and tail tokens
# ---------------------------------------------------------------------------------------------------


class DecompositionTables(NamedTuple):
    """``summary``: one row per (scope, layer, head, token_class, factor); ``sample``: long per-(query, key) rows."""

    summary: pd.DataFrame
    sample: pd.DataFrame


class _DecompositionCollector(_Collector):
    """Pieces ``stats`` (sufficient statistics per layer, head, class) and ``sample`` (quantile sample)."""

    def __init__(self, *args, kind, quantile_sample, seed):
        super().__init__(*args)
        self.kind = kind
        b, T = self.ids.shape
        rows_, cols_ = np.tril_indices(T - 1)  # tail pairs: 1 <= j <= i <= T-1
        tail_q, tail_k = rows_ + 1, cols_ + 1
        self.picks = {"sink": [], "tail": []}
        for s in range(b):
            rng = np.random.default_rng([seed, self.start + s])
            sink_q = np.arange(1, T)
            if len(sink_q) > quantile_sample:
                sink_q = np.sort(rng.choice(sink_q, quantile_sample, replace=False))
            self.picks["sink"].append((sink_q, np.zeros_like(sink_q)))
            chosen = np.sort(rng.choice(len(tail_q), min(quantile_sample, len(tail_q)), replace=False))
            self.picks["tail"].append((tail_q[chosen], tail_k[chosen]))
        q = torch.arange(T)
        self.masks = {"sink": (q[:, None] >= 1) & (q[None, :] == 0),
                      "tail": (q[:, None] >= q[None, :]) & (q[None, :] >= 1)}  # [q, k]
        self.stats, self.samples = [], []

    def on_layer(self, s):
        d = s.decomposition
        kind = self.kind
        alpha, rel, cos, contribution = d.attention, d.relative_norm(kind), d.cosine(kind), d.contribution(kind)
        b, heads = alpha.shape[:2]
        for cls, mask in self.masks.items():
            if cls == "sink":  # only key 0 of queries >= 1: slice instead of masking
                parts = [x[:, :, 1:, 0] for x in (alpha, rel, cos, contribution)]
                total = b * (alpha.shape[2] - 1)
            else:
                keep = mask.to(alpha.device)
                parts = [x[:, :, keep] for x in (alpha, rel, cos, contribution)]  # [b, h, pairs]
                total = b * int(keep.sum())
            a_, r_, c_, contrib = parts
            logs = torch.stack([a_.log(), r_.log(), c_.abs().log()])  # [3, b, h, n]
            valid = logs.sum(0).isfinite()  # log|c| is finite iff all three logs are
            ones = valid.to(logs.dtype)
            x = torch.cat([ones[None], torch.where(valid, logs, 0.0)])  # [4, b, h, n]
            x = x.permute(2, 0, 1, 3).reshape(heads, 4, -1).double()
            moments = x @ x.transpose(1, 2)  # [h, 4, 4]: n, sums of log f, sums of log f * log g
            n = moments[:, 0, 0]
            frame = {"layer": np.full(heads, s.layer, np.int32), "head": np.arange(heads, dtype=np.int32),
                     "token_class": [cls] * heads, "n": _np(n), "n_excluded": total - _np(n),
                     "n_pairs": np.full(heads, float(total)), "sum_alpha_linear": _np(a_.sum((0, 2), dtype=torch.float64)),
                     "sum_L": _np(moments[:, 0, 1:].sum(-1)), "sum_LL": _np(moments[:, 1:, 1:].sum((1, 2))),
                     "n_negative": _np((valid & (contrib < 0)).sum((0, 2))).astype(np.float64),
                     "n_negative_cosine": _np((valid & (c_ < 0)).sum((0, 2))).astype(np.float64)}
            for k, name in enumerate(_FACTORS, start=1):
                frame[f"sum_{name}"] = _np(moments[:, 0, k])
                frame[f"sum_{name}_L"] = _np(moments[:, k, 1:].sum(-1))
            self.stats.append(pd.DataFrame(frame))
            for seq, (qi, kj) in enumerate(self.picks[cls]):
                m = len(qi)
                qi_t, kj_t = torch.as_tensor(qi), torch.as_tensor(kj)
                values = {"alpha": alpha, "relative_norm": rel, "cosine": cos, "contribution": contribution}
                self.samples.append(pd.DataFrame({
                    "sequence": np.full(heads * m, self.start + seq, np.int32),
                    "layer": np.full(heads * m, s.layer, np.int32),
                    "head": np.repeat(np.arange(heads, dtype=np.int32), m),
                    "token_class": cls,
                    "query": np.tile(qi.astype(np.int32), heads), "key": np.tile(kj.astype(np.int32), heads),
                    **{name: _np(x[seq][:, qi_t, kj_t]).astype(np.float32) for name, x in values.items()},
                }))

    def finish(self, logits):
        return {"stats": _concat(self.stats), "sample": _concat(self.samples)}


def sink_decomposition(
    model,
    tokenizer,
    data,
    *,
    kind: str = "intra",
    eps: float = 0.3,
    quantile_sample: int = 128,
    sample_size: int = 2000,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> DecompositionTables:
    """The factors of c_ij = alpha_ij * (||v~_j|| / ||o_i||) * cos(o_i, v~_j) for sink and tail tokens.

    Token classes: ``sink`` = (query i >= 1, key 0); ``tail`` = (i >= 1, 1 <= j <= i). ``kind``: "intra"
    (o_i = the head's own output o^h_i, default) or "inter" (the layer's combined output).

    Since log|c| = log alpha + log rel_norm + log|cos| exactly, var(log|c|) splits into the factor
    shares ``share_f = cov(log|f|, log|c|) / var(log|c|)``, which sum to 1 over the three factors; they
    say which factor makes c *vary* (within the class, across heads, queries and sequences). ``mean_log``
    (the mean of log|f|, summing to the mean of log|c|) says which factor sets its *level*. Both are
    exact over every (sequence, query, key) of the class (running sums in float64); pairs with a zero
    factor (alpha underflowing to 0, a zero cosine, a zero output norm) have no logarithm and are
    counted in ``n_excluded``.

    ``summary`` columns: ``scope`` ("head", "layer": pooled over heads, "model": pooled over all),
    ``layer``/``head`` (NA when pooled), ``token_class``, ``factor`` (alpha, relative_norm, cosine,
    contribution), ``n``, ``n_excluded``, ``share`` (contribution: their sum), ``mean_log``, ``mean``,
    ``frac_negative``, ``q10``, ``q25``, ``median``, ``q75``, ``q90``, ``sink_rate`` (the head's mean
    alpha_i0 over queries >= 1; "head" rows only) and ``num_heads`` (heads pooled in the row). Scopes
    "sink_heads" / "other_heads" pool the heads whose sink rate is above / at most ``eps``. ``mean`` and the quantiles come
    from a seeded sample of ``quantile_sample`` pairs per (sequence, layer, head, class) (the sink class
    has only T-1 pairs per sequence: with the default every sink pair is kept); the same tail pairs are
    used in all layers and heads of a sequence.
    ``sample``: ``sample_size`` rows per token class drawn (seeded) from that sample, with columns
    sequence, layer, head, token_class, query, key, alpha, relative_norm, cosine, contribution.
    """
    if kind not in ("intra", "inter"):
        raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")
    common = {k: v for k, v in locals().items() if k in _COMMON}
    spec = _Spec("decomposition", _DecompositionCollector, {"kind": kind, "quantile_sample": quantile_sample, "seed": seed})
    parts, _ = _run(model, tokenizer, data, [spec], **common)
    return _decomposition_tables(parts["decomposition"], sample_size, seed, eps)


def _decomposition_tables(parts: dict, sample_size: int, seed: int, eps: float) -> DecompositionTables:
    summary = _decomposition_summary(parts["stats"], parts["sample"], eps)
    sample = parts["sample"]
    rng = np.random.default_rng(seed)
    drawn = []
    for cls in ("sink", "tail"):
        rows = sample[sample["token_class"] == cls]
        if len(rows) > sample_size:
            rows = rows.iloc[np.sort(rng.choice(len(rows), sample_size, replace=False))]
        drawn.append(rows)
    return DecompositionTables(summary, pd.concat(drawn, ignore_index=True))


def _shares(sums: pd.DataFrame) -> dict[str, np.ndarray]:
    """Variance shares and mean logs from summed sufficient statistics (columns as in the stats piece)."""
    n = sums["n"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_L = sums["sum_L"].to_numpy() / n
        var_L = sums["sum_LL"].to_numpy() / n - mean_L**2
        out = {"mean_log_contribution": mean_L, "var_log_contribution": var_L}
        for name in _FACTORS:
            mean_f = sums[f"sum_{name}"].to_numpy() / n
            cov = sums[f"sum_{name}_L"].to_numpy() / n - mean_f * mean_L
            out[f"share_{name}"] = np.where(var_L > 0, cov / np.where(var_L > 0, var_L, 1), np.nan)
            out[f"mean_log_{name}"] = mean_f
    return out


def _decomposition_summary(stats: pd.DataFrame, sample: pd.DataFrame, eps: float) -> pd.DataFrame:
    sum_columns = [c for c in stats.columns if c.startswith(("sum_", "n"))]
    # each head's sink rate: mean alpha_i0 over all its sink pairs
    sink = stats[stats["token_class"] == "sink"].groupby(["layer", "head"])[["sum_alpha_linear", "n_pairs"]].sum()
    rate = (sink["sum_alpha_linear"] / sink["n_pairs"]).rename("sink_rate").reset_index()
    stats = stats.merge(rate, on=["layer", "head"], how="left")
    sample = sample.merge(rate, on=["layer", "head"], how="left")
    frames = []
    scopes = (("head", ["layer", "head"], None), ("layer", ["layer"], None), ("sink_heads", [], True),
              ("other_heads", [], False), ("model", [], None))
    for scope, keys, sink_heads in scopes:
        by = keys + ["token_class"]
        stats_in, sample_in = stats, sample
        if sink_heads is not None:
            stats_in = stats[(stats["sink_rate"] > eps) == sink_heads]
            sample_in = sample[(sample["sink_rate"] > eps) == sink_heads]
            if stats_in.empty:
                continue
        sums = stats_in.groupby(by)[sum_columns].sum().reset_index()
        shares = _shares(sums)
        groups = sample_in.groupby(by)
        for factor in (*_FACTORS, "contribution"):
            q = groups[factor].quantile([0.1, 0.25, 0.5, 0.75, 0.9]).unstack()
            q.columns = ["q10", "q25", "median", "q75", "q90"]
            q = q.reset_index()
            frame = sums[by].copy()
            frame["scope"] = scope
            frame["factor"] = factor
            frame = frame.merge(stats_in.drop_duplicates(["layer", "head", "token_class"]).groupby(by).size()
                                .rename("num_heads").reset_index(), on=by, how="left")
            if scope == "head":
                frame["sink_rate"] = (sums["sum_alpha_linear"] / sums["n_pairs"]).where(sums["token_class"] == "sink")
                frame["sink_rate"] = frame.groupby(keys)["sink_rate"].transform("max")
            frame["n"] = sums["n"].astype(np.int64)
            frame["n_excluded"] = sums["n_excluded"].astype(np.int64)
            if factor == "contribution":
                frame["share"] = sum(shares[f"share_{f}"] for f in _FACTORS)
                frame["mean_log"] = shares["mean_log_contribution"]
                frame["frac_negative"] = sums["n_negative"] / sums["n"]
            else:
                frame["share"] = shares[f"share_{factor}"]
                frame["mean_log"] = shares[f"mean_log_{factor}"]
                frame["frac_negative"] = sums["n_negative_cosine"] / sums["n"] if factor == "cosine" else 0.0
            means = groups[factor].mean().rename("mean").reset_index()
            frame = frame.merge(means, on=by, how="left").merge(q, on=by, how="left")
            frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    for col in ("layer", "head"):
        if col not in table:
            table[col] = pd.NA
        table[col] = table[col].astype("Int64")
    if "sink_rate" not in table:
        table["sink_rate"] = np.nan
    columns = ["scope", "layer", "head", "sink_rate", "num_heads", "token_class", "factor", "n", "n_excluded", "share",
               "mean_log", "mean", "frac_negative", "q10", "q25", "median", "q75", "q90"]
    order = {"head": 0, "layer": 1, "sink_heads": 2, "other_heads": 3, "model": 4}
    table = table[columns].sort_values(["scope", "layer", "head", "token_class", "factor"],
                                       key=lambda c: c.map(order) if c.name == "scope" else c, na_position="last")
    return table.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------
# 3. anti-alignment of the sink's value
# ---------------------------------------------------------------------------------------------------


class _AntiAlignmentCollector(_Collector):
    """Piece ``points``: per (sequence, layer, head, position p >= 1) alpha_p0, cos(v~_0, v~_p) (key p),
    cos(v~_0, s_p) (query p), and per-sequence constants."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows = []

    def on_layer(self, s):
        v = s.values  # [b, h, k, d]
        b, h, T, _ = v.shape
        norms = s.value_norm  # [b, h, k]
        cos_vv = s.sink_inner(v) / (norms[..., :1] * norms)
        cos_vs = s.sink_inner(s.semantic) / (norms[..., :1] * s.semantic_norm)
        axis = v[:, :, 1:].mean(2, keepdim=True)
        cos_axis = s.sink_inner(axis)[..., 0] / (norms[..., 0] * s.norm(axis)[..., 0])  # [b, h]
        tail_median = norms[..., 1:].median(-1).values

        def per_row(x):  # [b, h] -> one value per row
            return np.repeat(_np(x), T - 1)

        cols = _grid((b, h, T - 1), ("sequence", "head", "position"), {"sequence": self.start, "position": 1})
        self.rows.append(pd.DataFrame({
            "layer": np.full(b * h * (T - 1), s.layer, np.int32), **cols,
            "alpha0": _np(s.probs[:, :, 1:, 0]), "cos_value": _np(cos_vv[..., 1:]),
            "cos_semantic": _np(cos_vs[..., 1:]), "cos_axis": per_row(cos_axis),
            "sink_value_norm": per_row(norms[..., 0]), "relative_sink_value_norm": per_row(norms[..., 0] / tail_median),
        }))

    def finish(self, logits):
        return {"points": _concat(self.rows)}


def anti_alignment(
    model,
    tokenizer,
    data,
    *,
    eps: float = 0.3,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> pd.DataFrame:
    """Per (layer, head): does the sink's projected value point against the others?

    Per sequence and head: ``cos(v~_0, v~_j)`` for every key j >= 1; ``cos(v~_0, s_i)`` for every query
    i >= 1, with s_i = sum_{j>0} alpha_ij v~_j the head's non-sink ("semantic") output component;
    ``cos(v~_0, m)`` with m = mean_{j>=1} v~_j the semantic mean of the sequence.
    One row per (layer, head): ``sink_rate`` (mean alpha_i0, queries >= 1), ``is_sink_head`` (> eps),
    ``cos_value_mean``/``_median``/``_frac_negative`` (over keys and sequences),
    ``cos_semantic_mean``/``_median``/``_frac_negative`` (over queries and sequences; queries whose s_i is
    zero are skipped), ``cos_semantic_weighted`` (the same mean weighted by alpha_i0 (1 - alpha_i0): the
    queries where both components matter), ``cos_axis_mean`` (over sequences), ``sink_value_norm`` (mean
    of ||v~_0||) and ``relative_sink_value_norm`` (||v~_0|| / median_j ||v~_j||, mean over sequences).
    """
    del seed
    common = {k: v for k, v in locals().items() if k in _COMMON}
    parts, _ = _run(model, tokenizer, data, [_Spec("anti_alignment", _AntiAlignmentCollector, {})], **common)
    return _anti_alignment_table(parts["anti_alignment"]["points"], eps)


def _anti_alignment_table(points: pd.DataFrame, eps: float) -> pd.DataFrame:
    g = points.groupby(["layer", "head"])
    weight = points["alpha0"] * (1 - points["alpha0"])
    finite = points["cos_semantic"].notna()
    weighted = (points["cos_semantic"].where(finite, 0) * weight.where(finite, 0)).groupby(
        [points["layer"], points["head"]]).sum() / weight.where(finite, 0).groupby([points["layer"], points["head"]]).sum()
    per_sequence = points.groupby(["layer", "head", "sequence"])[["cos_axis", "sink_value_norm", "relative_sink_value_norm"]].first()
    table = pd.DataFrame({
        "sink_rate": g["alpha0"].mean(),
        "cos_value_mean": g["cos_value"].mean(),
        "cos_value_median": g["cos_value"].median(),
        "cos_value_frac_negative": g["cos_value"].apply(lambda x: float((x < 0).mean())),
        "cos_semantic_mean": g["cos_semantic"].mean(),
        "cos_semantic_median": g["cos_semantic"].median(),
        "cos_semantic_frac_negative": g["cos_semantic"].apply(lambda x: float((x.dropna() < 0).mean())),
        "cos_semantic_weighted": weighted,
        "cos_axis_mean": per_sequence["cos_axis"].groupby(["layer", "head"]).mean(),
        "sink_value_norm": per_sequence["sink_value_norm"].groupby(["layer", "head"]).mean(),
        "relative_sink_value_norm": per_sequence["relative_sink_value_norm"].groupby(["layer", "head"]).mean(),
    }).reset_index()
    table.insert(3, "is_sink_head", table["sink_rate"] > eps)
    return table


# ---------------------------------------------------------------------------------------------------
# 4. convexity of the output norm in the sink rate
# ---------------------------------------------------------------------------------------------------


class ConvexityTables(NamedTuple):
    """``fits``: one row per head (plus one pooled "model" row); ``curves``: binned norm against alpha_i0."""

    fits: pd.DataFrame
    curves: pd.DataFrame


class _ConvexityCollector(_Collector):
    """Piece ``points``: per (sequence, layer, head, query >= 1) alpha_i0, ||o^h_i|| and the inner products
    ||v~_0||^2, ||s_i||^2, <v~_0, s_i> from which the two-vector reference is built."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows = []

    def on_layer(self, s):
        b, h, T, _ = s.probs.shape
        cols = _grid((b, h, T - 1), ("sequence", "head", "query"), {"sequence": self.start, "query": 1})
        self.rows.append(pd.DataFrame({
            "layer": np.full(b * h * (T - 1), s.layer, np.int32), **cols,
            "alpha0": _np(s.probs[:, :, 1:, 0]), "norm": _np(s.output_norm[..., 1:]),
            "v0_sq": np.repeat(_np(s.value_norm[..., 0] ** 2), T - 1), "s_sq": _np(s.semantic_norm[..., 1:] ** 2),
            "v0_s": _np(s.sink_inner(s.semantic)[..., 1:]),
        }))

    def finish(self, logits):
        return {"points": _concat(self.rows)}


def convexity(
    model,
    tokenizer,
    data,
    *,
    bins: int = 10,
    fit_on: str = "norm",
    min_range: float = 0.05,
    eps: float = 0.3,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> ConvexityTables:
    """Head output norm ||o^h_i|| as a function of the sink rate a_i = alpha^h_i0, over queries i >= 1.

    Every head output is a two-vector mixture o_i = a_i v~_0 + (1 - a_i) s^_i with s^_i = s_i / (1 - a_i)
    the normalised semantic component (a convex combination of the tail values).

    ``fits``: per (layer, head) a least-squares quadratic y = c2 a^2 + c1 a + c0 through the points
    (a_i, y_i), y = ||o^h_i|| (``fit_on="norm"``) or ||o^h_i||^2 (``"squared_norm"``, exactly quadratic in
    a for a fixed pair v~_0, s^). Columns: ``sink_rate``, ``is_sink_head``, ``n``, ``alpha_q05``/``alpha_q95``
    (the range of a the fit sees), ``curvature`` (= c2; the second derivative is 2 c2), ``linear``,
    ``constant``, ``alpha_star`` (= -c1 / 2 c2, the vertex), ``interior_minimum`` (c2 > 0 and
    0 < alpha_star < 1), ``minimum_in_range`` (also alpha_q05 <= alpha_star <= alpha_q95: the minimum is
    observed, not extrapolated), ``r2``, ``two_vector_alpha_star`` (median over queries of the analytic
    minimiser of ||a v~_0 + (1 - a) s^_i||, <s^, s^ - v~_0> / ||s^ - v~_0||^2), ``reference_alpha_star``
    (argmin over a 201-point grid of the averaged reference curve below), ``share_sink_suppresses`` (share
    of queries whose output is shorter than its semantic component, ||o_i|| < ||s_i||: the sink term
    interferes destructively) and ``median_norm_over_semantic`` (median ||o_i|| / ||s_i||). Heads whose a spans less than
    ``min_range`` (q95 - q05) are not fitted (NaN, ``fitted`` False). Two rows fit the pooled points of
    all heads, made dimensionless: "model" divides each head's vectors by that head's mean output norm,
    "model_v0" divides each point's vectors by its ||v~_0|| (so y = 1 at a = 1).

    ``curves``: per (scope, layer, head, bin) of a in ``bins`` equal bins on [0, 1]: ``n``, ``alpha_mean``,
    ``norm_mean``, ``norm_median``, ``fitted`` (the quadratic at the bin centre, in the fitted y's
    units: ||o|| or ||o||^2), and ``reference_norm``: the mean over *all* the head's queries of
    ||c v~_0 + (1 - c) s^_i|| at the bin centre c, i.e. what the norm would be if only the sink rate
    changed. "model" and "model_v0" rows pool the heads, normalised as in ``fits``.
    """
    if fit_on not in ("norm", "squared_norm"):
        raise ValueError(f"fit_on must be 'norm' or 'squared_norm', not {fit_on!r}")
    del seed
    common = {k: v for k, v in locals().items() if k in _COMMON}
    parts, _ = _run(model, tokenizer, data, [_Spec("convexity", _ConvexityCollector, {})], **common)
    return _convexity_tables(parts["convexity"]["points"], bins, fit_on, min_range, eps)


def _reference_norm(a: np.ndarray, c: np.ndarray | float, v0_sq, s_sq, v0_s) -> np.ndarray:
    """||c v~_0 + (1 - c) s^|| with s^ = s / (1 - a), from the stored inner products (broadcasts)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        k = (1 - c) / (1 - a)  # coefficient of s
        sq = c**2 * v0_sq + 2 * c * k * v0_s + k**2 * s_sq
    return np.sqrt(np.clip(sq, 0, None))


def _mean_reference(a, grid, v0_sq, s_sq, v0_s, chunk: int = 4_000_000) -> np.ndarray:
    """Mean over points of :func:`_reference_norm` at every ``grid`` value ``[len(grid)]`` (NaN: no point)."""
    if len(a) == 0:
        return np.full(len(grid), np.nan)
    step = max(1, chunk // len(grid))
    total, count = np.zeros(len(grid)), np.zeros(len(grid))
    for i in range(0, len(a), step):
        part = slice(i, i + step)
        values = _reference_norm(a[part, None], grid[None, :], v0_sq[part, None], s_sq[part, None], v0_s[part, None])
        finite = np.isfinite(values)
        total += np.where(finite, values, 0).sum(0)
        count += finite.sum(0)
    with np.errstate(invalid="ignore"):
        return total / count


def _quadratic_fit(a: np.ndarray, y: np.ndarray, min_range: float) -> dict:
    ok = np.isfinite(a) & np.isfinite(y)
    a, y = a[ok], y[ok]
    out = {"n": int(len(a)), "alpha_q05": np.nan, "alpha_q95": np.nan, "fitted": False, "curvature": np.nan,
           "linear": np.nan, "constant": np.nan, "alpha_star": np.nan, "r2": np.nan}
    if len(a) < 3:
        return out
    out["alpha_q05"], out["alpha_q95"] = np.quantile(a, [0.05, 0.95])
    if out["alpha_q95"] - out["alpha_q05"] < min_range:
        return out
    c2, c1, c0 = np.polyfit(a, y, 2)
    residual = y - np.polyval([c2, c1, c0], a)
    total = ((y - y.mean()) ** 2).sum()
    out.update(fitted=True, curvature=c2, linear=c1, constant=c0,
               alpha_star=-c1 / (2 * c2) if c2 != 0 else np.nan,
               r2=1 - (residual**2).sum() / total if total > 0 else np.nan)
    return out


def _convexity_tables(points: pd.DataFrame, bins: int, fit_on: str, min_range: float, eps: float) -> ConvexityTables:
    edges = np.linspace(0, 1, bins + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    grid = np.linspace(0, 1, 201)
    fits, curves = [], []
    groups = [(("head", layer, head), frame, None) for (layer, head), frame in points.groupby(["layer", "head"])]
    # pooled over heads, made dimensionless per head (by its mean output norm) or per point (by ||v~_0||)
    groups.append((("model", pd.NA, pd.NA), points, points.groupby(["layer", "head"])["norm"].transform("mean")))
    groups.append((("model_v0", pd.NA, pd.NA), points, np.sqrt(points["v0_sq"].clip(lower=0))))
    for (scope, layer, head), frame, scale in groups:
        a = frame["alpha0"].to_numpy(float)
        v0_sq, s_sq, v0_s = (frame[c].to_numpy(float) for c in ("v0_sq", "s_sq", "v0_s"))
        norm = frame["norm"].to_numpy(float)
        if scale is not None:  # divide every vector by the scale
            scale = scale.to_numpy(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                norm, v0_s, s_sq, v0_sq = norm / scale, v0_s / scale**2, s_sq / scale**2, v0_sq / scale**2
        y = norm if fit_on == "norm" else norm**2
        fit = _quadratic_fit(a, y, min_range)
        with np.errstate(divide="ignore", invalid="ignore"):
            s_hat_sq = s_sq / (1 - a) ** 2
            s_hat_v0 = v0_s / (1 - a)
            gap = s_hat_sq - 2 * s_hat_v0 + v0_sq  # ||s^ - v0||^2
            two_vector = (s_hat_sq - s_hat_v0) / gap
        usable = a < 1 - 1e-6  # s^ undefined where all attention is on the sink
        curve = _mean_reference(a[usable], np.concatenate([grid, centres]), v0_sq[usable], s_sq[usable], v0_s[usable])
        reference, at_centres = curve[: len(grid)], curve[len(grid):]
        with np.errstate(divide="ignore", invalid="ignore"):
            to_semantic = norm / np.sqrt(np.clip(s_sq, 0, None))  # ||o_i|| / ||s_i|| (scale-free)
        fits.append({"scope": scope, "layer": layer, "head": head, "sink_rate": a.mean(), **fit,
                     "share_sink_suppresses": float(np.mean(to_semantic[np.isfinite(to_semantic)] < 1)),
                     "median_norm_over_semantic": float(np.nanmedian(to_semantic)),
                     "two_vector_alpha_star": float(np.nanmedian(two_vector[usable])) if usable.any() else np.nan,
                     "reference_alpha_star": float(grid[np.nanargmin(reference)]) if np.isfinite(reference).any() else np.nan})
        which = np.clip(np.digitize(a, edges[1:-1]), 0, bins - 1)
        for k in range(bins):
            inside = which == k
            curves.append({
                "scope": scope, "layer": layer, "head": head, "bin": k, "bin_low": edges[k], "bin_high": edges[k + 1],
                "bin_centre": centres[k], "n": int(inside.sum()),
                "alpha_mean": a[inside].mean() if inside.any() else np.nan,
                "norm_mean": norm[inside].mean() if inside.any() else np.nan,
                "norm_median": float(np.median(norm[inside])) if inside.any() else np.nan,
                "fitted": np.polyval([fit["curvature"], fit["linear"], fit["constant"]], centres[k]) if fit["fitted"] else np.nan,
                "reference_norm": at_centres[k],
            })
    fits = pd.DataFrame(fits)
    fits["is_sink_head"] = fits["sink_rate"] > eps
    fits["interior_minimum"] = fits["fitted"] & (fits["curvature"] > 0) & (fits["alpha_star"] > 0) & (fits["alpha_star"] < 1)
    fits["minimum_in_range"] = fits["interior_minimum"] & (fits["alpha_star"] >= fits["alpha_q05"]) & (
        fits["alpha_star"] <= fits["alpha_q95"])
    fits["fit_on"] = fit_on
    curves = pd.DataFrame(curves)
    for table in (fits, curves):
        for col in ("layer", "head"):
            table[col] = table[col].astype("Int64")
    columns = ["scope", "layer", "head", "sink_rate", "is_sink_head", "n", "alpha_q05", "alpha_q95", "fitted", "fit_on",
               "curvature", "linear", "constant", "alpha_star", "interior_minimum", "minimum_in_range", "r2",
               "two_vector_alpha_star", "reference_alpha_star", "share_sink_suppresses", "median_norm_over_semantic"]
    return ConvexityTables(fits[columns], curves)


# ---------------------------------------------------------------------------------------------------
# 5. the semantic cone: remove the sink, watch the heads and the perplexity
# ---------------------------------------------------------------------------------------------------


class _Clean(NamedTuple):
    mixed: torch.Tensor  # z^h_i [b, h, q, d]
    output_norm: torch.Tensor  # ||o^h_i|| [b, h, q]
    rate: torch.Tensor  # mean alpha_i0 over queries >= 1, [b, h]


class SemanticConeTables(NamedTuple):
    """``by_quantile``: per (condition, output-norm quantile); ``heads``: per (condition, layer, head);
    ``ppl``: per condition."""

    by_quantile: pd.DataFrame
    heads: pd.DataFrame
    ppl: pd.DataFrame


CONDITIONS = ("sink", "sink_renorm", "control")


def _token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood ``[b, T-1]`` (float64)."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -logp.gather(-1, ids[:, 1:, None].to(logp.device))[..., 0].double()


class _SemanticConeCollector(_Collector):
    """Clean measurements from the shared pass; :meth:`finish` runs one intervened pass per condition.

    Pieces: ``points`` (per condition, layer, sequence, head, touched query: clean and intervened norm and
    axis cosine, drift), ``sequences`` (per sequence: summed NLL per condition, control key) and
    ``heads`` (per layer, sequence, head: clean sink rate, whether intervened, mean clean norm).
    """

    needs_logits = True

    def __init__(self, *args, heads, threshold, seed):
        super().__init__(*args)
        self.heads, self.threshold, self.seed = heads, threshold, seed
        self.clean: dict[int, _Clean] = {}
        self.clean_measure: dict[int, dict] = {}

    @staticmethod
    def measure(s: _LayerState) -> dict:
        """||o^h_i|| and cos(o^h_i, m_i), m_i = mean_{1<=j<=i} v~_j, each ``[b, h, q]`` (query 0: NaN)."""
        v = s.values[:, :, 1:]
        T = s.values.shape[2]
        counts = torch.arange(1, T, dtype=v.dtype, device=v.device)[None, None, :, None]
        axis = torch.cat([torch.zeros_like(v[:, :, :1]), v.cumsum(2) / counts], 2)
        return {"norm": s.output_norm, "cos": s.inner(s.mixed, axis) / (s.output_norm * s.norm(axis))}

    def on_layer(self, s):
        self.clean[s.layer] = _Clean(s.mixed, s.output_norm, s.probs[:, :, 1:, 0].mean(-1))
        self.clean_measure[s.layer] = self.measure(s)

    def finish(self, logits):
        ids, start = self.ids, self.start
        b, T = ids.shape
        nll_clean = _token_nll(logits, ids)
        rates = {l: c.rate for l, c in self.clean.items()}  # [b, h]
        selected = {l: (r > self.threshold) if self.heads == "sink" else torch.ones_like(r, dtype=torch.bool)
                    for l, r in rates.items()}
        control_key = np.array([np.random.default_rng([self.seed, start + i]).integers(1, T - 1) if T > 2 else 1
                                for i in range(b)])
        q = torch.arange(T)
        key = torch.as_tensor(control_key)
        sink_rows = (q[:, None] >= 1) & (q[None, :] == 0)  # [q, k]
        control_rows = (q[None, :, None] > key[:, None, None]) & (q[None, None, :] == key[:, None, None])  # [b, q, k]
        masks = {
            "sink": {l: sel[:, :, None, None] & sink_rows.to(sel.device)[None, None] for l, sel in selected.items()},
            "sink_renorm": {},
            "control": {l: sel[:, :, None, None] & control_rows.to(sel.device)[:, None] for l, sel in selected.items()},
        }
        touched = {"sink": (q >= 1)[None, :].expand(b, T), "sink_renorm": (q >= 1)[None, :].expand(b, T),
                   "control": q[None, :] > key[:, None]}  # [b, q]
        sequences = {"sequence": np.arange(start, start + b, dtype=np.int32), "control_key": control_key,
                     "n_tokens": np.full(b, T - 1), "nll_clean": _np(nll_clean.sum(-1))}
        frames = []
        for condition in CONDITIONS:
            after: dict[int, dict] = {}

            def on_layer(s: _LayerState, after=after):
                m = self.measure(s)
                c = self.clean[s.layer]
                m["drift"] = s.inner(c.mixed, s.mixed) / (c.output_norm * s.output_norm)
                after[s.layer] = m

            logits = _forward(self.model, ids, on_layer, masks=masks[condition],
                              renormalise=selected if condition == "sink_renorm" else None, logits=True,
                              compute_dtype=self.dtype)
            sequences[f"nll_{condition}"] = _np(_token_nll(logits, ids).sum(-1))
            del logits
            for layer, m in sorted(after.items()):
                keep = selected[layer][:, :, None] & touched[condition][:, None, :].to(selected[layer].device)
                bi, hi, qi = torch.nonzero(keep, as_tuple=True)
                c = self.clean_measure[layer]
                frames.append(pd.DataFrame({
                    "condition": condition, "layer": np.full(len(bi), layer, np.int32),
                    "sequence": (_np(bi) + start).astype(np.int32), "head": _np(hi).astype(np.int32),
                    "query": _np(qi).astype(np.int32),
                    "norm_clean": _np(c["norm"][bi, hi, qi]).astype(np.float32),
                    "cos_clean": _np(c["cos"][bi, hi, qi]).astype(np.float32),
                    "norm_after": _np(m["norm"][bi, hi, qi]).astype(np.float32),
                    "cos_after": _np(m["cos"][bi, hi, qi]).astype(np.float32),
                    "drift": _np(m["drift"][bi, hi, qi]).astype(np.float32),
                }))
        heads = _concat([pd.DataFrame({
            "layer": np.full(rates[l].numel(), l, np.int32),
            **_grid(tuple(rates[l].shape), ("sequence", "head"), {"sequence": start}),
            "sink_rate": _np(rates[l]), "selected": _np(selected[l]),
            "norm_clean_mean": _np(self.clean_measure[l]["norm"][:, :, 1:].mean(-1)),
        }) for l in sorted(rates)])
        return {"points": _concat(frames), "sequences": pd.DataFrame(sequences), "heads": heads}


def semantic_cone(
    model,
    tokenizer,
    data,
    *,
    heads: str = "all",
    threshold: float = 0.3,
    quantiles: int = 5,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> SemanticConeTables:
    """Remove the sink's value in every layer and compare head outputs and perplexity with a control.

    Conditions (each one forward pass intervening in every layer at once, on queries i >= 1; query 0,
    whose only key is the sink itself, is left alone so the sink token's own stream is only changed
    through the layers below):

    * ``sink``: alpha_i0 := 0 without renormalising: the term alpha_i0 v~_0 is removed and the head output
      becomes its semantic component s_i. This is "removing the sink's value vector": it is the same as
      setting v~_0 = 0 for these queries.
    * ``sink_renorm``: the sink is left out of the softmax: alpha_i0 := 0 and the other probabilities are
      divided by their sum 1 - alpha_i0, so the output becomes s^_i = s_i / (1 - alpha_i0). The sink's
      term is gone *and* its mass goes to the other tokens, whose relative weights are kept (what the
      head would do if key 0 were masked out). It separates "the sink's vector is missing" from "the
      output norm collapses": ``sink`` changes both, ``sink_renorm`` only the first.
    * ``control``: one non-sink key r per sequence, uniform in 1..T-2 (seeded), gets alpha_ir := 0 for
      all queries i > r, without renormalising (the same kind of removal as ``sink``, of a random token).

    ``heads``: "all", or "sink": only heads whose clean sink rate in that sequence (mean alpha_i0 over
    queries >= 1) exceeds ``threshold``; the control uses the same heads.

    Per head and query the clean and the intervened run give ||o^h_i|| and cos(o^h_i, m_i) with
    m_i = mean_{1<=j<=i} v~_j, the axis of the semantic cone visible to query i (from each run's own
    values), and the drift cos(o^h_i clean, o^h_i intervened). Measured over the queries the
    condition touches (control: i > r) in the selected heads.

    ``by_quantile``: per (binning, condition, quantile), columns ``n``, ``norm_clean``, ``norm_after``
    (means), ``norm_ratio`` (median of after/clean), ``cos_clean``, ``cos_after``, ``delta_cos`` (means),
    ``drift`` (mean). Two binnings into ``quantiles`` bins (1 = lowest norm): ``within_head`` bins each
    output o^h_i by the quantile of its clean norm among its own head's outputs (low-norm *outputs*);
    ``across_heads`` bins whole heads by their mean clean output norm among the model's heads
    (low-norm *heads*).
    ``heads``: the same per (condition, layer, head), plus ``sink_rate``, ``selected`` (share of
    sequences in which the head was intervened on), ``head_norm`` (mean clean norm) and
    ``norm_quantile_of_head`` (its rank among the model's heads, in (0, 1]).
    ``ppl``: per condition ``ppl_clean``, ``ppl`` (exp of the mean token NLL over all sequences),
    ``delta_ppl``, ``delta_log_ppl`` (mean over sequences of the per-sequence difference of mean NLL)
    with a normal 95% interval ``ci_low``/``ci_high``, ``num_sequences``.
    """
    if heads not in ("all", "sink"):
        raise ValueError(f"heads must be 'all' or 'sink', not {heads!r}")
    common = {k: v for k, v in locals().items() if k in _COMMON}
    spec = _Spec("semantic_cone", _SemanticConeCollector, {"heads": heads, "threshold": threshold, "seed": seed})
    parts, _ = _run(model, tokenizer, data, [spec], **common)
    p = parts["semantic_cone"]
    return _cone_tables(p["points"], p["sequences"], p["heads"], quantiles)


def _cone_stats(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    g = frame.assign(ratio=frame["norm_after"] / frame["norm_clean"], delta_cos=frame["cos_after"] - frame["cos_clean"]).groupby(by)
    return pd.DataFrame({
        "n": g.size(), "norm_clean": g["norm_clean"].mean(), "norm_after": g["norm_after"].mean(),
        "norm_ratio": g["ratio"].median(), "cos_clean": g["cos_clean"].mean(), "cos_after": g["cos_after"].mean(),
        "delta_cos": g["delta_cos"].mean(), "drift": g["drift"].mean(),
    }).reset_index()


def _within_head_quantile(points: pd.DataFrame, quantiles: int) -> np.ndarray:
    """1..quantiles: the quantile of each point's clean output norm within its head (edges over all of
    the head's touched queries and sequences in the ``sink`` condition)."""
    clean = points[points["condition"] == "sink"][["layer", "head", "norm_clean"]]
    edges = clean.groupby(["layer", "head"])["norm_clean"].quantile(np.linspace(0, 1, quantiles + 1)[1:-1]).unstack()
    edge_rows = edges.loc[pd.MultiIndex.from_frame(points[["layer", "head"]])].to_numpy() if len(edges.columns) else \
        np.zeros((len(points), 0))
    return 1 + (points["norm_clean"].to_numpy()[:, None] > edge_rows).sum(1)


def _head_summary(heads: pd.DataFrame, quantiles: int) -> pd.DataFrame:
    """Per (layer, head): sink rate, selected, mean clean norm, its rank among the heads and its bin."""
    summary = heads.groupby(["layer", "head"]).agg(sink_rate=("sink_rate", "mean"), selected=("selected", "mean"),
                                                    head_norm=("norm_clean_mean", "mean")).reset_index()
    summary["norm_quantile_of_head"] = summary["head_norm"].rank(pct=True)
    # heads binned by their mean clean output norm among the model's heads
    summary["head_bin"] = np.ceil(summary["norm_quantile_of_head"] * quantiles).clip(1, quantiles).astype(int)
    return summary


def cone_points(raw: dict[str, pd.DataFrame], quantiles: int = 5) -> pd.DataFrame:
    """The per-output rows of :func:`semantic_cone` with their bins, for intervals over sequences.

    ``raw``: the semantic cone's raw pieces (``run_analyses(..., raw=True)["raw"]["semantic_cone"]``).
    Returns its ``points`` (condition, layer, sequence, head, query, norm_clean, cos_clean, norm_after,
    cos_after, drift) plus ``quantile`` (the ``within_head`` bin of ``by_quantile``), ``head_bin`` (the
    ``across_heads`` bin), ``sink_rate`` (the head's), ``log_norm_ratio`` = log(norm_after / norm_clean)
    and ``delta_cos`` = cos_after - cos_clean.
    """
    points = raw["points"]
    summary = _head_summary(raw["heads"], quantiles)
    out = points.assign(quantile=_within_head_quantile(points, quantiles))
    out = out.merge(summary[["layer", "head", "head_bin", "sink_rate"]], on=["layer", "head"], how="left")
    with np.errstate(divide="ignore", invalid="ignore"):
        out["log_norm_ratio"] = np.log(out["norm_after"].to_numpy(float) / out["norm_clean"].to_numpy(float))
    out["delta_cos"] = out["cos_after"] - out["cos_clean"]
    return out


def _cone_tables(points: pd.DataFrame, sequences: pd.DataFrame, heads: pd.DataFrame, quantiles: int) -> SemanticConeTables:
    points = points.assign(quantile=_within_head_quantile(points, quantiles))
    summary = _head_summary(heads, quantiles)
    by_head = points.merge(summary[["layer", "head", "head_bin"]], on=["layer", "head"], how="left")
    by_quantile = pd.concat([
        _cone_stats(points, ["condition", "quantile"]).assign(binning="within_head"),
        _cone_stats(by_head.drop(columns="quantile").rename(columns={"head_bin": "quantile"}),
                    ["condition", "quantile"]).assign(binning="across_heads"),
    ], ignore_index=True)
    by_quantile = by_quantile[["binning", *[c for c in by_quantile.columns if c != "binning"]]]
    per_head = _cone_stats(points, ["condition", "layer", "head"])
    per_head = summary.drop(columns="head_bin").merge(per_head, on=["layer", "head"], how="right")
    rows = []
    n_tokens = sequences["n_tokens"].sum()
    for condition in CONDITIONS:
        ppl_clean = math.exp(sequences["nll_clean"].sum() / n_tokens)
        ppl = math.exp(sequences[f"nll_{condition}"].sum() / n_tokens)
        diff = (sequences[f"nll_{condition}"] - sequences["nll_clean"]) / sequences["n_tokens"]
        half = 1.96 * diff.std(ddof=1) / math.sqrt(len(diff)) if len(diff) > 1 else np.nan
        rows.append({"condition": condition, "ppl_clean": ppl_clean, "ppl": ppl, "delta_ppl": ppl - ppl_clean,
                     "delta_log_ppl": diff.mean(), "ci_low": diff.mean() - half, "ci_high": diff.mean() + half,
                     "num_sequences": len(diff)})
    return SemanticConeTables(by_quantile, per_head, pd.DataFrame(rows))


# ---------------------------------------------------------------------------------------------------
# all five in one go
# ---------------------------------------------------------------------------------------------------


ANALYSES = ("rates", "decomposition", "anti_alignment", "convexity", "semantic_cone")


def run_analyses(
    model,
    tokenizer,
    data,
    analyses: Iterable[str] = ANALYSES,
    *,
    eps: float = 0.3,
    kind: str = "intra",
    quantile_sample: int = 128,
    sample_size: int = 2000,
    bins: int = 10,
    fit_on: str = "norm",
    min_range: float = 0.05,
    heads: str = "all",
    threshold: float = 0.3,
    quantiles: int = 5,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    raw: bool = False,
    precompute: Iterable[str] = (),
) -> dict:
    """Several analyses sharing one clean forward pass per batch; options as in the single functions.

    Returns ``{name: result}`` with the results of :func:`sink_rates` (``rates``),
    :func:`sink_decomposition`, :func:`anti_alignment`, :func:`convexity` and :func:`semantic_cone`,
    equal to what those functions return (they share the cache: calling one afterwards reads it).
    With ``raw=True`` the result also holds ``"raw"``: ``{name: {part: DataFrame}}``, the per-point
    material the tables are made from (e.g. for intervals over sequences with :func:`sequence_bootstrap`;
    :func:`cone_points` bins the semantic cone's). ``raw`` is not part of the cache key.

    ``precompute``: further analyses whose raw material is computed in the same forward passes and
    cached, without building their tables (which can take longer than reading them): a later call for
    them with the same options reads the cache. Several callers that each need some of the analyses
    (the book's sink chapters) can pass ``precompute=ANALYSES`` so that whichever runs first does one
    shared pass for all of them.
    """
    analyses = list(analyses)
    precompute = [a for a in dict.fromkeys(precompute) if a not in analyses]
    unknown = sorted((set(analyses) | set(precompute)) - set(ANALYSES))
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {', '.join(ANALYSES)}")
    if kind not in ("intra", "inter"):
        raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")
    if heads not in ("all", "sink"):
        raise ValueError(f"heads must be 'all' or 'sink', not {heads!r}")
    if fit_on not in ("norm", "squared_norm"):
        raise ValueError(f"fit_on must be 'norm' or 'squared_norm', not {fit_on!r}")
    specs = _specs(kind=kind, quantile_sample=quantile_sample, seed=seed, heads=heads, threshold=threshold)
    common = {k: v for k, v in locals().items() if k in _COMMON}
    parts, blocks = _run(model, tokenizer, data, [specs[a] for a in analyses + precompute], **common)
    options = dict(eps=eps, sample_size=sample_size, seed=seed, bins=bins, fit_on=fit_on, min_range=min_range,
                   quantiles=quantiles)
    results = {name: _tables(name, parts[name], blocks, **options) for name in analyses}
    if raw:
        results["raw"] = {name: parts[name] for name in analyses}
    return results


def _specs(kind, quantile_sample, seed, heads, threshold) -> dict[str, _Spec]:
    return {
        "rates": _Spec("rates", _RatesCollector, {}),
        "decomposition": _Spec("decomposition", _DecompositionCollector,
                               {"kind": kind, "quantile_sample": quantile_sample, "seed": seed}),
        "anti_alignment": _Spec("anti_alignment", _AntiAlignmentCollector, {}),
        "convexity": _Spec("convexity", _ConvexityCollector, {}),
        "semantic_cone": _Spec("semantic_cone", _SemanticConeCollector,
                               {"heads": heads, "threshold": threshold, "seed": seed}),
    }


def _tables(name: str, p: dict[str, pd.DataFrame], blocks: _Blocks, *, eps, sample_size, seed, bins, fit_on,
            min_range, quantiles):
    """One analysis's result from its concatenated raw pieces ``p``."""
    if name == "rates":
        return _rates_table(p["alpha0"], eps, blocks)
    if name == "decomposition":
        return _decomposition_tables(p, sample_size, seed, eps)
    if name == "anti_alignment":
        return _anti_alignment_table(p["points"], eps)
    if name == "convexity":
        return _convexity_tables(p["points"], bins, fit_on, min_range, eps)
    return _cone_tables(p["points"], p["sequences"], p["heads"], quantiles)


# ---------------------------------------------------------------------------------------------------
# intervals and verdicts (the book's sink chapters state each claim with an interval and a verdict)
# ---------------------------------------------------------------------------------------------------


def _percentile_interval(replicates: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    tail = 100 * (1 - level) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN
        return np.nanpercentile(replicates, tail, axis=0), np.nanpercentile(replicates, 100 - tail, axis=0)


def bootstrap_ci(values, statistic=np.median, *, n_bootstrap: int = 1000, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """``(statistic(values), low, high)``: a percentile bootstrap interval, resampling the values.

    ``statistic`` takes an array and ``axis=`` (np.median, np.mean, ...). NaNs are dropped first;
    with fewer than two values the interval is NaN.
    """
    x = np.asarray(values, dtype=float)
    x = x[np.isfinite(x)]
    if len(x) == 0:
        return (np.nan, np.nan, np.nan)
    estimate = float(statistic(x, axis=0))
    if len(x) < 2:
        return (estimate, np.nan, np.nan)
    rng = np.random.default_rng(seed)
    replicates = statistic(x[rng.integers(0, len(x), (n_bootstrap, len(x)))], axis=1)
    low, high = _percentile_interval(replicates[:, None], level)
    return (estimate, float(low[0]), float(high[0]))


def spearman_ci(x, y, *, n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Spearman's rho of the pairs (x, y) and a percentile bootstrap interval resampling the pairs.

    Pairs with a NaN are dropped; ties get average ranks (as :func:`scipy.stats.spearmanr`).
    Returns ``(rho, low, high)``; NaN where undefined (fewer than three pairs, a constant variable).
    """
    from scipy.stats import rankdata

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3:
        return (np.nan, np.nan, np.nan)

    def rho(a, b):  # row-wise Pearson correlation of ranks, [r, n] -> [r]
        ra, rb = rankdata(a, axis=-1), rankdata(b, axis=-1)
        ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean(-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))

    estimate = float(rho(x[None], y[None])[0])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), (n_bootstrap, len(x)))
    low, high = _percentile_interval(rho(x[idx], y[idx])[:, None], level)
    return (estimate, float(low[0]), float(high[0]))


def share_ci(flags, *, level: float = 0.95) -> tuple[float, float, float]:
    """The share of true ``flags`` (NaN/None dropped) with its Wilson score interval: ``(share, low, high)``.

    Used for shares of heads (e.g. heads with an interior minimum); unlike a bootstrap, the Wilson
    interval does not collapse to a point when every head agrees.
    """
    from scipy.stats import norm

    f = pd.Series(flags, dtype="object").dropna().astype(bool).to_numpy()
    n = len(f)
    if n == 0:
        return (np.nan, np.nan, np.nan)
    p = f.mean()
    z = norm.ppf(0.5 + level / 2)
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return (float(p), float(max(0.0, centre - half)), float(min(1.0, centre + half)))


class SequenceBootstrap(NamedTuple):
    """``table``: per group, ``n`` (rows), ``n_sequences`` and each column's pooled mean with ``<column>_low`` /
    ``<column>_high``; ``replicates``: ``{column: [n_bootstrap, group]}``, groups in ``table``'s row order. The
    same resampled sequences are used for every group and column, so replicates of two groups can be
    subtracted for a paired interval of their difference."""

    table: pd.DataFrame
    replicates: dict[str, np.ndarray]


def sequence_bootstrap(points: pd.DataFrame, columns, by=(), *, weight: str | None = None, unit: str = "sequence",
                       n_bootstrap: int = 1000, seed: int = 0, level: float = 0.95) -> SequenceBootstrap:
    """Means of ``columns`` per group ``by``, pooled over rows, with intervals resampling whole sequences.

    The rows of one sequence (its queries, heads, layers) are not independent, so the percentile
    bootstrap draws the ``unit`` values (sequences) with replacement and pools the rows of each drawn
    sequence. The mean of a column in a group is sum(w x) / sum(w) over its rows with a finite x
    (w = the ``weight`` column, or 1). Groups are in sorted order of ``by``.
    """
    columns = [columns] if isinstance(columns, str) else list(columns)
    by = [by] if isinstance(by, str) else list(by)
    units, unit_index = np.unique(points[unit].to_numpy(), return_inverse=True)
    if by:
        grouped = points.groupby(by, sort=True, observed=True)
        codes = grouped.ngroup().to_numpy()
        table = grouped.size().rename("n").reset_index()
        table["n_sequences"] = grouped[unit].nunique().to_numpy()
    else:
        codes = np.zeros(len(points), dtype=np.int64)
        table = pd.DataFrame({"n": [len(points)], "n_sequences": [len(units)]})
    groups, n_units = len(table), len(units)
    cell = codes * n_units + unit_index
    w_all = np.ones(len(points)) if weight is None else points[weight].to_numpy(float)
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n_units, np.full(n_units, 1 / n_units), size=n_bootstrap).astype(float)  # [B, units]
    replicates = {}
    for column in columns:
        x = points[column].to_numpy(float)
        ok = np.isfinite(x) & np.isfinite(w_all)
        sums = np.bincount(cell[ok], weights=(w_all * x)[ok], minlength=groups * n_units).reshape(groups, n_units)
        counts = np.bincount(cell[ok], weights=w_all[ok], minlength=groups * n_units).reshape(groups, n_units)
        with np.errstate(invalid="ignore", divide="ignore"):
            table[column] = sums.sum(1) / counts.sum(1)
            replicates[column] = (draws @ sums.T) / (draws @ counts.T)
        table[f"{column}_low"], table[f"{column}_high"] = _percentile_interval(replicates[column], level)
        if n_units < 2:
            table[f"{column}_low"] = table[f"{column}_high"] = np.nan
    return SequenceBootstrap(table, replicates)


UNMEASURED = "cannot be evaluated"


def verdict(low: float, high: float, *, threshold: float = 0.0, side: str = "above") -> str:
    """The book's rule for a claim "the statistic is above (``side="above"``) / below ``threshold``",
    given the 95% interval [low, high] of the statistic:

    * ``"holds"``: the whole interval is on the claimed side (low > threshold for "above");
    * ``"does not hold"``: the whole interval is on the other side, the threshold included
      (high <= threshold for "above");
    * ``"inconclusive"``: the interval contains the threshold;
    * :data:`UNMEASURED` when the interval is not defined (NaN).
    """
    if side not in ("above", "below"):
        raise ValueError(f"side must be 'above' or 'below', not {side!r}")
    if not (np.isfinite(low) and np.isfinite(high)):
        return UNMEASURED
    if side == "below":
        low, high, threshold = -high, -low, -threshold
    if low > threshold:
        return "holds"
    if high <= threshold:
        return "does not hold"
    return "inconclusive"


def combine_verdicts(parts) -> str:
    """One verdict for a claim made of several parts, each judged by :func:`verdict`: "holds" if every part
    holds; "holds partly" if some but not all do; otherwise "does not hold" if a part does not hold,
    else "inconclusive". Parts that cannot be evaluated are left out (all of them: :data:`UNMEASURED`)."""
    parts = [p for p in parts if p != UNMEASURED]
    if not parts:
        return UNMEASURED
    held = sum(p == "holds" for p in parts)
    if held == len(parts):
        return "holds"
    if held:
        return "holds partly"
    return "does not hold" if "does not hold" in parts else "inconclusive"


# ---------------------------------------------------------------------------------------------------
# summary of the paper's claims, and the command line
# ---------------------------------------------------------------------------------------------------


def summarize(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The numbers behind each sink claim of PAPER.md section 6 from the CLI's tables.

    ``tables`` maps the CSV stems (``rates``, ``decomposition``, ``anti_alignment``, ``convexity``,
    ``semantic_cone``, ``semantic_cone-ppl``, ...) to their frames. Returns rows (claim, statistic, value).
    """
    out = []

    def add(claim, statistic, value):
        out.append({"claim": claim, "statistic": statistic, "value": float(value) if value is not None else np.nan})

    if "rates" in tables:
        r = tables["rates"]
        add("sink_rate", "sink_eps", r["sink_eps"].iloc[0])
        add("sink_rate", "sink_eps_all_queries", r["sink_eps_all_queries"].iloc[0])
        add("sink_rate", "mean_sink_rate", r["sink_rate"].mean())
        add("sink_rate", "median_sink_rate", r["sink_rate"].median())
        add("sink_rate", "first_token_is_bos", r["first_token_is_bos"].iloc[0])
    if "decomposition" in tables:
        d = tables["decomposition"]
        for scope in ("model", "sink_heads"):
            pooled = d[d["scope"] == scope]
            prefix = "" if scope == "model" else "sink_heads_"
            for cls in ("sink", "tail"):
                for factor in (*_FACTORS, "contribution"):
                    row = pooled[(pooled["token_class"] == cls) & (pooled["factor"] == factor)]
                    if len(row):
                        add("decomposition", f"{prefix}{cls}_{factor}_median", row["median"].iloc[0])
                        add("decomposition", f"{prefix}{cls}_{factor}_mean_log", row["mean_log"].iloc[0])
                        if factor != "contribution":
                            add("decomposition", f"{prefix}{cls}_{factor}_share", row["share"].iloc[0])
        for cls in ("sink", "tail"):  # per head: do relative norm and cosine together explain more than alpha?
            heads = d[(d["scope"] == "head") & (d["token_class"] == cls)]
            shares = heads.pivot_table(index=["layer", "head"], columns="factor", values="share")
            rate = heads.groupby(["layer", "head"])["sink_rate"].first()
            if len(shares):
                dominates = (shares["relative_norm"] + shares["cosine"]) > shares["alpha"]
                add("decomposition", f"{cls}_share_of_heads_geometry_dominates", dominates.mean())
                sink_heads = rate.reindex(dominates.index) > 0.3
                add("decomposition", f"sink_heads_{cls}_share_of_heads_geometry_dominates",
                    dominates[sink_heads].mean() if sink_heads.any() else np.nan)
    if "anti_alignment" in tables:
        a = tables["anti_alignment"]
        sink = a[a["is_sink_head"]]
        add("anti_alignment", "median_cos_value_all_heads", a["cos_value_mean"].median())
        add("anti_alignment", "median_cos_semantic_all_heads", a["cos_semantic_mean"].median())
        add("anti_alignment", "num_sink_heads", len(sink))
        add("anti_alignment", "median_cos_value_sink_heads", sink["cos_value_mean"].median() if len(sink) else np.nan)
        add("anti_alignment", "median_cos_semantic_sink_heads", sink["cos_semantic_mean"].median() if len(sink) else np.nan)
        add("anti_alignment", "share_sink_heads_cos_semantic_negative",
            (sink["cos_semantic_mean"] < 0).mean() if len(sink) else np.nan)
        add("anti_alignment", "share_all_heads_cos_semantic_negative", (a["cos_semantic_mean"] < 0).mean())
        add("anti_alignment", "spearman_sink_rate_vs_cos_semantic",
            a["sink_rate"].rank().corr(a["cos_semantic_mean"].rank()))
        add("anti_alignment", "median_relative_sink_value_norm_sink_heads",
            sink["relative_sink_value_norm"].median() if len(sink) else np.nan)
    if "convexity" in tables:
        c = tables["convexity"]
        heads = c[c["scope"] == "head"]
        fitted = heads[heads["fitted"]]
        sink_fitted = fitted[fitted["is_sink_head"]]
        add("convexity", "num_heads_fitted", len(fitted))
        add("convexity", "share_fitted_heads_interior_minimum", fitted["interior_minimum"].mean())
        add("convexity", "share_fitted_heads_minimum_in_range", fitted["minimum_in_range"].mean())
        add("convexity", "share_fitted_heads_convex", (fitted["curvature"] > 0).mean())
        add("convexity", "num_sink_heads_fitted", len(sink_fitted))
        add("convexity", "share_sink_heads_interior_minimum",
            sink_fitted["interior_minimum"].mean() if len(sink_fitted) else np.nan)
        add("convexity", "share_sink_heads_minimum_in_range",
            sink_fitted["minimum_in_range"].mean() if len(sink_fitted) else np.nan)
        head_sink = heads[heads["is_sink_head"]]
        add("anti_alignment", "median_share_sink_suppresses_norm_sink_heads",
            head_sink["share_sink_suppresses"].median() if len(head_sink) else np.nan)
        add("anti_alignment", "share_sink_heads_mostly_suppressed",
            (head_sink["share_sink_suppresses"] > 0.5).mean() if len(head_sink) else np.nan)
        add("anti_alignment", "median_norm_over_semantic_sink_heads",
            head_sink["median_norm_over_semantic"].median() if len(head_sink) else np.nan)
        add("convexity", "median_r2_fitted", fitted["r2"].median())
        add("convexity", "median_r2_sink_heads", sink_fitted["r2"].median() if len(sink_fitted) else np.nan)
        add("convexity", "share_sink_heads_convex", (sink_fitted["curvature"] > 0).mean() if len(sink_fitted) else np.nan)
        add("convexity", "median_alpha_star_interior",
            fitted.loc[fitted["interior_minimum"], "alpha_star"].median())
        add("convexity", "median_two_vector_alpha_star", heads["two_vector_alpha_star"].median())
        add("convexity", "median_reference_alpha_star", heads["reference_alpha_star"].median())
        for scope, name in (("model", "pooled"), ("model_v0", "pooled_v0")):
            m = c[c["scope"] == scope]
            if len(m):
                add("convexity", f"{name}_curvature", m["curvature"].iloc[0])
                add("convexity", f"{name}_alpha_star", m["alpha_star"].iloc[0])
    if "semantic_cone" in tables:
        q = tables["semantic_cone"]
        for binning, prefix in (("within_head", ""), ("across_heads", "heads_")):
            for condition in CONDITIONS:
                rows = q[(q["condition"] == condition) & (q["binning"] == binning)].sort_values("quantile")
                if len(rows):
                    low, high = rows.iloc[0], rows.iloc[-1]
                    name = f"{prefix}{condition}"
                    add("semantic_cone", f"{name}_cos_clean_lowest_norm_quantile", low["cos_clean"])
                    add("semantic_cone", f"{name}_cos_after_lowest_norm_quantile", low["cos_after"])
                    add("semantic_cone", f"{name}_delta_cos_lowest_norm_quantile", low["delta_cos"])
                    add("semantic_cone", f"{name}_delta_cos_highest_norm_quantile", high["delta_cos"])
                    add("semantic_cone", f"{name}_norm_ratio_lowest_norm_quantile", low["norm_ratio"])
                    add("semantic_cone", f"{name}_norm_ratio_highest_norm_quantile", high["norm_ratio"])
    if "semantic_cone-ppl" in tables:
        p = tables["semantic_cone-ppl"]
        for _, row in p.iterrows():
            add("semantic_cone", f"{row['condition']}_ppl_clean", row["ppl_clean"])
            add("semantic_cone", f"{row['condition']}_delta_ppl", row["delta_ppl"])
            add("semantic_cone", f"{row['condition']}_delta_log_ppl", row["delta_log_ppl"])
            add("semantic_cone", f"{row['condition']}_delta_log_ppl_ci_low", row["ci_low"])
            add("semantic_cone", f"{row['condition']}_delta_log_ppl_ci_high", row["ci_high"])
    return pd.DataFrame(out)


def _round(frame: pd.DataFrame, digits: int = 6) -> pd.DataFrame:
    floats = frame.select_dtypes("floating").columns
    return frame.assign(**{c: frame[c].astype(float).round(digits) for c in floats})


def _save_raw(folder: Path, parts: dict, blocks: _Blocks) -> None:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for name, frames in parts.items():
        for part, frame in frames.items():
            frame.to_parquet(folder / f"{name}.{part}.parquet", index=False)
    np.save(folder / "ids.npy", blocks.ids.numpy())
    meta = {"add_bos": blocks.add_bos, "first_token_is_bos": blocks.first_token_is_bos}
    (folder / "blocks.json").write_text(json.dumps(meta))


def _load_raw(folder: Path, analyses: list[str]) -> tuple[dict, _Blocks]:
    import json

    meta = json.loads((folder / "blocks.json").read_text())
    blocks = _Blocks(torch.from_numpy(np.load(folder / "ids.npy")), meta["add_bos"], meta["first_token_is_bos"])
    parts = {}
    for name in analyses:
        files = sorted(folder.glob(f"{name}.*.parquet"))
        if not files:
            raise FileNotFoundError(f"no raw material for {name} in {folder}")
        parts[name] = {f.name[len(name) + 1 : -len(".parquet")]: pd.read_parquet(f) for f in files}
    return parts, blocks


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m cwcore.sinks --model NAME --data NAME --num-sequences N --out DIR``."""
    parser = argparse.ArgumentParser(prog="python -m cwcore.sinks", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a name cwcore.models.load_model knows, e.g. smollm2-135m")
    parser.add_argument("--data", required=True, help="a data set cwcore.data.load_dataset knows, e.g. gsm8k, web-text")
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--add-bos", choices=("default", "yes", "no"), default="default")
    parser.add_argument("--analyses", default=",".join(ANALYSES), help=f"comma-separated subset of {','.join(ANALYSES)}")
    parser.add_argument("--cone-heads", choices=("all", "sink"), default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--out", default="data/results/")
    parser.add_argument("--raw", default=None,
                        help="also keep the raw per-batch material under RAW/<model>_<data>/ (parquet), independent "
                             "of the code version, so the tables can be rebuilt with --from-raw")
    parser.add_argument("--from-raw", action="store_true", help="rebuild the tables from --raw without running the model")
    args = parser.parse_args(list(argv) if argv is not None else None)
    wanted = [a.strip() for a in args.analyses.split(",") if a.strip()]
    unknown = sorted(set(wanted) - set(ANALYSES))
    if unknown:
        parser.error(f"unknown analyses: {', '.join(unknown)}")

    from .data import load_dataset
    from .models import load_model

    suffix = f"{args.model}_{args.data}"
    raw = Path(args.raw) / suffix if args.raw else None
    if args.from_raw:
        if raw is None:
            parser.error("--from-raw needs --raw")
        parts, blocks = _load_raw(raw, wanted)
    else:
        torch.manual_seed(args.seed)
        model, tokenizer = load_model(args.model)
        dataset = load_dataset(args.data)
        add_bos = {"default": None, "yes": True, "no": False}[args.add_bos]
        specs = _specs(kind="intra", quantile_sample=128, seed=args.seed, heads=args.cone_heads, threshold=0.3)
        parts, blocks = _run(model, tokenizer, dataset, [specs[a] for a in wanted], block_size=args.block_size,
                             num_sequences=args.num_sequences, add_bos=add_bos, batch_size=args.batch_size,
                             cache=not args.no_cache, progress=True)
        if raw is not None:
            _save_raw(raw, parts, blocks)
    options = dict(eps=0.3, sample_size=2000, seed=args.seed, bins=10, fit_on="norm", min_range=0.05, quantiles=5)
    results = {name: _tables(name, parts[name], blocks, **options) for name in wanted}
    tables: dict[str, pd.DataFrame] = {}
    for name, result in results.items():
        if name == "decomposition":
            tables["decomposition"], tables["decomposition-sample"] = result
        elif name == "convexity":
            tables["convexity"], tables["convexity-curves"] = result
        elif name == "semantic_cone":
            tables["semantic_cone"], tables["semantic_cone-heads"], tables["semantic_cone-ppl"] = result
        else:
            tables[name] = result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stem, table in tables.items():
        frame = table.copy()
        frame.insert(0, "data", args.data)
        frame.insert(0, "model", args.model)
        _round(frame).to_csv(out / f"sinks_{stem}_{suffix}.csv", index=False)
    summary = summarize(tables)
    summary.insert(0, "data", args.data)
    summary.insert(0, "model", args.model)
    summary["add_bos"] = blocks.add_bos
    summary["num_sequences"] = int(blocks.ids.shape[0])
    _round(summary).to_csv(out / f"sinks_summary_{suffix}.csv", index=False)
    print(summary.to_string(index=False), file=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
