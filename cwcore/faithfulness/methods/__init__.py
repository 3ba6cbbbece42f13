"""Attribution methods the faithfulness protocol can rank by: one registry, one function per method.

Every ranking the sweep uses is a *method*: a function called once per intervened layer as
``fn(layer_decomposition=<LayerDecomposition of that layer>, **context)`` that returns scores
``[batch, head, query, key]`` or token-level scores ``[batch, query, key]``. **Token-level scores are
spread over heads by giving every head of a key the same score**: under ``unit="head_key"`` the
ranking is then by token (the heads of one key are adjacent in the order, ties broken by head index),
under ``unit="token"`` it is the token ranking itself. Named methods live in one registry
(:mod:`~cwcore.faithfulness.methods.registry`), one module per family (:mod:`.ladder`: the ladder and
the random control, :mod:`.value_zeroing`, :mod:`.rollout`, :mod:`.alti`, :mod:`.gradient`); adding
one is one function in a new module of this package (imported below) or anywhere::

    @register_method("my_score", cost="no extra forward", title="my score")
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

from .registry import (  # noqa: F401  (the public interface, and _REGISTRY for tests that clean up)
    _REGISTRY, Method, ScoreContext, as_method, available_methods, colours, display_names, get_method, method_key,
    method_scores, output_gradients, precomputed, register_method, scoring,
)
from . import ladder, value_zeroing, rollout, alti, gradient  # noqa: E402,F401  (each registers its methods)
from .ladder import random, random_controls  # noqa: F401
from .projection import CHUNK_BYTES  # noqa: F401

__all__ = [
    "Method", "register_method", "get_method", "available_methods", "method_key", "as_method",
    "precomputed", "ScoreContext", "scoring", "method_scores", "output_gradients", "display_names", "colours",
    "BUILT_IN",
]

#: the built-in methods beyond the ladder and the random control
BUILT_IN = ("value_zeroing", "rollout", "contribution_rollout", "alti", "grad_x_input")
