"""The boundary of the core: model inputs, layer lists and dtypes are checked here, once, with one-line errors.

Every public entry point (:func:`cwcore.decompose`, :func:`cwcore.intervene`, the experiments and the
command line) passes what the user gave through these functions, so a misspelled keyword, float ids or
a mask of the wrong shape fails at once with a sentence that names the argument and says what to do,
instead of 20 frames deep or, worse, silently.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
from typing import Iterable, Mapping

import torch
from torch import nn

__all__ = [
    "InputError", "InputIndexError", "InputTypeError", "cached_length", "check_attention_mask", "check_batch_size",
    "check_compute_dtype", "check_count", "check_finite_scores", "check_fraction", "check_inputs", "check_layers",
    "query_positions", "query_positions_as_given",
    "check_mask", "check_not_empty", "check_ratios", "check_sequence_ids", "check_sweep_arguments", "check_targets",
    "check_texts", "check_token_sequences", "context_length", "did_you_mean", "finite_scores", "is_integer_number",
    "plain_integer", "refuse_unknown_inputs",
]


class InputError(ValueError):
    """An input a public entry point refuses; the message is one sentence naming the argument, what it
    got and what it accepts. A ``ValueError`` (the subclasses are also ``TypeError``/``IndexError``), so
    code that caught the built-in errors before keeps working."""


class InputTypeError(InputError, TypeError):
    """An input of the wrong type (float token ids, a string where a number belongs)."""


class InputIndexError(InputError, IndexError):
    """A layer, head or token id outside what the model has."""


def _shown(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

# keywords transformers' models accept through **kwargs (TransformersKwargs) or under older names
_GENERAL_KEYWORDS = {
    "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "use_cache", "cache",
    "past_key_values", "position_ids", "labels", "logits_to_keep", "num_items_in_batch", "cu_seq_lens_q",
    "cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal", "seq_idx", "head_mask", "token_type_ids",
}
#: of those, the flash-attention kernel's packing keywords: accepted, never suggested for a misspelt name
_KERNEL_KEYWORDS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
#: what a tokenizer returns besides the model's inputs (``return_offsets_mapping=True``, ...): the model's
#: **kwargs swallow them; cwcore names them rather than say "unexpected keyword"
_TOKENIZER_OUTPUTS = {"offset_mapping", "special_tokens_mask", "length", "overflowing_tokens",
                      "num_truncated_tokens", "overflow_to_sample_mapping"}
_COMPUTE_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _accepted_keywords(model: nn.Module) -> set[str] | None:
    """The keywords ``model.forward`` accepts; None where it names none and passes ``**kwargs`` on (a wrapper such
    as PeftModel or DataParallel): then the wrapped model's own error speaks for a wrong keyword."""
    parameters = inspect.signature(model.forward).parameters
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    if not named and any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return None
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
            rows = value if isinstance(value, (list, tuple)) else ()
            lengths = sorted({len(row) for row in rows if isinstance(row, (list, tuple))})
            if len(lengths) > 1:  # a tokenizer's output for several texts without padding
                raise InputError(f"{caller}: {name} holds sequences of unequal lengths ({lengths[0]} to {lengths[-1]} "
                                 "tokens); pad them: tokenizer(texts, padding=True, return_tensors='pt')") from None
            raise InputTypeError(f"{caller}: {name} must be a tensor of token ids, got {type(value).__name__}") from None
    if value.ndim == 1:
        value = value[None]  # one sequence: a batch of one
    if value.ndim != 2:
        raise InputError(f"{caller}: {name} must be [batch, sequence] (or one sequence), got shape {tuple(value.shape)}")
    return value


def passed_cache(inputs: Mapping):
    """The key/value cache a forward call passes: ``cache`` (transformers 5's name) or ``past_key_values`` (its
    older one, still accepted), None without one."""
    cache = inputs.get("cache")
    return inputs.get("past_key_values") if cache is None else cache


