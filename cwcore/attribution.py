"""``cwcore.attribute``: one entry point for every registered attribution method, picked by name as in inseq::

    a = cwcore.attribute(model, method="alti", **tokenizer("The cat sat on the mat", return_tensors="pt"))
    a[3]        # [batch, query, key]: ALTI of layer 3 (token-level)
    a.tensor    # [batch, layer, query, key], layers in the order of a.layers

:func:`list_attribution_methods` lists the names (the ladder, ``random``, ``grad_x_input``, ``alti``,
``value_zeroing``, ``rollout``, ``contribution_rollout`` and any registered by the user)."""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

__all__ = ["Attribution", "attribute", "list_attribution_methods"]

#: options a method may declare by naming them in its signature (besides the model inputs); ``sequence_ids`` for a
#: method that reads ``groups`` (the random control hashes each row's sequence number)
_OPTIONS = {"kind": "inter", "seed": 0, "sequence_ids": None}


class Attribution(Mapping):
    """The scores of one method on one batch, a mapping from layer number to scores like a decomposition.

    ``a[layer]``: ``[batch, head, query, key]`` for a head-level method (``a.level == "head"``) or
    ``[batch, query, key]`` for a token-level one (never copied into heads). ``a.tensor`` stacks the
    layers (order ``a.layers``; ``a.dims`` names the axes). Padded queries' rows are NaN, padded keys 0."""

    def __init__(self, method: str, level: str, scores: dict[int, torch.Tensor], attention_mask: torch.Tensor,
                 num_blocks: int | None = None, undecomposable: Mapping[int, str] | None = None):
        self.method, self.level = method, level
        self.scores = dict(sorted(scores.items()))
        self.attention_mask = attention_mask
        self.num_blocks, self.undecomposable = num_blocks, dict(undecomposable or {})

    @property
    def layers(self) -> list[int]:
        return list(self.scores)

    @property
    def dims(self) -> tuple[str, ...]:
        return ("batch", "layer", "head", "query", "key") if self.level == "head" else ("batch", "layer", "query", "key")

    @property
    def tensor(self) -> torch.Tensor:
        return torch.stack([self.scores[layer] for layer in self.layers], dim=1)

    def __getitem__(self, layer: int) -> torch.Tensor:
        """The scores of ``layer`` (negative numbers count from the last layer, as in a decomposition)."""
        from .core.decomposition import layer_by_number

        return layer_by_number(self.scores, layer, self.num_blocks, self.undecomposable, "attribute")

    def __iter__(self) -> Iterator[int]:
        return iter(self.scores)

    def __len__(self) -> int:
        return len(self.scores)

    def __repr__(self) -> str:
        shape = tuple(next(iter(self.scores.values())).shape) if self.scores else ()
        return f"Attribution(method={self.method!r}, level={self.level!r}, layers={self.layers}, shape per layer={shape})"


def list_attribution_methods() -> tuple[str, ...]:
    """The names :func:`attribute` accepts as ``method``, in registration order."""
    from .faithfulness.methods import available_methods

    return available_methods()


def _method_options(method) -> dict:
    """The options (name -> default) a method takes: ``kind`` for the kind-dependent rungs of the
    ladder, ``seed`` for methods whose function names it."""
    try:
        parameters = inspect.signature(method.fn).parameters
    except (TypeError, ValueError):
        parameters = {}
    options = {}
    if method.kind_dependent:
        options["kind"] = _OPTIONS["kind"]
    if "seed" in parameters:
        options["seed"] = parameters["seed"].default if parameters["seed"].default is not inspect._empty else 0
    if "groups" in parameters:
        options["sequence_ids"] = None
    return options


