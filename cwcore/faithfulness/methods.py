"""Attribution methods the faithfulness protocol can rank by: one registry, one function per method.

Every ranking the sweep uses is a *method*: a function called once per intervened layer as
``fn(layer_decomposition=<LayerDecomposition of that layer>, **context)`` that returns scores
``[batch, head, query, key]`` or token-level scores ``[batch, query, key]``. **Token-level scores are
spread over heads by giving every head of a key the same score**: under ``unit="head_key"`` the
ranking is then by token (the heads of one key are adjacent in the order, ties broken by head index),
under ``unit="token"`` it is the token ranking itself. Named methods live in one registry; adding one
is one function in this file (or anywhere)::

    @register_method("my_score", cost="no extra forward")
    def my_score(layer_decomposition, **context):
        return layer_decomposition.attention * layer_decomposition.value_norm[:, :, None]

``faithfulness_curve(..., metric="my_score")`` then ranks by it. A callable passed directly as
``metric=fn`` works the same way (its label is the function's name; its identity, see
:func:`method_key`, enters the cache keys).

Context keywords (a function may accept any of them by name, or ``**context``; more may be added):

``layer`` (int), ``call`` (:class:`cwcore.core.attention.LayerCall`: probabilities, values, block),
``model``, ``input_ids`` and ``attention_mask`` ``[rows, length]``, ``positions`` ``[rows, length]``
(token positions within each row's real tokens), ``groups`` ``[rows]`` (sequence or example ids),
``candidates`` ``[rows, 1, query, key]`` bool (the terms the protocol may remove), ``kind``
(``"inter"``/``"intra"``), ``seed``, ``state`` (a dict shared by the layers of one forward, cleared per
forward: e.g. a rollout product), and, for methods registered with ``needs``: ``block_input``
(``(args, kwargs)`` the decoder layer that holds the attention block received) and
``output_gradient`` (``[rows, length, model]``: d(total log-likelihood of the row's tokens) /
d(the attention block's output), from a separate clean forward and backward).

Built-in methods beyond the ladder, with their cost per batch (a forward = one model forward):

- ``value_zeroing`` (Mohebbi et al. 2023, adapted to decoders): token-level, all heads zeroed at once.
  Cost: per layer, the rest of the block (residual, norms, MLP) on one token per candidate pair
  (i, j), about Q/2 block-forwards of the batch per layer, i.e. ~Q/2 forwards.
- ``rollout`` (Abnar and Zuidema 2020) and ``contribution_rollout``: token-level, no extra forward.
- ``alti`` (Ferrando et al. 2022, adapted to RMSNorm decoders): token-level, no extra forward (a
  ``[rows, query, key, model]`` tensor per layer, in query chunks).
- ``grad_x_input``: per head, one extra forward and backward per batch (~3 forwards).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..core.architectures import UnsupportedModelError, attention_blocks
from ..core.decomposition import METRICS, LayerDecomposition, prepare_inputs
from .ranking import hashed_uniform

__all__ = [
    "Method", "register_method", "get_method", "available_methods", "method_key", "as_method",
    "precomputed", "ScoreContext", "scoring", "method_scores", "output_gradients", "BUILT_IN",
]

#: bytes of one chunk of model-space pair tensors (value zeroing, ALTI)
CHUNK_BYTES = 64 * 2 ** 20


@dataclass(frozen=True)
class Method:
    """A registered ranking: ``fn(layer_decomposition=..., **context)``; ``needs`` names the extra
    context it requires (``"block_input"``, ``"output_gradient"``, ``"earlier_layers"``: called on
    every layer up to the last intervened one, to build ``state``); ``cost`` documents its price;
    ``key`` identifies its code (the cache key of its curves)."""

    name: str
    fn: Callable = field(compare=False)
    needs: frozenset = frozenset()
    cost: str = ""
    key: str = ""
    kind_dependent: bool = False
    indexes_sequences: bool = False  # precomputed scores: rows are the sequences of faithfulness_curve


_REGISTRY: dict[str, Method] = {}
_NEEDS = ("block_input", "output_gradient", "earlier_layers")


def register_method(name: str, *, needs=(), cost: str = "", kind_dependent: bool = False):
    """Decorator: ``@register_method("name")`` makes ``metric="name"`` rank by the function."""
    unknown = set(needs) - set(_NEEDS)
    if unknown:
        raise ValueError(f"unknown needs {sorted(unknown)}; choose from {_NEEDS}")

    def add(fn: Callable) -> Callable:
        _REGISTRY[name] = Method(name, fn, frozenset(needs), cost, name, kind_dependent)
        fn.cwcore_needs = frozenset(needs)
        return fn

    return add


def get_method(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"unknown metric {name!r}; choose from {', '.join(available_methods())} (+ _intra/_inter)")
    return _REGISTRY[name]


def available_methods() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def _repr_digest(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        from ..runs import tensor_digest
        return tensor_digest(value.detach().cpu())
    if callable(value) and hasattr(value, "__code__"):
        return method_key(value)
    return repr(value)


def method_key(fn: Callable) -> str:
    """The identity of a callable: ``<qualified name>-<hash>`` of its source (or bytecode), constants,
    defaults and closure values. Two callables share a key only if that code and those values match;
    helpers it calls are not covered (pass ``cache=False`` while editing them)."""
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(fn).__name__)}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    digest = hashlib.sha256(name.encode())
    if code is None:  # a callable object: its class's source and its attributes
        target = type(fn)
        try:
            digest.update(inspect.getsource(target).encode())
        except (OSError, TypeError):
            digest.update(repr(vars(target)).encode())
        digest.update(_repr_digest(getattr(fn, "__dict__", {})).encode())
        return f"{name}-{digest.hexdigest()[:16]}"
    try:
        digest.update(inspect.getsource(target).encode())
    except (OSError, TypeError):
        pass
    digest.update(code.co_code)
    digest.update(repr(code.co_consts).encode())
    digest.update(repr(code.co_names).encode())
    for value in (target.__defaults__ or ()) + tuple((target.__kwdefaults__ or {}).items()):
        digest.update(_repr_digest(value).encode())
    for cell in target.__closure__ or ():
        try:
            digest.update(_repr_digest(cell.cell_contents).encode())
        except ValueError:  # an empty cell
            digest.update(b"<empty>")
    if hasattr(fn, "__self__"):
        digest.update(_repr_digest(getattr(fn.__self__, "__dict__", fn.__self__)).encode())
    return f"{name}-{digest.hexdigest()[:16]}"


def as_method(fn: Callable, label: str | None = None) -> Method:
    """A user's callable as a :class:`Method` (label: ``label`` or the function's name)."""
    name = label or getattr(fn, "__name__", type(fn).__name__)
    name = "lambda" if name == "<lambda>" else name
    key = hashlib.sha256(method_key(fn).encode()).hexdigest()[:16]
    from ..core.inputs import finite_scores  # a user's NaN/inf scores are refused at the layer they appear

    return Method(name, finite_scores(fn), frozenset(getattr(fn, "cwcore_needs", ())), "",
                  f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{key}")


def precomputed(scores, label: str = "precomputed") -> Method:
    """A :class:`Method` that reads precomputed scores (faithfulness_curve only: they index sequences).

    ``scores``: ``{layer: tensor}`` with tensors ``[n_sequences, head, length, length]`` (or token-level
    ``[n_sequences, length, length]``), or one tensor ``[layer, n_sequences, head, length, length]``
    (``[layer, n_sequences, length, length]``) whose first index is the layer number. Row s of a tensor
    is the s-th sequence given to :func:`faithfulness_curve`; query and key indices are token positions
    in that sequence (padding excluded), so ``length`` must reach the longest sequence.
    """
    from ..runs import tensor_digest

    if isinstance(scores, torch.Tensor):
        if scores.dim() not in (4, 5):
            raise ValueError(f"precomputed scores: a tensor must be [layer, n_sequences, (head,) length, length], "
                             f"got shape {tuple(scores.shape)}")
        scores = dict(enumerate(scores))
    if not isinstance(scores, Mapping) or not scores:
        raise ValueError("precomputed scores must be a tensor or a non-empty {layer: tensor} dict")
    tensors = {}
    for layer, value in scores.items():
        if not isinstance(layer, int) or not isinstance(value, torch.Tensor):
            raise ValueError(f"precomputed scores must map int layers to tensors, got {type(layer).__name__}: "
                             f"{type(value).__name__}")
        if value.dim() not in (3, 4) or value.shape[-1] != value.shape[-2]:
            raise ValueError(f"precomputed scores of layer {layer}: expected [n_sequences, (head,) length, length], "
                             f"got shape {tuple(value.shape)}")
        tensors[layer] = value.detach().float().cpu()

    def read(layer_decomposition, layer, groups, positions, **_):
        if layer not in tensors:
            raise ValueError(f"precomputed scores have no layer {layer} (they have {sorted(tensors)})")
        t = tensors[layer]
        if int(groups.max()) >= t.shape[0]:
            raise ValueError(f"precomputed scores of layer {layer} cover {t.shape[0]} sequences; sequence "
                             f"{int(groups.max())} was asked for")
        if int(positions.max()) >= t.shape[-1]:
            raise ValueError(f"precomputed scores of layer {layer} have length {t.shape[-1]}; a sequence has "
                             f"{int(positions.max()) + 1} tokens")
        g, p = groups.long(), positions.long()
        if t.dim() == 3:
            return t[g[:, None, None], p[:, :, None], p[:, None, :]]
        heads = torch.arange(t.shape[1])
        return t[g[:, None, None, None], heads[None, :, None, None], p[:, None, :, None], p[:, None, None, :]]

    read.__name__ = label
    key = f"precomputed-{tensor_digest({str(k): v for k, v in tensors.items()})}"
    return Method(label, read, frozenset(), "no extra forward", key, indexes_sequences=True)


# -- the per-forward context ------------------------------------------------------------------------
def _accepted(fn: Callable) -> set[str] | None:
    """Keyword names ``fn`` takes (None: it takes ``**kwargs``, so everything)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


