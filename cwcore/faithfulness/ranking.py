"""Which terms alpha^h_ij v~^h_j a faithfulness intervention removes: candidates, ranks and masks.

The protocol of the paper's section 'Faithfulness by causal intervention' ranks the candidate terms of one attention layer by a score
(attention, value-weighted attention, ..., contribution weights, or a seeded random control) and
removes a fraction r of them: the most important (comprehensiveness) or the least important
(sufficiency). This module turns scores ``[batch, head, query, key]`` into those removal masks.

Vocabulary
----------
candidate
    a term that may be removed: key j <= query i (causal), both real tokens (not padding), inside
    the layer's sliding window where it has one, and (with ``keep_first_token``) j is not the
    sequence's first real token. Only candidates are ranked, counted and removed.
unit
    what is ranked as one item. ``"head_key"``: a (head, key) pair, ranked jointly over heads for a
    query; ``"key"``: a key within one head; ``"token"``: a key, with the head-aggregated score
    (:meth:`cwcore.core.decomposition.LayerDecomposition.token_level`: attention averaged, other metrics summed over
    heads) and removed from every head.
scope
    ``"row"``: one ranking per query row (per (sequence, query) for head_key/token units, per
    (sequence, head, query) for key units); ``"layer"``: one ranking per sequence and layer (per
    (sequence, head) for key units) of the units' scores averaged over the candidate queries that
    see them, the selected units then being removed for every query.
group
    the set of units ranked together (a row, or a whole layer of a sequence). In each group, with n
    candidate units, the fraction r removes k(r) = floor(r * n + 1/2) of them (r * n in float64, see
    :func:`removal_counts`): the first k in the
    descending order for comprehensiveness, the last k for sufficiency.
ties and NaN
    the order is a stable descending sort of the scores, so ties keep the units' index order
    (heads before keys, lower index first); NaN scores (undefined weights where ||o_i|| = 0) sort
    as the least important. Both make every mask deterministic.

Masks for many ratios
---------------------
Ratios are nested: the terms removed at r are also removed at every larger r. So instead of one
mask per ratio, :func:`selection` stores per term (``Selection.buckets``) the index of the first ratio that removes
it (``uint8``, :data:`NEVER` when no ratio does), and the mask for ratio index t is ``bucket <= t``.
One sort per metric then serves every ratio. :func:`selection` also returns how many terms each
ratio removes per sequence (every ranked group removes exactly k(r) of its candidates).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import nn

from ..core.architectures import UnsupportedModelError, block_heads, sliding_windows

__all__ = [
    "UNITS",
    "SCOPES",
    "MODES",
    "NEVER",
    "candidate_mask",
    "descending_ranks",
    "removal_counts",
    "removal_mask",
    "selection",
    "Selection",
    "hashed_uniform",
    "layer_heads",
    "layer_windows",
]

UNITS = ("head_key", "key", "token")
SCOPES = ("row", "layer")
MODES = ("comprehensiveness", "sufficiency")
#: Bucket value of a term that no ratio removes (non-candidates included).
NEVER = 255


def _check(unit: str, scope: str, mode: str | None = None) -> None:
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, not {unit!r}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, not {scope!r}")
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")


def candidate_mask(
    attention_mask: torch.Tensor,
    keep_first_token: bool = True,
    window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """The removable terms of one layer, ``[batch, 1, query, key]`` bool.

    attention_mask: ``[batch, seq]`` (1 = real token, 0 = padding; left or right padding).
    ``window``: the layer's sliding window (key j is visible from query i when i - j < window).
    ``keep_first_token``: the first *real* token of each sequence is never a candidate.
    """
    valid = attention_mask.bool()
    n = valid.shape[-1]
    idx = torch.arange(n, device=valid.device)
    pairs = valid[:, :, None] & valid[:, None, :]  # [b, q, k]
    if causal:
        pairs = pairs & (idx[None, :, None] >= idx[None, None, :])
    if window is not None:
        pairs = pairs & ((idx[:, None] - idx[None, :]) < window)[None]
    if keep_first_token:
        first = valid.long().argmax(-1)  # first real position of each sequence
        pairs = pairs & (idx[None, None, :] != first[:, None, None])
    return pairs[:, None]


def require_window(probs: torch.Tensor, layer: int, window: int | None,
                   valid_queries: torch.Tensor | None = None) -> None:
    """Refuse a layer that attends beyond the sliding ``window`` cwcore reads for it (its candidates leave those
    keys out), measured on the probabilities it applied, ``probs`` ``[batch, head, query, key]`` of a
    self-attention call: a config's ``sliding_window`` that the family never applies (a Llama config carrying
    Mistral's key) would rank and remove terms of a window the model does not have."""
    q, k = probs.shape[-2:]
    if window is None or q != k or q <= window:
        return
    reached = probs.detach().tril(-window)  # the keys window or more tokens back (as later_attention's triu)
    if valid_queries is not None:
        reached = reached.masked_fill(~valid_queries.to(probs.device)[:, None, :, None], 0)
    if bool((reached > 0).any()):
        raise UnsupportedModelError(
            f"faithfulness: attention layer {layer} attends to keys {window} or more tokens back (up to "
            f"{float(reached.sum(-1).max()):.3g} of a query's attention), beyond the sliding window of {window} "
            "tokens that cwcore reads from the model's config: the model does not apply that window (a stray "
            "`sliding_window` in its config?), so its candidate terms would not be the ones the layer mixes")


