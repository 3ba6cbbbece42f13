"""Per-layer statistics of attention and contribution weights, for the book's chapters 3 and 8 (it was
``cwcore.analysis``).

Every statistic is one number per *sequence*, so a per-layer mean's interval resamples sequences
(:func:`summarize`); :func:`collect` runs many batches through :mod:`cwcore.runs` (cached pieces).
Conventions (layer l, head h, query i, key j):

* A key is **visible** to a query when some head gives it non-zero attention (causal mask, sliding
  window and padding hide keys); a query **counts** when it sees at least ``min_keys`` keys (the
  default 2 leaves out a decoder's query 0, whose alpha_00 = 1 says nothing).
* **Views** of a query row: ``intra`` (per head, alpha^h_i. against c^h_i. summing to 1 over keys),
  ``inter`` (per head, against the inter-head weights summing to 1 over heads and keys) and ``token``
  (attention averaged over heads against inter-head weights summed over heads).
* **Key groups** are named boolean masks ``[batch, key]`` (the first position, [CLS] and [SEP]).
* Undefined contribution weights (NaN from ``decompose``) are left out; a rank correlation of a row
  with one is NaN."""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd
import torch

from pathlib import Path

from cwcore import runs, stats
from cwcore.code_keys import normalised_source
from cwcore.identity import method_key
from cwcore.core.decomposition import decompose

__all__ = [
    "VIEWS",
    "average_ranks",
    "bootstrap_ci",
    "collect",
    "counted_queries",
    "factor_sample",
    "first_token_group",
    "kendall_rows",
    "layer_statistics",
    "spearman_rows",
    "summarize",
    "token_groups",
    "visible_keys",
]

VIEWS = ("intra", "inter", "token")


# --------------------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------------------
def visible_keys(attention: torch.Tensor) -> torch.Tensor:
    """``[batch, query, key]`` bool: keys some head of ``attention [batch, head, query, key]`` attends to (NaN rows: none)."""
    return attention.nan_to_num(0.0).sum(1) > 0


def counted_queries(visible: torch.Tensor, min_keys: int = 2) -> torch.Tensor:
    """``[batch, query]`` bool: queries that see at least ``min_keys`` keys."""
    return visible.sum(-1) >= min_keys


def first_token_group(batch: int, keys: int, device=None) -> dict[str, torch.Tensor]:
    """``{"first": mask}`` selecting key position 0 of every sequence (unpadded, or right-padded)."""
    mask = torch.zeros(batch, keys, dtype=torch.bool, device=device)
    mask[:, 0] = True
    return {"first": mask}


def token_groups(input_ids: torch.Tensor, groups: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Masks of keys whose token id is in each group, e.g. ``{"[CLS]": [101], "[SEP]": [102]}``."""
    out = {}
    for name, ids in groups.items():
        ids = torch.as_tensor(list(ids), dtype=input_ids.dtype, device=input_ids.device)
        out[name] = torch.isin(input_ids, ids)
    return out


# --------------------------------------------------------------------------------------------------
# Rank agreement per row
# --------------------------------------------------------------------------------------------------
def _ranks(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Average ranks among the visible entries (0-based), 0 at invisible entries."""
    filled = x.masked_fill(~visible, float("inf"))  # invisible keys sort last
    ordered, order = filled.sort(-1)
    ranks = torch.empty_like(x)
    positions = torch.arange(x.shape[-1], dtype=x.dtype, device=x.device).expand_as(x)
    ranks.scatter_(-1, order, positions)
    ties = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] != float("inf"))
    if ties.any():  # exact average ranks only where needed (ties are rare in float data)
        rows = ties.any(-1)
        sub, sub_sorted = filled[rows], ordered[rows]
        left = torch.searchsorted(sub_sorted, sub, side="left")
        right = torch.searchsorted(sub_sorted, sub, side="right")
        ranks[rows] = (left + right - 1).to(x.dtype) / 2
    return ranks.masked_fill_(~visible, 0.0)


