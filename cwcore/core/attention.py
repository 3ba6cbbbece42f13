"""One attention function for measurement and intervention, plugged in through transformers' interface.

:func:`attention_forward` follows the eager implementation's arithmetic exactly (same matmul, mask addition and
float32 softmax), so a model configured ``eager`` gives the same outputs through it. A model configured for SDPA keeps
its own SDPA forward, whatever layers a session asks for: layers the session does not touch run SDPA; a layer it only
observes computes cwcore's arithmetic for its decomposition and returns the model's own SDPA output for the same call
to the forward, once cwcore's output reproduces it within :data:`RECONSTRUCTION_TOLERANCE` (a layer whose SDPA and
eager attention differ beyond that is refused with the measured difference); a layer a transform changes returns
cwcore's output (an intervention is meant to change the forward). There cwcore's softmax is computed a block of
queries at a time (:func:`_probs_in_chunks`: the same values to float32 rounding, without attention-sized temporaries,
skipping keys that a causal mask hides from a whole block). While an :class:`AttentionSession` is active, each
attention layer's post-softmax probabilities pass through the session's *transforms* (which may change them, e.g. zero
terms alpha^h_ij v~^h_j without renormalising) and are then shown to its *observers* (which read them, e.g. to record
the layer's decomposition or collect sink statistics). Measurement, intervention and the sink analyses all plug in
there; nobody subclasses the session. The matching mask function is registered under the same name; without it
transformers would build no causal mask at all.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

from .thread_state import LOCAL as _LOCAL, SWITCHED as _SWITCHED, attention_configs, holding, outside, outside_sessions
from .architectures import AttentionBlock, UnsupportedModelError, attention_blocks, decomposable_layers
from .attention_features import (FAST_IMPLEMENTATIONS, HANDLED_KEYWORDS, block_label, changed_output, fast_path,
                                 maps_exclude_the_sink, refuse_nested, refuse_training, refuse_unknown_features,
                                 refuse_unverified_implementation, repeated_calls_reason)
from .blockwise import (_bias_mask, _causal_mask, _chunkable, _probs_in_chunks, adoptable_own_output,
                        adopted_own_output)
from .geometry import all_finite, full_check, output_difference, projected_check as _projected_check
from .layer_call import LayerCall, Observer, Transform

__all__ = ["ATTENTION_NAME", "RECONSTRUCTION_TOLERANCE", "AttentionSession", "attention_forward", "cwcore_attention",
           "every_layer", "default_compute_dtype", "outside_sessions", "HANDLED_KEYWORDS"]

ATTENTION_NAME = "cwcore"

#: Arguments of an attention block's forward that carry another sequence's states (cross-attention: an
#: encoder's, an image's); a call that receives one attends to that sequence, not to its own queries.
CROSS_INPUTS = ("key_value_states", "encoder_hidden_states", "cross_attention_states", "encoder_outputs")


def _sessions() -> list["AttentionSession"]:
    """This thread's active sessions, innermost last."""
    stack = getattr(_LOCAL, "sessions", None)
    if stack is None:
        stack = _LOCAL.sessions = []
    return stack


