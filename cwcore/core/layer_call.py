"""What transforms and observers see of one attention layer in one forward pass (:class:`LayerCall`), and
their two signatures. The session that makes the calls is :mod:`cwcore.core.attention`."""

from __future__ import annotations

from typing import Callable

import torch

from .architectures import AttentionBlock
from .geometry import HeadSpaceGeometry, head_space_geometry, split_output_projection

__all__ = ["LayerCall", "Observer", "Transform"]


class LayerCall:
    """One attention layer inside one forward pass, as transforms and observers see it.

    ``probs`` ``[batch, head, query, key]``: the float32 softmax output (without a learned sink's
    column, see ``learned_sink_mass``), after the transforms that ran before; ``value`` ``[batch, head, key, dim]``: the values in the model's dtype, already repeated
    for grouped-query attention; ``key_valid`` ``[batch, key]`` (False at padding) or None and
    ``query_valid`` ``[batch, query]`` or None, both read from this call's own attention mask (a key no
    query may see is padding; a query is padding when it is a self-attention call's padded key), never
    from a mask of another sequence that happens to have the same length.
    :meth:`geometry` (cached until ``probs`` is replaced) is the layer's head-space geometry in
    ``compute_dtype``, with padded query rows NaN.
    ``added_output`` ``[batch, head, query, dim]`` (None by default): what a transform adds to each head's
    output ``probs @ value`` before the output projection, e.g. the stand-in values of removed terms
    (:func:`cwcore.core.interventions.removal`); transforms add to it, never replace what an earlier one set.
    """

    def __init__(self, block: AttentionBlock, probs: torch.Tensor, value: torch.Tensor,
                 key_valid: torch.Tensor | None, compute_dtype: torch.dtype,
                 learned_sink_mass: torch.Tensor | None = None, mixed: torch.Tensor | None = None,
                 key_spans=None, query_valid: torch.Tensor | None = None):
        self.block, self.layer, self.module = block, block.layer, block.module
        #: ``[batch, head, query]``: the softmax mass a learned sink logit absorbed (None without one)
        self.learned_sink_mass = learned_sink_mass
        #: whether the model's own maps are the softmax over the keys alone, its sink a scale 1 - learned_sink_mass
        #: on the output (Granite SWA), rather than ``probs`` (the sink-dropped softmax, as GPT-OSS returns them)
        self.sink_scales_output = False
        self._probs = probs
        # what the blockwise softmax computed with these probabilities: probs @ value and where probs is 0
        self._computed = (mixed, key_spans)
        self.value = value
        self.key_valid = key_valid
        self.query_valid = query_valid
        self.compute_dtype = compute_dtype
        self._geometry: HeadSpaceGeometry | None = None
        self._mixed_is_output = False
        self.added_output: torch.Tensor | None = None

    @property
    def probs(self) -> torch.Tensor:
        return self._probs

    @probs.setter
    def probs(self, new: torch.Tensor) -> None:
        self._probs = new
        self._geometry = None  # computed from the old probabilities
        self._computed = (None, None)

    @property
    def geometry_computed(self) -> bool:
        """Whether :meth:`geometry` was read since ``probs`` last changed (it may then share ``probs``)."""
        return self._geometry is not None

    def output_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [model, head * head_dim], bias [model] | None)`` of this block."""
        return self.block.output_projection()

    def valid_keys(self) -> torch.Tensor | None:
        """``[batch, key]``: False at the keys this call's mask hides from every query (padding), or None."""
        return None if self.key_valid is None else self.key_valid.to(self._probs.device)

    def valid_queries(self) -> torch.Tensor | None:
        """``[batch, query]``: False at padded queries (a self-attention call's padded keys), or None."""
        return None if self.query_valid is None else self.query_valid.to(self._probs.device)

    def geometry(self) -> HeadSpaceGeometry:
        """The head-space geometry of the current probabilities (see :mod:`cwcore.core.geometry`)."""
        if self._geometry is None:
            self._geometry = self._compute_geometry()
        return self._geometry

    def _compute_geometry(self) -> HeadSpaceGeometry:
        dtype = self.compute_dtype
        weight, _ = self.output_projection()
        # a copy: views computed later must describe this forward pass, not the weights as they are then
        w_o = split_output_projection(weight.detach().to(dtype, copy=True), self._probs.shape[1])
        alpha = self._probs.detach().to(dtype)
        values = self.value.detach().to(dtype)
        valid, queries = self.valid_keys(), self.valid_queries()
        if queries is not None:
            # Padded queries are not tokens: make that explicit instead of reporting garbage rows.
            alpha = alpha.masked_fill(~queries[:, None, :, None], float("nan"))
        if valid is not None:
            values = values.masked_fill(~valid[:, None, :, None], 0.0)
        own = (alpha.data_ptr() == self._probs.data_ptr() and values.data_ptr() == self.value.data_ptr()
               and alpha.dtype == self._probs.dtype and values.dtype == self.value.dtype)
        mixed, spans = self._computed if own else (None, None)
        geometry = head_space_geometry(alpha, values, w_o, mixed, spans)
        if valid is not None:
            geometry.value_norm = geometry.value_norm.masked_fill(~valid[:, None, :], float("nan"))
        # alpha and values are the layer's own tensors (no cast, no masking): the mixed values are then
        # exactly the layer's alpha @ V, which attention_forward reuses instead of computing it again
        self._mixed_is_output = own and not (self._probs.requires_grad or self.value.requires_grad)
        return geometry

    @property
    def owns_geometry(self) -> bool:
        """Whether the geometry was computed from the layer's own alpha and values (no cast, no padding
        masked), so its mixed values are exactly what the layer passes to its output projection."""
        return self._geometry is not None and self._mixed_is_output

    def layer_output(self, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """``probs @ value`` ``[batch, head, query, dim]`` when the geometry already holds it (computed from
        these very tensors), else None."""
        if self._geometry is None or not self._mixed_is_output or probs is not self._probs or value is not self.value:
            return None
        return self._geometry.mixed


#: Reads a layer (records it, collects statistics); must not change ``call.probs``.
Observer = Callable[[LayerCall], None]
#: Changes a layer: returns the new probabilities ``[batch, head, query, key]`` (None = unchanged).
Transform = Callable[[LayerCall], "torch.Tensor | None"]
