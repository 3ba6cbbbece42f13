"""Chapter 6, sinks as suppressors: anti-alignment of the sink's value, suppression of the output norm, and
convexity of the output norm in the sink rate (the paper's section on value geometry of attention sinks).

:func:`run` computes everything the chapter shows on one model: the per-head tables of
:mod:`cwcore.sinks` (anti-alignment and convexity, from the pass chapters 5-7 share), their registered
claims with intervals, the suppression table under both readings, and the numbers and sentences its prose
quotes (:class:`Suppressors`: ``numbers``, ``phrases`` and ``intervals``, glued under those names). The
figure functions take its result and return a matplotlib figure.

Head outputs are written ``o_i = a_i ṽ_0 + s_i`` with ``s_i = (1 - a_i) ŝ_i``: the sink term plus the
semantic component (``a_i`` the sink rate of query ``i``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from cwbook.chapters.common import documents_text, interval_span, rerun_agrees, rerun_direction
from cwbook.chapters.sinks_common import (OnSinkPass, SinkPass, claim_phrase, committed_evidence, no_evidence_label,
                                          rerun_claims_table, sink_pass, sinks_module)

CHAPTER = "06_sinks_as_suppressors"
#: the categories of a fitted head's vertex, in the order of the figure's legend
CATEGORIES = ("minimum inside the observed range", "interior minimum, extrapolated", "convex, vertex outside (0, 1)",
              "concave (vertex is a maximum)")


def _colours():
    from cwcore.plotting import palette

    return palette(10)


@dataclass
class Suppressors(OnSinkPass):
    """What chapter 6 shows for one model. Per data set ``d`` (dicts keyed by data set):

    * ``aa_of[d]``: the per-head anti-alignment table (one row per (layer, head));
    * ``fits_of[d]``: the convexity fits (``scope`` head, model, model_v0); ``raw_of[d]``: the convexity
      analysis' raw tables, ``points`` one row per (sequence, layer, head, query >= 1);
    * ``profile_of[d]`` / ``centred_of[d]``: per layer, the mean cosines with intervals over documents (raw
      and centred values); ``supp_of[d]``: the suppression table (place x reading);
      ``hp_of[d]``: per-query norms of the head outputs and their counterfactuals;
      ``vertices_of[d]``: the vertex intervals of every fit;
    * ``claims_of[d]`` and ``claims`` (both data sets stacked): the registered claims with 95% intervals.

    ``numbers``, ``phrases`` (Markdown) and ``intervals`` ((estimate, low, high)) are what the prose quotes,
    under their glue names.
    """

    sinks: SinkPass
    bins: int
    min_range: float
    n_examples: int
    n_bootstrap: int
    runs: dict
    claims_of: dict
    claims: pd.DataFrame
    numbers: dict = field(default_factory=dict)
    phrases: dict = field(default_factory=dict)
    intervals: dict = field(default_factory=dict)
    # filled by run(), section by section
    aa_of: dict = None
    fits_of: dict = None
    raw_of: dict = None
    sink_aa: pd.DataFrame = None  # the first data set's sink heads (rows of aa_of)
    layer_type_of: dict = None  # layer -> its attention type ("global", "sliding", ...)
    rho_value: tuple = None  # Spearman rho (sink rate, cos(v0, v_j)) over heads, with its interval
    rho_semantic: tuple = None  # the same with cos(v0, s_i), the registered claim's row
    profile_of: dict = None
    centred_of: dict = None
    has_post: bool = None  # whether the model normalises the attention output (a post-attention norm)
    supp_of: dict = None
    suppression_rows: pd.DataFrame = None  # Table 1, as shown
    low_ratio_of: dict = None  # ||s^|| / ||o|| on the lowest-norm fifth of each head's outputs, with interval
    low_ratio_sink_of: dict = None  # the same over sink heads only
    hp_of: dict = None
    picks: pd.DataFrame = None  # the heads of Figure 4 (rows of the head fits)
    vertices_of: dict = None
    fitted: pd.DataFrame = None  # the first data set's fitted heads, with their vertex "category"
    claims_table: object = None  # the claims as shown: the rerun's parts beside the committed evidence's verdicts
    verdicts: pd.Series = None  # claim -> the rerun's combined verdict (never printed: see rerun_direction)
    evidence: object = None  # the committed evidence (sinks_common.Evidence), None where none is committed

    # the run, for the prose and the results table






    @property
    def parameters(self) -> dict:
        """The parameters written with the claims table for the findings page."""
        run = self.sinks.run
        return dict(data=self.datasets, n_sequences=min(self.documents.values()), seq_len=run.seq_len, eps=self.eps,
                    bins=self.bins, min_range=self.min_range, n_bootstrap=self.n_bootstrap, seed=run.seed,
                    dtype=run.dtype)

    # the first data set's tables, which the figures show
    @property
    def aa(self) -> pd.DataFrame:
        return self.aa_of[self.first]

    @property
    def points(self) -> pd.DataFrame:
        """Per (sequence, layer, head, query >= 1) of the first data set: sink rate ``alpha0``, output
        ``norm``, and the inner products ``v0_sq``, ``s_sq``, ``v0_s``."""
        return self.raw_of[self.first]["points"]

    @property
    def head_fits(self) -> pd.DataFrame:
        fits = self.fits_of[self.first]
        return fits[fits["scope"] == "head"].copy()

    @property
    def n_types(self) -> int:
        return len(set(self.layer_type_of.values()))

    # the claims rows, as the prose quotes them
    def row_of(self, d: str, key: str):
        """The claims row of data set d named key (a Series), or None."""
        c = self.claims_of[d]
        r = c[c["key"] == key]
        return None if not len(r) else r.iloc[0]

    def ci_text(self, d: str, key: str, fmt: str = "{:.2f}", pct: bool = False) -> str:
        """'0.18 (0.12 to 0.25)' for the claims row; percentages with pct."""
        r = self.row_of(d, key)
        if r is None or not np.isfinite(r["estimate"]):
            return "not measured" + (f" ({r['why']})" if r is not None and r["why"] else "")
        f = (lambda x: f"{100 * x:.0f}%") if pct else fmt.format
        span = interval_span(r["low"], r["high"], f)
        if span is None:  # e.g. too few layers of a type to resample
            units = (f": {int(r['n_units'])} {r['unit']}{'s' if int(r['n_units']) != 1 else ''}"
                     if r.get("unit") and np.isfinite(float(r["n_units"])) else "")
            return f"{f(r['estimate'])} (no interval{units})"
        return f"{f(r['estimate'])} ({span})"

    def pct_text(self, d: str, key: str) -> str:
        return self.ci_text(d, key, pct=True)

    def live_verdict(self, d: str, key: str) -> str:
        """The rerun's verdict of part ``key`` on ``d`` by the rule (for comparisons; never printed)."""
        from cwcore import stats

        r = self.row_of(d, key)
        if r is None:
            return "not measured"
        return f"{r['verdict']}: {r['why']}" if r["verdict"] == stats.NOT_MEASURED and r["why"] else r["verdict"]

    def verdict_of(self, d: str, key: str) -> str:
        """Where the rerun's interval of part ``key`` on ``d`` lies (no verdict word: the rerun decides nothing),
        with the committed evidence's verdict of the same part where it is committed."""
        said = rerun_direction(self.live_verdict(d, key))
        committed = self.evidence.part_verdict(d, key) if self.evidence is not None else None
        return said if committed is None else f"{said}; evidence: {committed}"

    def sink_head_index(self, d: str) -> pd.MultiIndex:
        """(layer, head) of the fitted heads of data set d whose sink rate exceeds eps."""
        f = self.fits_of[d][self.fits_of[d]["scope"] == "head"]
        f = f[f["sink_rate"] > self.eps]
        return pd.MultiIndex.from_arrays([f["layer"].astype(int), f["head"].astype(int)])

    def short_sink_share(self, d: str) -> float:
        """Share of sink-head queries with ||v0|| < ||s^|| (sufficient for the renormalised reading)."""
        h = self.hp_of[d]
        h = h[pd.MultiIndex.from_frame(h[["layer", "head"]]).isin(self.sink_head_index(d)) & np.isfinite(h["renorm"])]
        return float((h["v0"] < h["renorm"]).mean()) if len(h) else np.nan