def cached_length(inputs: dict) -> int:
    """Tokens already in the key/value cache the call passes (:func:`passed_cache`), 0 without one."""
    cache = passed_cache(inputs)
    length = getattr(cache, "get_seq_length", None)
    return int(length()) if callable(length) else 0


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module a ``torch.compile``'d model wraps (``_orig_mod``; its weights are the same tensors), so
    that its blocks are found and its forward's keywords read; any other model as it is. The
    decomposition then runs the module's own eager forward."""
    original = getattr(model, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else model


def check_materialised(model: nn.Module, caller: str = "decompose") -> None:
    """Refuse a model whose weights are on the ``meta`` device without an offloading hook (made under
    ``torch.device("meta")`` or ``init_empty_weights``: no values to run); accelerate's offloaded models
    (``device_map`` with disk or CPU offload) keep a hook that loads each weight when its module runs."""
    meta = next((name for name, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is None:
        return
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return
    raise InputError(f"{caller}: the model's weights are on the meta device (e.g. {meta}): it was made without "
                     "weights (torch.device('meta'), init_empty_weights); load them first, e.g. with "
                     "cwcore.load_model or from_pretrained")


def own_options(function) -> tuple[str, ...]:
    """The keyword options of one of cwcore's calls (its named parameters but the model and the inputs mapping),
    which an unknown keyword may be a misspelling of as well as a model input."""
    return tuple(name for name, parameter in inspect.signature(function).parameters.items()
                 if name not in ("model", "inputs")
                 and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL))


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the candidate closest to a misspelt keyword ``name``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def refuse_unknown_inputs(model: nn.Module, names: Iterable[str], caller: str, options: Iterable[str] = ()) -> None:
    """Refuse, in one sentence, keywords ``names`` the model's forward does not take: a tokenizer output that is no
    model input (``token_type_ids`` for a decoder), or a misspelling, named with the closest accepted keyword or the
    closest of the caller's own ``options`` (``rows`` for ``row``)."""
    accepted = _accepted_keywords(model)
    unknown = [] if accepted is None else sorted(set(names) - accepted)
    extras = [name for name in unknown if name in _TOKENIZER_OUTPUTS]
    if extras:
        one = len(extras) == 1
        raise InputTypeError(f"{caller}(): {', '.join(map(repr, extras))} {'is' if one else 'are'} the tokenizer's own "
                             f"output{'' if one else 's'}, not {'a model input' if one else 'model inputs'}: leave "
                             f"{'it' if one else 'them'} out, e.g. {caller}(model, input_ids=enc['input_ids'], "
                             "attention_mask=enc['attention_mask'])")
    if unknown:
        hints = [f"{name!r}" + did_you_mean(name, (accepted - _KERNEL_KEYWORDS) | set(options)) for name in unknown]
        raise InputTypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(hints)}; "
                             f"{type(model).__name__} accepts {', '.join(sorted(accepted - _GENERAL_KEYWORDS))}")