class ScoreContext:
    """What a method sees besides the decomposition, for one forward of one batch."""

    def __init__(self, model, input_ids, attention_mask, *, groups=None, candidates=None, kind="inter", seed=0):
        self.model = model
        self.input_ids, self.attention_mask = input_ids, attention_mask
        self.positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        self.groups = torch.arange(input_ids.shape[0]) if groups is None else groups
        self.candidates = candidates or {}
        self.kind, self.seed = kind, seed
        self.importance = "signed"  # the sweep applies |.| for absolute importance
        self.state: dict = {}
        self.block_inputs: dict[int, tuple] = {}
        self.gradients: dict[int, torch.Tensor] = {}

    def scores(self, method: Method, layer_decomposition: LayerDecomposition, call=None, kind: str | None = None):
        """``[batch, head, query, key]`` scores of ``method`` for one layer (token-level ones spread)."""
        layer = layer_decomposition.layer
        context = dict(layer=layer, call=call, model=self.model, input_ids=self.input_ids,
                       attention_mask=self.attention_mask, positions=self.positions, groups=self.groups,
                       candidates=self.candidates.get(layer), kind=kind or self.kind, seed=self.seed,
                       state=self.state)
        if "block_input" in method.needs:
            context["block_input"] = self.block_inputs.get(layer)
        if "output_gradient" in method.needs:
            context["output_gradient"] = self.gradients.get(layer)
        accepted = _accepted(method.fn)
        if accepted is not None:
            context = {k: v for k, v in context.items() if k in accepted}
        values = method.fn(layer_decomposition=layer_decomposition, **context)
        return _spread(values, layer_decomposition.attention.shape, method.name, layer)


