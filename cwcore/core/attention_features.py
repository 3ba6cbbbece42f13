"""What cwcore's attention function implements of an attention call, and what it refuses.

Transformers passes an attention implementation its own parameters (the mask, dropout, scaling, softcap,
learned sink logits ``s_aux``) and keyword arguments. :data:`HANDLED_KEYWORDS` lists the keywords
:func:`cwcore.core.attention.attention_forward` handles, with how; any other keyword with a value is refused
(:func:`refuse_unknown_features`), so a feature cwcore does not implement is never silently ignored. A new
keyword a family passes is one entry here.
"""

from __future__ import annotations

import sys
from typing import Iterable

import torch
from torch import nn

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .architectures import AttentionBlock, UnsupportedModelError, block_name_of

__all__ = ["FAST_IMPLEMENTATIONS", "HANDLED_KEYWORDS", "block_label", "changed_output", "fast_path",
           "maps_exclude_the_sink", "refuse_nested", "refuse_training", "refuse_unknown_features",
           "refuse_unverified_implementation", "repeated_calls_reason"]

# Attributes of an attention module that change what attention computes and that attention_forward does
# not implement: refusing is better than a plausible wrong number.
_UNSUPPORTED_MODULE_ATTRIBUTES = {
    "sinks": "learned sink logits are read from the call's `s_aux`, but this module keeps them in `sinks` "
             "without passing them",
}

#: Keywords of an attention call that attention_forward handles (its own parameters aside: the mask, dropout,
#: scaling, softcap and learned sink logits ``s_aux``), with how. Any other keyword with a value (not None or
#: False) is refused, naming the block and the keyword: a keyword cwcore does not implement would otherwise be
#: silently ignored (a sparse-attention indexer's ``indices=`` would run dense attention).
HANDLED_KEYWORDS = {
    "position_ids": "positions are already in the rotated queries and keys",
    "sliding_window": "the window is in the attention mask that transformers builds for the layer",
    "is_causal": "causality is in the attention mask, rebuilt from `is_causal` as SDPA does when the mask is omitted",
    "cache_position": "positions of the cache, already in the mask",
    "output_attentions": "the probabilities are always returned",
    "output_hidden_states": "not read by attention",
    "output_router_logits": "not read by attention",
    "use_cache": "not read by attention",
    "return_dict": "not read by attention",
    "num_items_in_batch": "a loss normaliser, not read by attention",
    "deterministic": "a flash-attention kernel option",
    "target_dtype": "a flash-attention kernel option",
    "layer_idx": "not read by attention",
    "token_type_ids": "segment ids, read by the embeddings and by the mask transformers builds for the layer, never "
                      "by an attention function (a tokenizer may return them for any model)",
    "position_bias": "an additive score bias (T5's relative positions), added to the scores before the softmax as "
                     "the model's eager attention adds it",
}
#: Keywords known to change attention, with what they mean, for the refusal's wording.
_KNOWN_UNSUPPORTED = {
    "indices": "the top-k keys a sparse-attention indexer selected (a kernel attends only to those; without "
               "it attention is dense)",
    "block_indices": "the key blocks a sparse-attention indexer selected",
    "topk_indices": "the top-k keys a sparse-attention indexer selected",
    "sinks": "learned sink logits under a keyword cwcore does not read",
    "attention_sinks": "learned sink logits under a keyword cwcore does not read",
    "alibi": "ALiBi position biases",
    "cu_seq_lens_q": "packed sequences (flash-attention's variable-length layout; pass an attention mask instead)",
    "cu_seq_lens_k": "packed sequences (flash-attention's variable-length layout; pass an attention mask instead)",
    "max_length_q": "packed sequences (flash-attention's variable-length layout)",
    "max_length_k": "packed sequences (flash-attention's variable-length layout)",
    "seq_idx": "packed sequences",
    "head_mask": "a per-head mask multiplied into the probabilities",
    "layer_head_mask": "a per-head mask multiplied into the probabilities",
    "use_top_left_mask": "a flash-attention mask alignment",
}


def block_label(module: nn.Module) -> str:
    """How a refusal names an attention module: its block's name where attention_blocks has set it."""
    block_name = block_name_of(module)
    return f"attention block {block_name!r} ({type(module).__name__})" if block_name is not None else type(module).__name__