def check_inputs(model: nn.Module, inputs: dict, *, caller: str = "decompose", truncate: bool = False,
                 options: Iterable[str] = ()) -> dict:
    """The model inputs, checked (and 1-D ``input_ids``/``attention_mask`` promoted to a batch of one).

    Raises ``TypeError`` for unknown keywords (naming the closest accepted one, or the closest of the caller's
    own ``options``, e.g. ``rows`` for ``row``) and non-integer ids,
    ``ValueError`` for ids outside the vocabulary, an empty batch, a mask whose shape differs from the
    ids', or an input longer than the model's context (``truncate=True`` keeps the first tokens instead).
    """
    if not isinstance(truncate, bool):  # "no" is truthy: it cut the input
        raise InputTypeError(f"{caller}: truncate must be True or False, not {truncate!r}")
    if not inputs:  # else the model's own error, many frames deep
        raise InputError(f"{caller}: no inputs: give the model's inputs as keywords, e.g. "
                         f"{caller}(model, **tokenizer(text, return_tensors='pt'))")
    refuse_unknown_inputs(model, inputs, caller, options)
    inputs = dict(inputs)
    ids = inputs.get("input_ids")
    if ids is not None and inputs.get("inputs_embeds") is not None:  # else the model's own error, many frames deep
        raise InputError(f"{caller}: give input_ids or inputs_embeds, not both")
    if ids is not None:
        ids = _as_2d("input_ids", ids, caller)
        if ids.numel() == 0:  # first: torch makes [] float32, and no ids is the reason, not their type
            raise InputError(f"{caller}: input_ids is empty (shape {tuple(ids.shape)}): give at least one token")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
            raise InputTypeError(f"{caller}: input_ids must be integer token ids, got {ids.dtype}; "
                            "use tokenizer(..., return_tensors='pt') or ids.long()")
        vocabulary = _vocabulary_size(model)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocabulary is not None and high >= vocabulary):
            raise InputError(f"{caller}: input_ids must lie in [0, {vocabulary}) for this model's vocabulary, "
                             f"got values from {low} to {high}")
        inputs["input_ids"] = ids if ids.dtype == torch.long else ids.long()  # int16/uint8 ids: the embedding takes long
    mask = inputs.get("attention_mask")
    reference = ids if ids is not None else inputs.get("inputs_embeds")
    if mask is not None and reference is not None:
        cached = cached_length(inputs)
        if cached:
            mask = _as_2d("attention_mask", mask, caller)
            with_cache = (reference.shape[0], cached + reference.shape[1])
            if tuple(mask.shape) != with_cache:
                raise InputError(f"{caller}: attention_mask has shape {tuple(mask.shape)} but with {cached} cached "
                                 f"tokens and inputs of {tuple(reference.shape[:2])} it must be {with_cache} [batch, "
                                 "cached + sequence]")
            inputs["attention_mask"] = check_attention_mask(mask, with_cache, caller=caller)
        else:
            inputs["attention_mask"] = check_attention_mask(mask, reference.shape[:2], caller=caller)
    limit = context_length(model)
    cached = cached_length(inputs) if reference is not None else 0
    if reference is not None and limit is not None and cached and cached + reference.shape[1] > limit:
        # the cached tokens take positions too (60 cached + 10 new failed inside the embedding, 19 frames deep)
        raise InputError(f"{caller}: {cached} cached and {reference.shape[1]} new tokens make "
                         f"{cached + reference.shape[1]}, but {type(model).__name__} was built for at most {limit}")
    if reference is not None and limit is not None and reference.shape[1] > limit:
        if not truncate:
            raise InputError(f"{caller}: the input has {reference.shape[1]} tokens but {type(model).__name__} was built "
                             f"for at most {limit}; shorten it (tokenizer(..., truncation=True, max_length={limit})) "
                             "or pass truncate=True to keep the first tokens")
        length = reference.shape[1]
        for name in ("input_ids", "attention_mask", "inputs_embeds", "token_type_ids", "position_ids", "labels"):
            value = inputs.get(name)
            # labels as long as the input (a causal or masked LM's) are cut with it; a decoder's labels are not
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length:
                inputs[name] = value[:, :limit]
    return inputs


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_seed(value) -> bool:
    """A random seed: a non-negative int (or numpy integer), not a bool. The one rule; each caller says in its
    own sentence what the seed draws."""
    return _is_integer(value) and value >= 0