def _spread(values, shape, name: str, layer: int) -> torch.Tensor:
    b, h, q, k = shape
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"metric {name!r} returned {type(values).__name__} at layer {layer}, not a tensor")
    if values.dim() == 4 and values.shape[1] == 1 and tuple(values.shape[2:]) == (q, k) and values.shape[0] == b:
        values = values[:, 0]
    if values.dim() == 3 and tuple(values.shape) == (b, q, k):
        values = values[:, None].expand(b, h, q, k)
    elif values.dim() != 4 or tuple(values.shape) != (b, h, q, k):
        raise ValueError(f"metric {name!r} returned shape {tuple(values.shape)} at layer {layer}; expected "
                         f"[batch, head, query, key] = {(b, h, q, k)} or [batch, query, key] = {(b, q, k)}")
    return values if values.is_floating_point() else values.float()


def _parent(model: nn.Module, layer: int) -> nn.Module:
    block = attention_blocks(model)[layer]
    if block.parent is None or not any(child is block.module for child in block.parent.children()):
        raise UnsupportedModelError(f"attention block {block.name!r} has no enclosing decoder layer")
    return block.parent


@contextlib.contextmanager
def scoring(model, methods, input_ids, attention_mask, *, layers, groups=None, candidates=None, kind="inter",
            seed=0) -> Iterator[ScoreContext]:
    """A :class:`ScoreContext` for one forward: computes the gradients and installs the block-input
    hooks the ``methods`` need (removed on exit)."""
    context = ScoreContext(model, input_ids, attention_mask, groups=groups, candidates=candidates, kind=kind,
                           seed=seed)
    needs = set().union(*[m.needs for m in methods]) if methods else set()
    if "output_gradient" in needs:
        context.gradients = output_gradients(model, input_ids, attention_mask, layers)
    handles = []
    if "block_input" in needs:
        for layer in layers:
            def capture(module, args, kwargs, layer=layer):
                context.block_inputs[layer] = (args, kwargs)
                return None
            handles.append(_parent(model, layer).register_forward_pre_hook(capture, with_kwargs=True))
    try:
        yield context
    finally:
        for handle in handles:
            handle.remove()