def _session_for(module: nn.Module) -> "AttentionSession | None":
    """The innermost of this thread's sessions that numbers ``module``, else the innermost one, else None."""
    if outside(module):
        return None
    stack = _sessions()
    for session in reversed(stack):
        if id(module) in session._by_module:
            return session
    return stack[-1] if stack else None


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
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention with cwcore's measurement and intervention points.

    query ``[batch, head, query, dim]``, key/value ``[batch, kv_head, key, dim]``.
    Returns (output ``[batch, query, head, dim]``, probabilities ``[batch, head, query, key]``).
    A half-precision model configured for SDPA: SDPA takes the scores, softmax and sums in float32, eager rounds
    the scores to the model's dtype first (alpha moves by up to ``|score| x 2^-9`` in bfloat16), so cwcore follows
    SDPA: what it decomposes is what the model computed. SDPA's kernel still rounds where cwcore's float32 sums do
    not (1 unit in the last place of about a fifth of the entries), so a layer a transform changes returns the
    model's own output plus the change: an empty change is the clean forward to the last bit.
    Learned sink logits (``s_aux``, one per head, as in GPT-OSS) join the softmax's normaliser as an
    extra column that is then dropped, exactly as the model's eager attention does: alpha excludes
    them, and the mass they absorb is :attr:`LayerCall.learned_sink_mass`.
    """
    session = _session_for(module)
    own = None if session is not None else _SWITCHED.get(id(getattr(module, "config", None)))
    if own in FAST_IMPLEMENTATIONS:  # a forward no session sees (another thread's): the model's own function
        extra = {k: v for k, v in (("softcap", softcap), ("s_aux", s_aux)) if v is not None}
        return ALL_ATTENTION_FUNCTIONS[own](module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                            **extra, **kwargs)
    refuse_unknown_features(module, kwargs, has_sink_logits=s_aux is not None)
    if s_aux is not None and session is not None and session.configured in FAST_IMPLEMENTATIONS:
        # transformers' SDPA function silently drops sink logits: the model's own forward leaves them out, so no
        # arithmetic can match both that forward and the architecture
        raise UnsupportedModelError(
            f"{block_label(module)} passes learned sink logits (s_aux) to the model's configured "
            f"{session.configured!r} attention, which ignores them, so the model's own forward leaves its sinks out; "
            "load the model with attn_implementation='eager' to decompose what its architecture computes")
    models_own = None  # this call as the model's configured function computes it, where the forward gets that
    changed_own = None  # the same, for a half-precision layer a transform changes: its output plus the change
    model_dtype = query.dtype
    if session is not None and session.fast_path is not None:
        # the call's own arguments, bound now: the code below rebinds these names
        own_call = functools.partial(session.fast_path, module, query, key, value, attention_mask, scaling=scaling,
                                     dropout=dropout, softcap=softcap, **kwargs)
        if not session.transforms_module(module):
            models_own = own_call
            if not session.touches(module):
                return models_own()  # a layer nobody reads or changes runs the model's configured implementation
        elif query.dtype in HALF_PRECISION:
            changed_own = own_call
        if query.dtype in HALF_PRECISION:  # SDPA's precision (see the docstring)
            query, key, value = query.float(), key.float(), value.float()
    call_mask = attention_mask  # the mask the model built: padding is read from it, not from the bias
    groups = query.shape[1] // key.shape[1]
    unrepeated = (key.shape[1], key.shape[-1], value.shape[-1])  # kv heads, key and value head dims
    key = _repeat_heads(key, groups)
    value = _repeat_heads(value, groups)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    causal = kwargs.get("is_causal")
    if causal is None:  # SDPA's rule: the call's `is_causal` first (CLIP's text encoder passes True to modules that
        # say False), else the module's, else SDPA's default True where the None mask is SDPA's (fast path on)
        causal = getattr(module, "is_causal", session is not None and session.fast_path is not None)
    if session is not None and session.streams(module):
        # a session that computes this layer itself, a block of queries at a time (cwcore.summarize); the model's
        # own output first, which the session may adopt as z after checking it (then it is not compared again)
        own = None if models_own is None else models_own()[0]
        if own is not None:
            session.refuse_non_finite(module, own, call_mask, (query, key, value))  # its reason, before a comparison's
        # one query is never causally masked (SDPA's rule, as below): without a mask it sees every key of the cache
        stream_mask, stream_causal = attention_mask, bool(causal) and query.shape[2] > 1
        if kwargs.get("position_bias") is not None:  # T5's relative positions: one additive mask with the call's
            if stream_mask is None and stream_causal:
                stream_mask = session.causal_mask(query.shape[2], key.shape[2], query.device)
            stream_mask, stream_causal = _bias_mask(kwargs["position_bias"], stream_mask, key), False
        output, checked = session.streamed_output(module, query, key, value, stream_mask, scaling, stream_causal,
                                                  softcap, s_aux, own, groups=groups)
        output = output.transpose(1, 2).contiguous()
        if own is not None:
            output = own if checked else session.models_own_output(module, output, own, call_mask, key.shape[-2])
        else:
            session.refuse_non_finite(module, output, call_mask, (query, key, value))
        session.on_output(module, output)
        return output, None
    if attention_mask is None and causal and query.shape[2] > 1:
        # the SDPA-style mask skips a plain causal pattern (fast path on): rebuild it, as SDPA would apply it
        q_len, k_len = query.shape[2], key.shape[2]
        attention_mask = (_causal_mask(q_len, k_len, query.device) if session is None
                          else session.causal_mask(q_len, k_len, query.device))
    position_bias = kwargs.get("position_bias")  # T5's relative positions: additive on the scores, like a float mask
    sink_mass = mixed = spans = adopted = None
    if session is not None and session.blockwise and _chunkable(query, key, softcap, s_aux):
        # alpha V in the same pass unless a transform may change alpha afterwards, or the model's own output is
        # adopted as alpha V once checked (blockwise.adopted_own_output; the forward gets a copy, see below)
        adopted = adoptable_own_output(session, models_own, model_dtype, call_mask, query.shape, key.shape[2])
        scores_mask = attention_mask if position_bias is None else _bias_mask(position_bias, attention_mask, key)
        probs, mixed, spans = _probs_in_chunks(query, key, scores_mask, scaling, None if session.transforms_module(
            module) or adopted is not None else value, session.mask_plans)
        if adopted is not None:
            mixed = adopted_own_output(session, module, probs, value, adopted, call_mask, (query, key, value))
    else:
        probs = torch.matmul(query, key.transpose(2, 3)) * scaling  # scores; one name so they are freed early
        if softcap is not None:
            probs = torch.tanh(probs / softcap) * softcap
        if position_bias is not None:  # T5's eager order: scores + bias, then the mask
            probs = probs + position_bias
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                probs = probs.masked_fill(~attention_mask, torch.finfo(probs.dtype).min)
            else:
                probs = probs + attention_mask[..., : key.shape[-2]]
        if s_aux is not None:  # GPT-OSS's eager arithmetic, step for step
            sinks = s_aux.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
            combined = torch.cat([probs, sinks.to(probs.dtype)], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            combined = nn.functional.softmax(combined, dim=-1, dtype=combined.dtype)
            probs = combined[..., :-1].float()
            sink_mass = combined[..., -1].float()
            del combined
        else:
            probs = nn.functional.softmax(probs, dim=-1, dtype=torch.float32)
    computed = probs if changed_own is None else probs.clone()  # a transform may change probs in place
    if session is not None:
        sink_scales_output = s_aux is not None and maps_exclude_the_sink(module, query, *unrepeated, s_aux)
        probs = session.on_attention(module, probs, value, sink_mass, mixed, spans, call_mask, sink_scales_output)
    probs = probs.to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    output = session.computed_output(module, probs, value) if session is not None else None
    if output is None:
        output = mixed if mixed is not None and probs is computed else torch.matmul(probs, value)
    added = session.added_output(module) if session is not None else None
    if added is not None:  # a transform's stand-in for the terms it removed (LayerCall.added_output)
        output = output + added.to(output.dtype)
    output = output.transpose(1, 2)
    # a copy even where the transpose is one already (one query, one head): the output projection's input must
    # not share storage with the geometry a session keeps, or an in-place edit of it (a head ablation by a
    # pre-hook) would change both sides of the self-check alike
    output = output.clone(memory_format=torch.contiguous_format) if output.is_contiguous() else output.contiguous()
    if changed_own is not None:  # the model's own output plus the change (docstring)
        change = torch.matmul(probs - computed.to(probs.dtype), value)
        change = change if added is None else change + added.to(change.dtype)
        output = changed_own()[0].to(change.dtype) + change.transpose(1, 2)
    if models_own is not None and adopted is None:
        own = models_own()[0]
        session.refuse_non_finite(module, own, call_mask, (query, key, value))  # its reason, before the comparison's
        output = session.models_own_output(module, output, own, call_mask, key.shape[-2])
    elif session is not None and session.touches(module):
        session.refuse_non_finite(module, output, call_mask, (query, key, value))
    output = output.to(model_dtype)  # what the output projection receives
    if session is not None:
        session.on_output(module, output)
    # the model's own call returns no map where it is configured for SDPA: nor does this one (a layer a transform
    # changes included: `attentions` held those layers' maps alone, attentions[0] another layer's), so the forward's
    # outputs are the model's
    return output, None if session is not None and session.fast_path is not None else probs.to(model_dtype)


def attention_mask_function(*args, **kwargs):
    """The mask for cwcore's attention: eager's float mask, or SDPA's (boolean, or None for a plain causal
    pattern) while a session keeps a model's SDPA forward or computes layers itself (:func:`cwcore.summarize`)."""
    stack = _sessions()
    session = stack[-1] if stack and not outside(stack[-1].blocks[0].module) else None
    if session is not None and (session.fast_path is not None or session.streaming):
        return sdpa_mask(*args, **kwargs)
    return eager_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, attention_mask_function)