def run(model: str, run_parameters: dict | None = None, *, bins: int = 10, min_range: float = 0.05,
        n_examples: int = 4, n_bootstrap: int = 1000, profile: str = "default") -> Suppressors:
    """Chapter 6 on ``model``: the analyses, the claims with their intervals, the tables and the prose's
    numbers. ``run_parameters``: the run chapters 5-7 share (:class:`cwbook.notebook.SinkRun`); ``bins``:
    equal-width bins of the sink rate for the convexity curves; ``min_range``: a head is fitted only if its sink
    rates span at least this (q95 - q05); ``n_examples``: heads in the convexity figure; ``n_bootstrap``:
    resamples (of heads, layers or documents) for every interval; ``profile``: the run profile (it names what
    the page's own numbers are). Prints how long the analyses took."""
    import time

    from cwbook import sink_claims

    shared = sink_pass(model, run_parameters, ["anti_alignment", "convexity"], profile=profile, bins=bins,
                       min_range=min_range)
    for d in shared.datasets:
        print(f"{model}: the sink analyses of {len(shared.blocks[d])} documents ({shared.run.seq_len} tokens each) "
              f"of {d} in {shared.seconds[d]:.0f} s")
    runs = shared.results
    t0 = time.monotonic()
    claims_of = {d: sink_claims.chapter_claims(CHAPTER, runs[d], shared.eps, n_resamples=n_bootstrap,
                                               seed=shared.run.seed) for d in shared.datasets}
    claims = sink_claims.stack_data(claims_of)  # parts "gsm8k: ...", keys "gsm8k/..."
    print(f"claims with intervals in {time.monotonic() - t0:.0f} s")
    r = Suppressors(sinks=shared, bins=bins, min_range=min_range, n_examples=n_examples, n_bootstrap=n_bootstrap,
                    runs=runs, claims_of=claims_of, claims=claims)
    r.evidence = committed_evidence(CHAPTER, model, eps=shared.eps)  # the verdicts the page prints come from here
    _setup(r)
    _anti_alignment(r)
    _layers(r)
    _suppression(r)
    _convexity(r)
    _verdicts(r)
    _disagreements(r)
    return r


def _setup(r: Suppressors) -> None:
    from cwbook import sink_claims

    run = r.sinks.run
    r.aa_of = {d: r.runs[d]["anti_alignment"] for d in r.datasets}
    r.fits_of = {d: r.runs[d]["convexity"].fits for d in r.datasets}
    r.raw_of = {d: r.runs[d]["raw"]["convexity"] for d in r.datasets}
    aa = r.aa
    r.sink_aa = aa[aa["is_sink_head"]]
    r.layer_type_of = dict(aa.drop_duplicates("layer")[["layer", "layer_type"]].itertuples(index=False, name=None))
    names = " and ".join(f"`{d}`" for d in r.datasets)
    counts = pd.Series(r.layer_type_of).value_counts()
    r.phrases.update({
        "caption": (f"{r.model}, {documents_text(r.documents)} ({run.seq_len} tokens each) from {names}, "
                    f"seed {run.seed}"),
        "first": f"`{r.first}`",
        "sink_heads_note": sink_claims.sink_heads_sentence(len(r.sink_aa), len(aa), r.eps),
        "sink_heads_short": sink_claims.sink_heads_sentence(len(r.sink_aa), len(aa), r.eps, short=True),
        "layer_types": ", ".join(f"{n} {t}" for t, n in counts.items()) + " layers",
        "rerun_label": r.rerun_label,
        "evidence_label": (r.evidence.label if r.evidence is not None
                           else no_evidence_label(CHAPTER, r.model, r.eps)),
    })
    r.numbers.update({"eps": r.eps, "n_sequences": run.n_sequences, "seq_len": run.seq_len,
                      "n_bootstrap": r.n_bootstrap, "n_heads_total": len(aa), "n_sink_heads": len(r.sink_aa)})


# -- does the sink point against the rest? ------------------------------------------------------------------------
def _anti_alignment(r: Suppressors) -> None:
    from cwcore import stats
    from cwbook import sink_claims

    r.rho_value = stats.spearman_ci(r.aa["sink_rate"], r.aa["cos_value_mean"], **r.boot)
    r.rho_semantic = sink_claims.triple(r.claims_of[r.first], "rho_semantic")
    r.phrases["anti_sentences"] = "\n".join(f"- {anti_sentence(r, d)}" for d in r.datasets)
    r.intervals["rho_value"] = r.rho_value
    sink_aa = r.sink_aa
    r.numbers["rel_sink_norm"] = sink_aa["relative_sink_value_norm"].median() if len(sink_aa) else np.nan
    r.numbers["cos_semantic_weighted"] = sink_aa["cos_semantic_weighted"].median() if len(sink_aa) else np.nan