def is_integer_number(value) -> bool:
    """An int, a numpy integer (what a DataFrame's integer column yields) or a 0-d integer tensor; not a bool."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return _is_integer(value)


def plain_integer(value):
    """``value`` as an ``int`` if it is an integer number of any kind (:func:`is_integer_number`), else unchanged
    (to be refused by the caller)."""
    return int(value) if is_integer_number(value) else value


def check_layers(layers, num_layers: int, *, argument: str = "layers", allow_empty: bool = True) -> list[int]:
    """``layers`` (a layer number, an iterable of them, or None for all) as a sorted list of valid layers.

    ``allow_empty=False`` (the experiments: an empty list would measure nothing) refuses ``[]``."""
    if layers is None:
        return list(range(num_layers))
    if isinstance(layers, bool) or isinstance(layers, (str, bytes, float)) or not (
            _is_integer(layers) or isinstance(layers, torch.Tensor) or hasattr(layers, "__iter__")):
        raise InputTypeError(f"{argument} must be a layer number, a list of layer numbers or None, got {_shown(layers)}")
    if _is_integer(layers) or (isinstance(layers, torch.Tensor) and layers.ndim == 0):
        layers = [layers]
    chosen = []
    for layer in layers:
        if isinstance(layer, torch.Tensor) and layer.ndim == 0 and not layer.is_floating_point():
            layer = int(layer)
        if not _is_integer(layer):
            raise InputTypeError(f"{argument} must hold layer numbers (int), got {_shown(layer)}")
        if not -num_layers <= layer < num_layers:
            raise InputIndexError(f"{argument}: layer {layer} out of range, the model has {num_layers} attention "
                                  f"layers (0..{num_layers - 1})")
        chosen.append(int(layer) % num_layers)
    if not chosen and not allow_empty:
        raise InputError(f"{argument} is empty: give at least one layer number (0..{num_layers - 1}), or None for all")
    return sorted(set(chosen))


def check_compute_dtype(compute_dtype) -> torch.dtype:
    """``torch.float32``/``torch.float64`` or their names; anything else is refused."""
    if isinstance(compute_dtype, str):
        name = compute_dtype.removeprefix("torch.")
        if name in _COMPUTE_DTYPES:
            return _COMPUTE_DTYPES[name]
    elif compute_dtype in _COMPUTE_DTYPES.values():
        return compute_dtype
    raise InputError(f"compute_dtype must be torch.float32 or torch.float64 (or 'float32', 'float64'), "
                     f"got {compute_dtype!r}")


def check_mask(mask, shape: Iterable[int], layer: int) -> torch.Tensor:
    """An intervention mask for ``layer``: boolean (or 0/1 integers), broadcastable to ``shape`` = its
    ``[batch, head, query, key]``. A 3-D mask must lead with 1: ``[n, query, key]`` could mean a batch or the
    heads (broadcasting reads heads, so a batch as large as the head count would be taken silently)."""
    shape = tuple(shape)
    mask = torch.as_tensor(mask)
    if mask.dim() == 3 and mask.shape[0] != 1:
        raise InputError(f"masks[{layer}] has shape {tuple(mask.shape)}: a 3-D mask is ambiguous ([batch, query, key] "
                         "or [head, query, key]); give it 4-D, mask[:, None] for one per sequence or mask[None] for "
                         "one per head")
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.is_complex():
            raise InputTypeError(f"masks[{layer}] must be boolean (True = remove) or 0/1 integers, got {mask.dtype}")
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise InputError(f"masks[{layer}] holds integers other than 0 and 1")
        mask = mask.bool()
    try:
        broadcast = torch.broadcast_shapes(tuple(mask.shape), shape)
    except RuntimeError:
        broadcast = None
    if broadcast != shape:
        raise InputError(f"masks[{layer}] has shape {tuple(mask.shape)}, which does not broadcast to layer {layer}'s "
                         f"[batch, head, query, key] = {list(shape)}")
    return mask


# --------------------------------------------------------------------------------------------------
# The experiments' arguments: counts, fractions, ratios, token sequences, masks, targets, scores.
# Each entry point (faithfulness, the per-layer sweep, downstream tasks, intervene, logit attribution,
# the sink analyses, the command lines) calls these, so one input is refused everywhere with one sentence.
# --------------------------------------------------------------------------------------------------
def check_count(value, argument: str, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """An experiment's count option (``batch_size``, ``num_sequences``, ``n_bootstrap``, ...) as an int
    >= ``minimum`` (``None`` passes when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if not _is_integer(value):
        raise InputTypeError(f"{argument} must be an integer of at least {minimum}, got {_shown(value)}")
    if value < minimum:
        raise InputError(f"{argument} must be at least {minimum}, got {value}")
    return int(value)


def check_sequence_ids(sequence_ids, n: int, what: str = "text") -> list[int]:
    """``sequence_ids`` (None: ``0 .. n-1``) as ``n`` distinct non-negative ints, one per ``what``: the numbers
    that seed a sequence's random control, whatever its row in a batch."""
    if sequence_ids is None:
        return list(range(n))
    if isinstance(sequence_ids, (str, bytes)) or not hasattr(sequence_ids, "__iter__"):
        raise InputTypeError(f"sequence_ids must be a sequence of ints, one per {what}, not "
                             f"{type(sequence_ids).__name__}")
    ids = list(sequence_ids.tolist() if hasattr(sequence_ids, "tolist") else sequence_ids)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise InputError(f"sequence_ids must be non-negative ints, got {ids[:8]}{' ...' if len(ids) > 8 else ''}")
    if len(ids) != n:
        raise InputError(f"sequence_ids has {len(ids)} ids for {n} sequences: give one id per {what}")
    if len(set(ids)) != n:
        raise InputError(f"sequence_ids must be distinct: each identifies one {what}")
    return ids


def check_batch_size(batch_size) -> int:
    """``batch_size`` as an int >= 1 (a float, a string or 0 are refused with one sentence)."""
    return check_count(batch_size, "batch_size")


def check_fraction(value, argument: str, *, low: float = 0.0, high: float = 1.0, open_low: bool = False,
                   open_high: bool = False) -> float:
    """A finite number in ``[low, high]`` (ends excluded with ``open_low``/``open_high``): thresholds
    such as the sinks' ``eps``, confidence levels, ratios."""
    brackets = ("(" if open_low else "[") + f"{low:g}, {high:g}" + (")" if open_high else "]")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            value = float(value)
        else:
            raise InputTypeError(f"{argument} must be a number in {brackets}, got {_shown(value)}")
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low) or (
            open_high and value == high):
        raise InputError(f"{argument} must be a number in {brackets}, got {value!r}")
    return value


