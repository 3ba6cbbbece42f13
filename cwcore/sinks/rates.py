"""Analysis 1, sink rates: the attention the first token receives, Gu et al.'s Sink_eps, and which key
positions take the attention mass (the sink found by statistics, not assumed)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from .engine import EPS, TOKEN_CLASSES, Analysis, Blocks, Collector, concat, flat, grid_columns, register
from .intervals import BOOK, claim_row, no_sink_heads, pooled_claim_rows, share_ci

__all__ = ["SINK_RATES", "SINK_POSITION_CLAIM", "sink_rates"]

#: the claims this analysis states (chapter 5); both are the book's, not the paper's (the paper's section 'Value geometry of attention sinks'
#: asks to *report* Sink_eps and reads position 0 as the sink; it claims neither)
SINK_RATES = "many heads are sink heads"
SINK_POSITION_CLAIM = "the sink is position 0"


class _RatesCollector(Collector):
    """Piece ``alpha0``: sequence, layer, head, query (all, 0 included), alpha0 = alpha_i0."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows, self.mass, self.layers = [], [], []

    def on_layer(self, s):
        a0 = s.probs[:, :, :, s.sink_position]  # [b, h, q]
        cols = grid_columns(tuple(a0.shape), ("sequence", "head", "query"), {"sequence": self.start})
        self.rows.append(pd.DataFrame({"layer": np.full(a0.numel(), s.layer, np.int32), **cols,
                                       "alpha0": flat(a0).astype(np.float32)}))
        mass = s.probs[:, :, 1:, :].mean(2)  # [b, h, k]: mean over queries >= 1 of alpha_ij (sums to 1 over k)
        self.mass.append(pd.DataFrame({"layer": np.full(mass.numel(), s.layer, np.int16),
                                       **grid_columns(tuple(mass.shape), ("sequence", "head", "key"), {"sequence": self.start}),
                                       "mass": flat(mass).astype(np.float32)}))
        learned = (s.learned_sink_mass[:, :, 1:].mean(-1) if s.learned_sink_mass is not None
                   else torch.full(a0.shape[:2], float("nan")))
        self.layers.append(pd.DataFrame({"layer": np.full(learned.numel(), s.layer, np.int32),
                                         **grid_columns(tuple(learned.shape), ("sequence", "head"), {"sequence": self.start}),
                                         "layer_type": s.layer_type, "learned_sink_mass": flat(learned).astype(float)}))

    def finish(self, logits):
        return {"alpha0": concat(self.rows), "mass": concat(self.mass), "layers": concat(self.layers)}


def _position_columns(mass: pd.DataFrame, blocks: Blocks) -> pd.DataFrame:
    """Per (layer, head): where the attention mass goes (see :func:`sink_rates`)."""
    by_key = mass.groupby(["layer", "head", "key"])["mass"].mean().reset_index()
    top = by_key.loc[by_key.groupby(["layer", "head"])["mass"].idxmax()].set_index(["layer", "head"])
    later = by_key[by_key["key"] >= 1]
    top_later = later.loc[later.groupby(["layer", "head"])["mass"].idxmax()].set_index(["layer", "head"])
    out = pd.DataFrame({"top_key": top["key"].astype(int), "top_key_mass": top["mass"],
                        "top_later_key": top_later["key"].astype(int), "top_later_mass": top_later["mass"]})
    classes = blocks.classes
    if classes is None:
        out["top_key_class"] = "unknown"
        for c in TOKEN_CLASSES:
            out[f"mass_{c}"] = out[f"uniform_{c}"] = np.nan
        return out.reset_index()
    seq, key = mass["sequence"].to_numpy(), mass["key"].to_numpy()
    cls = classes[seq, key]
    common = []  # the most frequent class at each position
    for column in classes.T:
        names, counts = np.unique(column, return_counts=True)
        common.append(str(names[np.argmax(counts)]))
    out["top_key_class"] = [common[k] for k in out["top_key"].to_numpy()]
    n_seq = mass["sequence"].nunique()
    T = classes.shape[1]
    # uniform causal attention: query i gives 1/(i+1) to each key j <= i; mean over queries 1..T-1
    uniform_key = np.array([sum(1 / (i + 1) for i in range(max(j, 1), T)) / (T - 1) for j in range(T)])
    for c in TOKEN_CLASSES:
        hit = cls == c
        out[f"mass_{c}"] = mass["mass"].where(hit, 0).groupby([mass["layer"], mass["head"]]).sum() / n_seq
        seqs = np.unique(seq)
        out[f"uniform_{c}"] = float(((classes[seqs] == c) * uniform_key[None]).sum(1).mean())
    return out.reset_index()


def _rates_table(points: pd.DataFrame, eps: float, blocks: Blocks, mass: pd.DataFrame | None = None,
                 layers: pd.DataFrame | None = None) -> pd.DataFrame:
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
    if layers is not None:
        per_head = layers.groupby(["layer", "head"]).agg(layer_type=("layer_type", "first"),
                                                        learned_sink_mass=("learned_sink_mass", "mean")).reset_index()
        table = table.merge(per_head, on=["layer", "head"], how="left")
    else:
        table["layer_type"], table["learned_sink_mass"] = "global", np.nan
    if mass is not None:
        table = table.merge(_position_columns(mass, blocks), on=["layer", "head"], how="left")
    table["is_sink_head"] = table["sink_rate"] > eps
    table["sink_eps"] = float(table["is_sink_head"].mean())
    table["sink_eps_all_queries"] = float((table["sink_rate_all_queries"] > eps).mean())
    table["eps"] = eps
    table["add_bos"] = pd.array([blocks.add_bos] * len(table), dtype="boolean")
    table["first_token_is_bos"] = blocks.first_token_is_bos
    table["num_sequences"] = int(blocks.ids.shape[0])
    table["block_size"] = int(blocks.ids.shape[1])
    return table