def refuse_unknown_features(module: nn.Module, kwargs: dict, has_sink_logits: bool) -> None:
    """Raise :class:`UnsupportedModelError`, naming the block and the keyword, for a keyword of the attention
    call (``kwargs``) that cwcore does not implement, or a module attribute that changes attention unseen."""
    for name, value in kwargs.items():
        if name in HANDLED_KEYWORDS or value is None or value is False:
            continue
        where = block_label(module)
        meaning = _KNOWN_UNSUPPORTED.get(name, "a keyword cwcore's attention function does not know")
        raise UnsupportedModelError(
            f"{where} passes `{name}` to the attention function ({meaning}); cwcore's attention function does not "
            "implement it, so it refuses rather than compute a different attention than the model's")
    for name, why in _UNSUPPORTED_MODULE_ATTRIBUTES.items():
        if isinstance(getattr(module, name, None), torch.Tensor) and not has_sink_logits:
            raise UnsupportedModelError(f"{type(module).__name__}.{name}: {why}; cwcore refuses to decompose it")


_SINK_MAPS: dict[type, bool] = {}


def maps_exclude_the_sink(module: nn.Module, query: torch.Tensor, kv_heads: int, key_dim: int, value_dim: int,
                          s_aux: torch.Tensor) -> bool:
    """Whether the model's own eager attention, given learned sink logits, returns the softmax over the keys
    alone (rows sum to one) and applies the sink as a scale on its output (Granite SWA), rather than the
    softmax over keys and sink with the sink's column dropped (GPT-OSS). Both compute the same output; the maps
    they return differ. Measured once per class by calling the eager function of the module's own modeling file
    on random tensors shaped like this call's (before grouped heads are repeated; False when it has none or it
    fails)."""
    cls = type(module)
    if cls not in _SINK_MAPS:
        eager = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        verdict = False
        if callable(eager):
            generator = torch.Generator().manual_seed(0)
            shapes = ((1, query.shape[1], 3, query.shape[-1]), (1, kv_heads, 3, key_dim), (1, kv_heads, 3, value_dim))
            probe_q, probe_k, probe_v = (torch.randn(shape, generator=generator).to(query.device, query.dtype)
                                         for shape in shapes)
            try:
                with torch.no_grad():
                    _, weights = eager(module, probe_q, probe_k, probe_v, None, scaling=query.shape[-1] ** -0.5,
                                       dropout=0.0, s_aux=s_aux)
            except Exception:  # an eager function this probe cannot call: the sink-dropped convention
                weights = None
            if isinstance(weights, torch.Tensor) and weights.shape[-1] == 3:
                sums = weights.float().sum(-1)
                verdict = bool((sums - 1).abs().max() < 1e-3)
        _SINK_MAPS[cls] = verdict
    return _SINK_MAPS[cls]


def repeated_calls_reason(block: AttentionBlock, sizes: list[tuple[int, int]], tokens: int | None) -> str:
    """Why a block that called the attention function more than once per forward is refused, from what was
    measured: the (queries, keys) of each call and the number of tokens the block received."""
    calls = len(sizes)
    queries = [q for q, _ in sizes]
    head = (f"attention block {block.name!r} ({type(block.module).__name__}) calls the attention function {calls} "
            f"times per layer")
    tail = "; cwcore decomposes one softmax map per layer call, and refuses rather than report one of them as the layer"
    if tokens is not None and all(q == tokens for q in queries):
        return (f"{head}, each time over all its {tokens} queries: it combines {calls} attention maps into one output "
                f"(as differential attention does, a_1 - lambda a_2), not one{tail}")
    if tokens is not None and sum(queries) == tokens and all(q == k for q, k in sizes):
        return (f"{head}, once per segment of its {tokens} tokens (query sizes {queries}, each attending only within "
                f"itself, as a vision tower does with one call per image): its attention is {calls} separate maps, "
                f"not one map over the sequence{tail}")
    return f"{head} (queries and keys per call {sizes}, for {tokens} tokens in the block's input){tail}"


#: Implementations whose function takes transformers' SDPA-style masks; a session keeps them as the model's
#: forward (untouched layers run them, observed layers return their output), since that is what the model computes.
FAST_IMPLEMENTATIONS = ("sdpa",)

#: Implementations a session accepts: eager (whose arithmetic cwcore's function follows) and those of
#: :data:`FAST_IMPLEMENTATIONS` (whose own output an observed layer is checked against). "cwcore": a nested session.
VERIFIED_IMPLEMENTATIONS = ("eager", *FAST_IMPLEMENTATIONS, "cwcore")


def _transformers_own(function) -> bool:
    return getattr(function, "__module__", "").startswith("transformers.")


