"""Chapter 7, the semantic cone: what happens to the head outputs, layer by layer, and to perplexity when the
sink's value is removed, against a random token, the sink's mass removed elsewhere and a random term of the
sink's norm; and whether noise from many weak tokens accumulates along the semantic mean (the paper's section
on value geometry of attention sinks).

:func:`run` computes everything the chapter shows on one model, from the sink pass chapters 5-7 share
(:mod:`cwbook.chapters.sinks_common`): the bootstrap tables of the intervened head outputs, the perplexity
changes, the weak-token drift curve, the registered claims, and the numbers and sentences its prose quotes
(:class:`SemanticCone`: ``numbers``, ``phrases`` and ``intervals``, glued under those names). The figure
functions take its result and return a figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from cwbook.chapters.sinks_common import (OnSinkPass, SinkPass, claim_phrase, committed_evidence, disagreement_opening,
                                          no_evidence_label, nothing_to_explain, part_phrase, rerun_claims_table,
                                          sink_pass)

CHAPTER = "07_semantic_cone"
MEASURES = ["log_norm_ratio", "delta_cos", "drift", "cos_clean", "cos_after"]


def conditions() -> dict:
    """The interventions: name -> (label, colour)."""
    from cwcore.plotting import palette

    colours = palette(10)
    return {"sink": ("sink removed", colours[1]), "sink_renorm": ("sink removed, renormalised", colours[2]),
            "control": ("random token removed (control)", colours[7]),
            "control_mass": ("sink's mass removed elsewhere (mass-matched control)", colours[5])}


CONDITIONS = ("sink", "sink_renorm", "control", "control_mass")


def value(boot, column: str, **where) -> tuple:
    """(estimate, low, high) of one group of a bootstrap table (:func:`cwbook.sink_claims.group_value`)."""
    from cwbook import sink_claims

    return sink_claims.group_value(boot, column, **where)


def by_sign(triple, positive: str, negative: str) -> str:
    """The sentence for a difference (estimate, low, high) whose reading turns with its sign."""
    e, lo, hi = triple
    if not np.isfinite(e):
        return "not measured"
    return f"{positive if e > 0 else negative} by {abs(e):.3f} (difference {e:+.3f}, {lo:+.3f} to {hi:+.3f})"


@dataclass
class SemanticCone(OnSinkPass):
    """What chapter 7 shows for one model (the first data set, ``data``, unless keyed by data set):

    * ``raw``: the semantic cone analysis' raw tables; ``points``: one row per touched head output and
      condition (:func:`cwcore.sinks.cone_points`);
    * ``within`` / ``across`` / ``by_layer``: cluster bootstraps over sequences of the measures per
      (condition, quantile of the output norm within its head), per (condition, head's norm bin) and, for
      the lowest-norm outputs, per (condition, layer);
    * ``changes``: the perplexity changes (:func:`cwbook.sink_claims.perplexity_changes`);
      ``curve``: the weak-token drift curve, ``ks`` its k > 0;
    * ``claims`` (first data set), ``claims_by_data``, ``stacked_claims`` and ``claims_display`` (Table 1).
    """

    sinks: SinkPass
    quantiles: int
    n_bootstrap: int
    numbers: dict = field(default_factory=dict)
    phrases: dict = field(default_factory=dict)
    intervals: dict = field(default_factory=dict)
    raw: dict = None
    points: pd.DataFrame = None
    within: object = None
    across: object = None
    by_layer: object = None
    changes: tuple = None
    curve: object = None
    ks: list = None
    claims: pd.DataFrame = None
    claims_by_data: dict = None
    stacked_claims: pd.DataFrame = None
    claims_display: pd.DataFrame = None  # Table 1: the rerun's parts beside the committed evidence's verdicts
    verdict_of: dict = None  # data set -> {claim: the rerun's verdict text} (never printed: see rerun_direction)
    evidence: object = None  # the committed evidence (sinks_common.Evidence), None where none is committed






    @property
    def first_layer(self) -> int:
        return int(self.by_layer.table["layer"].min())

    @property
    def parameters(self) -> dict:
        """The parameters written with the claims table for the findings page."""
        run = self.sinks.run
        return dict(data=",".join(self.datasets), n_documents=min(self.documents.values()), seq_len=run.seq_len,
                    quantiles=self.quantiles, n_bootstrap=self.n_bootstrap, seed=run.seed, dtype=run.dtype)

    def value_k(self, outputs: str, k: int) -> tuple:
        """(estimate, low, high) of the drift curve's cosine for ``outputs`` ("lowest" or "all") at ``k``
        (0: all tail terms)."""
        return value(self.curve, "cos", outputs=outputs, k=k)


#: the share of a head's outputs one of ``quantiles`` bins holds, in words ("the lowest-norm fifth")
BIN_NAMES = {2: "half", 3: "third", 4: "quarter", 5: "fifth", 6: "sixth", 7: "seventh", 8: "eighth", 9: "ninth",
             10: "tenth"}


def bin_name(quantiles: int) -> str:
    """The share one of ``quantiles`` equal-count bins holds, for the prose: 5 -> "fifth", 20 -> "1/20"."""
    return BIN_NAMES.get(int(quantiles), f"1/{int(quantiles)}")


def run(model: str, run_parameters: dict | None = None, *, quantiles: int = 5,
        n_bootstrap: int = 1000, profile: str = "default") -> SemanticCone:
    """Chapter 7 on ``model``: ``run_parameters`` the run chapters 5-7 share (:class:`cwbook.notebook.SinkRun`),
    ``quantiles`` bins of the clean output norm (bin 1: the lowest-norm outputs), ``n_bootstrap`` resamples of
    the sequences for the intervals, ``profile`` the run profile (it names what the page's own numbers are).
    Prints how long the analyses took."""
    from cwcore import sinks, stats
    from cwbook import sink_claims

    shared = sink_pass(model, run_parameters, ["semantic_cone"], profile=profile, quantiles=quantiles)
    run_ = shared.run
    print(f"{model}: the sink analyses of {run_.n_sequences} documents ({run_.seq_len} tokens) of each of "
          f"{', '.join(shared.datasets)} in {sum(shared.seconds.values()):.0f} s")
    r = SemanticCone(sinks=shared, quantiles=quantiles, n_bootstrap=n_bootstrap)
    # the verdicts the page prints come from here (the registered lowest bin is a fifth: 5 quantiles)
    r.evidence = committed_evidence(CHAPTER, model, eps=shared.eps, quantiles=quantiles)
    r.phrases["rerun_label"] = r.rerun_label
    r.phrases["evidence_label"] = (r.evidence.label if r.evidence is not None
                                   else no_evidence_label(CHAPTER, model, shared.eps, quantiles))
    r.phrases["bin"] = bin_name(quantiles)
    data = r.data
    r.phrases["caption"] = (f"{model}, {len(shared.blocks[data])} documents of `{data}` ({run_.seq_len} tokens each), "
                            f"seed {run_.seed}")
    r.numbers.update({"eps": shared.eps, "n_sequences": run_.n_sequences, "seq_len": run_.seq_len})
    r.raw = raw = shared.results[data]["raw"]["semantic_cone"]
    r.points = points = sinks.cone_points(raw, quantiles)  # one row per touched head output and condition
    if points.empty:  # every table below is of the touched heads' outputs (it stopped on a NaN layer number)
        from cwcore.cli import UsageError

        raise UsageError(f"{model}: no head output was intervened on in `{data}` (sink_options "
                         f"{dict(run_.sink_options)}, eps={shared.eps:g}: no head selected, e.g. heads='sink' on a "
                         "model without sink heads), so chapter 7 has no cone to show")
    r.within = stats.cluster_bootstrap(points, MEASURES, ["condition", "quantile"], **r.boot)
    r.across = stats.cluster_bootstrap(points, MEASURES, ["condition", "head_bin"], **r.boot)
    lowest = points[points["quantile"] == 1]
    r.by_layer = stats.cluster_bootstrap(lowest, ["log_norm_ratio", "delta_cos"], ["condition", "layer"], **r.boot)
    r.numbers.update({"n_bootstrap": n_bootstrap, "quantiles": quantiles,
                      "n_seq": int(raw["sequences"]["sequence"].nunique()),
                      "n_outputs": int((points["condition"] == "sink").sum())})
    # the findings page judges with the same table
    r.claims = sink_claims.chapter_claims(CHAPTER, shared.results[data], shared.eps, quantiles=quantiles, **r.boot)
    _outputs(r)
    _layers(r)
    _perplexity(r)
    _drift(r)
    _claims(r)
    _disagreements(r)
    return r


def _outputs(r: SemanticCone) -> None:
    from cwbook import sink_claims

    within, across, top, claims = r.within, r.across, r.quantiles, r.claims
    for condition in CONDITIONS:
        r.intervals[f"ratio_{condition}_q1"] = np.exp(value(within, "log_norm_ratio", condition=condition, quantile=1))
        r.intervals[f"ratio_{condition}_qtop"] = np.exp(value(within, "log_norm_ratio", condition=condition,
                                                              quantile=top))
        r.intervals[f"dcos_{condition}_q1"] = value(within, "delta_cos", condition=condition, quantile=1)
        r.intervals[f"dcos_{condition}_qtop"] = value(within, "delta_cos", condition=condition, quantile=top)
        r.intervals[f"drift_{condition}_q1"] = value(within, "drift", condition=condition, quantile=1)
        r.intervals[f"hdcos_{condition}_q1"] = value(across, "delta_cos", condition=condition, head_bin=1)
    r.intervals["cos_clean_q1"] = value(within, "cos_clean", condition="sink", quantile=1)
    r.intervals["cos_after_q1"] = value(within, "cos_after", condition="sink", quantile=1)
    # paired intervals
    for name, key in (("dcos_sink_minus_control", "dcos_sink_minus_control"), ("dcos_low_minus_high", "dcos_low_minus_high"),
                      ("dcos_sink_minus_mass", "dcos_sink_minus_mass"),
                      ("dcos_sink_minus_random", "dcos_sink_minus_random_direction")):
        r.intervals[name] = sink_claims.triple(claims, key)
    r.phrases["random_direction_sentence"] = by_sign(
        sink_claims.triple(claims, "dcos_sink_minus_random_direction"),
        "further from the axis than that random term would",
        "*closer to* the axis than that random term would, not further,")
    first_claims = sink_claims.for_data(claims, r.data)  # keys "<data>/...", as part_phrase reads them
    said = part_phrase(first_claims, r.data, "dcos_sink_minus_random_direction", r.evidence)
    r.phrases["v_random_direction"] = f"*{said}*"
    points = r.points
    matched = points[(points["condition"] == "sink") & (points["quantile"] == 1)]
    r.numbers["alpha0_q1"] = float(matched["alpha0_clean"].mean()) if len(matched) else np.nan
    r.numbers["share_over_half_q1"] = float((matched["alpha0_clean"] > 0.5).mean()) if len(matched) else np.nan


def _layers(r: SemanticCone) -> None:
    by_layer, first_layer = r.by_layer, r.first_layer
    layer_table = by_layer.table
    r.numbers["first_layer"] = first_layer
    r.intervals["dcos_sink_first"] = value(by_layer, "delta_cos", condition="sink", layer=first_layer)
    r.intervals["dcos_renorm_first"] = value(by_layer, "delta_cos", condition="sink_renorm", layer=first_layer)
    sink_layers = layer_table[layer_table["condition"] == "sink"]
    peak = sink_layers.loc[sink_layers["delta_cos"].idxmax()] if len(sink_layers) else None
    r.numbers["peak_layer"] = int(peak["layer"]) if peak is not None else -1
    r.numbers["peak_dcos"] = float(peak["delta_cos"]) if peak is not None else np.nan
    r.numbers["n_layers_up"] = int((sink_layers["delta_cos_low"] > 0).sum())
    r.numbers["n_layers"] = len(sink_layers)


def _perplexity(r: SemanticCone) -> None:
    from cwbook import sink_claims

    r.changes = sink_claims.perplexity_changes(r.raw["sequences"], CONDITIONS, **r.boot)
    ppl, delta_log, delta_ppl, sink_minus_control, sink_minus_mass = r.changes
    r.intervals["ppl_clean"] = ppl["clean"]
    for c in CONDITIONS:
        r.intervals[f"ppl_{c}"] = ppl[c]
        r.intervals[f"dppl_{c}"] = delta_ppl[c]
        r.intervals[f"dlog_{c}"] = delta_log[c]
    r.intervals["dlog_sink_minus_control"] = sink_minus_control
    r.intervals["dlog_sink_minus_mass"] = sink_minus_mass
    plain = float(delta_log["sink"][0])
    # a share of a cost needs a cost: where removing the sink does not raise perplexity (or changes nothing), the
    # reading said "most of the plain removal's cost ..." of a negative or zero change (or divided by zero)
    renorm_share = float(delta_log["sink_renorm"][0]) / plain if np.isfinite(plain) and plain > 0 else float("nan")
    r.numbers["renorm_share"] = renorm_share
    if not np.isfinite(renorm_share):
        r.phrases["renorm_reading"] = (f"In this rerun check (its point estimates), removing the sink does not raise "
                                       f"the perplexity (Δlog PPL {plain:+.4f}), so there is no cost to split between "
                                       "the shrinking of the outputs and the loss of the sink's term.")
    elif renorm_share < 0.5:
        r.phrases["renorm_reading"] = (f"That is {renorm_share:.0%} of the plain removal's change. "
                                       "In this rerun check (its point estimates), most of the plain removal's cost "
                                       "comes with the shrinking of the "
                                       "outputs, whose weights then sum to 1 − αᵢ₀, rather than with the loss of the "
                                       "sink's term itself.")
    else:
        r.phrases["renorm_reading"] = (f"That is {renorm_share:.0%} of the plain removal's change. "
                                       "In this rerun check (its point estimates), the cost does not come from the "
                                       "shrinking of the outputs alone: even with their weights summing to one, the "
                                       "outputs lack something the model relies on, the sink's term αᵢ₀ṽ₀.")


def _drift(r: SemanticCone) -> None:
    from cwbook import sink_claims

    r.curve = sink_claims.drift_curve(r.raw, r.quantiles, **r.boot)
    table = r.curve.table
    r.ks = ks = sorted(k for k in table["k"].unique() if k > 0)
    r.numbers["k_max"] = ks[-1]
    for outputs in ("lowest", "all"):
        r.intervals[f"wk1_{outputs}"] = r.value_k(outputs, 1)
        r.intervals[f"wkmax_{outputs}"] = r.value_k(outputs, ks[-1])
        r.intervals[f"wkall_{outputs}"] = r.value_k(outputs, 0)
    claims = r.claims
    for name, key in (("drift_gain_q1", "drift_weak_q1"), ("drift_gain_all", "drift_weak_all"),
                      ("drift_null_q1", "drift_null_q1"), ("drift_null_all", "drift_null_all")):
        r.intervals[name] = sink_claims.triple(claims, key)
    for outputs in ("q1", "all"):
        r.phrases[f"drift_null_{outputs}_sentence"] = by_sign(sink_claims.triple(claims, f"drift_null_{outputs}"),
                                                              "closer to the axis", "*farther from* the axis")


def _claims(r: SemanticCone) -> None:
    from cwbook import sink_claims

    r.claims_by_data = {r.data: r.claims}
    for name in r.datasets[1:]:
        r.claims_by_data[name] = sink_claims.chapter_claims(CHAPTER, r.sinks.results[name], r.eps,
                                                            quantiles=r.quantiles, **r.boot)
    r.stacked_claims = sink_claims.stack_data(r.claims_by_data)  # part "<data>: ...", key "<data>/..."
    r.claims_display = rerun_claims_table(r.stacked_claims, r.evidence, r.rerun_label, digits=3)
    r.verdict_of = {d: sink_claims.claim_verdict_texts(c) for d, c in r.claims_by_data.items()}
    for claim_name, tag in ((sink_claims.CONE, "v_cone"), (sink_claims.PERPLEXITY, "v_ppl"),
                            (sink_claims.DRIFT, "v_drift")):
        r.phrases[tag] = claim_phrase(claim_name, r.stacked_claims, r.datasets, r.evidence)
    for i, key in enumerate(r.claims["key"]):  # the first data set's parts, in order
        r.phrases[f"v_part{i}"] = f"*{part_phrase(r.stacked_claims, r.data, key, r.evidence)}*"


def _disagreements(r: SemanticCone) -> None:
    from cwbook import sink_claims

    tokenizer, blocks, data = r.sinks.tokenizer, r.sinks.blocks, r.data
    delta_log = r.changes[1]
    paragraphs = []
    first_is_bos = float(np.mean([int(blocks[d][0]["input_ids"][0] == tokenizer.bos_token_id)
                                  if tokenizer.bos_token_id is not None else 0 for d in r.datasets]))
    bos_text = ("every block starts with the BOS token, so the sink is always the same token"
                if first_is_bos == 1 else "no block starts with a BOS token: the sink is the first word of each document")
    for claim_name, what in ((sink_claims.CONE, "low-norm outputs collapse into the cone"),
                             (sink_claims.PERPLEXITY, "removing the sink raises perplexity"),
                             (sink_claims.DRIFT, "noise from many weak tokens accumulates")):
        lines = disagreement_opening(claim_name, what, r.stacked_claims, r.datasets, r.evidence, r.rerun_label)
        if lines is None:
            continue
        c = r.claims_by_data[data]
        keys = {sink_claims.CONE: ["dcos_sink_q1", "dcos_sink_minus_control", "dcos_sink_minus_mass",
                                   "dcos_low_minus_high", "dcos_sink_minus_random_direction"],
                sink_claims.PERPLEXITY: ["dlog_sink", "dlog_sink_minus_control", "dlog_sink_minus_mass"],
                sink_claims.DRIFT: ["drift_weak_q1", "drift_weak_all", "drift_null_q1", "drift_null_all"]}[claim_name]
        parts = []
        for key in keys:
            row = c[c["key"] == key]
            if len(row):
                row = row.iloc[0]
                parts.append(f"{row['statistic']} {row['estimate']:+.3f} ({row['low']:+.3f} to {row['high']:+.3f}, "
                             f"{part_phrase(r.stacked_claims, data, key, r.evidence)})")
        lines.append("On `" + data + "`: " + "; ".join(parts) + ".")
        if claim_name == sink_claims.CONE:
            e = value(r.within, "delta_cos", condition="sink_renorm", quantile=1)
            first = value(r.by_layer, "delta_cos", condition="sink", layer=r.first_layer)[0]
            lines.append(f"Renormalised removal: Δcos {e[0]:+.3f} ({e[1]:+.3f} to {e[2]:+.3f}); first layer, where no "
                         f"change comes from below: Δcos {first:+.4f}.")
        if claim_name == sink_claims.PERPLEXITY:
            lines.append(f"Renormalised removal: Δ log PPL {delta_log['sink_renorm'][0]:+.2f} "
                         f"({delta_log['sink_renorm'][1]:+.2f} to {delta_log['sink_renorm'][2]:+.2f}); mass-matched "
                         f"control: {delta_log['control_mass'][0]:+.2f} ({delta_log['control_mass'][1]:+.2f} to "
                         f"{delta_log['control_mass'][2]:+.2f}).")
        lines.append(f"BOS: {bos_text}.")
        paragraphs.append(" ".join(lines))
    r.phrases["disagreements"] = ("\n\n".join(paragraphs) if paragraphs else
                                  nothing_to_explain(r.evidence, r.rerun_label, r.datasets))


# -- figures ----------------------------------------------------------------------------------------------------------
def _lines(ax, table, x, column, transform=lambda v: v):
    # one line per condition with its bootstrap interval; small offsets keep the error bars apart
    for k, (condition, (label, colour)) in enumerate(conditions().items()):
        rows = table[table["condition"] == condition].sort_values(x)
        if not len(rows):
            continue
        est, low, high = (transform(rows[column + s].to_numpy(float)) for s in ("", "_low", "_high"))
        ax.errorbar(rows[x] + (k - 1.5) * 0.07, est, yerr=[est - low, high - est], color=colour, marker="o", ms=4,
                    capsize=2, lw=1.6, label=label)


def quantile_figure(r: SemanticCone):
    """Figure 1: per bin of the clean output norm (top: within the head; bottom: heads among heads), the norm
    ratio, the change of the cosine with the cone axis and the drift, per intervention."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.6), sharex=True, constrained_layout=True)
    for row, (boot, x, name) in enumerate(((r.within, "quantile", "output-norm quantile within the head"),
                                           (r.across, "head_bin", "head's norm quantile among heads"))):
        _lines(axes[row, 0], boot.table, x, "log_norm_ratio", np.exp)
        _lines(axes[row, 1], boot.table, x, "delta_cos")
        _lines(axes[row, 2], boot.table, x, "drift")
        axes[row, 0].axhline(1, color="black", lw=0.8)
        axes[row, 1].axhline(0, color="black", lw=0.8)
        axes[row, 0].set_ylabel(r"$\|o^{\mathrm{after}}\| / \|o^{\mathrm{clean}}\|$" + "\n(geometric mean)")
        axes[row, 1].set_ylabel(r"$\Delta \cos(o_i, m_i)$")
        axes[row, 2].set_ylabel(r"drift $\cos(o^{\mathrm{clean}}, o^{\mathrm{after}})$")
        for ax in axes[row]:
            ax.set_xlabel(name)
            ax.set_xticks(range(1, r.quantiles + 1))
    axes[0, 0].set_title("(a) norm")
    axes[0, 1].set_title("(b) towards the cone axis")
    axes[0, 2].set_title("(c) direction kept")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(f"{r.model}: head outputs after removing the sink or a random token", fontweight="bold")
    return fig


def layer_figure(r: SemanticCone):
    """Figure 2: per layer, the norm ratio and the change of the cosine with the cone axis of the lowest-norm
    outputs, per intervention."""
    import matplotlib.pyplot as plt

    fig, (ax_norm, ax_cos) = plt.subplots(1, 2, figsize=(12, 4.4), constrained_layout=True)
    _lines(ax_norm, r.by_layer.table, "layer", "log_norm_ratio", np.exp)
    _lines(ax_cos, r.by_layer.table, "layer", "delta_cos")
    ax_norm.axhline(1, color="black", lw=0.8)
    ax_cos.axhline(0, color="black", lw=0.8)
    ax_norm.set_ylim(bottom=0)
    ax_norm.set_ylabel(r"$\|o^{\mathrm{after}}\| / \|o^{\mathrm{clean}}\|$ (geometric mean)")
    ax_cos.set_ylabel(r"$\Delta \cos(o_i, m_i)$")
    for ax in (ax_norm, ax_cos):
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax_norm.set_title("(a) norm, lowest-norm outputs")
    ax_cos.set_title("(b) towards the cone axis, lowest-norm outputs")
    handles, labels = ax_norm.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=2, fontsize=9, frameon=False)
    fig.suptitle(r.model, fontweight="bold")
    return fig


def perplexity_figure(r: SemanticCone):
    """Figure 3: (a) perplexity, clean and under each intervention; (b) the change of log perplexity."""
    import matplotlib.pyplot as plt

    ppl, delta_log = r.changes[0], r.changes[1]
    conds = conditions()
    fig, (ax_ppl, ax_delta) = plt.subplots(1, 2, figsize=(11, 4.4), constrained_layout=True)
    names = ["clean", *conds]
    colours = ["black"] + [conds[c][1] for c in conds]
    labels = ["clean", "sink\nremoved", "sink removed,\nrenormalised", "random token\nremoved (control)",
              "sink's mass\nremoved elsewhere"]
    values = np.array([ppl[c] for c in names])
    ax_ppl.bar(range(len(names)), values[:, 0], color=colours, width=0.6,
               yerr=[values[:, 0] - values[:, 1], values[:, 2] - values[:, 0]], capsize=4)
    ax_ppl.set_xticks(range(len(names)), labels, fontsize=9)
    ax_ppl.set_ylabel("perplexity")
    ax_ppl.set_title("(a) perplexity")
    values = np.array([delta_log[c] for c in conds])
    ax_delta.bar(range(len(conds)), values[:, 0], color=colours[1:], width=0.6,
                 yerr=[values[:, 0] - values[:, 1], values[:, 2] - values[:, 0]], capsize=4)
    ax_delta.axhline(0, color="black", lw=0.8)
    ax_delta.set_xticks(range(len(conds)), labels[1:], fontsize=9)
    ax_delta.set_ylabel(r"$\Delta \log \mathrm{PPL}$ (mean NLL per token, nats)")
    ax_delta.set_title("(b) change against clean")
    fig.suptitle(r.model, fontweight="bold")
    return fig


def drift_figure(r: SemanticCone):
    """Figure 4: the cosine of the sum of the k weakest tail terms with the cone axis, against k (dotted: all
    tail terms), for the lowest-norm outputs and for all."""
    import matplotlib.pyplot as plt
    from cwcore.plotting import palette

    colours, table, ks = palette(10), r.curve.table, r.ks
    fig, ax = plt.subplots(figsize=(8.5, 4.4), constrained_layout=True)
    lowest = f"lowest-norm {bin_name(r.quantiles)} of each head's outputs"
    for outputs, colour, label in (("lowest", colours[1], lowest),
                                   ("all", colours[0], "all outputs")):
        rows = table[(table["outputs"] == outputs) & (table["k"] > 0)].sort_values("k")
        if len(rows):
            ax.errorbar(rows["k"], rows["cos"], yerr=[rows["cos"] - rows["cos_low"], rows["cos_high"] - rows["cos"]],
                        marker="o", ms=4, capsize=2, color=colour, label=label)
        whole = table[(table["outputs"] == outputs) & (table["k"] == 0)]
        if len(whole):
            ax.axhline(float(whole["cos"].iloc[0]), color=colour, ls=":", lw=1.2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("weak tail tokens kept (the k smallest αᵢⱼ)")
    ax.set_ylabel(r"cos(sum of their terms, $m_i$)")
    ax.legend(fontsize=9, frameon=False)
    ax.set_title(f"{r.model}: the weakest tokens' sum against the cone axis (dotted: all tail tokens)", fontsize=11)
    return fig