def anti_sentence(r: Suppressors, d: str) -> str:
    from cwbook import sink_claims

    a = r.aa_of[d]
    sink = a[a["is_sink_head"]]
    if not len(sink):
        return f"On `{d}`: **not measured**, {sink_claims.no_sink_heads(r.eps)}."
    return (f"On `{d}` ({len(sink)} sink heads): the median over sink heads of the mean cos(ṽ₀, ṽⱼ) is "
            f"{r.ci_text(d, 'cos_value')} and of cos(ṽ₀, sᵢ) {r.ci_text(d, 'cos_semantic')} (intervals resampling "
            f"whole layers), **{r.verdict_of(d, 'cos_semantic')}**; "
            f"{(sink['cos_semantic_mean'] < 0).mean():.0%} of sink heads have a negative mean cos(ṽ₀, sᵢ); "
            f"Spearman ρ(sink rate, cos(ṽ₀, sᵢ)) over all heads is {r.ci_text(d, 'rho_semantic')}."
            + centred_sentence(r, d))


def centred_sentence(r: Suppressors, d: str) -> str:
    # said whenever centring (the shared direction of all values removed) turns the sign, even if the raw claim holds
    raw_, centred = r.row_of(d, "cos_semantic"), r.row_of(d, "cos_semantic_centred")
    if raw_ is None or centred is None or not (np.isfinite(raw_["estimate"]) and np.isfinite(centred["estimate"])):
        return ""
    if np.sign(raw_["estimate"]) == np.sign(centred["estimate"]):
        return (f" On centred values the sign stays: {r.ci_text(d, 'cos_semantic_centred')} "
                f"(**{r.verdict_of(d, 'cos_semantic_centred')}**).")
    return (f" **In this rerun check, on centred values the sign reverses**: the median centred cosine is "
            f"{r.ci_text(d, 'cos_semantic_centred')} (**{r.verdict_of(d, 'cos_semantic_centred')}**); where that "
            f"holds, the raw cosine's sign comes from the direction the values share, not from the sink against the "
            f"text (the registered centred-values control decides it on the committed evidence, in the answer above).")


# -- against a random key, centred values, and the layers -----------------------------------------------------------
def _layers(r: Suppressors) -> None:
    anti = sinks_module("anti_alignment")
    points_of = {d: r.runs[d]["raw"]["anti_alignment"]["points"] for d in r.datasets}
    r.profile_of = {d: anti.layer_profile(points_of[d], r.aa_of[d], ("cos_semantic", "cos_key"), **r.boot)
                    for d in r.datasets}
    r.centred_of = {d: anti.layer_profile(points_of[d], r.aa_of[d], ("cos_semantic_centred", "cos_key_centred"),
                                          **r.boot) for d in r.datasets}
    r.phrases["layer_sentences"] = "\n".join(f"- {layer_sentence(r, d)}" for d in r.datasets)
    r.phrases["baseline_sentences"] = "\n".join(f"- {baseline_sentence(r, d)}" for d in r.datasets)


def layer_sentence(r: Suppressors, d: str) -> str:
    t = r.profile_of[d]
    if not len(t):
        return f"`{d}`: no layers"
    top, bottom = t.loc[t["cos_semantic"].idxmax()], t.loc[t["cos_semantic"].idxmin()]
    pos = t[t["cos_semantic_low"] > 0]["layer"].tolist()
    neg = t[t["cos_semantic_high"] < 0]["layer"].tolist()
    more = t[t["cos_semantic_minus_cos_key_high"] < 0]["layer"].tolist()
    return (f"On `{d}` the layer means of cos(ṽ₀, sᵢ) run from {bottom['cos_semantic']:+.2f} (layer {int(bottom['layer'])}) "
            f"to {top['cos_semantic']:+.2f} (layer {int(top['layer'])}); their intervals lie above zero in layers "
            f"{pos or 'none'} and below it in {neg or 'none'}; the sink is more anti-aligned than a random key "
            f"(the contrast's interval below zero) in layers {more or 'none'}.")


def baseline_sentence(r: Suppressors, d: str) -> str:
    types = sorted(set(r.layer_type_of.values())) if r.n_types > 1 else []
    per_type = "; ".join(f"{t} layers {r.ci_text(d, 'contrast@' + t)}" for t in types)
    return (f"On `{d}` the mean contrast over sink heads is {r.ci_text(d, 'contrast')}, **{r.verdict_of(d, 'contrast')}**"
            + (f" ({per_type})" if per_type else "") + f"; on centred values the median cos is "
            f"{r.ci_text(d, 'cos_semantic_centred')} (**{r.verdict_of(d, 'cos_semantic_centred')}**) and the contrast "
            f"{r.ci_text(d, 'contrast_centred')} (**{r.verdict_of(d, 'contrast_centred')}**).")


# -- does the sink shorten the output? ------------------------------------------------------------------------------
POST_NORM_TEXT = (
    "this model normalises each attention output (plus bias) before adding it to the residual stream "
    "(Gemma's RMSNorm, found by matching the tensor the norm receives with the output projection's "
    "output, `cwcore.sinks.suppression.post_attention_norms`). An RMSNorm's output has norm "
    "√D·‖g ⊙ x/‖x‖‖ (g its gain): the length of its input cancels, so after the norm a shorter "
    "attention output is not a smaller update; what changes the norm there is the *direction*, "
    "through the gain.")
NO_POST_NORM_TEXT = (
    "this model has **no post-attention norm** (its blocks add the attention output to the "
    "residual stream as it is; Llama's `post_attention_layernorm` is the MLP's pre-norm, applied "
    "after the residual add), so the attention output is what the residual stream receives and "
    "that place is *not measured*.")


def _pct_ci(r, col):
    v, lo, hi = r[col], r[f"{col}_low"], r[f"{col}_high"]
    return "–" if not np.isfinite(v) else f"{100 * v:.0f}% ({100 * lo:.0f} to {100 * hi:.0f})"


def _ratio_ci(r):
    v, lo, hi = r["geo_ratio"], r["geo_ratio_low"], r["geo_ratio_high"]
    return "–" if not np.isfinite(v) else f"{v:.2f} ({lo:.2f} to {hi:.2f})"


