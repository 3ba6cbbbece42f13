"""The sink analyses' engine and its extension interface: options, token blocks, one layer's state, the
registry of analyses, the batch loop.

An analysis is one :class:`Analysis`, registered with :func:`register` by its module: a *collector*
turning each layer of a clean forward pass into DataFrames (the batch's cached pieces), the *tables*
built from all batches' pieces, their CSV stems, its :func:`cwcore.sinks.summarize` rows, its
*claims* and its :class:`Option` s. All options (with :data:`EPS`, :data:`SEED` and
:data:`RUN_OPTIONS`) make one frozen dataclass, :class:`cwcore.sinks.SinkOptions` (:func:`options_class`).

Writing an analysis (one new file plus its name in :data:`cwcore.sinks.analyses._MODULES`):

* a :class:`Collector` subclass: ``on_layer(state)`` sees every layer's :class:`LayerState`,
  ``finish(logits)`` returns the batch's pieces ``{part: DataFrame}``; :func:`forward` runs further
  (intervened) passes; :func:`grid_columns`, :func:`flat` and :func:`concat` build the pieces;
* ``tables(parts, blocks, **options)``: the result from all batches' pieces;
* ``register(Analysis(name, collector, tables, stems, options=..., ...))`` and the public function
  ``@ANALYSIS.public def my_analysis(model, tokenizer, data, **options): "doc"``.

Collectors are *observers* of :class:`cwcore.core.attention.AttentionSession`; interventions are its
*transforms*. The batch loop is :func:`cwcore.runs.for_each_batch` over one
:class:`cwcore.runs.PieceStore` per analysis, so the single functions and
:func:`cwcore.sinks.run_analyses` share the cache."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import pandas as pd
import torch
from torch import nn

from .. import runs
from ..cache import caching_enabled
from ..core.architectures import attention_blocks, evaluating, input_device, layer_type, require_causal
from ..core.inputs import check_texts
from ..core.attention import AttentionSession, LayerCall, cwcore_attention
from ..core.decomposition import LayerDecomposition
from ..core.geometry import head_space_geometry, split_output_projection
from ..core.interventions import removal

__all__ = ["Analysis", "Blocks", "Collector", "EPS", "LayerState", "Option", "REGISTRY", "RUN_OPTIONS", "SEED",
           "SINK_POSITION", "Spec", "collect", "concat", "exclude_sink", "flat", "forward", "grid_columns",
           "layer_types", "model_fingerprint", "options_class", "refuse_unread", "register", "run_one",
           "token_blocks", "token_classes"]

#: The key position every analysis treats as the sink: position 0, the paper's reading. Whether the
#: attention statistics agree (which positions take the mass) is measured by :mod:`cwcore.sinks.rates`
#: (its ``positions`` table), not assumed. Fixed, not an option: the decomposition, the semantic cone, the
#: rates' query ranges and convexity are written for the first key.
SINK_POSITION = 0

#: The one model fingerprint of the project (cache identity of the weights).
model_fingerprint = runs.model_fingerprint


# options: each declared once (its default, check and help), checked once
@dataclass(frozen=True)
class Option:
    """One option: ``name``, ``default``, ``help`` (one line, also the command line's), ``check(value)``
    (raises naming the option; returns the value kept), ``choices``, ``cli`` (False: no flag of its own) and
    ``read_when`` ``(option, value)``: the only setting under which it is read (given otherwise, it is refused,
    :func:`refuse_unread`)."""

    name: str
    default: Any
    help: str
    check: Callable[[Any], Any] | None = None
    choices: tuple | None = None
    cli: bool = True
    read_when: tuple[str, Any] | None = None

    def validate(self, value):
        """``value`` checked (and normalised, e.g. an int eps to float); refused with one sentence."""
        if self.choices is not None and not any(value is c or (type(value) is type(c) and value == c)
                                                for c in self.choices):
            raise ValueError(f"{self.name} must be one of {', '.join(map(repr, self.choices))}, not {value!r}")
        return self.check(value) if self.check is not None else value


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value)


def unit_interval(name: str) -> Callable[[Any], float]:
    """A check: a finite number strictly between 0 and 1 (a sink-rate threshold)."""

    def check(value):
        x = _number(name, value)
        if not (math.isfinite(x) and 0 < x < 1):
            raise ValueError(f"{name} must be a finite number in (0, 1), got {value!r}")
        return x

    return check


def non_negative(name: str) -> Callable[[Any], float]:
    """A check: a finite number >= 0."""

    def check(value):
        x = _number(name, value)
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        return x

    return check


def count(name: str, minimum: int = 1, allow_none: bool = False) -> Callable[[Any], int | None]:
    """A check: an integer >= ``minimum`` (:func:`cwcore.runs.check_count`)."""
    return lambda value: runs.check_count(value, name, minimum=minimum, allow_none=allow_none)


def _seed(value):
    from ..core.inputs import is_seed

    if not is_seed(value):
        raise TypeError(f"seed must be a non-negative integer, got {value!r}")
    return int(value)


def _dtype(value):
    """float32 or float64 (or their names), the geometry's dtypes: bfloat16 failed after the forward and float16
    computed the geometry in half precision."""
    from ..core.inputs import check_compute_dtype

    return check_compute_dtype(value)


#: sink heads: sink rate above eps (Sink_eps of Gu et al. 2025); the one definition of its default
EPS = Option("eps", 0.3, "sink heads: a sink rate (mean alpha_i0 over queries >= 1) above eps", unit_interval("eps"))
#: the seed of every random choice (samples, controls, bootstrap resamples)
SEED = Option("seed", 0, "seed of every random choice", _seed)

#: the block length text data is cut into when ``block_size`` is not given
TEXT_BLOCK_SIZE = 128
#: how the analyses run; the command line sets these with its own flags
RUN_OPTIONS = (
    Option("block_size", None, f"tokens per block of text data (None: {TEXT_BLOCK_SIZE}); token blocks keep their "
           "own length", count("block_size", 2, allow_none=True), cli=False),
    Option("num_sequences", None, "blocks to analyse (None: all)", count("num_sequences", allow_none=True), cli=False),
    Option("add_bos", None, "prepend a BOS token to text (None: the tokenizer's default)", choices=(None, True, False),
           cli=False),
    Option("batch_size", 8, "sequences per forward pass", count("batch_size"), cli=False),
    Option("progress", True, "show a progress bar", choices=(True, False), cli=False),
    Option("compute_dtype", torch.float32, "dtype of the geometry", _dtype, cli=False),
)
_RUN = tuple(o.name for o in RUN_OPTIONS)


def _all_options(registry) -> dict[str, Option]:
    """name -> Option: the run options, then every registered analysis's (one object per name)."""
    out = {o.name: o for o in RUN_OPTIONS}
    for analysis in registry.values():
        for option in analysis.options:
            if out.setdefault(option.name, option) is not option:
                raise ValueError(f"option {option.name!r} of analysis {analysis.name!r} is declared twice; "
                                 "share the one Option object")
    return out


@functools.lru_cache(maxsize=None)
def _options_class(names: tuple[str, ...]):
    options = _all_options(REGISTRY)

    def __post_init__(self):
        for option in options.values():
            object.__setattr__(self, option.name, option.validate(getattr(self, option.name)))

    def analysis_options(self, name: str) -> dict:
        """The options analysis ``name`` takes (its own, without the run options), as a dict."""
        return {o.name: getattr(self, o.name) for o in REGISTRY[name].options}

    def run_options(self) -> dict:
        """The run options (:data:`RUN_OPTIONS`) as a dict."""
        return {name: getattr(self, name) for name in _RUN}

    cls = dataclasses.make_dataclass(
        "SinkOptions", [(o.name, Any, dataclasses.field(default=o.default)) for o in options.values()], frozen=True,
        namespace={"__post_init__": __post_init__, "analysis_options": analysis_options, "run_options": run_options,
                   "OPTIONS": options})
    cls.__module__ = "cwcore.sinks"
    cls.__doc__ = ("Every option of the sink analyses, checked once (a value out of range is refused with one "
                   "sentence):\n\n" + "\n".join(f"* ``{o.name}`` = {o.default!r}: {o.help}" for o in options.values()))
    return cls


def options_class():
    """The frozen dataclass of every option of the registered analyses and the run (``SinkOptions``);
    its ``OPTIONS`` maps each name to its :class:`Option`."""
    return _options_class(tuple(REGISTRY))


# inputs
@dataclass
class Blocks:
    """Token blocks ``ids [sequence, position]`` and what is known about their first token."""

    ids: torch.Tensor
    add_bos: bool | None  # None: blocks were given ready-made
    first_token_is_bos: float  # share of sequences starting with tokenizer.bos_token_id (NaN: unknown)
    classes: np.ndarray | None = None  # token class of every position [n, T] (None without a tokenizer)


def token_blocks(
    data,
    tokenizer=None,
    block_size: int | None = None,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
) -> Blocks:
    """Normalise ``data`` (text or ready blocks, see :mod:`cwcore.sinks`) to ``ids [n, block_size]``: text is
    cut into blocks of ``block_size`` tokens (None: :data:`TEXT_BLOCK_SIZE`); ready blocks keep their length, and
    a ``block_size`` other than it is refused (it would be ignored)."""
    ready = None
    if isinstance(data, np.ndarray) and data.dtype.kind in "US":  # an array of texts
        data = data.tolist()
    if isinstance(data, torch.Tensor):
        ready = data
    elif isinstance(data, np.ndarray) or (  # ids as numpy, or as a list of lists: they were read as text
            isinstance(data, (list, tuple)) and data
            and all(isinstance(row, (list, tuple, np.ndarray, torch.Tensor)) for row in data)):
        lengths = set() if isinstance(data, np.ndarray) else {len(row) for row in data}
        if len(lengths) > 1:
            raise ValueError(f"token blocks must all have one length, got lengths {sorted(lengths)}; text goes in "
                             "as a string or a list of strings")
        ready = torch.as_tensor(np.asarray([np.asarray(row) for row in data]) if not isinstance(data, np.ndarray)
                                else data)
    elif isinstance(data, Mapping):  # a tokenizer's output: before, its keys were tokenised as text
        other = sorted(set(data) - {"input_ids", "attention_mask"})
        if "input_ids" not in data or other:
            raise ValueError("a mapping of token blocks holds input_ids (and an all-ones attention_mask) only, got "
                             f"{', '.join(map(repr, sorted(data)))}; text goes in as a string or a list of strings")
        mask = data.get("attention_mask")
        if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
            raise ValueError("sink analyses need unpadded blocks: the attention mask has zeros")
        ready = torch.as_tensor(data["input_ids"])
    elif hasattr(data, "column_names") and "input_ids" in data.column_names:
        if "attention_mask" in data.column_names and not all(all(m) for m in data["attention_mask"]):
            raise ValueError("sink analyses need unpadded blocks: the attention mask has zeros")
        ready = torch.tensor(data["input_ids"])
    elif isinstance(data, (list, tuple)) and data and isinstance(data[0], dict) and "input_ids" in data[0]:
        if any("attention_mask" in r and not all(r["attention_mask"]) for r in data):
            raise ValueError("sink analyses need unpadded blocks: the attention mask has zeros")
        ready = torch.tensor([list(r["input_ids"]) for r in data])
    if ready is not None:
        if add_bos is not None:
            raise ValueError("add_bos applies to text; these blocks are already tokenised")
        ids = runs.check_token_blocks(ready, argument="data", caller="sink analyses").long()  # no float ids cut
        if ids.dim() != 2:
            raise ValueError(f"token blocks must be [sequence, position], got shape {tuple(ids.shape)}")
        if block_size is not None and block_size != ids.shape[1]:
            raise ValueError(f"block_size={block_size} applies to text; these blocks are already tokenised, "
                             f"{ids.shape[1]} tokens each: leave block_size out, or cut the blocks yourself")
        if num_sequences is not None:
            ids = ids[:num_sequences]
        resolved = None
    else:
        if tokenizer is None:
            raise ValueError("text data needs a tokenizer")
        from ..data import _resolve_bos, lm_blocks

        resolved = _resolve_bos(tokenizer, add_bos) is not None
        block_size = TEXT_BLOCK_SIZE if block_size is None else block_size
        blocks = lm_blocks(data, tokenizer, block_size=block_size, num_blocks=num_sequences, add_bos=add_bos)
        ids = torch.tensor(blocks["input_ids"], dtype=torch.long).reshape(len(blocks), block_size)
        if ids.shape[0] == 0:
            raise ValueError(f"the texts are shorter than one block of block_size={block_size} tokens (text is cut "
                             "into blocks of block_size tokens): give longer or more texts, or a smaller block_size")
    if ids.shape[0] == 0 or ids.shape[1] < 2:
        raise ValueError(f"need at least one block of at least 2 tokens, got shape {tuple(ids.shape)}")
    bos = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    first = float("nan") if bos is None else float((ids[:, 0] == bos).float().mean())
    classes = token_classes(ids, tokenizer) if tokenizer is not None else None
    return Blocks(ids, resolved, first, classes)


#: the token classes of :func:`token_classes`, in the order the tables list them
TOKEN_CLASSES = ("bos", "first", "special", "newline", "punctuation", "word")


def token_classes(ids: torch.Tensor, tokenizer) -> np.ndarray:
    """The class of every token of ``ids [n, T]``: position 0 ``"bos"`` (the BOS token) or ``"first"``;
    later ``"special"``, ``"newline"``, ``"punctuation"`` (only punctuation or symbols) or ``"word"``."""
    ids = torch.as_tensor(ids)
    special = {int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None}
    bos = getattr(tokenizer, "bos_token_id", None)
    vocab = {}
    for t in np.unique(ids.numpy()).tolist():
        if t in special:
            vocab[t] = "special"
            continue
        text = tokenizer.decode([t])
        stripped = text.strip()
        if "\n" in text or "\r" in text:
            vocab[t] = "newline"
        elif stripped and all(not c.isalnum() for c in stripped):
            vocab[t] = "punctuation"
        else:
            vocab[t] = "word"
    out = np.vectorize(vocab.get, otypes=[object])(ids.numpy()).astype("<U11")
    out[:, 0] = np.where(ids[:, 0].numpy() == bos, "bos", "first") if bos is not None else "first"
    return out


def layer_types(model: nn.Module) -> dict[int, str]:
    """``{layer: "sliding" | "global"}`` for every attention layer (the numbering of ``LayerState.layer``):
    by :func:`cwcore.core.architectures.layer_type` (the one rule for sliding windows)."""
    return {block.layer: layer_type(model, block) for block in attention_blocks(model)}


# one layer of one forward pass, and the forward pass itself
class LayerState:
    """What one attention layer did in one forward pass, in the compute dtype.

    ``probs [batch, head, query, key]`` (after any transform), ``values [batch, head, key, dim]``
    (repeated for grouped-query attention), ``w_o [head, model, dim]``, ``gram [head, dim, dim]`` =
    W_O^h^T W_O^h (head-space inner products are those of the projected vectors); ``sink_position``;
    ``layer_type``; ``learned_sink_mass [batch, head, query]`` or None (GPT-OSS ``s_aux``)."""

    @property
    def sink_position(self) -> int:
        """The sink's key, :data:`SINK_POSITION` (read-only: every analysis is written for the first key)."""
        return SINK_POSITION

    def __init__(self, layer: int, probs: torch.Tensor, values: torch.Tensor, weight: torch.Tensor, dtype,
                 layer_type: str = "global", learned_sink_mass: torch.Tensor | None = None):
        self.layer = layer
        self.layer_type = layer_type
        self.learned_sink_mass = None if learned_sink_mass is None else learned_sink_mass.detach().to(dtype)
        self.probs = probs.detach().to(dtype)
        self.values = values.detach().to(dtype)
        self.w_o = split_output_projection(weight.detach().to(dtype), probs.shape[1])
        self.gram = self.w_o.transpose(1, 2) @ self.w_o

    @classmethod
    def from_call(cls, call: LayerCall, layer_type: str = "global") -> "LayerState":
        """The state of the layer a session's observer sees (its final probabilities)."""
        weight, _ = call.output_projection()
        return cls(call.layer, call.probs, call.value, weight, call.compute_dtype, layer_type,
                   call.learned_sink_mass)

    def inner(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """<W_O^h x, W_O^h y> over the last axis: ``[b, h, n, d] x [b, h, n, d] -> [b, h, n]``."""
        return ((x @ self.gram) * y).sum(-1)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """||W_O^h x|| ``[b, h, n]``."""
        return self.inner(x, x).clamp_min(0).sqrt()

    @cached_property
    def mixed(self) -> torch.Tensor:
        """z^h_i = sum_j alpha_ij v^h_j ``[b, h, q, d]`` (o^h_i = W_O^h z^h_i)."""
        return self.probs @ self.values

    @cached_property
    def values_gram(self) -> torch.Tensor:
        """G_h v^h_j ``[b, h, k, d]``: <v~_0, v~_j> = (G v_0) . v_j."""
        return self.values @ self.gram

    @cached_property
    def value_norm(self) -> torch.Tensor:
        """||v~_j|| ``[b, h, k]``."""
        return (self.values_gram * self.values).sum(-1).clamp_min(0).sqrt()

    def sink_inner(self, x: torch.Tensor) -> torch.Tensor:
        """<v~_0, W_O^h x> for head-space vectors x ``[b, h, n, d]`` -> ``[b, h, n]``."""
        return (self.values_gram[:, :, :1, :] * x).sum(-1)

    @cached_property
    def semantic_norm(self) -> torch.Tensor:
        """||s_i|| ``[b, h, q]``."""
        return self.norm(self.semantic)

    @cached_property
    def output_norm(self) -> torch.Tensor:
        """||o^h_i|| ``[b, h, q]``."""
        return self.norm(self.mixed)

    @cached_property
    def semantic(self) -> torch.Tensor:
        """s^h_i = sum_{j>0} alpha_ij v^h_j ``[b, h, q, d]`` (head space), the non-sink component."""
        return self.mixed - self.probs[..., :1] * self.values[:, :, None, 0, :]

    @cached_property
    def decomposition(self) -> LayerDecomposition:
        """The layer's contribution weights (no output bias), from these probabilities and values."""
        return LayerDecomposition(self.layer, head_space_geometry(self.probs, self.values, self.w_o))


def _exclude_sink(probs: torch.Tensor, rows: torch.Tensor, learned: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax without key 0 for queries >= 1 of the selected ``rows [batch, head]``: alpha_ij / (1 - alpha_i0).
    ``learned [batch, head, query]``: the mass a learned sink logit takes from ``probs`` (GPT-OSS), which stays
    in the softmax (the tail's sum is 1 - alpha_i0 less it)."""
    tail = probs[..., 1:]
    total = tail.sum(-1, keepdim=True)
    if learned is not None:
        total = total + learned[..., None].to(total.dtype)
    renormalised = torch.cat([torch.zeros_like(probs[..., :1]), torch.where(total > 0, tail / total, tail)], -1)
    queries = torch.arange(probs.shape[-2], device=probs.device) >= 1
    selected = rows.bool()[:, :, None, None] & queries[None, None, :, None]
    return torch.where(selected, renormalised, probs)


def exclude_sink(rows: torch.Tensor):
    """The ``sink_renorm`` transform: in heads ``rows [batch, head]``, for queries i >= 1, alpha_i0 := 0
    and the row renormalised (the softmax without key 0)."""

    def transform(call: LayerCall) -> torch.Tensor:
        # probs are the softmax over keys and learned sink with the sink's column dropped, whether the model's own
        # maps are those (GPT-OSS) or sum to one and scale the output (Granite SWA): the same arithmetic
        return _exclude_sink(call.probs, rows.to(call.probs.device), call.learned_sink_mass)

    return transform


def _backbone(model: nn.Module) -> nn.Module:
    """The model without its language-modelling head (avoids computing unused logits)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def forward(model, ids, on_layer=None, masks=None, renormalise=None, logits=False, compute_dtype=torch.float32,
             transforms=None):
    """Run ``model`` on ``ids [b, T]`` through cwcore's attention; the logits ``[b, T, vocab]`` or None.

    ``on_layer(state)`` observes every layer; ``masks {layer: bool [.., q, k]}`` remove terms;
    ``renormalise {layer: bool [b, h]}`` applies :func:`exclude_sink`; ``transforms {layer: callable}``."""
    extra = transforms
    transforms: dict[int, list] = {}
    for layer, transform in (extra or {}).items():
        transforms.setdefault(layer, []).append(transform)
    for layer, mask in (masks or {}).items():
        transforms.setdefault(layer, []).append(removal(mask))
    for layer, rows in (renormalise or {}).items():
        transforms.setdefault(layer, []).append(exclude_sink(rows))
    observers = {}
    if on_layer is not None:
        types = layer_types(model)

        def observe(call: LayerCall) -> None:
            on_layer(LayerState.from_call(call, types.get(call.layer, "global")))

        observers = {block.layer: [observe] for block in attention_blocks(model)}
    session = AttentionSession(model, observers=observers, transforms=transforms, compute_dtype=compute_dtype)
    ids = ids.to(input_device(model))
    network = model if logits else _backbone(model)
    with evaluating(model), torch.inference_mode(), cwcore_attention(model, session):
        out = network(input_ids=ids, attention_mask=torch.ones_like(ids))
    return out.logits if logits else None


# the registry: one Analysis object per module
class Collector:
    """One analysis's raw material from one batch's clean pass: ``Collector(model, ids [b, T], start, dtype,
    **options)``; :meth:`on_layer` sees each :class:`LayerState`, :meth:`finish` gets the logits (None
    unless ``needs_logits``) and returns the batch's pieces."""

    needs_logits = False

    def __init__(self, model, ids: torch.Tensor, start: int, dtype: torch.dtype, **options):
        self.model, self.ids, self.start, self.dtype = model, ids, start, dtype
        self.options = options

    def on_layer(self, s: LayerState) -> None:
        raise NotImplementedError

    def finish(self, logits: torch.Tensor | None) -> dict[str, pd.DataFrame]:
        raise NotImplementedError


@dataclass(frozen=True)
class Analysis:
    """One sink analysis, everything about it in one object.

    ``collector``: a :class:`Collector` class; ``options``: the :class:`Option` s it takes;
    ``collector_options``: those its collector takes (also in the cache key); ``tables(parts, blocks,
    **options)``: its result; ``stems``: the CSV stems of the result's tables; ``summary(tables, add)``:
    its rows of :func:`cwcore.sinks.summarize`; ``claims(results, *, eps, quantiles, n_resamples,
    seed)``: its claim rows from :func:`cwcore.sinks.run_analyses` (``raw=True``)."""

    name: str
    collector: type
    tables: Callable
    stems: tuple[str, ...]
    collector_options: tuple[str, ...] = ()
    summary: Callable | None = None
    claims: Callable | None = None
    options: tuple[Option, ...] = ()

    def __post_init__(self):
        missing = sorted(set(self.collector_options) - {o.name for o in self.options})
        if missing:
            raise ValueError(f"analysis {self.name!r}: collector options {missing} are not among its options")

    def public(self, function: Callable) -> Callable:
        """Decorator: ``function`` (its name and docstring) becomes this analysis's checked public function
        ``f(model, tokenizer, data, **options)`` with a signature listing its options and the run options."""
        name = self.name

        @functools.wraps(function)
        def run(model, tokenizer, data, **options):
            return run_one(name, model, tokenizer, data, options)

        positional = [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                      for p in ("model", "tokenizer", "data")]
        keywords = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default)
                    for o in (*self.options, *RUN_OPTIONS)]
        run.__signature__ = inspect.Signature(positional + keywords,
                                              return_annotation=inspect.signature(function).return_annotation)
        return run

    def spec(self, options: dict) -> "Spec":
        """What to collect for these run options."""
        return Spec(self.name, self.collector, {k: options[k] for k in self.collector_options})

    def named_tables(self, result) -> dict[str, pd.DataFrame]:
        """``{stem: DataFrame}`` of one result (as the command line writes them)."""
        return {self.stems[0]: result} if len(self.stems) == 1 else dict(zip(self.stems, result))


#: name -> Analysis, in registration order (the order of cwcore.sinks.ANALYSES)
REGISTRY: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add ``analysis`` to :data:`REGISTRY` (one call at the end of each analysis module)."""
    REGISTRY[analysis.name] = analysis
    return analysis


# the batch loop: one shared clean forward pass, one PieceStore per analysis
@dataclass
class Spec:
    """One analysis to run: its name (cache namespace ``sinks-<name>``), collector and per-batch options."""

    name: str
    collector: type
    options: dict


class _Stores:
    """The PieceStores of several analyses as the one store :func:`cwcore.runs.for_each_batch` reads: a
    batch is found when every analysis has its pieces; the ones found are kept for ``compute``."""

    def __init__(self, stores: dict):
        self.stores = stores
        self.found: dict[str, dict[str, dict[str, pd.DataFrame]]] = {}

    def get_group(self, key: str):
        found = {}
        for name, store in self.stores.items():
            frames = store.get_group(key)
            if frames is not None:
                found[name] = frames
        self.found[key] = found
        if len(found) < len(self.stores):
            return None
        return {f"{name}/{part}": frame for name, frames in found.items() for part, frame in frames.items()}

    def put_group(self, key: str, frames: dict[str, pd.DataFrame]) -> None:
        grouped: dict[str, dict[str, pd.DataFrame]] = {}
        for label, frame in frames.items():
            name, part = label.split("/", 1)
            grouped.setdefault(name, {})[part] = frame
        for name, parts in grouped.items():
            if name not in self.found.get(key, {}):
                self.stores[name].put_group(key, parts)
        self.found.pop(key, None)


def _batch_key(batch) -> str:
    start, ids = batch
    return f"{start:06d}-{len(ids)}-{runs.tensor_digest(ids)}"


def collect(model, tokenizer, data, specs: list["Spec"], *, block_size=None, num_sequences=None, add_bos=None,
            batch_size=8, progress=True, compute_dtype=torch.float32):
    """Every batch's pieces of every analysis in ``specs`` (read from the cache inside caching), the
    missing ones sharing one clean pass: ``({analysis: {part: DataFrame}}, blocks)``."""
    batch_size = runs.check_batch_size(batch_size)
    num_sequences = runs.check_count(num_sequences, "num_sequences", allow_none=True)
    block_size = runs.check_count(block_size, "block_size", minimum=2, allow_none=True)
    blocks = token_blocks(check_texts(data, "sink analyses", "data"), tokenizer, block_size, num_sequences, add_bos)
    runs.check_token_blocks(blocks.ids, model, argument="data", caller="sink analyses")  # vocabulary, context
    fingerprint = model_fingerprint(model) if caching_enabled() else None  # once, not once per analysis
    stores = _Stores({
        spec.name: runs.PieceStore(f"sinks-{spec.name}", {"analysis": spec.name, "model": fingerprint,
                                                          "dtype": str(compute_dtype), **spec.options},
                                   code=("sinks",))
        for spec in specs
    })

    def compute(batch) -> dict[str, pd.DataFrame]:
        start, ids = batch
        found = stores.found.get(_batch_key(batch), {})
        todo = [spec for spec in specs if spec.name not in found]
        collectors = [spec.collector(model, ids, start, compute_dtype, **spec.options) for spec in todo]

        def on_layer(s: LayerState):
            # each analysis reads key 0 as the sink and keys 1..i as query i's tail
            require_causal(s.probs, s.layer, "sink analyses", "keys after the query would be left out of its tail")
            for collector in collectors:
                collector.on_layer(s)

        logits = forward(model, ids, on_layer, logits=any(c.needs_logits for c in collectors),
                         compute_dtype=compute_dtype)
        frames = {name: dict(parts) for name, parts in found.items()}
        for spec, collector in zip(todo, collectors):
            frames[spec.name] = collector.finish(logits)
        return {f"{name}/{part}": frame for name, parts in frames.items() for part, frame in parts.items()}

    n = blocks.ids.shape[0]
    batches = [(start, blocks.ids[start : start + batch_size]) for start in range(0, n, batch_size)]
    parts: dict[str, dict[str, list[pd.DataFrame]]] = {spec.name: {} for spec in specs}
    label = "+".join(spec.name for spec in specs)
    for _, frames in runs.for_each_batch(batches, compute, stores, key=_batch_key, desc=f"sinks:{label}",
                                         show_progress=progress):
        for key, frame in frames.items():
            name, part = key.split("/", 1)
            parts[name].setdefault(part, []).append(frame)
    joined = {name: {p: pd.concat(f, ignore_index=True) for p, f in ps.items()} for name, ps in parts.items()}
    return joined, blocks


def refuse_unread(analysis: "Analysis", given: Iterable[str], resolved: Mapping[str, Any],
                  flags: bool = False) -> None:
    """Refuse an option ``given`` that ``analysis`` would not read with the ``resolved`` options (its
    :attr:`Option.read_when`), e.g. a threshold for heads='all'; ``flags``: name them as command-line flags."""
    def shown(name: str) -> str:
        return "--" + name.replace("_", "-") if flags else name

    for option in analysis.options:
        if option.name in given and option.read_when is not None:
            other, value = option.read_when
            if resolved.get(other) != value:
                raise ValueError(f"{shown(option.name)} is read only with {shown(other)} {value!r} (not "
                                 f"{resolved.get(other)!r}): give both, or leave {shown(option.name)} out")


def run_one(name: str, model, tokenizer, data, options: dict):
    """The result of one registered analysis (what its public function returns) for ``options``: its own
    options and the run options, checked by ``SinkOptions`` (:func:`options_class`); any other is refused."""
    analysis = REGISTRY[name]
    allowed = {o.name for o in analysis.options} | set(_RUN)
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"{name} takes no option {', '.join(map(repr, unknown))}; its options: "
                        f"{', '.join(o.name for o in analysis.options)} and {', '.join(_RUN)}")
    checked = options_class()(**options)
    own = checked.analysis_options(name)
    refuse_unread(analysis, options, own)
    parts, blocks = collect(model, tokenizer, data, [analysis.spec(own)], **checked.run_options())
    return analysis.tables(parts[name], blocks, **own)


# small helpers shared by the collectors
def grid_columns(shape: tuple[int, ...], names: tuple[str, ...], offsets: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Index columns of a C-ordered grid: ``{name: int array}``, each of length prod(shape)."""
    grids = np.meshgrid(*[np.arange(s) for s in shape], indexing="ij")
    offsets = offsets or {}
    return {n: (g.reshape(-1) + offsets.get(n, 0)).astype(np.int32) for n, g in zip(names, grids)}


def flat(x: torch.Tensor) -> np.ndarray:
    """A tensor as a flat numpy array."""
    return x.detach().cpu().numpy().reshape(-1)


def concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True)
