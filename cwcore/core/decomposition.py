"""``cwcore.decompose`` (defined here): attention, value-aware metrics and contribution weights of a forward pass.

Terminology (the paper's sections 'Multi-head attention as a sum of projected value vectors' to 'The metrics compared'), for layer l, head h, query i, key j:

- ``attention``: alpha_ij, ``[batch, head, query, key]``
- ``value_norm``: ||v~_j||, the projected value vector's norm, ``[batch, head, key]``
- ``head_output_norm`` ||o^h_i|| ``[batch, head, query]``; ``output_norm`` ||o_i|| ``[batch, query]``
  (o_i is the block's output without the output projection's bias, exposed as ``output_bias``)
- ``contribution(kind)``: the contribution weights c_ij, one spelling for both kinds (``[batch, head,
  query, key]``): ``"inter"`` alpha_ij <o_i, v~_j> / ||o_i||^2 (sums to 1 over heads and keys for each
  query), ``"intra"`` alpha_ij <o^h_i, v~_j> / ||o^h_i||^2 (sums to 1 over keys for each head and query)
- factors: ``relative_norm(kind)`` ||v~_j|| / ||o_i|| and ``cosine(kind)`` cos(o_i, v~_j)
- ``value_weighted`` alpha_ij ||v~_j|| and ``value_weighted_output_normalized(kind)`` alpha_ij ||v~_j|| / ||o_i||
- ``metric(name, kind)``: a rung of the ladder by its name (:data:`METRICS`), for code that loops over them
- deprecated spellings (:data:`DEPRECATED_VIEWS`, one DeprecationWarning each): ``inter``/``intra``,
  ``d.inter[layer]``, ``*_relative_norm``, ``*_cosine``, ``*_value_weighted_normalized``

Where an output norm is at most :data:`ZERO_NORM` the quantities divided by it are NaN, never a
silently huge number. Padded query rows are NaN; padded keys get zero attention and zero weight.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from .architectures import UnsupportedModelError, attention_blocks, has_cross_attention, model_facts
from .attention import AttentionSession, LayerCall, cwcore_attention, default_compute_dtype
from .geometry import HeadSpaceGeometry
from .inputs import (InputError, InputTypeError, is_integer_number, plain_integer, _shown, check_compute_dtype,
                     check_inputs, check_layers, check_materialised, own_options, refuse_unknown_inputs,
                     unwrap_compiled)

__all__ = ["Decomposition", "LayerDecomposition", "LayerNotDecomposedError", "decompose", "METRICS", "Rung", "ZERO_NORM",
           "prepare_inputs"]

#: Norms at or below this (in the compute dtype) count as zero: weights divided by them are NaN.
ZERO_NORM = 1e-12

# -- METRICS: the geometric ladder, in one place ------------------------------------------------------
class Rung(str):
    """One rung of the geometric ladder: its name (the string itself, e.g. ``"contribution"``) plus
    ``title`` (display name, numbered), ``colour`` (hex, the book's figures), ``kinds`` (the kinds
    of output normalisation it depends on: ``()`` or ``("inter", "intra")``) and ``rescales``: the
    lower rung it divides by the output norm of its kind (None), which makes the two rank identically
    wherever that norm is constant over a ranked group (see
    :func:`cwcore.faithfulness.protocol.identical_steps`).

    Adding a rung is one entry of :data:`METRICS` plus its branch in :meth:`LayerDecomposition.metric`.
    """

    title: str
    colour: str
    kinds: tuple[str, ...]
    rescales: str | None
    nonnegative: bool

    def __new__(cls, name: str, title: str, colour: str, kinds: tuple[str, ...] = (), rescales: str | None = None,
                nonnegative: bool = True):
        rung = super().__new__(cls, name)
        rung.title, rung.colour, rung.kinds, rung.rescales = title, colour, tuple(kinds), rescales
        rung.nonnegative = nonnegative
        return rung

    def __reduce__(self):
        return Rung, (str(self), self.title, self.colour, self.kinds, self.rescales, self.nonnegative)

    @property
    def kind_dependent(self) -> bool:
        return bool(self.kinds)


#: The geometric ladder of the paper's section 'The metrics compared', in order (names are plain strings: ``"contribution" in METRICS``).
METRICS = (
    Rung("attention", "1 attention", "#0173b2"),
    Rung("value_weighted", "2 value-weighted", "#de8f05"),
    Rung("value_weighted_output_normalized", "3 output-normalised", "#029e73", ("inter", "intra"),
         rescales="value_weighted"),
    Rung("contribution", "4 contribution", "#d55e00", ("inter", "intra"), nonnegative=False),
)


def _nan_at_zero(denominator: torch.Tensor) -> torch.Tensor:
    """``denominator`` with NaN where it is at most :data:`ZERO_NORM` in magnitude (a small tensor)."""
    return denominator.masked_fill(denominator.abs() <= ZERO_NORM, float("nan"))


def _safe_divide(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    return numerator / _nan_at_zero(denominator)


#: deprecated attribute -> the one spelling that replaces it (kind as an argument, as relative_norm(kind))
DEPRECATED_VIEWS = {
    "inter": 'contribution("inter")', "intra": 'contribution("intra")',
    "inter_relative_norm": 'relative_norm("inter")', "intra_relative_norm": 'relative_norm("intra")',
    "inter_cosine": 'cosine("inter")', "intra_cosine": 'cosine("intra")',
    "inter_value_weighted_normalized": 'value_weighted_output_normalized("inter")',
    "intra_value_weighted_normalized": 'value_weighted_output_normalized("intra")',
}
_WARNED: set[str] = set()


def _deprecated(name: str, replacement: str, where: str = "d[layer]", stacklevel: int = 3) -> None:
    """One DeprecationWarning per old spelling and process."""
    if name in _WARNED:
        return
    _WARNED.add(name)
    warnings.warn(f"{where}.{name} is deprecated: use d[layer].{replacement}, the one spelling of this tensor",
                  DeprecationWarning, stacklevel=stacklevel)


class LayerDecomposition:
    """The decomposition of one attention layer. All tensors are in the compute dtype."""

    #: why the block returned another tensor than its output projection's result (a hook on the block, a step after
    #: W_O), else None: the decomposition of the projection's output holds, the block's residual update is another
    changed_output: str | None = None

    def __init__(
        self,
        layer: int,
        geometry: HeadSpaceGeometry,
        output_bias: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        block_name: str | None = None,
        map_scale: torch.Tensor | None = None,
    ):
        self.layer = layer
        #: ``[batch, head, query]`` or None: the scale a learned sink applies to the output of a model whose own
        #: maps exclude the sink (Granite SWA); :attr:`attention` divides by it to return the model's maps
        self.map_scale = map_scale
        #: the attention module this layer number refers to, e.g. ``"model.layers.3.self_attn"``
        self.block_name = block_name
        self.geometry = geometry
        self.output_bias = output_bias
        self.key_valid = key_valid
        self._views: dict[str, weakref.ref] = {}

    @classmethod
    def from_call(cls, call: LayerCall) -> "LayerDecomposition":
        """The decomposition of the layer an observer or transform sees (see :class:`~cwcore.core.attention.LayerCall`)."""
        _, bias = call.output_projection()
        # a copy, as W_O is: the result must not change when the user edits the live bias afterwards
        bias = None if bias is None else bias.detach().to(call.compute_dtype, copy=True)
        scale = None
        if getattr(call, "sink_scales_output", False) and call.learned_sink_mass is not None:
            scale = (1 - call.learned_sink_mass.detach()).to(call.compute_dtype)
        return cls(call.layer, call.geometry(), bias, key_valid=call.key_valid, block_name=call.block.name,
                   map_scale=scale)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_views": {}}  # weak references do not pickle (and hold nothing)

    def __repr__(self) -> str:
        b, h, q, k = self.attention.shape
        where = f", block={self.block_name!r}" if self.block_name else ""
        return f"LayerDecomposition(layer={self.layer}{where}, batch={b}, heads={h}, queries={q}, keys={k})"

    # -- stored quantities -------------------------------------------------------------------------
    @property
    def attention(self) -> torch.Tensor:
        """The attention map the model applies ``[batch, head, query, key]``, as its eager forward returns it.

        Without learned sink logits it is alpha, the weight of key j in o_i = sum_j alpha_ij v~_j. With them
        (``s_aux``) it follows the model's own convention, measured from its eager attention: GPT-OSS returns the
        softmax over the keys and the sink with the sink's column dropped (alpha itself: a row sums to one minus
        the mass the sink absorbed); Granite SWA returns the softmax over the keys alone (rows sum to one) and
        applies its sink as a scale on the output, so there ``attention`` is alpha divided by that scale
        (:attr:`map_scale`), and the terms, ``value_weighted`` and the contribution weights use alpha.
        """
        if self.map_scale is None:
            return self.geometry.attention
        return self.geometry.attention / self.map_scale[..., None]

    @property
    def value_norm(self) -> torch.Tensor:
        """||v~_j|| ``[batch, head, key]``."""
        return self.geometry.value_norm

    @property
    def head_output_norm(self) -> torch.Tensor:
        """||o^h_i|| ``[batch, head, query]``."""
        return self.geometry.head_output_norm

    @property
    def output_norm(self) -> torch.Tensor:
        """||o_i|| of the combined output without bias, ``[batch, query]``."""
        return self.geometry.output_norm

    # -- factors ----------------------------------------------------------------------------------
    # Each view below allocates exactly one [batch, head, query, key] tensor, its result: divisions act
    # on the per-query side before the attention-sized product, and products with alpha are in place.
    # With alpha (stored) that is at most two attention-sized tensors alive while a view is computed.
    def _norm(self, kind: str) -> torch.Tensor:
        """The output norm for ``kind``: ``[batch, head, query]`` (intra) or ``[batch, query]`` (inter)."""
        if kind == "intra":
            return self.head_output_norm
        if kind == "inter":
            return self.output_norm
        raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")

    @staticmethod
    def _per_query(norm: torch.Tensor, kind: str) -> torch.Tensor:
        """A ``_norm`` broadcastable to ``[batch, head, query, key]``."""
        return norm[..., None] if kind == "intra" else norm[:, None, :, None]

    def relative_norm(self, kind: str = "inter") -> torch.Tensor:
        """||v~_j|| / ||o_i|| ``[batch, head, query, key]``."""
        return _safe_divide(self.value_norm[:, :, None, :], self._per_query(self._norm(kind), kind))

    def cosine(self, kind: str = "inter") -> torch.Tensor:
        """cos(o_i, v~_j) ``[batch, head, query, key]`` (NaN where either norm is zero)."""
        norm = self._norm(kind)
        cosine = self.geometry.scaled_dot(kind, _nan_at_zero(norm))  # <o_i, v~_j> / ||o_i||
        return cosine.div_(_nan_at_zero(self.value_norm)[:, :, None, :])

    def contribution(self, kind: str = "inter") -> torch.Tensor:
        """c_ij = alpha_ij <o_i, v~_j> / ||o_i||^2 ``[batch, head, query, key]``."""
        norm = _nan_at_zero(self._norm(kind))  # the norm against ZERO_NORM, not its square (NaN below 1e-6)
        return self.geometry.weighted_dot(kind, norm * norm)

    def metric(self, name: str, kind: str = "inter") -> torch.Tensor:
        """One rung of the geometric ladder (:data:`METRICS`), ``[batch, head, query, key]``.

        ``kind`` picks the output that normalises: the head's own (``intra``) or the combined one
        (``inter``); it does not affect ``attention`` and ``value_weighted``, but is checked for them too (a
        typo such as ``"intre"`` passed without a word there).
        """
        if kind not in ("intra", "inter"):
            raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")
        if name == "attention":
            return self.attention
        if name == "value_weighted":
            return self.value_weighted
        if name == "value_weighted_output_normalized":
            return self.value_weighted.div_(self._per_query(_nan_at_zero(self._norm(kind)), kind))
        if name == "contribution":
            return self.contribution(kind)
        raise ValueError(f"unknown metric {name!r}; choose from {', '.join(METRICS)}")

    # -- named views (computed on demand) ------------------------------------------------------------
    def _remembered(self, name: str, compute) -> torch.Tensor:
        """``compute()``, or the tensor it returned last time while the caller still holds it: the
        decomposition itself keeps no view alive (a weak reference only), so memory holds alpha plus
        what the caller keeps."""
        held = self._views.get(name)
        value = None if held is None else held()
        if value is None:
            value = compute()
            self._views[name] = weakref.ref(value)
        return value

    # -- deprecated spellings: one tensor, one name (contribution(kind), relative_norm(kind), cosine(kind))
    @property
    def intra(self) -> torch.Tensor:
        """Deprecated: ``contribution("intra")`` (this alias keeps the tensor while the caller holds it)."""
        _deprecated("intra", 'contribution("intra")')
        return self._remembered("intra", lambda: self.contribution("intra"))

    @property
    def inter(self) -> torch.Tensor:
        """Deprecated: ``contribution("inter")`` (this alias keeps the tensor while the caller holds it)."""
        _deprecated("inter", 'contribution("inter")')
        return self._remembered("inter", lambda: self.contribution("inter"))

    @property
    def intra_relative_norm(self) -> torch.Tensor:
        _deprecated("intra_relative_norm", 'relative_norm("intra")')
        return self.relative_norm("intra")

    @property
    def inter_relative_norm(self) -> torch.Tensor:
        _deprecated("inter_relative_norm", 'relative_norm("inter")')
        return self.relative_norm("inter")

    @property
    def intra_cosine(self) -> torch.Tensor:
        _deprecated("intra_cosine", 'cosine("intra")')
        return self.cosine("intra")

    @property
    def inter_cosine(self) -> torch.Tensor:
        _deprecated("inter_cosine", 'cosine("inter")')
        return self.cosine("inter")

    @property
    def value_weighted(self) -> torch.Tensor:
        """alpha_ij ||v~_j|| (Kobayashi et al. 2020) ``[batch, head, query, key]``."""
        # padded keys have NaN norm but zero attention: they weigh zero; alpha, the terms' own weights
        return self.geometry.attention * self.value_norm.nan_to_num(0.0)[:, :, None, :]

    def value_weighted_output_normalized(self, kind: str = "inter") -> torch.Tensor:
        """alpha_ij ||v~_j|| / ||o_i|| ``[batch, head, query, key]`` (the ladder's third rung)."""
        return self.metric("value_weighted_output_normalized", kind)

    @property
    def intra_value_weighted_normalized(self) -> torch.Tensor:
        _deprecated("intra_value_weighted_normalized", 'value_weighted_output_normalized("intra")')
        return self.metric("value_weighted_output_normalized", "intra")

    @property
    def inter_value_weighted_normalized(self) -> torch.Tensor:
        _deprecated("inter_value_weighted_normalized", 'value_weighted_output_normalized("inter")')
        return self.metric("value_weighted_output_normalized", "inter")

    def token_level(self, name: str = "contribution", kind: str = "inter") -> torch.Tensor:
        """A head-aggregated ``[batch, query, key]`` view: attention is averaged over heads, every other
        metric summed (so inter-head contributions of a query sum to 1 over keys)."""
        values = self.metric(name, kind)
        return values.mean(1) if name == "attention" else values.sum(1)

    def to(self, *args, **kwargs) -> "LayerDecomposition":
        """Move every tensor (e.g. ``.to("cpu")``)."""
        moved = self.geometry.to(*args, **kwargs)
        bias = None if self.output_bias is None else self.output_bias.to(*args, **kwargs)
        valid = None if self.key_valid is None else self.key_valid.to(moved.attention.device)
        scale = None if self.map_scale is None else self.map_scale.to(*args, **kwargs)
        return LayerDecomposition(self.layer, moved, bias, valid, self.block_name, scale)


class LayerNotDecomposedError(KeyError):
    """``d[layer]`` for a layer the decomposition does not hold; the message says which it holds and why."""

    def __str__(self) -> str:  # KeyError would print the repr of its message, quotes and all
        return str(self.args[0]) if self.args else ""


#: the entry point that fills each kind of result -> the participle its messages use
_ENTRY_DONE = {"decompose": "decomposed", "summarize": "summarized", "attribute": "attributed"}


def _missing_layer(layer, layers, num_blocks: int | None, undecomposable: Mapping[int, str],
                   entry: str = "decompose") -> LayerNotDecomposedError:
    held = f"it holds layers {sorted(layers)}" if layers else "it holds no layer"
    if layer in undecomposable:
        return LayerNotDecomposedError(f"layer {layer} cannot be decomposed: {undecomposable[layer]}")
    if num_blocks is not None and not (isinstance(layer, int) and -num_blocks <= layer < num_blocks):
        return LayerNotDecomposedError(f"layer {layer!r} is out of range: the model has {num_blocks} attention layers "
                                       f"(0 to {num_blocks - 1}, or -1 for the last); {held}")
    return LayerNotDecomposedError(f"layer {layer} was not {_ENTRY_DONE[entry]} ({held}); pass layers={layer} to "
                                   f"cwcore.{entry}")


def layer_by_number(held: Mapping[int, object], layer, num_blocks: int | None, undecomposable: Mapping[int, str],
                    entry: str = "decompose"):
    """``held[layer]`` for a layer number (negative numbers count from the last of ``num_blocks`` attention
    layers), or :class:`LayerNotDecomposedError` saying why that layer is not held. The one lookup of
    :class:`Decomposition`, :class:`cwcore.core.summary.Summary` and :class:`cwcore.attribution.Attribution`
    (``entry``: the function that made the result, named in the message)."""
    number = plain_integer(layer)
    if num_blocks is not None and isinstance(number, int) and -num_blocks <= number < 0:
        number = number + num_blocks
    found = held.get(number) if isinstance(number, int) else None
    if found is None:
        raise _missing_layer(number, held, num_blocks, undecomposable, entry)
    return found


class _FieldView(Mapping):
    """``d.<field>[layer]``: one field of every recorded layer, indexed by layer number."""

    def __init__(self, layers: dict[int, LayerDecomposition], field: str, owner: "Decomposition | None" = None):
        self._layers, self._field, self._owner = layers, field, owner

    def __getitem__(self, layer: int) -> torch.Tensor:
        if self._owner is not None:
            return getattr(self._owner[layer], self._field)
        layer = plain_integer(layer)
        if layer not in self._layers:
            raise _missing_layer(layer, self._layers, None, {})
        return getattr(self._layers[layer], self._field)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._layers))

    def __len__(self) -> int:
        return len(self._layers)