def _tables(parts: dict, blocks: Blocks, *, eps: float, **_) -> pd.DataFrame:
    return _rates_table(parts["alpha0"], eps, blocks, parts.get("mass"), parts.get("layers"))


def _summary(tables: dict, add) -> None:
    if "rates" in tables:
        r = tables["rates"]
        add("sink_rate", "sink_eps", r["sink_eps"].iloc[0])
        add("sink_rate", "sink_eps_all_queries", r["sink_eps_all_queries"].iloc[0])
        add("sink_rate", "mean_sink_rate", r["sink_rate"].mean())
        add("sink_rate", "median_sink_rate", r["sink_rate"].median())
        add("sink_rate", "first_token_is_bos", r["first_token_is_bos"].iloc[0])
        if "top_key" in r:
            strong = r[r["top_key_mass"] > r["eps"].iloc[0]]
            add("sink_rate", "share_strong_heads_top_key_0", (strong["top_key"] == 0).mean() if len(strong) else np.nan)
            add("sink_rate", "max_top_later_mass", r["top_later_mass"].max())
        if "learned_sink_mass" in r:
            add("sink_rate", "mean_learned_sink_mass", r["learned_sink_mass"].mean())


def rate_claim_rows(rates: pd.DataFrame, eps: float = EPS.default, majority: float = 0.5, n_resamples: int = 1000,
                    seed: int = 0) -> list[dict]:
    """Chapter 5's claims: "many heads are sink heads" (share of heads with sink rate > ``eps`` above
    ``majority``, Wilson and cluster bootstrap by layer, per layer type too) and "the sink is position 0"
    (among heads whose strongest key takes > ``eps``, share at position 0 above one half; the median
    head's strongest later key below ``eps``)."""
    rate = rates[np.isfinite(rates["sink_rate"].to_numpy(float))]
    flags = rate.assign(sink=rate["sink_rate"] > eps)
    rows = [claim_row(5, SINK_RATES, f"more than {majority:g} of the heads are sink heads",
                      f"share of heads with sink rate > {eps:g} (Sink_eps, Wilson over heads)", "sink_eps",
                      share_ci(flags["sink"]), majority, "above", len(flags), "" if len(flags) else "no finite sink rate",
                      unit="head", n_units=len(flags), source=BOOK)]
    rows += pooled_claim_rows(flags, "sink", chapter=5, claim=SINK_RATES,
                              part=f"more than {majority:g} of the heads are sink heads, heads clustered by layer",
                              statistic_text=f"share of heads with sink rate > {eps:g}", key="sink_eps_by_layer",
                              threshold=majority, side="above", statistic="share", why="no finite sink rate",
                              n_resamples=n_resamples, seed=seed, source=BOOK)
    if "top_key" in rates:
        strong = rates[rates["top_key_mass"] > eps]
        rows.append(claim_row(5, SINK_POSITION_CLAIM, "the strongest key of a strongly attending head is position 0",
                              f"share of heads whose strongest key (mass > {eps:g}) is position 0 (Wilson)",
                              "top_key_0", share_ci(strong["top_key"] == 0), 0.5, "above", len(strong),
                              "" if len(strong) else no_sink_heads(eps), unit="head",
                              n_units=len(strong), source=BOOK))
        rows += pooled_claim_rows(rates, "top_later_mass", chapter=5, claim=SINK_POSITION_CLAIM,
                                  part="no later position is a second sink",
                                  statistic_text="median over heads of the strongest later key's mass",
                                  key="top_later_mass", threshold=eps, side="below", statistic="median",
                                  n_resamples=n_resamples, seed=seed, source=BOOK)
    return rows


def _claims(results, *, eps: float, n_resamples: int, seed: int, **_) -> list[dict]:
    return rate_claim_rows(results["rates"], eps, n_resamples=n_resamples, seed=seed)


ANALYSIS = register(Analysis("rates", _RatesCollector, _tables, stems=("rates",), summary=_summary, claims=_claims,
                             options=(EPS,)))


@ANALYSIS.public
def sink_rates(model, tokenizer, data, **options) -> pd.DataFrame:
    """Per (layer, head): the attention the first token receives, and Gu et al.'s Sink_eps.

    With a_i = alpha^h_i0 for queries i >= 1: ``sink_rate`` (mean), ``sink_rate_std``,
    ``sink_rate_sequence_std``, ``q10``/``median``/``q90``, ``sink_rate_all_queries`` (Gu et al.'s, with
    a_0 = 1), ``is_sink_head`` (> eps); model-level ``sink_eps`` (share of sink heads),
    ``sink_eps_all_queries``, ``eps``, ``add_bos``, ``first_token_is_bos``, ``num_sequences``,
    ``block_size``; ``layer_type`` and ``learned_sink_mass`` (GPT-OSS; NaN without).

    Where the mass goes, from m_j = mean over queries of alpha_ij: ``top_key``, ``top_key_mass``,
    ``top_key_class``, ``top_later_key``/``top_later_mass`` (positions >= 1: a second sink), and per token
    class (:func:`cwcore.sinks.engine.token_classes`) ``mass_<class>`` against ``uniform_<class>`` (uniform
    causal attention); NaN without a tokenizer.

    Options: ``eps`` and the run options (:class:`cwcore.sinks.SinkOptions`)."""

