"""Chapter 4, faithfulness: does removing the terms a metric ranks first hurt the model? The paper's
ladder (attention, value-weighted, output-normalised, contribution weights, against random) on removal
curves, its anatomy, downstream tasks, per-layer interventions, variants and protocol sensitivity.

Every sweep is a call of the package, moved here unchanged from the notebook (the paper's section on
faithfulness): :func:`ladder` (``cwbook.ladder.ladder_evidence`` through ``ladder_cell``),
:func:`anatomy`, :func:`downstream` (``downstream_cell``), :func:`per_layer` (``per_layer_cell``),
:func:`weight_variants` and :func:`sensitivity` (``sensitivity_cell``). Each returns its tables and
``quoted``/``quoted_md``: the numbers and texts the prose quotes, under their glue names.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import cwcore
from cwbook import findings
from cwbook import ladder as evidence
from cwbook.chapters.common import (AGREEMENT_SAID, AGREEMENT_SHORT, aopc_table, rerun_agrees, rerun_direction,
                                   rerun_label, SweepOptions)
from cwbook.evidence_build import ladder_cell
from cwbook.evidence_frames import downstream_cell, downstream_ladder, per_layer_cell, sensitivity_cell
from cwcore import faithfulness as faith
from cwcore import stats
from cwcore.core.architectures import decomposable_layers

COLOURS = faith.methods.colours()  # each method's colour and display name, from the registry
LABELS = faith.methods.display_names()
ROWS = ["data", "protocol", "importance", "range", "mode"]


def committed_ladder(model: str):
    """The committed ladder of ``model`` at the evidence size (``data/results/evidence/04_faithfulness``):
    ``(its table, its findings rows, its label)``, or ``(None, None, None)`` where none is committed. Every
    verdict word chapter 4 prints about the ladder comes from here."""
    committed = findings.load_results(findings.EVIDENCE_DIR, "04_faithfulness", model)
    if committed is None:
        return None, None, None
    n = committed.metadata.get("parameters", {}).get("n_documents")
    label = f"evidence (exploratory sample, {n} documents per data set)"
    return committed.table, findings.faithfulness_findings(committed.table, model=model, profile="evidence"), label


def agreement_cells(rows: pd.DataFrame, evidence_rows: pd.DataFrame | None,
                    template: str = "{interval}; {agreement}") -> list[str]:
    """One table cell per findings row of this build: ``"+0.012 [-0.003, +0.020]; too few to tell"``, the
    rerun's estimate and interval, then whether it agrees with the verdict of the same row
    (:data:`cwbook.findings.ROW_KEYS`) in the committed ``evidence_rows`` (never the rerun's own verdict);
    ``template`` lays the two out."""
    committed = {}
    if evidence_rows is not None and len(evidence_rows):
        keyed = evidence_rows.assign(**{k: evidence_rows[k].astype(object).fillna("").astype(str) for k in findings.ROW_KEYS})
        committed = dict(zip(map(tuple, keyed[findings.ROW_KEYS].to_numpy()), keyed["verdict"]))
    keyed = rows.assign(**{k: rows[k].astype(object).fillna("").astype(str) for k in findings.ROW_KEYS})
    cells = []
    for key, e, lo, hi, v in zip(map(tuple, keyed[findings.ROW_KEYS].to_numpy()), rows["estimate"], rows["ci_low"],
                                 rows["ci_high"], rows["verdict"]):
        ev = committed.get(key)
        # a step measured at neither size (identical by construction under its protocol) says so
        agreement = (stats.NOT_MEASURED if v == stats.NOT_MEASURED and ev in (None, stats.NOT_MEASURED)
                     else AGREEMENT_SHORT[rerun_agrees(v, ev)])
        interval = f"{e:+.3f} [{lo:+.3f}, {hi:+.3f}]" if np.isfinite(e) else rerun_direction(v)
        cells.append(template.format(interval=interval, agreement=agreement))
    return cells


@dataclass
class Ladder(SweepOptions):
    """The ladder of one model: ``run`` (``cwbook.ladder.ladder_evidence``'s result), its per-document
    rows ``per_seq``, ``blocks`` per data set, the ratio ``grid`` and the top of its low range
    ``low_max``; ``areas`` (AOPC) and ``ladder`` (paired steps), those of the variant cells, ``curves``;
    ``claims`` (one verdict per claim and slice), Tables 1-3 (``aopc_table``, ``step_table``,
    ``verdict_table``) and ``steps`` (Table 2's rows); ``common``: the keywords of the page's other
    sweeps."""
    run: object
    per_seq: pd.DataFrame
    blocks: dict
    grid: list
    low_max: float
    areas: pd.DataFrame
    ladder: pd.DataFrame
    variant_areas: pd.DataFrame
    variant_ladder: pd.DataFrame
    curves: pd.DataFrame
    common: dict
    claims: pd.DataFrame
    steps: pd.DataFrame
    aopc_table: pd.DataFrame
    step_table: pd.DataFrame
    verdict_table: pd.DataFrame
    seconds: float
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)


def ladder(lm, tokenizer, *, model: str, datasets, n_sequences: int, seq_len: int, low_ratios, ratios, protocols,
           importances, metrics, random_seeds: int, variants, variant_models, n_bootstrap: int, seed: int,
           batch_size: int, cache: bool, profile: str, dtype: str) -> Ladder:
    """The chapter's sweeps and tables: one function of the package (the evidence export calls it too,
    with the parameters this page runs with under a profile)."""
    from cwcore.cli import UsageError

    # the page's curves and quoted AOPCs are the default protocol's under signed importance: without them it
    # failed deep in pandas ("No objects to concatenate") or quoted NaN for every AOPC
    for name, values, needed in (("importances", importances, "signed"), ("protocols", protocols, "default")):
        if needed not in list(values):
            raise UsageError(f"{name}={list(values)}: chapter 4's curves and quoted areas are the default protocol's "
                             f"under signed importance; keep {needed!r} among the {name} (others are added beside it)")
    t0 = time.monotonic()
    run = evidence.ladder_evidence(lm, tokenizer, datasets=datasets, n_sequences=n_sequences, seq_len=seq_len,
                                   low_ratios=low_ratios, ratios=ratios, protocols=protocols, importances=importances,
                                   metrics=metrics, random_seeds=random_seeds, variants=variants,
                                   n_bootstrap=n_bootstrap, variant_models=variant_models, model_name=model,
                                   seed=seed, batch_size=batch_size, cache=cache,
                                   # a cell committed in data/results/evidence is taken once 2 of its documents
                                   # recompute equal
                                   sweep=partial(ladder_cell, model=model, profile=profile, dtype=dtype))
    seconds = time.monotonic() - t0
    per_seq, blocks, grid = run.per_sequence, run.blocks, run.grids.ratios
    low_max = run.grids.low_max  # the low range ends at the top of the low grid that was run, not at a constant
    areas, ladder_table = run.tables()
    variant_areas, variant_ladder = run.variant_tables()  # empty unless `variants` ran
    curves = run.curves()  # signed curves per data set and protocol
    # the page's other sweeps (protocol variants, exercises) run with the same sizes
    common = dict(n_bootstrap=n_bootstrap, seed=seed, batch_size=batch_size, max_length=seq_len, progress=False,
                  cache=cache)
    quoted, quoted_md = {}, {}
    n_docs = {d: len(b) for d, b in blocks.items()}
    evidence_table, evidence_rows, evidence_label = committed_ladder(model)
    quoted_md["rerun_label"] = rerun_label(n_docs, profile)
    quoted_md["evidence_label"] = evidence_label or "no committed evidence for this model"
    quoted_md["caption"] = (f"{model}, one block of {seq_len} tokens from each of "
                            + ", ".join(f"{n_docs[d]} `{d}` documents" for d in datasets)
                            + f", ratios {', '.join(f'{r:g}' for r in grid)}, seed {seed}")
    first = datasets[0]
    clean = per_seq[per_seq["data"] == first].drop_duplicates("sequence")["clean_nll"]
    # the data set's perplexity: exp of the mean NLL (the blocks have one length), as chapter 7's; the mean of
    # per-document perplexities it was is another number (113.7 against 84.9 on four web-text documents)
    quoted["clean_ppl"] = float(np.exp(clean.mean()))

    # Table 1
    table1 = aopc_table(areas, ROWS, metrics, LABELS)
    h = areas[(areas["data"] == first) & (areas["protocol"] == "default") & (areas["importance"] == "signed")]
    h = h.set_index(["range", "mode", "metric"])
    for rng in ("low", "full"):
        for mode, tag in (("comprehensiveness", "comp"), ("sufficiency", "suff")):
            for metric in metrics:
                key = (rng, mode, metric)
                quoted[f"aopc_{rng}_{tag}_{metric}"] = h.loc[key, "aopc_nll"] if key in h.index else float("nan")

    # Tables 2 and 3
    claims = findings.faithfulness_findings(ladder_table, model=model, profile=profile)
    steps = claims[claims["claim"].str.startswith("step") | (claims["claim"] == "contribution beats random")]
    steps = steps.assign(cell=agreement_cells(steps, evidence_rows))  # no rerun verdict: its agreement
    step_table = steps.pivot_table(index=ROWS, columns="claim", values="cell", aggfunc="first", sort=False)
    power = steps.groupby(ROWS, sort=False).agg(n=("n_units", "max"), mde=("mde", "median"))
    step_table = step_table.join(power).reset_index().rename(columns={"mde": "mde (median)"})
    combined = claims[claims["claim"].isin(["ordering", "cosine_gain"])]
    # Table 3: the evidence's verdict of each combined claim, and whether this rerun agrees with it
    ev_verdict = {} if evidence_rows is None else dict(zip(
        map(tuple, evidence_rows[["claim", *ROWS]].astype(object).fillna("").astype(str).to_numpy()), evidence_rows["verdict"]))
    combined = combined.assign(shown=[
        (f"evidence {ev_verdict[key]}; rerun {AGREEMENT_SHORT[rerun_agrees(v, ev_verdict[key])]}"
         if ev_verdict.get(key) not in (None, stats.NOT_MEASURED) else
         f"evidence {ev_verdict[key]}; rerun: {rerun_direction(v, claim=True)}" if key in ev_verdict
         else f"rerun: {rerun_direction(v, claim=True)}")
        for key, v in zip(map(tuple, combined[["claim", *ROWS]].astype(object).fillna("").astype(str).to_numpy()),
                          combined["verdict"])])
    verdict_table = combined.pivot_table(index=ROWS, columns="claim", values="shown", aggfunc="first",
                                         sort=False).reset_index()
    # the headline as pre-registered: each step under the protocol where it is measured, |c|, full range, both
    # modes; the verdict is the committed evidence's, the rerun says whether it agrees
    for mode, tag in (("comprehensiveness", "comp"), ("sufficiency", "suff")):
        for key, judge in ((f"v_{tag}", findings.primary_ordering), (f"v_gain_{tag}", findings.primary_cosine_gain)):
            live = judge(ladder_table, mode, data=first).verdict
            if evidence_table is None:
                quoted_md[key] = (f"not decided here (no committed evidence for this model; the rerun check: "
                                  f"{rerun_direction(live, claim=True)})")
                continue
            committed_verdict = judge(evidence_table, mode, data=first).verdict
            quoted_md[key] = (f"**{committed_verdict}** in the {evidence_label} — the rerun check "
                              f"{AGREEMENT_SAID[rerun_agrees(live, committed_verdict)]} —")
    ph = claims[(claims["data"] == first) & (claims["protocol"] == "per-head") & (claims["range"] == "full")
                & (claims["claim"] == "step 2->3")]
    quoted_md["step23"] = ("; ".join(f"{importance} {mode} {cell}" for importance, mode, cell in
                                     zip(ph["importance"], ph["mode"],
                                         agreement_cells(ph, evidence_rows, "{interval} (rerun {agreement})")))
                           or "not measured")
    return Ladder(run, per_seq, blocks, grid, low_max, areas, ladder_table, variant_areas, variant_ladder, curves,
                  common, claims, steps, table1, step_table, verdict_table, seconds, quoted, quoted_md)


def curves_figure(lad: Ladder, datasets, protocols, metrics, model: str):
    """Figure 1: comprehensiveness and sufficiency curves of every metric, one row per data set and protocol."""
    curves = lad.curves
    panels = [(d, p) for d in datasets for p in protocols]
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.8 * len(panels)), squeeze=False, constrained_layout=True)
    for row, (data, protocol) in enumerate(panels):
        for ax, mode in zip(axes[row], ("comprehensiveness", "sufficiency")):
            part = curves[(curves["data"] == data) & (curves["protocol"] == protocol) & (curves["mode"] == mode)]
            for metric in metrics:
                m = part[part["metric"] == metric].sort_values("ratio")
                style = ":" if metric == "random" else "--" if metric == "value_weighted_output_normalized" else "-"
                ax.plot(m["ratio"], m["delta_nll"], style, marker="o", ms=3, color=COLOURS[metric],
                        label=LABELS[metric])
                ax.fill_between(m["ratio"], m["nll_ci_low"], m["nll_ci_high"], color=COLOURS[metric], alpha=0.18,
                                lw=0)
            ax.set_xscale("log")
            ax.axvline(lad.low_max, color="grey", lw=0.8, ls=":")
            ax.set_xlabel("fraction of terms removed $r$ (log scale)")
            ax.set_ylabel(r"$\Delta \log$ PPL")
            ax.set_title(f"{mode} ({data}, {protocol})")
    axes[0, 0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{model}: removing the terms each metric ranks highest / lowest", fontweight="bold")
    return fig


def evidence_size(lad: Ladder, *, model: str, profile: str):
    """The committed ladder at the evidence size beside this page's steps: ``(note, figure or None)``."""
    from cwbook.forests import ladder_forest

    committed = findings.load_results(findings.EVIDENCE_DIR, "04_faithfulness", model)
    if profile == "evidence":
        return ("This chapter was built with the `evidence` profile: Tables 2 and 3 *are* the "
                "evidence, so nothing is set beside them."), None
    if committed is None:
        return ("No evidence table is committed for this model (`data/results/evidence/"
                "04_faithfulness/`), so there is no figure here."), None
    ev_claims = findings.faithfulness_findings(committed.table, model=model, profile="evidence")
    ran = committed.metadata.get("parameters", {})
    fig = ladder_forest(ev_claims, title=f"{model}: the ladder at the evidence size")
    both = lad.steps.merge(ev_claims, on=findings.ROW_KEYS, suffixes=("", "_ev"))  # the step rows of Table 2
    decided = both[(both["verdict"] == stats.INCONCLUSIVE) & both["verdict_ev"].isin([stats.HOLDS, stats.CONTRADICTED])]
    flipped = both[both["verdict"].isin([stats.HOLDS, stats.CONTRADICTED])
                   & both["verdict_ev"].isin([stats.HOLDS, stats.CONTRADICTED]) & (both["verdict"] != both["verdict_ev"])]
    cells = ran.get("cells") or [f"{d} x {p}" for d in dict.fromkeys(committed.table["data"])
                                 for p in dict.fromkeys(committed.table["protocol"])]
    note = (f"Committed evidence (`data/results/evidence/04_faithfulness/`): {'; '.join(cells)}"
            + (f"; not in it: {ran['not_included']}" if ran.get("not_included") else "")
            + f". Of the {len(both)} steps measured at both sizes, {int((both['verdict'] == both['verdict_ev']).sum())} "
            f"get the same verdict; {len(decided)} that are inconclusive at this page's size are decided at the "
            f"evidence size, and {len(flipped)} decided ones change side.")
    return note, fig


@dataclass
class Anatomy:
    """What each rung removes (per-head protocol) on the first ``n_documents`` documents of the first data
    set: ``dissected`` (``cwbook.anatomy.selection_anatomy``), ``per_doc`` (its layer average),
    ``explained`` (Table 4: the explanation's test, rung 3 minus rung 2)."""
    n_documents: int
    rungs: list
    ratios: list
    dissected: pd.DataFrame
    per_doc: pd.DataFrame
    explained: pd.DataFrame
    seconds: float
    quoted_md: dict = field(default_factory=dict)


#: the measures of the anatomy figure
ANATOMY_SHOWN = ["output_shift", "head_norm", "first_token_attention", "removed_share"]


def anatomy(lm, lad: Ladder, *, first: str, metrics, anatomy_sequences, anatomy_ratios, batch_size: int,
            n_bootstrap: int, seed: int) -> Anatomy:
    """Dissect the removals of the ladder's rungs and test the explanation of the 2->3 step."""
    from cwbook import anatomy as dissect
    from cwcore.cli import UsageError

    blocks, per_seq = lad.blocks, lad.per_seq
    # the explanation is tested against the ladder's own rows: a ratio off its grid was dropped from Table 4 while
    # Figure 2 still showed it
    off_grid = [r for r in anatomy_ratios if not any(abs(float(r) - float(g)) < 1e-12 for g in lad.grid)]
    if off_grid:
        raise UsageError(f"anatomy_ratios {off_grid} are not on the ladder's grid {lad.grid}: the anatomy's "
                         "explanation is tested against the ladder's rows at the same ratios")
    t0 = time.monotonic()
    n_anatomy = len(blocks[first]) if anatomy_sequences is None else min(anatomy_sequences, len(blocks[first]))
    rungs = [m for m in dissect.LADDER if m in metrics]
    dissected = dissect.selection_anatomy(lm, blocks[first].select(range(n_anatomy)), rungs, anatomy_ratios,
                                          ("comprehensiveness", "sufficiency"), protocol="per-head",
                                          batch_size=batch_size, progress=False)
    per_doc_anatomy = dissect.layer_average(dissected)
    seconds = time.monotonic() - t0

    ph_rows = per_seq[(per_seq["data"] == first) & (per_seq["protocol"] == "per-head")
                      & (per_seq["importance"] == "signed")]
    explained = dissect.explain_step(dissected, ph_rows, "value_weighted", "value_weighted_output_normalized",
                                     n_bootstrap=n_bootstrap, seed=seed)
    gaps = per_doc_anatomy.pivot_table(index=["mode", "ratio", "document"], columns="metric", values=ANATOMY_SHOWN)
    for measure in ("head_norm", "first_token_attention"):
        gap = (gaps[(measure, "value_weighted_output_normalized")] - gaps[(measure, "value_weighted")])
        gap = gap.groupby(["mode", "ratio"]).mean()
        explained[f"{measure}_gap"] = [gap.get((m, r), np.nan) for m, r in zip(explained["mode"], explained["ratio"])]
    comp_rows = explained[explained["mode"] == "comprehensiveness"]
    quoted_md = {}
    if len(comp_rows):
        best = comp_rows.iloc[-1]
        quoted_md["anatomy_verdict"] = (
            f"at r = {best['ratio']:g}, rung 3's removal shifts the layer output by "
            f"{best['measure_gap']:+.3f} [{best['measure_gap_ci_low']:+.3f}, {best['measure_gap_ci_high']:+.3f}] "
            f"against rung 2's (head norm {best['head_norm_gap']:+.2f}, first-token attention "
            f"{best['first_token_attention_gap']:+.2f}); that the damage gap follows the shift gap across "
            + (f"documents, ρ = {best['rho']:+.2f} [{best['rho_ci_low']:+.2f}, {best['rho_ci_high']:+.2f}]: "
               if np.isfinite(best["rho_ci_low"]) else "documents: ")
            + f"{rerun_direction(best['rho_verdict'])} (rerun check, {int(best['n_units'])} documents, one seed, "
            "no adjustment)")
    else:
        quoted_md["anatomy_verdict"] = "not measured (no per-head sweep at these ratios)"
    return Anatomy(n_anatomy, rungs, list(anatomy_ratios), dissected, per_doc_anatomy, explained, seconds, quoted_md)


def anatomy_table(anat: Anatomy) -> pd.DataFrame:
    """Table 4's columns, rounded as shown: a rerun check, so ρ's interval is described by where it lies
    (``rho: rerun direction``), not by a verdict."""
    shown = anat.explained.assign(rho_direction=[rerun_direction(v) for v in anat.explained["rho_verdict"]])
    return shown[["mode", "ratio", "measure_gap", "measure_gap_ci_low", "measure_gap_ci_high",
                  "head_norm_gap", "first_token_attention_gap", "damage_gap", "damage_gap_ci_low",
                  "damage_gap_ci_high", "rho", "rho_ci_low", "rho_ci_high", "rho_direction",
                  "n_units"]].round(4).rename(columns={"rho_direction": "rho: rerun direction"})


def anatomy_figure(anat: Anatomy, *, first: str, model: str, n_bootstrap: int, seed: int):
    """Figure 2: the removed terms of each rung in the clean run (per-head, comprehensiveness), mean over
    documents of the layer average with bootstrap intervals."""
    comp_anatomy = anat.per_doc[anat.per_doc["mode"] == "comprehensiveness"]
    rungs, anatomy_ratios = anat.rungs, anat.ratios
    fig, axes = plt.subplots(1, len(ANATOMY_SHOWN), figsize=(13, 3.4), constrained_layout=True)
    width = 0.8 / len(rungs)
    for ax, measure in zip(axes, ANATOMY_SHOWN):
        for k, metric in enumerate(rungs):
            part = comp_anatomy[comp_anatomy["metric"] == metric]
            for x, ratio in enumerate(anatomy_ratios):
                values = part.loc[np.isclose(part["ratio"], ratio), measure].to_numpy()
                ci = stats.bootstrap_ci(values, np.mean, n_resamples=n_bootstrap, seed=seed)
                ax.bar(x + (k - (len(rungs) - 1) / 2) * width, ci.estimate, width, color=COLOURS[metric],
                       label=LABELS[metric] if x == 0 else None,
                       yerr=[[ci.estimate - ci.low], [ci.high - ci.estimate]] if np.isfinite(ci.low) else None,
                       capsize=2)
        ax.set_xticks(range(len(anatomy_ratios)), [f"r = {r:g}" for r in anatomy_ratios])
        ax.set_title(measure.replace("_", " "))
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{model}: what each rung removes (per-head, comprehensiveness, {first}, {anat.n_documents} "
                 "documents)", fontweight="bold")
    return fig


SINK_EPS = 0.3  # the sink threshold of chapters 5-7


def committed_anatomy(model: str, datasets):
    """The explanation's test at the evidence size, where committed for this model: ``(quoted_md, table or
    None)``."""
    from cwbook import slug
    from cwbook.evidence_files import read_checked_csv
    from cwbook.evidence_frames import ANATOMY, read_frame

    committed_explain = {d: findings.EVIDENCE_DIR / f"explain_{slug(model)}_{d}.csv" for d in datasets}
    committed_explain = {d: read_checked_csv(p) for d, p in committed_explain.items() if p.is_file()}
    explain_notes = []
    for data, ev in committed_explain.items():
        ev23 = ev[(ev["lower"] == "value_weighted") & (ev["higher"] == "value_weighted_output_normalized")]
        parts = []
        for mode, side in (("comprehensiveness", "below"), ("sufficiency", "above")):
            m = ev23[ev23["mode"] == mode]
            if m.empty:
                continue
            signed = (m["measure_gap_ci_high"] < 0) if side == "below" else (m["measure_gap_ci_low"] > 0)
            held = m.loc[m["rho_verdict"] == "holds", "ratio"].tolist()
            parts.append(f"{mode}: the shift gap is {side} zero at {int(signed.sum())} of {len(m)} ratios and ρ > 0 "
                         + (f"holds at r = {', '.join(f'{r:g}' for r in held)}" if held else "holds at no ratio"))
        explain_notes.append(f"`{data}`, {int(ev['n_units'].max())} documents; for 2→3, " + "; ".join(parts))
    held_notes, first_token_notes = [], []
    for data in committed_explain:
        held_path = findings.EVIDENCE_DIR / f"held_out_{slug(model)}_{data}.csv"  # the evidence build's step
        removed = read_frame(ANATOMY, model, data)
        if not held_path.is_file() or removed is None:
            continue
        held = read_checked_csv(held_path)
        count = held.groupby("role")["verdict"].agg(lambda v: int((v == stats.HOLDS).sum()))
        cells = held.groupby("role").size()
        held_notes.append(f"`{data}`: fitted on {int(held['n_fit'].iloc[0])} documents, tested on "
                          f"{int(held['n_test'].iloc[0])}, Holm over {int(held['n_tests'].iloc[0])} tests: 2→3 holds in "
                          f"{count.get('explained', 0)} of {cells.get('explained', 0)} cells, the controls 1→2 and 3→4 "
                          f"in {count.get('control', 0)} of {cells.get('control', 0)}")
        removed = removed[0]
        removed = removed[(removed["mode"] == "comprehensiveness")
                          & (removed["metric"] == "value_weighted_output_normalized")]
        by_ratio = removed.groupby("ratio")["first_token_attention"].mean()
        if len(by_ratio):
            side = ("below it at every ratio" if by_ratio.max() < SINK_EPS else
                    f"above it at {int((by_ratio >= SINK_EPS).sum())} of {len(by_ratio)} ratios")
            first_token_notes.append(f"`{data}`: {by_ratio.min():.2f} to {by_ratio.max():.2f} over the ratios, {side}")
    quoted_md = {"anatomy_held_out": "; ".join(held_notes) or "not computed (no committed anatomy for this model)",
                 "anatomy_first_token": "; ".join(first_token_notes) or "not committed for this model"}
    if not committed_explain:
        quoted_md["anatomy_evidence"] = "not committed for this model."
        return quoted_md, None
    quoted_md["anatomy_evidence"] = ". ".join(explain_notes) + " (table below)."
    ev = pd.concat([e.assign(data=d) for d, e in committed_explain.items()], ignore_index=True)
    return quoted_md, ev[["data", "lower", "higher", "mode", "ratio", "measure_gap", "measure_gap_ci_low",
                          "measure_gap_ci_high", "damage_gap", "rho", "rho_ci_low", "rho_ci_high", "rho_verdict",
                          "n_units"]].round(3)


@dataclass
class Downstream:
    """The interventions on multiple-choice tasks: ``per_example`` rows, ``summary``
    (``faith.summarize_downstream``), ``chance`` (Table 5), ``ladder`` (the steps on the gold answers),
    ``table`` (Table 6) and ``steps`` (Table 7)."""
    per_example: pd.DataFrame
    summary: pd.DataFrame
    chance: pd.DataFrame
    ladder: pd.DataFrame
    table: pd.DataFrame
    steps: pd.DataFrame
    seconds: float
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)


def downstream(lm, tokenizer, *, tasks, metrics, task_ratios, n_examples: int, n_bootstrap: int, seed: int,
               batch_size: int, cache: bool, model: str, profile: str, dtype: str) -> Downstream:
    """The same interventions (default protocol, signed) on multiple-choice prompts, ``4 * batch_size`` prompts per
    forward pass (they are a few dozen tokens, the ladder's documents ``seq_len``); the numbers do not depend on
    the batch beyond float rounding (each prompt is scored alone, its padding excluded)."""
    t0 = time.monotonic()
    # faith.downstream_eval(..., per_example=True), taken from data/results/evidence once 2 examples per task
    # recompute equal
    down_per = downstream_cell(lm, tokenizer, tasks, metrics, task_ratios, num_examples=n_examples, data_seed=seed,
                               n_bootstrap=n_bootstrap, seed=seed, batch_size=batch_size * 4, progress=False,
                               cache=cache, model=model, profile=profile, dtype=dtype)
    down = faith.summarize_downstream(down_per, n_bootstrap=n_bootstrap, seed=seed)
    seconds = time.monotonic() - t0
    chance_rows = []
    for task in dict.fromkeys(down_per["task"]):
        choices = len(cwcore.load_dataset(task, limit=1, seed=None)[0]["choices"])
        clean = down_per[down_per["task"] == task].drop_duplicates("example")
        acc = stats.bootstrap_ci(clean["clean_correct"].to_numpy(float), np.mean, n_resamples=n_bootstrap,
                                 seed=seed)
        at_chance = acc.low <= 1 / choices <= acc.high
        chance_rows.append({"task": task, "choices": choices, "chance": 1 / choices, "clean accuracy": acc.estimate,
                            "95% interval": f"{acc.low:.2f} – {acc.high:.2f}", "at chance": at_chance,
                            "examples": len(clean)})
    chance = pd.DataFrame(chance_rows)
    down_ladder = downstream_ladder(down_per, n_bootstrap=n_bootstrap, seed=seed)  # judged as the ladder's steps
    at = chance.loc[chance["at chance"], "task"].tolist()
    quoted = {"n_examples": n_examples}
    quoted_md = {"task_ratios": ", ".join(f"{r:g}" for r in task_ratios),
                 "at_chance": ", ".join(at) if at else "none of the tasks"}

    table = down.assign(metric=down["metric"].map(LABELS))
    table["ΔlogPPL 95%"] = [f"{a:.3f} – {b:.3f}" for a, b in zip(table["nll_ci_low"], table["nll_ci_high"])]
    table["accuracy 95%"] = [f"{a:.2f} – {b:.2f}" for a, b in zip(table["accuracy_ci_low"], table["accuracy_ci_high"])]
    table = table[["task", "mode", "ratio", "metric", "delta_nll", "ΔlogPPL 95%", "accuracy", "accuracy 95%",
                   "n_examples"]]
    table = table.rename(columns={"delta_nll": "ΔlogPPL (gold)", "n_examples": "examples"})

    dl = findings.faithfulness_findings(down_ladder, model=model, profile=profile)
    dl = dl[dl["claim"].str.startswith("step") | dl["claim"].isin(["contribution beats random", "ordering"])]
    dl = dl.assign(cell=agreement_cells(dl, committed_ladder(model)[1]))  # the rerun against the evidence's verdict
    steps = dl.pivot_table(index=["data", "mode"], columns="claim", values="cell", aggfunc="first",
                           sort=False).reset_index()
    return Downstream(down_per, down, chance, down_ladder, table, steps, seconds, quoted, quoted_md)


def save_results(results_file, lad: Ladder, down: Downstream, *, model: str, profile: str, datasets, tasks,
                 n_sequences: int, n_examples: int, seq_len: int, task_ratios, protocols, n_bootstrap: int,
                 seed: int, dtype: str) -> None:
    """Write the whole ladder table (the variant cells' and the downstream tasks' steps too) to
    ``results_file``, where the findings page reads it."""
    ladder_all = pd.concat([lad.ladder, lad.variant_ladder, down.ladder], ignore_index=True)
    findings.save_results(results_file, ladder_all, chapter="04_faithfulness", model=model, profile=profile,
                          # the documents each data set really gave (a short local file gives fewer than asked for)
                          parameters=dict(data=",".join(datasets), tasks=",".join(tasks),
                                          n_documents=min(len(lad.blocks[d]) for d in datasets),
                                          n_examples=n_examples, seq_len=seq_len, ratios=lad.grid,
                                          task_ratios=task_ratios, protocols=protocols, n_bootstrap=n_bootstrap,
                                          seed=seed, dtype=dtype))


@dataclass
class PerLayer:
    """The per-layer interventions (``rows``, ``areas``: AOPC per layer and metric) of this build, or the
    committed ones when this profile skips them (``rows`` None when neither)."""
    rows: pd.DataFrame | None
    areas: pd.DataFrame | None
    metrics: list
    seconds: float | None
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)