class Decomposition(Mapping):
    """The decomposition of a forward pass, a mapping from layer number to :class:`LayerDecomposition` (``d[layer]``,
    ``for layer in d``, ``d.items()``), as a :class:`~cwcore.core.summary.Summary` and an attribution are;
    ``d.<field>[layer]`` indexes one field by layer number, e.g. ``d.attention[3]``; contribution weights
    have one spelling, ``d[3].contribution("inter")`` (``d.inter[3]`` and ``d[3].inter`` are deprecated).

    ``outputs`` holds the model's own output of that forward pass (logits, hidden states, ...).
    ``num_blocks`` is the model's number of attention layers (negative layer numbers count from it, -1
    the last); ``undecomposable`` ``{layer: reason}`` lists the blocks cwcore numbers but cannot decompose.
    Asking for a layer the decomposition does not hold raises :class:`LayerNotDecomposedError` (a
    ``KeyError``) saying which layers it holds, or why that layer cannot be decomposed.
    """

    FIELDS = (
        "attention", "value_norm", "head_output_norm", "output_norm", "intra", "inter",
        "intra_relative_norm", "inter_relative_norm", "intra_cosine", "inter_cosine",
        "value_weighted", "intra_value_weighted_normalized", "inter_value_weighted_normalized",
        "output_bias",
    )

    def __init__(self, layers: dict[int, LayerDecomposition], outputs=None, attention_mask=None,
                 num_blocks: int | None = None, undecomposable: Mapping[int, str] | None = None,
                 input_ids: torch.Tensor | None = None, cross_attention: bool = False):
        self.layer_decompositions = dict(sorted(layers.items()))
        #: whether some layer's keys (or queries) are not input_ids': an encoder-decoder's decoder and
        #: cross-attention, a BERT-style decoder's cross-attention to ``encoder_hidden_states``
        self.cross_attention = cross_attention
        self.outputs = outputs
        self.attention_mask = attention_mask
        #: ``[batch, sequence]`` the token ids decomposed (None when the model was given embeddings)
        self.input_ids = input_ids
        self.num_blocks = num_blocks
        self.undecomposable = dict(undecomposable or {})

    @property
    def layers(self) -> list[int]:
        return list(self.layer_decompositions)

    def __getitem__(self, layer: int) -> LayerDecomposition:
        return layer_by_number(self.layer_decompositions, layer, self.num_blocks, self.undecomposable)

    def __iter__(self) -> Iterator[int]:
        """The layer numbers held, in order, as a summary and an attribution: ``for layer in d: d[layer]``."""
        return iter(self.layer_decompositions)

    def __len__(self) -> int:
        return len(self.layer_decompositions)

    def __getattr__(self, name: str):
        if name in Decomposition.FIELDS:
            if name in DEPRECATED_VIEWS:  # d.inter[layer]: the same key, so one warning whichever spelling came first
                _deprecated(name, DEPRECATED_VIEWS[name], where="d")
            return _FieldView(self.layer_decompositions, name, self)
        raise AttributeError(name)

    def to_frame(self, layers: int | Iterable[int] | None = None, heads: int | Iterable[int] | None = None,
                 kind: str = "inter", tokenizer=None):
        """A tidy table (pandas DataFrame): one row per (sequence, layer, head, query, key) term.

        Columns: ``sequence`` (row of the batch), ``layer``, ``head``, ``query``, ``key`` (positions
        among the sequence's real tokens, so a padded row reads like its unpadded sequence),
        ``query_token`` and ``key_token`` (with a ``tokenizer``: its ``convert_ids_to_tokens`` of the
        decomposed ids), ``attention`` (alpha_ij as the model applies it), ``relative_norm``
        (||v~_j|| / ||o_i||), ``cosine`` (cos(o_i, v~_j)) and ``contribution`` (c_ij), the last three
        normalised by the output of ``kind`` (``"inter"``: the combined output, ``"intra"``: the head's).
        Padded queries and keys have no rows; in a causal layer (all attention above the diagonal exactly
        zero) neither do the future keys. ``layers``/``heads``: a number, a list (each once; negative numbers
        count from the end), or None for all.
        """
        import pandas as pd

        chosen = self.layers if layers is None else (
            [plain_integer(layers)] if is_integer_number(layers) else [plain_integer(x) for x in layers])
        input_ids = getattr(self, "input_ids", None)  # a decomposition pickled before it held them has none
        # the rows would be read with input_ids' mask and tokens (an older pickle names the flag encoder_decoder)
        if getattr(self, "cross_attention", getattr(self, "encoder_decoder", False)):
            raise ValueError("to_frame: this decomposition is of a model with cross-attention (an encoder-decoder, or "
                             "a decoder reading encoder_hidden_states), whose layers have other queries, keys and "
                             "padding than input_ids and its attention mask; read its layers as tensors "
                             "(d[layer].contribution(), [batch, head, query, key])")
        if tokenizer is not None and input_ids is None:
            raise ValueError("to_frame: this decomposition holds no input_ids (the model was given embeddings), "
                             "so it has no tokens to name")
        frames = []
        # negative numbers count from the end, as self[layer] reads them: each layer once, under its own number
        for layer in dict.fromkeys(self[number].layer for number in chosen):
            ld = self[layer]
            b, h, q, k = ld.attention.shape
            if q != k:
                raise ValueError(f"to_frame: layer {layer} has {q} queries and {k} keys (a cache); decompose the "
                                 "whole sequence to tabulate it")
            picked = list(range(h)) if heads is None else [
                plain_integer(x) for x in ([heads] if is_integer_number(heads) else heads)]
            bad = [x for x in picked if not (isinstance(x, int) and not isinstance(x, bool) and -h <= x < h)]
            if bad:
                raise ValueError(f"to_frame: heads {bad} are out of range: layer {layer} has {h} heads (0 to {h - 1}, "
                                 "or -1 for the last)")
            # negative heads count from the end, as layers do; each head once (heads=[0, 0] doubled every row)
            picked = list(dict.fromkeys(x % h for x in picked))
            index = torch.tensor(picked, dtype=torch.long, device=ld.attention.device)
            valid = self._valid_tokens(ld, b, k)
            pairs = valid[:, :, None] & valid[:, None, :]
            attention = ld.attention
            if bool((attention.nan_to_num(0.0).triu(1) == 0).all()):  # a causal layer: future keys are no terms
                pairs = pairs & torch.ones(q, k, dtype=torch.bool, device=pairs.device).tril()
            keep = pairs[:, None].expand(b, len(picked), q, k)
            rows, head, query, key = keep.nonzero(as_tuple=True)
            position = (valid.long().cumsum(-1) - 1)
            columns = {
                "sequence": rows.cpu().numpy(), "layer": layer, "head": index[head].cpu().numpy(),
                "query": position[rows, query].cpu().numpy(), "key": position[rows, key].cpu().numpy(),
            }
            if tokenizer is not None:
                ids = input_ids.to(rows.device)
                names = {int(t): tokenizer.convert_ids_to_tokens(int(t)) for t in ids.unique()}
                columns["query_token"] = [names[int(t)] for t in ids[rows, query]]
                columns["key_token"] = [names[int(t)] for t in ids[rows, key]]
            for name, values in (("attention", attention), ("relative_norm", ld.relative_norm(kind)),
                                 ("cosine", ld.cosine(kind)), ("contribution", ld.contribution(kind))):
                columns[name] = values[:, index][keep].cpu().numpy()
            frames.append(pd.DataFrame(columns))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def _valid_tokens(self, ld: LayerDecomposition, batch: int, length: int) -> torch.Tensor:
        """``[batch, length]`` bool: the real tokens (the attention mask's, else the layer's valid keys)."""
        device = ld.attention.device
        if self.attention_mask is not None and self.attention_mask.shape[-1] == length:
            return self.attention_mask.to(device).bool()
        if ld.key_valid is not None:
            return ld.key_valid.to(device).bool()
        return torch.ones(batch, length, dtype=torch.bool, device=device)

    def __repr__(self) -> str:
        skipped = f", undecomposable={sorted(self.undecomposable)}" if self.undecomposable else ""
        return f"Decomposition(layers={self.layers}{skipped})"


