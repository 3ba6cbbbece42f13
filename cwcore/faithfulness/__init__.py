"""Faithfulness of attribution metrics by causal intervention (the paper's section 'Faithfulness by causal intervention').

Rank the terms alpha^h_ij v~^h_j of every attention layer by a metric, remove a fraction r of them
(zero the post-softmax probabilities, no renormalisation: :func:`cwcore.intervene`) and measure how
much perplexity rises: **comprehensiveness** removes the *most* important fraction (a more faithful
metric raises PPL more), **sufficiency** the *least* important (it raises PPL less).

``metric=`` takes a registered method's name (the ladder, ``random``, ``value_zeroing``, ``rollout``,
``contribution_rollout``, ``alti``, ``grad_x_input``; add one with :func:`register_method`), a
callable ``fn(layer_decomposition=..., **context)`` or precomputed scores (:mod:`~cwcore.faithfulness.methods`).
Entry points: :func:`faithfulness_curve` (a :class:`FaithfulnessResult`), :func:`downstream_eval`
(MMLU, WinoGrande, BoolQ), :func:`aopc`, :func:`ladder_comparison`; the command line
``python -m cwcore.faithfulness --model smollm2-135m --data gsm8k --out results/`` writes tidy CSVs.

Protocol defaults (each a keyword argument) and why
----------------------------------------------------
``unit="head_key"``
    rank (head, key) pairs jointly per query: within one head's row the ladder's rungs rank alike, so
    they only separate when a ranking spans heads. With ``kind="inter"`` and ``scope="row"`` rungs 2 and
    3 still rank identically (||o_i|| is shared by the heads); identical rankings are computed once.
``scope="row"``
    one ranking per query row, every query losing the same fraction of its own terms; ``"layer"``
    averages a unit's scores over the queries that see it and removes it from every query.
``layers=None``
    all layers, as in the paper.
``keep_first_token=True``
    the first token (the attention sink) is never removed: raw attention always ranks it first and
    removing it alone moves perplexity most, which would make comprehensiveness a test of "does the
    metric rank the sink first".
``scores="clean"``
    scores from one decomposition of the clean run, reused for every point; ``"live"`` ranks layer l
    on the state the removals below it produced (~2.5x slower).
``kind="inter"``
    contribution weights relative to the combined output o_i, the paper's token-level quantity.
``importance="signed"``
    rank by the value, so the most negative (destructive) terms are least important; ``"absolute"``: by ``|score|``.
candidates
    causal keys, real tokens, inside the sliding window, first token excluded; ties keep index order,
    NaN scores count as least important.
``ratios``
    fractions of each group's candidates, k(r) = floor(r n + 1/2) (r n in float64: a decimal half such as
    0.7 x 45 may round down); ratio 0 is not run (its delta is 0).

Statistics: per sequence NLL (mean over its next-token predictions) and PPL = exp(NLL); deltas are
intervened minus clean per sequence. Intervals are percentile bootstraps over documents (blocks of
one ``document`` averaged first), with the same resamples for every point. ``delta_nll`` (Delta
log-PPL) is what :func:`aopc` and :func:`ladder_comparison` summarise: Delta PPL explodes when most
terms are removed.

Speed: per batch one clean pass computes every metric's selection buckets layer by layer, then one
forward per (metric, mode, ratio) point with fixed masks, under ``torch.inference_mode()``; inside
:func:`cwcore.cache.caching` each (batch, point) piece is cached (:class:`cwcore.runs.PieceStore`)."""

from __future__ import annotations

import sys as _sys

_asked = getattr(_sys, "orig_argv", [])  # the module after -m: this package, not one below it (a gone one)
if _sys.argv[:1] == ["-m"] and {"-h", "--help"} & set(_sys.argv[1:]) and "-m" in _asked[:-1] and \
        _asked[_asked.index("-m") + 1] in (__name__, f"{__name__}.__main__"):
    # ``python -m cwcore.faithfulness --help`` imports this package first: answer without importing torch
    from .cli import parser as _parser

    _parser().print_help()
    raise SystemExit(0)

from ..runs import model_fingerprint
from .cli import main
from .downstream import downstream_eval
from .lm import faithfulness_curve
from .result import FaithfulnessResult
from .protocol import DEFAULT_METRICS, DEFAULT_RATIOS, KINDS, LADDER, MetricSpec, Protocol, parse_metric
from .ranking import MODES, SCOPES, UNITS
from .summary import aopc, ladder_comparison, method_pairs, random_baseline, summarize, summarize_downstream
from .methods import available_methods, method_scores, register_method
from . import methods

__all__ = ["DEFAULT_RATIOS", "DEFAULT_METRICS", "LADDER", "KINDS", "MODES", "SCOPES", "UNITS", "MetricSpec",
           "Protocol", "parse_metric", "faithfulness_curve", "FaithfulnessResult", "downstream_eval", "summarize",
           "summarize_downstream", "aopc", "ladder_comparison", "method_pairs", "random_baseline",
           "register_method", "available_methods", "method_scores", "model_fingerprint", "methods", "main"]