def check_ratios(values, default: Iterable[float] | None = None, *, argument: str = "ratios") -> list[float]:
    """``values`` (a number, a list of them, or None = ``default``) as a sorted, deduplicated, non-empty
    list of fractions in [0, 1]."""
    if values is None:
        if default is None:
            raise InputError(f"{argument} must be given: a fraction in [0, 1] or a list of them")
        values = default
    if isinstance(values, (numbers.Real, str, bytes)) or (isinstance(values, torch.Tensor) and values.ndim == 0):
        values = [values]
    try:
        items = list(values)
    except TypeError:
        raise InputTypeError(f"{argument} must be a fraction in [0, 1] or a list of them, got {_shown(values)}") from None
    if not items:
        raise InputError(f"{argument} is empty: give at least one fraction in [0, 1]")
    return sorted({check_fraction(r, argument) for r in items})


def _integer_ids(values, argument: str, caller: str) -> torch.Tensor:
    """A tensor of token ids from ``values`` (a tensor, an array or a list), refusing non-integers."""
    try:
        ids = values if isinstance(values, torch.Tensor) else torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputTypeError(f"{caller}: {argument} must hold integer token ids, got {type(values).__name__} "
                             f"{_shown(values, 40)}") from None
    if ids.numel() == 0 and not isinstance(values, torch.Tensor):  # torch makes [] float32: no ids, not floats
        ids = ids.long()
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise InputTypeError(f"{caller}: {argument} must hold integer token ids, got {ids.dtype}; "
                             "use tokenizer(..., return_tensors='pt') or ids.long()")
    return ids


def check_token_sequences(sequences, model: nn.Module | None = None, *, argument: str = "texts",
                          caller: str = "the experiment", min_length: int = 1) -> list[list[int]]:
    """Token id sequences (lists of unequal length or rows of a tensor) as lists of ints: at least one
    sequence, each of at least ``min_length`` tokens, integer ids inside ``model``'s vocabulary and no
    longer than its context."""
    if isinstance(sequences, torch.Tensor):
        ids = _integer_ids(sequences, argument, caller)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise InputError(f"{caller}: {argument} must be [sequence, token] ids, got shape {tuple(ids.shape)}")
        sequences = ids.tolist()
    out = []
    for row in sequences:
        ids = _integer_ids(row, argument, caller)
        if ids.ndim != 1:
            raise InputError(f"{caller}: each sequence of {argument} must be a list of token ids, got shape "
                             f"{tuple(ids.shape)}")
        out.append([int(i) for i in ids.tolist()])
    if not out:
        raise InputError(f"{caller}: {argument} holds no sequence; give at least one")
    shortest = min(range(len(out)), key=lambda n: len(out[n]))
    if len(out[shortest]) < min_length:
        raise InputError(f"{caller}: every sequence of {argument} needs at least {min_length} token"
                         f"{'s' if min_length > 1 else ''}; sequence {shortest} has {len(out[shortest])}"
                         + (" (an empty text?)" if not out[shortest] else ""))
    if model is not None:
        vocabulary = _vocabulary_size(model)
        low, high = min(min(s) for s in out if s), max(max(s) for s in out if s)
        if low < 0 or (vocabulary is not None and high >= vocabulary):
            raise InputError(f"{caller}: token ids of {argument} must lie in [0, {vocabulary}) for this model's "
                             f"vocabulary, got values from {low} to {high}")
        limit = context_length(model)
        longest = max(len(s) for s in out)
        if limit is not None and longest > limit:
            raise InputError(f"{caller}: a sequence of {argument} has {longest} tokens but {type(model).__name__} was "
                             f"built for at most {limit}; shorten it (max_length=..., block_size=...)")
    return out


