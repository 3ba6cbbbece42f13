"""Analysis 2, the decomposition: the three factors of c_ij for sink and tail tokens (chapter 5)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import torch

from .engine import _COMMON, Analysis, Collector, _concat, _np, register, run_one
from .intervals import claim_row, claims_frame, no_sink_heads, share_ci

__all__ = ["DECOMPOSITION", "DecompositionTables", "decomposition_claims", "head_shares", "sink_decomposition"]

_FACTORS = ("alpha", "relative_norm", "cosine")

#: the claim chapter 5 judges
DECOMPOSITION = "sink driven by value geometry, tail by attention"


class DecompositionTables(NamedTuple):
    """``summary``: one row per (scope, layer, head, token_class, factor); ``sample``: long per-(query, key) rows."""

    summary: pd.DataFrame
    sample: pd.DataFrame


class _DecompositionCollector(Collector):
    """Pieces ``stats`` (sufficient statistics per layer, head, class) and ``sample`` (quantile sample)."""

    def __init__(self, *args, kind, quantile_sample, seed):
        super().__init__(*args)
        self.kind = kind
        b, T = self.ids.shape
        rows_, cols_ = np.tril_indices(T - 1)  # tail pairs: 1 <= j <= i <= T-1
        tail_q, tail_k = rows_ + 1, cols_ + 1
        self.picks = {"sink": [], "tail": []}
        for s in range(b):
            rng = np.random.default_rng([seed, self.start + s])
            sink_q = np.arange(1, T)
            if len(sink_q) > quantile_sample:
                sink_q = np.sort(rng.choice(sink_q, quantile_sample, replace=False))
            self.picks["sink"].append((sink_q, np.zeros_like(sink_q)))
            chosen = np.sort(rng.choice(len(tail_q), min(quantile_sample, len(tail_q)), replace=False))
            self.picks["tail"].append((tail_q[chosen], tail_k[chosen]))
        q = torch.arange(T)
        self.masks = {"sink": (q[:, None] >= 1) & (q[None, :] == 0),
                      "tail": (q[:, None] >= q[None, :]) & (q[None, :] >= 1)}  # [q, k]
        self.stats, self.samples = [], []

    def on_layer(self, s):
        d = s.decomposition
        kind = self.kind
        alpha, rel, cos, contribution = d.attention, d.relative_norm(kind), d.cosine(kind), d.contribution(kind)
        b, heads = alpha.shape[:2]
        for cls, mask in self.masks.items():
            if cls == "sink":  # only key 0 of queries >= 1: slice instead of masking
                parts = [x[:, :, 1:, 0] for x in (alpha, rel, cos, contribution)]
                total = b * (alpha.shape[2] - 1)
            else:
                keep = mask.to(alpha.device)
                parts = [x[:, :, keep] for x in (alpha, rel, cos, contribution)]  # [b, h, pairs]
                total = b * int(keep.sum())
            a_, r_, c_, contrib = parts
            logs = torch.stack([a_.log(), r_.log(), c_.abs().log()])  # [3, b, h, n]
            valid = logs.sum(0).isfinite()  # log|c| is finite iff all three logs are
            ones = valid.to(logs.dtype)
            x = torch.cat([ones[None], torch.where(valid, logs, 0.0)])  # [4, b, h, n]
            x = x.permute(2, 0, 1, 3).reshape(heads, 4, -1).double()
            moments = x @ x.transpose(1, 2)  # [h, 4, 4]: n, sums of log f, sums of log f * log g
            n = moments[:, 0, 0]
            frame = {"layer": np.full(heads, s.layer, np.int32), "head": np.arange(heads, dtype=np.int32),
                     "token_class": [cls] * heads, "n": _np(n), "n_excluded": total - _np(n),
                     "n_pairs": np.full(heads, float(total)), "sum_alpha_linear": _np(a_.sum((0, 2), dtype=torch.float64)),
                     "sum_L": _np(moments[:, 0, 1:].sum(-1)), "sum_LL": _np(moments[:, 1:, 1:].sum((1, 2))),
                     "n_negative": _np((valid & (contrib < 0)).sum((0, 2))).astype(np.float64),
                     "n_negative_cosine": _np((valid & (c_ < 0)).sum((0, 2))).astype(np.float64)}
            for k, name in enumerate(_FACTORS, start=1):
                frame[f"sum_{name}"] = _np(moments[:, 0, k])
                frame[f"sum_{name}_L"] = _np(moments[:, k, 1:].sum(-1))
            self.stats.append(pd.DataFrame(frame))
            for seq, (qi, kj) in enumerate(self.picks[cls]):
                m = len(qi)
                qi_t, kj_t = torch.as_tensor(qi), torch.as_tensor(kj)
                values = {"alpha": alpha, "relative_norm": rel, "cosine": cos, "contribution": contribution}
                self.samples.append(pd.DataFrame({
                    "sequence": np.full(heads * m, self.start + seq, np.int32),
                    "layer": np.full(heads * m, s.layer, np.int32),
                    "head": np.repeat(np.arange(heads, dtype=np.int32), m),
                    "token_class": cls,
                    "query": np.tile(qi.astype(np.int32), heads), "key": np.tile(kj.astype(np.int32), heads),
                    **{name: _np(x[seq][:, qi_t, kj_t]).astype(np.float32) for name, x in values.items()},
                }))

    def finish(self, logits):
        return {"stats": _concat(self.stats), "sample": _concat(self.samples)}


def sink_decomposition(
    model,
    tokenizer,
    data,
    *,
    kind: str = "intra",
    eps: float = 0.3,
    quantile_sample: int = 128,
    sample_size: int = 2000,
    block_size: int = 128,
    num_sequences: int | None = None,
    add_bos: bool | None = None,
    batch_size: int = 8,
    seed: int = 0,
    cache: bool = True,
    cache_root=None,
    progress: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> DecompositionTables:
    """The factors of c_ij = alpha_ij * (||v~_j|| / ||o_i||) * cos(o_i, v~_j) for sink and tail tokens.

    Token classes: ``sink`` = (query i >= 1, key 0); ``tail`` = (i >= 1, 1 <= j <= i). ``kind``: "intra"
    (o_i = the head's own output o^h_i, default) or "inter" (the layer's combined output).

    Since log|c| = log alpha + log rel_norm + log|cos| exactly, var(log|c|) splits into the factor
    shares ``share_f = cov(log|f|, log|c|) / var(log|c|)``, which sum to 1 over the three factors; they
    say which factor makes c *vary* (within the class, across heads, queries and sequences). ``mean_log``
    (the mean of log|f|, summing to the mean of log|c|) says which factor sets its *level*. Both are
    exact over every (sequence, query, key) of the class (running sums in float64); pairs with a zero
    factor (alpha underflowing to 0, a zero cosine, a zero output norm) have no logarithm and are
    counted in ``n_excluded``.

    ``summary`` columns: ``scope`` ("head", "layer": pooled over heads, "model": pooled over all),
    ``layer``/``head`` (NA when pooled), ``token_class``, ``factor`` (alpha, relative_norm, cosine,
    contribution), ``n``, ``n_excluded``, ``share`` (contribution: their sum), ``mean_log``, ``mean``,
    ``frac_negative``, ``q10``, ``q25``, ``median``, ``q75``, ``q90``, ``sink_rate`` (the head's mean
    alpha_i0 over queries >= 1; "head" rows only) and ``num_heads`` (heads pooled in the row). Scopes
    "sink_heads" / "other_heads" pool the heads whose sink rate is above / at most ``eps``. ``mean`` and the quantiles come
    from a seeded sample of ``quantile_sample`` pairs per (sequence, layer, head, class) (the sink class
    has only T-1 pairs per sequence: with the default every sink pair is kept); the same tail pairs are
    used in all layers and heads of a sequence.
    ``sample``: ``sample_size`` rows per token class drawn (seeded) from that sample, with columns
    sequence, layer, head, token_class, query, key, alpha, relative_norm, cosine, contribution.
    """
    if kind not in ("intra", "inter"):
        raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")
    common = {k: v for k, v in locals().items() if k in _COMMON}
    options = dict(kind=kind, quantile_sample=quantile_sample, seed=seed, sample_size=sample_size, eps=eps)
    return run_one("decomposition", model, tokenizer, data, options, common)


def _decomposition_tables(parts: dict, sample_size: int, seed: int, eps: float) -> DecompositionTables:
    summary = _decomposition_summary(parts["stats"], parts["sample"], eps)
    sample = parts["sample"]
    rng = np.random.default_rng(seed)
    drawn = []
    for cls in ("sink", "tail"):
        rows = sample[sample["token_class"] == cls]
        if len(rows) > sample_size:
            rows = rows.iloc[np.sort(rng.choice(len(rows), sample_size, replace=False))]
        drawn.append(rows)
    return DecompositionTables(summary, pd.concat(drawn, ignore_index=True))


def _shares(sums: pd.DataFrame) -> dict[str, np.ndarray]:
    """Variance shares and mean logs from summed sufficient statistics (columns as in the stats piece)."""
    n = sums["n"].to_numpy(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_L = sums["sum_L"].to_numpy() / n
        var_L = sums["sum_LL"].to_numpy() / n - mean_L**2
        out = {"mean_log_contribution": mean_L, "var_log_contribution": var_L}
        for name in _FACTORS:
            mean_f = sums[f"sum_{name}"].to_numpy() / n
            cov = sums[f"sum_{name}_L"].to_numpy() / n - mean_f * mean_L
            out[f"share_{name}"] = np.where(var_L > 0, cov / np.where(var_L > 0, var_L, 1), np.nan)
            out[f"mean_log_{name}"] = mean_f
    return out


def _decomposition_summary(stats: pd.DataFrame, sample: pd.DataFrame, eps: float) -> pd.DataFrame:
    sum_columns = [c for c in stats.columns if c.startswith(("sum_", "n"))]
    # each head's sink rate: mean alpha_i0 over all its sink pairs
    sink = stats[stats["token_class"] == "sink"].groupby(["layer", "head"])[["sum_alpha_linear", "n_pairs"]].sum()
    rate = (sink["sum_alpha_linear"] / sink["n_pairs"]).rename("sink_rate").reset_index()
    stats = stats.merge(rate, on=["layer", "head"], how="left")
    sample = sample.merge(rate, on=["layer", "head"], how="left")
    frames = []
    scopes = (("head", ["layer", "head"], None), ("layer", ["layer"], None), ("sink_heads", [], True),
              ("other_heads", [], False), ("model", [], None))
    for scope, keys, sink_heads in scopes:
        by = keys + ["token_class"]
        stats_in, sample_in = stats, sample
        if sink_heads is not None:
            stats_in = stats[(stats["sink_rate"] > eps) == sink_heads]
            sample_in = sample[(sample["sink_rate"] > eps) == sink_heads]
            if stats_in.empty:
                continue
        sums = stats_in.groupby(by)[sum_columns].sum().reset_index()
        shares = _shares(sums)
        groups = sample_in.groupby(by)
        for factor in (*_FACTORS, "contribution"):
            q = groups[factor].quantile([0.1, 0.25, 0.5, 0.75, 0.9]).unstack()
            q.columns = ["q10", "q25", "median", "q75", "q90"]
            q = q.reset_index()
            frame = sums[by].copy()
            frame["scope"] = scope
            frame["factor"] = factor
            frame = frame.merge(stats_in.drop_duplicates(["layer", "head", "token_class"]).groupby(by).size()
                                .rename("num_heads").reset_index(), on=by, how="left")
            if scope == "head":
                frame["sink_rate"] = (sums["sum_alpha_linear"] / sums["n_pairs"]).where(sums["token_class"] == "sink")
                frame["sink_rate"] = frame.groupby(keys)["sink_rate"].transform("max")
            frame["n"] = sums["n"].astype(np.int64)
            frame["n_excluded"] = sums["n_excluded"].astype(np.int64)
            if factor == "contribution":
                frame["share"] = sum(shares[f"share_{f}"] for f in _FACTORS)
                frame["mean_log"] = shares["mean_log_contribution"]
                frame["frac_negative"] = sums["n_negative"] / sums["n"]
            else:
                frame["share"] = shares[f"share_{factor}"]
                frame["mean_log"] = shares[f"mean_log_{factor}"]
                frame["frac_negative"] = sums["n_negative_cosine"] / sums["n"] if factor == "cosine" else 0.0
            means = groups[factor].mean().rename("mean").reset_index()
            frame = frame.merge(means, on=by, how="left").merge(q, on=by, how="left")
            frames.append(frame)
    table = pd.concat(frames, ignore_index=True)
    for col in ("layer", "head"):
        if col not in table:
            table[col] = pd.NA
        table[col] = table[col].astype("Int64")
    if "sink_rate" not in table:
        table["sink_rate"] = np.nan
    columns = ["scope", "layer", "head", "sink_rate", "num_heads", "token_class", "factor", "n", "n_excluded", "share",
               "mean_log", "mean", "frac_negative", "q10", "q25", "median", "q75", "q90"]
    order = {"head": 0, "layer": 1, "sink_heads": 2, "other_heads": 3, "model": 4}
    table = table[columns].sort_values(["scope", "layer", "head", "token_class", "factor"],
                                       key=lambda c: c.map(order) if c.name == "scope" else c, na_position="last")
    return table.reset_index(drop=True)


def _tables(parts: dict, blocks, *, sample_size: int, seed: int, eps: float, **_) -> DecompositionTables:
    return _decomposition_tables(parts, sample_size, seed, eps)


def _summary(tables: dict, add) -> None:
    if "decomposition" in tables:
        d = tables["decomposition"]
        for scope in ("model", "sink_heads"):
            pooled = d[d["scope"] == scope]
            prefix = "" if scope == "model" else "sink_heads_"
            for cls in ("sink", "tail"):
                for factor in (*_FACTORS, "contribution"):
                    row = pooled[(pooled["token_class"] == cls) & (pooled["factor"] == factor)]
                    if len(row):
                        add("decomposition", f"{prefix}{cls}_{factor}_median", row["median"].iloc[0])
                        add("decomposition", f"{prefix}{cls}_{factor}_mean_log", row["mean_log"].iloc[0])
                        if factor != "contribution":
                            add("decomposition", f"{prefix}{cls}_{factor}_share", row["share"].iloc[0])
        for cls in ("sink", "tail"):  # per head: do relative norm and cosine together explain more than alpha?
            heads = d[(d["scope"] == "head") & (d["token_class"] == cls)]
            shares = heads.pivot_table(index=["layer", "head"], columns="factor", values="share")
            rate = heads.groupby(["layer", "head"])["sink_rate"].first()
            if len(shares):
                dominates = (shares["relative_norm"] + shares["cosine"]) > shares["alpha"]
                add("decomposition", f"{cls}_share_of_heads_geometry_dominates", dominates.mean())
                sink_heads = rate.reindex(dominates.index) > 0.3
                add("decomposition", f"sink_heads_{cls}_share_of_heads_geometry_dominates",
                    dominates[sink_heads].mean() if sink_heads.any() else np.nan)


def head_shares(rates: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, head, token class): the share of var(log|c|) of each factor, ``geometry`` (relative
    norm + cosine) and the head's ``sink_rate``; heads with an undefined share are left out.

    ``rates``: :func:`cwcore.sinks.sink_rates`' table; ``summary``: the decomposition's ``summary``.
    """
    heads = (summary[summary["scope"] == "head"]
             .pivot_table(index=["layer", "head", "token_class"], columns="factor", values="share")
             .reset_index())
    rate = rates.set_index(["layer", "head"])["sink_rate"]
    heads["sink_rate"] = rate.reindex(pd.MultiIndex.from_frame(heads[["layer", "head"]])).to_numpy()
    heads["geometry"] = heads["relative_norm"] + heads["cosine"]
    return heads[np.isfinite(heads["geometry"]) & np.isfinite(heads["alpha"])].reset_index(drop=True)


