"""Where each architecture keeps its attention blocks and their output projections, and every other model fact.

cwcore sees a block's queries, keys and values through transformers' attention interface; what it
cannot see there is the output projection W_O that maps the mixed values back to model space. This
registry finds it. Add an architecture with :func:`register_output_projection`.

The other facts the packages need about a model have their one home (and one rule each) here too:
:func:`text_config`, :func:`attention_heads`, :func:`sliding_window` and :func:`layer_type`,
:func:`final_norm`, :func:`post_attention_norms` (found by observation). A new fact is one function here.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from .thread_state import outside_sessions

__all__ = ["AttentionBlock", "attention_blocks", "decomposable_layers", "has_cross_attention",
           "register_output_projection", "input_device", "offloaded_value", "execution_device", "materialised",
           "UnsupportedModelError", "UNSUPPORTED_MODULES", "text_config", "residual_multiplier", "attention_heads",
           "sliding_window", "sliding_windows", "layer_type",
           "final_norm", "FINAL_NORMS", "post_attention_norms", "require_causal"]


class UnsupportedModelError(ValueError):
    """The model's attention blocks or their output projections could not be found."""


def later_attention(probs: torch.Tensor, valid_queries: torch.Tensor | None = None) -> torch.Tensor:
    """``probs`` ``[batch, head, query, key]`` above the diagonal (what queries give later keys), padded queries
    ``valid_queries`` ``[batch, query]`` left out (a row that sees no key may be given every key)."""
    later = probs.detach().triu(1)
    if valid_queries is not None:
        later = later.masked_fill(~valid_queries.to(later.device)[:, None, :, None], 0.0)
    return later


def require_causal(probs: torch.Tensor, layer: int, caller: str, why: str,
                   valid_queries: torch.Tensor | None = None) -> None:
    """Refuse a layer whose queries attend to later keys (an encoder, a masked LM), measured on the
    probabilities it applied, ``probs`` ``[batch, head, query, key]``: ``why`` says what ``caller``
    computes that only a causal decoder defines (a next token, a tail of keys 0..i). ``valid_queries``
    ``[batch, query]`` bool: padded queries are not read (a left-padded row whose every key is masked may
    be given all keys by the model)."""
    later = later_attention(probs, valid_queries)
    if bool((later > 0).any()):
        raise UnsupportedModelError(
            f"{caller}: attention layer {layer} attends to later keys (up to {float(later.max()):.3g} of a query's "
            f"attention lies above the diagonal), so {why}; it is defined for causal decoders only")


# An output-projection finder takes (attention module, its parent module) and returns
# (weight [model, head * head_dim], bias [model] or None), or None when it does not apply.
ProjectionFinder = Callable[[nn.Module, nn.Module | None], "tuple[torch.Tensor, torch.Tensor | None] | None"]
_FINDERS: list[ProjectionFinder] = []


#: cwcore's facts about a model (its blocks, post-attention norms, ...), keyed weakly by the model
#: object: nothing is written on the user's model, and a copy of it is looked at afresh
_FACTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
#: attention module -> the name of its block, for refusals raised without a session
_BLOCK_NAMES: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def model_facts(model: nn.Module) -> dict:
    """The mutable dict of what cwcore has found out about ``model`` (kept while the model lives)."""
    facts = _FACTS.get(model)
    if facts is None:
        facts = _FACTS[model] = {}
    return facts


def forget_model(model: nn.Module) -> None:
    """Drop what cwcore found out about ``model`` (e.g. after registering a projection finder)."""
    _FACTS.pop(model, None)


def block_name_of(module: nn.Module) -> str | None:
    """The name of the block an attention module is, once :func:`attention_blocks` has numbered it."""
    return _BLOCK_NAMES.get(module)


def register_output_projection(finder: ProjectionFinder, first: bool = True) -> ProjectionFinder:
    """Register a finder ``(attention_module, parent) -> (weight [model, inner], bias) | None``."""
    if first:
        _FINDERS.insert(0, finder)
    else:
        _FINDERS.append(finder)
    return finder


