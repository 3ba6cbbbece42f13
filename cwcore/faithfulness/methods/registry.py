"""The registry of attribution methods and the context a method is called with (see
:mod:`cwcore.faithfulness.methods` for the calling convention and the context keywords)."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import re
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ...core.architectures import UnsupportedModelError, attention_blocks, has_cross_attention, post_attention_norms
from ...core.decomposition import LayerDecomposition, prepare_inputs
from ...core.thread_state import holding
from ...identity import UncacheableMetric, method_key  # a callable's identity: one home, cwcore.identity

__all__ = [
    "Method", "register_method", "get_method", "available_methods", "method_key", "as_method", "code_identity",
    "precomputed", "ScoreContext", "scoring", "method_scores", "output_gradients", "display_names", "colours",
    "refuse_encoder_decoder",
]


@dataclass(frozen=True)
class Method:
    """A registered ranking ``fn(layer_decomposition=..., **context)``: ``needs`` (extra context: ``"block_input"``,
    ``"output_gradient"``, ``"earlier_layers"``, ``"post_attention_norm"``, ``"block_output"``), ``cost``, ``key``
    (its code's identity in cache keys), ``title`` and ``colour`` (the book's figures)."""

    name: str
    fn: Callable = field(compare=False)
    needs: frozenset = frozenset()
    cost: str = ""
    key: str = ""
    kind_dependent: bool = False
    indexes_sequences: bool = False  # precomputed scores: rows are the sequences of faithfulness_curve
    title: str = ""
    colour: str = ""
    #: ``fits(lengths, num_layers)`` of precomputed scores: refuses texts and a model they do not fit (else None)
    fits: Callable | None = field(default=None, compare=False)

    @property
    def display_name(self) -> str:
        """The title, or the name where the method has none."""
        return self.title or self.name


_REGISTRY: dict[str, Method] = {}
#: ``"block_output"``: the method models what the attention block adds to the residual stream as its output
#: projection's result (ALTI): a layer whose block returns another tensor (a hook on the block, a step after W_O) is
#: refused after the forward, with the measured difference
_NEEDS = ("block_input", "output_gradient", "earlier_layers", "post_attention_norm", "block_output")


def register_method(name: str, *, needs=(), cost: str = "", kind_dependent: bool = False, title: str = "",
                    colour: str = ""):
    """Decorator: ``@register_method("name", title="My score")`` makes ``metric="name"`` rank by the
    function; ``title`` is its display name in tables and figures (default: the name)."""
    unknown = set(needs) - set(_NEEDS)
    if unknown:
        raise ValueError(f"unknown needs {sorted(unknown)}; choose from {_NEEDS}")

    def add(fn: Callable) -> Callable:
        _REGISTRY[name] = Method(name, fn, frozenset(needs), cost, name, kind_dependent, title=title or name,
                                 colour=colour)
        fn.cwcore_needs = frozenset(needs)
        return fn

    return add


def code_identity(method: Method) -> str:
    """What a registered method's code adds to its cache keys: nothing for cwcore's own (the package's code
    hash covers them), else :func:`method_key` of the user's function, read at each call (its globals may
    change); a fresh key when that function reads a value cwcore cannot fingerprint (never served from the
    cache)."""
    module = getattr(getattr(method.fn, "__wrapped__", method.fn), "__module__", "") or ""
    if module == "cwcore" or module.startswith("cwcore."):
        return ""
    return as_method(method.fn, method.name).key


def get_method(name: str) -> Method:
    if name not in _REGISTRY:
        raise ValueError(f"unknown metric {name!r}; choose from {', '.join(available_methods())} (+ _intra/_inter)")
    return _REGISTRY[name]


def available_methods() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def display_names(names=None) -> dict[str, str]:
    """``{name: display name}`` of registered methods (all, or ``names``; a label that is no registered
    name, e.g. ``"contribution_intra"`` or a user's label, maps to itself)."""
    names = available_methods() if names is None else names
    return {n: _REGISTRY[n].display_name if n in _REGISTRY else n for n in names}


def colours(names=None) -> dict[str, str]:
    """``{name: hex colour}`` of registered methods that have one (all, or ``names``)."""
    names = available_methods() if names is None else names
    return {n: _REGISTRY[n].colour for n in names if n in _REGISTRY and _REGISTRY[n].colour}


def as_method(fn: Callable, label: str | None = None) -> Method:
    """A user's callable as a :class:`Method` (label: ``label`` or the function's name)."""
    name = label or getattr(fn, "__name__", type(fn).__name__)
    name = "lambda" if name == "<lambda>" else name
    try:
        key = hashlib.sha256(method_key(fn).encode()).hexdigest()[:16]
    except UncacheableMetric as err:  # a fresh key each call: its curves are neither stored nor served
        from ...cache import never_cached_identity, warn_cache

        warn_cache(f"cwcore: metric {name!r} is not cached: it reads a value whose state cwcore cannot "
                   f"fingerprint ({err}); its results are computed every time")
        key = never_cached_identity()
    from ...core.inputs import finite_scores  # a user's NaN/inf scores are refused at the layer they appear

    return Method(name, finite_scores(fn), frozenset(getattr(fn, "cwcore_needs", ())), "",
                  f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}-{key}")


def precomputed(scores, label: str = "precomputed") -> Method:
    """A :class:`Method` reading precomputed scores (faithfulness_curve only): ``{layer: [n_sequences,
    head, length, length]}`` (or token-level), or one tensor with the layer first; row s is the s-th
    sequence, indices are token positions without padding."""
    from ...runs import tensor_digest

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
        g, p = groups.long().cpu(), positions.long().cpu()  # the scores are kept on the CPU
        if t.dim() == 3:
            return t[g[:, None, None], p[:, :, None], p[:, None, :]].to(positions.device)
        heads = torch.arange(t.shape[1])
        return t[g[:, None, None, None], heads[None, :, None, None], p[:, None, :, None],
                 p[:, None, None, :]].to(positions.device)

    def fits(lengths: Sequence[int], num_layers: int) -> None:
        """Refuse scores that do not fit the texts (``lengths``: each sequence's tokens) and the model: a layer
        it does not have, another number of sequences, rows longer than the longest sequence (e.g. a padded
        batch's). Taken silently, they gave another curve (a three-layer stack on two layers: +238 instead of
        -136 perplexity)."""
        foreign = sorted(layer for layer in tensors if not 0 <= layer < num_layers)
        if foreign:
            raise ValueError(f"precomputed scores name layers {foreign}, which the model does not have (its "
                             f"{num_layers} attention layers are 0 to {num_layers - 1})")
        longest = max(lengths)
        for layer, t in sorted(tensors.items()):
            if t.shape[0] != len(lengths):
                raise ValueError(f"precomputed scores of layer {layer} hold {t.shape[0]} sequences for "
                                 f"{len(lengths)} texts (row s is the s-th sequence)")
            if t.shape[-1] != longest:
                raise ValueError(f"precomputed scores of layer {layer} are {t.shape[-1]} positions long, the longest "
                                 f"sequence {longest} tokens (indices are token positions without padding)")

    read.__name__ = label
    key = f"precomputed-{tensor_digest({str(k): v for k, v in tensors.items()})}"
    return Method(label, read, frozenset(), "no extra forward", key, indexes_sequences=True, fits=fits)


def check_precomputed_fit(specs, sequences: Sequence[Sequence[int]], num_layers: int) -> None:
    """Every precomputed metric of ``specs`` fits ``sequences`` (token ids, no padding) and a model of
    ``num_layers`` attention layers (see :func:`precomputed`)."""
    for spec in specs:
        if spec.method.fits is not None:
            spec.method.fits([len(sequence) for sequence in sequences], num_layers)


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
        self.groups = torch.arange(input_ids.shape[0], device=input_ids.device) if groups is None else groups
        self.candidates = candidates or {}
        self.kind, self.seed = kind, seed
        self.importance = "signed"  # the sweep applies |.| for absolute importance
        self.state: dict = {}
        self.block_inputs: dict[int, tuple] = {}
        self.gradients: dict[int, torch.Tensor] = {}
        self.post_attention_norms: dict[int, nn.Module | None] = {}
        # layer -> why its block returned another tensor than its projection's result: the scored forward's
        # AttentionSession.changed_outputs, handed over by the caller (read on leaving scoring())
        self.changed_outputs: dict[int, str] | None = None

    def scores(self, method: Method, layer_decomposition: LayerDecomposition, call=None, kind: str | None = None):
        """``[batch, head, query, key]`` scores of ``method`` for one layer. Token-level scores are copied
        into every head, which the head-key ranking needs (one order over all terms); they are then H
        times too large when summed over heads: :func:`cwcore.attribute` returns them token-level."""
        values = self.raw_scores(method, layer_decomposition, call, kind)
        return _spread(values, layer_decomposition.attention.shape, method.name, layer_decomposition.layer)

    def raw_scores(self, method: Method, layer_decomposition: LayerDecomposition, call=None, kind: str | None = None):
        """What ``method`` returns for one layer: ``[batch, head, query, key]`` or ``[batch, query, key]``."""
        layer = layer_decomposition.layer
        context = dict(layer=layer, call=call, model=self.model, input_ids=self.input_ids,
                       attention_mask=self.attention_mask, positions=self.positions, groups=self.groups,
                       candidates=self.candidates.get(layer), kind=kind or self.kind, seed=self.seed,
                       state=self.state)
        if "block_input" in method.needs:
            context["block_input"] = self.block_inputs.get(layer)
        if "output_gradient" in method.needs:
            context["output_gradient"] = self.gradients.get(layer)
        if "post_attention_norm" in method.needs:
            context["post_attention_norm"] = self.post_attention_norms.get(layer)
        accepted = _accepted(method.fn)
        if accepted is not None:
            context = {k: v for k, v in context.items() if k in accepted}
        return method.fn(layer_decomposition=layer_decomposition, **context)


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


def refuse_encoder_decoder(model) -> None:
    """The methods score one stack of layers over ``input_ids`` and their mask: an encoder-decoder's decoder
    queries, its own mask and cross-attention's encoder keys are not those (its real rows read as padding,
    rollout chained the two stacks, gradients were taken for the token after the decoder's target); a decoder's
    cross-attention to ``encoder_hidden_states`` has keys that are not input_ids' either."""
    if has_cross_attention(model) and not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} has cross-attention layers, whose keys are encoder states, not input_ids: the "
            "attribution methods score one stack of self-attention over input_ids and their attention mask; "
            "cwcore.decompose and cwcore.intervene decompose and change its cross-attention")
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} is an encoder-decoder: the attribution methods score one stack of layers over "
            "input_ids and their attention mask, which are the encoder's here, not the decoder's queries or its own "
            "mask; cwcore.decompose and cwcore.intervene decompose and change its three kinds of attention")