def output_gradients(model, input_ids, attention_mask, layers) -> dict[int, torch.Tensor]:
    """``{layer: [rows, length, model]}``: the gradient of each row's summed next-token log-likelihood
    (real tokens only) with respect to each attention block's output (after its output projection and
    bias). One forward and one backward, outside inference mode; parameter gradients are not computed."""
    blocks = attention_blocks(model)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer in layers:
        module = blocks[layer].output_module()
        if module is None:
            raise UnsupportedModelError(f"grad_x_input: attention block {blocks[layer].name!r} has no output module")

        def hook(mod, args, output, layer=layer):
            out = output[0] if isinstance(output, tuple) else output
            if not out.requires_grad:
                out.requires_grad_(True)
            captured[layer] = out

        handles.append(module.register_forward_hook(hook))
    inputs = prepare_inputs(model, {"input_ids": input_ids, "attention_mask": attention_mask})
    try:
        with torch.inference_mode(False), torch.enable_grad():
            inputs = {k: v.clone() for k, v in inputs.items()}
            out = model(**inputs)
            logits = (out.logits if hasattr(out, "logits") else out[0]).float()
            mask = attention_mask.bool()
            valid = mask[:, :-1] & mask[:, 1:]
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, inputs["input_ids"][:, 1:, None])[..., 0]
            total = (logp * valid).sum()
            order = [layer for layer in layers if layer in captured]
            grads = torch.autograd.grad(total, [captured[layer] for layer in order], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: (torch.zeros_like(captured[layer]) if g is None else g).detach() for layer, g in zip(order, grads)}


def method_scores(model, metric, input_ids, attention_mask=None, *, layers=None, keep_first_token=True,
                  kind="inter", seed=0, compute_dtype=None) -> dict[int, torch.Tensor]:
    """``{layer: [batch, head, query, key]}`` scores of one method on one batch (a named method or a
    callable), computed exactly as the faithfulness sweep computes them in its clean pass.
    ``compute_dtype``: the decomposition's dtype (default float64 for a float64 model, else float32)."""
    from ..core.interventions import intervene
    from .ranking import candidate_mask, layer_windows

    method = get_method(metric) if isinstance(metric, str) else as_method(metric)
    if compute_dtype is None:
        float64 = next(model.parameters()).dtype == torch.float64
        compute_dtype = torch.float64 if float64 else torch.float32
    input_ids = torch.as_tensor(input_ids)
    input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask)
    num_layers = len(attention_blocks(model))
    layers = list(range(num_layers)) if layers is None else sorted(set(layers))
    windows = layer_windows(model, num_layers)
    candidates = {l: candidate_mask(attention_mask, keep_first_token, windows[l]) for l in layers}
    observed = list(range(max(layers) + 1)) if "earlier_layers" in method.needs else layers
    results = {}
    with scoring(model, [method], input_ids, attention_mask, layers=layers, candidates=candidates, kind=kind,
                 seed=seed) as context:
        def observe(call):
            decomposition = LayerDecomposition.from_call(call)
            scores = context.scores(method, decomposition, call)
            if call.layer in candidates:
                results[call.layer] = scores.detach().clone()

        inputs = prepare_inputs(model, {"input_ids": input_ids, "attention_mask": attention_mask})
        with torch.inference_mode(), intervene(model, {}, attention_mask=attention_mask, compute_dtype=compute_dtype,
                                               observers={l: [observe] for l in observed}):
            model(**inputs)
    return results