def decomposition_claims(rates: pd.DataFrame, summary: pd.DataFrame, eps: float = 0.3) -> pd.DataFrame:
    """Chapter 5: in sink heads (sink rate > ``eps``), the geometry (relative norm + cosine) explains more
    of the sink's var(log|c|) than attention does in more than half of the heads, and attention more of
    the tail's in more than half (shares of heads with Wilson intervals, threshold 0.5)."""
    return claims_frame(_claim_rows(head_shares(rates, summary), eps))


def _claim_rows(heads: pd.DataFrame, eps: float) -> list[dict]:
    in_sink = heads[heads["sink_rate"] > eps]
    sink = in_sink[in_sink["token_class"] == "sink"]
    tail = in_sink[in_sink["token_class"] == "tail"]
    why = "" if len(in_sink) else no_sink_heads(eps)
    return [
        claim_row(5, DECOMPOSITION, "sink: geometry explains more than attention",
                  "share of sink heads where geometry's share of var(log|c|) > attention's", "sink_geometry_share",
                  share_ci(sink["geometry"] > sink["alpha"]), 0.5, "above", len(sink), why),
        claim_row(5, DECOMPOSITION, "tail: attention explains more than geometry",
                  "share of sink heads where attention's share of var(log|c|) > geometry's", "tail_attention_share",
                  share_ci(tail["alpha"] > tail["geometry"]), 0.5, "above", len(tail), why),
    ]


def _claims(results, *, eps: float, **_) -> list[dict]:
    return _claim_rows(head_shares(results["rates"], results["decomposition"].summary), eps)


ANALYSIS = register(Analysis("decomposition", _DecompositionCollector, _tables,
                             stems=("decomposition", "decomposition-sample"),
                             collector_options=("kind", "quantile_sample", "seed"), summary=_summary, claims=_claims))
