"""Gradient x input on the projected value terms."""

from __future__ import annotations

import torch

from ...core.architectures import UnsupportedModelError, require_causal
from .registry import register_method

__all__ = ["grad_x_input"]


@register_method("grad_x_input", needs=("output_gradient",), cost="one extra forward and backward per batch",
                 title="grad x input", colour="#56b4e9")
def grad_x_input(layer_decomposition, output_gradient, **_):
    """Gradient x input on the projected value terms, per head ``[batch, head, query, key]``:
    score_hij = <g_i, alpha^h_ij v~^h_j>, g_i = d(total log-likelihood of the row's next tokens) / d(a_i),
    a_i the attention block's output at query i (the term enters a_i additively, so its gradient is g_i).
    It is the first-order estimate of how much the term raises the log-likelihood that the protocol's
    Delta NLL measures. Computed in head space: alpha^h_ij (W_O^h^T g_i) . v^h_j."""
    if output_gradient is None:
        raise UnsupportedModelError("grad_x_input: the attention output's gradient was not computed")
    geometry = layer_decomposition.geometry
    valid = layer_decomposition.key_valid  # self-attention: a padded key is a padded query
    require_causal(geometry.attention, layer_decomposition.layer, "grad_x_input",
                   "its next-token log-likelihood (what the gradient differentiates) is not the model's objective",
                   valid if valid is not None and valid.shape[-1] == geometry.attention.shape[-2] else None)
    g = output_gradient.to(geometry.values.dtype)
    pulled = torch.einsum("bqm,hmd->bhqd", g, geometry.w_o)
    return geometry.attention * (pulled @ geometry.values.transpose(-1, -2))