def _numbers_own_positions(model: nn.Module) -> bool:
    """Whether the model derives position ids from its input ids itself (RoBERTa's family numbers real
    tokens from ``padding_idx + 1`` and gives padding ``padding_idx``), so padding is already handled."""
    facts = model_facts(model)
    if "own_positions" not in facts:
        facts["own_positions"] = any(hasattr(type(m), "create_position_ids_from_input_ids") for m in model.modules())
    return facts["own_positions"]


#: Methods by which a multimodal model computes its own position ids in its own shape (multimodal RoPE:
#: ``[3, batch, sequence]`` temporal/height/width ids for image and video tokens), reading the attention
#: mask itself, so that a padded row keeps the positions of its unpadded sequence.
OWN_POSITION_METHODS = ("get_rope_index", "compute_3d_position_ids")
#: Inputs that hold text only (tokens, their mask and types): with anything else (pixels, image grids), a
#: model with one of :data:`OWN_POSITION_METHODS` computes positions that plain 2-D ids cannot express.
TEXT_INPUTS = {"input_ids", "attention_mask", "inputs_embeds", "token_type_ids", "labels", "past_key_values",
               "cache", "use_cache", "logits_to_keep", "output_attentions", "output_hidden_states", "return_dict"}


def _computes_multimodal_positions(model: nn.Module, inputs: dict) -> bool:
    """Whether the model computes its own positions for these inputs in another shape than ``[batch,
    sequence]`` (see :data:`OWN_POSITION_METHODS`): they carry more than text."""
    if not any(value is not None for name, value in inputs.items() if name not in TEXT_INPUTS):
        return False
    return any(callable(getattr(m, name, None)) for m in model.modules() for name in OWN_POSITION_METHODS)