def _grouped(scores: torch.Tensor, unit: str) -> tuple[torch.Tensor, tuple]:
    """Reshape ``[b, h, q, k]`` (``[b, 1, q, k]`` for token) so that the last axis is one row group."""
    if unit == "head_key":
        b, h, q, k = scores.shape
        return scores.permute(0, 2, 1, 3).reshape(b, q, h * k), (b, q, h, k)
    return scores, scores.shape


def _ungrouped(values: torch.Tensor, unit: str, shape: tuple) -> torch.Tensor:
    if unit == "head_key":
        b, q, h, k = shape
        return values.reshape(b, q, h, k).permute(0, 2, 1, 3)
    return values


def descending_ranks(scores: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank along the last axis: candidates first in descending score order (stable), then the rest.

    scores, candidates: same shape ``[..., n]``. Returns (ranks ``[..., n]`` int32 with 0 = most
    important candidate, counts ``[..., 1]`` = number of candidates). NaN scores count as the lowest
    candidates. One stable sort: candidates' keys are finite (NaN and -inf become the lowest finite
    value), non-candidates' keys are -inf.
    """
    lowest = torch.finfo(scores.dtype).min
    keys = scores.nan_to_num(lowest, posinf=torch.finfo(scores.dtype).max, neginf=lowest)
    keys = keys.masked_fill(~candidates, float("-inf"))
    order = torch.sort(keys, dim=-1, descending=True, stable=True).indices
    ranks = torch.empty(order.shape, dtype=torch.int32, device=order.device)
    positions = torch.arange(order.shape[-1], dtype=torch.int32, device=order.device)
    ranks.scatter_(-1, order, positions.expand(order.shape))
    return ranks, candidates.sum(-1, keepdim=True, dtype=torch.int32)


def removal_counts(counts: torch.Tensor, ratio: float) -> torch.Tensor:
    """k(r) = floor(r * n + 1/2): how many of n candidate units the fraction r removes, with r * n a float64
    product: where it is a half in decimal but not in binary it rounds as the binary number does (0.7 x 45 =
    31.499999999999996 gives 31, not 32). Kept so: every committed table was counted this way."""
    return torch.floor(counts.double() * float(ratio) + 0.5).to(counts.dtype)


def _unit_scores(scores: torch.Tensor, candidates: torch.Tensor, unit: str, scope: str):
    """Scores and candidate flags of the ranked units.

    Returns (unit scores, unit candidates), both broadcastable to ``[b, h, q, k]``: row scope
    ``[b, h, q, k]`` (``[b, 1, q, k]`` for token units); layer scope ``[b, h, 1, k]`` (``[b, 1, 1, k]``).
    """
    cand = candidates.expand(scores.shape[0], -1, -1, -1)
    if scope == "row":
        return scores, cand
    # layer scope: mean over the candidate queries that see the key (NaN scores left out)
    usable = cand & ~torch.isnan(scores)
    total = torch.where(usable, scores, torch.zeros((), dtype=scores.dtype)).sum(2, keepdim=True)
    seen = usable.sum(2, keepdim=True)
    mean = total / seen.clamp_min(1)
    mean = mean.masked_fill(seen == 0, float("nan"))
    return mean, cand.any(2, keepdim=True)


def _aggregate_heads(scores: torch.Tensor, unit: str) -> torch.Tensor:
    """Token units: sum over heads (for attention the head mean of token_level ranks identically)."""
    if unit != "token" or scores.shape[1] == 1:
        return scores
    return scores.sum(1, keepdim=True)


class Selection(NamedTuple):
    """What one layer's ranking removes at every ratio: ``buckets[mode]`` (uint8: per term, the
    index of the first ratio that removes it, :data:`NEVER` when none does) and ``removed[mode]``, the number of terms (head, query, key) each
    ratio's mask removes per sequence, ``[batch, n_ratios]`` int64."""

    buckets: dict[str, torch.Tensor]
    removed: dict[str, torch.Tensor]