@contextlib.contextmanager
def scoring(model, methods, input_ids, attention_mask, *, layers, groups=None, candidates=None, kind="inter",
            seed=0) -> Iterator[ScoreContext]:
    """A :class:`ScoreContext` for one forward: computes the gradients and installs the block-input
    hooks the ``methods`` need (removed on exit)."""
    refuse_encoder_decoder(model)
    context = ScoreContext(model, input_ids, attention_mask, groups=groups, candidates=candidates, kind=kind,
                           seed=seed)
    needs = set().union(*[m.needs for m in methods]) if methods else set()
    if "post_attention_norm" in needs:  # found by a probe forward: run it now, not inside the scored forward,
        context.post_attention_norms = post_attention_norms(model)  # whose hooks (block inputs) would see it
    if "output_gradient" in needs:
        context.gradients = output_gradients(model, input_ids, attention_mask, layers)
    handles = []
    try:  # every hook inside: one registration that fails removes those before it
        if "block_input" in needs:
            for layer in layers:
                def capture(module, args, kwargs, layer=layer):
                    context.block_inputs[layer] = (args, kwargs)
                    return None
                handles.append(_parent(model, layer).register_forward_pre_hook(capture, with_kwargs=True))
        yield context
    finally:
        for handle in handles:
            handle.remove()
    if "block_output" in needs:
        if context.changed_outputs is None:  # a caller that forgot would drop the refusal silently
            raise RuntimeError("scoring: a method needs the block outputs checked; set context.changed_outputs to the "
                               "scored forward's AttentionSession.changed_outputs")
        changed = {layer: why for layer, why in context.changed_outputs.items() if layer in layers}
        if changed:
            layer, why = min(changed.items())
            users = ", ".join(m.name for m in methods if "block_output" in m.needs)
            raise UnsupportedModelError(f"{users} models what attention layer {layer} adds to the residual stream as "
                                        f"its output projection's result, but {why}")