def prepare_inputs(model: nn.Module, inputs: dict) -> dict:
    """Add ``position_ids`` consistent with left padding when the model needs them.

    transformers numbers positions 0..n-1 regardless of padding; with left padding that shifts every
    real token's position. Counting only real tokens makes a padded row equal its unpadded sequence,
    for every supported family. Only left-padded rows are renumbered: a row that starts with a real token
    keeps 0..n-1 (a hole in its mask included), the positions it gets alone. Models that take no
    ``position_ids``, models that number positions from the ids themselves (RoBERTa and its relatives) and
    multimodal models that compute their own positions from the mask in their own shape (multimodal RoPE, on
    inputs with images or videos) are left alone: cwcore never replaces a model's own positions.
    """
    mask = inputs.get("attention_mask")
    if mask is None or "position_ids" in inputs or bool(mask[:, 0].all()):
        return inputs
    if "position_ids" not in inspect.signature(model.forward).parameters or _numbers_own_positions(model):
        return inputs
    if _computes_multimodal_positions(model, inputs):
        return inputs
    counted = (mask.long().cumsum(-1) - 1).clamp_min(0)
    own = torch.arange(mask.shape[1], device=mask.device).expand_as(counted)
    # only left-padded rows are renumbered: a row that starts with a real token keeps the model's own 0..n-1 (a
    # hole in its mask included), so each row's positions are those it gets alone, whatever its neighbours
    positions = torch.where(mask[:, :1].bool(), own, counted)
    reference = inputs.get("input_ids", inputs.get("inputs_embeds"))
    if reference is not None and positions.shape[1] > reference.shape[1]:  # a cache holds the first tokens
        positions = positions[:, -reference.shape[1]:]
    return {**inputs, "position_ids": positions}


