"""The blockwise softmax of the recorded layers: probabilities computed a block of queries at a time,
so memory holds the probabilities and one block's scores, never a second [batch, head, query, key]
tensor of scores (:func:`_probs_in_chunks`, used by :func:`cwcore.core.attention.attention_forward`)."""

from __future__ import annotations

import torch

#: :func:`_probs_in_chunks` computes the scores of at most QUERY_BLOCK queries (all heads), and at most
#: CHUNK_ELEMENTS scores (64 MiB in float32), at a time: memory then holds the probabilities and one
#: block, whatever the length, and a causal mask lets each block skip the keys after its last query.
#: Blocks of about an eighth of the keys, at least MIN_QUERY_BLOCK queries: small enough that a causal
#: mask skips about 40% of the keys (blocks of 64 at 512 tokens), and that a block's scores stay in
#: cache while its softmax and its alpha V are computed, large enough for the matrix products.
QUERY_BLOCK = 256
MIN_QUERY_BLOCK = 64
CHUNK_ELEMENTS = 1 << 24


def _chunkable(query: torch.Tensor, key: torch.Tensor, softcap, s_aux) -> bool:
    """Whether :func:`_probs_in_chunks` computes this call (float32, no softcap, no sink logits, no autograd)."""
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
    return query.dtype == torch.float32 and softcap is None and s_aux is None and not needs_grad