def per_layer(lm, tokenizer, lad: Ladder, *, first: str, metrics, per_layer_sequences: int, per_layer_ratios,
              batch_size: int, seq_len: int, seed: int, n_bootstrap: int, model: str, profile: str,
              dtype: str) -> PerLayer:
    """Removing terms in one layer at a time (comprehensiveness, default protocol, signed)."""
    from cwbook.evidence_frames import PER_LAYER, frame_paths, read_frame
    from cwcore.faithfulness import layers as layer_curves

    blocks = lad.blocks
    pl, pl_source, seconds = None, "", None
    if per_layer_sequences > 0:
        t0 = time.monotonic()
        pl_blocks = blocks[first].select(range(min(per_layer_sequences, len(blocks[first]))))
        # per_layer.per_layer_curve, taken from data/results/evidence once 2 documents recompute equal
        pl = per_layer_cell(lm, tokenizer, pl_blocks, metrics, per_layer_ratios, "comprehensiveness",
                            batch_size=batch_size, max_length=seq_len, seed=seed, model=model, data=first,
                            profile=profile, dtype=dtype)
        seconds = time.monotonic() - t0
    elif (found := read_frame(PER_LAYER, model, first)) is not None:  # this profile skips them: show the evidence's
        pl, pl_meta = found
        pl_source = (f" These are the committed rows of the `{pl_meta.get('profile')}` profile "
                     f"(`{frame_paths(PER_LAYER, model, first)[0].name}`, commit {str(pl_meta.get('commit'))[:7]}, "
                     f"{pl['document'].nunique()} documents of {pl_meta.get('settings', {}).get('seq_len', '?')} "
                     "tokens): this build did not run them (`per_layer_sequences = 0`).")
    if pl is None:
        return PerLayer(None, None, [], None, {"pl_docs": 0}, {
            "pl_note": "Not run in this profile (`per_layer_sequences = 0`; the `evidence` profile runs it), and "
                       "no per-layer frame is committed for this model.",
            "pl_ratios": ", ".join(f"{r:g}" for r in per_layer_ratios)})
    pl_metrics = [m for m in metrics if m in set(pl["metric"])] or list(dict.fromkeys(pl["metric"]))
    pl_areas = layer_curves.per_layer_aopc(pl, n_bootstrap=n_bootstrap, seed=seed)
    top = pl_areas[pl_areas["metric"] == "contribution"].nlargest(3, "aopc_nll")["layer"].tolist()
    quoted_md = {"pl_note": ("Removing contribution's top terms costs most in layers "
                             f"{', '.join(map(str, top))} " if top else "")
                 + "(figure below: AOPC per layer with 95% intervals over documents)." + pl_source,
                 "pl_ratios": ", ".join(f"{r:g}" for r in sorted(set(pl["ratio"])))}
    return PerLayer(pl, pl_areas, pl_metrics, seconds, {"pl_docs": int(pl["document"].nunique())}, quoted_md)