def _per_layer(mapping, num_layers: int, what: str) -> dict[int, list]:
    out: dict[int, list] = {}
    for layer, functions in dict(mapping or {}).items():
        if not 0 <= layer < num_layers:
            raise IndexError(f"{what} for layer {layer}: out of range, the model has {num_layers} attention layers")
        out[layer] = [functions] if callable(functions) else list(functions)
    return out


def every_layer(model: nn.Module, function, layers: Iterable[int] | None = None) -> dict[int, list]:
    """``{layer: [function]}`` for every decomposable attention layer of ``model`` (or the given ``layers``)."""
    chosen = decomposable_layers(model) if layers is None else layers
    return {layer: [function] for layer in chosen}


#: Relative error allowed between cwcore's terms (plus bias) and what the output projection returned,
#: by the model's dtype: summation order differs, and bf16/fp16 models round their own products.
RECONSTRUCTION_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
#: the dtypes whose eager attention rounds its scores more coarsely than a fast implementation (SDPA) computes them
HALF_PRECISION = (torch.float16, torch.bfloat16)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 if it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def default_compute_dtype(model: nn.Module) -> torch.dtype:
    """float64 for a float64 model (its own precision), float32 for every other dtype."""
    return torch.float64 if model_dtype(model) == torch.float64 else torch.float32


