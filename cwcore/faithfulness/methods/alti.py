"""ALTI (Ferrando et al. 2022), adapted to RMSNorm decoders."""

from __future__ import annotations

import torch

from ...core.architectures import UnsupportedModelError, require_causal
from .projection import CHUNK_BYTES, projected_values
from .registry import register_method

__all__ = ["alti"]


@register_method("alti", needs=("block_input", "post_attention_norm", "block_output"),
                 cost="no extra forward; [rows, query chunk, key, model] tensors",
                 title="ALTI", colour="#ece133")
def alti(layer_decomposition, call, block_input, post_attention_norm=None, model=None, **_):
    """ALTI-style contributions (Ferrando et al. 2022) of one decoder layer, token-level.

    The residual stream after the attention sub-block is y_i = x_i + N(a_i), a_i = sum_j sum_h
    alpha^h_ij v~^h_j + b (x_i: the layer's input; N: the post-attention norm of sandwich-norm models
    such as Gemma 3, else the identity). The transformed vectors are T_i(x_j) = N_lin(sum_h alpha^h_ij
    v~^h_j) (+ x_i when j = i), where N_lin is the norm's linear part at the clean run's statistics:
    ALTI splits LayerNorm(sum_j z_j) into sum_j g * (z_j - mean z_j) / sigma; for **RMSNorm the same
    split without the mean subtraction**, g * z_j / rms(a_i), which is exact. Contribution:
    c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), normalised to sum 1 over keys j; a query where every c_ij is 0
    (each T_i(x_j) as far from y_i as zero is, e.g. under a large W_O bias b, which no token carries) gets a row of
    zeros, not NaN: no key contributes, so there is nothing to normalise. One layer, no
    rollout over layers. Pre-norm models (Llama, Qwen, SmolLM2) have N = identity
    (``post_attention_norm`` None). Refused: a post-LN layer, which adds the residual inside its LayerNorm,
    y_i = LN(x_i + a_i) (BERT, BART, OPT-350m: found by a probe forward,
    :func:`cwcore.core.architectures.residual_norms`), a layer that attends to later keys (an encoder), and, after
    the forward, a layer whose block returns another tensor than its output projection's result (a hook on the
    block): y_i is then not x_i + N(a_i).
    """
    from ...core.architectures import residual_norms
    from ...logit_attribution import frozen_norm_on, norm_at_float32

    if block_input is None:
        raise UnsupportedModelError("alti: the decoder layer's input was not captured")
    residual = None if model is None else residual_norms(model).get(call.layer)
    if residual is not None:  # before: scored as x_i + a_i, up to 0.06 off the layer's own stream on BART
        raise UnsupportedModelError(
            f"alti: attention layer {call.layer} is post-LN: its residual enters a norm with the attention output, "
            f"y_i = LN(x_i + a_i) ({type(residual).__name__}, found in a probe forward), and this ALTI is written "
            "for y_i = x_i + N(a_i), the pre-norm and sandwich-norm layers")
    # geometry in float32 at least, even for a bf16 model: ||y_i||_1 - ||y_i - T_i(x_j)||_1 is a difference of
    # two nearly equal sums, which bf16 sums would swamp (a bf16 GPT-2's scores were 17% off)
    require_causal(call.probs, call.layer, "alti", "its transformed vectors (written for a decoder's residual "
                   "x_i + N(a_i)) and its pairs (keys 0..i) do not describe the layer", call.valid_queries())
    alpha, projected, bias = projected_values(call, at_least=torch.promote_types(torch.float32, call.compute_dtype))
    b, h, q, k = alpha.shape
    hidden = (block_input[0][0] if block_input[0] else block_input[1]["hidden_states"]).to(projected.dtype)
    a = torch.einsum("bhqk,bhkm->bqm", alpha, projected)
    if bias is not None:
        a = a + bias
    valid = call.valid_keys()
    norm = post_attention_norm
    scale = None
    normed = None
    if norm is not None:  # the norm's linear part at this run's statistics, fitted on the real rows
        normed = norm_at_float32(norm, a).to(a.dtype)  # the model's own norm
        frozen = frozen_norm_on(valid, norm, a, normed, dtype=projected.dtype)
        scale = frozen.scale  # [batch, query], NaN on padded rows (their scores are set to 0 below)
    y = hidden + (a if normed is None else normed)
    m = y.shape[-1]
    pair = torch.ones(b, q, k, dtype=torch.bool, device=alpha.device).tril()
    if valid is not None:
        pair = pair & valid[:, :, None] & valid[:, None, :]
    scores = torch.zeros(b, q, k, dtype=projected.dtype, device=alpha.device)  # float32, or compute_dtype float64
    step = max(1, CHUNK_BYTES // (b * k * m * projected.element_size() * 2))
    for q0 in range(0, q, step):
        q1 = min(q, q0 + step)
        terms = torch.einsum("bhqk,bhkm->bqkm", alpha[:, :, q0:q1], projected)
        if scale is not None:
            terms = frozen.gain * frozen.project(terms) / scale[:, q0:q1, None, None]
        diagonal = torch.arange(q0, q1, device=alpha.device)
        terms[:, diagonal - q0, diagonal] += hidden[:, q0:q1]
        y_part = y[:, q0:q1, None]
        distance = (y_part - terms).abs().sum(-1)
        c = (y_part.abs().sum(-1) - distance).clamp_min(0).masked_fill(~pair[:, q0:q1], 0.0)
        scores[:, q0:q1] = c / c.sum(-1, keepdim=True).clamp_min(1e-30)
    return scores
