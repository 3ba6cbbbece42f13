"""Causal interventions: remove projected value terms alpha^h_ij v~^h_j inside the model.

Removing a term zeroes the post-softmax probability alpha^h_ij without renormalising the row, so the
head output loses exactly alpha^h_ij v~^h_j and nothing else changes (the paper's section 'Faithfulness by causal intervention').
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .architectures import attention_blocks
from .attention import AttentionSession, LayerCall, Observer, Transform, cwcore_attention, default_compute_dtype
from .decomposition import LayerDecomposition
from .inputs import InputError, check_attention_mask, check_compute_dtype, check_layers, check_mask
from .thread_state import outside

__all__ = ["LayerMask", "intervene", "removal"]

# A mask for one layer: a boolean tensor broadcastable to [batch, head, query, key] (True = remove),
# or a callable that builds one from the layer's live decomposition (see cwcore.decompose).
LayerMask = torch.Tensor | Callable[[LayerDecomposition], torch.Tensor]


def removal(mask: LayerMask) -> Transform:
    """The transform that removes the terms ``mask`` selects (zeroes those probabilities, no renormalisation)."""

    def remove(call: LayerCall) -> torch.Tensor:
        chosen = mask(LayerDecomposition.from_call(call)) if callable(mask) else mask
        probs = call.probs
        chosen = check_mask(chosen, probs.shape, call.layer).to(probs.device)
        # zeroing leaves every other probability bit-for-bit unchanged (an empty mask changes nothing);
        # in place where nothing else holds the softmax output (a live decomposition may), saving a copy
        in_place = not (call.geometry_computed or probs.requires_grad)
        return probs.masked_fill_(chosen, 0.0) if in_place else probs.masked_fill(chosen, 0.0)

    return remove


def _merged(first: Mapping[int, list], second: Mapping | None) -> dict[int, list]:
    """``{layer: first[layer] + second[layer]}``; ``second``'s values may be one function or a list."""
    merged = {layer: list(functions) for layer, functions in first.items()}
    for layer, functions in dict(second or {}).items():
        merged.setdefault(layer, []).extend([functions] if callable(functions) else functions)
    return merged


@contextlib.contextmanager
def intervene(
    model: nn.Module,
    masks: Mapping[int, LayerMask],
    record: Iterable[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype | None = None,
    *,
    observers: Mapping[int, Sequence[Observer]] | None = None,
    transforms: Mapping[int, Sequence[Transform]] | None = None,
) -> Iterator[AttentionSession]:
    """Inside the block, every forward of ``model`` has the selected terms removed.

    ``masks`` maps a layer number to a boolean tensor broadcastable to ``[batch, head, query, key]``
    (True removes alpha^h_ij v~^h_j from o_i), or to a callable that receives that layer's live
    :class:`~cwcore.core.decomposition.LayerDecomposition` (computed inside the intervened run, before the removal) and
    returns such a mask. ``record`` lists layers whose decomposition *after* the removal is kept in
    ``session.recorded``. Their padding is read from each attention call's own mask (built from the
    ``attention_mask`` the model is called with); ``attention_mask`` (``[batch, key]``) given here is checked
    against the inputs of every forward; pass ``cwcore.core.decomposition.prepare_inputs(model, inputs)`` to the model when batches
    are left-padded.
    ``transforms`` run after the removal and ``observers`` (see :mod:`cwcore.core.attention`) see each
    layer last, e.g. to read the clean run's decomposition without removing anything (``masks={}``).
    ``compute_dtype`` (float32 or float64; default the model's own for a float64 model, else float32) is
    the dtype of the recorded decompositions. A model in ``train()`` mode is refused (dropout).

    An empty mask changes nothing, to the last bit, relative to the model's eager attention::

        with cwcore.intervene(model, {3: mask}):
            logits = model(**inputs).logits
    """
    num_layers = len(attention_blocks(model))
    compute_dtype = default_compute_dtype(model) if compute_dtype is None else check_compute_dtype(compute_dtype)
    if not isinstance(masks, Mapping):
        raise TypeError(f"masks must map layer numbers to masks, got {type(masks).__name__}")
    check_layers(list(masks), num_layers, argument="masks")
    if any(isinstance(layer, int) and layer < 0 for layer in masks):  # -1 is the last layer, as in check_layers
        if len({layer % num_layers for layer in masks}) < len(masks):
            raise InputError("masks names one layer twice (a negative number and its positive twin)")
        masks = {layer % num_layers: mask for layer, mask in masks.items()}
    for layer, mask in masks.items():  # wrong dtypes fail here; shapes are checked against each layer's call
        if not callable(mask):
            check_mask(mask, torch.as_tensor(mask).shape, layer)
    recorded: dict[int, LayerDecomposition] = {}

    def keep(call: LayerCall) -> None:
        recorded[call.layer] = LayerDecomposition.from_call(call)

    kept = {} if record is None else {layer: [keep] for layer in check_layers(record, num_layers, argument="record")}
    all_transforms = _merged({layer: [removal(mask)] for layer, mask in masks.items()}, transforms)
    all_observers = _merged(kept, observers)
    if attention_mask is not None:
        attention_mask = check_attention_mask(attention_mask, None, caller="intervene")
    key_valid = None if attention_mask is None else attention_mask.bool()
    session = AttentionSession(model, observers=all_observers, transforms=all_transforms, compute_dtype=compute_dtype)
    session.recorded = recorded  # the decompositions of the ``record`` layers, filled by each forward
    handle = None if key_valid is None else model.register_forward_pre_hook(_mask_fits(key_valid), with_kwargs=True)
    try:
        with cwcore_attention(model, session):
            yield session
    finally:
        if handle is not None:
            handle.remove()


def _mask_fits(key_valid: torch.Tensor):
    """A forward pre-hook refusing a forward whose tokens ``[batch, sequence]`` differ from intervene's
    ``attention_mask`` (a mask that describes other tokens would be ignored, silently)."""

    def check(module, args, kwargs):
        if outside():
            return None  # a probe pass (e.g. finding the post-attention norms) is not the intervened forward
        if kwargs.get("past_key_values") is not None:
            return None  # the keys include the cache: the mask's length is the cache's plus the new tokens'
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 and tuple(tokens.shape[:2]) != tuple(key_valid.shape):
            raise InputError(f"intervene: attention_mask has shape {tuple(key_valid.shape)} but the model was called "
                             f"on inputs {tuple(tokens.shape[:2])} [batch, sequence]; they must match")
        return None

    return check