def select_layers(model: nn.Module, layers, caller: str, done: str = "decomposed"):
    """The layers one call runs: ``(model, blocks, wanted, undecomposable)``.

    ``model`` unwrapped from ``torch.compile`` and checked to hold its weights; ``layers=None``: every
    block cwcore can decompose, the others named in one warning; a block asked for by number that cwcore
    cannot decompose is refused with its reason, and so is a model with no such block. ``undecomposable``
    is ``{layer: reason}``. The one entry check of :func:`decompose`, :func:`cwcore.summarize` and
    :func:`cwcore.attribute` (``caller``; ``done``: the participle its warning uses)."""
    model = unwrap_compiled(model)
    check_materialised(model, caller)
    blocks = attention_blocks(model)
    undecomposable = {b.layer: b.unsupported for b in blocks if b.unsupported is not None}
    if isinstance(layers, str) and not layers.strip().lstrip("-").isdigit():  # decompose(model, "some text")
        raise InputTypeError(f"layers must be a layer number, a list of layer numbers or None, got {_shown(layers)}; "
                             f"text is tokenized first: cwcore.{caller}(model, **tokenizer(text, return_tensors='pt'))")
    # an explicit empty list asks for nothing: bad input, not a model cwcore cannot decompose
    wanted = check_layers(layers, len(blocks), allow_empty=False)
    if layers is None and undecomposable:
        wanted = [layer for layer in wanted if layer not in undecomposable]
        warnings.warn(f"cwcore.{caller}: " + "; ".join(
            f"layer {b.layer} ({b.name!r}, {type(b.module).__name__}) is not {done}: {b.unsupported}"
            for b in blocks if b.layer in undecomposable), stacklevel=3)
    for layer in wanted:
        blocks[layer].refuse_if_unsupported()
    if not wanted:
        raise UnsupportedModelError(f"{type(model).__name__}: no attention layer can be {done} ("
                                    + "; ".join(undecomposable.values()) + ")")
    return model, blocks, wanted, undecomposable


