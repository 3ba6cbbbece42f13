"""Causal interventions: remove projected value terms alpha^h_ij v~^h_j inside the model.

Removing a term zeroes the post-softmax probability alpha^h_ij without renormalising the row, so the
head output loses exactly alpha^h_ij v~^h_j and nothing else changes (the paper's section 'Faithfulness by causal intervention').

Zeroing moves the model off the distribution it was trained on (a head output shrinks by the removed
mass). The in-distribution alternative replaces each removed term by a stand-in: the head's mean value
mu_h (:func:`mean_values`, estimated on other texts) under the same weight, so head h's output before
W_O becomes ``sum_j alpha_ij v_j - sum_{j removed} alpha_ij v_j + (sum_{j removed} alpha_ij) mu_h``
(``removal(mask, stand_in=mu)``, ``intervene(..., stand_in={layer: mu})``). W_O is linear, so this is
exactly alpha_ij v~_j replaced by alpha_ij mu_h W_O^h.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .architectures import attention_blocks
from .attention import AttentionSession, LayerCall, Observer, Transform, cwcore_attention, default_compute_dtype
from .decomposition import LayerDecomposition
from .inputs import (InputError, InputTypeError, check_attention_mask, check_compute_dtype, check_layers, check_mask,
                     passed_cache)
from .thread_state import outside

__all__ = ["LayerMask", "intervene", "mean_values", "removal", "value_sums"]

# A mask for one layer: a boolean tensor broadcastable to [batch, head, query, key] (True = remove),
# or a callable that builds one from the layer's live decomposition (see cwcore.decompose).
LayerMask = torch.Tensor | Callable[[LayerDecomposition], torch.Tensor]


def removal(mask: LayerMask, stand_in: torch.Tensor | None = None) -> Transform:
    """The transform that removes the terms ``mask`` selects (zeroes those probabilities, no renormalisation).

    ``stand_in`` (None: plain zeroing) ``[head, dim]`` or ``[batch, head, dim]``, the value vectors v of the
    layer's heads (before W_O; after grouped-query repetition, one row per query head) that replace the
    removed ones: the head output ``[batch, head, query, dim]`` then gains ``m_hi * stand_in[h]``, ``m_hi``
    the probability mass removed from row i of head h (:attr:`LayerCall.added_output`). A zero stand-in
    gives plain zeroing's outputs bit for bit.
    """

    def remove(call: LayerCall) -> torch.Tensor:
        chosen = mask(LayerDecomposition.from_call(call)) if callable(mask) else mask
        probs = call.probs
        chosen = check_mask(chosen, probs.shape, call.layer).to(probs.device)
        if stand_in is not None:  # before the zeroing, which may be in place
            values = _check_stand_in(stand_in, call)
            removed_mass = torch.where(chosen, probs, 0.0).sum(-1)  # [batch, head, query]
            added = removed_mass.to(values.dtype)[..., None] * values[:, :, None, :]
            call.added_output = added if call.added_output is None else call.added_output + added
        # zeroing leaves every other probability bit-for-bit unchanged (an empty mask changes nothing);
        # in place where nothing else holds the softmax output (a live decomposition may), saving a copy
        in_place = not (call.geometry_computed or probs.requires_grad)
        return probs.masked_fill_(chosen, 0.0) if in_place else probs.masked_fill(chosen, 0.0)

    return remove


def _check_stand_in(stand_in, call: LayerCall) -> torch.Tensor:
    """``stand_in`` as ``[batch or 1, head, dim]`` on the layer's device, or a one-line error naming its shape."""
    values = torch.as_tensor(stand_in)
    batch, heads, _, dim = call.value.shape
    if not values.is_floating_point() or values.dim() not in (2, 3) or tuple(values.shape[-2:]) != (heads, dim) or (
            values.dim() == 3 and values.shape[0] not in (1, batch)):
        raise InputError(f"stand_in for layer {call.layer} must be floating point [head, dim] = [{heads}, {dim}] or "
                         f"[batch, head, dim] = [{batch}, {heads}, {dim}], got {values.dtype} {tuple(values.shape)}")
    values = values if values.dim() == 3 else values[None]
    return values.to(call.value.device)