def per_layer_figure(pl: PerLayer, *, first: str, model: str):
    """AOPC (comprehensiveness) per layer whose terms are removed, with 95% intervals over documents."""
    fig, ax = plt.subplots(figsize=(10, 3.6), constrained_layout=True)
    for metric in pl.metrics:
        m = pl.areas[pl.areas["metric"] == metric].sort_values("layer")
        ax.errorbar(m["layer"], m["aopc_nll"], yerr=[m["aopc_nll"] - m["aopc_nll_ci_low"],
                                                      m["aopc_nll_ci_high"] - m["aopc_nll"]],
                    marker="o", ms=3, capsize=2, color=COLOURS.get(metric), label=LABELS.get(metric, metric))
    ax.set_xlabel("layer whose terms are removed")
    ax.set_ylabel(r"AOPC ($\Delta\log$ PPL)")
    ax.legend(fontsize=8)
    ax.set_title(f"{model}: comprehensiveness per layer ({first}, {pl.rows['document'].nunique()} documents)")
    return fig


def _said(verdict, profile: str) -> str:
    """A step's verdict as the page may print it: the verdict itself under the ``evidence`` profile (its tables
    are the evidence), else where the rerun's interval lies (a smaller build's numbers decide nothing)."""
    return str(verdict) if profile == "evidence" else rerun_direction(verdict)


