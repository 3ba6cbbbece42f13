"""Language modelling under interventions: :func:`faithfulness_curve`.

Per sequence: NLL = mean negative log-likelihood over its next-token predictions (position t
predicts token t+1, both real), PPL = exp(NLL); deltas are intervened minus clean.
"""

from __future__ import annotations

from typing import Any, Sequence

import datasets
import pandas as pd
import torch
from torch import nn

from ..core.architectures import attention_blocks, input_device
from ..core.inputs import (InputError, check_count, check_sequence_ids, check_sweep_arguments, check_texts,
                           check_token_sequences, is_integer_number, own_options)
from .protocol import (Protocol, model_protocol, modes as parse_modes, ratios as parse_ratios, refuse_removed,
                       refuse_unknown, specs as parse_specs)
from .methods.registry import check_precomputed_fit
from .result import FaithfulnessResult
from .sweep import Batch, Scorer, canonical_order, pad_batch, piece_store, run_sweep, sample_identity

__all__ = ["faithfulness_curve", "pad_id", "sequence_nll"]


def pad_id(tokenizer) -> int:
    """The tokenizer's padding id (its EOS id without one; 0 without a tokenizer)."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            return int(value)
    return 0


class _TextLength(int):
    """The default ``max_length``, 128 tokens: it truncates text, and token input is taken whole. Told apart from
    a ``max_length`` the caller gives, which a token sequence longer than it is refused for (not ignored)."""

    def __repr__(self) -> str:
        return str(int(self))


#: ``max_length``'s default (:class:`_TextLength`): text is truncated to 128 tokens, token input taken whole
DEFAULT_MAX_LENGTH = _TextLength(128)


#: columns beside ``input_ids`` that the sweeps would drop, though they change what a model computes or scores
_UNREAD_COLUMNS = {
    "labels": "every next token of a sequence is scored (no -100 masking)",
    "position_ids": "positions count each sequence's real tokens",
    "inputs_embeds": "the ids are embedded by the model",
    "past_key_values": "every sequence runs whole, without a cache",
}


def _lm_sequences(texts, tokenizer, max_length: int | None, caller: str = "faithfulness_curve") -> list[list[int]]:
    """Token id lists (padding removed) from strings, a Dataset, token tensors or a dict of them. Strings are
    truncated to ``max_length``; token input is taken whole, and refused if longer than a ``max_length`` given."""

    if max_length is not None and max_length is not DEFAULT_MAX_LENGTH:  # 0 meant "no truncation", -3 overflowed
        check_count(max_length, "max_length", minimum=2)

    def trimmed(ids, mask):
        return [int(i) for i, m in zip(ids, mask) if m]

    def whole(sequences: list[list[int]]) -> list[list[int]]:
        longest = max((len(s) for s in sequences), default=0)
        if max_length is not None and max_length is not DEFAULT_MAX_LENGTH and longest > max_length:
            raise ValueError(f"max_length={max_length} truncates text; these sequences are already tokenised, up to "
                             f"{longest} tokens: cut them yourself, or leave max_length out")
        return sequences

    columns = list(texts) if isinstance(texts, dict) else getattr(texts, "column_names", None) or []
    unread = [name for name in _UNREAD_COLUMNS if name in columns] if "input_ids" in columns else []
    if unread:  # only input_ids and attention_mask are read: these would change the result if they were
        raise InputError(f"{caller}: texts holds {', '.join(map(repr, unread))}, which the sweep does not read: "
                         f"{'; '.join(_UNREAD_COLUMNS[name] for name in unread)}; leave "
                         f"{'it' if len(unread) == 1 else 'them'} out")
    if isinstance(texts, dict) and "input_ids" in texts:
        ids = torch.as_tensor(texts["input_ids"])
        mask = torch.as_tensor(texts.get("attention_mask", torch.ones_like(ids)))
        return whole([trimmed(i.tolist(), m.tolist()) for i, m in zip(ids, mask)])
    if isinstance(texts, torch.Tensor):
        ids = texts if texts.dim() == 2 else texts[None]
        return whole([row.tolist() for row in ids])
    if isinstance(texts, datasets.Dataset) and "input_ids" in texts.column_names:
        masks = texts["attention_mask"] if "attention_mask" in texts.column_names else None
        return whole([trimmed(ids, masks[i] if masks else [1] * len(ids))
                      for i, ids in enumerate(texts["input_ids"])])
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
    # on the logits' device: the last layers' where a model is split over devices
    ids, mask = batch.input_ids.to(logits.device), batch.attention_mask.to(logits.device).bool()
    sums = torch.zeros(ids.shape[0], dtype=torch.float64, device=logits.device)
    counts = (mask[:, :-1] & mask[:, 1:]).sum(-1)
    for row in range(ids.shape[0]):
        valid = mask[row, :-1] & mask[row, 1:]
        nll = nn.functional.cross_entropy(logits[row, :-1].float(), ids[row, 1:], reduction="none")
        sums[row] = nll[valid].double().sum()
    return sums, counts


def _documents(texts, ids: list[int]) -> list[int]:
    """The document of each sequence: the ``document`` column of a Dataset of blocks
    (:func:`cwcore.data.document_blocks`), else each sequence its own document (its id)."""
    given = None
    if isinstance(texts, datasets.Dataset) and "document" in texts.column_names:
        given = list(texts["document"])
    elif isinstance(texts, dict) and "document" in texts:
        given = list(texts["document"])
    if given is None:
        return list(ids)
    if len(given) != len(ids):  # zip would leave sequences without a document: NaN units, dropped by the summaries
        raise ValueError(f"'document' holds {len(given)} values for {len(ids)} sequences: give one per sequence")
    if any(not (is_integer_number(d) or isinstance(d, float) and d.is_integer()) for d in given):
        raise ValueError(f"'document' must hold integer document ids, got {given[:8]}")
    return [int(d) for d in given]


def _lm_scorer(candidates: dict[int, torch.Tensor]) -> Scorer:
    def score(logits, batch, removed):
        sums, counts = sequence_nll(logits, batch)
        return pd.DataFrame({
            "sequence": batch.groups.cpu().numpy(),
            "nll": (sums / counts.clamp_min(1)).cpu().numpy(),
            "n_tokens": counts.cpu().numpy(),
            "n_removed": removed.cpu().numpy(),
            "n_candidates": candidates[batch.index].cpu().numpy(),
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
    max_length: int | None = DEFAULT_MAX_LENGTH,
    padding_side: str = "right",
    deduplicate: bool = True,
    progress: bool = True,
    sequence_ids: Sequence[int] | None = None,
    **protocol_keywords,
) -> FaithfulnessResult:
    """Delta perplexity of a causal LM when the top / bottom fraction of attention terms is removed.

    texts
        a list of strings (each one sequence, tokenised with the tokenizer's special tokens and
        truncated to ``max_length``, default 128, None: not truncated), a :class:`datasets.Dataset` of LM
        blocks (``input_ids``, optional ``attention_mask``; e.g. :func:`cwcore.data.lm_blocks`) or with a
        ``text`` column,
        a ``[n, length]`` tensor of token ids, or a dict with ``input_ids``/``attention_mask``. Token input is
        taken whole: a ``max_length`` given shorter than one of its sequences is refused (it would be ignored).
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
        ``removal="mean"`` (default ``"zero"``) replaces each removed term alpha_ij v~_j by alpha_ij times the
        head's mean projected value, estimated on the call's *other* documents (leave one document out,
        :func:`~cwcore.faithfulness.sweep.stand_ins`; one more forward per batch, at least two documents).
    batch_size
        sequences per forward. ``padding_side``: how sequences of unequal length are padded.
    deduplicate
        metrics whose clean masks are identical to an earlier metric's in every layer (e.g. rungs 2
        and 3 under the default protocol) reuse its forwards: the results are identical by
        construction.
    sequence_ids
        identifiers of the texts, one distinct non-negative int each (default ``0 .. n-1``): the
        ``sequence`` column, what the random control hashes with the seed (so a text keeps its control
        whatever else is run with it), the row of a precomputed score tensor, and each sequence's
        document when ``texts`` has no ``document`` column. The texts ``k:`` of a longer sample run with
        ``sequence_ids=range(k, n)`` (``k`` a multiple of ``batch_size``) give exactly that sample's rows.

    Nothing is cached unless the call runs inside :func:`cwcore.cache.caching`: then every (batch,
    metric, mode, ratio) piece is stored, a rerun reads them and an interrupted run resumes.

    Returns a :class:`~cwcore.faithfulness.result.FaithfulnessResult`: ``.table``, one row per (metric,
    mode, ratio): ``metric, kind, mode, ratio, delta_ppl, ci_low, ci_high, delta_nll, nll_ci_low,
    nll_ci_high, clean_ppl, ppl, removed_fraction, n_sequences`` plus the protocol columns (``unit, scope,
    scores, keep_first_token, importance, layers, variant``: :meth:`Protocol.columns`;
    ``removed_fraction`` is the share of all candidate terms (head, query, key) removed);
    ``.per_sequence``, one row per sequence and point (``sequence, nll, n_tokens, n_removed,
    n_candidates, metric, kind, mode, ratio, clean_nll, document`` + protocol columns); ``.summary()``,
    the AOPC with intervals; ``.plot()``.
    """
    refuse_removed("faithfulness_curve", protocol_keywords)
    refuse_unknown("faithfulness_curve", protocol_keywords, own_options(faithfulness_curve))
    check_sweep_arguments(model, caller="faithfulness_curve", metric=metric, ratios=ratios, mode=mode,
                          layers=protocol_keywords.get("layers"), batch_size=batch_size, n_bootstrap=n_bootstrap,
                          confidence=confidence, padding_side=padding_side)
    protocol = model_protocol(model, protocol, **protocol_keywords)  # a layer number, negative ones
    check_sweep_arguments(model, caller="faithfulness_curve", layers=protocol.layers)  # a protocol object's layers too
    specs, modes, ratio_list = parse_specs(metric, protocol.kind), parse_modes(mode), parse_ratios(ratios)
    if padding_side not in ("left", "right"):
        raise ValueError("padding_side must be 'left' or 'right'")
    sequences = check_token_sequences(_lm_sequences(check_texts(texts, "faithfulness_curve"), tokenizer, max_length),
                                      model, caller="faithfulness_curve", min_length=2)
    if not sequences or any(len(s) < 2 for s in sequences):
        raise ValueError("every sequence needs at least two tokens (one next-token prediction)")
    check_precomputed_fit(specs, sequences, len(attention_blocks(model)))
    ids = check_sequence_ids(sequence_ids, len(sequences))
    pad, device = pad_id(tokenizer), input_device(model)
    batches = [
        pad_batch(i // batch_size, sequences[i:i + batch_size], ids[i:i + batch_size], pad, padding_side, device=device)
        for i in range(0, len(sequences), batch_size)
    ]
    documents = dict(zip(ids, _documents(texts, ids)))
    store = piece_store("faithfulness", {"protocol": protocol.settings(),
                                         **sample_identity(protocol, batches, documents)}, model)
    frames, cleans = run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches,
                               deduplicate, _lm_scorer, documents)
    table = canonical_order(pd.concat(frames, ignore_index=True), specs, modes, "sequence")
    table["clean_nll"] = table["sequence"].map(pd.concat(cleans).set_index("sequence")["nll"])
    table["document"] = table["sequence"].map(documents)
    for key, value in protocol.columns().items():
        table[key] = value
    return FaithfulnessResult(table, n_bootstrap=n_bootstrap, confidence=confidence, seed=protocol.seed)