def check_attention_mask(mask, shape: Iterable[int] | None, *, caller: str = "decompose",
                         argument: str = "attention_mask") -> torch.Tensor:
    """A padding mask ``[batch, key]`` of ``shape`` (None: any) holding 0 (padding) and 1 (token) only."""
    mask = _as_2d(argument, mask, caller)
    shape = tuple(mask.shape) if shape is None else tuple(int(n) for n in shape)
    if tuple(mask.shape) != shape:
        raise InputError(f"{caller}: {argument} has shape {tuple(mask.shape)} but the inputs are {shape} "
                         "[batch, sequence]; they must match")
    if mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise InputError(f"{caller}: {argument} must hold 0 (padding) and 1 (token) only")
    return mask


def check_targets(targets, shape: Iterable[int], vocabulary: int | None, *, caller: str = "logit_attribution",
                  argument: str = "targets") -> torch.Tensor:
    """Target token ids broadcast to ``shape`` = ``[batch, query]``: one id for every position, or
    ``[batch, query]`` ids, each in ``[0, vocabulary)`` (negative ids are refused, not counted from the end)."""
    shape = tuple(int(n) for n in shape)
    if isinstance(targets, bool) or (isinstance(targets, numbers.Real) and not _is_integer(targets)):
        raise InputTypeError(f"{caller}: {argument} must be integer token ids, got {_shown(targets)}")
    ids = _integer_ids(targets, argument, caller)
    if ids.ndim == 1 and len(shape) == 2 and shape[0] == 1 and ids.shape[0] == shape[1]:
        ids = ids[None]
    if ids.ndim != 0 and tuple(ids.shape) != shape:
        raise InputError(f"{caller}: {argument} has shape {tuple(ids.shape)}; give one id for every position or "
                         f"[batch, query] = {list(shape)} ids")
    if ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or (vocabulary is not None and high >= vocabulary):
            raise InputError(f"{caller}: {argument} must lie in [0, {vocabulary}) for this model's vocabulary, "
                             f"got values from {low} to {high}")
    return ids.expand(shape).clone() if ids.ndim == 0 else ids


def check_finite_scores(scores: torch.Tensor, name: str, layer: int, visible: torch.Tensor | None = None) -> torch.Tensor:
    """``scores`` of a user's metric at ``layer``, refused when NaN or infinite where a query sees its
    key (``visible``, broadcastable to the scores; default everywhere): a ranking of NaN is no ranking."""
    values = scores if visible is None else scores.masked_select(torch.broadcast_to(visible, scores.shape))
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        bad = int((~torch.isfinite(values)).sum())
        raise InputError(f"metric {name!r} returned {bad} NaN or infinite score(s) at layer {layer}; a metric must "
                         "return finite scores for every (head, query, key) a query can see")
    return scores


def finite_scores(fn):
    """``fn`` (a user's metric, ``fn(layer_decomposition=..., **context)``) whose tensor results go
    through :func:`check_finite_scores` at each layer; the signature is kept (``__wrapped__``)."""
    import functools

    name = getattr(fn, "__name__", type(fn).__name__)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        values = fn(*args, **kwargs)
        decomposition = kwargs.get("layer_decomposition")
        if isinstance(values, torch.Tensor) and decomposition is not None:
            attention = decomposition.attention  # [batch, head, query, key]; 0 where a key is hidden
            # padded query rows are NaN by the decomposition's convention: not a failure of the metric
            seen = attention.nan_to_num(0.0).ne(0)
            visible = seen.any(1) if values.dim() == 3 else seen
            if tuple(visible.shape) == tuple(values.shape):
                check_finite_scores(values, name, kwargs.get("layer", decomposition.layer), visible)
        return values

    return checked