def average_ranks(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Ranks (0-based, ties get their average rank) of ``x`` along the last axis among the visible
    entries; invisible entries get NaN. ``x`` must be finite where visible."""
    visible = visible.expand_as(x)
    return _ranks(x, visible).masked_fill(~visible, float("nan"))


def _valid_rows(x: torch.Tensor, y: torch.Tensor, visible: torch.Tensor, min_keys: int) -> torch.Tensor:
    """Rows with at least ``min_keys`` visible entries, all of them finite in ``x`` and ``y``."""
    finite = torch.isfinite(x) & torch.isfinite(y)
    return (visible.sum(-1) >= min_keys) & (finite | ~visible).all(-1)


def _spearman_from_ranks(rx: torch.Tensor, ry: torch.Tensor, visible: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    n = visible.sum(-1, dtype=rx.dtype)
    mean = ((n - 1) / 2)[..., None]  # average ranks always average to (n - 1) / 2
    dx = (rx - mean).masked_fill_(~visible, 0.0)
    dy = (ry - mean).masked_fill_(~visible, 0.0)
    cov = (dx * dy).sum(-1)
    var = (dx * dx).sum(-1) * (dy * dy).sum(-1)
    return (cov / var.sqrt()).masked_fill_(~ok | (var <= 0), float("nan"))


def spearman_rows(x: torch.Tensor, y: torch.Tensor, visible: torch.Tensor, min_keys: int = 3) -> torch.Tensor:
    """Spearman's rho between ``x`` and ``y`` along the last axis, over the visible entries of each row.

    Ties get average ranks (as :func:`scipy.stats.spearmanr`). NaN for rows with fewer than
    ``min_keys`` visible entries, a non-finite visible value, or a constant ``x`` or ``y``.
    """
    visible = visible.expand_as(x)
    ok = _valid_rows(x, y, visible, min_keys)
    vis = visible & ok[..., None]
    return _spearman_from_ranks(_ranks(x, vis), _ranks(y, vis), vis, ok)


def kendall_rows(x: torch.Tensor, y: torch.Tensor, visible: torch.Tensor, min_keys: int = 3,
                 chunk_elements: int = 2 ** 23) -> torch.Tensor:
    """Kendall's tau-b between ``x`` and ``y`` along the last axis, over the visible entries of each row.

    tau-b = sum_{j,k} s^x_jk s^y_jk / sqrt(sum s^x_jk^2 * sum s^y_jk^2) with s_jk = sign(x_j - x_k)
    over pairs of visible entries (as :func:`scipy.stats.kendalltau`). Costs O(keys^2) per row:
    rows are processed in chunks, each cut to the keys its rows can see (a causal row i needs only
    the keys up to i). NaN where :func:`spearman_rows` is.
    """
    shape = x.shape[:-1]
    keys = x.shape[-1]
    visible = visible.expand_as(x).reshape(-1, keys)
    xf, yf = x.reshape(-1, keys), y.reshape(-1, keys)
    ok = _valid_rows(xf, yf, visible, min_keys)
    out = torch.full((xf.shape[0],), float("nan"), dtype=x.dtype, device=x.device)
    rows = ok.nonzero().squeeze(-1)
    if rows.numel():
        positions = torch.arange(keys, device=x.device)
        last = torch.where(visible[rows], positions, -1).max(-1).values + 1  # keys a row needs
        order = last.argsort()
        rows, last = rows[order], last[order]
        start = 0
        while start < rows.numel():
            # the longest run of rows (sorted by width) whose pairwise tensors fit in chunk_elements
            cost = torch.arange(1, rows.numel() - start + 1, device=x.device) * last[start:] ** 2
            stop = start + max(1, int((cost <= chunk_elements).sum()))
            width = int(last[stop - 1])
            idx = rows[start:stop]
            v = visible[idx, :width]
            pair = v[:, :, None] & v[:, None, :]
            a, b = xf[idx, :width], yf[idx, :width]
            sx = torch.sign(a[:, :, None] - a[:, None, :]) * pair
            sy = torch.sign(b[:, :, None] - b[:, None, :]) * pair
            num = (sx * sy).sum((1, 2))
            den = ((sx * sx).sum((1, 2)) * (sy * sy).sum((1, 2))).sqrt()
            out[idx] = torch.where(den > 0, num / den, torch.full_like(num, float("nan")))
            start = stop
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------------
# Per-layer statistics, one row per sequence
# --------------------------------------------------------------------------------------------------
def _masked_mean(values: torch.Tensor, mask: torch.Tensor, dims) -> torch.Tensor:
    """Mean of ``values`` over ``dims`` where ``mask``; NaN where nothing counts."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dims)
    return total / mask.sum(dims).to(values.dtype)


def layer_statistics(layer, key_groups: Mapping[str, torch.Tensor] | None = None, *, min_keys: int = 2,
                     rank_min_keys: int = 5, rank_views: Sequence[str] = VIEWS,
                     kendall_views: Sequence[str] = (), sequence_offset: int = 0) -> pd.DataFrame:
    """Statistics of one layer of a decomposition, one value per sequence of the batch.

    Returns a long table with columns ``sequence, layer, statistic, view, group, value``:

    ``mass`` (view ``attention``, ``intra`` or ``token``; one row per key group)
        the weight a query row puts on the group's keys, averaged over counted queries (and over
        heads for ``attention`` and ``intra``; ``token`` sums the inter-head weights over heads, so
        all three are shares of one unit). Rows with an undefined weight are left out;
    ``negative_share`` (views ``intra``, ``inter``, ``token``)
        the fraction of the defined, visible weights of counted queries that are negative;
    ``negative_mass`` (same views)
        minus the sum of a row's negative weights, averaged over rows (for ``intra`` and ``token``
        rows sum to 1, so this is how far past 1 the positive weights must go);
    ``spearman`` (``rank_views``) / ``kendall`` (``kendall_views``)
        the rank correlation of attention and contribution along each row, averaged over the rows of
        queries that see at least ``rank_min_keys`` keys (Kendall costs O(keys^2) per row).

    ``sequence`` numbers the batch's rows from ``sequence_offset``.
    """
    for name in (*rank_views, *kendall_views):
        if name not in VIEWS:
            raise ValueError(f"unknown view {name!r}; views are {', '.join(VIEWS)}")
    attention = layer.attention
    batch, heads, queries, keys = attention.shape
    visible = visible_keys(attention)  # [b, q, k]
    counted = counted_queries(visible, min_keys)  # [b, q]
    ranked = counted_queries(visible, rank_min_keys)
    weights = {  # view -> (attention, contribution); per head [b, h, q, k], token level [b, q, k]
        "intra": (attention, layer.contribution("intra")),
        "inter": (attention, layer.contribution("inter")),
        "token": (attention.mean(1), layer.contribution("inter").sum(1)),
    }
    records: list[tuple] = []

    def add(statistic, view, group, per_sequence):
        for b, value in enumerate(per_sequence.tolist()):
            records.append((sequence_offset + b, layer.layer, statistic, view, group, value))

    alpha_ranks = {}
    for view, (alpha, contribution) in weights.items():
        per_head = contribution.dim() == 4
        expand = (lambda m: m[:, None].expand(batch, heads, *m.shape[1:])) if per_head else (lambda m: m)
        vis = expand(visible & counted[..., None])
        finite = vis & ~contribution.isnan()
        row_ok = expand(counted) & (finite == vis).all(-1)  # counted rows whose weights are all defined
        dims = tuple(range(1, contribution.dim() - 1))  # all but batch and key

        negative = (contribution < 0) & finite
        share = negative.sum((*dims, -1)) / finite.sum((*dims, -1)).clamp_min(1)
        add("negative_share", view, "", share)
        neg_mass = -torch.where(negative, contribution, torch.zeros_like(contribution)).sum(-1)
        add("negative_mass", view, "", _masked_mean(neg_mass, row_ok, dims))

        if view != "inter":  # mass on key groups: attention (per head), intra (per head), token
            for group, mask in (key_groups or {}).items():
                keymask = (mask.to(attention.device)[:, None, None, :] if per_head else
                           mask.to(attention.device)[:, None, :]) & vis
                if view == "intra":
                    mass = torch.where(keymask, alpha, torch.zeros_like(alpha)).sum(-1)
                    add("mass", "attention", group, _masked_mean(mass, expand(counted), dims))
                mass = torch.where(keymask, contribution, torch.zeros_like(contribution)).sum(-1)
                add("mass", view, group, _masked_mean(mass, row_ok, dims))

        if view in rank_views or view in kendall_views:
            rvis = expand(visible & ranked[..., None])
            ok = expand(ranked) & (finite == vis).all(-1) & (rvis.sum(-1) >= rank_min_keys)
            rvis = rvis & ok[..., None]
            if view in rank_views:
                key = per_head
                if key not in alpha_ranks:  # intra and inter share attention and the same rows
                    alpha_ranks[key] = (_ranks(alpha, rvis), rvis)
                ra, avis = alpha_ranks[key]
                if not torch.equal(avis, rvis):
                    ra = _ranks(alpha, rvis)
                rho = _spearman_from_ranks(ra, _ranks(contribution.nan_to_num(0.0), rvis), rvis, ok)
                add("spearman", view, "", _masked_mean(rho, ~rho.isnan(), dims))
            if view in kendall_views:
                tau = kendall_rows(alpha, contribution, rvis, min_keys=rank_min_keys)
                add("kendall", view, "", _masked_mean(tau, ~tau.isnan(), dims))

    return pd.DataFrame.from_records(records, columns=["sequence", "layer", "statistic", "view", "group", "value"])


def sequence_key(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
    """A 32-bit key of one sequence's real tokens (``[seq]`` ids, padding left out): what seeds its factor sample,
    so the draw is the same whatever batch, position or padding the sequence came with (it was the sequence's
    index in its batch: at batch_size=1 every sequence drew the same positions, and the medians moved with it)."""
    import zlib

    ids = input_ids if attention_mask is None else input_ids[attention_mask.bool()]
    return zlib.crc32(np.ascontiguousarray(ids.detach().cpu().numpy().astype(np.int64)).tobytes())


def factor_sample(layer, key_groups: Mapping[str, torch.Tensor] | None = None, *, kind: str = "intra",
                  per_group: int = 256, min_keys: int = 2, seed: int = 0, sequence_offset: int = 0,
                  sequence_keys: Sequence[int] | None = None) -> pd.DataFrame:
    """A random sample of (head, query, key) terms with their three factors, stratified by key group.

    For each sequence and each group (the key groups, then ``other`` for the remaining keys) at most
    ``per_group`` visible terms of counted queries are drawn uniformly without replacement
    (``numpy.random.default_rng([seed, layer, sequence key])``; a sequence's key is ``sequence_keys[b]``, e.g.
    :func:`sequence_key` of its tokens, so that the draw does not depend on the batch it came in; default
    ``sequence_offset + b``). Columns: ``sequence, layer, group, head, query, key, attention, relative_norm,
    cosine, contribution`` (the factors of ``kind``). Terms with an undefined factor (zero output norm) are not
    drawn."""
    attention = layer.attention
    batch, heads, queries, keys = attention.shape
    visible = visible_keys(attention)
    rows_vis = (visible & counted_queries(visible, min_keys)[..., None])[:, None].expand(batch, heads, queries, keys)
    rel, cos, con = layer.relative_norm(kind), layer.cosine(kind), layer.contribution(kind)
    defined = rows_vis & torch.isfinite(rel) & torch.isfinite(cos) & torch.isfinite(con)
    groups = dict(key_groups or {})
    taken = torch.zeros(batch, keys, dtype=torch.bool, device=attention.device)
    masks = []
    for name, mask in groups.items():
        mask = mask.to(attention.device) & ~taken
        masks.append((name, mask))
        taken |= mask
    masks.append(("other", ~taken))
    frames = []
    for b in range(batch):
        rng = np.random.default_rng([seed, layer.layer, sequence_offset + b if sequence_keys is None
                                     else int(sequence_keys[b])])
        for name, mask in masks:
            candidates = (defined[b] & mask[b][None, None, :]).nonzero()  # [n, 3]: head, query, key
            if candidates.shape[0] == 0:
                continue
            pick = rng.choice(candidates.shape[0], size=min(per_group, candidates.shape[0]), replace=False)
            h, q, k = candidates[torch.as_tensor(np.sort(pick))].unbind(-1)
            frames.append(pd.DataFrame({
                "sequence": sequence_offset + b, "layer": layer.layer, "group": name,
                "head": h.cpu().numpy(), "query": q.cpu().numpy(), "key": k.cpu().numpy(),
                "attention": attention[b, h, q, k].cpu().numpy(),
                "relative_norm": rel[b, h, q, k].cpu().numpy(),
                "cosine": cos[b, h, q, k].cpu().numpy(),
                "contribution": con[b, h, q, k].cpu().numpy(),
            }))
    columns = ["sequence", "layer", "group", "head", "query", "key", "attention", "relative_norm", "cosine",
               "contribution"]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)


# --------------------------------------------------------------------------------------------------
# Many batches, cached
# --------------------------------------------------------------------------------------------------
def code_key(source: str | None = None) -> str:
    """A hash of this module's normalised code (no comments, docstrings or layout), part of the key of
    :func:`collect`'s cached pieces: an edit of a statement here computes them again."""
    import hashlib

    text = normalised_source(Path(__file__).read_text(encoding="utf-8") if source is None else source)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def collect(model, batches: Iterable[Mapping[str, torch.Tensor]], *,
            key_groups: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None,
            layers: Sequence[int] | None = None, kind: str = "intra", min_keys: int = 2, rank_min_keys: int = 5,
            rank_views: Sequence[str] = VIEWS, kendall_views: Sequence[str] = (), factor_samples: int = 256,
            seed: int = 0,
            progress: Callable[[int], None] | bool | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Decompose every batch and gather :func:`layer_statistics` and :func:`factor_sample` of each layer:
    ``(statistics, factor samples)``, sequences numbered across batches.

    ``key_groups(batch)``: the batch's key groups (default :func:`first_token_group`). Each batch's tables
    are a cached piece (namespace ``layer-statistics``, inside :func:`cwcore.cache.caching`) keyed by the
    model's fingerprint, the batch, the options and the code (the library's base code and
    :func:`code_key`). ``progress``: True shows a bar; a callable gets the number of sequences done."""
    factor_samples = runs.check_count(factor_samples, "factor_samples", minimum=0)
    min_keys = runs.check_count(min_keys, "min_keys", minimum=0)
    rank_min_keys = runs.check_count(rank_min_keys, "rank_min_keys", minimum=0)

    options = dict(layers=None if layers is None else sorted(layers), kind=kind, min_keys=min_keys,
                   rank_min_keys=rank_min_keys, rank_views=list(rank_views), kendall_views=list(kendall_views),
                   factor_samples=factor_samples, seed=seed)
    # the key covers the library's base code (core, statistics, run driver) and this module's own code
    # a caller's key groups (chapter 8's) group other keys: their code and what it reads (None: the default)
    if key_groups is not None:
        options["key_groups"] = method_key(key_groups)
    store = runs.PieceStore("layer-statistics", {**options, "book_code": code_key()}, model=model, code=())

    def compute(batch) -> dict[str, pd.DataFrame]:
        groups = key_groups(batch) if key_groups else None
        keys = [sequence_key(ids, mask) for ids, mask in
                zip(batch["input_ids"], batch.get("attention_mask", torch.ones_like(batch["input_ids"])))]
        d = decompose(model, layers=layers, **batch)
        per_layer, samples = [], []
        for layer in d.values():
            if groups is None:
                b, _, _, k = layer.attention.shape
                groups = first_token_group(b, k)
            per_layer.append(layer_statistics(layer, groups, min_keys=min_keys, rank_min_keys=rank_min_keys,
                                              rank_views=rank_views, kendall_views=kendall_views))
            samples.append(factor_sample(layer, groups, kind=kind, per_group=factor_samples,
                                         min_keys=min_keys, seed=seed, sequence_keys=keys))
        del d
        return {"stats": pd.concat(per_layer, ignore_index=True), "factors": pd.concat(samples, ignore_index=True)}

    stats_parts, factors = [], []
    offset = 0
    for batch, frames in runs.for_each_batch((dict(b) for b in batches), compute, store,
                                             desc="layer statistics", show_progress=progress is True):
        size = int(next(iter(batch.values())).shape[0])
        # the cached tables number sequences from 0 within their batch
        stats_parts.append(frames["stats"].assign(sequence=frames["stats"]["sequence"] + offset))
        factors.append(frames["factors"].assign(sequence=frames["factors"]["sequence"] + offset))
        offset += size
        if callable(progress):
            progress(offset)
    return pd.concat(stats_parts, ignore_index=True), pd.concat(factors, ignore_index=True)


# --------------------------------------------------------------------------------------------------
# Error bars
# --------------------------------------------------------------------------------------------------
#: :func:`cwcore.stats.bootstrap_ci` under its old name here (one bootstrap for the whole project)
bootstrap_ci = stats.bootstrap_ci


def summarize(statistics: pd.DataFrame, by: Sequence[str] = ("layer", "statistic", "view", "group"),
              n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """Per-group mean over sequences with a percentile bootstrap interval (:func:`cwcore.stats.bootstrap_ci`):
    columns ``*by, mean, low, high, n``; one finite value gives no interval."""
    out = []
    for key, frame in statistics.groupby(list(by), sort=True, dropna=False):
        values = frame["value"].to_numpy(dtype=float)
        mean, low, high = stats.bootstrap_ci(values, n_resamples=n_bootstrap, confidence=confidence, seed=seed)
        n = int(np.isfinite(values).sum())
        out.append((*((key,) if len(by) == 1 else key), mean, low, high, n))
    return pd.DataFrame(out, columns=[*by, "mean", "low", "high", "n"])