# -- the ladder and the random control ----------------------------------------------------------------
for _name in METRICS:
    def _ladder(layer_decomposition, kind="inter", _name=_name, **_):
        return layer_decomposition.metric(_name, kind)
    _ladder.__name__ = _name
    register_method(_name, cost="no extra forward",
                    kind_dependent=_name in ("value_weighted_output_normalized", "contribution"))(_ladder)


@register_method("random", cost="no extra forward")
def random(layer_decomposition, layer, groups, positions, seed=0, **_):
    """Seeded control: a hash of (seed, sequence, layer, head, query position, key position)."""
    heads = layer_decomposition.attention.shape[1]
    return hashed_uniform(seed, groups, layer, heads, positions)


# -- value zeroing -------------------------------------------------------------------------------------
def _projected_values(call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(alpha ``[b, h, q, k]``, v~ ``[b, h, k, model]``, bias) in the model's dtype (padding zeroed)."""
    from ..core.geometry import split_output_projection

    weight, bias = call.output_projection()
    dtype = call.value.dtype
    alpha = call.probs.detach().to(dtype)
    values = call.value.detach()
    valid = call.valid_keys()
    if valid is not None:
        alpha = alpha.masked_fill(~valid[:, None, :, None] | ~valid[:, None, None, :], 0.0)
        values = values.masked_fill(~valid[:, None, :, None], 0.0)
    w_o = split_output_projection(weight.detach().to(dtype), alpha.shape[1])
    projected = torch.einsum("bhkd,hmd->bhkm", values, w_o)
    return alpha, projected, None if bias is None else bias.detach().to(dtype)


def _rest_of_block(call, block_input, hidden: torch.Tensor, attention_out: torch.Tensor) -> torch.Tensor:
    """The decoder layer's output when its attention block returns ``attention_out`` (``[1, n, model]``,
    after the output projection) on residual inputs ``hidden`` ``[1, n, model]``: the layer's own
    modules (norms, residual, MLP) are run, the attention module is replaced by that output."""
    parent, module = call.block.parent, call.module
    args, kwargs = block_input
    if args:
        args = (hidden,) + tuple(args[1:])
    else:
        kwargs = {**kwargs, "hidden_states": hidden}
    module.forward = lambda *a, **k: (attention_out, None)
    try:  # forward, not __call__: hooks on the decoder layer (recorders, the block-input capture) stay quiet
        out = parent.forward(*args, **kwargs)
    finally:
        del module.forward
    return out[0] if isinstance(out, tuple) else out


@register_method("value_zeroing", needs=("block_input",),
                 cost="per layer, the rest of the block on one token per candidate pair (~Q/2 forwards)")
def value_zeroing(layer_decomposition, call, block_input, candidates=None, **_):
    """Value zeroing (Mohebbi et al. 2023) for decoders, token-level ``[batch, query, key]``.

    For key j, its value vector is zeroed in every head of the layer (the value bias included) while the
    attention weights stay; the attention output at query i then loses sum_h alpha^h_ij v~^h_j exactly,
    and the rest of the decoder layer (residual, post-attention norm if any, MLP) is run again on it.
    Score = cosine distance 1 - cos(x_i, x~_i^(j)) between the layer's original and altered output at
    query i. Vectorised: the altered attention outputs of all (i, j) pairs are formed in model space and
    the layer's own modules run on them as a flat batch of tokens (norms and MLP act per token), in
    chunks of :data:`CHUNK_BYTES`. Scored pairs: the candidates (all causal pairs of real tokens without).
    """
    if block_input is None:
        raise UnsupportedModelError("value_zeroing: the decoder layer's input was not captured")
    alpha, projected, bias = _projected_values(call)
    b, h, q, k = alpha.shape
    hidden = block_input[0][0] if block_input[0] else block_input[1]["hidden_states"]
    original = torch.einsum("bhqk,bhkm->bqm", alpha, projected)
    if bias is not None:
        original = original + bias
    m = original.shape[-1]
    clean = _rest_of_block(call, block_input, hidden.reshape(1, b * q, m), original.reshape(1, b * q, m))
    clean = clean.reshape(b, q, m).double()
    if candidates is None:
        candidates = torch.ones(b, 1, q, k, dtype=torch.bool).tril()
        valid = call.valid_keys()
        if valid is not None:
            candidates = candidates & (valid[:, None, :, None] & valid[:, None, None, :])
    rows, queries, keys = candidates[:, 0].expand(b, q, k).nonzero(as_tuple=True)
    scores = torch.zeros(b, q, k, dtype=torch.float32)
    step = max(1, CHUNK_BYTES // (h * m * projected.element_size()))
    for start in range(0, rows.numel(), step):
        r, i, j = rows[start:start + step], queries[start:start + step], keys[start:start + step]
        delta = torch.einsum("ph,phm->pm", alpha[r, :, i, j], projected[r, :, j])
        altered = _rest_of_block(call, block_input, hidden[r, i][None], (original[r, i] - delta)[None])[0].double()
        scores[r, i, j] = (1 - torch.nn.functional.cosine_similarity(clean[r, i], altered, dim=-1)).float()
    return scores


# -- rollout -------------------------------------------------------------------------------------------
def _rolled(state: dict, key: str, mixing: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """R^l = A^l R^(l-1) with A^l = row-normalised (0.5 mixing + 0.5 I), kept in ``state[key]``."""
    b, q, _ = mixing.shape
    eye = torch.eye(q, dtype=torch.float64)[None]
    mixing = mixing.double().nan_to_num(0.0)
    if valid is not None:
        pair = valid[:, :, None] & valid[:, None, :]
        mixing = mixing.masked_fill(~pair, 0.0)
    a = 0.5 * mixing + 0.5 * eye
    a = a / a.sum(-1, keepdim=True).clamp_min(1e-30)
    previous = state.get(key)
    state[key] = a if previous is None else a @ previous
    return state[key].float()


@register_method("rollout", needs=("earlier_layers",), cost="no extra forward")
def rollout(layer_decomposition, state, attention_mask=None, **_):
    """Attention rollout (Abnar and Zuidema 2020), token-level: A^l = 0.5 mean_h alpha^l + 0.5 I
    (the residual), row-normalised; the score of layer l is the product A^l A^(l-1) ... A^0."""
    mixing = layer_decomposition.attention.nan_to_num(0.0).mean(1)
    return _rolled(state, "rollout", mixing, None if attention_mask is None else attention_mask.bool())


@register_method("contribution_rollout", needs=("earlier_layers",), cost="no extra forward")
def contribution_rollout(layer_decomposition, state, attention_mask=None, **_):
    """The rollout product applied to token-level contribution weights C_ij = sum_h c^h_ij (``inter``,
    summing to 1 over keys). Negative weights (destructive interference) are clipped at zero before the
    row normalisation, as ALTI clips its contributions (Ferrando et al. 2022)."""
    mixing = layer_decomposition.inter.nan_to_num(0.0).sum(1).clamp_min(0.0)
    mixing = mixing / mixing.sum(-1, keepdim=True).clamp_min(1e-30)
    return _rolled(state, "contribution_rollout", mixing, None if attention_mask is None else attention_mask.bool())


# -- ALTI ----------------------------------------------------------------------------------------------
@register_method("alti", needs=("block_input",), cost="no extra forward; [rows, query chunk, key, model] tensors")
def alti(layer_decomposition, call, block_input, **_):
    """ALTI-style contributions (Ferrando et al. 2022) of one decoder layer, token-level.

    The residual stream after the attention sub-block is y_i = x_i + N(a_i), a_i = sum_j sum_h
    alpha^h_ij v~^h_j + b (x_i: the layer's input; N: the post-attention norm of sandwich-norm models
    such as Gemma 3, else the identity). The transformed vectors are T_i(x_j) = N_lin(sum_h alpha^h_ij
    v~^h_j) (+ x_i when j = i), where N_lin is the norm's linear part at the clean run's statistics:
    ALTI splits LayerNorm(sum_j z_j) into sum_j g * (z_j - mean z_j) / sigma; for **RMSNorm the same
    split without the mean subtraction**, g * z_j / rms(a_i), which is exact. Contribution:
    c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), normalised to sum 1 over keys j. One layer, no
    rollout over layers. Pre-norm models (Llama, Qwen, SmolLM2) have N = identity.
    """
    from ..logit_attribution import _post_attention_norm, frozen_norm

    if block_input is None:
        raise UnsupportedModelError("alti: the decoder layer's input was not captured")
    alpha, projected, bias = _projected_values(call)
    b, h, q, k = alpha.shape
    hidden = (block_input[0][0] if block_input[0] else block_input[1]["hidden_states"]).to(projected.dtype)
    a = torch.einsum("bhqk,bhkm->bqm", alpha, projected)
    if bias is not None:
        a = a + bias
    valid = call.valid_keys()
    rows = torch.ones(b, q, dtype=torch.bool) if valid is None else valid
    norm = _post_attention_norm(call.block)
    scale = None
    if norm is not None:  # the norm's linear part at this run's statistics, fitted on the real rows
        frozen = frozen_norm(norm, a[rows][None], norm(a[rows][None]), dtype=projected.dtype)
        scale = torch.ones(b, q, dtype=projected.dtype)
        scale[rows] = frozen.scale[0]
    y = hidden + (a if norm is None else norm(a))
    m = y.shape[-1]
    pair = torch.ones(b, q, k, dtype=torch.bool).tril()
    if valid is not None:
        pair = pair & valid[:, :, None] & valid[:, None, :]
    scores = torch.zeros(b, q, k, dtype=torch.float32)
    step = max(1, CHUNK_BYTES // (b * k * m * projected.element_size() * 2))
    for q0 in range(0, q, step):
        q1 = min(q, q0 + step)
        terms = torch.einsum("bhqk,bhkm->bqkm", alpha[:, :, q0:q1], projected)
        if scale is not None:
            terms = frozen.gain * frozen.project(terms) / scale[:, q0:q1, None, None]
        diagonal = torch.arange(q0, q1)
        terms[:, diagonal - q0, diagonal] += hidden[:, q0:q1]
        y_part = y[:, q0:q1, None]
        distance = (y_part - terms).abs().sum(-1)
        c = (y_part.abs().sum(-1) - distance).clamp_min(0).masked_fill(~pair[:, q0:q1], 0.0)
        scores[:, q0:q1] = (c / c.sum(-1, keepdim=True).clamp_min(1e-30)).float()
    return scores


# -- gradient x input ------------------------------------------------------------------------------------
@register_method("grad_x_input", needs=("output_gradient",), cost="one extra forward and backward per batch")
def grad_x_input(layer_decomposition, output_gradient, **_):
    """Gradient x input on the projected value terms, per head ``[batch, head, query, key]``:
    score_hij = <g_i, alpha^h_ij v~^h_j>, g_i = d(total log-likelihood of the row's next tokens) / d(a_i),
    a_i the attention block's output at query i (the term enters a_i additively, so its gradient is g_i).
    It is the first-order estimate of how much the term raises the log-likelihood that the protocol's
    Delta NLL measures. Computed in head space: alpha^h_ij (W_O^h^T g_i) . v^h_j."""
    if output_gradient is None:
        raise UnsupportedModelError("grad_x_input: the attention output's gradient was not computed")
    geometry = layer_decomposition.geometry
    g = output_gradient.to(geometry.values.dtype)
    pulled = torch.einsum("bqm,hmd->bhqd", g, geometry.w_o)
    return geometry.attention * (pulled @ geometry.values.transpose(-1, -2))


BUILT_IN = ("value_zeroing", "rollout", "contribution_rollout", "alti", "grad_x_input")