class AttentionSession:
    """What cwcore does inside the attention of one forward pass.

    transforms: ``{layer: [Transform, ...]}``, run in order; each may replace the probabilities.
    observers: ``{layer: [Observer, ...]}``, called after the transforms with the final probabilities.
    compute_dtype: the dtype of :meth:`LayerCall.geometry` (float32 or float64; None: the model's own for a
    float64 model, else float32).
    verify: check, in every forward and for every layer the session touches, that the block's output
    projection received exactly what cwcore's attention function returned (no gate or other step in
    between, and the block did run through cwcore's function) and, where the layer's geometry was
    computed, that the terms plus bias reproduce the projection's output within
    :data:`RECONSTRUCTION_TOLERANCE`. A failed check raises :class:`UnsupportedModelError`.
    allow_fast_path: when the model is configured for SDPA, the forward stays the model's SDPA forward:
    layers the session does not touch run SDPA, and a layer it only observes returns SDPA's output for the
    call, which cwcore's output must reproduce within :data:`RECONSTRUCTION_TOLERANCE` (with ``verify``; else
    the layer is refused, its SDPA and eager attention differing); transformed layers return cwcore's output.
    False: every layer returns cwcore's eager arithmetic (a forward the model configured for SDPA does not
    compute). A model with learned sink logits configured for SDPA is refused: SDPA drops them, so its
    forward is not its architecture's.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        observers: Mapping[int, Sequence[Observer] | Observer] | None = None,
        transforms: Mapping[int, Sequence[Transform] | Transform] | None = None,
        compute_dtype: torch.dtype | None = None,
        verify: bool = True,
        allow_fast_path: bool = True,
    ):
        self.model = model
        self.blocks = attention_blocks(model)
        self._by_module = {id(b.module): b for b in self.blocks}
        self.observers = _per_layer(observers, len(self.blocks), "observer")
        self.transforms = _per_layer(transforms, len(self.blocks), "transform")
        for layer in sorted(set(self.observers) | set(self.transforms)):
            self.blocks[layer].refuse_if_unsupported()  # before any forward pass
        self.compute_dtype = default_compute_dtype(model) if compute_dtype is None else compute_dtype
        self.verify = verify
        self.allow_fast_path = allow_fast_path
        self.fast_path = None  # set by cwcore_attention: the model's SDPA function, where it is configured for it
        self.configured = None  # the model's own attention implementation, set by cwcore_attention
        self.blockwise = False  # set by cwcore_attention: recorded layers use _probs_in_chunks
        self._touched_modules = {id(self.blocks[layer].module) for layer in self.layers}
        self._outputs: dict[int, torch.Tensor] = {}  # layer -> what attention_forward returned
        self._own_differences: dict[int, float] = {}  # layer -> cwcore's output against the model's own it returned
        self._calls: dict[int, LayerCall] = {}  # layer -> the call whose geometry was computed
        self._last_call: dict[int, LayerCall] = {}  # module id -> its call, until attention_forward's alpha @ V
        self._added: dict[int, torch.Tensor] = {}  # module id -> LayerCall.added_output, until attention_forward adds it
        self._runs: dict[int, int] = {}  # layer -> calls in the current forward
        self._in_block: dict[int, int] = {}  # layer -> attention calls in the block's current forward
        self._call_sizes: dict[int, list] = {}  # layer -> (queries, keys) of each call in the block's current forward
        self._block_tokens: dict[int, int | None] = {}  # layer -> tokens of the block's input in its current forward
        self._early: dict[int, bool] = {}  # layer -> its projection ran before its attention did
        self._depth: dict[int, int] = {}  # layer -> how many calls of the block are running (re-entrant)
        self._running: set[int] = set()  # ids of the model and backbone whose forward pass is running
        self._projected: dict[int, torch.Tensor] = {}  # layer -> its projection's result in the current forward
        self.changed_outputs: dict[int, str] = {}  # layer -> why its block returned another tensor (changed_output)
        self._hooks: list = []
        self.mask_plans: dict = {}  # the blockwise softmax's analysis of each mask (see _probs_in_chunks)
        self._causal_masks: dict = {}
        self._validity: dict = {}  # id(mask) -> (mask, key validity): every layer of a forward shares one mask
        self._cross: dict[int, bool] = {}  # layer -> whether its current call attends to another sequence
        #: ``[batch, decoder token]`` bool, False at a padded decoder token (the decoder_attention_mask a forward
        #: is given): the padding of a cross-attention call's queries, which that call's own mask cannot show
        self.decoder_query_valid: torch.Tensor | None = None

    @property
    def layers(self) -> set[int]:
        """The layers this session touches (observes or transforms)."""
        return set(self.observers) | set(self.transforms)

    def touches(self, module: nn.Module) -> bool:
        """Whether this attention module's layer is observed or transformed."""
        return id(module) in self._touched_modules

    def transforms_module(self, module: nn.Module) -> bool:
        """Whether a transform may change this attention module's probabilities."""
        block = self._by_module.get(id(module))
        return block is not None and bool(self.transforms.get(block.layer))

    def causal_mask(self, q_len: int, k_len: int, device) -> torch.Tensor:
        """A causal ``[query, key]`` bool mask, one object per shape for the session (so the blockwise
        softmax analyses it once, not in every layer)."""
        key = (q_len, k_len, str(device))
        if key not in self._causal_masks:
            self._causal_masks[key] = _causal_mask(q_len, k_len, device)
        return self._causal_masks[key]

    def mask_validity(self, attention_mask: torch.Tensor | None, batch: int, q_len: int,
                      k_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys [batch, key], rows [batch, query])`` bool from this call's own mask: False at a key that the
        mask hides from every query (padding, an empty cache slot), and at a query row that sees no key; None
        where the mask hides nothing. Read from the call, never matched to the user's mask by length (a text as
        long as an image's patches, a decoder as long as its encoder)."""
        if attention_mask is None:
            return None, None
        held = self._validity.get(id(attention_mask))
        if held is not None and held[0] is attention_mask and held[1] == (batch, q_len, k_len):
            return held[2]
        mask = attention_mask[..., :k_len]
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        keys = allowed.any(2).any(1).expand(batch, k_len)  # seen by some query of some head
        rows = allowed.any(3).any(1).expand(batch, q_len)  # sees some key in some head
        found = (None if bool(keys.all()) else keys.clone(), None if bool(rows.all()) else rows.clone())
        if len(self._validity) >= 4:
            self._validity.pop(next(iter(self._validity)))
        self._validity[id(attention_mask)] = (attention_mask, (batch, q_len, k_len), found)
        return found

    def call_validity(self, block: AttentionBlock, attention_mask: torch.Tensor | None, batch: int, q_len: int,
                      k_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys [batch, key], queries [batch, query])`` bool of one call of ``block`` (None: all real): its keys
        from :meth:`mask_validity`; its queries are its keys without a cache (query i is key i), the rows that see
        some key with one (left padding), and in cross-attention (whose mask describes the encoder's keys)
        :attr:`decoder_query_valid` where it describes exactly these queries (not a generation step's)."""
        key_valid, rows_valid = self.mask_validity(attention_mask, batch, q_len, k_len)
        if self._cross.get(block.layer):
            valid = self.decoder_query_valid
            return key_valid, (None if valid is None or tuple(valid.shape) != (batch, q_len) or bool(valid.all())
                               else valid)
        return key_valid, None if key_valid is None else key_valid if q_len == k_len else rows_valid

    def on_attention(self, module: nn.Module, probs: torch.Tensor, value: torch.Tensor,
                     learned_sink_mass: torch.Tensor | None = None, mixed: torch.Tensor | None = None,
                     key_spans=None, attention_mask: torch.Tensor | None = None,
                     sink_scales_output: bool = False) -> torch.Tensor:
        block = self._by_module.get(id(module))
        if block is None:
            return probs
        transforms = self.transforms.get(block.layer, ())
        observers = self.observers.get(block.layer, ())
        if not transforms and not observers:
            return probs
        if not self.count_call(block, (probs.shape[-2], probs.shape[-1])):
            return probs
        batch, heads, q_len, k_len = probs.shape
        self._refuse_unmatched_projection(block, heads, value.shape[-1])  # before any geometry is built
        key_valid, query_valid = self.call_validity(block, attention_mask, batch, q_len, k_len)
        call = LayerCall(block, probs, value, key_valid, self.compute_dtype, learned_sink_mass, mixed, key_spans,
                         query_valid)
        call.sink_scales_output = sink_scales_output
        for transform in transforms:
            new = transform(call)
            if new is not None:
                call.probs = new
        for observer in observers:
            observer(call)
        if call.added_output is not None:
            if call.geometry_computed:
                # the terms alpha_ij v~_j no longer sum to the head output: there is no decomposition to report
                raise UnsupportedModelError(
                    f"layer {block.layer}: a transform added stand-in values to the head outputs and an observer "
                    "then read the layer's decomposition, whose terms alpha_ij v~_j leave the stand-ins out; "
                    "cwcore does not decompose a layer with stand-in values (read it before the removal)")
            self._added[id(module)] = call.added_output
        if self.verify and call.geometry_computed:
            self._calls[block.layer] = call
        if call.geometry_computed:
            self._last_call[id(module)] = call
        return call.probs

    @staticmethod
    def _refuse_unmatched_projection(block: AttentionBlock, heads: int, head_dim: int) -> None:
        """Refuse, before any geometry, a W_O whose input width is not the attention output's heads x head_dim."""
        weight, _ = block.output_projection()
        if weight.dim() != 2 or weight.shape[1] != heads * head_dim:
            width = weight.shape[1] if weight.dim() == 2 else tuple(weight.shape)
            raise UnsupportedModelError(
                f"attention block {block.name!r}: `{block.output_module_name()}`, which cwcore took as its output "
                f"projection W_O ({block.projection_source()}), takes inputs of width {width}, but the attention output "
                f"has {heads} heads x {head_dim} = {heads * head_dim} values per token, so it is not one linear map of "
                "the attention output (the block transforms the head outputs first, e.g. a grouped low-rank "
                "projection); register the module that applies W_O with cwcore.register_output_projection")

    def count_call(self, block: AttentionBlock, sizes: tuple[int, int] | None = None) -> bool:
        """Count one attention call of a touched layer (with ``verify``; ``sizes``: its (query, key) lengths,
        recorded for the refusal's reason); False for a repeated call inside one forward of the block (counted
        to the end of the block, refused by the projection or block hook)."""
        if not self.verify:
            return True
        self._runs[block.layer] = runs = self._runs.get(block.layer, 0) + 1
        calls = self._in_block.get(block.layer)
        if calls is not None:
            self._in_block[block.layer] = calls = calls + 1
            if sizes is not None:
                self._call_sizes.setdefault(block.layer, []).append(tuple(sizes))
            if calls > 1:
                return False
        if runs > 1:
            raise UnsupportedModelError(
                f"attention block {block.name!r} ran {runs} times in one forward pass: its weights are shared "
                "across layers (as in ALBERT), and cwcore numbers layers by module, so it refuses rather than "
                "report one of the calls as the layer")
        return True

    #: whether this session computes some layers itself (:meth:`streamed_output`); those take SDPA's masks
    #: (boolean, or None for a plain causal pattern), never an eager float mask of [query, key]
    streaming = False

    def streams(self, module: nn.Module) -> bool:
        """Whether :meth:`streamed_output` computes this attention module's layer (never, here)."""
        return False

    def streamed_output(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float, causal: bool, softcap, s_aux,
                        own: torch.Tensor | None = None, groups: int = 1) -> tuple[torch.Tensor, bool]:
        """``(output, checked)`` for sessions that compute a layer themselves without a ``[batch, head, query,
        key]`` tensor (:class:`cwcore.core.summary.SummarySession`): the layer's ``alpha @ value`` ``[batch, head,
        query, dim]``, or, with ``checked``, the model's own output ``own`` (``[batch, query, head, dim]``, from
        its configured implementation, None on an eager model) as ``[batch, head, query, dim]``, adopted after
        the session checked its own alpha against it (:meth:`refuse_own_output` otherwise). ``key`` and ``value``
        come repeated to every query head; ``groups`` query heads share each of the model's key/value heads."""
        raise NotImplementedError

    def added_output(self, module: nn.Module) -> torch.Tensor | None:
        """What the transforms of this attention call added to its head outputs (:attr:`LayerCall.added_output`,
        ``[batch, head, query, dim]``), once; None where they added nothing."""
        return self._added.pop(id(module), None) if self._added else None

    def computed_output(self, module: nn.Module, probs: torch.Tensor, value: torch.Tensor) -> torch.Tensor | None:
        """The layer's ``probs @ value`` if an observer's geometry already computed it, else None."""
        call = self._last_call.pop(id(module), None) if self._last_call else None
        return None if call is None else call.layer_output(probs, value)

    def models_own_output(self, module: nn.Module, computed: torch.Tensor, own: torch.Tensor,
                          attention_mask: torch.Tensor | None, key_length: int) -> torch.Tensor:
        """What an observed layer of a model configured for a fast implementation (SDPA) returns to the forward:
        ``own`` ``[batch, query, head, dim]``, the model's own function's output for the call, so that the forward
        is the model's whatever layers are observed. With ``verify``, cwcore's output ``computed`` (same shape, the
        arithmetic its decomposition describes) must reproduce it on every query that sees a key, within
        :meth:`tolerance` (``max(abs(computed - own)) / max(abs(own))``), or the layer is refused."""
        if not self.verify:
            return own
        block = self._by_module[id(module)]
        _, rows = self.mask_validity(attention_mask, computed.shape[0], computed.shape[1], key_length)
        self.refuse_own_output(block, output_difference(computed, own, rows), own.dtype)
        return own

    def own_output_agrees(self, module: nn.Module, error: float, dtype: torch.dtype) -> bool:
        """Whether ``error`` (cwcore's output against the model's own for ``module``'s layer, relative to its largest
        entry) is within :meth:`tolerance` (False for NaN); recorded, so this forward's checks allow float32's."""
        layer = self._by_module[id(module)].layer
        self._own_differences[layer] = error
        return error <= self.tolerance(dtype, layer)

    def refuse_own_output(self, block: AttentionBlock, error: float, dtype: torch.dtype, measured: str = "") -> None:
        """Raise :class:`UnsupportedModelError` unless :meth:`own_output_agrees` (``measured``: how ``error`` was
        measured, if not entry by entry)."""
        if not self.own_output_agrees(block.module, error, dtype):
            allowed = self.tolerance(dtype, block.layer)
            # a half-precision layer is decomposed at SDPA's float32 precision (see cwcore_attention), not eager's
            arithmetic = ("eager arithmetic at float32 precision (as SDPA computes a half-precision model's attention) "
                          "that" if dtype in HALF_PRECISION else "eager arithmetic")
            raise UnsupportedModelError(
                f"attention block {block.name!r}: the model's configured {self.configured!r} attention and the "
                f"{arithmetic} cwcore decomposes give this layer different outputs (relative error {error:.3g} > "
                f"{allowed:g} for a {dtype} model{measured}): the model's {self.configured} and eager attention differ, "
                "so cwcore refuses to report a decomposition of a computation the model does not do; load the model "
                "with attn_implementation='eager' to decompose its eager attention")

    def tolerance(self, dtype: torch.dtype, layer: int) -> float:
        """The relative error allowed between cwcore's terms and a layer's output in ``dtype``: the coarser of
        the model's dtype and the compute dtype sets the rounding both sides can agree to; and where the layer
        returned the model's own (SDPA) output, at least float32's, the precision of cwcore's softmax (eager's,
        float32 even in a float64 model, whose SDPA computes it in float64: 3e-8 apart in the tests)."""
        allowed = max(RECONSTRUCTION_TOLERANCE.get(dtype, 3e-2), RECONSTRUCTION_TOLERANCE.get(self.compute_dtype, 3e-2))
        if layer in self._own_differences:
            allowed = max(allowed, RECONSTRUCTION_TOLERANCE[torch.float32])
        return allowed

    def refuse_non_finite(self, module: nn.Module, output: torch.Tensor, attention_mask: torch.Tensor | None,
                          inputs: Sequence[torch.Tensor]) -> None:
        """Raise :class:`UnsupportedModelError` if the attention output this call returns to the forward
        (``[batch, query, head, dim]``) holds NaN or inf on a query row that sees a key: its terms would be NaN,
        and the checks after it would blame a mismatch. Says whether the call's ``inputs`` (query, key, value)
        held NaN or inf already (an overflow upstream, as a float16 Gemma 3's residual stream) or only the output."""
        if all_finite(output):
            return
        _, rows = self.mask_validity(attention_mask, output.shape[0], output.shape[1], inputs[1].shape[-2])
        bad = ~torch.isfinite(output.detach()).flatten(2).all(-1)  # [batch, query]
        if rows is not None:
            bad &= rows.to(bad.device)
        count = int(bad.sum())
        if not count:
            return  # padding only: rows that see no key are no tokens
        block = self._by_module[id(module)]
        seen = output.shape[0] * output.shape[1] if rows is None else int(rows.sum())
        upstream = not all(all_finite(tensor) for tensor in inputs)
        where = ("its queries, keys or values held NaN or inf already, so the forward overflowed or failed before "
                 "this layer" if upstream else "its queries, keys and values were finite")
        hint = (f"; a {output.dtype} model whose activations outgrow the range of its dtype computes NaN and inf: "
                "load it in bfloat16 or float32" if output.dtype == torch.float16 else "")
        raise UnsupportedModelError(
            f"attention block {block.name!r}: the attention output of this layer holds NaN or inf on {count} of the "
            f"{seen} query rows that see a key ({where}){hint}; cwcore decomposes finite computations only")

    def on_output(self, module: nn.Module, output: torch.Tensor) -> None:
        """attention_forward's output ``[batch, query, head, dim]``, kept until the projection reads it."""
        if self.verify and self.touches(module):  # a set lookup: this runs for every attention call
            self._outputs[self._by_module[id(module)].layer] = output

    # -- verification: hooks on the output projections of the touched layers --------------------------
    def _elsewhere(self) -> bool:
        """A forward pass this session does not see: a probe (:func:`outside_sessions`), or another thread's."""
        return outside(self.blocks[0].module) or threading.get_ident() != self._thread

    def attach(self) -> None:
        """Install the hooks (done by :func:`cwcore_attention`): which sequence each touched block attends to,
        and the verification hooks. They see this thread's forward passes only."""
        self._thread = threading.get_ident()
        for layer in sorted(self.layers):
            block = self.blocks[layer]
            self._hooks.append(block.module.register_forward_pre_hook(self._note_sequence(block), with_kwargs=True))
        if not self.verify:
            return
        # a new forward pass (of the model or of its backbone, as the sink analyses call it) starts the
        # per-forward call counts afresh
        entries = {id(self.model): self.model}
        base = getattr(self.model, "base_model", None)
        if isinstance(base, nn.Module):
            entries[id(base)] = base
        for entry in entries.values():
            self._hooks.append(entry.register_forward_pre_hook(self._forward_starts))
            self._hooks.append(entry.register_forward_hook(self._forward_ends, always_call=True))
        for layer in sorted(self.layers):
            block = self.blocks[layer]
            projection = block.output_module()
            inside = projection is not None and any(m is projection for m in block.module.modules())
            self._hooks.append(block.module.register_forward_pre_hook(self._enter_block(block), with_kwargs=True))
            self._hooks.append(block.module.register_forward_hook(self._leave_block(block, inside)))
            if projection is None:
                raise UnsupportedModelError(
                    f"attention block {block.name!r}: the registered output projection is not a module of the "
                    "block, so cwcore cannot check that its decomposition reproduces the model; register a finder "
                    "that returns a module's own weight")
            self._hooks.append(projection.register_forward_pre_hook(self._check_input(block)))
            self._hooks.append(projection.register_forward_hook(self._check_output(block)))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._outputs.clear()
        self._own_differences.clear()
        self._calls.clear()
        self._last_call.clear()
        self._added.clear()
        self._runs.clear()
        self._in_block.clear()
        self._call_sizes.clear()
        self._block_tokens.clear()
        self._early.clear()
        self._depth.clear()
        self._running.clear()
        self._projected.clear()
        self.mask_plans.clear()
        self._causal_masks.clear()
        self._validity.clear()
        self._cross.clear()

    def _forward_starts(self, module: nn.Module, args) -> None:
        """A forward pass of the model (or its backbone) starts: its per-forward state afresh, also after a pass
        that failed half-way; a pass started inside another (a hook calling the model) is refused."""
        if self._elsewhere():
            return
        if id(module) in self._running:
            raise UnsupportedModelError(f"a forward pass of {type(module).__name__} started inside another of its "
                                        "forward passes (a hook that calls the model?): cwcore's session would mix the "
                                        "two passes; run the inner pass outside the cwcore call")
        if not self._running:
            refuse_training(self.model)  # model.train() inside an intervene block: the reason, not a failed check
            for state in (self._runs, self._in_block, self._call_sizes, self._block_tokens, self._early, self._depth,
                          self._last_call, self._added, self._projected):
                state.clear()
        self._running.add(id(module))

    def _forward_ends(self, module: nn.Module, args, output) -> None:
        if not self._elsewhere():
            self._running.discard(id(module))

    def _note_sequence(self, block: AttentionBlock):
        """Whether this call of the block attends to another sequence (an encoder's states, an image's):
        its mask then says nothing about the padding of its queries."""
        try:
            signature = inspect.signature(block.module.forward)
        except (TypeError, ValueError):
            signature = None

        def hook(module, args, kwargs):
            if self._elsewhere():
                return
            bound = dict(kwargs)
            if signature is not None and args:
                with contextlib.suppress(TypeError):
                    bound = {**signature.bind_partial(*args, **kwargs).arguments, **kwargs}
            self._cross[block.layer] = any(bound.get(name) is not None for name in CROSS_INPUTS)
        return hook

    def _enter_block(self, block: AttentionBlock):
        def hook(module, args, kwargs):
            if self._elsewhere():
                return
            self._depth[block.layer] = depth = self._depth.get(block.layer, 0) + 1
            if depth == 1:  # a call of the block from inside its own forward (an observer's) is not judged
                self._in_block[block.layer] = 0
                self._call_sizes[block.layer] = []
                hidden = next((a for a in (*args, kwargs.get("hidden_states")) if isinstance(a, torch.Tensor)), None)
                self._block_tokens[block.layer] = None if hidden is None or hidden.dim() < 2 else hidden.shape[-2]
        return hook

    def _refuse_repeated_calls(self, block: AttentionBlock) -> None:
        calls = self._in_block.get(block.layer) or 0
        if calls > 1:
            raise UnsupportedModelError(repeated_calls_reason(
                block, self._call_sizes.get(block.layer, []), self._block_tokens.get(block.layer)))

    def _leave_block(self, block: AttentionBlock, projection_inside: bool):
        def hook(module, args, result):
            if self._elsewhere():
                return
            self._depth[block.layer] = depth = self._depth.get(block.layer, 1) - 1
            if depth > 0:
                return
            early = self._early.pop(block.layer, False)
            if self._in_block.get(block.layer) == 0:
                raise UnsupportedModelError(
                    f"attention block {block.name!r} ({type(block.module).__name__}) did not run through cwcore's "
                    "attention function: it does not call transformers' attention interface, so cwcore cannot "
                    "decompose it")
            self._refuse_repeated_calls(block)
            self._in_block.pop(block.layer, None)
            if early or (projection_inside and block.layer in self._outputs):
                raise UnsupportedModelError(
                    f"attention block {block.name!r}: `{block.output_module_name()}`, which cwcore took as its output "
                    f"projection W_O ({block.projection_source()}), did not receive the attention output; register the "
                    "module that applies W_O with cwcore.register_output_projection")
            why = changed_output(block, result, self._projected.pop(block.layer, None))
            if why is not None:
                self.changed_outputs[block.layer] = why
        return hook

    def _check_input(self, block: AttentionBlock):
        def hook(projection, args):
            if self._elsewhere():
                return
            self._refuse_repeated_calls(block)
            received = args[0] if args else None
            produced = self._outputs.pop(block.layer, None)
            if produced is None and self._in_block.get(block.layer) == 0:
                self._early[block.layer] = True  # called before attention ran: judged when the block ends
                return
            if produced is None:
                raise UnsupportedModelError(
                    f"attention block {block.name!r} ({type(block.module).__name__}) did not run through cwcore's "
                    "attention function: it does not call transformers' attention interface, so cwcore cannot "
                    "decompose it")
            if received is None or received.numel() != produced.numel():
                raise UnsupportedModelError(
                    f"attention block {block.name!r}: its output projection received a tensor of another shape than "
                    f"the attention output ({None if received is None else tuple(received.shape)} vs "
                    f"{tuple(produced.shape)}); cwcore refuses to decompose it")
            expected = produced.reshape(received.shape)
            # NaN where both hold it is the same tensor (a padded row's, which refuse_non_finite lets through)
            if not (torch.equal(received, expected)
                    or bool(((received == expected) | (received.isnan() & expected.isnan())).all())):
                difference = float((received.float() - expected.float()).abs().max())
                raise UnsupportedModelError(
                    f"attention block {block.name!r}: the output projection received something other than the "
                    f"attention output (max |difference| {difference:.3g}) at `{block.output_module_name()}`: if that "
                    "module is not W_O, register the one that is with cwcore.register_output_projection; otherwise "
                    "the block transforms the head outputs "
                    "before W_O (an output gate, a norm, ...), which cwcore does not decompose: with a gate g_i the "
                    "term of key j becomes W_O^h (g_i * alpha_ij v_j), a projected value that depends on the query, so "
                    "value norms and the head-space inner products would need one matrix per query")
        return hook

    def _check_output(self, block: AttentionBlock):
        def hook(projection, args, result):
            if self._elsewhere():
                return
            output = result[0] if isinstance(result, tuple) else result
            self._projected[block.layer] = output  # for _leave_block, in every touched layer (a transformed one too)
            call = self._calls.pop(block.layer, None)
            if call is None:
                return
            geometry = call.geometry()
            _, bias = call.output_projection()
            allowed = self.tolerance(output.dtype, block.layer)
            own = self._own_differences.pop(block.layer, None)  # read for this forward's check only
            if (geometry.output_pending and call.owns_geometry and output.dtype == geometry.mixed.dtype
                    and output.numel() == geometry.mixed.shape[0] * geometry.mixed.shape[2] * geometry.w_o.shape[1]):
                # o_i is the projection's own result (less its bias), once its agreement with the terms is
                # verified: a second [query, head * head_dim] x W_O^T product only to compare would double it
                error, rows_finite, adopted = _projected_check(geometry, output, bias)
                if rows_finite and error <= allowed:
                    geometry.output = adopted
                    return
            # the entrywise comparison decides (and gives the refusal its exact error)
            error, rows_finite = full_check(call, geometry, output, bias)
            if not rows_finite or error > allowed:
                raise UnsupportedModelError(
                    f"attention block {block.name!r}: the terms alpha_ij v~_j plus the bias do not reproduce the "
                    f"output projection's result (relative error {error:.3g} > {allowed:g} for a {output.dtype} model "
                    f"decomposed in compute_dtype={self.compute_dtype})"
                    + ("" if own is None else
                       f"; the layer's output is the model's configured {self.configured!r} attention's, from which "
                       f"cwcore's eager arithmetic differs by {own:.3g} (relative)")
                    + "; cwcore refuses to report this decomposition")
        return hook


@contextlib.contextmanager
def cwcore_attention(model: nn.Module, session: AttentionSession | None = None) -> Iterator[AttentionSession | None]:
    """Route the model's attention through :func:`attention_forward` (and ``session``) inside the block.

    The session is this thread's; another thread entering the same model waits until this block ends
    (the attention implementation is a setting of the model, not of the thread). The previous attention
    implementation is restored on exit, also after an exception. A session on a model in ``train()`` mode
    is refused: dropout would make the forward differ from the model's computation at every call.
    """
    if session is not None:
        refuse_training(model)
        refuse_nested(type(model).__name__, [set(s._by_module) & set(session._by_module) for s in _sessions()])
    if session is None:
        with contextlib.suppress(UnsupportedModelError):
            attention_blocks(model)  # names the blocks, for the refusals attention_forward may raise
    configs = attention_configs(model)
    with holding(model, configs):
        if session is not None:
            try:
                session.attach()  # first: a model it refuses is left untouched
            except BaseException:
                session.detach()
                raise
        previous = [c._attn_implementation_internal if hasattr(c, "_attn_implementation_internal") else c._attn_implementation for c in configs]
        if session is not None:
            try:
                refuse_unverified_implementation(previous, type(session.model).__name__, session._by_module.values())
            except BaseException:
                session.detach()
                raise
            session.fast_path = fast_path(previous) if session.allow_fast_path else None
            # a model configured for SDPA does not compute eager's exact bits anyway: its recorded layers
            # may use the blockwise arithmetic (same values to float32 rounding, less memory, less work)
            names = {p for p in previous if p is not None}
            session.configured = next(iter(names)) if len(names) == 1 else None
            session.blockwise = session.configured in FAST_IMPLEMENTATIONS
        stack = _sessions()
        switched = [id(c) for c, p in zip(configs, previous) if id(c) not in _SWITCHED]  # the outermost block's
        try:
            for config, value in zip(configs, previous):
                _SWITCHED.setdefault(id(config), value)
                config._attn_implementation_internal = ATTENTION_NAME
            if session is not None:
                stack.append(session)
            yield session
        finally:
            if session is not None:
                if session in stack:
                    stack.remove(session)
                session.detach()
            for config, value in zip(configs, previous):
                config._attn_implementation_internal = value
            for key in switched:
                _SWITCHED.pop(key, None)
