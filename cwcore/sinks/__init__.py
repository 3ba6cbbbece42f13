"""The value geometry of attention sinks (the paper's section 'Value geometry of attention sinks'), as five analyses returning tidy tables.

Every analysis is ``analysis(model, tokenizer, data, **options)``: its own options and the run options
(``block_size=None`` (text: blocks of 128 tokens), ``num_sequences=None, add_bos=None, batch_size=8,
progress=True, compute_dtype=float32``), all fields of one frozen dataclass, :class:`SinkOptions`, each declared
once with its default and check; ``help(cwcore.sinks.sink_rates)`` lists a function's options.

``data`` is text (a :class:`datasets.Dataset` with a ``text`` column or an iterable of strings, cut
into blocks by :func:`cwcore.data.lm_blocks`, BOS prepended as ``add_bos`` says) or ready unpadded
token blocks (a ``[sequence, position]`` tensor, numpy array or list of equal-length id lists, rows with
``input_ids``, or a tokenizer's output with ``input_ids`` and an all-ones ``attention_mask``; ``tokenizer``
may be None).

Conventions shared by all analyses:

* The **sink** is key position 0 (:data:`cwcore.sinks.engine.SINK_POSITION`), checked rather than
  assumed: :func:`sink_rates` reports which key takes the most attention. **Tail** tokens are keys
  1..i of query i. **Query 0 is excluded** (its only key is itself, alpha_00 = 1 trivially).
* Every layer has a **layer type**, "sliding" or "global"; pooled claims over heads use a cluster
  bootstrap by layer. A learned sink logit's mass (GPT-OSS) is ``learned_sink_mass``.
* Projected values v~^h_j = W_O^h v^h_j and every inner product between them are computed in head
  space with the Gram matrix G_h = W_O^h^T W_O^h; nothing ``[query, key, model]``-sized is made.
* Inside :func:`cwcore.cache.caching` each batch's raw material is a cached piece (namespace
  ``sinks-<analysis>``), so a rerun or an interrupted run resumes.
* Random choices use ``numpy.random.default_rng([seed, sequence index])``: results do not depend
  on ``batch_size``.

:func:`run_analyses` runs several analyses on one clean pass per batch; :mod:`~cwcore.sinks.engine`
is the extension interface (its docstring says how to write an analysis). The command line writes
``sinks_<table>_<model>_<data>.csv`` plus a summary (:func:`summarize`)::

    python -m cwcore.sinks --model smollm2-135m --data gsm8k --num-sequences 32 --out my-results/"""

from __future__ import annotations

import sys as _sys

_asked = getattr(_sys, "orig_argv", [])  # the module after -m: this package, not one below it (a gone one)
if _sys.argv[:1] == ["-m"] and {"-h", "--help"} & set(_sys.argv[1:]) and "-m" in _asked[:-1] and \
        _asked[_asked.index("-m") + 1] in (__name__, f"{__name__}.__main__"):
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

__all__ = ["ANALYSES", "CONDITIONS", "ConvexityTables", "DecompositionTables", "SemanticConeTables", "SinkOptions",
           "UNMEASURED", "sink_anti_alignment", "combine_verdicts", "cone_points", "sink_convexity",
           "model_fingerprint", "sink_semantic_cone", "sink_decomposition", "share_ci", "sink_rates", "summarize",
           "token_blocks", "verdict", "vertex_intervals", "layer_profile", "suppression", "main", "run_analyses"]