def layers_not_run(blocks, wanted, done: Iterable[int], layers, caller: str,
                   participle: str = "decomposed") -> dict[int, str]:
    """``{layer: reason}`` for the ``wanted`` blocks that never ran in the forward (every block that ran was
    checked by the session's hooks). Asked for by number, they are refused; with ``layers=None`` (every layer
    of this forward) they are named in one warning: a cross-attention block given no encoder states, an
    image model's cross-attention given no image, is not part of the computation."""
    missing = sorted(set(wanted) - set(done))
    if not missing:
        return {}
    names = ", ".join(blocks[layer].name for layer in missing)
    if layers is not None or not set(done):
        raise UnsupportedModelError(f"attention layers {missing} ({names}) did not run in the forward pass, so "
                                    f"cwcore could not {caller} them")
    warnings.warn(f"cwcore.{caller}: attention layers {missing} ({names}) did not run in this forward pass (e.g. "
                  f"cross-attention given no encoder states), so they are not {participle}", stacklevel=3)
    return {layer: "it did not run in this forward pass" for layer in missing}


def positional_inputs(model, layers, inputs: dict, caller: str, options: Iterable[str] = ()) -> tuple:
    """``(model, layers, inputs)`` of ``caller(model, ...)``, whose first two parameters are positional only so that
    the second may hold the layers or the inputs as one mapping: ``caller(model, enc)`` is ``caller(model, **enc)``
    with every layer, and ``caller(model, enc, layers=[2])`` chooses them; ``model=`` and ``layers=`` given by keyword
    arrive among ``inputs`` and are taken from there (``layers=enc``, a mapping, is the inputs, as it always was). A
    tensor in the layers' slot, or the layers given twice, is refused in one sentence; so is a keyword beside the
    mapping that the model does not take (``layer=[2]``: did you mean one of the caller's ``options``?)."""
    if model is None and "model" in inputs:
        model = inputs.pop("model")
    if model is None:
        raise InputTypeError(f"{caller}() needs the model: {caller}(model, **inputs)")
    chosen = inputs.pop("layers") if "layers" in inputs else None
    if isinstance(chosen, Mapping) and not isinstance(chosen, (str, bytes)) and layers is None:
        layers, chosen = chosen, None  # decompose(model, layers=enc)
    if isinstance(layers, Mapping) and not isinstance(layers, (str, bytes)):  # decompose(model, enc)
        if inputs:
            refuse_unknown_inputs(model, inputs, caller, options)  # a misspelt option is not a second set of inputs
            raise InputError(f"{caller}: give the inputs once, either as one mapping ({caller}(model, enc)) or "
                             f"as keywords ({caller}(model, **enc))")
        return model, chosen, dict(layers)
    if chosen is not None:
        if layers is not None:
            raise InputError(f"{caller}: layers given twice, as the second positional argument ({layers!r}) and as "
                             f"layers={chosen!r}; give one")
        layers = chosen
    if isinstance(layers, torch.Tensor) and layers.ndim >= 1 and not inputs:
        raise InputError(f"{caller}(model, tensor): the second positional argument is layers; pass token ids as "
                         f"{caller}(model, input_ids=tensor)")
    return model, layers, inputs


