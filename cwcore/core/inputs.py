"""The boundary of the core: model inputs, layer lists and dtypes are checked here, once, with one-line errors.

Every public entry point (:func:`cwcore.decompose`, :func:`cwcore.intervene`, the experiments and the
command line) passes what the user gave through these functions, so a misspelled keyword, float ids or
a mask of the wrong shape fails at once with a sentence that names the argument and says what to do,
instead of 20 frames deep or, worse, silently.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Iterable

import torch
from torch import nn

__all__ = ["check_inputs", "check_layers", "check_compute_dtype", "check_mask", "context_length"]

# keywords transformers' models accept through **kwargs (TransformersKwargs) or under older names
_GENERAL_KEYWORDS = {
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "use_cache", "cache",
    "past_key_values", "position_ids", "labels", "logits_to_keep", "num_items_in_batch", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal", "seq_idx", "head_mask", "token_type_ids",
}
_COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _accepted_keywords(model: nn.Module) -> set[str]:
    parameters = inspect.signature(model.forward).parameters
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    return named | _GENERAL_KEYWORDS


from .architectures import text_config as _text_config  # noqa: E402  (the one home of model facts)


def context_length(model: nn.Module) -> int | None:
    """The longest input the model was built for (``max_position_embeddings``), or None if it has no limit."""
    value = getattr(_text_config(model), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _vocabulary_size(model: nn.Module) -> int | None:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return getattr(embeddings, "num_embeddings", None)


def _as_2d(name: str, value, caller: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"{caller}: {name} must be a tensor of token ids, got {type(value).__name__}") from None
    if value.ndim == 1:
        value = value[None]  # one sequence: a batch of one
    if value.ndim != 2:
        raise ValueError(f"{caller}: {name} must be [batch, sequence] (or one sequence), got shape {tuple(value.shape)}")
    return value


def _cached_length(inputs: dict) -> int:
    """Tokens already in a ``past_key_values`` (or ``cache``) the call passes, 0 without one."""
    cache = inputs.get("past_key_values", inputs.get("cache"))
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 0


def check_inputs(model: nn.Module, inputs: dict, *, caller: str = "decompose", truncate: bool = False) -> dict:
    """The model inputs, checked (and 1-D ``input_ids``/``attention_mask`` promoted to a batch of one).

    Raises ``TypeError`` for unknown keywords (naming the closest accepted one) and non-integer ids,
    ``ValueError`` for ids outside the vocabulary, an empty batch, a mask whose shape differs from the
    ids', or an input longer than the model's context (``truncate=True`` keeps the first tokens instead).
    """
    accepted = _accepted_keywords(model)
    unknown = sorted(set(inputs) - accepted)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(accepted), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(hints)}; "
                        f"{type(model).__name__} accepts {', '.join(sorted(accepted - _GENERAL_KEYWORDS))}")
    inputs = dict(inputs)
    ids = inputs.get("input_ids")
    if ids is not None:
        ids = _as_2d("input_ids", ids, caller)
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise TypeError(f"{caller}: input_ids must be integer token ids, got {ids.dtype}; "
                            "use tokenizer(..., return_tensors='pt') or ids.long()")
        if ids.numel() == 0:
            raise ValueError(f"{caller}: input_ids is empty (shape {tuple(ids.shape)}): give at least one token")
        vocabulary = _vocabulary_size(model)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocabulary is not None and high >= vocabulary):
            raise ValueError(f"{caller}: input_ids must lie in [0, {vocabulary}) for this model's vocabulary, "
                             f"got values from {low} to {high}")
        inputs["input_ids"] = ids
    mask = inputs.get("attention_mask")
    reference = ids if ids is not None else inputs.get("inputs_embeds")
    if mask is not None and reference is not None:
        mask = _as_2d("attention_mask", mask, caller)
        cached = _cached_length(inputs)
        with_cache = (reference.shape[0], cached + reference.shape[1])
        if cached and tuple(mask.shape) != with_cache:
            raise ValueError(f"{caller}: attention_mask has shape {tuple(mask.shape)} but with {cached} cached tokens "
                             f"and inputs of {tuple(reference.shape[:2])} it must be {with_cache} [batch, cached + "
                             "sequence]")
        if not cached and tuple(mask.shape) != tuple(reference.shape[:2]):
            raise ValueError(f"{caller}: attention_mask has shape {tuple(mask.shape)} but the inputs are "
                             f"{tuple(reference.shape[:2])} [batch, sequence]; they must match")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{caller}: attention_mask must hold 0 (padding) and 1 (token) only")
        inputs["attention_mask"] = mask
    limit = context_length(model)
    if reference is not None and limit is not None and reference.shape[1] > limit:
        if not truncate:
            raise ValueError(f"{caller}: the input has {reference.shape[1]} tokens but {type(model).__name__} was built "
                             f"for at most {limit}; shorten it (tokenizer(..., truncation=True, max_length={limit})) "
                             "or pass truncate=True to keep the first tokens")
        for name in ("input_ids", "attention_mask", "inputs_embeds", "token_type_ids", "position_ids"):
            if isinstance(inputs.get(name), torch.Tensor):
                inputs[name] = inputs[name][:, :limit]
    return inputs


def check_layers(layers, num_layers: int, *, argument: str = "layers") -> list[int]:
    """``layers`` (a layer number, an iterable of them, or None for all) as a sorted list of valid layers."""
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, bool) or isinstance(layers, (str, bytes, float)):
        raise TypeError(f"{argument} must be a layer number, a list of layer numbers or None, got {layers!r}")
    if isinstance(layers, int) or (isinstance(layers, torch.Tensor) and layers.ndim == 0):
        layers = [int(layers)]
    chosen = []
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"{argument} must hold layer numbers (int), got {layer!r}")
        if not -num_layers <= layer < num_layers:
            raise IndexError(f"{argument}: layer {layer} out of range, the model has {num_layers} attention layers")
        chosen.append(layer % num_layers)
    return sorted(set(chosen))


def check_compute_dtype(compute_dtype) -> torch.dtype:
    """``torch.float32``/``torch.float64`` or their names; anything else is refused."""
    if isinstance(compute_dtype, str):
        name = compute_dtype.removeprefix("torch.")
        if name in _COMPUTE_DTYPES:
            return _COMPUTE_DTYPES[name]
    elif compute_dtype in _COMPUTE_DTYPES.values():
        return compute_dtype
    raise ValueError(f"compute_dtype must be torch.float32 or torch.float64 (or 'float32', 'float64'), "
                     f"got {compute_dtype!r}")


def check_mask(mask, shape: Iterable[int], layer: int) -> torch.Tensor:
    """An intervention mask for ``layer``: boolean (or 0/1 integers), broadcastable to ``shape`` = its
    ``[batch, head, query, key]``."""
    shape = tuple(shape)
    mask = torch.as_tensor(mask)
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.is_complex():
            raise TypeError(f"masks[{layer}] must be boolean (True = remove) or 0/1 integers, got {mask.dtype}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"masks[{layer}] holds integers other than 0 and 1")
        mask = mask.bool()
    try:
        broadcast = torch.broadcast_shapes(tuple(mask.shape), shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise ValueError(f"masks[{layer}] has shape {tuple(mask.shape)}, which does not broadcast to layer {layer}'s "
                         f"[batch, head, query, key] = {list(shape)}")
    return mask
