"""Analysis 3, anti-alignment: does the sink's projected value point against the others? (chapter 6)"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from .engine import EPS, SEED, Analysis, Collector, concat, flat, grid_columns, register
from .. import stats
from .intervals import claim_row, no_sink_heads, too_few_layers

__all__ = ["ANTI_ALIGNMENT", "TREND", "layer_profile", "sink_anti_alignment"]

#: the claims chapter 6 judges with this analysis
ANTI_ALIGNMENT = "anti-alignment"
TREND = "stronger sink, stronger anti-alignment"


class _AntiAlignmentCollector(Collector):
    """Piece ``points``: per (sequence, layer, head, position p >= 1) alpha_p0, cos(v~_0, v~_p) (key p),
    cos(v~_0, s_p) (query p), the baseline and centred cosines of query p (see :func:`sink_anti_alignment`),
    and per-sequence constants. Piece ``layers``: each layer's type (sliding / global)."""

    def __init__(self, *args, seed, **options):
        super().__init__(*args, **options)
        self.rows, self.layers, self.seed = [], [], seed

    def on_layer(self, s):
        v = s.values  # [b, h, k, d]
        b, h, T, d = v.shape
        p = s.sink_position
        norms = s.value_norm  # [b, h, k]
        sink_value = v[:, :, p : p + 1]  # [b, h, 1, d]
        semantic = s.semantic  # [b, h, q, d]
        cos_vv = s.sink_inner(v) / (norms[..., p : p + 1] * norms)
        cos_vs = s.sink_inner(semantic) / (norms[..., p : p + 1] * s.semantic_norm)
        axis = v[:, :, p + 1 :].mean(2, keepdim=True)
        cos_axis = s.sink_inner(axis)[..., 0] / (norms[..., p] * s.norm(axis)[..., 0])  # [b, h]
        tail_median = norms[..., p + 1 :].quantile(0.5, dim=-1)  # torch's median() is the lower middle value
        # the baseline: for query i a random non-sink key k it can see (alpha_ik > 0, uniformly), against
        # the rest of s_i; drawn per sequence (numpy's default_rng([seed, sequence, 4, layer])), so the draw
        # does not depend on batch_size: the visible key with the largest of uniform draws, one per key
        visible = (s.probs[..., p + 1 :] > 0).cpu().numpy()  # [b, h, q, tail key]
        alone = torch.as_tensor(visible.sum(-1) < 2).to(v.device)  # k is the only tail key: no rest (NaN)
        draws = np.stack([np.random.default_rng([self.seed, self.start + i, 4, int(s.layer)]).random(visible.shape[1:])
                          for i in range(b)])
        # queries up to the sink see no tail key: key p + 1 (their rows are dropped)
        key = torch.as_tensor(p + 1 + np.where(visible, draws, -1.0).argmax(-1)).to(v.device)  # [b, h, q]
        v_key = v.gather(2, key[..., None].expand(-1, -1, -1, d))  # [b, h, q, d]
        a_key = s.probs.gather(-1, key[..., None])[..., 0]  # [b, h, q]
        rest = semantic - a_key[..., None] * v_key  # s_i without key k's own term

        def cos(x, y, empty=None):
            c = s.inner(x, y) / (s.norm(x) * s.norm(y))
            return c if empty is None else c.masked_fill(empty, float("nan"))

        # centring: subtract the head's mean non-sink value m of the sequence from every value
        mean = axis  # [b, h, 1, d]
        tail_mass = s.probs[..., p + 1 :].sum(-1)  # sum_{j > p} alpha_ij = 1 - a_i without a learned sink
        semantic_c = semantic - tail_mass[..., None] * mean
        rest_c = rest - (tail_mass - a_key)[..., None] * mean
        q = slice(p + 1, None)
        cols = grid_columns((b, h, T - 1 - p), ("sequence", "head", "position"), {"sequence": self.start, "position": p + 1})

        def per_row(x):  # [b, h] -> one value per row
            return np.repeat(flat(x), T - 1 - p)

        self.rows.append(pd.DataFrame({
            "layer": np.full(b * h * (T - 1 - p), s.layer, np.int32), **cols,
            "alpha0": flat(s.probs[:, :, q, p]), "cos_value": flat(cos_vv[..., q]),
            "cos_semantic": flat(cos_vs[..., q]),
            "key": flat(key[..., q]).astype(np.int32), "cos_key": flat(cos(v_key, rest, alone)[..., q]),
            "cos_key_literal": flat(cos(v_key, semantic)[..., q]),
            "cos_semantic_centred": flat(cos((sink_value - mean).expand_as(semantic), semantic_c)[..., q]),
            "cos_key_centred": flat(cos(v_key - mean, rest_c, alone)[..., q]),
            "cos_axis": per_row(cos_axis),
            "sink_value_norm": per_row(norms[..., p]), "relative_sink_value_norm": per_row(norms[..., p] / tail_median),
        }))
        self.layers.append((s.layer, getattr(s, "layer_type", "global")))

    def finish(self, logits):
        return {"points": concat(self.rows), "layers": pd.DataFrame(self.layers, columns=["layer", "layer_type"])}