def _linear(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if isinstance(layer, nn.Linear):
        return layer.weight, layer.bias
    # transformers' Conv1D (GPT-2): y = x W + b with W [inner, model]
    if type(layer).__name__ == "Conv1D" and hasattr(layer, "weight"):
        return layer.weight.t(), layer.bias
    return None


def _own_projection(module, parent):
    # Llama, Mistral, Qwen2/3, Gemma3, ViT (o_proj); GPT-2 (c_proj); GPT-NeoX (dense); DistilBERT
    # (out_lin); others (out_proj)
    for name in ("o_proj", "c_proj", "dense", "out_proj", "out_lin"):
        layer = getattr(module, name, None)
        if layer is not None and (found := _linear(layer)) is not None:
            return found
        if isinstance(layer, nn.Module) and any(_linear(m) is not None for m in layer.modules()):
            # a wrapper of the projection (a LoRA adapter, a quantisation wrapper): its effective W_O is not one
            # weight to read, and guessing another linear child of the block (v_proj) would name the wrong module
            raise UnsupportedModelError(
                f"`{name}` of {type(module).__name__} is a {type(layer).__name__} wrapping a linear layer (a LoRA "
                "adapter, a quantisation wrapper?): cwcore cannot read its effective W_O; merge the adapter "
                "(peft: model.merge_and_unload()) or register a finder that returns its weight with "
                "cwcore.register_output_projection")
    return None


def _sibling_output(module, parent):
    # BERT-style: BertAttention(self=BertSelfAttention, output=BertSelfOutput(dense, LayerNorm))
    output = getattr(parent, "output", None) if parent is not None else None
    if output is not None and getattr(parent, "self", None) is module:
        return _linear(getattr(output, "dense", None))
    return None


def _last_linear_child(module, parent):
    # Any other name (ModernBERT's ``Wo``, T5's ``o``): the block's last linear child, by structure. It is a
    # guess that the run verifies: the session's hooks check that this module receives exactly the attention
    # output and that the terms reproduce its result, and refuse (naming it) otherwise.
    found = None
    for child in module.children():
        found = _linear(child) or found
    return found


register_output_projection(_own_projection, first=False)
register_output_projection(_sibling_output, first=False)
register_output_projection(_last_linear_child, first=False)

#: How each built-in finder guesses W_O, for a refusal that says where its guess came from.
_GUESSES = {
    _own_projection: "by its name, one the registry knows",
    _sibling_output: "the parent's `output.dense`, as in BERT",
    _last_linear_child: "no registered name matched, so the block's last linear layer",
}

#: Why a block whose W_O no finder locates is not decomposed (it keeps its number: never silently dropped).
NO_OUTPUT_PROJECTION = (
    "no output projection W_O found (the block has no linear child, nn.Linear or Conv1D, no BERT-style sibling "
    "`output.dense`, and no registered finder matched), so cwcore cannot check a decomposition of it; if W_O is a "
    "plain parameter (as in `x @ self.w_o`), apply it through a linear module that the block calls with the attention "
    "output, and register that module with cwcore.register_output_projection")


def input_device(model: nn.Module) -> torch.device:
    """The device a model's inputs go to, as ``model(**inputs)`` expects them: its input embeddings' (the
    first shard of a model split with ``device_map``), else its first parameter's; the CPU for a model
    without parameters. A model whose weights accelerate offloads (on the meta device, loaded by each module's
    hook as it runs): the hook's execution device, else the CPU (the hooks move the inputs themselves)."""
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    weight = getattr(embeddings, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else next(
        (p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "meta" and any(hasattr(module, "_hf_hook") for module in model.modules()):
        return execution_device(embeddings) or execution_device(model) or torch.device("cpu")
    return device


def offloaded_value(module: nn.Module | None, name: str) -> torch.Tensor | None:
    """The values accelerate keeps for ``module``'s parameter or buffer ``name`` while it sits on the ``meta``
    device (offloaded to the CPU or to disk): the ``weights_map`` of the module's hook, else None."""
    hook = getattr(module, "_hf_hook", None)
    for each in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):  # a SequentialHook's parts
        weights = getattr(each, "weights_map", None)
        if weights is None:
            continue
        try:
            value = weights[name]
        except (KeyError, IndexError):
            continue
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value
    return None


def execution_device(module: nn.Module | None) -> torch.device | None:
    """Where accelerate's hook on ``module`` runs it (and loads its offloaded weights), else None."""
    hook = getattr(module, "_hf_hook", None)
    for each in getattr(hook, "hooks", None) or ([hook] if hook is not None else []):
        device = getattr(each, "execution_device", None)
        if device is not None:
            return torch.device(device)
    return None


def materialised(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """``module``'s parameter or buffer ``name``, or, where accelerate offloads it (on the meta device until
    the module runs, with the module's hook), the values its hook keeps, on the device the module runs on;
    refused with the reason when the hook holds none."""
    tensor = getattr(module, name)
    if tensor.device.type != "meta" or not hasattr(module, "_hf_hook"):  # not offloaded (a model made without
        return tensor  # weights is refused on entry, check_materialised)
    value = offloaded_value(module, name)
    if value is None:
        raise UnsupportedModelError(f"the {name} of {type(module).__name__} is on the meta device and no "
                                    "offloading hook holds its values: load the model's weights first")
    return value.to(device=execution_device(module) or value.device, dtype=tensor.dtype)


@dataclass
class AttentionBlock:
    """One attention block: its number, the module the attention interface receives, and W_O."""

    layer: int
    name: str
    module: nn.Module
    parent: nn.Module | None
    #: why cwcore cannot decompose this block (None: it can); such a block keeps its number, and asking
    #: for it raises this reason before any forward pass
    unsupported: str | None = None

    def output_projection(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [model, head * head_dim], bias [model] | None)``, read live from the module; where
        accelerate offloads them (on the meta device until the module runs), the values its hook keeps, on
        the device the module runs on."""
        weight, bias = self._find()[1]
        if weight.device.type != "meta" and (bias is None or bias.device.type != "meta"):
            return weight, bias
        owner = self._owner(weight)
        if owner is None or owner.weight is not weight or (bias is not None and owner.bias is not bias):
            raise UnsupportedModelError(f"attention block {self.name!r}: its output projection W_O is on the meta "
                                        "device, held by no module of the block whose offloading hook cwcore "
                                        "could read")
        return materialised(owner, "weight"), None if bias is None else materialised(owner, "bias")

    def _find(self):
        """``(finder, (weight, bias))``: the first registered finder that locates W_O."""
        for finder in _FINDERS:
            found = finder(self.module, self.parent)
            if found is not None:
                return finder, found
        raise UnsupportedModelError(f"no output projection found for attention block {self.name!r}")

    def projection_source(self) -> str:
        """Which finder supplied W_O, in words (for refusals of a wrong guess)."""
        finder, _ = self._find()
        return _GUESSES.get(finder) or (f"from the finder {getattr(finder, '__qualname__', repr(finder))} "
                                        "registered with cwcore.register_output_projection")

    def output_module(self) -> nn.Module | None:
        """The module that applies W_O (its forward receives the attention output), or None if the
        registered finder returned a weight no module of this block owns."""
        return self._owner(self._find()[1][0])

    def _owner(self, weight: torch.Tensor) -> nn.Module | None:
        """The module of this block (or its parent) whose ``weight`` is that tensor, else one sharing its memory
        (not by address alone: accelerate's offloaded weights all sit on the meta device, at address 0)."""
        by_address = weight.device.type != "meta"
        pointer = weight.data_ptr() if by_address else None
        shared = None
        for root in (self.module, self.parent):
            if root is None:
                continue
            for module in root.modules():
                own = getattr(module, "weight", None)
                if not isinstance(own, torch.Tensor) or module is root:
                    continue
                if own is weight:
                    return module
                if shared is None and by_address and own.data_ptr() == pointer:
                    shared = module
        return shared

    def output_module_name(self) -> str:
        """The output projection's path relative to the block (``"o_proj"``, ``"../output.dense"``), or ``"?"``."""
        projection = self.output_module()
        for prefix, root in (("", self.module), ("../", self.parent)):
            for name, module in (root.named_modules() if root is not None else ()):
                if module is projection and name:
                    return prefix + name
        return "?"

    def refuse_if_unsupported(self) -> None:
        """Raise :class:`UnsupportedModelError` with the reason when this block cannot be decomposed."""
        if self.unsupported is not None:
            raise UnsupportedModelError(f"attention block {self.layer} ({self.name!r}, "
                                        f"{type(self.module).__name__}) cannot be decomposed: {self.unsupported}")


#: Attention modules cwcore numbers but cannot decompose, with the reason (checked by isinstance).
UNSUPPORTED_MODULES: dict[type, str] = {
    nn.MultiheadAttention: "torch.nn.MultiheadAttention computes its attention inside torch "
                           "(F.multi_head_attention_forward), not through transformers' attention interface, and "
                           "applies out_proj's weight without calling out_proj, so cwcore can neither see its "
                           "attention nor check its output",
}


def decomposable_layers(model: nn.Module) -> list[int]:
    """The numbers of the blocks cwcore can decompose (every block but those with a reason in ``unsupported``)."""
    return [block.layer for block in attention_blocks(model) if block.unsupported is None]


def _is_attention_module(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Attention")


def has_cross_attention(model: nn.Module) -> bool:
    """Whether some block's keys are not the input's tokens: an encoder-decoder, a decoder configured with
    ``add_cross_attention`` (BERT-style ``encoder_hidden_states``), or a block class named ``...Cross...``."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or getattr(text_config(model), "add_cross_attention", False):
        return True
    return any("Cross" in type(block.module).__name__ for block in attention_blocks(model))


#: Names by which a block's code calls transformers' attention interface (a softmax attention block).
_INTERFACE_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "attention_interface", "AttentionInterface", "eager_attention_forward")
#: The torch functions that compute a softmax attention map (or SDPA, which computes one inside).
_SOFTMAX_FUNCTIONS = {torch.softmax, torch.nn.functional.softmax, torch.Tensor.softmax, torch.special.softmax,
                      torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.multi_head_attention_forward}
_CALLS_INTERFACE: dict[type, bool] = {}


def _calls_attention_interface(cls: type) -> bool:
    """Whether the class's own code calls transformers' attention interface (read once per class)."""
    if cls not in _CALLS_INTERFACE:
        import inspect

        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            source = ""
        _CALLS_INTERFACE[cls] = any(marker in source for marker in _INTERFACE_MARKERS)
    return _CALLS_INTERFACE[cls]


class _SoftmaxProbe(torch.overrides.TorchFunctionMode):
    """Records which of the watched modules compute a softmax (or SDPA) while they run."""

    def __init__(self, watched: list[nn.Module]):
        super().__init__()
        self.active: list[int] = []
        self.ran: set[int] = set()
        self.softmax: set[int] = set()
        self.handles = []
        for module in watched:
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave))

    def _enter(self, module, args):
        self.active.append(id(module))
        self.ran.add(id(module))

    def _leave(self, module, args, output):
        if self.active and self.active[-1] == id(module):
            self.active.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SOFTMAX_FUNCTIONS and self.active:
            self.softmax.update(self.active)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """``model`` in eval() mode inside the block, each module's own training flag restored after it (``model.train(
    flag)`` would set every submodule to the top module's flag)."""
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def _without_softmax(model: nn.Module, modules: list[nn.Module]) -> set[int]:
    """The ids of the ``modules`` that, in a probe forward pass on 4 tokens, ran without computing any softmax or
    SDPA (linear attention, state-space mixers named "...Attention"): not softmax attention blocks. Empty when the
    probe cannot run (a model that takes more than token ids): then every module keeps its number."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters
        device = input_device(model)
    except (TypeError, ValueError, StopIteration):
        return set()
    if "input_ids" not in parameters:
        return set()
    ids = torch.arange(4, device=device).reshape(1, 4)
    inputs = {"input_ids": ids}
    if "decoder_input_ids" in parameters:
        inputs["decoder_input_ids"] = ids
    probe = _SoftmaxProbe(modules)
    try:
        with torch.inference_mode(), outside_sessions(model), evaluating(model), probe:
            model(**inputs)
    except Exception:  # a model the probe cannot run keeps every block numbered (never dropped on a guess)
        return set()
    finally:
        for handle in probe.handles:
            handle.remove()
    return {id(m) for m in modules if id(m) in probe.ran and id(m) not in probe.softmax}


def attention_blocks(model: nn.Module) -> list[AttentionBlock]:
    """The model's softmax attention blocks, numbered from 0 in the order the model registers its modules (the
    forward order of the usual layouts; an encoder-decoder's encoder layers first, then each decoder layer's
    self-attention and cross-attention as its module lists them).

    A block is the innermost module whose class name ends in ``Attention`` (cross-attention included: BERT's
    ``BertCrossAttention`` is numbered after its layer's self-attention) and that computes softmax attention: its
    code calls transformers' attention interface, or, probed in a
    4-token forward pass, it computes a softmax (a block with its own attention code is numbered, and
    refused when it runs); one that runs without any softmax (linear attention in a hybrid) is not numbered;
    a registered finder locates its output projection (the last finder takes the block's last linear
    child; the run verifies it). Modules of :data:`UNSUPPORTED_MODULES` (``nn.MultiheadAttention``) and
    blocks whose W_O no finder locates keep their number with ``unsupported`` saying why they cannot be
    decomposed; a model with no block whose W_O is found is refused.
    """
    cached = model_facts(model).get("blocks")
    if cached is not None:
        return cached
    parents: dict[int, nn.Module] = {}
    names: dict[int, str] = {}
    for name, module in model.named_modules():
        names[id(module)] = name
        for child in module.children():
            parents[id(child)] = module
    candidates = [m for _, m in model.named_modules() if _is_attention_module(m)]
    innermost = [
        m for m in candidates if not any(c is not m and _is_attention_module(c) for c in m.modules())
    ]
    # numbered by behaviour: a block whose code does not call the attention interface is probed, and one that
    # computes no softmax (linear attention named "...Attention" in a hybrid) is not a softmax attention block
    unknown = [m for m in innermost if not isinstance(m, tuple(UNSUPPORTED_MODULES))
               and not _calls_attention_interface(type(m))]
    if unknown:
        linear = _without_softmax(model, unknown)
        innermost = [m for m in innermost if id(m) not in linear]
    blocks = []
    skipped = []
    for module in innermost:
        block = AttentionBlock(len(blocks), names[id(module)], module, parents.get(id(module)))
        reason = next((why for cls, why in UNSUPPORTED_MODULES.items() if isinstance(module, cls)), None)
        if reason is not None:
            block.unsupported = reason
        else:
            try:
                block.output_projection()
            except UnsupportedModelError as error:  # a finder's own reason where it gave one (a wrapped o_proj)
                generic = str(error).startswith("no output projection found")
                block.unsupported = NO_OUTPUT_PROJECTION if generic else str(error)
                skipped.append(block.name)
        blocks.append(block)
        _BLOCK_NAMES[module] = block.name  # for refusals raised without a session
    owners: dict[int, AttentionBlock] = {}
    for block in (b for b in blocks if b.unsupported is None):
        owner = block.output_module()
        first = owners.setdefault(id(owner), block) if owner is not None else block
        if first is not block:  # one module object as two blocks' W_O: each block's checks would see the other's calls
            first.unsupported = block.unsupported = (
                f"blocks {first.name!r} and {block.name!r} share one output projection module "
                f"`{block.output_module_name()}` (the same object): the checks of one would see the other's calls, "
                "so cwcore cannot verify either; give each block its own module")
    if len(skipped) == len(blocks):  # no attention module, or none whose W_O is found
        found = f" (attention modules without one: {', '.join(skipped[:3])})" if skipped else ""
        raise UnsupportedModelError(
            f"cwcore found no attention block with a linear output projection in {type(model).__name__}{found}; "
            "register the module that applies W_O with cwcore.register_output_projection"
        )
    model_facts(model)["blocks"] = blocks
    return blocks


# ---------------------------------------------------------------------------------------------------
# Model facts: one home, one rule each. Every package reads them here.
# ---------------------------------------------------------------------------------------------------


def text_config(model: nn.Module):
    """The config that describes the language (or only) tower: ``config.get_text_config()`` where it exists."""
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def residual_multiplier(model: nn.Module) -> float:
    """The factor by which each block's attention output is added to the residual stream: Granite's
    ``residual_multiplier`` (``h = h + m * attn(h)``), 1.0 for the usual layouts. Read from the decoder layers,
    which apply it (a config edited after loading does not change them); layers that disagree are refused."""
    found = {float(m) for m in (getattr(b.parent, "residual_multiplier", None) for b in attention_blocks(model))
             if isinstance(m, (int, float)) and not isinstance(m, bool)}
    if len(found) > 1:
        raise UnsupportedModelError(f"the decoder layers apply different residual multipliers {sorted(found)}: "
                                    "cwcore attributes with one")
    return found.pop() if found else float(getattr(text_config(model), "residual_multiplier", None) or 1.0)


def attention_heads(model: nn.Module) -> int:
    """Query heads per attention layer, from the config (``num_attention_heads``, GPT-2's ``n_head``)."""
    config = text_config(model)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if heads is None:
        raise ValueError("cannot tell the number of attention heads from the model's config")
    return int(heads)


def block_heads(model: nn.Module) -> dict[int, int]:
    """``{layer: query heads}``: each block's output projection's input width over the block's ``head_dim``, so that
    pruned heads and a config edited after loading count as the layer computes; else the config's count."""
    fallback, out = attention_heads(model), {}
    for block in attention_blocks(model):
        head_dim = getattr(block.module, "head_dim", None)
        width = block._find()[1][0].shape[-1] if isinstance(head_dim, int) and head_dim > 0 else None
        out[block.layer] = width // head_dim if width and width % head_dim == 0 else fallback
    return out


def sliding_window(model: nn.Module, block: AttentionBlock) -> int | None:
    """The block's sliding window in tokens (None: full attention).

    One rule: ``config.layer_types[layer_idx]`` where the config lists layer types (Gemma 2/3, GPT-OSS,
    Qwen2, ...; indexed by the module's own ``layer_idx``, so hybrids read their attention layers' entries),
    else the module's ``is_sliding``/``sliding_window``, else the config's ``sliding_window`` for every layer
    unless ``use_sliding_window`` is False (Mistral, Starcoder2).
    """
    config = text_config(model)
    window = getattr(config, "sliding_window", None)
    window = int(window) if isinstance(window, int) and window > 0 else None
    types = getattr(config, "layer_types", None)
    index = getattr(block.module, "layer_idx", block.layer)
    if isinstance(types, (list, tuple)) and isinstance(index, int) and 0 <= index < len(types):
        return window if "sliding" in str(types[index]) else None
    own = getattr(block.module, "sliding_window", None)
    if isinstance(own, int) and not isinstance(own, bool) and own > 0:
        return own
    if getattr(block.module, "is_sliding", False):
        return window
    return window if getattr(config, "use_sliding_window", True) is not False else None


def sliding_windows(model: nn.Module) -> dict[int, int | None]:
    """``{layer: window or None}`` for every attention block (:func:`sliding_window`)."""
    return {block.layer: sliding_window(model, block) for block in attention_blocks(model)}


def layer_type(model: nn.Module, block: AttentionBlock) -> str:
    """``"sliding"`` when the block has a sliding window (:func:`sliding_window`), else ``"global"``."""
    return "sliding" if sliding_window(model, block) is not None else "global"


#: Attribute names of the final norm on the base model (or its decoder).
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


def final_norm(model: nn.Module) -> nn.Module:
    """The norm applied to the last hidden state before the unembedding."""
    base = getattr(model, "base_model", model)
    for root in (base, getattr(base, "decoder", None)):
        for name in FINAL_NORMS:
            module = getattr(root, name, None) if root is not None else None
            if isinstance(module, nn.Module):
                return module
    raise UnsupportedModelError(f"no final norm found in {type(model).__name__} (looked for {', '.join(FINAL_NORMS)})")


def _candidate_norms(block: AttentionBlock) -> list[nn.Module]:
    """Norm modules of the block's decoder layer that are not inside the attention module (q/k norms)."""
    if block.parent is None:
        return []
    inside = {id(m) for m in block.module.modules()}
    return [m for m in block.parent.modules()
            if id(m) not in inside and m is not block.parent and "norm" in type(m).__name__.lower()]


def post_attention_norms(model: nn.Module, ids: torch.Tensor | None = None) -> dict[int, nn.Module | None]:
    """``{layer: module or None}``: the norm applied to each attention block's output before the residual
    add (Gemma 2/3's ``post_attention_layernorm``), found by observation, not by name (Llama's
    ``post_attention_layernorm`` is the MLP's pre-norm, applied after the residual add): in a probe forward
    pass on ``ids [1, n]`` (default ``[[0, 1, 2, 3]]``), the candidate norm whose input equals the output
    projection's output. The probe runs outside any active cwcore session. Cached on the model, with
    :func:`residual_norms` (the same probe)."""
    cached = model_facts(model).get("post_norms")
    if cached is not None:
        return cached

    blocks = [b for b in attention_blocks(model) if b.unsupported is None]
    seen_out: dict[int, torch.Tensor] = {}
    seen_in: dict[int, list[tuple[nn.Module, torch.Tensor]]] = {}
    layer_in: dict[int, torch.Tensor] = {}  # the decoder layer's input h (the residual) and the attention's x
    attention_in: dict[int, torch.Tensor] = {}

    def first_input(store, layer):
        def hook(module, args, kwargs):
            value = args[0] if args else kwargs.get("hidden_states")
            if isinstance(value, torch.Tensor):
                store.setdefault(layer, value.detach())
        return hook

    handles = []
    for block in blocks:
        out = block.output_module()
        if out is None:
            continue
        if block.parent is not None:
            handles.append(block.parent.register_forward_pre_hook(first_input(layer_in, block.layer), with_kwargs=True))
            handles.append(block.module.register_forward_pre_hook(first_input(attention_in, block.layer),
                                                                  with_kwargs=True))
        handles.append(out.register_forward_hook(
            lambda m, i, o, l=block.layer: seen_out.setdefault(l, (o[0] if isinstance(o, tuple) else o).detach())))
        for norm in _candidate_norms(block):
            handles.append(norm.register_forward_pre_hook(
                lambda m, i, l=block.layer: seen_in.setdefault(l, []).append((m, i[0].detach()))))
    probe = torch.arange(4).reshape(1, 4) if ids is None else torch.as_tensor(ids)[:1, :8]
    device = input_device(model)
    try:  # the probe must not be seen by a session around it
        with torch.inference_mode(), outside_sessions(model), evaluating(model):
            model(input_ids=probe.to(device), attention_mask=torch.ones_like(probe).to(device))
    finally:
        for h in handles:
            h.remove()
    found: dict[int, nn.Module | None] = {}
    residual: dict[int, nn.Module | None] = {}
    for block in blocks:
        out, h, x = seen_out.get(block.layer), layer_in.get(block.layer), attention_in.get(block.layer)
        found[block.layer] = residual[block.layer] = None
        for module, inp in seen_in.get(block.layer, []):
            if out is not None and inp.shape == out.shape and torch.equal(inp, out):
                found[block.layer] = module
                break
        # post-LN: the attention reads the residual h itself (no norm before it), and a norm reads h + its output
        if out is not None and h is not None and x is not None and x.shape == h.shape and torch.equal(x, h):
            for module, inp in seen_in.get(block.layer, []):
                if inp.shape == out.shape and torch.allclose(inp, h + out, rtol=1e-5, atol=1e-6):
                    residual[block.layer] = module
                    break
    model_facts(model)["post_norms"], model_facts(model)["residual_norms"] = found, residual
    return found


def residual_norms(model: nn.Module) -> dict[int, nn.Module | None]:
    """``{layer: module or None}``: the norm a post-LN layer (BERT, BART, OPT-350m) applies to the residual and
    the attention output together, y_i = LN(x_i + a_i), found in :func:`post_attention_norms`' probe (the
    attention reads the layer's input itself, and a norm reads that input plus the output projection's output)."""
    post_attention_norms(model)
    return model_facts(model)["residual_norms"]
