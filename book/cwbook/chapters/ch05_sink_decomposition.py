"""Chapter 5, sink decomposition: which heads sink, where the attention mass goes, and which factor of a
contribution c_ij = alpha_ij * (||v~_j|| / ||o_i||) * cos(o_i, v~_j) drives it for the sink and for the tail
(the paper's section on value geometry of attention sinks).

:func:`run` computes everything the chapter shows on one model, from the sink pass chapters 5-7 share
(:mod:`cwbook.chapters.sinks_common`): the per-head sink rates, the three-factor decomposition and its
variance shares, the joint model of the tail, the registered claims with intervals, the tables and the
numbers and sentences its prose quotes (:class:`SinkDecomposition`: ``numbers``, ``phrases`` and
``intervals``, glued under those names). The figure functions take its result and return a figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from cwbook.chapters.sinks_common import (OnSinkPass, SinkPass, claim_phrase, committed_evidence, disagreement_opening,
                                          no_evidence_label, nothing_to_explain, rerun_claims_table, sink_pass)
from cwbook.chapters.common import interval_span, rerun_direction
from cwbook.notebook import tick

CHAPTER = "05_sink_decomposition"
FACTORS = ["alpha", "relative_norm", "cosine", "contribution"]
FACTOR_NAMES = {"alpha": "attention α", "relative_norm": "relative norm ‖ṽ‖/‖oʰ‖", "cosine": "alignment cos(oʰ, ṽ)",
                "contribution": "contribution c"}
#: the groups of pairs of Figure 3: (token class, heads, label)
GROUPS = [("sink", "sink_heads", "sink\nsink heads"), ("sink", "other_heads", "sink\nother heads"),
          ("tail", "sink_heads", "tail\nsink heads"), ("tail", "other_heads", "tail\nother heads")]
JOINT_MEASURES = ("share_alpha", "share_cosine", "share_alpha_cosine", "r2_alpha", "r2_cosine", "r2_joint", "r2_gain",
                  "geometry_minus_alpha")


def _colours():
    from cwcore.plotting import palette

    return palette(10)


def ratio(a, b):
    # a share of the attention relative to uniform attention's (NaN where the class is absent)
    return a / b if b > 0 else np.nan


@dataclass
class SinkDecomposition(OnSinkPass):
    """What chapter 5 shows for one model (tables of the first data set, ``data``, unless keyed by data set):

    * ``rates``: per (layer, head), the sink rate and the statistics of the rates analysis;
    * ``blocks``: the token blocks the analyses ran on (:func:`cwcore.sinks.token_blocks`);
    * ``positions``: Table 1 (per data set and layer type: Sink_eps, where the mass goes);
    * ``summary`` / ``sample``: the decomposition's pooled summary and its sampled (query, key) pairs
      (``sink_head`` added); ``medians``: the factors' medians per group;
    * ``heads``: per head and token class, each factor's share of var(log|c|) and geometry's;
    * ``joint`` / ``joint_table``: the joint shares and R² of the first data set, and Table 2 (every data set);
    * ``claims_by_data`` / ``stacked_claims``: the registered claims, per data set and stacked.
    """

    sinks: SinkPass
    sample_size: int
    n_bootstrap: int
    numbers: dict = field(default_factory=dict)
    phrases: dict = field(default_factory=dict)
    intervals: dict = field(default_factory=dict)
    rates: pd.DataFrame = None
    blocks: object = None
    positions: pd.DataFrame = None
    summary: pd.DataFrame = None
    sample: pd.DataFrame = None
    medians: pd.DataFrame = None
    heads: pd.DataFrame = None
    joint: pd.DataFrame = None
    joint_table: pd.DataFrame = None
    claims_by_data: dict = None
    stacked_claims: pd.DataFrame = None
    claims_display: pd.DataFrame = None  # Table 3: the rerun's parts beside the committed evidence's verdicts
    verdict_of: dict = None  # data set -> {claim: the rerun's verdict text} (never printed: see rerun_direction)
    evidence: object = None  # the committed evidence (sinks_common.Evidence), None where none is committed









    @property
    def claims(self) -> pd.DataFrame:
        """The claims of the first data set."""
        return self.claims_by_data[self.data]

    @property
    def parameters(self) -> dict:
        """The parameters written with the claims table for the findings page."""
        run = self.sinks.run
        return dict(data=",".join(self.datasets), n_documents=min(self.documents.values()), seq_len=run.seq_len,
                    eps=self.eps, seed=run.seed, dtype=run.dtype, n_bootstrap=self.n_bootstrap)

    def pooled(self, scope: str, cls: str, factor: str, column: str) -> float:
        """One number of the decomposition summary pooled over a group of heads (NaN if absent)."""
        summary = self.summary
        row = summary[(summary["scope"] == scope) & (summary["token_class"] == cls) & (summary["factor"] == factor)]
        return float(row[column].iloc[0]) if len(row) else np.nan

    def joint_value(self, measure: str, cls: str, group: str = "sink_heads") -> tuple:
        """(estimate, low, high) of a joint measure over all layers of the first data set (NaNs if absent)."""
        joint = self.joint
        row = joint[(joint["group"] == group) & (joint["token_class"] == cls) & (joint["layer_type"] == "all")]
        return tuple(float(row[measure + s].iloc[0]) for s in ("", "_low", "_high")) if len(row) else (np.nan,) * 3


def run(model: str, run_parameters: dict | None = None, *, sample_size: int = 5000,
        n_bootstrap: int = 1000, profile: str = "default") -> SinkDecomposition:
    """Chapter 5 on ``model``: ``run_parameters`` the run chapters 5-7 share (:class:`cwbook.notebook.SinkRun`),
    ``sample_size`` (query, key) pairs per token class for the distribution plots, ``n_bootstrap`` resamples
    (documents, layers) for the intervals, ``profile`` the run profile (it names what the page's own numbers
    are). Prints how long the analyses took."""
    from cwcore import sinks

    shared = sink_pass(model, run_parameters, ["rates", "decomposition"], profile=profile, sample_size=sample_size)
    run_ = shared.run
    print(f"{model}: the sink analyses of {run_.n_sequences} documents ({run_.seq_len} tokens) of each of "
          f"{', '.join(shared.datasets)} in {sum(shared.seconds.values()):.0f} s")
    r = SinkDecomposition(sinks=shared, sample_size=sample_size, n_bootstrap=n_bootstrap)
    r.evidence = committed_evidence(CHAPTER, model, eps=shared.eps)  # the verdicts the page prints come from here
    r.rates = shared.results[r.data]["rates"]
    r.blocks = sinks.token_blocks(shared.blocks[r.data], shared.tokenizer)  # the blocks the analyses ran on
    r.phrases.update({
        "caption": f"{model}, {len(shared.blocks[r.data])} documents of `{r.data}` ({run_.seq_len} tokens each), "
                   f"seed {run_.seed}",
        "data_list": " and ".join(f"`{d}`" for d in shared.datasets),
        "rerun_label": r.rerun_label,
        "evidence_label": (r.evidence.label if r.evidence is not None
                           else no_evidence_label(CHAPTER, model, shared.eps)),
    })
    r.numbers.update({"eps": r.eps, "n_sequences": run_.n_sequences, "seq_len": run_.seq_len})
    _sink_heads(r)
    _positions(r)
    _factors(r)
    _joint(r)
    _claims(r)
    _disagreements(r)
    return r


def _sink_heads(r: SinkDecomposition) -> None:
    from cwbook import sink_claims

    rates, eps, blocks, tokenizer = r.rates, r.eps, r.blocks, r.sinks.tokenizer
    first = [tokenizer.decode([t]) for t in blocks.ids[:, 0].tolist()]
    counts = pd.Series(first).value_counts()
    if blocks.first_token_is_bos == 1:
        r.phrases["bos_sentence"] = (f"The tokenizer of {r.model} starts every text with its beginning-of-sequence "
                                     f"token {tick(first[0])}, and every block here starts with it: position 0 is always that "
                                     "token, never a word of the text.")
    else:
        examples = ", ".join(tick(t) for t in counts.index[:5])
        r.phrases["bos_sentence"] = (f"The tokenizer of {r.model} adds no beginning-of-sequence token, so nothing is "
                                     "prepended: position 0 is the first text token of each block, wherever the cut falls "
                                     f"({len(counts)} different tokens in {len(first)} blocks, e.g. {examples}). Whatever it is, "
                                     "that first token is the one that becomes the sink.")
    is_sink = rates["sink_rate"] > eps
    sink_layers = sorted(rates.loc[is_sink, "layer"].unique())
    top = rates.loc[rates["sink_rate"].idxmax()]
    n_layers = rates.pivot(index="layer", columns="head", values="sink_rate").shape[0]
    r.numbers.update({
        "n_heads_total": len(rates), "n_sink_heads": int(is_sink.sum()),
        "sink_eps": rates["sink_eps"].iloc[0], "sink_eps_all": rates["sink_eps_all_queries"].iloc[0],
        "mean_rate": rates["sink_rate"].mean(), "median_rate": rates["sink_rate"].median(),
        "n_layers": n_layers, "n_layers_with_sinks": len(sink_layers),
        "top_rate": top["sink_rate"], "top_layer": int(top["layer"]), "top_head": int(top["head"]),
        "sink_q10": rates.loc[is_sink, "q10"].median() if is_sink.any() else np.nan,
        "sink_q90": rates.loc[is_sink, "q90"].median() if is_sink.any() else np.nan,
    })
    # what the statistics over sink heads are taken over; on a model without sink heads: not measured, and why
    r.phrases["sink_heads_note"] = sink_claims.sink_heads_sentence(int(is_sink.sum()), len(rates), eps)
    r.phrases["sink_heads_short"] = sink_claims.sink_heads_sentence(int(is_sink.sum()), len(rates), eps, short=True)
    r.phrases["first_sink_layer"] = (f"the first layer with one is layer {sink_layers[0]}" if sink_layers
                                     else "no layer has one")


def _positions(r: SinkDecomposition) -> None:
    from cwcore import stats
    from cwcore.sinks.intervals import pooled_by_layer

    eps = r.eps
    rows = []
    for name in r.datasets:
        rates = r.results[name]["rates"]
        by_layer = pooled_by_layer(rates.assign(sink=rates["sink_rate"] > eps), "sink", statistic="share", **r.boot)
        first_class = "bos" if r.sinks.blocks[name] and rates["first_token_is_bos"].iloc[0] == 1 else "first"
        for row in by_layer.itertuples():
            part = rates if row.scope == "all" else rates[rates["layer_type"] == row.scope]
            strong_part = part[part["top_key_mass"] > eps]
            wilson = stats.share_ci(part["sink_rate"] > eps)
            rows.append({
                "data": name, "layers": row.scope, "heads": len(part),
                "Sink_eps": wilson[0], "Wilson 95%": f"{wilson[1]:.2f} – {wilson[2]:.2f}",
                "by layer 95%": f"{row.low:.2f} – {row.high:.2f}",
                "strongest key = 0": (f"{(strong_part['top_key'] == 0).mean():.2f} of {len(strong_part)}"
                                      if len(strong_part) else "no head > eps"),
                "strongest later key (median)": part["top_later_mass"].median(),
                "mass on position 0 / uniform": ratio(part[f"mass_{first_class}"].mean(),
                                                      part[f"uniform_{first_class}"].mean()),
                "newline / uniform": ratio(part["mass_newline"].mean(), part["uniform_newline"].mean()),
                "punctuation / uniform": ratio(part["mass_punctuation"].mean(), part["uniform_punctuation"].mean()),
                "learned sink mass": ("none" if part["learned_sink_mass"].isna().all()
                                      else f"{part['learned_sink_mass'].mean():.3f}"),
            })
    r.positions = pd.DataFrame(rows)
    rates, blocks = r.rates, r.blocks
    strong = rates[rates["top_key_mass"] > eps]
    top_later = rates.loc[rates["top_later_mass"].idxmax()]
    first_class = "bos" if blocks.first_token_is_bos == 1 else "first"
    r.numbers.update({
        "n_strong": len(strong), "strong_top0": (strong["top_key"] == 0).mean() if len(strong) else np.nan,
        "later_median": rates["top_later_mass"].median(), "later_max": rates["top_later_mass"].max(),
        "later_max_key": int(top_later["top_later_key"]), "later_max_layer": int(top_later["layer"]),
        "later_max_head": int(top_later["head"]),
        "pos0_over_uniform": ratio(rates[f"mass_{first_class}"].mean(), rates[f"uniform_{first_class}"].mean()),
        "newline_over_uniform": ratio(rates["mass_newline"].mean(), rates["uniform_newline"].mean()),
        "punct_over_uniform": ratio(rates["mass_punctuation"].mean(), rates["uniform_punctuation"].mean()),
    })
    if blocks.classes is not None:  # the class of that position differs between documents: count them
        at_key = pd.Series(blocks.classes[:, int(top_later["top_later_key"])]).value_counts()
        r.phrases["later_max_class"] = f"`{at_key.index[0]}` token in {at_key.iloc[0]} of {at_key.sum()} documents"
    else:
        r.phrases["later_max_class"] = "token of unknown class"
    r.phrases["learned_sink"] = ("none: the model has no learned sink logit" if rates["learned_sink_mass"].isna().all()
                                 else f"{rates['learned_sink_mass'].mean():.3f} of each row, on average")
    types = sorted(rates["layer_type"].unique())
    layers = rates.drop_duplicates("layer")["layer_type"]
    r.phrases["layer_types"] = ("all of its layers are global (full causal attention)" if types == ["global"] else
                                f"it has {int((layers == 'sliding').sum())} sliding-window and "
                                f"{int((layers == 'global').sum())} global layers")
    r.phrases["later_sink"] = ("No later position acts as a second sink in the median head"
                               if rates["top_later_mass"].median() <= eps else
                               "In the median head a later position also takes more than $\\epsilon$, a second sink")
    r.phrases["stats_agree"] = ("agree with the paper's reading that the sink is position 0"
                                if len(strong) and (strong["top_key"] == 0).mean() > 0.5 else
                                "do not single out position 0: see the table for where the mass goes")


def _factors(r: SinkDecomposition) -> None:
    from cwbook import sink_claims

    dec = r.results[r.data]["decomposition"]
    r.summary = dec.summary
    head_rate = r.rates.set_index(["layer", "head"])["sink_rate"]
    sample = dec.sample
    r.sample = sample.assign(
        sink_head=head_rate.reindex(pd.MultiIndex.from_frame(sample[["layer", "head"]])).to_numpy() > r.eps)
    r.numbers["quantile_sample"] = r.sinks.options.quantile_sample
    r.numbers["sample_size"] = r.sample_size
    pooled = r.pooled
    r.medians = pd.DataFrame({f"{cls}, {scope.replace('_', ' ')}": [pooled(scope, cls, f, "median") for f in FACTORS]
                              for scope in ("sink_heads", "other_heads") for cls in ("sink", "tail")},
                             index=[FACTOR_NAMES[f] for f in FACTORS])
    for cls in ("sink", "tail"):
        for f in FACTORS:
            r.numbers[f"med_{cls}_{f}"] = pooled("sink_heads", cls, f, "median")
        r.numbers[f"neg_{cls}_cos"] = pooled("sink_heads", cls, "cosine", "frac_negative")
    r.numbers["neg_sink_c"] = pooled("sink_heads", "sink", "contribution", "frac_negative")
    shorter = pooled("sink_heads", "sink", "relative_norm", "median") < pooled("sink_heads", "tail", "relative_norm", "median")
    less_aligned = pooled("sink_heads", "sink", "cosine", "median") < pooled("sink_heads", "tail", "cosine", "median")
    r.phrases["rel_compare"] = "shorter than" if shorter else "not shorter than"
    r.phrases["cos_compare"] = "less aligned with the output" if less_aligned else "better aligned with the output"
    # the sentence after the medians: only when the sink's contribution is smaller than its attention says
    sink_alpha_med = pooled("sink_heads", "sink", "alpha", "median")
    sink_c_med = pooled("sink_heads", "sink", "contribution", "median")
    r.phrases["geometry_difference"] = (
        "The two geometric factors make the difference." if abs(sink_c_med) < sink_alpha_med else
        "Here the geometric factors do not shrink the sink's contribution below its attention."
        if np.isfinite(sink_c_med) else "")
    # the variance shares and levels of Figure 3
    for cls in ("sink", "tail"):
        for scope, tag in (("sink_heads", "sh"), ("other_heads", "oh")):
            for f in ("alpha", "relative_norm", "cosine"):
                r.numbers[f"share_{cls}_{tag}_{f}"] = pooled(scope, cls, f, "share")
            r.numbers[f"share_{cls}_{tag}_geometry"] = (pooled(scope, cls, "relative_norm", "share")
                                                       + pooled(scope, cls, "cosine", "share"))
            for f in ("alpha", "relative_norm", "cosine", "contribution"):
                r.numbers[f"level_{cls}_{tag}_{f}"] = pooled(scope, cls, f, "mean_log")
    sink_level = {f: pooled("sink_heads", "sink", f, "mean_log") for f in ("alpha", "relative_norm", "cosine")}
    r.numbers["sink_geo_factor"] = np.exp(sink_level["relative_norm"] + sink_level["cosine"])
    r.numbers["sink_gm_alpha"] = np.exp(sink_level["alpha"])
    r.numbers["sink_gm_c"] = np.exp(pooled("sink_heads", "sink", "contribution", "mean_log"))
    biggest = min(("relative_norm", "cosine"), key=lambda f: sink_level[f])
    r.phrases["sink_level_driver"] = "the alignment" if biggest == "cosine" else "the relative norm"
    r.heads = sink_claims.head_shares(r.rates, r.summary)  # per head and token class: each factor's share, geometry's


def _joint(r: SinkDecomposition) -> None:
    from cwbook import sink_claims

    rows = []
    for name in r.datasets:
        raw_stats = r.results[name]["raw"]["decomposition"]["stats"]
        table = sink_claims.joint_shares(raw_stats, r.eps, **r.boot)
        for row in table[table["group"] == "sink_heads"].itertuples():
            rows.append({"data": name, "layers": row.layer_type, "class": row.token_class, "pairs": row.n,
                         **{label: f"{getattr(row, m):.2f} ({getattr(row, m + '_low'):.2f} – {getattr(row, m + '_high'):.2f})"
                            for m, label in (("share_alpha", "attention"), ("share_cosine", "alignment"),
                                             ("share_relative_norm", "relative norm"),
                                             ("share_alpha_cosine", "attention + alignment"),
                                             ("r2_alpha", "R² attention"), ("r2_cosine", "R² alignment"),
                                             ("r2_joint", "R² joint"), ("r2_gain", "gain of the joint model"))}})
        if name == r.data:
            r.joint = table
    r.joint_table = pd.DataFrame(rows)
    for m in JOINT_MEASURES:
        r.intervals[f"j_tail_{m}"] = r.joint_value(m, "tail")
        r.intervals[f"j_sink_{m}"] = r.joint_value(m, "sink")


def _claims(r: SinkDecomposition) -> None:
    from cwbook import sink_claims

    eps = r.eps
    r.claims_by_data = {}
    for name in r.datasets:
        r.claims_by_data[name] = sink_claims.chapter_claims(CHAPTER, r.results[name], eps, **r.boot)
    claims = r.claims
    r.stacked_claims = sink_claims.stack_data(r.claims_by_data)  # part "<data>: ...", key "<data>/..."
    r.verdict_of = {d: sink_claims.claim_verdict_texts(c) for d, c in r.claims_by_data.items()}
    for key in ("sink_geometry_share", "tail_attention_share", "sink_eps", "sink_eps_by_layer", "top_key_0",
                "tail_joint_share", "tail_alpha_share", "tail_cosine_share", "sink_geometry_pooled"):
        r.intervals[f"v_{key}"] = sink_claims.triple(claims, key)
    row = claims[claims["key"] == "sink_geometry_share"]
    r.numbers["v_n_sink"] = int(row["n"].iloc[0]) if len(row) else 0
    heads = r.heads
    tail_rows = heads[(heads["sink_rate"] > eps) & (heads["token_class"] == "tail")]
    r.numbers["v_tail_cos_over_rel"] = ((tail_rows["cosine"] > tail_rows["relative_norm"]).mean() if len(tail_rows)
                                        else np.nan)
    for claim_name, tag in ((sink_claims.DECOMPOSITION, "dec"), (sink_claims.SINK_RATES, "rates"),
                            (sink_claims.TAIL_ATTENTION_ONLY, "tail_only"), (sink_claims.SINK_POSITION_CLAIM, "pos0")):
        r.phrases[f"v_{tag}"] = claim_phrase(claim_name, r.stacked_claims, r.datasets, r.evidence)
    r.numbers["tail_margin"] = sink_claims.TAIL_MARGIN
    r.phrases["tail_reading"] = "; ".join(tail_reading(r, d) for d in r.claims_by_data) + "."
    r.claims_display = rerun_claims_table(r.stacked_claims, r.evidence, r.rerun_label)


def tail_reading(r: SinkDecomposition, d: str) -> str:
    # which terms clear the margin in this rerun, by the parts above (where the intervals lie: no verdict word)
    from cwcore import stats
    from cwbook import sink_claims

    c = r.claims_by_data[d]
    verdict_ = dict(zip(c["key"], c["verdict"]))
    attention, alignment = verdict_.get("tail_alpha_share"), verdict_.get("tail_cosine_share")
    margin = f"{sink_claims.TAIL_MARGIN:g}"
    if attention == stats.HOLDS and alignment != stats.HOLDS:
        return (f"on `{d}` attention's share clears the margin {margin} and alignment's does not "
                f"({rerun_direction(alignment)})")
    if attention == stats.HOLDS and alignment == stats.HOLDS:
        return f"on `{d}` attention's and alignment's shares both clear the margin {margin}"
    return (f"on `{d}` against the margin {margin}, attention's share: {rerun_direction(attention)}; "
            f"alignment's: {rerun_direction(alignment)}")


def layer_type_note(frame: pd.DataFrame, key: str) -> str:
    # the per-layer-type rows of a pooled part, as text
    rows = frame[frame["key"].str.startswith(key + "@")]
    return "; ".join(f"{k.split('@')[1]} layers {e:.2f} ({interval_span(lo, hi) or 'no interval'})"
                     for k, e, lo, hi in zip(rows["key"], rows["estimate"], rows["low"], rows["high"]))


def _disagreements(r: SinkDecomposition) -> None:
    from cwbook import sink_claims

    eps, rates, heads = r.eps, r.rates, r.heads
    paragraphs = []
    bos = {d: r.results[d]["rates"]["first_token_is_bos"].iloc[0] for d in r.datasets}
    bos_text = ("every block starts with the BOS token" if all(v == 1 for v in bos.values())
                else "no block starts with a BOS token: position 0 is the first word of each document")
    for claim_name, what in ((sink_claims.SINK_RATES, "many heads are sink heads (the book's claim)"),
                             (sink_claims.DECOMPOSITION, "sink by geometry, tail by attention and alignment")):
        # which claims to explain: those the committed evidence does not find holding (the rerun only where
        # nothing is committed, said by where its intervals lie)
        lines = disagreement_opening(claim_name, what, r.stacked_claims, r.datasets, r.evidence,
                                     f"{r.rerun_label} on `{r.data}`")
        if lines is None:
            continue
        c = r.claims_by_data[r.data]
        if claim_name == sink_claims.SINK_RATES:
            est = sink_claims.triple(c, "sink_eps")
            lines.append(f"Sink_eps is {est[0]:.2f} at eps = {eps:g}; the heads' rates have median "
                         f"{rates['sink_rate'].median():.2f}, so the share depends on eps: "
                         f"{(rates['sink_rate'] > 0.1).mean():.2f} of the heads exceed 0.1 and "
                         f"{(rates['sink_rate'] > 0.5).mean():.2f} exceed 0.5.")
            by_type = layer_type_note(c, "sink_eps_by_layer")
            lines.append(f"Layer type: {by_type}." if by_type else "Layer type: not a candidate, every layer is global.")
        else:
            for key, text_ in (("tail_joint_share", "attention + alignment's share of the tail's variance"),
                               ("tail_alpha_share", "attention's share"), ("tail_cosine_share", "alignment's share"),
                               ("sink_geometry_pooled", "the sink's geometry minus attention share")):
                e, lo, hi = sink_claims.triple(c, key)
                lines.append(f"{text_}: {e:.2f} ({lo:.2f} to {hi:.2f}).")
            by_type = layer_type_note(c, "sink_geometry_margin_by_layer")
            if by_type:
                lines.append(f"By layer type (sink's geometry minus attention share, mean over sink heads): {by_type}.")
            strong_heads = heads[(heads["sink_rate"] > 0.6) & (heads["token_class"] == "tail")]
            weak_heads = heads[(heads["sink_rate"] > eps) & (heads["sink_rate"] <= 0.6) & (heads["token_class"] == "tail")]
            lines.append(f"Strength of the sink: attention's share of the tail is {strong_heads['alpha'].median():.2f} "
                         f"(median) in the {len(strong_heads)} heads with a sink rate above 0.6 and "
                         f"{weak_heads['alpha'].median():.2f} in the {len(weak_heads)} between eps and 0.6.")
        lines.append(f"BOS: {bos_text}.")
        paragraphs.append(" ".join(lines))
    r.phrases["disagreements"] = ("\n\n".join(paragraphs) if paragraphs else
                                  nothing_to_explain(r.evidence, r.rerun_label, r.datasets))


# -- figures ----------------------------------------------------------------------------------------------------------
def sink_rates_figure(r: SinkDecomposition):
    """Figure 1: (a) the sink rate of every head, [layer, head], sink heads dotted; (b) its distribution."""
    import matplotlib.pyplot as plt

    rates, eps, colours = r.rates, r.eps, _colours()
    grid = rates.pivot(index="layer", columns="head", values="sink_rate")
    n_layers, n_heads = grid.shape
    fig, (ax, ax_hist) = plt.subplots(1, 2, figsize=(10.5, 6), width_ratios=[1.25, 1], constrained_layout=True)
    image = ax.imshow(grid.to_numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
    layer_idx, head_idx = np.nonzero(grid.to_numpy() > eps)
    ax.scatter(head_idx, layer_idx, s=14, color="white", edgecolor="black", linewidth=0.5,
               label=rf"sink head (rate $> {eps:g}$)")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(0, n_layers, max(1, round(n_layers / 15))))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.grid(False)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.08, pad=0.03, label=r"sink rate: mean $\alpha_{i0}$, queries $i \geq 1$")
    ax.set_title("(a) sink rate per head")
    ax_hist.hist(rates["sink_rate"], bins=np.linspace(0, 1, 21), color=colours[0], edgecolor="white")
    ax_hist.axvline(eps, color="black", ls="--", lw=1)
    ax_hist.annotate(rf"$\epsilon = {eps:g}$", (eps, 1), xycoords=("data", "axes fraction"), xytext=(4, -14),
                     textcoords="offset points", fontsize=9)
    ax_hist.set_xlabel("sink rate")
    ax_hist.set_ylabel("heads")
    ax_hist.set_title("(b) over all heads")
    fig.suptitle(f"{r.model}: attention on position 0", fontweight="bold")
    return fig


def factor_distributions_figure(r: SinkDecomposition):
    """Figure 2: empirical distribution functions of the factors and of |c|, sink and tail, in sink heads and
    the other heads (the sampled pairs)."""
    import matplotlib.pyplot as plt

    colours, sample = _colours(), r.sample
    sink, tail = colours[1], colours[0]
    classes = [("sink", True, sink, "-", "sink, sink heads"), ("sink", False, sink, "--", "sink, other heads"),
               ("tail", True, tail, "-", "tail, sink heads"), ("tail", False, tail, "--", "tail, other heads")]
    panels = [("alpha", r"attention $\alpha_{ij}$", "log", lambda x: x),
              ("relative_norm", r"relative norm $\|\tilde v_j\| / \|o^h_i\|$", "log", lambda x: x),
              ("cosine", r"alignment $\cos(o^h_i, \tilde v_j)$", "linear", lambda x: x),
              ("contribution", r"$|c_{ij}|$", "log", np.abs)]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7.5), constrained_layout=True)
    for ax, (column, label, scale, transform) in zip(axes.ravel(), panels):
        shown_values = []
        for cls, in_sink_heads, colour, style, name in classes:
            rows = sample[(sample["token_class"] == cls) & (sample["sink_head"] == in_sink_heads)]
            x = np.sort(transform(rows[column].to_numpy(float)))
            x = x[np.isfinite(x) & ((x > 0) if scale == "log" else True)]
            if len(x):
                ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", color=colour, ls=style, lw=1.8,
                        label=f"{name} ({len(x)})")
                shown_values.append(x)
        ax.set_xscale(scale)
        if scale == "log" and shown_values:  # the lowest 0.5% (underflowing attention) would squash the rest
            ax.set_xlim(left=np.quantile(np.concatenate(shown_values), 0.005))
        ax.set_xlabel(label)
        ax.set_ylabel("share of pairs below")
        ax.set_ylim(0, 1)
    axes[1, 0].axvline(0, color="black", lw=0.8)
    axes[0, 0].legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{r.model}: empirical distribution of the three factors and of $|c|$", fontweight="bold")
    return fig


def _stacked(ax, r: SinkDecomposition, column, annotate, factor_colours, factor_labels):
    # one stacked bar per group: positive parts upwards from 0, negative parts downwards
    for x, (cls, scope, _) in enumerate(GROUPS):
        up = down = 0.0
        for f in factor_colours:
            v = r.pooled(scope, cls, f, column)
            if not np.isfinite(v):
                continue
            bottom = up if v >= 0 else down
            ax.bar(x, v, bottom=bottom, color=factor_colours[f], width=0.6, edgecolor="white",
                   label=factor_labels[f] if x == 0 else None)
            if annotate and abs(v) >= 0.08:
                ax.text(x, bottom + v / 2, f"{v:.2f}", ha="center", va="center", fontsize=8, color="white")
            up, down = (up + v, down) if v >= 0 else (up, down + v)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(GROUPS)), [g[2] for g in GROUPS])


def variance_figure(r: SinkDecomposition):
    """Figure 3: (a) each factor's share of var(log|c|) and (b) the mean of each log factor, per group."""
    import matplotlib.pyplot as plt

    colours = _colours()
    factor_colours = {"alpha": colours[0], "relative_norm": colours[2], "cosine": colours[4]}
    factor_labels = {"alpha": r"attention $\alpha$", "relative_norm": "relative norm", "cosine": r"alignment $|\cos|$"}
    fig, (ax_var, ax_level) = plt.subplots(1, 2, figsize=(11, 4.8), constrained_layout=True)
    _stacked(ax_var, r, "share", True, factor_colours, factor_labels)
    ax_var.set_ylabel(r"share of var$(\log|c|)$")
    ax_var.set_title("(a) what makes $c$ vary")
    _stacked(ax_level, r, "mean_log", False, factor_colours, factor_labels)
    for x, (cls, scope, _) in enumerate(GROUPS):
        total = r.pooled(scope, cls, "contribution", "mean_log")
        ax_level.plot([x - 0.34, x + 0.34], [total, total], color="black", lw=2,
                      label=r"mean $\log|c|$" if x == 0 else None)
    ax_level.set_ylabel(r"mean of $\log|f|$ (natural log)")
    ax_level.set_title("(b) what sets its level")
    handles, labels = ax_level.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle(r.model, fontweight="bold")
    return fig


def geometry_share_figure(r: SinkDecomposition):
    """Figure 4: per head, geometry's share of var(log|c|) for its sink and its tail pairs, against its sink rate."""
    import matplotlib.pyplot as plt

    colours, heads, eps = _colours(), r.heads, r.eps
    fig, ax = plt.subplots(figsize=(9, 4.6), constrained_layout=True)
    for cls, colour in (("sink", colours[1]), ("tail", colours[0])):
        rows = heads[heads["token_class"] == cls]
        ax.scatter(rows["sink_rate"], rows["geometry"], s=18, color=colour, alpha=0.75, edgecolor="none",
                   label=f"{cls} tokens ({len(rows)} heads)")
    ax.axhline(0.5, color="0.4", ls=":", lw=1)
    ax.axvline(eps, color="black", ls="--", lw=1)
    ax.annotate(rf"$\epsilon = {eps:g}$", (eps, 1), xycoords=("data", "axes fraction"), xytext=(4, -14),
                textcoords="offset points", fontsize=9)
    ax.set_xlim(0, 1)
    ax.set_xlabel("sink rate of the head")
    ax.set_ylabel(r"geometry's share of var$(\log|c|)$")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=9, frameon=False)
    ax.set_title(r.model, fontsize=12)
    return fig
