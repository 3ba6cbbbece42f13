"""What the model-space methods (value zeroing, ALTI) share: the projected value vectors of a layer."""

from __future__ import annotations

import torch

__all__ = ["CHUNK_BYTES", "projected_values"]

#: bytes of one chunk of model-space pair tensors (value zeroing, ALTI)
CHUNK_BYTES = 64 * 2 ** 20


def projected_values(call, at_least: torch.dtype | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(alpha ``[b, h, q, k]``, v~ ``[b, h, k, model]``, bias) in the model's dtype (padding zeroed): the output
    projection's, since a half-precision model's SDPA layers hand cwcore their values in float32; promoted to
    ``at_least`` where given (ALTI's geometry in float32 for a bf16 model; value zeroing runs the model's own
    modules, in its dtype)."""
    from ...core.geometry import split_output_projection

    weight, bias = call.output_projection()
    dtype = weight.dtype if at_least is None else torch.promote_types(weight.dtype, at_least)
    alpha = call.probs.detach().to(dtype)
    values = call.value.detach().to(dtype)
    valid = call.valid_keys()
    if valid is not None:
        alpha = alpha.masked_fill(~valid[:, None, :, None] | ~valid[:, None, None, :], 0.0)
        values = values.masked_fill(~valid[:, None, :, None], 0.0)
    w_o = split_output_projection(weight.detach().to(dtype), alpha.shape[1])
    projected = torch.einsum("bhkd,hmd->bhkm", values, w_o)
    return alpha, projected, None if bias is None else bias.detach().to(dtype)