def _moved(moved, profile: str, cell) -> str:
    """The steps in ``moved`` (rows of :func:`cwbook.ladder.variant_changes`) as the page lists them: ``cell(row)``
    names the cell, then the step and its verdict on the main protocol and on the variant (:func:`_said`)."""
    return "; ".join(f"{cell(r)}, {LABELS.get(r.lower, r.lower)} → {LABELS.get(r.higher, r.higher)}: "
                     f"{_said(r.verdict_main, profile)} → {_said(r.verdict, profile)}" for r in moved.itertuples())


def committed_variant_changes(model: str, variants, evidence_dir=None) -> pd.DataFrame:
    """The committed evidence's step verdicts (exploratory sample) of ``model`` under each of ``variants`` beside
    the same step of the main cells: one row per step, ``variant, data, mode, protocol, importance, range, claim,
    verdict_main, verdict, changed``; empty when the evidence holds none of them for this model."""
    from cwbook.headline import committed_findings
    from cwbook.registration import EXPLORATORY

    rows = committed_findings(evidence_dir)  # findings.csv of the evidence folder, verified; empty without one
    rows = rows[(rows["model"] == model) & rows["claim"].str.startswith("step")
                & (rows.get("sample", EXPLORATORY) == EXPLORATORY)]
    cell = ["data", "mode", "protocol", "importance", "range", "claim"]
    main = rows[rows["variant"] == "main"][[*cell, "verdict"]]
    other = rows[rows["variant"].isin(list(variants))][["variant", *cell, "verdict"]]
    out = other.merge(main, on=cell, suffixes=("", "_main"))
    return out.assign(changed=out["verdict"] != out["verdict_main"])[
        ["variant", *cell, "verdict_main", "verdict", "changed"]].reset_index(drop=True)