def value_sums(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
               layers: Iterable[int] | None = None, skip_first_token: bool = True) -> tuple[dict, torch.Tensor]:
    """``({layer: [batch, head, dim]}, counts [batch])``: each sequence's sum (float64) of the value vectors
    v_j = x_j W_V^h (per query head, after grouped-query repetition, before W_O) over its real tokens, and how
    many tokens each sum has; one forward of ``model`` on ``input_ids`` ``[batch, sequence]``.

    ``skip_first_token`` leaves each sequence's first real token out: it is the attention sink, whose values
    are atypical (the paper's section on the value geometry of attention sinks), and the faithfulness
    protocol's default never removes it, so the terms a stand-in replaces are those of the other tokens.
    ``layers``: default every decomposable layer.
    """
    from .architectures import decomposable_layers
    from .decomposition import prepare_inputs

    if not isinstance(skip_first_token, bool):  # "no" is truthy: the opposite stand-in
        raise InputTypeError(f"skip_first_token must be True or False, not {skip_first_token!r}")
    chosen = decomposable_layers(model) if layers is None else check_layers(layers, len(attention_blocks(model)))
    sums: dict[int, torch.Tensor] = {}
    valid = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()).cpu()
    if skip_first_token:
        first = valid.long().argmax(-1)  # the first real token of each row (left or right padding)
        valid = valid.clone()
        valid[torch.arange(valid.shape[0]), first] = False

    def add(call: LayerCall) -> None:
        kept = valid.to(call.value.device, torch.float64)  # [batch, key]
        sums[call.layer] = torch.einsum("bk,bhkd->bhd", kept, call.value.detach().double()).cpu()

    inputs = {"input_ids": input_ids} if attention_mask is None else {"input_ids": input_ids,
                                                                      "attention_mask": attention_mask}
    with torch.inference_mode(), intervene(model, {}, attention_mask=attention_mask,
                                           observers={layer: [add] for layer in chosen}):
        model(**prepare_inputs(model, inputs))
    return sums, valid.sum(-1)


