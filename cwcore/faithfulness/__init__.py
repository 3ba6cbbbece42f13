"""Faithfulness of attribution metrics by causal intervention (the paper's section 'Faithfulness by causal intervention').

Rank the terms alpha^h_ij v~^h_j of every attention layer by a metric, remove a fraction r of them
(zero the post-softmax probabilities, no renormalisation; see :func:`cwcore.intervene`) and measure how
much the model's perplexity rises:

- **comprehensiveness** removes the *most* important fraction: a more faithful metric raises PPL more;
- **sufficiency** removes the *least* important fraction: a more faithful metric raises PPL less.

Any ranking can be evaluated: ``metric=`` takes a registered method's name (the ladder, ``random``,
``value_zeroing``, ``rollout``, ``contribution_rollout``, ``alti``, ``grad_x_input``; add one with
:func:`register_method`), a callable ``fn(layer_decomposition=..., **context)`` or precomputed scores
(see :mod:`~cwcore.faithfulness.methods`).

Entry points: :func:`faithfulness_curve` (language modelling; returns a :class:`FaithfulnessResult`), :func:`downstream_eval` (MMLU,
WinoGrande, BoolQ: gold-answer perplexity and accuracy), :func:`aopc` (area over the curve) and
:func:`ladder_comparison` (paired differences between rungs of the geometric ladder). The command
line ``python -m cwcore.faithfulness --model smollm2-135m --data gsm8k --out data/results/`` writes
tidy CSVs.

Modules, one concept each: :mod:`~cwcore.faithfulness.protocol` (the choices below, metric names),
:mod:`~cwcore.faithfulness.methods` (the registry of attribution methods),
:mod:`~cwcore.faithfulness.ranking` (candidates, ranks, removal masks), :mod:`~cwcore.faithfulness.sweep`
(the engine: clean pass, points, cached pieces), :mod:`~cwcore.faithfulness.lm` and
:mod:`~cwcore.faithfulness.downstream` (the two scorers), :mod:`~cwcore.faithfulness.summary`
(curves, AOPC, ladder tests), :mod:`~cwcore.faithfulness.layers` (one layer at a time, from the
clean residual stream), :mod:`~cwcore.faithfulness.cli` (the command line). The book's own evidence design (its main
protocols, ratio ranges and importance signs) lives with the book's production, not in the library.

Protocol defaults (each a keyword argument) and why
----------------------------------------------------
``unit="head_key"``
    rank (head, key) pairs jointly for each query. Within one head's row value-weighted attention and
    its output-normalised version rank identically, so the ladder only separates its rungs when a
    ranking spans heads (or queries). Caveat measured here: with ``kind="inter"`` the normaliser
    ||o_i|| is shared by all heads of a query, so under ``unit="head_key", scope="row"`` rungs 2 and 3
    still rank identically (they differ with ``kind="intra"``, or with ``scope="layer"``). Identical
    rankings are detected and computed once (see ``deduplicate``).
``scope="row"``
    one ranking per query row: every query loses the same fraction of its own terms, the closest
    reading of "remove alpha_ij v~_j from o_i". ``"layer"`` averages a unit's scores over the queries
    that see it and removes the selected units from every query.
``layers=None``
    all layers, as in the paper.
``keep_first_token=True``
    the first real token of each sequence is never removed. It is the attention sink: in every model
    we looked at it receives most of the attention mass, so raw attention always ranks it first,
    and removing it alone moves perplexity more than anything else. Letting it be removed turns
    comprehensiveness into "does the metric rank the sink first" (section 6 studies the sink
    separately). ``keep_first_token=False`` is available to show how much that matters.
``scores="clean"``
    scores come from one decomposition of the unmodified run and are reused for every ratio, metric
    and mode (fast: one sort per metric). ``"live"`` recomputes them inside each intervened run, so
    layer l is ranked on the state that the removals in layers < l produced (one decomposition per
    point: ~2.5x slower per point).
``kind="inter"``
    contribution weights relative to the combined output o_i (sum to 1 over heads and keys), the
    paper's token-level quantity. Names like ``"contribution_intra"`` pick the other kind per metric.
``importance="signed"``
    rank by the metric's value. Contribution weights can be negative (destructive interference):
    signed ranking treats the most negative terms as least important. ``"absolute"`` ranks by ``|score|``.
candidates
    key <= query (causal), both real tokens, inside the layer's sliding window, first token excluded
    as above. Ties keep index order; NaN scores (||o_i|| = 0) count as least important.
``ratios``
    fractions of each group's candidates; k(r) = floor(r n + 1/2). Ratio 0 removes nothing and is not
    run: its intervened run would be bit-identical to the clean one, so its delta is exactly 0.

Statistics
----------
Per sequence: NLL = mean negative log-likelihood over its next-token predictions (position t predicts
token t+1, both real), PPL = exp(NLL). Deltas are intervened minus clean, per sequence, then averaged.
Confidence intervals are percentile bootstraps over documents (a table with a ``document`` column, e.g.
from :func:`cwcore.data.document_blocks`, is averaged over each document's blocks first: a cluster
bootstrap; without the column each sequence is its own document) (:func:`cwcore.stats.bootstrap_ci`,
``n_bootstrap`` resamples drawn with ``numpy.random.default_rng(seed)``; the same resamples for every
point, so intervals are comparable, paired and deterministic). Ladder verdicts use the project's one
vocabulary (:func:`cwcore.stats.verdict`: holds / contradicted / inconclusive / not measured).
Delta PPL explodes when most terms are removed (a destroyed model has PPL in the
thousands), so ``delta_nll`` = Delta log-PPL is reported too and is what :func:`aopc` and
:func:`ladder_comparison` summarise by default.

Speed
-----
Per batch of sequences: one clean pass observes every layer (an observer of
:class:`cwcore.core.attention.AttentionSession`) and, layer by layer (nothing larger than one layer's
geometry is kept), computes the selection buckets of every metric
(:func:`cwcore.faithfulness.ranking.selection`: one uint8 per term and mode); then one forward
per (metric, mode, ratio) point with fixed boolean masks. Everything runs under ``torch.inference_mode()``.
Inside :func:`cwcore.cache.caching` (caching is opt-in) results are cached per (batch, metric, mode,
ratio) piece with :class:`cwcore.runs.PieceStore`: the
key holds :func:`cwcore.runs.model_fingerprint`, the protocol and the producing code, and each piece
is named by its batch's content (token ids, padding, sequence ids), so a rerun is free, an interrupted
run resumes, and a longer run over the same first sequences reuses the shorter run's batches.
"""

from __future__ import annotations

import sys as _sys

if _sys.argv[:1] == ["-m"] and {"-h", "--help"} & set(_sys.argv[1:]):
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

__all__ = [
    "DEFAULT_RATIOS",
    "DEFAULT_METRICS",
    "LADDER",
    "KINDS",
    "MODES",
    "SCOPES",
    "UNITS",
    "MetricSpec",
    "Protocol",
    "parse_metric",
    "faithfulness_curve",
    "FaithfulnessResult",
    "downstream_eval",
    "summarize",
    "summarize_downstream",
    "aopc",
    "ladder_comparison",
    "method_pairs",
    "random_baseline",
    "register_method",
    "available_methods",
    "method_scores",
    "model_fingerprint",
    "methods",
    "main",
]
