"""Attribution methods the faithfulness protocol can rank by: one registry, one function per method.

A method is called once per intervened layer as ``fn(layer_decomposition=..., **context)`` and
returns scores ``[batch, head, query, key]`` or token-level ``[batch, query, key]``, which are spread
over heads (every head of a key gets the key's score). One module per family (:mod:`.ladder`,
:mod:`.value_zeroing`, :mod:`.rollout`, :mod:`.alti`, :mod:`.gradient`); adding one::

    @register_method("my_score", cost="no extra forward", title="my score")
    def my_score(layer_decomposition, **context):
        return layer_decomposition.attention * layer_decomposition.value_norm[:, :, None]

A callable passed as ``metric=fn`` works the same way (its identity, :func:`method_key`, is in the
cache keys). Context keywords a method may take by name: ``layer``, ``call``
(:class:`cwcore.core.attention.LayerCall`), ``model``, ``input_ids`` and ``attention_mask`` ``[rows,
length]``, ``positions [rows, length]``, ``groups [rows]``, ``candidates [rows, 1, query, key]`` bool,
``kind``, ``seed``, ``state`` (a dict shared by the layers of one forward) and, for methods registered
with ``needs``: ``block_input`` (the decoder layer's ``(args, kwargs)``) and ``output_gradient``
``[rows, length, model]`` (d total log-likelihood / d attention block output).

Costs per batch: ``value_zeroing`` (Mohebbi et al. 2023) ~Q/2 forwards; ``rollout`` (Abnar and
Zuidema 2020), ``contribution_rollout`` and ``alti`` (Ferrando et al. 2022) no extra forward;
``grad_x_input`` ~3 forwards."""

from __future__ import annotations

from .registry import (  # noqa: F401  (the public interface, and _REGISTRY for tests that clean up)
    _REGISTRY, Method, ScoreContext, as_method, available_methods, code_identity, colours, display_names, get_method,
    method_key,
    method_scores, output_gradients, precomputed, register_method, scoring,
)
from . import ladder, value_zeroing, rollout, alti, gradient  # noqa: E402,F401  (each registers its methods)
from .ladder import random, random_controls  # noqa: F401
from .projection import CHUNK_BYTES  # noqa: F401

__all__ = [
    "Method", "register_method", "get_method", "available_methods", "method_key", "as_method", "code_identity",
    "precomputed", "ScoreContext", "scoring", "method_scores", "output_gradients", "display_names", "colours",
    "BUILT_IN",
]

#: the built-in methods beyond the ladder and the random control
BUILT_IN = ("value_zeroing", "rollout", "contribution_rollout", "alti", "grad_x_input")
