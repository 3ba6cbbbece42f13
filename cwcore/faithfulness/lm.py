"""Language modelling under interventions: :func:`faithfulness_curve`.

Per sequence: NLL = mean negative log-likelihood over its next-token predictions (position t
predicts token t+1, both real), PPL = exp(NLL); deltas are intervened minus clean.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import datasets
import pandas as pd
import torch
from torch import nn

from ..core.inputs import check_sweep_arguments, check_texts, check_token_sequences
from .protocol import Protocol, as_protocol, modes as parse_modes, ratios as parse_ratios, specs as parse_specs
from .summary import summarize
from .sweep import Batch, Scorer, canonical_order, pad_batch, piece_store, run_sweep

__all__ = ["faithfulness_curve", "pad_id", "sequence_nll"]


def pad_id(tokenizer) -> int:
    """The tokenizer's padding id (its EOS id without one; 0 without a tokenizer)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


def _lm_sequences(texts, tokenizer, max_length: int | None) -> list[list[int]]:
    """Token id lists (padding removed) from strings, a Dataset, token tensors or a dict of them."""

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


def sequence_nll(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token NLL ``[rows]`` (float64) and predictions per row ``[rows]`` (long) from
    ``logits [rows, length, vocab]``, row by row for memory."""
    ids, mask = batch.input_ids, batch.attention_mask.bool()
    sums = torch.zeros(ids.shape[0], dtype=torch.float64)
    counts = (mask[:, :-1] & mask[:, 1:]).sum(-1)
    for row in range(ids.shape[0]):
        valid = mask[row, :-1] & mask[row, 1:]
        nll = nn.functional.cross_entropy(logits[row, :-1].float(), ids[row, 1:], reduction="none")
        sums[row] = nll[valid].double().sum()
    return sums, counts


def _documents(texts, n: int, first: int = 0) -> list[int]:
    """The document of each sequence: the ``document`` column of a Dataset of blocks
    (:func:`cwcore.data.document_blocks`), else each sequence its own document (its id, from ``first``)."""
    if isinstance(texts, datasets.Dataset) and "document" in texts.column_names:
        return [int(d) for d in texts["document"]]
    if isinstance(texts, dict) and "document" in texts:
        return [int(d) for d in texts["document"]]
    return list(range(first, first + n))


def _lm_scorer(candidates: dict[int, torch.Tensor]) -> Scorer:
    def score(logits, batch, removed):
        sums, counts = sequence_nll(logits, batch)
        return pd.DataFrame({
            "sequence": batch.groups.numpy(),
            "nll": (sums / counts.clamp_min(1)).numpy(),
            "n_tokens": counts.numpy(),
            "n_removed": removed.numpy(),
            "n_candidates": candidates[batch.index].numpy(),
        })
    return score


def faithfulness_curve(
    model: nn.Module,
    tokenizer,
    texts,
    metric: Any = None,
    ratios: float | Sequence[float] | None = None,
    mode: str | Sequence[str] | None = None,
    *,
    protocol: Protocol | None = None,
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
    first_sequence: int = 0,
    **protocol_keywords,
) -> pd.DataFrame:
    """Delta perplexity of a causal LM when the top / bottom fraction of attention terms is removed.

    texts
        a list of strings (each one sequence, tokenised with the tokenizer's special tokens and
        truncated to ``max_length``), a :class:`datasets.Dataset` of LM blocks (``input_ids``,
        optional ``attention_mask``; e.g. :func:`cwcore.data.lm_blocks`) or with a ``text`` column,
        a ``[n, length]`` tensor of token ids, or a dict with ``input_ids``/``attention_mask``.
    metric
        one ranking or a list of them (default: the ladder plus ``"random"``). A ranking is a registered
        method's name (:func:`cwcore.faithfulness.methods.available_methods`: the ladder ``attention``,
        ``value_weighted``, ``value_weighted_output_normalized``, ``contribution``; ``random``, the
        seeded control, a hash of (seed, sequence, layer, head, query, key); ``value_zeroing``,
        ``rollout``, ``contribution_rollout``, ``alti``, ``grad_x_input``; suffix ``_intra``/``_inter``
        overrides ``kind`` for the kind-dependent ones), a callable ``fn(layer_decomposition=...,
        **context)`` returning scores ``[batch, head, query, key]`` or ``[batch, query, key]`` (see
        :mod:`cwcore.faithfulness.methods` for the context keywords and how token scores are spread
        over heads), precomputed scores (``{layer: tensor}`` or one
        ``[layer, n_sequences, (head,) length, length]`` tensor), or ``{label: ranking}`` to name any of these.
    ratios, mode
        fractions (default :data:`DEFAULT_RATIOS`) and ``"comprehensiveness"``/``"sufficiency"``
        (default both). Lists make one call compute the whole sweep from one clean pass per batch.
    protocol
        a :class:`~cwcore.faithfulness.Protocol` (unit, scope, layers, keep_first_token, scores, kind,
        importance, seed: see :mod:`cwcore.faithfulness` for each default and why); its fields may also
        be given as keywords (``unit="token"``), which replace the protocol's
        (:func:`~cwcore.faithfulness.protocol.as_protocol`). ``seed`` also seeds the bootstrap.
    batch_size
        sequences per forward. ``padding_side``: how sequences of unequal length are padded.
    deduplicate
        metrics whose clean masks are identical to an earlier metric's in every layer (e.g. rungs 2
        and 3 under the default protocol) reuse its forwards: the results are identical by
        construction.
    per_sequence
        return the per-sequence table (one row per sequence and point: ``sequence, nll, n_tokens,
        n_removed, n_candidates, metric, kind, mode, ratio, clean_nll, document`` + protocol columns)
        instead of
        the summary; :func:`summarize` turns it into the summary and :func:`aopc` gives bootstrap
        intervals from it.
    cache, cache_dir
        store every (batch, metric, mode, ratio) piece under ``cache_dir`` (default
        :func:`cwcore.cache.cache_root`); a rerun reads them, an interrupted run resumes.
    first_sequence
        the id of the first sequence (the ``sequence`` column; the random control hashes it and the
        pieces are named by it): a slice ``texts[k:]`` of a longer sample run with ``first_sequence=k``
        (``k`` a multiple of ``batch_size``) gives exactly that sample's rows for those sequences.

    Returns the summary, one row per (metric, mode, ratio): ``metric, kind, mode, ratio, delta_ppl,
    ci_low, ci_high, delta_nll, nll_ci_low, nll_ci_high, clean_ppl, ppl, removed_fraction,
    n_sequences`` plus the protocol columns (``unit, scope, scores, keep_first_token, importance,
    layers, variant``: :meth:`Protocol.columns`). ``removed_fraction`` is the share of all candidate terms (head, query, key) removed.
    """
    check_sweep_arguments(model, caller="faithfulness_curve", metric=metric, ratios=ratios, mode=mode,
                          layers=protocol_keywords.get("layers"), batch_size=batch_size, n_bootstrap=n_bootstrap,
                          confidence=confidence, padding_side=padding_side)
    protocol = as_protocol(protocol, **protocol_keywords)
    check_sweep_arguments(model, caller="faithfulness_curve", layers=protocol.layers)  # a protocol object's layers too
    specs, modes, ratio_list = parse_specs(metric, protocol.kind), parse_modes(mode), parse_ratios(ratios)
    if padding_side not in ("left", "right"):
        raise ValueError("padding_side must be 'left' or 'right'")
    if isinstance(first_sequence, bool) or not isinstance(first_sequence, int) or first_sequence < 0:
        raise ValueError(f"first_sequence must be a non-negative int, got {first_sequence!r}")
    sequences = check_token_sequences(_lm_sequences(check_texts(texts, "faithfulness_curve"), tokenizer, max_length),
                                      model, caller="faithfulness_curve", min_length=2)
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("every sequence needs at least two tokens (one next-token prediction)")
    pad = pad_id(tokenizer)
    batches = [
        pad_batch(i // batch_size, sequences[i:i + batch_size],
                  list(range(first_sequence + i, first_sequence + min(i + batch_size, len(sequences)))), pad,
                  padding_side)
        for i in range(0, len(sequences), batch_size)
    ]
    store = piece_store("faithfulness", {"protocol": asdict(protocol)}, model, cache, cache_dir)
    frames, cleans = run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches,
                               deduplicate, _lm_scorer)
    table = canonical_order(pd.concat(frames, ignore_index=True), specs, modes, "sequence")
    table["clean_nll"] = table["sequence"].map(pd.concat(cleans).set_index("sequence")["nll"])
    table["document"] = table["sequence"].map(dict(enumerate(_documents(texts, len(sequences), first_sequence),
                                                                   start=first_sequence)))
    for key, value in protocol.columns().items():
        table[key] = value
    if per_sequence:
        return table
    return summarize(table, n_bootstrap=n_bootstrap, confidence=confidence, seed=protocol.seed)