def _suppression(r: Suppressors) -> None:
    from cwcore.sinks import suppression

    r.has_post = bool(r.raw_of[r.first]["layers"]["post_norm"].any())
    r.phrases["post_norm_note"] = POST_NORM_TEXT if r.has_post else NO_POST_NORM_TEXT
    r.supp_of = {d: suppression.suppression_table(r.fits_of[d], r.raw_of[d]["points"], r.raw_of[d]["block"], r.eps,
                                                  **r.boot) for d in r.datasets}
    rows = []
    for d in r.datasets:
        for _, row in r.supp_of[d].iterrows():
            key = "shortened" if (row["reading"], row["place"]) == ("raw", "head") else \
                f"shortened_{row['reading']}@{row['place'].replace(' ', '_')}"
            rows.append({"data": d, "place": row["place"], "reading": row["reading"],
                         "share shortened (95% CI)": _pct_ci(row, "share"),
                         "typical ‖o‖ / ‖counterfactual‖": _ratio_ci(row),
                         "queries": int(row["n"]), "rerun direction": rerun_direction(r.live_verdict(d, key)),
                         "evidence": (r.evidence.part_verdict(d, key) or "not committed") if r.evidence is not None
                         else "not committed",
                         "rerun agrees with the evidence?": rerun_agrees(
                             r.live_verdict(d, key),
                             r.evidence.part_verdict(d, key) if r.evidence is not None else None)})
    r.suppression_rows = pd.DataFrame(rows)
    if r.evidence is not None:
        r.suppression_rows = r.suppression_rows.rename(columns={"evidence": r.evidence.label})
    # the earlier measurement's number: the renormalised counterfactual on the lowest-norm outputs (chapter 7's
    # default 5 bins)
    r.low_ratio_of = {d: suppression.lowest_norm_ratio(r.raw_of[d]["points"], 5, **r.boot) for d in r.datasets}
    r.low_ratio_sink_of = {d: suppression.lowest_norm_ratio(r.raw_of[d]["points"], 5, heads=r.sink_head_index(d),
                                                            **r.boot) for d in r.datasets}
    r.hp_of = {d: suppression.head_points(r.raw_of[d]["points"]) for d in r.datasets}
    r.phrases["supp_sentences"] = "\n".join(f"- {supp_sentence(r, d)}" for d in r.datasets)
    r.intervals["low_ratio"] = r.low_ratio_of[r.first]


def supp_sentence(r: Suppressors, d: str) -> str:
    t = r.supp_of[d].set_index(["place", "reading"])
    lr, lrs = r.low_ratio_of[d], r.low_ratio_sink_of[d]
    return (f"On `{d}`: per head, the raw reading shortens {_pct_ci(t.loc[('head', 'raw')], 'share')} of sink-head "
            f"outputs (**{r.verdict_of(d, 'shortened')}**), the renormalised one "
            f"{_pct_ci(t.loc[('head', 'renormalised')], 'share')} (**{r.verdict_of(d, 'shortened_renormalised@head')}**); "
            f"‖ṽ₀‖ < ‖ŝᵢ‖, which is enough for the second, in {r.short_sink_share(d):.0%} of them. "
            f"On the lowest-norm fifth of each head's outputs (all heads), ‖ŝᵢ‖ is {lr[0]:.2f} ({lr[1]:.2f} to "
            f"{lr[2]:.2f}) times ‖oᵢ‖; in sink heads {lrs[0]:.2f} ({lrs[1]:.2f} to {lrs[2]:.2f}).")


# -- is the output norm convex in the sink rate? --------------------------------------------------------------------
def _convexity(r: Suppressors) -> None:
    convexity = sinks_module("convexity")
    head_fits = r.head_fits
    fitted = head_fits[head_fits["fitted"]].copy()
    pool = fitted[fitted["is_sink_head"]]
    pool = pool if len(pool) >= r.n_examples else fitted
    pool = pool.sort_values("sink_rate")
    r.picks = pool.iloc[[int((k + 0.5) * len(pool) / r.n_examples) for k in range(min(r.n_examples, len(pool)))]]
    r.vertices_of = {d: convexity.vertex_intervals(r.raw_of[d]["points"], r.fits_of[d], "norm", **r.boot)
                     for d in r.datasets}
    r.phrases["pooled_sentences"] = "\n".join(f"- {pooled_sentence(r, d)}" for d in r.datasets)
    fitted["category"] = np.select([fitted["minimum_in_range"], fitted["interior_minimum"], fitted["curvature"] > 0],
                                   list(CATEGORIES[:3]), CATEGORIES[3])
    r.fitted = fitted
    r.numbers.update({
        "min_range": r.min_range, "n_examples_shown": len(r.picks), "bins": r.bins,
        "n_fitted": len(fitted), "n_not_fitted": int((~head_fits["fitted"]).sum()),
        "median_alpha_star": fitted.loc[fitted["interior_minimum"], "alpha_star"].median(),
        "median_reference_alpha_star": fitted["reference_alpha_star"].median(),
        "median_r2": fitted["r2"].median(), "n_concave": int((fitted["curvature"] <= 0).sum()),
    })


def pooled_sentence(r: Suppressors, d: str) -> str:
    out = []
    for tag, what in (("", "norms over each head's mean"), ("_v0", "norms over ‖ṽ₀‖")):
        curv = r.row_of(d, f"pooled_curvature{tag}")
        if curv is None or not np.isfinite(curv["estimate"]):
            out.append(f"{what}: not measured")
            continue
        kind = "convex" if curv["estimate"] > 0 else "concave"
        out.append(f"{what}: {kind} (c₂ {r.ci_text(d, 'pooled_curvature' + tag)}), vertex α* = "
                   f"{r.ci_text(d, 'pooled_vertex_below_1' + tag)}, below 1: **{r.verdict_of(d, 'pooled_vertex_below_1' + tag)}**, "
                   f"above 0: **{r.verdict_of(d, 'pooled_vertex_above_0' + tag)}**")
    per_head = (f"per head (cluster bootstrap by layer): an interior minimum in {r.pct_text(d, 'share_interior')} "
                f"of fitted heads, inside the observed range in {r.pct_text(d, 'share_in_range')}, established "
                f"by its interval (α* interval inside (0, 1), c₂ interval above 0) in {r.pct_text(d, 'share_vertex_inside')}")
    return f"On `{d}`, pooled: " + "; ".join(out) + "; " + per_head + "."


# -- where the claim holds ------------------------------------------------------------------------------------------
def listing(names) -> str:
    """'*a*, *b* and *c*' ('none' for no names)."""
    names = [f"*{n}*" for n in names]
    return "none" if not names else names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def evidence_verdicts(r: Suppressors, claims) -> dict:
    """``{claim: verdict}`` of ``claims`` in the committed evidence, both data sets combined (a claim holds
    when it holds on each, :func:`cwcore.stats.combine_all`, as the findings page reads it)."""
    from cwcore import stats

    out = {}
    for claim in claims:
        found = [r.evidence.claim_verdict(d, claim) for d in r.datasets]
        out[claim] = stats.combine_all([v.split(":")[0] if v else stats.NOT_MEASURED for v in found])
    return out