def check_not_empty(value, argument: str, accepts: str):
    """``value`` unless it is an empty list, tuple, set or dict (an experiment over nothing)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)) and not value:
        raise InputError(f"{argument} is empty: give {accepts}")
    return value


def check_texts(texts, caller: str, argument: str = "texts"):
    """The data an experiment reads, refused when it holds nothing or has the wrong shape (the
    token ids themselves are checked by :func:`check_token_sequences` once tokenised)."""
    if texts is None:
        raise InputError(f"{caller}: {argument} is None; give strings, token ids or a data set")
    if isinstance(texts, torch.Tensor) and texts.ndim not in (1, 2):
        raise InputError(f"{caller}: {argument} as a tensor must be [sequence, token] ids, got shape {tuple(texts.shape)}")
    if isinstance(texts, (list, tuple)) and not texts:
        raise InputError(f"{caller}: {argument} holds no sequence; give at least one")
    if hasattr(texts, "__len__") and hasattr(texts, "column_names") and len(texts) == 0:
        raise InputError(f"{caller}: {argument} holds no sequence; give at least one")
    columns = texts if isinstance(texts, dict) else texts if hasattr(texts, "column_names") else None
    names = getattr(texts, "column_names", None) or (list(texts) if isinstance(texts, dict) else [])
    if columns is not None and "input_ids" in names:  # ids and masks before padding is trimmed (no int() cut)
        rows = columns["input_ids"]
        rows = [rows] if isinstance(rows, torch.Tensor) and rows.ndim == 1 else rows
        masks = columns["attention_mask"] if "attention_mask" in names else None
        masks = [masks] if isinstance(masks, torch.Tensor) and masks.ndim == 1 else masks
        if len(rows) == 0:
            raise InputError(f"{caller}: {argument} holds no sequence; give at least one")
        for i, row in enumerate(rows):
            ids = _integer_ids(row, f"{argument}['input_ids']", caller)
            if masks is not None:
                check_attention_mask(masks[i], (1, ids.shape[-1]), caller=caller,
                                     argument=f"{argument}['attention_mask'] of sequence {i}")
    return texts


def check_sweep_arguments(model: nn.Module, *, caller: str, metric=None, ratios=None, mode=None, layers=None,
                          batch_size=1, n_bootstrap=1, confidence=0.95, padding_side="right") -> None:
    """The arguments every faithfulness sweep shares (:func:`cwcore.faithfulness.faithfulness_curve`,
    ``downstream_eval``, ``per_layer_curve``), checked before any work: non-empty metrics, modes and
    ratios (fractions in [0, 1]), layers the model has (not an empty list), counts and the confidence."""
    from .architectures import attention_blocks

    check_not_empty(metric, "metric", "at least one metric (a name, a callable or precomputed scores), or None "
                                      "for the defaults")
    check_not_empty(mode, "mode", "'comprehensiveness', 'sufficiency', a list of them, or None for both")
    if isinstance(mode, (list, tuple)) or isinstance(mode, str):
        for m in [mode] if isinstance(mode, str) else mode:
            if m not in ("comprehensiveness", "sufficiency"):
                raise InputError(f"mode must be 'comprehensiveness' or 'sufficiency', got {_shown(m)}")
    if ratios is not None:
        check_ratios(ratios)
    if layers is not None:
        check_layers(layers, len(attention_blocks(model)), allow_empty=False)
    check_batch_size(batch_size)
    check_count(n_bootstrap, "n_bootstrap")
    check_fraction(confidence, "confidence", open_low=True, open_high=True)
    if padding_side not in ("left", "right"):
        raise InputError(f"padding_side must be 'left' or 'right', got {_shown(padding_side)}")


def query_positions_as_given(positions, argument: str) -> tuple[int, ...]:
    """``positions`` (one or a list, None: none) as a tuple of ints as given, negative ones counting from the end."""
    if positions is None:
        return ()
    if is_integer_number(positions):
        positions = [positions]
    elif isinstance(positions, (str, bytes)) or not isinstance(positions, Iterable):
        raise InputTypeError(f"{argument} must be a query position or a list of them (ints), got {positions!r}")
    out = []
    for position in positions:
        position = plain_integer(position)  # a numpy or 0-d tensor integer reads as its int
        if isinstance(position, bool) or not isinstance(position, int):
            raise InputTypeError(f"{argument} must be query positions (ints), got {position!r}")
        out.append(position)
    return tuple(out)


def query_positions(positions, length: int, argument: str, what: str = "the input has {length} tokens") -> tuple[int, ...]:
    """``positions`` (as :func:`query_positions_as_given` reads them) among ``length`` queries, each once, from the end if negative."""
    out = []
    for position in query_positions_as_given(positions, argument):
        if not -length <= position < length:
            raise InputError(f"{argument} must be query positions in -{length}..{length - 1} "
                             f"({what.format(length=length)}), got {position!r}")
        wanted = position + length if position < 0 else position
        if wanted not in out:
            out.append(wanted)
    return tuple(out)