_STEP_RUNGS = {name: (lower, higher) for name, lower, higher in findings.STEPS}  # "step 1->2" -> its two rungs


def _committed_said(changes: pd.DataFrame, what: str, model: str) -> str:
    """The committed evidence's ``changes`` (:func:`committed_variant_changes` of ``model``) in one sentence."""
    moved = changes[changes["changed"]]
    listed = "; ".join(f"{r.variant}, `{r.data}` {r.mode} {r.importance} {r.range}, {r.claim}: {r.verdict_main} → "
                       f"{r.verdict}" for r in moved.itertuples())
    size = findings.documents_per_data_set(findings.EVIDENCE_DIR, "04_faithfulness", f"{model}*")  # its variants too
    return (f"not run by this build; in the committed evidence (exploratory sample, {size}), "
            f"{len(moved)} of {len(changes)} {what} (unadjusted) differ from the main cells' verdicts"
            + (f" ({listed})." if len(moved) else "."))


def variant_summary(ladder_table, variant_ladder, profile: str = "default", model: str | None = None):
    """How the variant cells' step verdicts differ from the main protocol's: ``(text, changes or None)``.
    Outside the ``evidence`` profile the steps are this build's rerun check: the text then says where their
    intervals lie, never a verdict word. A build that ran no variant reports the committed evidence's for
    ``model``, where it holds them."""
    changes = evidence.variant_changes(ladder_table, variant_ladder)
    if changes.empty:
        committed = committed_variant_changes(model, ("token-unit", "first-token-removable")) if model else None
        if committed is not None and len(committed):
            return _committed_said(committed, "step verdicts", model), committed
        return ("not run by this build, and not in the committed evidence for this model (the `evidence` profile "
                "runs both on smollm2-135m; `findings.csv` carries them with a `variant` column)."), None
    moved = changes[changes["changed"]]
    what = "step verdicts" if profile == "evidence" else "steps of this build's rerun check"
    return (f"{len(moved)} of {len(changes)} {what} differ from the main protocol's "
            + ("(" + _moved(moved, profile, lambda r: f"{r.variant}, {r.data} {r.mode} {r.importance} {r.range}")
               + ")." if len(moved) else "(none).")), changes.round(4)


