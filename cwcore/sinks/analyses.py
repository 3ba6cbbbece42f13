"""The registered analyses, in order, and :func:`run_analyses` (several analyses, one forward pass per batch).

Importing this module registers the five analyses; a new analysis is a new module
``cwcore/sinks/<name>.py`` ending in ``register(Analysis(...))`` plus its name in the import below.
"""

from __future__ import annotations

import importlib
from typing import Iterable

import torch

from .engine import _COMMON, REGISTRY, _run

# importing the analysis modules registers them, in this order (the order of ANALYSES, of the CSVs,
# of the summary rows and of the claims); by name, because the package rebinds some of these names
# to the analysis functions (cwcore.sinks.convexity is the function convexity)
_MODULES = ("rates", "decomposition", "anti_alignment", "convexity", "semantic_cone")
for _name in _MODULES:
    importlib.import_module(f"{__package__}.{_name}")

__all__ = ["ANALYSES", "run_analyses"]

#: the names of the registered analyses
ANALYSES = tuple(REGISTRY)


def run_analyses(
    model,
    tokenizer,
    data,
    analyses: Iterable[str] = ANALYSES,
    *,
    eps: float = 0.3,
    kind: str = "intra",
    quantile_sample: int = 128,
    sample_size: int = 2000,
    bins: int = 10,
    fit_on: str = "norm",
    min_range: float = 0.05,
    heads: str = "all",
    threshold: float = 0.3,
    quantiles: int = 5,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
    raw: bool = False,
    precompute: Iterable[str] = (),
) -> dict:
    """Several analyses sharing one clean forward pass per batch; options as in the single functions.

    Returns ``{name: result}`` with the results of :func:`sink_rates` (``rates``),
    :func:`sink_decomposition`, :func:`anti_alignment`, :func:`convexity` and :func:`semantic_cone`,
    equal to what those functions return (they share the cache: calling one afterwards reads it).
    With ``raw=True`` the result also holds ``"raw"``: ``{name: {part: DataFrame}}``, the per-point
    material the tables are made from (e.g. for intervals over sequences with :func:`cwcore.stats.cluster_bootstrap`;
    :func:`cone_points` bins the semantic cone's). ``raw`` is not part of the cache key.

    ``precompute``: further analyses whose raw material is computed in the same forward passes and
    cached, without building their tables (which can take longer than reading them): a later call for
    them with the same options reads the cache. Several callers that each need some of the analyses
    (the book's sink chapters) can pass ``precompute=ANALYSES`` so that whichever runs first does one
    shared pass for all of them.
    """
    analyses = list(analyses)
    precompute = [a for a in dict.fromkeys(precompute) if a not in analyses]
    unknown = sorted((set(analyses) | set(precompute)) - set(REGISTRY))
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {', '.join(REGISTRY)}")
    if kind not in ("intra", "inter"):
        raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")
    if heads not in ("all", "sink"):
        raise ValueError(f"heads must be 'all' or 'sink', not {heads!r}")
    if fit_on not in ("norm", "squared_norm"):
        raise ValueError(f"fit_on must be 'norm' or 'squared_norm', not {fit_on!r}")
    common = {k: v for k, v in locals().items() if k in _COMMON}
    options = dict(eps=eps, kind=kind, quantile_sample=quantile_sample, sample_size=sample_size, bins=bins,
                   fit_on=fit_on, min_range=min_range, heads=heads, threshold=threshold, quantiles=quantiles,
                   seed=seed)
    parts, blocks = _run(model, tokenizer, data, [REGISTRY[a].spec(options) for a in analyses + precompute],
                         **common)
    results = {name: REGISTRY[name].tables(parts[name], blocks, **options) for name in analyses}
    if raw:
        results["raw"] = {name: parts[name] for name in analyses}
    return results
