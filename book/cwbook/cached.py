"""The book's calls of the library's sweeps, with the book's conventions: caching on by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from cwcore.cache import caching
from cwcore.faithfulness.downstream import downstream_eval
from cwcore.faithfulness.layers import per_layer_curve
from cwcore.faithfulness.lm import DEFAULT_MAX_LENGTH, faithfulness_curve


def per_sequence_curve(model, tokenizer, texts, metric: Any = None, ratios: float | Sequence[float] | None = None,
                       mode: str | Sequence[str] | None = None, *, protocol=None, n_bootstrap: int = 1000,
                       confidence: float = 0.95, batch_size: int = 16, max_length: int | None = DEFAULT_MAX_LENGTH,
                       padding_side: str = "right", per_sequence: bool = True, deduplicate: bool = True,
                       cache: bool = True, cache_dir: str | Path | None = None, progress: bool = True,
                       first_sequence: int = 0, **protocol_keywords) -> pd.DataFrame:
    """:func:`cwcore.faithfulness.faithfulness_curve` inside :func:`cwcore.cache.caching` (``cache``,
    ``cache_dir``): its ``.per_sequence`` table (``per_sequence=False``: its ``.table``)."""
    if isinstance(first_sequence, bool) or not isinstance(first_sequence, int) or first_sequence < 0:
        raise ValueError(f"first_sequence must be a non-negative int, got {first_sequence!r}")
    ids = None
    if first_sequence:
        ids = range(first_sequence, first_sequence + _count(texts))
    with caching(cache_dir, enabled=bool(cache)):
        result = faithfulness_curve(model, tokenizer, texts, metric, ratios, mode, protocol=protocol,
                                    n_bootstrap=n_bootstrap, confidence=confidence, batch_size=batch_size,
                                    max_length=max_length, padding_side=padding_side, deduplicate=deduplicate,
                                    progress=progress, sequence_ids=ids, **protocol_keywords)
    return result.per_sequence if per_sequence else result.table


def _count(texts) -> int:
    """How many sequences ``texts`` holds (as :func:`faithfulness_curve` reads them)."""
    if isinstance(texts, str):
        return 1
    if isinstance(texts, dict) and "input_ids" in texts:
        ids = texts["input_ids"]
        return len(ids) if not hasattr(ids, "dim") or ids.dim() == 2 else 1
    if hasattr(texts, "dim"):
        return texts.shape[0] if texts.dim() == 2 else 1
    return len(texts)


def cached_downstream_eval(model, tokenizer, dataset, metric=None, ratios=None, mode=None, *, cache: bool = True,
                           cache_dir: str | Path | None = None, **kwargs) -> pd.DataFrame:
    """:func:`cwcore.faithfulness.downstream_eval` inside :func:`cwcore.cache.caching` (``cache``, ``cache_dir``)."""
    with caching(cache_dir, enabled=bool(cache)):
        return downstream_eval(model, tokenizer, dataset, metric, ratios, mode, **kwargs)


def cached_per_layer_curve(model, tokenizer, texts, metric=None, ratios=None, mode=None, *, cache: bool = True,
                           cache_dir: str | Path | None = None, **kwargs) -> pd.DataFrame:
    """:func:`cwcore.faithfulness.layers.per_layer_curve` inside :func:`cwcore.cache.caching` (``cache``, ``cache_dir``)."""
    with caching(cache_dir, enabled=bool(cache)):
        return per_layer_curve(model, tokenizer, texts, metric, ratios, mode, **kwargs)
