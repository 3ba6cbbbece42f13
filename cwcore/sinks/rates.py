"""Analysis 1, sink rates: the attention the first token receives, and Gu et al.'s Sink_eps."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from .engine import _COMMON, Analysis, Collector, _Blocks, _concat, _grid, _np, register, run_one

__all__ = ["sink_rates"]


class _RatesCollector(Collector):
    """Piece ``alpha0``: sequence, layer, head, query (all, 0 included), alpha0 = alpha_i0."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows = []

    def on_layer(self, s):
        a0 = s.probs[:, :, :, 0]  # [b, h, q]
        cols = _grid(tuple(a0.shape), ("sequence", "head", "query"), {"sequence": self.start})
        self.rows.append(pd.DataFrame({"layer": np.full(a0.numel(), s.layer, np.int32), **cols,
                                       "alpha0": _np(a0).astype(np.float32)}))

    def finish(self, logits):
        return {"alpha0": _concat(self.rows)}


def sink_rates(
    model,
    tokenizer,
    data,
    *,
    eps: float = 0.3,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> pd.DataFrame:
    """Per (layer, head): the attention the first token receives, and Gu et al.'s Sink_eps.

    For head h and query i >= 1, a_i = alpha^h_i0. One row per (layer, head) with
    ``sink_rate`` (mean of a_i over queries 1..T-1 and sequences), ``sink_rate_std`` (its standard
    deviation over queries and sequences), ``sink_rate_sequence_std`` (standard deviation over sequences
    of each sequence's mean), ``q10``/``median``/``q90`` of a_i, ``sink_rate_all_queries`` (mean over all
    queries 0..T-1, Gu et al.'s convention, where a_0 = 1), ``is_sink_head`` (sink_rate > eps).
    Model-level columns, constant over rows: ``sink_eps`` (share of all heads with sink_rate > eps),
    ``sink_eps_all_queries`` (the same with Gu et al.'s rate), ``eps``, ``add_bos`` (True/False, NA for
    ready-made blocks), ``first_token_is_bos`` (share of sequences; NaN without a tokenizer with a BOS),
    ``num_sequences``, ``block_size``.
    """
    del seed  # nothing random; kept for the common signature
    common = {k: v for k, v in locals().items() if k in _COMMON}
    return run_one("rates", model, tokenizer, data, {"eps": eps}, common)


def _rates_table(points: pd.DataFrame, eps: float, blocks: _Blocks) -> pd.DataFrame:
    later = points[points["query"] >= 1]
    grouped = later.groupby(["layer", "head"])["alpha0"]
    table = pd.DataFrame({
        "sink_rate": grouped.mean(),
        "sink_rate_std": grouped.std(ddof=0),
        "sink_rate_sequence_std": later.groupby(["layer", "head", "sequence"])["alpha0"].mean()
        .groupby(["layer", "head"]).std(ddof=0),
        "q10": grouped.quantile(0.1),
        "median": grouped.median(),
        "q90": grouped.quantile(0.9),
        "sink_rate_all_queries": points.groupby(["layer", "head"])["alpha0"].mean(),
    }).reset_index()
    table["is_sink_head"] = table["sink_rate"] > eps
    table["sink_eps"] = float(table["is_sink_head"].mean())
    table["sink_eps_all_queries"] = float((table["sink_rate_all_queries"] > eps).mean())
    table["eps"] = eps
    table["add_bos"] = pd.array([blocks.add_bos] * len(table), dtype="boolean")
    table["first_token_is_bos"] = blocks.first_token_is_bos
    table["num_sequences"] = int(blocks.ids.shape[0])
    table["block_size"] = int(blocks.ids.shape[1])
    return table


def _tables(parts: dict, blocks: _Blocks, *, eps: float, **_) -> pd.DataFrame:
    return _rates_table(parts["alpha0"], eps, blocks)


def _summary(tables: dict, add) -> None:
    if "rates" in tables:
        r = tables["rates"]
        add("sink_rate", "sink_eps", r["sink_eps"].iloc[0])
        add("sink_rate", "sink_eps_all_queries", r["sink_eps_all_queries"].iloc[0])
        add("sink_rate", "mean_sink_rate", r["sink_rate"].mean())
        add("sink_rate", "median_sink_rate", r["sink_rate"].median())
        add("sink_rate", "first_token_is_bos", r["first_token_is_bos"].iloc[0])


ANALYSIS = register(Analysis("rates", _RatesCollector, _tables, stems=("rates",), summary=_summary))
