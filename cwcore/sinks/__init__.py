"""The value geometry of attention sinks (the paper's section 'Value geometry of attention sinks'), as five analyses returning tidy tables.

Every analysis has the same signature, ``analysis(model, tokenizer, data, **options)``: its own options
and the run options (``block_size=128, num_sequences=None, add_bos=None, batch_size=8,
progress=True, compute_dtype=float32``), all fields of one frozen dataclass,
:class:`SinkOptions`, where each option is declared once with its default and its check (``eps`` must
be a finite number in (0, 1), ...); ``help(cwcore.sinks.sink_rates)`` lists a function's options.

``data`` is text (a :class:`datasets.Dataset` with a ``text`` column or an iterable of strings, cut
into ``num_sequences`` blocks of ``block_size`` tokens by :func:`cwcore.data.lm_blocks`, with a BOS
token prepended when ``add_bos`` says so, None = the tokenizer's default), or ready token blocks: a
``[sequence, position]`` integer tensor, or rows with ``input_ids`` (the output of ``lm_blocks``).
``tokenizer`` may be None for ready blocks. Blocks must be unpadded (the sink is position 0).

Conventions shared by all analyses:

* The **sink** is key position 0 (the BOS token when one is prepended, otherwise the first text
  token): :data:`cwcore.sinks.engine.SINK_POSITION`, carried to every collector as
  ``LayerState.sink_position``. It is the paper's reading, and it is checked rather than assumed:
  :func:`sink_rates` reports per head which key position takes the most attention, the strongest later
  key, and the attention each token class receives (BOS/first token, special, newline, punctuation,
  word) against uniform causal attention. **Tail** tokens are keys 1..i of query i.
* Every layer has a **layer type**, "sliding" or "global" (:func:`cwcore.sinks.engine.layer_types`, from
  ``config.layer_types`` or the module's sliding window), in the tables that pool heads; pooled claims
  over heads use a cluster bootstrap by layer (:func:`cwcore.sinks.intervals.pooled_by_layer`). A
  learned sink logit's mass (GPT-OSS) is reported as ``learned_sink_mass``.
* **Query 0 is excluded** everywhere: in a decoder its only key is itself, so alpha_00 = 1 trivially
  and it says nothing about sink behaviour. (``sink_rate_all_queries`` in :func:`sink_rates` keeps it,
  as Gu et al. 2025 do; with 128 positions the two differ by at most 1/128.)
* Projected values v~^h_j = W_O^h v^h_j, head outputs o^h_i = sum_j alpha_ij v~^h_j and every inner
  product between them are computed in head space with the Gram matrix G_h = W_O^h^T W_O^h
  (:mod:`cwcore.core.geometry`); nothing ``[query, key, model]``-sized is materialised.
* Work is batched (``batch_size`` sequences a forward pass, with a tqdm bar); the raw per-batch
  material is cached as :class:`cwcore.runs.PieceStore` pieces (namespace ``sinks-<analysis>``,
  keyed by :func:`cwcore.runs.model_fingerprint`, every option, the batch's tokens and the source of
  this subpackage, the core and the statistics), so a rerun or an interrupted run resumes;
  inside :func:`cwcore.cache.caching` (caching is opt-in).
* Random choices (samples, the control token) use ``numpy.random.default_rng([seed, sequence index])``
  per sequence: results are deterministic and do not depend on ``batch_size`` (up to float rounding).

:func:`run_analyses` runs several analyses on one clean forward pass per batch (they fill the same
cache as the single functions). The analyses observe each layer through
:class:`cwcore.core.attention.AttentionSession` (observers read, transforms remove terms or
renormalise rows for ``sink_renorm``); see :mod:`cwcore.sinks.engine`.

Layout: :mod:`~cwcore.sinks.engine` (the extension interface: options, blocks, layer state, registry,
batch loop; its docstring says how to write an analysis), one module per
analysis (:mod:`~cwcore.sinks.rates`, :mod:`~cwcore.sinks.decomposition`,
:mod:`~cwcore.sinks.anti_alignment`, :mod:`~cwcore.sinks.convexity`,
:mod:`~cwcore.sinks.semantic_cone`: each one registered :class:`~cwcore.sinks.engine.Analysis` with
its collector, tables, summary rows, claims and options), :mod:`~cwcore.sinks.analyses` (the registry's
order, :class:`SinkOptions`, :func:`run_analyses`), :mod:`~cwcore.sinks.claims` (the chapters' claims tables),
:mod:`~cwcore.sinks.intervals` (the claim rows and the intervals they read, over :mod:`cwcore.stats`),
:mod:`~cwcore.sinks.summary` and :mod:`~cwcore.sinks.cli`.

The command line runs all five on a named model and data set and writes small CSVs
``sinks_<table>_<model>_<data>.csv`` plus ``sinks_summary_<model>_<data>.csv`` (:func:`summarize`)::

    python -m cwcore.sinks --model smollm2-135m --data gsm8k --num-sequences 32 --out my-results/
"""

from __future__ import annotations

import sys as _sys

if _sys.argv[:1] == ["-m"] and {"-h", "--help"} & set(_sys.argv[1:]):
    # ``python -m cwcore.sinks --help`` imports this package first: answer without importing torch
    from .cli import parser as _parser

    _parser().print_help()
    raise SystemExit(0)

from .analyses import ANALYSES, SinkOptions, run_analyses
from . import suppression
from .anti_alignment import layer_profile, sink_anti_alignment
from .cli import main
from .convexity import ConvexityTables, sink_convexity, vertex_intervals
from .decomposition import DecompositionTables, sink_decomposition
from .engine import model_fingerprint, token_blocks
from .intervals import UNMEASURED, combine_verdicts, share_ci, verdict
from .rates import sink_rates
from .semantic_cone import CONDITIONS, SemanticConeTables, cone_points, sink_semantic_cone
from .summary import summarize

__all__ = [
    "ANALYSES",
    "CONDITIONS",
    "ConvexityTables",
    "DecompositionTables",
    "SemanticConeTables",
    "SinkOptions",
    "UNMEASURED",
    "sink_anti_alignment",
    "combine_verdicts",
    "cone_points",
    "sink_convexity",
    "model_fingerprint",
    "sink_semantic_cone",
    "sink_decomposition",
    "share_ci",
    "sink_rates",
    "summarize",
    "token_blocks",
    "verdict",
    "vertex_intervals",
    "layer_profile",
    "suppression",
    "main",
    "run_analyses",
]
