"""Does the sink shorten the output? Both readings of the paper, at every place a norm can be read (chapter 6).

With o_i = a_i v~_0 + s_i (a_i = alpha_i0), "the sink suppresses the output norm" compares ||o_i||
with the output *without the sink*, read two ways:

* **raw**: without the sink's term, s_i (zeroed, not renormalised). It suppresses exactly when
  cos(v~_0, s_i) < -a_i ||v~_0|| / (2 ||s_i||): anti-alignment strong enough for the term's length.
* **renormalised**: without the sink as a key, s^_i = s_i / (1 - a_i). Then ||o_i|| < ||s^_i||
  whenever ||v~_0|| < ||s^_i||: a short sink value suppresses whatever its direction.

Each is read per **head**, at the **attention output** (the sum over heads, before the bias) and,
where the block has one, **after the post-attention norm** (Gemma 2/3, OLMo 2; NaN elsewhere, "no
post-attention norm"). :func:`post_attention_norms` finds that norm by observation: the norm module
that receives exactly the output projection's output in a probe pass."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import nn

from .. import stats
from ..core import architectures
from .engine import EPS
from .intervals import claim_row, no_sink_heads

__all__ = ["READINGS", "PLACES", "post_attention_norms", "block_points", "head_points", "suppression_table",
           "suppression_claim_rows", "lowest_norm_ratio", "NO_POST_NORM"]

#: the two readings of "the output without the sink"
READINGS = ("raw", "renormalised")
#: where the norm is read
PLACES = ("head", "attention output", "after post-norm")
NO_POST_NORM = "no post-attention norm"
_SUPPRESSION = "the sink suppresses the output norm"


# the post-attention norm, found by observation


# the one rule lives with the other model facts (cwcore.core.architectures); re-exported here
post_attention_norms = architectures.post_attention_norms


# per (sequence, layer, query): the attention output and its two counterfactuals, before and after the norm
def _model_space(x: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """sum_h W_O^h x^h: ``[b, h, q, d] x [h, model, d] -> [b, q, model]``."""
    return torch.einsum("bhqd,hmd->bqm", x, w_o)


def block_points(s, start: int, norm: nn.Module | None, bias: torch.Tensor | None, sink: int = 0) -> pd.DataFrame:
    """Per (sequence, query > sink) of layer state ``s``: ``out``, ``raw``, ``renorm`` (||o_i||, ||sum_h
    s^h_i||, ||sum_h s^h_i / (1 - a^h_i)||, no bias), the same plus bias through the post-attention
    ``norm`` (``post_*``, NaN without one) and ``alpha0`` (mean over heads of a^h_i)."""
    a = s.probs[..., sink]  # [b, h, q]
    tail = 1 - a
    semantic = s.semantic
    renorm = torch.where(tail[..., None] > 1e-6, semantic / tail.clamp_min(1e-6)[..., None],
                         torch.full_like(semantic, float("nan")))
    vectors = torch.stack([_model_space(x, s.w_o) for x in (s.mixed, semantic, renorm)])  # [3, b, q, m]
    b, T = vectors.shape[1:3]
    q = slice(sink + 1, None)
    norms = vectors.norm(dim=-1)[:, :, q]  # [3, b, q']
    if norm is not None:  # at float32 at least, as the geometry (a bf16 norm rounded the norms by up to 0.7%)
        from ..logit_attribution import norm_at_float32

        x = vectors if bias is None else vectors + bias.to(vectors.dtype)
        after = torch.stack([norm_at_float32(norm, v).to(vectors.dtype) for v in x])
        post = after.norm(dim=-1)[:, :, q]
    else:
        post = torch.full_like(norms, float("nan"))
    n = T - sink - 1
    return pd.DataFrame({
        "layer": np.full(b * n, s.layer, np.int32),
        "sequence": np.repeat(np.arange(b) + start, n).astype(np.int32),
        "query": np.tile(np.arange(sink + 1, T), b).astype(np.int32),
        "alpha0": a[:, :, q].mean(1).reshape(-1).cpu().numpy(),
        **{name: norms[k].reshape(-1).cpu().numpy() for k, name in enumerate(("out", "raw", "renorm"))},
        **{name: post[k].reshape(-1).cpu().numpy() for k, name in enumerate(("post_out", "post_raw", "post_renorm"))},
    })


def head_points(points: pd.DataFrame) -> pd.DataFrame:
    """The convexity points (per sequence, layer, head, query) with both readings per head:
    ``raw`` = ||s_i||, ``renorm`` = ||s_i|| / (1 - a_i) = ||s^_i|| and ``out`` = ||o_i||."""
    s = np.sqrt(points["s_sq"].clip(lower=0).to_numpy(float))
    alpha = points["alpha0"].to_numpy(float) if "alpha0" in points else np.full(len(points), np.nan)
    # a query that does not see the sink (alpha_i0 = 0: a sliding window) has o_i = s_i exactly, not the
    # rounding of two norms computed apart (which read as shortened for half of them)
    s = np.where(alpha == 0, points["norm"].to_numpy(float), s)
    tail = 1 - alpha
    with np.errstate(divide="ignore", invalid="ignore"):
        renorm = np.where(tail > 1e-6, s / tail, np.nan)
    return pd.DataFrame({"layer": points["layer"].to_numpy(), "head": points["head"].to_numpy(),
                         "sequence": points["sequence"].to_numpy(), "alpha0": alpha,
                         "out": points["norm"].to_numpy(float), "raw": s, "renorm": renorm,
                         "v0": np.sqrt(points["v0_sq"].clip(lower=0).to_numpy(float)) if "v0_sq" in points
                         else np.full(len(points), np.nan)})


def _shortened(out, counterfactual) -> np.ndarray:
    """1.0 where ||o|| < ||counterfactual||, 0.0 where not, NaN where undefined (a zero or NaN counterfactual)."""
    out, cf = np.asarray(out, float), np.asarray(counterfactual, float)
    with np.errstate(invalid="ignore"):
        flag = (out < cf).astype(float)
    return np.where(np.isfinite(out) & np.isfinite(cf) & (cf > 0), flag, np.nan)


def _log_ratio(out, counterfactual) -> np.ndarray:
    """log(||o|| / ||counterfactual||): below 0 where the sink shortens the output."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.log(np.asarray(out, float) / np.asarray(counterfactual, float))
    return np.where(np.isfinite(r), r, np.nan)


