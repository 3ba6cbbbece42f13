"""Causal interventions: remove projected value terms alpha^h_ij v~^h_j inside the model.

Removing a term zeroes the post-softmax probability alpha^h_ij without renormalising the row, so the
head output loses exactly alpha^h_ij v~^h_j and nothing else changes (PAPER.md section 5).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from .attention import AttentionSession, LayerMask, cwcore_attention

__all__ = ["intervene"]


@contextlib.contextmanager
def intervene(
    model: nn.Module,
    masks: Mapping[int, LayerMask],
    record: Iterable[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Iterator[AttentionSession]:
    """Inside the block, every forward of ``model`` has the selected terms removed.

    ``masks`` maps a layer number to a boolean tensor broadcastable to ``[batch, head, query, key]``
    (True removes alpha^h_ij v~^h_j from o_i), or to a callable that receives that layer's live
    :class:`~cwcore.LayerDecomposition` (computed inside the intervened run, before the removal) and
    returns such a mask. ``record`` lists layers whose decomposition *after* the removal is kept in
    ``session.recorded``. ``attention_mask`` (``[batch, key]``) marks padding for those decompositions;
    pass ``cwcore.prepare_inputs(model, inputs)`` to the model when batches are left-padded.

    An empty mask changes nothing, to the last bit, relative to the model's eager attention::

        with cwcore.intervene(model, {3: mask}):
            logits = model(**inputs).logits
    """
    key_valid = None if attention_mask is None else attention_mask.bool()
    session = AttentionSession(model, record=set(record or ()), masks=masks, key_valid=key_valid,
                               compute_dtype=compute_dtype)
    with cwcore_attention(model, session):
        yield session