def _bucket(ranks: torch.Tensor, counts: torch.Tensor, candidates: torch.Tensor, cuts: list[torch.Tensor],
            mode: str) -> torch.Tensor:
    """The number of ratios that keep each unit (NEVER for non-candidates). Comprehensiveness keeps
    the unit of rank p at ratio t iff p >= k_t; sufficiency iff p < n - k_t, i.e. n - 1 - p >= k_t."""
    position = ranks if mode == "comprehensiveness" else counts - 1 - ranks
    bucket = torch.zeros(ranks.shape, dtype=torch.uint8, device=ranks.device)
    for cut in cuts:
        bucket += position >= cut
    return bucket.masked_fill_(~candidates, NEVER)


def _query_blocks(candidates: torch.Tensor, max_blocks: int = 16, min_size: int = 8) -> list[tuple[int, int, int]]:
    """``(first query, end query, key limit)`` blocks such that no query of a block has a candidate key at
    or beyond the limit: under causal masks the keys after a block's last query are never candidates,
    so each block sorts only its left part of the rows (about half the work of whole rows)."""
    rows = candidates[:, 0]  # [b, q, k]
    n_q, n_k = rows.shape[-2:]
    seen = rows.any(0)  # [q, k]
    last = torch.where(seen.any(-1), (seen * torch.arange(1, n_k + 1, device=rows.device)).amax(-1), 0)
    size = max(min_size, -(-n_q // max_blocks))
    blocks = []
    for q0 in range(0, n_q, size):
        q1 = min(n_q, q0 + size)
        limit = int(last[q0:q1].max()) if q1 > q0 else 0
        if limit:
            blocks.append((q0, q1, limit))
    return blocks


def selection(
    scores: torch.Tensor,
    candidates: torch.Tensor,
    ratios: Sequence[float],
    modes: Sequence[str] = MODES,
    unit: str = "head_key",
    scope: str = "row",
) -> Selection:
    """Buckets and removed-term counts of one layer for every ratio and mode (one sort per group).

    scores: ``[batch, head, query, key]`` (already transformed: signed or absolute);
    candidates: ``[batch, 1, query, key]`` from :func:`candidate_mask`; ratios: ascending.
    Buckets are broadcastable to ``[batch, head, query, key]`` (``[b, h, 1, k]`` for layer scope,
    ``[b, 1, ...]`` for token units); the mask for ``ratios[t]`` is ``removal_mask(bucket, t, candidates)``.
    """
    _check(unit, scope)
    for mode in modes:
        _check(unit, scope, mode)
    ratios = [float(r) for r in ratios]
    if any(b < a for a, b in zip(ratios, ratios[1:])):
        raise ValueError(f"ratios must be ascending, got {ratios}")
    if len(ratios) >= NEVER:
        raise ValueError(f"at most {NEVER - 1} ratios")
    heads = scores.shape[1]
    candidates = candidates.to(scores.device)  # a model split over devices: the layer's, not the inputs'
    unit_scores, unit_cand = _unit_scores(_aggregate_heads(scores, unit), candidates, unit, scope)
    if unit == "token":
        unit_cand = unit_cand[:, :1]
    broadcast = heads if unit_scores.shape[1] == 1 else 1  # token units are removed from every head
    b = unit_scores.shape[0]
    removed = {m: torch.zeros(b, len(ratios), dtype=torch.long, device=scores.device) for m in modes}
    if scope == "row":
        buckets = {m: torch.full(unit_scores.shape, NEVER, dtype=torch.uint8, device=scores.device) for m in modes}
        for q0, q1, limit in _query_blocks(unit_cand):
            part = unit_scores[:, :, q0:q1, :limit]
            grouped, shape = _grouped(part, unit)
            grouped_cand, _ = _grouped(unit_cand[:, :, q0:q1, :limit].expand_as(part), unit)
            ranks, counts = descending_ranks(grouped, grouped_cand)
            cuts = [removal_counts(counts, r) for r in ratios]
            # every group removes exactly k_t of its candidates, in both modes
            per_sequence = torch.stack([cut.reshape(b, -1).sum(-1, dtype=torch.long) for cut in cuts], -1) * broadcast
            for mode in modes:
                bucket = _bucket(ranks, counts, grouped_cand, cuts, mode)
                buckets[mode][:, :, q0:q1, :limit] = _ungrouped(bucket, unit, shape)
                removed[mode] += per_sequence
        return Selection(buckets, removed)
    if unit == "head_key":
        # one group per sequence: [b, h, 1, k] -> [b, 1, 1, h*k]
        _, h, _, n_keys = unit_scores.shape
        grouped = unit_scores.reshape(b, 1, 1, h * n_keys)
        grouped_cand = unit_cand.expand(b, h, 1, n_keys).reshape(b, 1, 1, h * n_keys)
        shape = (b, h, 1, n_keys)
    else:
        grouped, shape = _grouped(unit_scores, "key")
        grouped_cand, _ = _grouped(unit_cand.expand_as(unit_scores), "key")
    ranks, counts = descending_ranks(grouped, grouped_cand)
    cuts = [removal_counts(counts, r) for r in ratios]
    buckets = {}
    for mode in modes:
        bucket = _bucket(ranks, counts, grouped_cand, cuts, mode)
        buckets[mode] = bucket.reshape(shape) if unit == "head_key" else _ungrouped(bucket, "key", shape)
        # a unit selected in layer scope is removed from every candidate query that sees it
        for t in range(len(ratios)):
            removed[mode][:, t] = removal_mask(buckets[mode], t, candidates).sum((1, 2, 3)) * broadcast
    return Selection(buckets, removed)


def removal_mask(bucket: torch.Tensor, ratio_index: int, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """The bool removal mask of ``ratios[ratio_index]`` from a bucket of :func:`selection`
    (``Selection.buckets[mode]``).

    For layer scope pass ``candidates`` (``[b, 1, q, k]``): the selected units are removed from every
    query that may see them.
    """
    mask = bucket <= ratio_index
    if candidates is not None and mask.shape[-2] == 1 and candidates.shape[-2] != 1:
        mask = mask & candidates.to(mask.device)
    return mask


# -- a counter-based random score: a pure function of its coordinates -------------------------------
_M64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    x = x * _GOLDEN  # int64 arithmetic wraps modulo 2^64
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def hashed_uniform(seed: int, groups: torch.Tensor, layer: int, heads: int, positions: torch.Tensor) -> torch.Tensor:
    """Seeded random scores in [0, 1) on a 2^-24 grid, ``[batch, head, query, key]`` float32.

    Each score is a hash (splitmix64) of (seed, group id, layer, head, query position, key position),
    so it does not depend on the batch it is computed in, on the padding or on the padded length.
    groups: ``[batch]`` int (sequence or example ids; rows with the same id get the same scores);
    positions: ``[batch, seq]`` int, the positions of the tokens within their sequence.
    """
    groups = groups.long()
    b, n = positions.shape
    x = _splitmix(torch.tensor(int(seed), dtype=torch.long) + _splitmix(groups.view(b, 1, 1, 1) + 1))
    x = _splitmix(x + layer + 1)
    x = _splitmix(x + torch.arange(heads, device=positions.device).view(1, heads, 1, 1) + 1)
    x = _splitmix(x + positions.long().view(b, 1, n, 1) + 1)
    x = _splitmix(x + positions.long().view(b, 1, 1, n) + 1)
    return _shift_right(x, 40).float() / float(1 << 24)


# -- what the candidates need from a model's config ----------------------------------------------------
def layer_windows(model: nn.Module, num_layers: int) -> list[int | None]:
    """Each layer's sliding window (None = full attention), by :func:`cwcore.core.architectures.sliding_window`."""
    windows = sliding_windows(model)
    return [windows.get(layer) for layer in range(num_layers)]


def layer_heads(model: nn.Module, num_layers: int) -> list[int]:
    """Each layer's query heads as it computes them (:func:`cwcore.core.architectures.block_heads`)."""
    heads = block_heads(model)
    return [heads[layer] for layer in range(num_layers)]