def attribute(
    model: nn.Module,
    inputs: Mapping | None = None,
    *,
    method: str | Callable = "contribution",
    layers: int | Iterable[int] | None = None,
    compute_dtype: torch.dtype | str | None = None,
    truncate: bool = False,
    **keywords,
) -> Attribution:
    """Scores of the attribution ``method`` (a registered name or a callable) for every requested layer.

    Inputs as in :func:`cwcore.decompose` (keywords or one mapping; ``input_ids [batch, sequence]`` required). The
    method's own options are keywords too (``kind="intra"``, ``seed=``; ``sequence_ids=``, one distinct int per row,
    for a method that hashes each row's sequence number, such as ``random``: by default the row numbers, so the same
    sentence in another row gets other random scores); any other keyword raises. ``layers``: one, a list, or None
    (all); ``truncate=True`` keeps the first tokens of an input longer than the model's context (else refused).
    ``compute_dtype``: default float64 for a float64 model, else float32; every method's geometry and scores are in
    it (value zeroing's reruns are the model's own forward, in its dtype; the random control's scores are a seeded
    hash, float32). Returns an :class:`Attribution` (token-level methods: compare with contribution weights summed
    over heads)."""
    from .core.architectures import UnsupportedModelError
    from .core.attention import default_compute_dtype
    from .core.decomposition import LayerDecomposition, prepare_inputs, select_layers
    from .core.inputs import (InputError, cached_length, check_compute_dtype, check_inputs, check_sequence_ids,
                              own_options, refuse_unknown_inputs, unwrap_compiled)
    from .core.interventions import intervene
    from .faithfulness.methods import as_method, available_methods, get_method, scoring
    from .faithfulness.methods.registry import refuse_encoder_decoder

    if isinstance(method, str):
        if method not in available_methods():
            base, _, suffix = method.rpartition("_")
            if suffix in ("inter", "intra") and base in available_methods():  # faithfulness_curve's metric spelling
                raise ValueError(f"attribute: unknown method {method!r}; the kind is its own keyword here: "
                                 f"method={base!r}, kind={suffix!r}")
            raise ValueError(f"attribute: unknown method {method!r}; registered methods: {', '.join(available_methods())}")
        chosen = get_method(method)
    elif callable(method):
        chosen = as_method(method)
    else:
        raise TypeError(f"attribute: method must be a registered name or a callable, got {type(method).__name__}")
    options = _method_options(chosen)
    given_options = {name: keywords.pop(name) for name in list(keywords) if name in options}
    stray = sorted(set(keywords) & set(_OPTIONS))
    if stray:
        raise TypeError(f"attribute: method {chosen.name!r} takes no option {', '.join(map(repr, stray))}"
                        + (f" (its options: {', '.join(options)})" if options else " (it has no options)"))
    if inputs is not None:
        if keywords:
            refuse_unknown_inputs(model, keywords, "attribute", own_options(attribute) + tuple(options))
            raise InputError("attribute: give the inputs once, either as one mapping (attribute(model, enc)) or as "
                             "keywords (attribute(model, **enc))")
        if not isinstance(inputs, Mapping):
            raise TypeError(f"attribute: inputs must be a mapping such as a tokenizer's output, got "
                            f"{type(inputs).__name__}; pass token ids as input_ids=...")
        keywords = dict(inputs)
    options.update(given_options)
    if options.get("kind", "inter") not in ("inter", "intra"):
        raise ValueError(f"attribute: kind must be 'inter' or 'intra', not {options['kind']!r}")

    model = unwrap_compiled(model)
    refuse_encoder_decoder(model)
    try:
        checked = check_inputs(model, keywords, caller="attribute", truncate=truncate,
                               options=own_options(attribute) + tuple(options))
    except TypeError as err:  # say that the method's options were looked at too
        raise type(err)(f"{err}; method {chosen.name!r} takes "
                        + (f"the options {', '.join(options)}" if options else "no options")) from None
    if checked.get("input_ids") is None:
        raise InputError("attribute: input_ids are required (the methods index tokens)")
    input_ids = checked["input_ids"]
    attention_mask = checked.get("attention_mask")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    checked["attention_mask"] = attention_mask
    if cached_length(checked):  # before: an error of the method's shapes, after the whole forward
        raise InputError(f"attribute: a key/value cache holds {cached_length(checked)} earlier token(s) that the "
                         "scores could not index (they are [batch, query, key] over input_ids); pass the whole "
                         "sequence as input_ids, or use cwcore.summarize, which reads a cache")
    if "output_gradient" in chosen.needs and set(checked) - {"input_ids", "attention_mask"}:
        head = getattr(model, "get_output_embeddings", None)
        if callable(head) and head() is None:  # the true reason first: removing an input would not help
            raise UnsupportedModelError(f"attribute: method {chosen.name!r} differentiates the next-token "
                                        f"log-likelihood, and {type(model).__name__} has no language-model head; "
                                        "load it with its head (e.g. AutoModelForCausalLM)")
        raise InputError(f"attribute: method {chosen.name!r} takes input_ids and attention_mask only, got also "
                         f"{', '.join(sorted(set(checked) - {'input_ids', 'attention_mask'}))}")
    # as decompose: all the layers cwcore can decompose (asked for by number, one is refused with its reason)
    model, blocks, wanted, undecomposable = select_layers(model, layers, "attribute", "attributed")
    compute_dtype = default_compute_dtype(model) if compute_dtype is None else check_compute_dtype(compute_dtype)
    observed = list(range(max(wanted) + 1)) if "earlier_layers" in chosen.needs else wanted
    raw: dict[int, torch.Tensor] = {}
    heads: dict[int, int] = {}  # each layer's query heads: a one-head layer's scores stay head-level
    groups = None
    if "sequence_ids" in options:
        groups = torch.tensor(check_sequence_ids(options["sequence_ids"], input_ids.shape[0], "row"),
                              device=input_ids.device)
    with scoring(model, [chosen], input_ids, attention_mask, layers=wanted, kind=options.get("kind", "inter"),
                 seed=options.get("seed", 0), groups=groups) as context:
        def observe(call):
            values = context.raw_scores(chosen, LayerDecomposition.from_call(call), call)
            if call.layer in wanted:
                raw[call.layer] = values.detach().clone()
                heads[call.layer] = call.probs.shape[1]

        forward_inputs = prepare_inputs(model, checked)
        with torch.inference_mode(), intervene(model, {}, attention_mask=attention_mask, compute_dtype=compute_dtype,
                                               observers={layer: [observe] for layer in observed}) as session:
            context.changed_outputs = session.changed_outputs
            model(**forward_inputs)
    attribution = _assemble(chosen.name, raw, input_ids.shape, attention_mask, heads)
    attribution.num_blocks, attribution.undecomposable = len(blocks), undecomposable
    return attribution


