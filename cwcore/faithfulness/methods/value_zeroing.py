"""Value zeroing (Mohebbi et al. 2023), adapted to decoders."""

from __future__ import annotations

import torch

from ...core.architectures import UnsupportedModelError, later_attention
from ...runs import progress
from .projection import CHUNK_BYTES, projected_values
from .registry import register_method

__all__ = ["value_zeroing", "PROGRESS_PAIRS"]

#: a layer with at least this many scored pairs shows a progress bar (about a second of work on a CPU core)
PROGRESS_PAIRS = 2048


def _rest_of_block(call, block_input, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
    """The decoder layer's output when its attention block returns ``attention_out`` (``[1, n, model]``,
    after the output projection) on residual inputs ``hidden`` ``[1, n, model]``: the layer's own
    modules (norms, residual, MLP) are run, the attention module is replaced by that output."""
    parent, module = call.block.parent, call.module
    args, kwargs = block_input
    if args:
        args = (hidden,) + tuple(args[1:])
    else:
        kwargs = {**kwargs, "hidden_states": hidden}
    module.forward = lambda *a, **k: (attention_out, None)
    try:  # forward, not __call__: hooks on the decoder layer (recorders, the block-input capture) stay quiet
        out = parent.forward(*args, **kwargs)
    finally:
        del module.forward
    return out[0] if isinstance(out, tuple) else out


@register_method("value_zeroing", needs=("block_input",), title="value zeroing", colour="#ca9161",
                 cost="per layer, the rest of the block on one token per candidate pair (~Q/2 forwards)")
def value_zeroing(layer_decomposition, call, block_input, candidates=None, **_):
    """Value zeroing (Mohebbi et al. 2023) for decoders, token-level ``[batch, query, key]``.

    For key j, its value vector is zeroed in every head of the layer (the value bias included) while the
    attention weights stay; the attention output at query i then loses sum_h alpha^h_ij v~^h_j exactly,
    and the rest of the decoder layer (residual, post-attention norm if any, MLP) is run again on it.
    Score = cosine distance 1 - cos(x_i, x~_i^(j)) between the layer's original and altered output at
    query i. Vectorised: the altered attention outputs of all (i, j) pairs are formed in model space and
    the layer's own modules run on them as a flat batch of tokens (norms and MLP act per token), in
    chunks of :data:`CHUNK_BYTES`. Scored pairs: the candidates (all causal pairs of real tokens without).
    """
    if block_input is None:
        raise UnsupportedModelError("value_zeroing: the decoder layer's input was not captured")
    block = call.block
    applies_w_o = block.output_module()
    if applies_w_o is None or not any(sub is applies_w_o for sub in call.module.modules()):
        # BERT-style: W_O and the residual norm sit in the parent, so the module cannot be swapped for its output
        raise UnsupportedModelError(
            f"value_zeroing: attention block {block.name!r} applies its output projection outside the attention "
            f"module (in {type(block.parent).__name__}); value zeroing reruns a decoder layer around an attention "
            "module that returns the projected output, so it cannot score this block")
    alpha, projected, bias = projected_values(call)
    b, h, q, k = alpha.shape
    hidden = block_input[0][0] if block_input[0] else block_input[1]["hidden_states"]
    original = torch.einsum("bhqk,bhkm->bqm", alpha, projected)
    if bias is not None:
        original = original + bias
    m = original.shape[-1]
    clean = _rest_of_block(call, block_input, hidden.reshape(1, b * q, m), original.reshape(1, b * q, m))
    clean = clean.reshape(b, q, m).double()
    if candidates is None:
        # every pair a query attends to: keys 0..i in a causal layer, every key in an encoder's (it kept only keys
        # 0..i there, and scored each later key 0)
        candidates = torch.ones(b, 1, q, k, dtype=torch.bool, device=alpha.device)
        if not bool((later_attention(call.probs, call.valid_queries()) > 0).any()):
            candidates = candidates.tril()
        valid = call.valid_keys()
        if valid is not None:
            candidates = candidates & (valid[:, None, :, None] & valid[:, None, None, :])
    rows, queries, keys = candidates[:, 0].expand(b, q, k).nonzero(as_tuple=True)
    # the distances in compute_dtype (float32, or float64 asked for); the reruns are the model's own, in its dtype
    scores = torch.zeros(b, q, k, dtype=torch.promote_types(torch.float32, call.compute_dtype), device=alpha.device)
    step = max(1, CHUNK_BYTES // (h * m * projected.element_size()))
    # a bar for the long calls (seconds per layer: ~Q^2/2 pairs through the MLP), none for short ones
    bar = progress(rows.numel(), f"value zeroing, layer {layer_decomposition.layer}", unit="pair",
                   enabled=rows.numel() >= PROGRESS_PAIRS, leave=False)
    try:
        for start in range(0, rows.numel(), step):
            r, i, j = rows[start:start + step], queries[start:start + step], keys[start:start + step]
            delta = torch.einsum("ph,phm->pm", alpha[r, :, i, j], projected[r, :, j])
            altered = _rest_of_block(call, block_input, hidden[r, i][None], (original[r, i] - delta)[None])[0].double()
            scores[r, i, j] = (1 - torch.nn.functional.cosine_similarity(clean[r, i], altered, dim=-1)).to(scores.dtype)
            bar.update(int(r.numel()))
    finally:
        bar.close()
    return scores