def refuse_unverified_implementation(previous: Iterable[str | None], model_name: str,
                                     blocks: Iterable[AttentionBlock]) -> None:
    """Refuse a model whose attention function cwcore would replace by eager arithmetic without a check: one
    configured for another implementation (a function registered with ``AttentionInterface``, flex attention,
    flash attention), SDPA re-registered by the user, or a family whose module-level eager function is replaced."""
    for name in {p for p in previous if p is not None}:
        if name not in VERIFIED_IMPLEMENTATIONS:
            raise UnsupportedModelError(
                f"{model_name} is configured for {name!r} attention, which cwcore would replace by "
                "eager arithmetic without a check (it follows transformers' eager attention and checks itself against "
                "SDPA's output only); load the model with attn_implementation='eager' or 'sdpa' (or call "
                "model.set_attn_implementation('sdpa'))")
        if name in FAST_IMPLEMENTATIONS and not _transformers_own(ALL_ATTENTION_FUNCTIONS[name]):
            function = ALL_ATTENTION_FUNCTIONS[name]
            raise UnsupportedModelError(
                f"the {name!r} attention function is replaced by {getattr(function, '__qualname__', function)!r} "
                f"(module {getattr(function, '__module__', None)!r}), which cwcore cannot follow: it checks itself "
                "against transformers' own SDPA function only; restore that function, or load the model with "
                "attn_implementation='eager'")
        if name == "eager":
            for block in blocks:
                home = sys.modules.get(type(block.module).__module__)
                function = getattr(home, "eager_attention_forward", None)
                if function is not None and function.__module__ != home.__name__ and not _transformers_own(function):
                    raise UnsupportedModelError(
                        f"{home.__name__}.eager_attention_forward is replaced by {function.__qualname__!r} (module "
                        f"{function.__module__!r}): the model computes that function, and cwcore would replace it "
                        "by transformers' eager arithmetic; restore transformers' function, or load the model with "
                        "attn_implementation='sdpa'")


def refuse_training(model: nn.Module) -> None:
    """Refuse a model with a module in ``train()`` mode, naming the reason it really has: dropout where it has any
    (every forward pass a random perturbation of the model's computation), else train-time behaviour in general."""
    training = [name or type(model).__name__ for name, module in model.named_modules() if module.training]
    if not training:
        return
    dropout = any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()) or getattr(
        getattr(model, "config", None), "attention_dropout", 0)
    why = ("its dropout changes every forward pass, so a decomposition or an intervention would describe a random "
           "perturbation rather than the model's computation" if dropout else "a module may compute otherwise in "
           "training (dropout, batch statistics), and cwcore decomposes the model's inference computation")
    raise UnsupportedModelError(f"{type(model).__name__} is in train() mode ({len(training)} modules, e.g. "
                                f"{training[0]!r}): {why}; call model.eval() first")


def fast_path(previous: Iterable[str | None]):
    """The model's own attention function (SDPA) where its configs name one fast implementation, else None:
    untouched layers run it, observed layers return its output (checked against cwcore's), transformed layers
    cwcore's. None: every layer runs cwcore's function, the model's eager arithmetic."""
    names = {p for p in previous if p is not None}
    if len(names) != 1 or not names <= set(FAST_IMPLEMENTATIONS):
        return None
    return ALL_ATTENTION_FUNCTIONS[names.pop()]  # what the model's own forward looks up (transformers' public mapping)


def refuse_nested(model_name: str, shared_blocks: Iterable[set]) -> None:
    """Refuse a session on blocks that one of this thread's active sessions holds (``shared_blocks``: the blocks
    each active session shares with the new one): its hooks and counts would mix with the other's."""
    if any(shared_blocks):
        raise UnsupportedModelError(
            f"a cwcore call on {model_name} inside another on the same model (decompose inside an intervene block, "
            "say): one session per model at a time; inside intervene, read the intervened layers with its observers=")


def changed_output(block: AttentionBlock, result, projected: torch.Tensor | None) -> str | None:
    """Why the block's result is not its output projection's result ``projected`` (a hook on the block, a step after
    W_O such as ALBERT's residual and norm), measured; None where it is. A decomposition of the projection's output
    is exact either way, but what the block adds to the residual stream is then another vector (the direct logit
    attribution refuses such a layer)."""
    returned = result[0] if isinstance(result, tuple) else result
    if projected is None or returned is projected or not isinstance(returned, torch.Tensor):
        return None
    if returned.numel() == projected.numel():
        returned = returned.reshape(projected.shape)
        if torch.equal(returned, projected):
            return None
        difference = float((returned.float() - projected.float()).norm() / projected.float().norm().clamp_min(1e-30))
        measured = f"relative difference {difference:.3g}"
    else:
        measured = f"shape {tuple(returned.shape)} against {tuple(projected.shape)}"
    return (f"{block_label(block.module)} returns another tensor than its output projection's result ({measured}): a "
            "step after W_O (a hook on the block?) changes what the block adds to the residual stream")