def _place_frames(points: pd.DataFrame, block: pd.DataFrame | None, sink_heads: pd.Index) -> dict[str, pd.DataFrame]:
    """Per place: rows (sequence, layer, ...) with ``shortened_<reading>`` and ``log_ratio_<reading>``."""
    heads = head_points(points)
    keep = pd.MultiIndex.from_frame(heads[["layer", "head"]]).isin(sink_heads)
    frames = {"head": heads[keep]}
    if block is not None and len(block):
        sink_layers = set(int(l) for l, _ in sink_heads)
        in_sink_layer = block["layer"].isin(sink_layers).to_numpy()
        frames["attention output"] = block[in_sink_layer][["layer", "sequence", "out", "raw", "renorm"]]
        post = block[in_sink_layer & np.isfinite(block["post_out"].to_numpy(float))]
        frames["after post-norm"] = post[["layer", "sequence"]].assign(
            out=post["post_out"], raw=post["post_raw"], renorm=post["post_renorm"])
    out = {}
    for place, f in frames.items():
        f = f.copy()
        for reading, column in (("raw", "raw"), ("renormalised", "renorm")):
            f[f"shortened_{reading}"] = _shortened(f["out"], f[column])
            f[f"log_ratio_{reading}"] = _log_ratio(f["out"], f[column])
        out[place] = f
    return out


def _sink_head_index(fits: pd.DataFrame, eps: float) -> pd.Index:
    heads = fits[fits["scope"] == "head"]
    heads = heads[heads["sink_rate"] > eps]
    return pd.MultiIndex.from_arrays([heads["layer"].astype(int), heads["head"].astype(int)])


def suppression_table(fits: pd.DataFrame, points: pd.DataFrame, block: pd.DataFrame | None, eps: float = EPS.default,
                      by: tuple[str, ...] = (), n_resamples: int = 1000, seed: int = 0,
                      layer_types: dict | None = None) -> pd.DataFrame:
    """Both readings at every place, pooled over the sink heads' queries, resampling whole sequences: per
    (place, reading[, by]) ``share`` of shortened outputs and ``geo_ratio`` (exp mean log ||o|| / ||cf||),
    each with ``_low``/``_high``, ``n``, ``n_sequences`` and ``why`` (a place not measured)."""
    sink_heads = _sink_head_index(fits, eps)
    frames = _place_frames(points, block, sink_heads)
    rows = []
    for place in PLACES:
        f = frames.get(place)
        why = ""
        if not len(sink_heads):
            why = no_sink_heads(eps)
        elif place == "after post-norm" and (f is None or not len(f)):
            why = NO_POST_NORM if block is not None else "not collected"
        elif f is None:
            why = "not collected"
        if why:
            for reading in READINGS:
                rows.append({"place": place, "reading": reading, "share": np.nan, "share_low": np.nan,
                             "share_high": np.nan, "geo_ratio": np.nan, "geo_ratio_low": np.nan,
                             "geo_ratio_high": np.nan, "n": 0, "n_sequences": 0, "why": why})
            continue
        if "layer_type" in by:
            f = f.assign(layer_type=[(layer_types or {}).get(int(layer), "global") for layer in f["layer"]])
        columns = [f"{k}_{r}" for k in ("shortened", "log_ratio") for r in READINGS]
        boot = stats.cluster_bootstrap(f, columns, list(by), cluster="sequence", n_resamples=n_resamples, seed=seed)
        t = boot.table
        for reading in READINGS:
            part = t[list(by)].copy() if by else pd.DataFrame(index=t.index)
            part["place"], part["reading"] = place, reading
            sh, lr = f"shortened_{reading}", f"log_ratio_{reading}"
            part["share"], part["share_low"], part["share_high"] = t[sh], t[f"{sh}_low"], t[f"{sh}_high"]
            part["geo_ratio"], part["geo_ratio_low"], part["geo_ratio_high"] = (np.exp(t[lr]), np.exp(t[f"{lr}_low"]),
                                                                                np.exp(t[f"{lr}_high"]))
            part["n"], part["n_sequences"], part["why"] = t["n"], t["n_clusters"], ""
            rows += part.to_dict("records")
    columns = ["place", "reading", *by, "share", "share_low", "share_high", "geo_ratio", "geo_ratio_low",
               "geo_ratio_high", "n", "n_sequences", "why"]
    return pd.DataFrame(rows).reindex(columns=columns)