def decompose(
    model: nn.Module | None = None,
    layers: int | Iterable[int] | None = None,
    /,
    compute_dtype: torch.dtype | None = None,
    truncate: bool = False,
    **inputs,
) -> Decomposition:
    """Decompose every requested layer's attention output into projected value vectors.

    ``inputs`` are the model's usual forward arguments (``input_ids`` ``[batch, sequence]`` integer
    ids, or one sequence ``[sequence]`` promoted to a batch of one; ``attention_mask`` of the same
    shape; ``pixel_values``, ...); unknown keywords, out-of-vocabulary ids and inputs longer than the
    model's context raise at once. ``layers`` is a layer number, a list of them, or None for all;
    layer numbers count the model's softmax-attention blocks in forward order (in a hybrid model the
    state-space or linear-attention layers are not numbered; ``d[l].block_name`` and
    :func:`cwcore.core.architectures.attention_blocks` say which module each number is);
    ``compute_dtype`` is ``torch.float32``/``torch.float64`` or its name (default: float64 for a float64
    model, float32 otherwise). A block cwcore numbers but cannot decompose (``nn.MultiheadAttention``,
    or a block whose output projection no finder locates) is refused with its reason when asked for; with
    ``layers=None`` it is skipped with a warning, and listed in ``d.undecomposable``. An input longer than the
    model's context is refused unless ``truncate=True``, which keeps its first tokens.
    The model runs as usual (same outputs as its eager attention); the geometry is computed in
    ``compute_dtype`` (float32 or float64) whatever the model's dtype. A ``torch.compile``'d model is
    decomposed through the module it wraps (the same weights, run eagerly). A layer whose block returns another
    tensor than its output projection's result (a hook on the block, a step after W_O) is still the exact
    decomposition of the projection's output; ``d[l].changed_output`` then says so, with the measured difference,
    and the methods that model the block's residual update (ALTI, the direct logit attribution) refuse it.

    The inputs may also come as one mapping in place of ``layers``: ``decompose(model, enc)`` with ``enc``
    a tokenizer's ``BatchEncoding`` or a dict is ``decompose(model, **enc)``, and ``decompose(model, enc,
    layers=[2])`` chooses the layers.

    **Padding.** Rows of padded queries are NaN in every ``[batch, head, query, key]`` quantity (attention,
    contribution weights, cosines): a padded position has no output to decompose. Padded keys get zero
    attention and zero weight. A plain ``.sum()`` over a padded batch is therefore NaN; reduce over the
    real tokens, e.g. ``d[l].contribution("inter").nansum(-1)`` or
    ``w[mask[:, None, :, None].expand_as(w).bool()].sum()`` with ``mask = enc["attention_mask"]``.
    A left-padded batch given without ``position_ids`` runs with position ids that count its real tokens, as
    ``generate`` does (:func:`prepare_inputs`), so each row equals its unpadded sequence; on a model with
    absolute positions (GPT-2) that differs from ``model(**enc)``, whose positions count the padding too. Pass
    ``position_ids`` to choose them; models that number positions themselves are never given any.
    With a key/value cache (``cache=``) the key axis is what each layer attends to, cached and new tokens; a
    sliding-window layer's cache keeps only its last ones, so its key ``j`` is position ``total - keys + j``.
    """
    model, layers, inputs = positional_inputs(model, layers, inputs, "decompose", own_options(decompose))
    model, blocks, wanted, undecomposable = select_layers(model, layers, "decompose")
    num_layers = len(blocks)
    compute_dtype = default_compute_dtype(model) if compute_dtype is None else check_compute_dtype(compute_dtype)
    inputs = prepare_inputs(model, check_inputs(model, inputs, caller="decompose", truncate=truncate,
                                               options=own_options(decompose)))
    recorded: dict[int, LayerDecomposition] = {}

    def record(call: LayerCall) -> None:
        recorded[call.layer] = LayerDecomposition.from_call(call)

    session = AttentionSession(model, observers={layer: [record] for layer in wanted}, compute_dtype=compute_dtype)
    decoder_mask = inputs.get("decoder_attention_mask")  # an encoder-decoder's padded decoder tokens: their cross-
    if isinstance(decoder_mask, torch.Tensor) and decoder_mask.dim() == 2:  # attention rows are padded queries too
        session.decoder_query_valid = decoder_mask.bool()
    with torch.inference_mode(), cwcore_attention(model, session):
        outputs = model(**inputs)
        for layer, why in session.changed_outputs.items():
            if layer in recorded:
                recorded[layer].changed_output = why
    undecomposable = {**undecomposable, **layers_not_run(blocks, wanted, recorded, layers, "decompose")}
    return Decomposition(recorded, outputs, inputs.get("attention_mask"), num_blocks=num_layers,
                         undecomposable=undecomposable, input_ids=inputs.get("input_ids"),
                         cross_attention=has_cross_attention(model))