def weight_variants(ladder_table, *, model: str, weight_variants, weight_variant_models, datasets,
                    n_sequences: int, seq_len: int, low_ratios, ratios, protocols, importances, metrics,
                    random_seeds: int, n_bootstrap: int, seed: int, batch_size: int, cache: bool, profile: str,
                    dtype: str, device: str):
    """The main ladder cells again on other weights of the model: ``(text, changes or None)``, the text
    naming the primary verdicts that change."""
    weight_names = ([] if weight_variant_models is not None and model not in weight_variant_models
                    else list(weight_variants))
    weight_ladders = []
    for name in weight_names:  # the main cells on the other weights: committed cells are taken as above
        other = f"{model}-{name}"
        t0 = time.monotonic()
        other_lm, other_tokenizer = cwcore.load_model(other, dtype=dtype, device=device)
        other_run = evidence.ladder_evidence(other_lm, other_tokenizer, datasets=datasets, n_sequences=n_sequences,
                                             seq_len=seq_len, low_ratios=low_ratios, ratios=ratios,
                                             protocols=protocols, importances=importances, metrics=metrics,
                                             random_seeds=random_seeds, n_bootstrap=n_bootstrap, model_name=other,
                                             seed=seed, batch_size=batch_size, cache=cache,
                                             sweep=partial(ladder_cell, model=other, profile=profile, dtype=dtype))
        weight_ladders.append(other_run.tables()[1].assign(variant=name))
        del other_lm, other_run
        print(f"{other}: ladder sweeps in {time.monotonic() - t0:.0f} s")
    if not weight_ladders:
        committed = committed_variant_changes(model, ("requantized",))
        if len(committed):
            committed = committed[[evidence.is_primary(model, r.data, r.mode, r.protocol, r.importance, r.range,
                                                       *_STEP_RUNGS[r.claim]) for r in committed.itertuples()]]
        if len(committed):
            return _committed_said(committed, "primary step verdicts", model), committed
        return ("not run by this build, and not in the committed evidence for this model (the `evidence` profile "
                "runs `requantized` on smollm2-135m)."), None
    changes = evidence.variant_changes(ladder_table, pd.concat(weight_ladders, ignore_index=True))
    changes = changes[[evidence.is_primary(model, r.data, r.mode, r.protocol, r.importance, r.range, r.lower, r.higher)
                       for r in changes.itertuples()]]
    moved = changes[changes["changed"]]
    what = "primary verdicts" if profile == "evidence" else "primary steps of this build's rerun check"
    return (f"{len(changes) - len(moved)} of {len(changes)} {what} survive the "
            "re-quantisation" + (" (changed: " + _moved(moved, profile, lambda r: f"{r.data} {r.mode}") + ")."
                                 if len(moved) else ".")), changes.round(4)