def _assemble(name: str, raw: dict[int, torch.Tensor], shape, attention_mask: torch.Tensor,
              heads: dict[int, int]) -> Attribution:
    """Check each layer's shape, squeeze a one-head axis to token level where the layer has several heads
    (``heads``: each layer's), apply the padding convention."""
    b, n = shape
    levels, scores = set(), {}
    for layer, values in raw.items():
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"attribute: method {name!r} returned {type(values).__name__} at layer {layer}, not a tensor")
        if values.dim() == 4 and values.shape[1] == 1 and heads.get(layer, 0) != 1:  # a one-head model's heads
            values = values[:, 0]
        if values.dim() == 3 and tuple(values.shape) == (b, n, n):
            levels.add("token")
        elif values.dim() == 4 and values.shape[0] == b and tuple(values.shape[2:]) == (n, n):
            levels.add("head")
        else:
            raise ValueError(f"attribute: method {name!r} returned shape {tuple(values.shape)} at layer {layer}; "
                             f"expected [batch, head, query, key] or [batch, query, key] with batch {b}, length {n}")
        values = values.float() if not values.is_floating_point() else values.clone()
        valid = attention_mask.bool().to(values.device)
        if not bool(valid.all()):
            if values.dim() == 4:
                values = values.masked_fill(~valid[:, None, None, :], 0.0)
                values = values.masked_fill(~valid[:, None, :, None], float("nan"))
            else:
                values = values.masked_fill(~valid[:, None, :], 0.0).masked_fill(~valid[:, :, None], float("nan"))
        scores[layer] = values
    if len(levels) > 1:
        raise ValueError(f"attribute: method {name!r} returned head-level scores at some layers and token-level at others")
    return Attribution(name, levels.pop() if levels else "head", scores, attention_mask)