def _block_rows(heads: int, k_len: int) -> int:
    return max(1, min(QUERY_BLOCK, max(MIN_QUERY_BLOCK, k_len // 8), CHUNK_ELEMENTS // max(1, heads * k_len)))


def _mask_plan(attention_mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, rows: int):
    """``(hidden, additive, spans)`` for :func:`_probs_in_chunks`: the masked entries ``[batch or 1, head or 1,
    query, key]`` (bool, or None), the additive float mask of the same shape (or None) and, per batch row, the
    query blocks ``(start, stop, first, limit)``: keys outside ``first:limit`` are masked for every query of
    the block (unless a row of the block masks every key: eager then spreads it uniformly, so that block
    keeps every key)."""
    minimum = torch.finfo(torch.float32).min
    hidden = additive = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            allowed = attention_mask
        else:
            additive = attention_mask[..., :k_len].to(torch.float32)
            allowed = additive > minimum
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        if additive is not None:
            additive = additive.reshape(allowed.shape)
        else:
            hidden = ~allowed
    spans = []
    for b in range(batch if attention_mask is None or allowed.shape[0] > 1 else 1):
        blocks = []
        for start in range(0, q_len, rows):
            stop = min(q_len, start + rows)
            first, limit = 0, k_len
            if attention_mask is not None:
                block = allowed[b, :, start:stop]
                if bool(block.any(-1).all()):  # no row masks every key: drop the keys all rows mask
                    columns = block.any(1).any(0).nonzero()
                    first, limit = int(columns[0]), int(columns[-1]) + 1
            blocks.append((start, stop, first, limit))
        spans.append(tuple(blocks))
    if len(spans) < batch:  # one mask for every batch row
        spans = spans * batch
    return hidden, additive, tuple(spans)


def _probs_in_chunks(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                     scaling: float, value: torch.Tensor | None = None, plans: dict | None = None):
    """``softmax(scaling * query key^T + mask)`` ``[batch, head, query, key]`` (float32), a block of queries
    at a time; with ``value`` ``[batch, head, key, dim]`` also ``probs @ value`` ``[batch, head, query, dim]``.

    Returns ``(probs, probs @ value or None, spans)`` (``spans``: see :func:`_mask_plan`; probabilities outside
    them are exactly 0). The same arithmetic as eager (scores, masked scores at finfo.min, float32 softmax)
    without its attention-sized temporaries: each block's scores are written once (``baddbmm`` puts an
    additive mask and the scaled product in one pass), its softmax goes straight into the returned tensor
    and, while it is still in cache, its product with the values. Keys that every row of a block masks
    (the future, under a causal mask) are not computed: their probability is exactly 0, as eager's softmax
    of finfo.min gives; likewise the keys before a sliding window. ``plans`` caches the mask's analysis by
    mask (every layer of a forward pass shares one mask).
    """
    batch, heads, q_len, _ = query.shape
    k_len = key.shape[-2]
    minimum = torch.finfo(torch.float32).min
    rows = _block_rows(heads, k_len)
    plan_key = (id(attention_mask), batch, q_len, k_len, rows)
    cached = None if plans is None else plans.get(plan_key)
    if cached is not None and cached[0] is attention_mask:
        hidden, additive, spans = cached[1]
    else:
        hidden, additive, spans = _mask_plan(attention_mask, batch, q_len, k_len, rows)
        if plans is not None:
            if len(plans) >= 4:
                plans.pop(next(iter(plans)))
            plans[plan_key] = (attention_mask, (hidden, additive, spans))  # holds the mask: its id stays its own
    probs = torch.empty(batch, heads, q_len, k_len, dtype=torch.float32, device=query.device)
    mixed = None if value is None else torch.empty(batch, heads, q_len, value.shape[-1], dtype=value.dtype,
                                                   device=value.device)
    key_t = key.transpose(2, 3)
    for b in range(batch):
        hidden_b = None if hidden is None else hidden[b if hidden.shape[0] > 1 else 0]  # [head or 1, q, k]
        bias_b = None if additive is None else additive[b if additive.shape[0] > 1 else 0]
        for start, stop, first, limit in spans[b]:
            q_block, keys = query[b, :, start:stop], key_t[b, :, :, first:limit]
            if bias_b is not None:
                scores = torch.baddbmm(bias_b[:, start:stop, first:limit], q_block, keys, alpha=scaling)
            else:
                scores = torch.matmul(q_block, keys).mul_(scaling)
                if hidden_b is not None:
                    scores.masked_fill_(hidden_b[:, start:stop, first:limit], minimum)
            target = probs[b, :, start:stop]  # [head, block, key]
            inside = target[..., first:limit]
            torch.softmax(scores, -1, out=inside)
            target[..., :first] = 0.0
            target[..., limit:] = 0.0
            if mixed is not None:
                torch.matmul(inside, value[b, :, first:limit], out=mixed[b, :, start:stop])
    return probs, mixed, spans


def adoptable_own_output(session, models_own, model_dtype: torch.dtype, attention_mask, query_shape, k_len: int):
    """The model's own output of an observed layer (``models_own()``'s ``[batch, query, head, dim]``, or None where
    the session computes the layer itself) where :func:`adopted_own_output` may adopt it: a float32 model decomposed
    in float32, no key padded (a padded key's value is masked in the geometry, which then differs from the layer's);
    else None."""
    if models_own is None or not model_dtype == session.compute_dtype == torch.float32:
        return None
    if session.mask_validity(attention_mask, query_shape[0], query_shape[2], k_len)[0] is not None:
        return None
    return models_own()[0]


def adopted_own_output(session, module, probs: torch.Tensor, value: torch.Tensor, own: torch.Tensor, attention_mask,
                       inputs) -> torch.Tensor:
    """The model's own output ``own`` ``[batch, query, head, dim]`` (its SDPA's, for a layer a session only observes)
    as the layer's alpha @ V ``[batch, head, query, dim]`` (a view), checked instead of computed: ``probs``
    ``[batch, head, query, key]`` (float32) against it along :data:`~cwcore.core.geometry.PROBES` random directions r
    of head space (Freivalds' test, as :func:`cwcore.summarize` and the output projection's check): alpha (V r)
    against z r, relative to max |z|. An error e_i of a row shows as e_i r ~ N(0, ||e_i||^2), at least the size of
    its largest entry with high probability over the directions and the queries: as strict as comparing entries,
    without the attention-sized product alpha @ V; a difference beyond the tolerance is measured again entry by
    entry (:meth:`~cwcore.core.attention.AttentionSession.models_own_output`), which decides. ``value`` ``[batch,
    head, key, dim]``; ``inputs``: the call's query, key and value, for the reason of a non-finite output. ``own``:
    from :func:`adoptable_own_output`."""
    from .geometry import probe_directions

    session.refuse_non_finite(module, own, attention_mask, inputs)  # its reason, before a comparison's
    mixed = own.detach().transpose(1, 2)
    if session.verify:
        probes = probe_directions(value.shape[-1], value.dtype, value.device)  # [dim, probes]
        difference = (probs @ (value @ probes) - mixed @ probes).abs().max()
        scale = mixed.abs().max().clamp_min(torch.finfo(mixed.dtype).tiny)
        error = float((difference / scale).nan_to_num(float("inf")))
        if not session.own_output_agrees(module, error, own.dtype):
            # the entrywise comparison decides (a sum along r can exceed the largest entry's error), and gives a
            # refusal its exact error
            session.models_own_output(module, (probs @ value).transpose(1, 2), own, attention_mask, value.shape[-2])
    return mixed


def _bias_mask(position_bias: torch.Tensor, attention_mask: torch.Tensor | None, key: torch.Tensor) -> torch.Tensor:
    """An additive score bias ``[batch or 1, head, query, key]`` and the call's mask as one additive float mask,
    as transformers' SDPA function combines them (the blockwise softmax of a model configured for SDPA)."""
    bias = position_bias[..., : key.shape[-2]]
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:
        return torch.where(attention_mask, bias, max(torch.finfo(key.dtype).min, torch.finfo(bias.dtype).min))
    return bias + attention_mask[..., : key.shape[-2]]


def _causal_mask(q_len: int, k_len: int, device) -> torch.Tensor:
    """``[query, key]`` bool, True where a query may see a key: query i sees keys 0..i, SDPA's ``is_causal``
    alignment (top-left). transformers omits the mask with more keys than queries only where that is meant
    (a prefill into an empty static cache: the later keys are empty slots)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()