def mean_values(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                layers: Iterable[int] | None = None, skip_first_token: bool = True) -> dict[int, torch.Tensor]:
    """``{layer: [head, dim]}`` (float64): each head's mean value vector over every real token of the batch
    (the first of each sequence left out with ``skip_first_token``, see :func:`value_sums`), the stand-in of
    an in-distribution removal (:func:`removal`). Estimate it on other texts than the ones intervened on."""
    sums, counts = value_sums(model, input_ids, attention_mask, layers=layers, skip_first_token=skip_first_token)
    total = int(counts.sum())
    if total == 0:
        raise InputError("mean_values: the texts have no token to average (one token each, skipped as the first)")
    return {layer: summed.sum(0) / total for layer, summed in sums.items()}


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
    stand_in: Mapping[int, torch.Tensor] | None = None,
) -> Iterator[AttentionSession]:
    """Inside the block, every forward of ``model`` has the selected terms removed.

    ``masks`` maps a layer number to a boolean tensor broadcastable to ``[batch, head, query, key]``
    (True removes alpha^h_ij v~^h_j from o_i), or to a callable that receives that layer's live
    :class:`~cwcore.core.decomposition.LayerDecomposition` (computed inside the intervened run, before the removal) and
    returns such a mask. ``record`` lists layers whose decomposition *after* the removal is kept in
    ``session.recorded``. Their padding is read from each attention call's own mask (built from the
    ``attention_mask`` the model is called with); ``attention_mask`` (``[batch, key]``) given here is checked
    against the inputs and the mask of every forward (the same mask must reach the model); pass
    ``cwcore.core.decomposition.prepare_inputs(model, inputs)`` to the model when batches are left-padded.
    ``transforms`` run after the removal and ``observers`` (see :mod:`cwcore.core.attention`) see each
    layer last, e.g. to read the clean run's decomposition without removing anything (``masks={}``).
    ``compute_dtype`` (float32 or float64; default the model's own for a float64 model, else float32) is
    the dtype of the recorded decompositions. A model in ``train()`` mode is refused (dropout).
    ``stand_in`` (None: zeroing) maps each layer of ``masks`` to the value vectors ``[head, dim]`` or
    ``[batch, head, dim]`` that replace its removed terms (an in-distribution removal: see :func:`removal` and
    :func:`mean_values`); a layer with stand-ins cannot be recorded (its terms no longer sum to its output).

    An empty mask changes nothing, to the last bit, relative to the model's eager attention and to a
    half-precision model's SDPA forward (a float32 SDPA forward: to float32 rounding, about 1e-7)::

        with cwcore.intervene(model, {3: mask}):
            logits = model(**inputs).logits
    """
    num_layers = len(attention_blocks(model))
    compute_dtype = default_compute_dtype(model) if compute_dtype is None else check_compute_dtype(compute_dtype)
    if not isinstance(masks, Mapping):
        raise TypeError(f"masks must map layer numbers to masks, got {type(masks).__name__}")
    check_layers(list(masks), num_layers, argument="masks")
    # plain ints, -1 the last layer, as check_layers reads them (a numpy or 0-d tensor key reached the session
    # as itself: "out of range", or the block "does not call the attention interface")
    if len({int(layer) % num_layers for layer in masks}) < len(masks):
        raise InputError("masks names one layer twice (a negative number and its positive twin)")
    masks = {int(layer) % num_layers: mask for layer, mask in masks.items()}
    for layer, mask in masks.items():  # wrong dtypes fail here; shapes are checked against each layer's call
        if not callable(mask):
            check_mask(mask, torch.as_tensor(mask).shape, layer)
    if stand_in is not None:
        if not isinstance(stand_in, Mapping):
            raise InputTypeError(f"stand_in must map layer numbers to value vectors, got {type(stand_in).__name__}")
        check_layers(list(stand_in), num_layers, argument="stand_in")
        stand_in = {int(layer) % num_layers: values for layer, values in stand_in.items()}
        if set(stand_in) != set(masks):
            raise InputError(f"stand_in names layers {sorted(stand_in)} but masks names {sorted(masks)}: give one "
                             "stand-in per masked layer")
    recorded: dict[int, LayerDecomposition] = {}

    def keep(call: LayerCall) -> None:
        recorded[call.layer] = LayerDecomposition.from_call(call)

    kept = {} if record is None else {layer: [keep] for layer in check_layers(record, num_layers, argument="record")}
    stand_in = stand_in or {}
    all_transforms = _merged({layer: [removal(mask, stand_in.get(layer))] for layer, mask in masks.items()},
                             transforms)
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
    ``attention_mask``, or whose own mask is missing or another (a mask that describes other tokens, or none
    the forward reads, would be ignored, silently)."""

    def check(module, args, kwargs):
        if outside(module):
            return None  # a probe pass (e.g. finding the post-attention norms) is not the intervened forward
        if passed_cache(kwargs) is not None:
            return None  # the keys include the cache: the mask's length is the cache's plus the new tokens'
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2 and tuple(tokens.shape[:2]) != tuple(key_valid.shape):
            raise InputError(f"intervene: attention_mask has shape {tuple(key_valid.shape)} but the model was called "
                             f"on inputs {tuple(tokens.shape[:2])} [batch, sequence]; they must match")
        # padding is read from each call's own mask: a mask given here and not to the forward would be ignored
        called = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        if called is None and not bool(key_valid.all()):  # an all-ones mask says no more than no mask
            raise InputError("intervene: attention_mask was given here but the model was called without one, so it "
                             "would be ignored (padding is read from each forward's own mask): pass it to the model")
        if (isinstance(called, torch.Tensor) and called.dim() == 2
                and not torch.equal(called.bool(), key_valid.to(called.device))):
            raise InputError("intervene: the model was called with another attention_mask than the one given here; "
                             "they must be the same")
        return None

    return check
