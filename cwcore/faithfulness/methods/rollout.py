"""Attention rollout (Abnar and Zuidema 2020) and its contribution-weight version."""

from __future__ import annotations

import torch

from .registry import register_method

__all__ = ["rollout", "contribution_rollout"]


def _rolled(state: dict, key: str, mixing: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """R^l = A^l R^(l-1) with A^l = row-normalised (0.5 mixing + 0.5 I), kept in ``state[key]``."""
    b, q, _ = mixing.shape
    dtype = mixing.dtype
    eye = torch.eye(q, dtype=torch.float64, device=mixing.device)[None]
    mixing = mixing.double().nan_to_num(0.0)
    if valid is not None:
        valid = valid.to(mixing.device)  # the layer's device, where a model is split over devices
        pair = valid[:, :, None] & valid[:, None, :]
        mixing = mixing.masked_fill(~pair, 0.0)
    a = 0.5 * mixing + 0.5 * eye
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-30)
    previous = state.get(key)
    state[key] = a if previous is None else a @ previous.to(a.device)
    return state[key].to(torch.promote_types(dtype, torch.float32))  # the decomposition's dtype (compute_dtype)


@register_method("rollout", needs=("earlier_layers",), cost="no extra forward", title="rollout",
                 colour="#fbafe4")
def rollout(layer_decomposition, state, attention_mask=None, **_):
    """Attention rollout (Abnar and Zuidema 2020), token-level: A^l = 0.5 mean_h alpha^l + 0.5 I
    (the residual), row-normalised; the score of layer l is the product A^l A^(l-1) ... A^0."""
    mixing = layer_decomposition.attention.nan_to_num(0.0).mean(1)
    return _rolled(state, "rollout", mixing, None if attention_mask is None else attention_mask.bool())


@register_method("contribution_rollout", needs=("earlier_layers",), cost="no extra forward",
                 title="contribution rollout", colour="#949494")
def contribution_rollout(layer_decomposition, state, attention_mask=None, **_):
    """The rollout product applied to token-level contribution weights C_ij = sum_h c^h_ij (``inter``,
    summing to 1 over keys). Negative weights (destructive interference) are clipped at zero before the
    row normalisation, as ALTI clips its contributions (Ferrando et al. 2022)."""
    mixing = layer_decomposition.contribution("inter").nan_to_num(0.0).sum(1).clamp_min(0.0)
    mixing = mixing / mixing.sum(-1, keepdim=True).clamp_min(1e-30)
    return _rolled(state, "contribution_rollout", mixing, None if attention_mask is None else attention_mask.bool())