def _verdicts(r: Suppressors) -> None:
    from cwcore import stats
    from cwbook import sink_claims

    r.claims_table = rerun_claims_table(r.claims, r.evidence, r.rerun_label)
    r.verdicts = verdicts = sink_claims.claim_verdicts(r.claims)
    slugs = {sink_claims.ANTI_ALIGNMENT: "v_anti", sink_claims.TREND: "v_trend",
             sink_claims.SUPPRESSION: "v_suppress", sink_claims.CONVEXITY: "v_convex"}
    # the other scaling of the pooled fit, and whether each vertex is observed (not only established)
    others = {sink_claims.CONVEXITY_V0: "v_convex_v0", sink_claims.OBSERVED_CLAIMS["model"]: "v_convex_obs",
              sink_claims.OBSERVED_CLAIMS["model_v0"]: "v_convex_v0_obs"}
    for claim, slug in (*slugs.items(), *others.items()):
        r.phrases[slug] = claim_phrase(claim, r.claims, r.datasets, r.evidence)
    primary = [c for c in verdicts.index if c in slugs]
    other = [c for c in verdicts.index if c not in primary]
    if r.evidence is not None:  # the lists a reader takes away: the committed evidence's verdicts
        decided, other_decided = evidence_verdicts(r, primary), evidence_verdicts(r, other)
        r.phrases["in_short"] = (
            f"In short, in the {r.evidence.label}, by the rule above, of the paper's readings: holds for "
            f"{listing([c for c in primary if decided[c] == stats.HOLDS])}; contradicted for "
            f"{listing([c for c in primary if decided[c] == stats.CONTRADICTED])}; inconclusive (or not measured) "
            f"for {listing([c for c in primary if decided[c] in (stats.INCONCLUSIVE, stats.NOT_MEASURED)])}. Of "
            f"the other readings and baselines, these hold: "
            f"{listing([c for c in other if other_decided[c] == stats.HOLDS])}.")
    else:  # no committed evidence (another model): where the rerun's intervals lie, and no verdict
        r.phrases["in_short"] = (
            f"No evidence is committed for this model, so nothing is decided here. In the {r.rerun_label}, of the "
            f"paper's readings, every part lies on the claimed side for "
            f"{listing([c for c in primary if verdicts[c] == stats.HOLDS])}; a part lies on the opposite side for "
            f"{listing([c for c in primary if verdicts[c] == stats.CONTRADICTED])}.")


# -- where this model disagrees with the paper ----------------------------------------------------------------------
def _both(r: Suppressors, key: str, fmt=None) -> str:
    fmt = fmt or r.ci_text
    return "; ".join(f"`{d}` {fmt(d, key)}" for d in r.datasets)


def _types_of(r: Suppressors, key: str) -> str:
    if r.n_types < 2:
        return "the model has one layer type, so layer type cannot explain it"
    return "; ".join(f"{t} layers: " + _both(r, f"{key}@{t}") for t in sorted(set(r.layer_type_of.values())))


def _bos_text(r: Suppressors) -> str:
    tokenizer, blocks_of = r.sinks.tokenizer, r.sinks.blocks
    first_bos = {d: float(np.mean([ids[0] == tokenizer.bos_token_id for ids in blocks_of[d]["input_ids"]]))
                 if tokenizer.bos_token_id is not None else 0.0 for d in r.datasets}
    return ("every block starts with the BOS token" if min(first_bos.values()) == 1 else
            "no block starts with a BOS token (this tokenizer adds none): the sink is the document's first token"
            if max(first_bos.values()) == 0 else "some blocks start with a BOS token")


