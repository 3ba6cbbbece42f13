"""The geometry of one attention block: projected value vectors and the weights built on them.

Everything here works in *head space*: with W_O^h the head's slice of the output projection
(``[model, head_dim]``) and its Gram matrix G_h = W_O^h^T W_O^h, every inner product between projected
value vectors v~_j = W_O^h v_j and outputs o_i can be computed without materialising
``[query, key, model]`` tensors:

    <o^h_i, v~^h_j> = z^h_i^T G_h v^h_j        (z^h_i = sum_j alpha_ij v^h_j, the head's mixed value)
    <o_i,   v~^h_j> = (W_O^h^T o_i)^T v^h_j    (o_i = sum_h W_O^h z^h_i, the block output without bias)

so the extra cost is a few attention-sized matrix products. :func:`naive_geometry` materialises the
terms alpha_ij v~_j and serves as the independent reference in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HeadSpaceGeometry", "head_space_geometry", "naive_geometry", "split_output_projection"]


def split_output_projection(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-head slices of an output projection.

    ``weight``: ``[model, head * head_dim]`` (``nn.Linear`` layout, y = W x).
    Returns ``[head, model, head_dim]``.
    """
    model_dim, inner = weight.shape
    if inner % num_heads:
        raise ValueError(f"output projection width {inner} is not divisible by {num_heads} heads")
    return weight.reshape(model_dim, num_heads, inner // num_heads).permute(1, 0, 2)


@dataclass
class HeadSpaceGeometry:
    """The raw inner products of one layer, from which every metric is derived.

    Shapes: ``attention``, ``intra_dot``, ``inter_dot``: ``[batch, head, query, key]``;
    ``value_norm``: ``[batch, head, key]``; ``head_output_norm``: ``[batch, head, query]``;
    ``output_norm``: ``[batch, query]``; ``output``: ``[batch, query, model]`` or None.
    ``intra_dot`` = <o^h_i, v~^h_j>, ``inter_dot`` = <o_i, v~^h_j> (o_i combined over heads, no bias).
    """

    attention: torch.Tensor
    value_norm: torch.Tensor
    head_output_norm: torch.Tensor
    output_norm: torch.Tensor
    intra_dot: torch.Tensor
    inter_dot: torch.Tensor
    output: torch.Tensor | None = None


def head_space_geometry(
    attention: torch.Tensor,
    values: torch.Tensor,
    w_o: torch.Tensor,
    keep_output: bool = False,
) -> HeadSpaceGeometry:
    """Inner products of projected value vectors and outputs, computed in head space.

    attention: ``[batch, head, query, key]``; values: ``[batch, head, key, head_dim]`` (already
    repeated for grouped-query attention, bias included); w_o: ``[head, model, head_dim]``.
    All inputs must share one floating dtype (float32 or float64).
    """
    gram = w_o.transpose(1, 2) @ w_o  # [head, head_dim, head_dim]; symmetric
    values_gram = values @ gram  # [b, h, k, d]  = G v_j
    value_norm = (values_gram * values).sum(-1).clamp_min(0).sqrt()
    mixed = attention @ values  # z^h_i: [b, h, q, d]
    intra_dot = mixed @ values_gram.transpose(-1, -2)  # z^T G v: [b, h, q, k]
    head_output_norm = ((mixed @ gram) * mixed).sum(-1).clamp_min(0).sqrt()
    output = torch.einsum("bhqd,hmd->bqm", mixed, w_o)  # o_i without bias
    pulled_back = torch.einsum("bqm,hmd->bhqd", output, w_o)  # W_O^h^T o_i
    inter_dot = pulled_back @ values.transpose(-1, -2)
    return HeadSpaceGeometry(
        attention=attention,
        value_norm=value_norm,
        head_output_norm=head_output_norm,
        output_norm=output.norm(dim=-1),
        intra_dot=intra_dot,
        inter_dot=inter_dot,
        output=output if keep_output else None,
    )


def naive_geometry(attention: torch.Tensor, values: torch.Tensor, w_o: torch.Tensor) -> HeadSpaceGeometry:
    """Reference implementation: materialises every term alpha_ij v~_j in model space.

    Memory ``[batch, head, query, key, model]``: for tests and small inputs only.
    """
    projected = torch.einsum("bhkd,hmd->bhkm", values, w_o)  # v~^h_j
    terms = attention[..., None] * projected[:, :, None]  # [b, h, q, k, m]
    head_outputs = terms.sum(3)  # o^h_i: [b, h, q, m]
    output = head_outputs.sum(1)  # o_i: [b, q, m]
    return HeadSpaceGeometry(
        attention=attention,
        value_norm=projected.norm(dim=-1),
        head_output_norm=head_outputs.norm(dim=-1),
        output_norm=output.norm(dim=-1),
        intra_dot=torch.einsum("bhqm,bhkm->bhqk", head_outputs, projected),
        inter_dot=torch.einsum("bqm,bhkm->bhqk", output, projected),
        output=output,
    )
