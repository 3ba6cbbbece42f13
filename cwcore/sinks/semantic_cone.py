"""Analysis 5, the semantic cone: remove the sink, watch the head outputs and the perplexity (chapter 7)."""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple

import numpy as np
import pandas as pd
import torch

from .. import stats
from . import engine
from .engine import SEED, Analysis, Collector, LayerState, Option, concat, count, flat, grid_columns, register, unit_interval
from .intervals import claim_row, claims_frame, contrast, group_value

__all__ = ["CONDITIONS", "CONE", "DRIFT", "PERPLEXITY", "drift_curve", "drift_points", "mass_matched_removal",
           "weak_token_counts", "PerplexityChanges", "SemanticConeTables", "cone_claims",
           "cone_points", "perplexity_changes", "sink_semantic_cone"]

HEADS = Option("heads", "all", "semantic-cone interventions in all heads, or only in sink heads (rate above threshold)",
               choices=("all", "sink"))
THRESHOLD = Option("threshold", 0.3, "heads='sink': a head's sink rate in the sequence above this",
                   unit_interval("threshold"), read_when=("heads", "sink"))
QUANTILES = Option("quantiles", 5, "bins of the clean output norm (bin 1: the lowest-norm outputs)", count("quantiles"))

#: the claims chapter 7 judges
CONE = "low-norm outputs collapse into the cone"
PERPLEXITY = "removing the sink raises perplexity"
DRIFT = "noise from many weak tokens accumulates"


class _Clean(NamedTuple):
    mixed: torch.Tensor  # z^h_i [b, h, q, d]
    output_norm: torch.Tensor  # ||o^h_i|| [b, h, q]
    rate: torch.Tensor  # mean alpha_i0 over queries >= 1, [b, h]


class SemanticConeTables(NamedTuple):
    """``by_quantile``: per (condition, output-norm quantile); ``heads``: per (condition, layer, head);
    ``ppl``: per condition."""

    by_quantile: pd.DataFrame
    heads: pd.DataFrame
    ppl: pd.DataFrame


CONDITIONS = ("sink", "sink_renorm", "control", "control_mass")