def _disagreements(r: Suppressors) -> None:
    from cwcore import stats
    from cwbook import sink_claims

    first, verdicts, seed = r.first, r.verdicts, r.seed
    layer_rho, within_rho = {}, {}
    for d in r.datasets:
        by_layer = r.aa_of[d].groupby("layer")[["sink_rate", "cos_semantic_mean"]].mean()
        layer_rho[d] = stats.spearman_ci(by_layer["sink_rate"], by_layer["cos_semantic_mean"], **r.boot)
        inside = [stats.spearman_ci(g["sink_rate"], g["cos_semantic_mean"], n_resamples=50, seed=seed).estimate
                  if len(g) >= 3 else np.nan for _, g in r.aa_of[d].groupby("layer")]
        within_rho[d] = float(np.nanmean(inside)) if np.isfinite(inside).any() else np.nan
    disagree = (stats.CONTRADICTED, stats.INCONCLUSIVE)  # "not measured" is no disagreement: the table says why
    claims_ = (sink_claims.ANTI_ALIGNMENT, sink_claims.TREND, sink_claims.SUPPRESSION, sink_claims.CONVEXITY)
    if r.evidence is not None:  # which claims disagree: the committed evidence's verdicts, not the rerun's
        verdicts = evidence_verdicts(r, claims_)
        label = r.evidence.label
        said = {c: f"{label}: {v}" for c, v in verdicts.items()}
    else:
        label = r.rerun_label
        said = {c: f"{label}: {rerun_direction(verdicts.get(c), claim=True)}" for c in claims_}
    pct = r.pct_text
    paragraphs = []
    if verdicts.get(sink_claims.ANTI_ALIGNMENT) in disagree:
        contrast = r.row_of(first, "contrast")
        # whether the sink is less aligned than an ordinary token: the evidence's verdict where committed
        contrast_verdict = (r.evidence.part_verdict(first, "contrast") if r.evidence is not None
                            else contrast["verdict"] if contrast is not None else None)
        paragraphs.append(
            f"**Anti-alignment**, {said[sink_claims.ANTI_ALIGNMENT]}. The median cos(ṽ₀, sᵢ) over sink heads is "
            f"{_both(r, 'cos_semantic')}. *Layer type*: {_types_of(r, 'cos_semantic')}. *Layers*: Figure 2; the sink heads' "
            f"cosines cluster by layer, which is why the intervals resample layers and are wider than a bootstrap over "
            f"heads would make them. *Baseline*: the sink's cosine minus a random non-sink key's is "
            f"{_both(r, 'contrast')} ({r.verdict_of(first, 'contrast')} on `{first}`)"
            + (": the sink is less aligned with the text than an ordinary token, even where its own cosine is positive"
               if contrast_verdict == stats.HOLDS else
               ": the sink is not shown to be less aligned with the text than an ordinary token")
            + f". *Centring*: with the shared direction removed the median is {_both(r, 'cos_semantic_centred')}. "
            f"*BOS*: {_bos_text(r)}.")
    if verdicts.get(sink_claims.TREND) in disagree:
        paragraphs.append(
            f"**Trend**, {said[sink_claims.TREND]}. Spearman's ρ(sink rate, cos(ṽ₀, sᵢ)) over all heads is "
            f"{_both(r, 'rho_semantic')}. *Layers*: over the layers (one point per layer: its heads' mean sink rate and mean "
            f"cosine) ρ is " + "; ".join(f"`{d}` {layer_rho[d][0]:.2f} ({layer_rho[d][1]:.2f} to {layer_rho[d][2]:.2f})"
                                         for d in r.datasets)
            + ", and within layers (heads ranked inside their own layer, the mean of the layers' ρ) "
            + "; ".join(f"`{d}` {within_rho[d]:.2f}" for d in r.datasets)
            + ": in this rerun check (point estimates, no interval within layers) the sign of the trend comes mostly from "
            + ("differences between layers" if abs(within_rho[first]) < abs(layer_rho[first][0]) else "heads within layers")
            + ".")
    if verdicts.get(sink_claims.SUPPRESSION) in disagree:
        post = ("after the post-attention norm the raw reading gives " + _both(r, "shortened_raw@after_post-norm", pct)
                + "; since the norm cancels the input's length, this measures how the sink term turns the output "
                "relative to the norm's gain, not a shorter update" if r.has_post else "the model has no post-attention norm")
        paragraphs.append(
            f"**Suppression** (raw reading per head), {said[sink_claims.SUPPRESSION]}. The sink term shortens "
            f"{_both(r, 'shortened', pct)} of sink-head outputs. *Reading*: with the sink "
            f"renormalised away the share is {_both(r, 'shortened_renormalised@head', pct)}, "
            f"and ‖ṽ₀‖ < ‖ŝᵢ‖ (which suffices for it) in "
            + "; ".join(f"`{d}` {r.short_sink_share(d):.0%}" for d in r.datasets)
            + ": wherever ‖ṽ₀‖ < ‖ŝᵢ‖ the renormalised reading shortens the output whatever the sink's direction "
            "(Exercise 6.1), so a high share there says the sink value is short, not that it points against the text. "
            f"*Place*: at the attention output (all heads at once) the raw reading gives "
            f"{_both(r, 'shortened_raw@attention_output', pct)}; {post}.")
    if verdicts.get(sink_claims.CONVEXITY) in disagree:
        paragraphs.append(
            f"**Convexity** (pooled fit), {said[sink_claims.CONVEXITY]}. The pooled quadratic has curvature "
            f"c₂ = {_both(r, 'pooled_curvature')} (norms over each head's mean; vertex {_both(r, 'pooled_vertex_below_1')}) and "
            f"{_both(r, 'pooled_curvature_v0')} (norms over ‖ṽ₀‖; vertex {_both(r, 'pooled_vertex_below_1_v0')}). *Scale of the "
            f"pooled points*: the verdict depends on how the heads are put on one scale, because heads differ in output "
            f"norm, sink value norm and vertex, which can make their pooled cloud (Figure 5) flatter than any one head. *Per head*: an interior minimum in "
            f"{_both(r, 'share_interior', pct)} of fitted heads, established by its interval in "
            f"{_both(r, 'share_vertex_inside', pct)}. *Layer type*: {_types_of(r, 'share_interior')}.")
    if paragraphs:
        paragraphs.insert(0, f"Which claims disagree is decided by the {label}; the numbers that can explain "
                             f"it are this page's, the {r.rerun_label}." if r.evidence is not None
                          else f"No evidence is committed for this model: the claims below are those whose parts, in "
                               f"the {label}, lie on the opposite side or straddle their threshold.")
    r.phrases["disagreements"] = ("\n\n".join(paragraphs) if paragraphs else
                                  f"In the {label} no claim of the paper is contradicted or inconclusive: there is "
                                  "no disagreement to explain (a claim not measured says why in the table above)."
                                  if r.evidence is not None else
                                  f"In the {label} no claim's part lies on the opposite side or straddles its "
                                  "threshold: there is nothing to explain here.")


