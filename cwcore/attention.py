"""One attention function for measurement and intervention, plugged in through transformers' interface.

:func:`attention_forward` follows the eager implementation's arithmetic exactly (same matmul, mask
addition and float32 softmax), so a model run through it gives the same outputs as ``eager``. While an
:class:`AttentionSession` is active it also (a) computes the head-space geometry of the layers the
session asks for and (b) zeroes selected post-softmax probabilities, without renormalising, which
removes the terms alpha^h_ij v~^h_j from o_i. The matching mask function is registered under the same
name; without it transformers would build no causal mask at all.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from .architectures import AttentionBlock, attention_blocks
from .geometry import head_space_geometry, split_output_projection

__all__ = ["ATTENTION_NAME", "AttentionSession", "attention_forward", "cwcore_attention"]

ATTENTION_NAME = "cwcore"

_SESSIONS: list["AttentionSession"] = []


def _repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    """``[batch, kv_head, seq, dim]`` -> ``[batch, kv_head * groups, seq, dim]`` like transformers' repeat_kv."""
    return states if groups == 1 else states.repeat_interleave(groups, dim=1)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with cwcore's measurement and intervention points.

    query ``[batch, head, query, dim]``, key/value ``[batch, kv_head, key, dim]``.
    Returns (output ``[batch, query, head, dim]``, probabilities ``[batch, head, query, key]``).
    """
    groups = query.shape[1] // key.shape[1]
    key = _repeat_heads(key, groups)
    value = _repeat_heads(value, groups)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    probs = torch.matmul(query, key.transpose(2, 3)) * scaling  # scores; one name so they are freed early
    if softcap is not None:
        probs = torch.tanh(probs / softcap) * softcap
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            probs = probs.masked_fill(~attention_mask, torch.finfo(probs.dtype).min)
        else:
            probs = probs + attention_mask[..., : key.shape[-2]]
    probs = nn.functional.softmax(probs, dim=-1, dtype=torch.float32)
    if _SESSIONS:
        probs = _SESSIONS[-1].on_attention(module, probs, value)
    probs = probs.to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = torch.matmul(probs, value)
    return output.transpose(1, 2).contiguous(), probs


AttentionInterface.register(ATTENTION_NAME, attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


# A mask for one layer: a boolean tensor broadcastable to [batch, head, query, key] (True = remove),
# or a callable that builds one from the layer's live decomposition (see cwcore.decompose).
LayerMask = torch.Tensor | Callable[..., torch.Tensor]


class AttentionSession:
    """What cwcore does inside the attention of one forward pass.

    record: layer numbers whose geometry is kept (see :class:`cwcore.decomposition.LayerDecomposition`).
    masks: ``{layer: LayerMask}``; removes the selected terms before the values are mixed.
    key_valid: ``[batch, key]`` bool, False at padding (padded queries become NaN in the geometry).
    """

    def __init__(
        self,
        model: nn.Module,
        record: set[int] | None = None,
        masks: Mapping[int, LayerMask] | None = None,
        key_valid: torch.Tensor | None = None,
        compute_dtype: torch.dtype = torch.float32,
    ):
        self.blocks = attention_blocks(model)
        self._by_module = {id(b.module): b for b in self.blocks}
        num_layers = len(self.blocks)
        self.record = set(record or ())
        self.masks = dict(masks or {})
        for layer in self.record | set(self.masks):
            if not 0 <= layer < num_layers:
                raise IndexError(f"layer {layer} out of range: the model has {num_layers} attention layers")
        self.key_valid = key_valid
        self.compute_dtype = compute_dtype
        self.recorded: dict[int, "object"] = {}

    def layer_geometry(self, block: AttentionBlock, probs: torch.Tensor, value: torch.Tensor):
        """The :class:`~cwcore.decomposition.LayerDecomposition` of one layer from its probabilities and values."""
        from .decomposition import LayerDecomposition  # decomposition imports this module

        dtype = self.compute_dtype
        weight, bias = block.output_projection()
        w_o = split_output_projection(weight.detach().to(dtype), probs.shape[1])
        alpha = probs.detach().to(dtype)
        values = value.detach().to(dtype)
        valid = self.key_valid
        if valid is not None and valid.shape[-1] == alpha.shape[-1] == alpha.shape[-2]:
            # Padded queries are not tokens: make that explicit instead of reporting garbage rows.
            alpha = alpha.masked_fill(~valid[:, None, :, None].to(alpha.device), float("nan"))
            values = values.masked_fill(~valid[:, None, :, None].to(values.device), 0.0)
        geometry = head_space_geometry(alpha, values, w_o)
        if valid is not None and valid.shape[-1] == alpha.shape[-1]:
            geometry.value_norm = geometry.value_norm.masked_fill(~valid[:, None, :].to(alpha.device), float("nan"))
        return LayerDecomposition(
            block.layer, geometry, None if bias is None else bias.detach().to(dtype), key_valid=valid
        )

    def on_attention(self, module: nn.Module, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        block = self._by_module.get(id(module))
        if block is None:
            return probs
        layer = block.layer
        mask = self.masks.get(layer)
        shared = callable(mask)  # the live decomposition handed to the callable may hold `probs` itself
        if shared:
            mask = mask(self.layer_geometry(block, probs, value))
        if mask is not None:
            mask = torch.as_tensor(mask, dtype=torch.bool, device=probs.device)
            # zeroing leaves every other probability bit-for-bit unchanged (an empty mask changes nothing);
            # in place where nothing else holds the softmax output, which saves a copy per layer
            in_place = not (shared or probs.requires_grad)
            probs = probs.masked_fill_(mask, 0.0) if in_place else probs.masked_fill(mask, 0.0)
        if layer in self.record:
            self.recorded[layer] = self.layer_geometry(block, probs, value)
        return probs


def _configs(model: nn.Module) -> list:
    seen, configs = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            configs.append(config)
    return configs


@contextlib.contextmanager
def cwcore_attention(model: nn.Module, session: AttentionSession | None = None) -> Iterator[AttentionSession | None]:
    """Route the model's attention through :func:`attention_forward` (and ``session``) inside the block.

    The previous attention implementation is restored on exit, also after an exception.
    """
    configs = _configs(model)
    previous = [c._attn_implementation_internal if hasattr(c, "_attn_implementation_internal") else c._attn_implementation for c in configs]
    for config in configs:
        config._attn_implementation_internal = ATTENTION_NAME
    if session is not None:
        _SESSIONS.append(session)
    try:
        yield session
    finally:
        if session is not None:
            _SESSIONS.remove(session)
        for config, value in zip(configs, previous):
            config._attn_implementation_internal = value