@dataclass
class Sensitivity:
    """Each protocol variant's AOPC per metric and ordering verdict (Table 8), on ``blocks``."""
    blocks: object
    table: pd.DataFrame
    seconds: float
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)


def sensitivity(lm, tokenizer, lad: Ladder, *, first: str, metrics, sensitivity_sequences: int,
                sensitivity_ratios, n_bootstrap: int, seed: int, model: str, profile: str,
                dtype: str) -> Sensitivity:
    """Each variant changes one choice of the default protocol (both modes, the first documents)."""
    blocks, common = lad.blocks, lad.common
    decomposable = decomposable_layers(lm)
    first_half = decomposable[:len(decomposable) // 2]
    variants = {"default (head_key, row)": {}, "unit = token": {"unit": "token"}, "unit = key": {"unit": "key"},
                "scope = layer": {"scope": "layer"}, "kind = intra": {"kind": "intra"},
                "importance = absolute": {"importance": "absolute"},
                "keep_first_token = False": {"keep_first_token": False}, "scores = live": {"scores": "live"},
                f"layers = {first_half[0]}-{first_half[-1]}": {"layers": first_half}}
    sens_blocks = blocks[first].select(range(min(sensitivity_sequences, len(blocks[first]))))
    t0 = time.monotonic()
    # one faithfulness_curve per variant, taken from data/results/evidence once 2 documents recompute equal
    sens_rows = sensitivity_cell(lm, tokenizer, sens_blocks, metrics, sensitivity_ratios, variants=variants,
                                 model=model, data=first, profile=profile, dtype=dtype, **common)
    rows = []
    for name in variants:
        ps = sens_rows[sens_rows["change"] == name].drop(columns="change")
        area = faith.aopc(ps, n_bootstrap=n_bootstrap, seed=seed).set_index(["mode", "metric"])["aopc_nll"]
        lad_ = faith.ladder_comparison(ps, n_bootstrap=n_bootstrap, seed=seed)
        for mode in ("comprehensiveness", "sufficiency"):
            step = lad_[(lad_["mode"] == mode)].set_index(["lower", "higher"])
            mde = step["mde"].median()
            rows.append({"variant": name, "mode": mode,
                         **{LABELS[m]: area.get((mode, m), np.nan) for m in metrics},
                         "ordering: rerun direction": rerun_direction(findings.ordering(lad_, mode).verdict,
                                                                      claim=True), "median mde": mde,
                         "documents": ps["document"].nunique()})
    seconds = time.monotonic() - t0
    sens = pd.DataFrame(rows)
    every_step = rerun_direction(stats.HOLDS, claim=True)
    held = sorted({f"{r['variant']} ({r['mode']})" for _, r in sens.iterrows()
                   if r["ordering: rerun direction"] == every_step})
    return Sensitivity(sens_blocks, sens, seconds, {"sensitivity_sequences": len(sens_blocks)},
                       {"sens_ratios": ", ".join(f"{r:g}" for r in sensitivity_ratios),
                        "sens_holds": ", ".join(held) if held else "none of them"})


# -- removal in distribution (zeroing beside the head's mean value as the removed terms' stand-in) -----------
#: the rankings of the in-distribution check: the headline rung, the control and the first rung
IN_DISTRIBUTION_METRICS = ("contribution", "random", "attention")
#: the paired steps reported beside the AOPCs: (lower, higher), difference = AOPC(higher) - AOPC(lower)
IN_DISTRIBUTION_PAIRS = (("random", "contribution"), ("attention", "contribution"))
IN_DISTRIBUTION_DATA = "gsm8k"


def in_distribution_path(model: str):
    """Where the committed table of :func:`removal_in_distribution` for ``model`` lives (``.json`` beside it)."""
    from cwbook import slug
    return findings.EVIDENCE_DIR.parent / f"removal_in_distribution_{slug(model)}_{IN_DISTRIBUTION_DATA}.csv"


def committed_zero_rows(model: str, documents, metrics=IN_DISTRIBUTION_METRICS, ratios=None, *, seq_len: int,
                        dtype: str):
    """The zeroing rows of the committed exploratory evidence (``per_document_<model>_gsm8k.csv.gz``: protocol
    ``default``, importance ``absolute``, the main cell, not a variant's) for ``documents`` (the data set's
    row numbers, in sample order), in
    :func:`~cwcore.faithfulness.faithfulness_curve`'s per-sequence layout; None unless the export ran on blocks
    of ``seq_len`` tokens in ``dtype`` (its JSON's ``seq_len``, ``dtype``: other blocks are other inputs) and every
    (document, metric, mode, ratio) row is there. Read through :func:`cwbook.evidence_export.read_committed`: a
    table whose bytes do not match the SHA-256 its JSON records is refused (``CommittedFileError``), never taken."""
    from cwbook.evidence_export import read_committed

    found = read_committed(model, IN_DISTRIBUTION_DATA, findings.EVIDENCE_DIR)
    if found is None or found[1].get("seq_len") != seq_len or found[1].get("dtype") != dtype:
        return None  # before, 128-token rows were taken beside a --seq-len 160 run's mean removal
    rows = found[0]
    rows = rows[(rows["protocol"] == "default") & (rows["importance"] == "absolute") & rows["metric"].isin(metrics)
                & (rows["variant"] == "main") & rows["document"].isin(list(documents))]
    if ratios is not None:
        rows = rows[rows["ratio"].isin([float(r) for r in ratios])]
    expected = len(documents) * len(metrics) * 2 * (rows["ratio"].nunique() if ratios is None else len(ratios))
    if len(rows) != expected or rows.empty:
        return None
    # a kind-independent metric's kind is "" in the sweep's rows (the CSV reads it back as missing)
    return rows.drop(columns=["data", "model", "protocol", "delta_nll"]).assign(kind=rows["kind"].astype(object).fillna("").infer_objects())


def removal_in_distribution(lm, tokenizer, *, model: str, n_documents: int = 16, seq_len: int = 128,
                            ratios=None, metrics=IN_DISTRIBUTION_METRICS, batch_size: int = 8,
                            n_bootstrap: int = 2000, seed: int = 0, progress: bool = False,
                            zero_from_evidence: bool = False):
    """The headline ranking, the random control and attention on GSM8K with each removed term zeroed
    (``removal="zero"``, the book's removal) and replaced by the head's mean value from the other documents
    (``removal="mean"``, in distribution): ``(table, per_document)``. ``table``: one row per removal, range
    (low: r <= the low grid's top; full), mode and metric with the AOPC of Delta NLL and its bootstrap interval
    over documents, then one row per step of :data:`IN_DISTRIBUTION_PAIRS` with the paired difference,
    its interval and verdict (:func:`cwcore.faithfulness.ladder_comparison`). The headline protocol
    (``default``, importance ``absolute``), the ladder's ratio grid; the first ``n_documents`` documents of the
    chapter's GSM8K sample (prefix-stable, seed ``seed``). ``zero_from_evidence``: take the zeroing rows from
    the committed exploratory evidence (:func:`committed_zero_rows`, the same documents, protocol and
    ranking: computed by the evidence build) where it holds them all, and compute only ``removal="mean"``;
    ``per_document["source"]`` says where each row comes from."""
    grid = evidence.ratio_grid() if ratios is None else sorted(float(r) for r in ratios)
    blocks = cwcore.data.document_blocks(cwcore.load_dataset(IN_DISTRIBUTION_DATA), tokenizer, seq_len, n_documents,
                                         seed=seed)
    parts = []
    for removal in ("zero", "mean"):
        if removal == "zero" and zero_from_evidence:
            dtype = str(next(lm.parameters()).dtype).removeprefix("torch.")
            committed = committed_zero_rows(model, blocks["document"], metrics, grid, seq_len=seq_len, dtype=dtype)
            if committed is not None:
                parts.append(committed.assign(removal=removal, seconds=0.0, source="committed evidence"))
                continue
        t0 = time.monotonic()
        result = faith.faithfulness_curve(lm, tokenizer, blocks, list(metrics), grid,
                                          protocol=evidence.PROTOCOLS["default"], importance="absolute",
                                          removal=removal, batch_size=batch_size, max_length=seq_len,
                                          n_bootstrap=n_bootstrap, progress=progress)
        per_sequence = result.per_sequence
        parts.append(per_sequence.assign(removal=removal, seconds=time.monotonic() - t0, source="computed"))
    columns = [c for c in parts[-1].columns if c not in ("variant", "removal", "seconds", "source")]
    per_document = pd.concat([p[columns + ["removal", "seconds", "source"]] for p in parts], ignore_index=True)
    return in_distribution_table(per_document, grid, model=model, n_bootstrap=n_bootstrap, seed=seed), per_document


def in_distribution_table(per_document: pd.DataFrame, grid, *, model: str, n_bootstrap: int, seed: int) -> pd.DataFrame:
    """:func:`removal_in_distribution`'s table from its per-document rows (column ``removal``)."""
    rows = []
    for range_name, max_ratio in evidence.ranges(grid).items():
        for removal, part in per_document.groupby("removal", sort=False):
            part = part.drop(columns=["removal", "seconds", "source"])
            area = faith.aopc(part, n_bootstrap=n_bootstrap, seed=seed, max_ratio=max_ratio)
            rows.append(area[["mode", "metric", "aopc_nll", "aopc_nll_ci_low", "aopc_nll_ci_high", "n_documents"]]
                        .rename(columns={"aopc_nll": "estimate", "aopc_nll_ci_low": "ci_low",
                                         "aopc_nll_ci_high": "ci_high", "n_documents": "n_units"})
                        .assign(removal=removal, range=range_name, quantity="aopc", lower="", higher=""))
            steps = faith.ladder_comparison(part, pairs=list(IN_DISTRIBUTION_PAIRS), n_bootstrap=n_bootstrap,
                                            seed=seed, max_ratio=max_ratio)
            rows.append(steps[["mode", "lower", "higher", "difference", "ci_low", "ci_high", "verdict", "n"]]
                        .rename(columns={"difference": "estimate", "n": "n_units"})
                        .assign(removal=removal, range=range_name, quantity="step", metric=""))
    table = pd.concat(rows, ignore_index=True)
    table.insert(0, "model", model)
    table.insert(1, "data", IN_DISTRIBUTION_DATA)
    columns = ["model", "data", "removal", "range", "mode", "quantity", "metric", "lower", "higher", "estimate",
               "ci_low", "ci_high", "verdict", "n_units"]
    return table[columns]


def save_in_distribution(table: pd.DataFrame, per_document: pd.DataFrame, *, model: str, n_documents: int,
                         seq_len: int, batch_size: int, n_bootstrap: int, seed: int, path=None, commit=None):
    """Write :func:`removal_in_distribution`'s table with its provenance (``.json`` beside it: the SHA-256 of
    the table's bytes, the commit, sizes, ratios, seconds per removal) through
    :func:`cwbook.findings.save_results`. ``commit``: the commit of the code that ran (default: the checkout's
    now; give the one read when the run started)."""
    from cwbook import REPO_ROOT
    from cwbook import git

    seconds = per_document.groupby("removal")["seconds"].first().round(1).to_dict()
    sources = per_document.groupby("removal")["source"].first().to_dict()
    parameters = dict(data=IN_DISTRIBUTION_DATA, n_documents=n_documents, seq_len=seq_len, batch_size=batch_size,
                      ratios=sorted(per_document["ratio"].unique().tolist()), metrics=list(IN_DISTRIBUTION_METRICS),
                      protocol="default", importance="absolute", n_bootstrap=n_bootstrap, seed=seed,
                      documents=list(dict.fromkeys(per_document["document"].tolist())), seconds=seconds,
                      sources=sources, random_seeds=1,
                      commit=commit or git(REPO_ROOT, "rev-parse", "--short", "HEAD"),
                      cwcore_modified=bool(git(REPO_ROOT, "status", "--porcelain", "--", "cwcore")),
                      stand_in="the head's mean value vector over the real tokens (first token of each sequence "
                      "left out) of the other documents of the sample: leave one document out")
    path = Path(path or in_distribution_path(model))
    rows_path = path.with_name(path.stem + "_per_document.csv.gz")
    rows = per_document.drop(columns=["seconds"])
    rows.to_csv(rows_path, index=False, float_format="%.8g", compression={"method": "gzip", "mtime": 0})
    parameters["per_document_sha256"] = hashlib.sha256(rows_path.read_bytes()).hexdigest()
    return findings.save_results(path, table, chapter="04_faithfulness", model=model, profile="in-distribution",
                                 parameters=parameters)


def committed_in_distribution(model: str):
    """``(table or None, quoted_md)``: the committed in-distribution check of ``model``, and two sentences
    read from it (each step, contribution minus random and minus attention, over the full range, under each
    removal, with its interval and verdict)."""
    path = in_distribution_path(model)
    if not path.is_file():
        return None, {"in_distribution": "not committed for this model."}
    import io

    from cwbook.evidence_files import read_pair

    data, _ = read_pair(path, path.with_suffix(".json"))  # refused when the bytes are not the recorded ones
    table = pd.read_csv(io.BytesIO(data), keep_default_na=False, na_values=[""])
    steps = table[(table["quantity"] == "step") & (table["range"] == "full")]
    names = {"zero": "zeroed", "mean": "with the mean stand-in"}
    sentences = []
    for lower in dict.fromkeys(steps["lower"]):
        parts = []
        for removal in ("zero", "mean"):
            part = steps[(steps["lower"] == lower) & (steps["removal"] == removal)].set_index("mode")
            parts.append(f"{names[removal]}, " + " and ".join(
                f"{mode} {r['estimate']:+.3f} nats [{r['ci_low']:+.3f}, {r['ci_high']:+.3f}] ({r['verdict']})"
                for mode, r in part.iterrows()))
        n = int(steps.loc[steps["lower"] == lower, "n_units"].max())
        sentences.append(f"Contribution minus {lower}, AOPC over the full range ({n} documents): " + "; ".join(parts)
                         + ".")
    return table, {"in_distribution": " ".join(sentences)}