# -- figures ----------------------------------------------------------------------------------------------------------
def _trend(ax, x, y, colour="black", n_bins=8):
    # the median of y in equal-count bins of x: a trend line that outliers do not drag
    order = np.argsort(x)
    x, y = np.asarray(x)[order], np.asarray(y)[order]
    parts = [p for p in np.array_split(np.arange(len(x)), min(n_bins, max(1, len(x) // 5))) if len(p)]
    ax.plot([np.median(x[p]) for p in parts], [np.median(y[p]) for p in parts], color=colour, lw=2,
            marker="o", ms=4, label="binned median")


def _heads_scatter(ax, frame, column, label, eps):
    colours = _colours()
    for flag, colour, name in ((True, colours[1], "sink heads"), (False, colours[0], "other heads")):
        rows = frame[frame["is_sink_head"] == flag]
        ax.scatter(rows["sink_rate"], rows[column], s=16, color=colour, alpha=0.7, edgecolor="none",
                   label=f"{name} ({len(rows)})")
    ok = frame[column].notna()
    if ok.sum() >= 2:
        _trend(ax, frame.loc[ok, "sink_rate"], frame.loc[ok, column])
    ax.axvline(eps, color="black", ls="--", lw=1)
    ax.set_xlim(0, 1)
    ax.set_xlabel("sink rate of the head")
    ax.set_ylabel(label)


def anti_alignment_figure(r: Suppressors):
    """Figure 1: per head, the mean cosine of the sink's value with the tail values and with s_i, against the
    head's sink rate (first data set), with Spearman's rho and its interval in the titles."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6), sharey=True, constrained_layout=True)
    for ax, column, label, rho in ((axes[0], "cos_value_mean", r"mean $\cos(\tilde v_0, \tilde v_j)$, $j \geq 1$", r.rho_value),
                                   (axes[1], "cos_semantic_mean", r"mean $\cos(\tilde v_0, s_i)$", r.rho_semantic)):
        _heads_scatter(ax, r.aa, column, label, r.eps)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(rf"Spearman $\rho$ = {rho[0]:.2f} [{rho[1]:.2f}, {rho[2]:.2f}]", fontsize=11)
    axes[0].set_ylim(-1, 1)
    axes[0].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"{r.model} on {r.first}: alignment of the sink's value with the text", fontweight="bold")
    return fig


def layers_figure(r: Suppressors):
    """Figure 2: per layer, the sink's cosine with s_i and a random key's with the rest of s_i, raw (top) and
    centred (bottom), one column per data set, with intervals over documents."""
    import matplotlib.pyplot as plt

    colours, n = _colours(), len(r.datasets)
    sink_colour = colours[1]
    fig, axes = plt.subplots(2, n, figsize=(5.6 * n, 7.6), squeeze=False, sharex=True, sharey="row",
                             constrained_layout=True)
    for col, d in enumerate(r.datasets):
        for row, (table, sink_col, key_col, title) in enumerate((
                (r.profile_of[d], "cos_semantic", "cos_key", "raw values"),
                (r.centred_of[d], "cos_semantic_centred", "cos_key_centred", "centred values"))):
            ax = axes[row, col]
            if not len(table):
                ax.set_visible(False)
                continue
            x = table["layer"].to_numpy()
            for k, (column, colour, label) in enumerate(((sink_col, sink_colour, r"sink: $\cos(\tilde v_0, s_i)$"),
                                                          (key_col, "0.45", r"random key: $\cos(\tilde v_k, s_i - \alpha_{ik}\tilde v_k)$"))):
                y = table[column].to_numpy()
                ax.errorbar(x + (k - 0.5) * 0.25, y, yerr=[y - table[f"{column}_low"], table[f"{column}_high"] - y],
                            fmt="o-", ms=3.5, lw=1, capsize=1.5, color=colour, label=label)
            for layer, kind in r.layer_type_of.items():
                if kind == "global" and r.n_types > 1:
                    ax.axvspan(layer - 0.5, layer + 0.5, color=colours[2], alpha=0.12, lw=0)
            sink_layers = table.loc[table["n_sink_heads"] > 0, "layer"]
            ax.plot(sink_layers, np.full(len(sink_layers), -1.02), "|", color=sink_colour, ms=6)
            ax.axhline(0, color="black", lw=0.8)
            ax.set_ylim(-1.05, 1.05)
            ax.set_title(f"{d}, {title}", fontsize=11)
            ax.set_xlabel("layer")
    axes[0, 0].set_ylabel("mean over the layer's heads and queries")
    axes[1, 0].set_ylabel("the same, centred")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if r.n_types > 1:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=colours[2], alpha=0.3))
        labels.append("global-attention layer (the others: sliding window)")
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"{r.model}: the sink against a random key, layer by layer", fontweight="bold")
    return fig


def suppression_figure(r: Suppressors):
    """Figure 3: per head, the share of its queries shortened under the raw and the renormalised reading,
    against the head's sink rate (first data set)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True, constrained_layout=True)
    hp = r.hp_of[r.first]
    with np.errstate(invalid="ignore"):
        flags = hp.assign(raw_short=(hp["out"] < hp["raw"]).where(hp["raw"] > 0),
                          renorm_short=(hp["out"] < hp["renorm"]).where(np.isfinite(hp["renorm"])))
    per_head = flags.groupby(["layer", "head"])[["raw_short", "renorm_short"]].mean().reset_index()
    per_head = per_head.merge(r.head_fits[["layer", "head", "sink_rate", "is_sink_head"]].astype({"layer": int, "head": int}),
                              on=["layer", "head"])
    per_head["is_sink_head"] = per_head["is_sink_head"].astype(bool)
    for ax, column, label in ((axes[0], "raw_short", r"raw: share with $\|o_i\| < \|s_i\|$"),
                              (axes[1], "renorm_short", r"renormalised: share with $\|o_i\| < \|\hat s_i\|$")):
        _heads_scatter(ax, per_head, column, label, r.eps)
        ax.axhline(0.5, color="0.4", ls=":", lw=1)
        ax.set_ylim(0, 1)
        ax.set_title(label, fontsize=11)
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"{r.model} on {r.first}: how often the sink shortens a head's output", fontweight="bold")
    return fig


def convexity_examples_figure(r: Suppressors):
    """Figure 4: output norm against sink rate in the heads ``r.picks`` (first data set): the queries, bin means
    with intervals over documents, the quadratic fit and the reference curve."""
    import matplotlib.pyplot as plt
    from cwcore import stats

    colours, picks, points, bins, seed = _colours(), r.picks, r.points, r.bins, r.seed
    curves = r.runs[r.first]["convexity"].curves
    edges = np.linspace(0, 1, bins + 1)
    chosen = points.merge(picks[["layer", "head"]], on=["layer", "head"])
    chosen = chosen.assign(bin=np.clip(np.digitize(chosen["alpha0"], edges[1:-1]), 0, bins - 1))
    binned = stats.cluster_bootstrap(chosen, "norm", ["layer", "head", "bin"], **r.boot).table if len(chosen) else None
    rng = np.random.default_rng(seed)

    n_cols = max(1, min(2, len(picks)))
    n_rows = max(1, -(-len(picks) // n_cols))
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(5.2 * n_cols, 3.9 * n_rows), squeeze=False, constrained_layout=True)
    grid_a = np.linspace(0, 1, 201)
    for ax, (_, f) in zip(axes.ravel(), picks.iterrows()):
        mine = chosen[(chosen["layer"] == f["layer"]) & (chosen["head"] == f["head"])]
        cloud = mine.iloc[rng.permutation(len(mine))[:3000]]
        ax.scatter(cloud["alpha0"], cloud["norm"], s=3, color="0.75", alpha=0.4, edgecolor="none")
        ax.scatter([], [], s=16, color="0.75", label="queries")  # a legible legend marker
        ax.axvspan(f["alpha_q05"], f["alpha_q95"], color=colours[2], alpha=0.08, lw=0, label="observed range (q05–q95)")
        b = binned[(binned["layer"] == f["layer"]) & (binned["head"] == f["head"])]
        centres = (edges[b["bin"]] + edges[b["bin"] + 1]) / 2
        ax.errorbar(centres, b["norm"], yerr=[b["norm"] - b["norm_low"], b["norm_high"] - b["norm"]], fmt="o",
                    color="black", ms=4, capsize=2, lw=1, label="bin mean, 95% CI")
        quad = np.polyval([f["curvature"], f["linear"], f["constant"]], grid_a)
        inside = (grid_a >= f["alpha_q05"]) & (grid_a <= f["alpha_q95"])
        ax.plot(grid_a, np.where(inside, quad, np.nan), color=colours[1], lw=2, label="quadratic fit")
        ax.plot(grid_a, np.where(inside, np.nan, quad), color=colours[1], lw=1.2, ls=":")
        ref = curves[(curves["scope"] == "head") & (curves["layer"] == f["layer"]) & (curves["head"] == f["head"])]
        ax.plot(ref["bin_centre"], ref["reference_norm"], color=colours[4], lw=1.5, ls="--", label="reference")
        if f["interior_minimum"]:
            ax.axvline(f["alpha_star"], color=colours[1], lw=1, ls="-.")
        top = np.nanquantile(mine["norm"], 0.99) * 1.15
        ax.set_ylim(0, top)
        ax.set_xlim(0, 1)
        ax.set_xlabel(r"sink rate $a_i = \alpha_{i0}$")
        ax.set_ylabel(r"$\|o^h_i\|$")
        star = f"α* = {f['alpha_star']:.2f}" if np.isfinite(f["alpha_star"]) else "no vertex"
        kind = "convex" if f["curvature"] > 0 else "concave"
        ax.set_title(f"layer {int(f['layer'])} · head {int(f['head'])} · sink rate {f['sink_rate']:.2f}\n"
                     f"{kind}, {star}, R² = {f['r2']:.2f}", fontsize=10)
    for ax in axes.ravel()[len(picks):]:
        ax.set_visible(False)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"{r.model} on {r.first}: output norm against sink rate", fontweight="bold")
    return fig


def pooled_figure(r: Suppressors):
    """Figure 5: the pooled fits, one column per data set (top: norms over each head's mean, bottom: over
    ||v0||), with the 95% interval of the vertex over documents."""
    import matplotlib.pyplot as plt

    colours, n = _colours(), len(r.datasets)
    data_colours = {d: colours[k] for d, k in zip(r.datasets, (0, 1, 2, 3))}
    grid_a = np.linspace(0, 1, 201)
    fig, axes = plt.subplots(2, n, figsize=(5.4 * n, 7.4), squeeze=False, constrained_layout=True)
    for col, d in enumerate(r.datasets):
        c = r.runs[d]["convexity"].curves
        for row, (scope, ylabel) in enumerate((("model", r"$\|o^h_i\|$ / the head's mean"),
                                               ("model_v0", r"$\|o^h_i\| / \|\tilde v_0\|$"))):
            ax = axes[row, col]
            cur = c[(c["scope"] == scope) & (c["n"] > 0)]
            f = r.fits_of[d][r.fits_of[d]["scope"] == scope]
            v = r.vertices_of[d][r.vertices_of[d]["scope"] == scope]
            ax.plot(cur["alpha_mean"], cur["norm_mean"], "o", color="black", ms=4, label="bin mean (all heads' queries)")
            if len(f) and bool(f["fitted"].iloc[0]):
                f = f.iloc[0]
                ax.plot(grid_a, np.polyval([f["curvature"], f["linear"], f["constant"]], grid_a), color=data_colours[d],
                        lw=2, label="pooled quadratic fit")
                if len(v):
                    v = v.iloc[0]
                    lo, hi = np.clip([v["alpha_star_low"], v["alpha_star_high"]], -0.2, 1.2)
                    ax.axvspan(lo, hi, color=data_colours[d], alpha=0.15, lw=0, label="vertex α*, 95% CI (clipped)")
                    kind = "convex" if f["curvature"] > 0 else "concave"
                    ax.set_title(f"{d}: {kind}, α* = {v['alpha_star']:.2f} [{v['alpha_star_low']:.2f}, "
                                 f"{v['alpha_star_high']:.2f}]", fontsize=10)
            ax.set_xlim(-0.02, 1.02)
            ax.set_xlabel(r"sink rate $a_i$")
            ax.set_ylabel(ylabel)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=3, fontsize=9, frameon=False)
    fig.suptitle(f"{r.model}: the pooled fits, across heads and queries", fontweight="bold")
    return fig


def alpha_star_figure(r: Suppressors):
    """Figure 6: (a) the vertex of every convex head, by category; (b) each fitted head's vertex against its
    sink rate with its 95% interval over documents (first data set; clipped to [-0.5, 1.5])."""
    import matplotlib.pyplot as plt

    colours, fitted = _colours(), r.fitted
    category_colours = dict(zip(CATEGORIES, (colours[2], colours[1], colours[7], colours[4])))
    fig, (ax_hist, ax_range) = plt.subplots(1, 2, figsize=(11.5, 4.6), constrained_layout=True)
    lo, hi = -0.5, 1.5
    hist_bins = np.linspace(lo, hi, 41)
    stacks = [np.clip(fitted.loc[fitted["category"] == c, "alpha_star"].dropna(), lo, hi) for c in CATEGORIES[:3]]
    ax_hist.hist(stacks, bins=hist_bins, stacked=True, color=list(category_colours.values())[:3],
                 label=list(CATEGORIES[:3]), edgecolor="white", linewidth=0.3)
    for x in (0, 1):
        ax_hist.axvline(x, color="black", lw=0.8)
    ax_hist.set_xlabel(r"vertex $\alpha^*$ of convex heads (clipped to $[-0.5, 1.5]$)")
    ax_hist.set_ylabel("heads")
    ax_hist.set_title(r"(a) where the minimum is")
    vertices = r.vertices_of[r.first]
    head_v = vertices[vertices["scope"] == "head"].astype({"layer": int, "head": int})
    shown_v = fitted.astype({"layer": int, "head": int}).merge(head_v[["layer", "head", "alpha_star_low", "alpha_star_high"]],
                                                               on=["layer", "head"], how="left")
    for name, colour in category_colours.items():
        rows = shown_v[shown_v["category"] == name]
        ax_range.vlines(rows["sink_rate"], np.clip(rows["alpha_star_low"], lo, hi), np.clip(rows["alpha_star_high"], lo, hi),
                        color=colour, lw=1, alpha=0.45)
        ax_range.scatter(rows["sink_rate"], np.clip(rows["alpha_star"], lo, hi), s=18, color=colour,
                         edgecolor="none", zorder=3, label=f"{name} ({len(rows)})")
    ax_range.axhspan(0, 1, color="0.5", alpha=0.06, lw=0)
    ax_range.set_xlim(0, 1)
    ax_range.set_ylim(lo - 0.05, hi + 0.05)
    ax_range.set_xlabel("sink rate of the head")
    ax_range.set_ylabel(r"vertex $\alpha^*$ with its 95% interval over documents")
    ax_range.set_title("(b) each head's vertex, with its interval")
    handles, labels = ax_range.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(f"{r.model} on {r.first}: vertices of the per-head fits", fontweight="bold")
    return fig
