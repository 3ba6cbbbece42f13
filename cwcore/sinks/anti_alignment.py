"""Analysis 3, anti-alignment: does the sink's projected value point against the others? (chapter 6)"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from .engine import _COMMON, Analysis, Collector, _concat, _grid, _np, register, run_one
from .intervals import bootstrap_ci, claim_row, no_sink_heads, spearman_ci

__all__ = ["ANTI_ALIGNMENT", "TREND", "anti_alignment"]

#: the claims chapter 6 judges with this analysis
ANTI_ALIGNMENT = "anti-alignment"
TREND = "stronger sink, stronger anti-alignment"


class _AntiAlignmentCollector(Collector):
    """Piece ``points``: per (sequence, layer, head, position p >= 1) alpha_p0, cos(v~_0, v~_p) (key p),
    cos(v~_0, s_p) (query p), and per-sequence constants."""

    def __init__(self, *args, **options):
        super().__init__(*args, **options)
        self.rows = []

    def on_layer(self, s):
        v = s.values  # [b, h, k, d]
        b, h, T, _ = v.shape
        norms = s.value_norm  # [b, h, k]
        cos_vv = s.sink_inner(v) / (norms[..., :1] * norms)
        cos_vs = s.sink_inner(s.semantic) / (norms[..., :1] * s.semantic_norm)
        axis = v[:, :, 1:].mean(2, keepdim=True)
        cos_axis = s.sink_inner(axis)[..., 0] / (norms[..., 0] * s.norm(axis)[..., 0])  # [b, h]
        tail_median = norms[..., 1:].median(-1).values

        def per_row(x):  # [b, h] -> one value per row
            return np.repeat(_np(x), T - 1)

        cols = _grid((b, h, T - 1), ("sequence", "head", "position"), {"sequence": self.start, "position": 1})
        self.rows.append(pd.DataFrame({
            "layer": np.full(b * h * (T - 1), s.layer, np.int32), **cols,
            "alpha0": _np(s.probs[:, :, 1:, 0]), "cos_value": _np(cos_vv[..., 1:]),
            "cos_semantic": _np(cos_vs[..., 1:]), "cos_axis": per_row(cos_axis),
            "sink_value_norm": per_row(norms[..., 0]), "relative_sink_value_norm": per_row(norms[..., 0] / tail_median),
        }))

    def finish(self, logits):
        return {"points": _concat(self.rows)}


def anti_alignment(
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
    """Per (layer, head): does the sink's projected value point against the others?

    Per sequence and head: ``cos(v~_0, v~_j)`` for every key j >= 1; ``cos(v~_0, s_i)`` for every query
    i >= 1, with s_i = sum_{j>0} alpha_ij v~_j the head's non-sink ("semantic") output component;
    ``cos(v~_0, m)`` with m = mean_{j>=1} v~_j the semantic mean of the sequence.
    One row per (layer, head): ``sink_rate`` (mean alpha_i0, queries >= 1), ``is_sink_head`` (> eps),
    ``cos_value_mean``/``_median``/``_frac_negative`` (over keys and sequences),
    ``cos_semantic_mean``/``_median``/``_frac_negative`` (over queries and sequences; queries whose s_i is
    zero are skipped), ``cos_semantic_weighted`` (the same mean weighted by alpha_i0 (1 - alpha_i0): the
    queries where both components matter), ``cos_axis_mean`` (over sequences), ``sink_value_norm`` (mean
    of ||v~_0||) and ``relative_sink_value_norm`` (||v~_0|| / median_j ||v~_j||, mean over sequences).
    """
    del seed
    common = {k: v for k, v in locals().items() if k in _COMMON}
    return run_one("anti_alignment", model, tokenizer, data, {"eps": eps}, common)


def _anti_alignment_table(points: pd.DataFrame, eps: float) -> pd.DataFrame:
    g = points.groupby(["layer", "head"])
    weight = points["alpha0"] * (1 - points["alpha0"])
    finite = points["cos_semantic"].notna()
    weighted = (points["cos_semantic"].where(finite, 0) * weight.where(finite, 0)).groupby(
        [points["layer"], points["head"]]).sum() / weight.where(finite, 0).groupby([points["layer"], points["head"]]).sum()
    per_sequence = points.groupby(["layer", "head", "sequence"])[["cos_axis", "sink_value_norm", "relative_sink_value_norm"]].first()
    table = pd.DataFrame({
        "sink_rate": g["alpha0"].mean(),
        "cos_value_mean": g["cos_value"].mean(),
        "cos_value_median": g["cos_value"].median(),
        "cos_value_frac_negative": g["cos_value"].apply(lambda x: float((x < 0).mean())),
        "cos_semantic_mean": g["cos_semantic"].mean(),
        "cos_semantic_median": g["cos_semantic"].median(),
        "cos_semantic_frac_negative": g["cos_semantic"].apply(lambda x: float((x.dropna() < 0).mean())),
        "cos_semantic_weighted": weighted,
        "cos_axis_mean": per_sequence["cos_axis"].groupby(["layer", "head"]).mean(),
        "sink_value_norm": per_sequence["sink_value_norm"].groupby(["layer", "head"]).mean(),
        "relative_sink_value_norm": per_sequence["relative_sink_value_norm"].groupby(["layer", "head"]).mean(),
    }).reset_index()
    table.insert(3, "is_sink_head", table["sink_rate"] > eps)
    return table


def _tables(parts: dict, blocks, *, eps: float, **_) -> pd.DataFrame:
    return _anti_alignment_table(parts["points"], eps)


def _summary(tables: dict, add) -> None:
    if "anti_alignment" in tables:
        a = tables["anti_alignment"]
        sink = a[a["is_sink_head"]]
        add("anti_alignment", "median_cos_value_all_heads", a["cos_value_mean"].median())
        add("anti_alignment", "median_cos_semantic_all_heads", a["cos_semantic_mean"].median())
        add("anti_alignment", "num_sink_heads", len(sink))
        add("anti_alignment", "median_cos_value_sink_heads", sink["cos_value_mean"].median() if len(sink) else np.nan)
        add("anti_alignment", "median_cos_semantic_sink_heads", sink["cos_semantic_mean"].median() if len(sink) else np.nan)
        add("anti_alignment", "share_sink_heads_cos_semantic_negative",
            (sink["cos_semantic_mean"] < 0).mean() if len(sink) else np.nan)
        add("anti_alignment", "share_all_heads_cos_semantic_negative", (a["cos_semantic_mean"] < 0).mean())
        add("anti_alignment", "spearman_sink_rate_vs_cos_semantic",
            a["sink_rate"].rank().corr(a["cos_semantic_mean"].rank()))
        add("anti_alignment", "median_relative_sink_value_norm_sink_heads",
            sink["relative_sink_value_norm"].median() if len(sink) else np.nan)


def _claim_rows(anti_alignment: pd.DataFrame, n_bootstrap: int = 1000, seed: int = 0, eps: float = 0.3) -> list[dict]:
    """Medians over sink heads of the mean cosines below 0 (bootstrap over heads), and their trend with the
    sink rate over all heads (Spearman rho below 0)."""
    boot = dict(n_bootstrap=n_bootstrap, seed=seed)
    sink_aa = anti_alignment[anti_alignment["is_sink_head"].astype(bool)]
    why = "" if len(sink_aa) else no_sink_heads(eps)
    return [
        claim_row(6, ANTI_ALIGNMENT, "sink value against the tail values", "median over sink heads of mean cos(ṽ₀, ṽⱼ)",
                  "cos_value", bootstrap_ci(sink_aa["cos_value_mean"], np.median, **boot), 0.0, "below", len(sink_aa),
                  why),
        claim_row(6, ANTI_ALIGNMENT, "sink value against the semantic component",
                  "median over sink heads of mean cos(ṽ₀, sᵢ)", "cos_semantic",
                  bootstrap_ci(sink_aa["cos_semantic_mean"], np.median, **boot), 0.0, "below", len(sink_aa), why),
        claim_row(6, TREND, "rank correlation over all heads", "Spearman ρ(sink rate, mean cos(ṽ₀, sᵢ))",
                  "rho_semantic", spearman_ci(anti_alignment["sink_rate"], anti_alignment["cos_semantic_mean"], **boot),
                  0.0, "below", len(anti_alignment)),
    ]


def _claims(results, *, n_bootstrap: int, seed: int, eps: float = 0.3, **_) -> list[dict]:
    return _claim_rows(results["anti_alignment"], n_bootstrap, seed, eps)


ANALYSIS = register(Analysis("anti_alignment", _AntiAlignmentCollector, _tables, stems=("anti_alignment",),
                             summary=_summary, claims=_claims))