def weak_token_counts(T: int) -> list[int]:
    """The numbers k of weak tokens of the drift curve: powers of two up to (T - 1) // 2 (queries i >= the
    largest k are measured, so every point of the curve has the same queries)."""
    ks, k = [], 1
    while k <= max(1, (T - 1) // 2):
        ks.append(k)
        k *= 2
    return ks


def _mass_scores(seed: int, sequences: range, heads: int, T: int) -> torch.Tensor:
    """Random priorities ``[b, h, q, k]`` (seeded per sequence) of the mass-matched control's removal order."""
    return torch.stack([torch.as_tensor(np.random.default_rng([seed, s, 1]).random((heads, T, T)), dtype=torch.float32)
                        for s in sequences])


def _removal_order(scores: torch.Tensor) -> torch.Tensor:
    """Keys 1..i of each row in the random order of ``scores [b, h, q, k]`` (the other keys last)."""
    T = scores.shape[-1]
    q = torch.arange(T, device=scores.device)
    allowed = (q[None, :] >= 1) & (q[None, :] <= q[:, None])  # [q, k]
    return torch.where(allowed, scores, torch.full_like(scores, float("inf"))).argsort(-1)


def mass_matched_removal(probs: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor,
                         order: torch.Tensor | None = None) -> torch.Tensor:
    """The ``control_mass`` transform: in ``rows [b, h]`` and queries i >= 1, zero non-sink keys 1..i in the
    random order of ``scores [b, h, q, k]`` (or the known ``order``) until the removed mass is exactly
    min(alpha_i0, 1 - alpha_i0) (the last key in part); no renormalisation."""
    T = probs.shape[-1]
    q = torch.arange(T, device=probs.device)
    allowed = (q[None, :] >= 1) & (q[None, :] <= q[:, None])  # [q, k]
    order = _removal_order(scores.to(probs.device, probs.dtype)) if order is None else order.to(probs.device)
    ranked = torch.where(allowed, probs, torch.zeros_like(probs)).gather(-1, order)
    before = ranked.cumsum(-1) - ranked
    take = torch.minimum((probs[..., :1] - before).clamp_min(0), ranked)
    removed = torch.zeros_like(probs).scatter(-1, order, take)
    selected = rows.bool().to(probs.device)[:, :, None, None] & (q >= 1)[None, None, :, None]
    return torch.where(selected, probs - removed, probs)


def _token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood ``[b, T-1]`` (float64)."""
    logp = torch.log_softmax(logits[:, :-1].float(), -1)
    return -logp.gather(-1, ids[:, 1:, None].to(logp.device))[..., 0].double()


class _SemanticConeCollector(Collector):
    """Pieces ``points`` (per condition, layer, sequence, head, touched query), ``sequences`` (summed NLL
    per condition) and ``heads`` (clean sink rate, intervened or not, mean clean norm)."""

    needs_logits = True

    def __init__(self, *args, heads, threshold, seed):
        super().__init__(*args)
        self.heads, self.threshold, self.seed = heads, threshold, seed
        self.clean: dict[int, _Clean] = {}
        self.clean_measure: dict[int, dict] = {}
        self.weak: list[pd.DataFrame] = []
        self.clean_alpha0: dict[int, torch.Tensor] = {}

    @staticmethod
    def cone_axis(s: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """m_i = mean_{1<=j<=i} v_j (head space, query 0: zero) ``[b, h, q, d]`` and G_h m_i (for inner products)."""
        v = s.values[:, :, 1:]
        T = s.values.shape[2]
        counts = torch.arange(1, T, dtype=v.dtype, device=v.device)[None, None, :, None]
        axis = torch.cat([torch.zeros_like(v[:, :, :1]), v.cumsum(2) / counts], 2)
        return axis, axis @ s.gram

    @classmethod
    def measure(cls, s: LayerState, axis=None) -> dict:
        """||o^h_i|| and cos(o^h_i, m_i), m_i = mean_{1<=j<=i} v~_j, each ``[b, h, q]`` (query 0: NaN)."""
        axis, axis_gram = cls.cone_axis(s) if axis is None else axis
        axis_norm = (axis * axis_gram).sum(-1).clamp_min(0).sqrt()
        return {"norm": s.output_norm, "cos": (s.mixed * axis_gram).sum(-1) / (s.output_norm * axis_norm)}

    def on_layer(self, s):
        self.clean[s.layer] = _Clean(s.mixed, s.output_norm, s.probs[:, :, 1:, 0].mean(-1))
        self.clean_alpha0[s.layer] = s.probs[:, :, :, 0]
        axis = self.cone_axis(s)
        self.clean_measure[s.layer] = self.measure(s, axis)
        self.clean_measure[s.layer]["cos_random"] = self.random_direction_cos(s, axis)
        self.weak.append(self.weak_tokens(s, axis))

    def random_direction_cos(self, s: LayerState, axis=None) -> torch.Tensor:
        """The control not inside the cone by construction: cos(s_i + r_i, m_i) ``[b, h, q]``, r_i the sink's
        term replaced by one of the same norm along a random direction W_O^h g of the head's output space
        (g ~ N(0, I), seeded per sequence and layer)."""
        axis, axis_gram = self.cone_axis(s) if axis is None else axis
        b, h, T, d = s.values.shape
        g = torch.stack([torch.as_tensor(np.random.default_rng([self.seed, self.start + i, 2, s.layer])
                                         .standard_normal((h, T, d)), dtype=s.values.dtype) for i in range(b)])
        g = g.to(s.values.device)
        length = s.probs[..., 0] * s.value_norm[..., :1]  # a_i ||v~_0|| [b, h, q]
        replaced = s.semantic + g * (length / s.norm(g).clamp_min(torch.finfo(g.dtype).tiny))[..., None]
        axis_norm = (axis * axis_gram).sum(-1).clamp_min(0).sqrt()
        return (replaced * axis_gram).sum(-1) / (s.norm(replaced) * axis_norm)

    def weak_tokens(self, s: LayerState, axis=None) -> pd.DataFrame:
        """The drift curve of one clean layer: cos(sum of the k weakest tail terms, m_i) for queries i >= max k
        and each k of :func:`weak_token_counts`, and of all tail terms; NaN where the weights underflow."""
        b, h, T, _ = s.probs.shape
        ks = weak_token_counts(T)
        first = ks[-1]
        axis, axis_gram = self.cone_axis(s) if axis is None else axis
        axis, axis_gram = axis[:, :, first:], axis_gram[:, :, first:]
        axis_norm = (axis * axis_gram).sum(-1).clamp_min(0).sqrt()
        q = torch.arange(T, device=s.probs.device)
        tail = ((q[None, :] >= 1) & (q[None, :] <= q[:, None]))[first:]  # queries >= first
        probs = s.probs[:, :, first:]
        order = torch.where(tail, probs, torch.full_like(probs, float("inf"))).argsort(-1)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=order.device).expand_as(order))
        cols = {"layer": np.full(b * h * (T - first), s.layer, np.int32),
                **grid_columns((b, h, T - first), ("sequence", "head", "query"), {"sequence": self.start, "query": first}),
                "norm_clean": flat(s.output_norm[:, :, first:]).astype(np.float32)}
        zero = torch.zeros_like(probs)

        def cosine(kept):
            total = kept.sum(-1, keepdim=True)  # the cosine is scale-free: weights summing to one avoid underflow
            z = torch.where(total > 0, kept / total, zero) @ s.values
            norm = ((z @ s.gram) * z).sum(-1).clamp_min(0).sqrt()
            return torch.where(total[..., 0] > 0, (z * axis_gram).sum(-1) / (norm * axis_norm), float("nan"))

        # the null: the same k weakest weights on k tail keys drawn at random (seeded per sequence and
        # layer), so a sum of k terms with the same weights whose directions are any of the row's values
        weakest = torch.where(tail, probs, zero).gather(-1, order)  # ascending weights, tail keys first
        scores = torch.stack([torch.as_tensor(np.random.default_rng([self.seed, self.start + i, 3, s.layer])
                                              .random((h, T - first, T)), dtype=probs.dtype) for i in range(b)])
        shuffled = torch.where(tail, scores.to(probs.device), torch.full_like(probs, float("inf"))).argsort(-1)
        for k in [*ks, None]:
            keep = tail if k is None else (tail & (rank < k))  # rank 0 = the weakest tail key of the row
            cols[f"cos_k{k if k is not None else 'all'}"] = flat(cosine(torch.where(keep, probs, zero))).astype(np.float32)
            if k is not None:  # queries >= first have at least k tail keys: the k drawn keys are tail keys
                null = zero.scatter(-1, shuffled[..., :k], weakest[..., :k])
                cols[f"null_k{k}"] = flat(cosine(null)).astype(np.float32)
        return pd.DataFrame(cols)

    def finish(self, logits):
        ids, start = self.ids, self.start
        b, T = ids.shape
        nll_clean = _token_nll(logits, ids)
        rates = {l: c.rate for l, c in self.clean.items()}  # [b, h]
        selected = {l: (r > self.threshold) if self.heads == "sink" else torch.ones_like(r, dtype=torch.bool)
                    for l, r in rates.items()}
        control_key = np.array([np.random.default_rng([self.seed, start + i]).integers(1, T - 1) if T > 2 else 1
                                for i in range(b)])
        q = torch.arange(T)
        key = torch.as_tensor(control_key)
        sink_rows = (q[:, None] >= 1) & (q[None, :] == 0)  # [q, k]
        control_rows = (q[None, :, None] > key[:, None, None]) & (q[None, None, :] == key[:, None, None])  # [b, q, k]
        masks = {
            "sink": {l: sel[:, :, None, None] & sink_rows.to(sel.device)[None, None] for l, sel in selected.items()},
            "sink_renorm": {},
            "control": {l: sel[:, :, None, None] & control_rows.to(sel.device)[:, None] for l, sel in selected.items()},
            "control_mass": {},
        }
        heads_n = next(iter(rates.values())).shape[1] if rates else 0
        scores = _mass_scores(self.seed, range(start, start + b), heads_n, T) if rates else None
        order = _removal_order(scores) if rates else None  # the same random order in every layer
        mass_transforms = {l: (lambda call, sel=sel: mass_matched_removal(call.probs, scores, sel, order))
                           for l, sel in selected.items()}
        touched = {"sink": (q >= 1)[None, :].expand(b, T), "sink_renorm": (q >= 1)[None, :].expand(b, T),
                   "control": q[None, :] > key[:, None], "control_mass": (q >= 1)[None, :].expand(b, T)}  # [b, q]
        sequences = {"sequence": np.arange(start, start + b, dtype=np.int32), "control_key": control_key,
                     "n_tokens": np.full(b, T - 1), "nll_clean": flat(nll_clean.sum(-1))}
        frames = []
        for condition in CONDITIONS:
            after: dict[int, dict] = {}

            def on_layer(s: LayerState, after=after):
                m = self.measure(s)
                c = self.clean[s.layer]
                m["drift"] = s.inner(c.mixed, s.mixed) / (c.output_norm * s.output_norm)
                after[s.layer] = m

            # engine.forward read at call time: the engine's one forward pass, which a test may replace
            logits = engine.forward(self.model, ids, on_layer, masks=masks[condition],
                                     renormalise=selected if condition == "sink_renorm" else None, logits=True,
                                     compute_dtype=self.dtype,
                                     transforms=mass_transforms if condition == "control_mass" else None)
            sequences[f"nll_{condition}"] = flat(_token_nll(logits, ids).sum(-1))
            del logits
            for layer, m in sorted(after.items()):
                keep = selected[layer][:, :, None] & touched[condition][:, None, :].to(selected[layer].device)
                bi, hi, qi = torch.nonzero(keep, as_tuple=True)
                c = self.clean_measure[layer]
                frames.append(pd.DataFrame({
                    "condition": condition, "layer": np.full(len(bi), layer, np.int32),
                    "sequence": (flat(bi) + start).astype(np.int32), "head": flat(hi).astype(np.int32),
                    "query": flat(qi).astype(np.int32),
                    "norm_clean": flat(c["norm"][bi, hi, qi]).astype(np.float32),
                    "cos_clean": flat(c["cos"][bi, hi, qi]).astype(np.float32),
                    "norm_after": flat(m["norm"][bi, hi, qi]).astype(np.float32),
                    "cos_after": flat(m["cos"][bi, hi, qi]).astype(np.float32),
                    "drift": flat(m["drift"][bi, hi, qi]).astype(np.float32),
                    "alpha0_clean": flat(self.clean_alpha0[layer][bi, hi, qi]).astype(np.float32),
                    "cos_random_clean": flat(c["cos_random"][bi, hi, qi]).astype(np.float32),
                }))
        heads = concat([pd.DataFrame({
            "layer": np.full(rates[l].numel(), l, np.int32),
            **grid_columns(tuple(rates[l].shape), ("sequence", "head"), {"sequence": start}),
            "sink_rate": flat(rates[l]), "selected": flat(selected[l]),
            "norm_clean_mean": flat(self.clean_measure[l]["norm"][:, :, 1:].mean(-1)),
        }) for l in sorted(rates)])
        return {"points": concat(frames), "sequences": pd.DataFrame(sequences), "heads": heads,
                "weak": concat(self.weak)}


def _cone_stats(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    g = frame.assign(ratio=frame["norm_after"] / frame["norm_clean"], delta_cos=frame["cos_after"] - frame["cos_clean"]).groupby(by)
    return pd.DataFrame({
        "n": g.size(), "norm_clean": g["norm_clean"].mean(), "norm_after": g["norm_after"].mean(),
        "norm_ratio": g["ratio"].median(), "cos_clean": g["cos_clean"].mean(), "cos_after": g["cos_after"].mean(),
        "delta_cos": g["delta_cos"].mean(), "drift": g["drift"].mean(),
    }).reset_index()


def _within_head_quantile(points: pd.DataFrame, quantiles: int) -> np.ndarray:
    """1..quantiles: the quantile of each point's clean output norm within its head (edges over all of
    the head's touched queries and sequences in the ``sink`` condition)."""
    clean = points[points["condition"] == "sink"][["layer", "head", "norm_clean"]]
    edges = clean.groupby(["layer", "head"])["norm_clean"].quantile(np.linspace(0, 1, quantiles + 1)[1:-1]).unstack()
    edge_rows = edges.loc[pd.MultiIndex.from_frame(points[["layer", "head"]])].to_numpy() if len(edges.columns) else \
        np.zeros((len(points), 0))
    return 1 + (points["norm_clean"].to_numpy()[:, None] > edge_rows).sum(1)


def _head_summary(heads: pd.DataFrame, quantiles: int) -> pd.DataFrame:
    """Per (layer, head): sink rate, selected, mean clean norm, its rank among the heads and its bin."""
    summary = heads.groupby(["layer", "head"]).agg(sink_rate=("sink_rate", "mean"), selected=("selected", "mean"),
                                                    head_norm=("norm_clean_mean", "mean")).reset_index()
    summary["norm_quantile_of_head"] = summary["head_norm"].rank(pct=True)
    # heads binned by their mean clean output norm among the model's heads
    summary["head_bin"] = np.ceil(summary["norm_quantile_of_head"] * quantiles).clip(1, quantiles).astype(int)
    return summary


def cone_points(raw: dict[str, pd.DataFrame], quantiles: int = 5) -> pd.DataFrame:
    """The semantic cone's raw ``points`` with ``quantile`` (``within_head`` bin), ``head_bin``
    (``across_heads`` bin), ``sink_rate``, ``log_norm_ratio`` and ``delta_cos``, for intervals over sequences."""
    points = raw["points"]
    summary = _head_summary(raw["heads"], quantiles)
    out = points.assign(quantile=_within_head_quantile(points, quantiles))
    out = out.merge(summary[["layer", "head", "head_bin", "sink_rate"]], on=["layer", "head"], how="left")
    with np.errstate(divide="ignore", invalid="ignore"):
        out["log_norm_ratio"] = np.log(out["norm_after"].to_numpy(float) / out["norm_clean"].to_numpy(float))
    out["delta_cos"] = out["cos_after"] - out["cos_clean"]
    # the random-direction control (clean pass): cos(s_i + random term, m_i) - cos(o_i, m_i); NaN in pieces
    # computed without it
    random = out["cos_random_clean"] if "cos_random_clean" in out else np.nan
    out["sink_vs_random"] = random - out["cos_clean"]
    return out


def _cone_tables(points: pd.DataFrame, sequences: pd.DataFrame, heads: pd.DataFrame, quantiles: int) -> SemanticConeTables:
    points = points.assign(quantile=_within_head_quantile(points, quantiles))
    summary = _head_summary(heads, quantiles)
    by_head = points.merge(summary[["layer", "head", "head_bin"]], on=["layer", "head"], how="left")
    by_quantile = pd.concat([
        _cone_stats(points, ["condition", "quantile"]).assign(binning="within_head"),
        _cone_stats(by_head.drop(columns="quantile").rename(columns={"head_bin": "quantile"}),
                    ["condition", "quantile"]).assign(binning="across_heads"),
    ], ignore_index=True)
    by_quantile = by_quantile[["binning", *[c for c in by_quantile.columns if c != "binning"]]]
    per_head = _cone_stats(points, ["condition", "layer", "head"])
    per_head = summary.drop(columns="head_bin").merge(per_head, on=["layer", "head"], how="right")
    rows = []
    n_tokens = sequences["n_tokens"].sum()
    for condition in CONDITIONS:
        ppl_clean = math.exp(sequences["nll_clean"].sum() / n_tokens)
        ppl = math.exp(sequences[f"nll_{condition}"].sum() / n_tokens)
        diff = (sequences[f"nll_{condition}"] - sequences["nll_clean"]) / sequences["n_tokens"]
        half = 1.96 * diff.std(ddof=1) / math.sqrt(len(diff)) if len(diff) > 1 else np.nan
        rows.append({"condition": condition, "ppl_clean": ppl_clean, "ppl": ppl, "delta_ppl": ppl - ppl_clean,
                     "delta_log_ppl": diff.mean(), "ci_low": diff.mean() - half, "ci_high": diff.mean() + half,
                     "num_sequences": len(diff)})
    return SemanticConeTables(by_quantile, per_head, pd.DataFrame(rows))


def _tables(parts: dict, blocks, *, quantiles: int, **_) -> SemanticConeTables:
    return _cone_tables(parts["points"], parts["sequences"], parts["heads"], quantiles)


def _summary(tables: dict, add) -> None:
    if "semantic_cone" in tables:
        q = tables["semantic_cone"]
        for binning, prefix in (("within_head", ""), ("across_heads", "heads_")):
            for condition in CONDITIONS:
                rows = q[(q["condition"] == condition) & (q["binning"] == binning)].sort_values("quantile")
                if len(rows):
                    low, high = rows.iloc[0], rows.iloc[-1]
                    name = f"{prefix}{condition}"
                    add("semantic_cone", f"{name}_cos_clean_lowest_norm_quantile", low["cos_clean"])
                    add("semantic_cone", f"{name}_cos_after_lowest_norm_quantile", low["cos_after"])
                    add("semantic_cone", f"{name}_delta_cos_lowest_norm_quantile", low["delta_cos"])
                    add("semantic_cone", f"{name}_delta_cos_highest_norm_quantile", high["delta_cos"])
                    add("semantic_cone", f"{name}_norm_ratio_lowest_norm_quantile", low["norm_ratio"])
                    add("semantic_cone", f"{name}_norm_ratio_highest_norm_quantile", high["norm_ratio"])
    if "semantic_cone-ppl" in tables:
        p = tables["semantic_cone-ppl"]
        for _, row in p.iterrows():
            add("semantic_cone", f"{row['condition']}_ppl_clean", row["ppl_clean"])
            add("semantic_cone", f"{row['condition']}_delta_ppl", row["delta_ppl"])
            add("semantic_cone", f"{row['condition']}_delta_log_ppl", row["delta_log_ppl"])
            add("semantic_cone", f"{row['condition']}_delta_log_ppl_ci_low", row["ci_low"])
            add("semantic_cone", f"{row['condition']}_delta_log_ppl_ci_high", row["ci_high"])


# claims
class PerplexityChanges(NamedTuple):
    """Perplexity per condition; per intervention ``delta_log`` (nats per token) and ``delta_ppl``;
    ``sink_minus_control`` / ``sink_minus_mass``: Delta log-PPL of the sink minus that of each control.
    Each ``(estimate, low, high)``, a bootstrap over sequences with shared resamples."""

    ppl: dict
    delta_log: dict
    delta_ppl: dict
    sink_minus_control: tuple
    sink_minus_mass: tuple = (np.nan, np.nan, np.nan)


def drift_points(raw: Mapping[str, pd.DataFrame], quantiles: int = 5) -> pd.DataFrame:
    """The drift curve's long rows: per clean (layer, sequence, head, query) and ``k`` weak tokens kept
    (0: all tail tokens), ``cos`` with m_i, and the output's ``quantile`` of its clean norm."""
    weak = raw["weak"]
    edges = weak.groupby(["layer", "head"])["norm_clean"].quantile(np.linspace(0, 1, quantiles + 1)[1:-1]).unstack()
    edge_rows = (edges.loc[pd.MultiIndex.from_frame(weak[["layer", "head"]])].to_numpy() if len(edges.columns)
                 else np.zeros((len(weak), 0)))
    weak = weak.assign(quantile=1 + (weak["norm_clean"].to_numpy()[:, None] > edge_rows).sum(1))
    columns = [c for c in weak.columns if c.startswith("cos_k")]
    long = weak.melt(id_vars=["layer", "sequence", "head", "query", "norm_clean", "quantile"], value_vars=columns,
                     var_name="k", value_name="cos")
    long["k"] = long["k"].str.slice(5).replace("all", "0").astype(int)
    # the null (cos_null: the same weights on random tail keys; NaN for k = 0 and in pieces without it),
    # cos_minus_null = cos - cos_null
    nulls = [f"null_k{c[5:]}" for c in columns]
    null = np.concatenate([weak[c].to_numpy(float) if c in weak else np.full(len(weak), np.nan) for c in nulls]) \
        if len(columns) else np.zeros(0)
    long["cos_null"] = null
    long["cos_minus_null"] = long["cos"] - long["cos_null"]
    return long


def drift_curve(raw: Mapping[str, pd.DataFrame], quantiles: int = 5, n_resamples: int = 1000,
                seed: int = 0) -> stats.ClusterBootstrap:
    """Mean cos per (``outputs``: "lowest" norm bin or "all", k) with a cluster bootstrap over sequences, plus
    ``cos_null`` (the k weakest weights on k random tail keys) and ``cos_minus_null``."""
    long = drift_points(raw, quantiles)
    both = pd.concat([long.assign(outputs="all"), long[long["quantile"] == 1].assign(outputs="lowest")],
                     ignore_index=True)
    return stats.cluster_bootstrap(both, ["cos", "cos_null", "cos_minus_null"], ["outputs", "k"],
                                   n_resamples=n_resamples, seed=seed)


def perplexity_changes(sequences: pd.DataFrame, conditions=("sink", "sink_renorm", "control", "control_mass"),
                       n_resamples: int = 1000, seed: int = 0) -> PerplexityChanges:
    """From the cone's raw ``sequences`` table (``n_tokens`` and summed ``nll_<condition>`` per sequence)."""
    names = ["clean", *conditions]
    long = pd.concat([pd.DataFrame({"sequence": sequences["sequence"], "condition": name,
                                    "n_tokens": sequences["n_tokens"], "nll": sequences[f"nll_{name}"] / sequences["n_tokens"]})
                      for name in names], ignore_index=True)
    boot = stats.cluster_bootstrap(long, "nll", "condition", weight="n_tokens", n_resamples=n_resamples, seed=seed)
    row = {c: i for i, c in enumerate(boot.table["condition"])}
    ppl = {c: tuple(np.exp(boot.interval(row[c], "nll"))) for c in names}
    delta_log = {c: tuple(boot.contrast(row[c], row["clean"], "nll")) for c in conditions}
    delta_ppl = {c: _delta_ppl(boot, row[c], row["clean"]) for c in conditions}
    minus = {c: (tuple(boot.contrast(row["sink"], row[c], "nll")) if {"sink", c} <= set(conditions) else (np.nan,) * 3)
             for c in ("control", "control_mass")}
    return PerplexityChanges(ppl, delta_log, delta_ppl, minus["control"], minus["control_mass"])


def _delta_ppl(boot: stats.ClusterBootstrap, first: int, second: int) -> tuple[float, float, float]:
    """exp(mean NLL) of row ``first`` minus that of row ``second``, percentile interval over the same resamples."""
    nll, reps = boot.table["nll"].to_numpy(float), boot.replicates["nll"]
    estimate = float(np.exp(nll[first]) - np.exp(nll[second]))
    if min(boot.table["n_clusters"].iloc[[first, second]]) < 2:
        return (estimate, np.nan, np.nan)
    low, high = stats.percentile_interval((np.exp(reps[:, first]) - np.exp(reps[:, second]))[:, None], boot.confidence)
    return (estimate, float(low[0]), float(high[0]))


def cone_claims(raw: Mapping[str, pd.DataFrame], quantiles: int = 5, n_resamples: int = 1000,
                seed: int = 0) -> pd.DataFrame:
    """Chapter 7: removing the sink turns the lowest-norm outputs towards the cone axis (more than a random
    token, more than for the highest-norm outputs) and raises perplexity (more than the control); each
    part's bootstrap interval over sequences above 0. ``raw``: the semantic cone's raw pieces."""
    return claims_frame(_claim_rows(raw, quantiles, n_resamples, seed))


def _claim_rows(raw: Mapping[str, pd.DataFrame], quantiles: int, n_resamples: int, seed: int) -> list[dict]:
    points = cone_points(raw, quantiles)
    # one set of resampled documents for both columns (adding the second changes nothing in the first)
    within = stats.cluster_bootstrap(points, ["delta_cos", "sink_vs_random"], ["condition", "quantile"],
                                     n_resamples=n_resamples, seed=seed)
    conditions = tuple(c for c in CONDITIONS if f"nll_{c}" in raw["sequences"])
    changes = perplexity_changes(raw["sequences"], conditions, n_resamples=n_resamples, seed=seed)
    sink_low = dict(condition="sink", quantile=1)
    why = "" if raw["heads"]["selected"].any() else "no head intervened on (no sink rate above the threshold)"
    if why:  # the perplexity is unchanged by construction: not a measurement
        nan = (np.nan,) * 3
        changes = PerplexityChanges(changes.ppl, {c: nan for c in changes.delta_log}, changes.delta_ppl, nan, nan)
    rows = [
        claim_row(7, CONE, "removing the sink turns them towards the cone axis", "Δcos, lowest-norm bin, sink removed",
                  "dcos_sink_q1", group_value(within, "delta_cos", **sink_low), 0.0, "above"),
        claim_row(7, CONE, "more than the control does (one random token, the paper's control)",
                  "Δcos(sink) − Δcos(control), lowest-norm bin", "dcos_sink_minus_control",
                  contrast(within, "delta_cos", sink_low, dict(condition="control", quantile=1)), 0.0, "above"),
        claim_row(7, CONE, "more than a mass-matched control does",
                  "Δcos(sink) − Δcos(mass-matched control), lowest-norm bin", "dcos_sink_minus_mass",
                  contrast(within, "delta_cos", sink_low, dict(condition="control_mass", quantile=1)), 0.0, "above"),
        claim_row(7, CONE, "more for low-norm than for high-norm outputs",
                  "Δcos(lowest bin) − Δcos(highest bin), sink removed", "dcos_low_minus_high",
                  contrast(within, "delta_cos", sink_low, dict(condition="sink", quantile=quantiles)), 0.0, "above"),
        claim_row(7, CONE, "more than replacing the sink's term by a random one of the same norm (a control "
                  "not inside the cone by construction)",
                  "cos(sᵢ + random term of norm aᵢ‖ṽ₀‖, mᵢ) − cos(oᵢ, mᵢ), lowest-norm bin, clean pass",
                  "dcos_sink_minus_random_direction",
                  group_value(within, "sink_vs_random", **sink_low), 0.0, "above"),
        claim_row(7, PERPLEXITY, "perplexity rises", "Δ log PPL, sink removed", "dlog_sink",
                  changes.delta_log["sink"], 0.0, "above"),
        claim_row(7, PERPLEXITY, "more than removing a random token (the paper's control)",
                  "Δ log PPL(sink) − Δ log PPL(control)", "dlog_sink_minus_control", changes.sink_minus_control, 0.0,
                  "above"),
        claim_row(7, PERPLEXITY, "more than removing the same attention mass elsewhere",
                  "Δ log PPL(sink) − Δ log PPL(mass-matched control)", "dlog_sink_minus_mass", changes.sink_minus_mass,
                  0.0, "above"),
    ]
    for row in rows:
        if why and row["verdict"] == stats.NOT_MEASURED:
            row["why"] = why
    if "weak" in raw and len(raw["weak"]):
        curve = drift_curve(raw, quantiles, n_resamples, seed)
        ks = sorted(k for k in curve.table["k"].unique() if k > 0)
        for outputs, key, text in (("lowest", "drift_weak_q1", "lowest-norm bin"), ("all", "drift_weak_all", "all outputs")):
            rows.append(claim_row(7, DRIFT, f"the sum of more weak tokens points closer to the cone axis ({text})",
                                  f"cos(k={ks[-1]} weakest, mᵢ) − cos(k=1 weakest, mᵢ), {text}", key,
                                  contrast(curve, "cos", dict(outputs=outputs, k=ks[-1]), dict(outputs=outputs, k=1)),
                                  0.0, "above"))
        # any sum of many vectors with a nonzero mean aligns with that mean: the null keeps the k weakest
        # weights and puts them on k random tail keys, so only what is particular to the weak tokens remains
        for outputs, key, text in (("lowest", "drift_null_q1", "lowest-norm bin"), ("all", "drift_null_all", "all outputs")):
            rows.append(claim_row(7, DRIFT, f"more than the same weights on random tail tokens (a null; {text})",
                                  f"cos(k={ks[-1]} weakest, mᵢ) − cos(the same weights on {ks[-1]} random tail keys, mᵢ), "
                                  f"{text}", key, group_value(curve, "cos_minus_null", outputs=outputs, k=ks[-1]),
                                  0.0, "above"))
    n_documents = int(raw["sequences"]["sequence"].nunique()) if "sequence" in raw["sequences"] else 0
    for row in rows:  # every interval here resamples whole documents
        row["unit"], row["n_units"] = "document", n_documents
    return rows


def _claims(results, *, quantiles: int, n_resamples: int, seed: int, **_) -> list[dict]:
    return _claim_rows(results["raw"]["semantic_cone"], quantiles, n_resamples, seed)


ANALYSIS = register(Analysis("semantic_cone", _SemanticConeCollector, _tables,
                             stems=("semantic_cone", "semantic_cone-heads", "semantic_cone-ppl"),
                             collector_options=("heads", "threshold", "seed"), summary=_summary, claims=_claims,
                             options=(HEADS, THRESHOLD, QUANTILES, SEED)))


@ANALYSIS.public
def sink_semantic_cone(model, tokenizer, data, **options) -> SemanticConeTables:
    """Remove the sink's value in every layer and compare head outputs and perplexity with controls.

    Conditions (one forward pass each, every layer at once, queries i >= 1):

    * ``sink``: alpha_i0 := 0 without renormalising, so the head output becomes its semantic component
      s_i (the same as v~_0 = 0 for these queries).
    * ``sink_renorm``: the sink left out of the softmax, s_i / (1 - alpha_i0): the sink's vector is
      missing but the output norm does not collapse.
    * ``control``: one random non-sink key r per sequence (seeded) gets alpha_ir := 0 for all i > r.
    * ``control_mass``: as much attention as ``sink`` removes, from other keys
      (:func:`mass_matched_removal`).

    ``heads``: "all", or "sink" (heads whose clean sink rate in that sequence exceeds ``threshold``; the
    controls use the same heads). Per head and query both runs give ||o^h_i|| and cos(o^h_i, m_i), m_i =
    mean_{1<=j<=i} v~_j the axis of the semantic cone, and the drift cos(clean, intervened). The raw
    pieces also hold ``weak`` (:func:`drift_points`).

    ``by_quantile``: per (binning, condition, quantile) ``n``, ``norm_clean``, ``norm_after``,
    ``norm_ratio`` (median after/clean), ``cos_clean``, ``cos_after``, ``delta_cos``, ``drift``; binnings
    ``within_head`` (each output by its clean norm among its head's outputs) and ``across_heads`` (heads
    by their mean clean norm). ``heads``: the same per (condition, layer, head), plus ``sink_rate``,
    ``selected``, ``head_norm``, ``norm_quantile_of_head``. ``ppl``: per condition ``ppl_clean``, ``ppl``,
    ``delta_ppl``, ``delta_log_ppl`` with a normal 95% ``ci_low``/``ci_high``, ``num_sequences``.

    Options: ``heads``, ``threshold``, ``quantiles``, ``seed`` and the run options (:class:`cwcore.sinks.SinkOptions`)."""