def lm_logits(model, out, caller: str, why: str) -> torch.Tensor:
    """The logits ``[batch, length, vocab]`` of a forward's output ``out``, or :class:`UnsupportedModelError`
    for a model without a language-model head (``why``: what ``caller`` needs them for)."""
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", None)
    if logits is None:  # a bare encoder's first output is its hidden states, not scores over tokens
        raise UnsupportedModelError(f"{caller}: {type(model).__name__} has no language-model head (its output has "
                                    f"no logits), so {why}; load it with its head (e.g. AutoModelForCausalLM)")
    return logits


def output_gradients(model, input_ids, attention_mask, layers) -> dict[int, torch.Tensor]:
    """``{layer: [rows, length, model]}``: the gradient of each row's summed next-token log-likelihood
    (real tokens only) with respect to each attention block's output (after its output projection and
    bias). One forward and one backward, outside inference mode; parameter gradients are not computed."""
    with holding(model):  # the capture hooks are the model's: another thread's cwcore call waits
        return _output_gradients(model, input_ids, attention_mask, layers)


def _output_gradients(model, input_ids, attention_mask, layers) -> dict[int, torch.Tensor]:
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
            logits = lm_logits(model, out, "grad_x_input", "there is no next-token log-likelihood to "
                               "differentiate").float()
            mask = attention_mask.to(logits.device).bool()  # the last layers' device, where a model is split
            valid = mask[:, :-1] & mask[:, 1:]
            targets = inputs["input_ids"][:, 1:, None].to(logits.device)
            logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, targets)[..., 0]
            total = (logp * valid).sum()
            order = [layer for layer in layers if layer in captured]
            grads = torch.autograd.grad(total, [captured[layer] for layer in order], allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return {layer: (torch.zeros_like(captured[layer]) if g is None else g).detach() for layer, g in zip(order, grads)}


def method_scores(model, metric, input_ids, attention_mask=None, *, layers=None, keep_first_token=True,
                  kind="inter", seed=0, compute_dtype=None) -> dict[int, torch.Tensor]:
    """``{layer: [batch, head, query, key]}`` scores of one method on one batch, exactly as the sweep's clean
    pass computes them (token-level methods copied into every head: do not sum over heads; for
    attributions use :func:`cwcore.attribute`). ``compute_dtype``: default float64 for a float64 model,
    else float32."""
    from ...core.interventions import intervene
    from ..ranking import candidate_mask, layer_windows, require_window

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
            require_window(call.probs, call.layer, windows[call.layer], call.valid_queries())
            decomposition = LayerDecomposition.from_call(call)
            scores = context.scores(method, decomposition, call)
            if call.layer in candidates:
                results[call.layer] = scores.detach().clone()

        inputs = prepare_inputs(model, {"input_ids": input_ids, "attention_mask": attention_mask})
        with torch.inference_mode(), intervene(model, {}, attention_mask=attention_mask, compute_dtype=compute_dtype,
                                               observers={l: [observe] for l in observed}) as session:
            context.changed_outputs = session.changed_outputs
            model(**inputs)
    return results