def _anti_alignment_table(points: pd.DataFrame, eps: float, layers: pd.DataFrame | None = None) -> pd.DataFrame:
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
        **{f"{c}_mean": g[c].mean() for c in _BASELINES if c in points},
    }).reset_index()
    table.insert(3, "is_sink_head", table["sink_rate"] > eps)
    if "cos_key_mean" in table:
        table["contrast"] = table["cos_semantic_mean"] - table["cos_key_mean"]
        table["contrast_centred"] = table["cos_semantic_centred_mean"] - table["cos_key_centred_mean"]
    types = {} if layers is None else dict(layers.drop_duplicates("layer")[["layer", "layer_type"]].itertuples(
        index=False, name=None))
    table["layer_type"] = [types.get(int(layer), "global") for layer in table["layer"]]
    return table


#: the per-query baseline and centred cosines of the ``points`` piece
_BASELINES = ("cos_key", "cos_key_literal", "cos_semantic_centred", "cos_key_centred")


def _tables(parts: dict, blocks, *, eps: float, **_) -> pd.DataFrame:
    return _anti_alignment_table(parts["points"], eps, parts.get("layers"))


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


def layer_profile(points: pd.DataFrame, table: pd.DataFrame, columns=("cos_semantic", "cos_key"), *,
                  sink_only: bool = False, n_resamples: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Per layer: the mean of ``columns`` over its heads' queries (all heads, or only sink heads), with
    95% intervals resampling whole sequences (documents), plus ``<first>_minus_<second>`` (a paired
    contrast of the first two columns), ``n_heads``, ``n_sink_heads`` and ``layer_type``."""
    columns = list(columns)
    heads = table.set_index(["layer", "head"])
    if sink_only:
        keep = pd.MultiIndex.from_frame(points[["layer", "head"]]).isin(heads.index[heads["is_sink_head"].astype(bool)])
        points = points[keep]
    if not len(points):
        return pd.DataFrame(columns=["layer", "layer_type", "n_heads", "n_sink_heads", *columns])
    boot = stats.cluster_bootstrap(points, columns, "layer", cluster="sequence", n_resamples=n_resamples, seed=seed)
    out = boot.table.copy()
    if len(columns) >= 2:
        name = f"{columns[0]}_minus_{columns[1]}"
        diff = boot.replicates[columns[0]] - boot.replicates[columns[1]]
        out[name] = out[columns[0]] - out[columns[1]]
        out[f"{name}_low"], out[f"{name}_high"] = stats.percentile_interval(diff)
        if (out["n_clusters"] < 2).any():
            out.loc[out["n_clusters"] < 2, [f"{name}_low", f"{name}_high"]] = np.nan
    grouped = table.groupby("layer")
    out["n_heads"] = out["layer"].map(grouped.size())
    out["n_sink_heads"] = out["layer"].map(grouped["is_sink_head"].sum()).astype(int)
    types = grouped["layer_type"].first().to_dict() if "layer_type" in table else {}
    out["layer_type"] = [types.get(layer, "global") for layer in out["layer"]]
    return out


def _claim_rows(anti_alignment: pd.DataFrame, n_resamples: int = 1000, seed: int = 0, eps: float = EPS.default) -> list[dict]:
    """Medians over sink heads of the mean cosines below 0, the sink against a random key (``contrast``
    below 0), both also on centred values (cluster bootstrap by layer, per layer type too), and the trend
    with the sink rate over all heads (Spearman rho below 0, bootstrap over heads)."""
    from . import intervals

    table = anti_alignment.copy()
    if "layer_type" not in table:
        table["layer_type"] = "global"
    sink_aa = table[table["is_sink_head"].astype(bool)]
    why = no_sink_heads(eps)
    boot = dict(n_resamples=n_resamples, seed=seed, why=why)

    def pooled(column, claim, part, text, key, statistic="median"):
        if column not in table:
            return []  # a table without the baseline columns (built by hand): no row
        return intervals.pooled_claim_rows(sink_aa, column, chapter=6, claim=claim, part=part, statistic_text=text,
                                           key=key, threshold=0.0, side="below", statistic=statistic, **boot)

    baseline = f"{ANTI_ALIGNMENT} [against a random key]"
    centred = f"{ANTI_ALIGNMENT} [centred values]"
    return [
        *pooled("cos_value_mean", ANTI_ALIGNMENT, "sink value against the tail values",
                "median over sink heads of mean cos(ṽ₀, ṽⱼ)", "cos_value"),
        *pooled("cos_semantic_mean", ANTI_ALIGNMENT, "sink value against the semantic component",
                "median over sink heads of mean cos(ṽ₀, sᵢ)", "cos_semantic"),
        *pooled("contrast", baseline, "sink more anti-aligned than a random non-sink key",
                "mean over sink heads of cos(ṽ₀, sᵢ) − cos(ṽₖ, sᵢ − αᵢₖṽₖ)", "contrast", "mean"),
        *pooled("cos_semantic_centred_mean", centred, "centred sink value against the centred semantic component",
                "median over sink heads of mean cos(ṽ₀ − m, sᵢ − (1 − aᵢ)m)", "cos_semantic_centred"),
        *pooled("contrast_centred", centred, "centred: sink more anti-aligned than a random key",
                "mean over sink heads of the centred contrast", "contrast_centred", "mean"),
        *trend_rows(table, n_resamples, seed),
    ]


def trend_rows(table: pd.DataFrame, n_resamples: int = 1000, seed: int = 0) -> list[dict]:
    """The trend "more sink, more anti-aligned": Spearman rho(sink rate, mean cos(ṽ₀, sᵢ)) over all heads
    below 0, the interval resampling whole layers (heads of one layer cluster); on a model with two layer
    types, one more claim per type (``"<TREND> [<type> layers]"``, key ``rho_semantic@<type>``)."""
    if "layer_type" not in table:
        table = table.assign(layer_type="global")
    scopes = [("all", table)]
    if table["layer_type"].nunique() > 1:
        scopes += [(str(t), table[table["layer_type"] == t]) for t in sorted(table["layer_type"].unique())]
    rows = []
    for scope, part in scopes:
        n_layers = int(part["layer"].nunique())
        claim, key = (TREND, "rho_semantic") if scope == "all" else (f"{TREND} [{scope} layers]", f"rho_semantic@{scope}")
        rows.append(claim_row(6, claim, "rank correlation over all heads",
                              f"Spearman ρ(sink rate, mean cos(ṽ₀, sᵢ)) (cluster bootstrap by layer, {n_layers} layers)",
                              key, stats.spearman_ci(part["sink_rate"], part["cos_semantic_mean"], clusters=part["layer"],
                                               n_resamples=n_resamples, seed=seed), 0.0, "below", len(part),
                              too_few_layers(n_layers), unit="layer", n_units=n_layers))
    return rows


def _claims(results, *, n_resamples: int, seed: int, eps: float = EPS.default, **_) -> list[dict]:
    return _claim_rows(results["anti_alignment"], n_resamples, seed, eps)


ANALYSIS = register(Analysis("anti_alignment", _AntiAlignmentCollector, _tables, stems=("anti_alignment",),
                             collector_options=("seed",), summary=_summary, claims=_claims, options=(EPS, SEED)))


@ANALYSIS.public
def sink_anti_alignment(model, tokenizer, data, **options) -> pd.DataFrame:
    """Per (layer, head): does the sink's projected value point against the others?

    Per sequence: ``cos(v~_0, v~_j)`` for keys j >= 1; ``cos(v~_0, s_i)`` for queries i >= 1, s_i =
    sum_{j>0} alpha_ij v~_j the semantic component; ``cos(v~_0, m)``, m = mean_{j>=1} v~_j. Baseline per
    query: ``cos(v~_k, s_i - alpha_ik v~_k)`` for one random visible non-sink key k (column ``key``;
    ``cos_key_literal`` against s_i itself), and both on values centred by m. The key is drawn per sequence
    and layer from ``seed``, whatever the batch.

    Columns: ``sink_rate``, ``is_sink_head`` (> eps), ``cos_value_mean``/``_median``/``_frac_negative``,
    ``cos_semantic_mean``/``_median``/``_frac_negative``, ``cos_semantic_weighted`` (weights alpha_i0 (1 -
    alpha_i0)), ``cos_axis_mean``, ``sink_value_norm``, ``relative_sink_value_norm`` (over the median
    ||v~_j||), ``cos_key_mean``, ``cos_key_literal_mean``, ``cos_semantic_centred_mean``,
    ``cos_key_centred_mean``, ``contrast`` = ``cos_semantic_mean - cos_key_mean`` (below 0: the sink is
    more anti-aligned than an ordinary token), ``contrast_centred`` and ``layer_type``.

    Options: ``eps`` and the run options (:class:`cwcore.sinks.SinkOptions`)."""