def suppression_claim_rows(fits: pd.DataFrame, points: pd.DataFrame, block: pd.DataFrame | None, eps: float = EPS.default,
                           n_resamples: int = 1000, seed: int = 0, layer_types: dict | None = None) -> list[dict]:
    """Per place and reading, the share of shortened outputs above 0.5 (bootstrap over sequences). The raw
    reading per head (key ``shortened``) is a part of "the sink suppresses the output norm"; the others
    are separate claims ``"... [<reading>, <place>]"`` (and per layer type with ``layer_types``)."""
    table = suppression_table(fits, points, block, eps, n_resamples=n_resamples, seed=seed).assign(layer_type="all")
    if layer_types and len(set(layer_types.values())) > 1:
        by_type = suppression_table(fits, points, block, eps, by=("layer_type",), n_resamples=n_resamples, seed=seed,
                                    layer_types=layer_types)
        by_type = by_type[by_type["layer_type"].notna()] if "layer_type" in by_type else by_type.iloc[:0]
        table = pd.concat([table, by_type], ignore_index=True)
    if block is None:  # no block piece (a points table built by hand): the places it holds are left out
        table = table[table["place"] == "head"]
    rows = []
    for _, r in table.iterrows():
        primary = r["reading"] == "raw" and r["place"] == "head" and r["layer_type"] == "all"
        claim = _SUPPRESSION if primary else f"{_SUPPRESSION} [{r['reading']}, {r['place']}]"
        key = "shortened" if primary else f"shortened_{r['reading']}@{r['place'].replace(' ', '_')}"
        if r["layer_type"] != "all":
            claim, key = f"{claim} [{r['layer_type']} layers]", f"{key}@{r['layer_type']}"
        cf = {"raw": "the output without the sink term", "renormalised": "the output with the sink renormalised away"}
        where = {"head": "sink-head queries", "attention output": "attention outputs of layers with a sink head",
                 "after post-norm": "post-norm outputs of layers with a sink head"}[r["place"]]
        rows.append(claim_row(6, claim, f"{r['reading']} reading, {r['place']}: shorter than {cf[r['reading']]}",
                              f"share of {where} with ‖o‖ < ‖{'s' if r['reading'] == 'raw' else 'ŝ'}‖", key,
                              (r["share"], r["share_low"], r["share_high"]), 0.5, "above", int(r["n"]), r["why"],
                              unit="document", n_units=int(r["n_sequences"])))
    return rows


def lowest_norm_ratio(points: pd.DataFrame, quantiles: int = 5, n_resamples: int = 1000, seed: int = 0,
                      heads: pd.Index | None = None) -> stats.Interval:
    """Mean ||s^_i|| over mean ||o^h_i|| on each head's lowest-norm ``quantiles`` bin (> 1: the sink,
    renormalised away, would lengthen them), bootstrap over sequences; ``heads``: only these pairs."""
    h = head_points(points)
    if heads is not None:
        h = h[pd.MultiIndex.from_frame(h[["layer", "head"]]).isin(heads)]
    if not len(h):
        return stats.Interval(np.nan, np.nan, np.nan)
    cut = h.groupby(["layer", "head"])["out"].transform(lambda x: x.quantile(1 / quantiles))
    low = h[(h["out"] <= cut) & np.isfinite(h["renorm"])]
    boot = stats.cluster_bootstrap(low, ["renorm", "out"], cluster="sequence", n_resamples=n_resamples, seed=seed)
    estimate = float(boot.table["renorm"].iloc[0] / boot.table["out"].iloc[0])
    ratio = boot.replicates["renorm"][:, 0] / boot.replicates["out"][:, 0]
    lo, hi = stats.percentile_interval(ratio[:, None])
    if boot.table["n_clusters"].iloc[0] < 2:
        return stats.Interval(estimate, np.nan, np.nan)
    return stats.Interval(estimate, float(lo[0]), float(hi[0]))
