"""Chapter 4b, the attribution bench: every attention-based attribution method (the paper's ladder and
the methods of the literature) on the same removal curves, compared pairwise with a reference.

The removal protocol is chapter 4's (the paper's section on faithfulness); :func:`run` computes the
sweeps of every data set (one ``faithfulness_curve`` per data set, through
:func:`cwbook.evidence_frames.bench_cell`), their areas (AOPC) per range and the paired comparisons,
and returns them with the chapter's tables and ``quoted``/``quoted_md``: the numbers and texts the
prose quotes, under their glue names.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import pandas as pd

import cwcore
from cwbook import findings
from cwbook import ladder as evidence
from cwbook.chapters.common import (AGREEMENT_SHORT, RERUN_DIRECTION, aopc_table, interval_cell, rerun_agrees,
                                   rerun_direction, rerun_label, SweepOptions)
from cwbook.evidence_frames import bench_cell
from cwcore import faithfulness as faith
from cwcore.data import document_blocks
from cwcore.faithfulness import methods
from cwcore.plotting import palette

LABELS = methods.display_names()  # each method's display name and colour, from the registry


def colours(metrics) -> dict:
    """Each method's colour: the registry's, a user's method one of the palette."""
    return {**dict(zip(metrics, palette(len(metrics)))), **methods.colours()}


@dataclass
class Bench(SweepOptions):
    """The bench of one model.

    ``per_seq``: every (data, metric, mode, ratio, sequence) point; ``areas``: AOPC per data set, range,
    mode and metric; ``comparisons``: the paired differences (``faith.ladder_comparison``) per data set
    and range; ``curves``: mean curves with intervals (``faith.summarize``); ``aopc_table`` (Table 1),
    ``pair_table`` (Table 2) and ``costs`` (Table 3) as shown; ``common``: the keywords every sweep ran
    with; ``timing``: seconds per data set, ``elapsed`` in all.
    """
    metrics: list
    blocks: dict
    grids: object
    common: dict
    per_seq: pd.DataFrame
    areas: pd.DataFrame
    comparisons: pd.DataFrame
    curves: pd.DataFrame
    aopc_table: pd.DataFrame
    pair_table: pd.DataFrame
    costs: pd.DataFrame
    timing: dict
    elapsed: float
    parameters: dict
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)


def run(lm, tokenizer, *, model: str, datasets, metrics, reference: str, n_sequences: int, seq_len: int,
        batch_size: int, low_ratios, ratios, n_bootstrap: int, seed: int, cache: bool, profile: str,
        dtype: str) -> Bench:
    """Sweep every method on ``n_sequences`` documents (one block of ``seq_len`` tokens each) of each data
    set, over the low and the paper grid, and compare every method with ``reference`` and random."""
    grids = evidence.RatioGrids(low_ratios, ratios)  # the named grids: the low range ends at the top of low_ratios
    grid = grids.ratios
    common = dict(n_bootstrap=n_bootstrap, seed=seed, batch_size=batch_size, max_length=seq_len, progress=False,
                  cache=cache)
    t0 = time.monotonic()
    blocks, parts, timing = {}, [], {}
    for data in datasets:
        blocks[data] = document_blocks(cwcore.load_dataset(data), tokenizer, seq_len, n_sequences, seed=seed)
        t1 = time.monotonic()
        # faith.faithfulness_curve(..., per_sequence=True), taken from data/results/evidence once 2 documents
        # recompute equal
        parts.append(bench_cell(lm, tokenizer, blocks[data], metrics, grid, model=model, data=data, profile=profile,
                                dtype=dtype, **common).assign(data=data))
        timing[data] = time.monotonic() - t1
    per_seq = pd.concat(parts, ignore_index=True)
    pairs = faith.method_pairs(metrics, reference=reference)
    areas, comparisons, curves = [], [], []
    for data, part in per_seq.groupby("data", sort=False):
        part = part.drop(columns="data")
        for rng, r_max in grids.ranges().items():
            kw = dict(n_bootstrap=n_bootstrap, seed=seed, max_ratio=r_max)
            areas.append(faith.aopc(part, **kw).assign(data=data, range=rng))
            comparisons.append(faith.ladder_comparison(part, pairs=pairs, **kw).assign(data=data, range=rng,
                                                                                       protocol="default"))
        curves.append(faith.summarize(part, n_bootstrap=n_bootstrap, seed=seed).assign(data=data))
    areas = pd.concat(areas, ignore_index=True)
    # the registered rule of these secondary rows, as findings.csv judges them: negligible inside the margin
    comparisons = findings.judged_bench(pd.concat(comparisons, ignore_index=True))
    curves = pd.concat(curves, ignore_index=True)
    elapsed = time.monotonic() - t0

    quoted, quoted_md = {}, {}
    n_docs = {d: len(b) for d, b in blocks.items()}
    quoted_md["caption"] = (f"{model}, one block of {seq_len} tokens from each of "
                            + ", ".join(f"{n_docs[d]} `{d}` documents" for d in datasets)
                            + f", ratios {', '.join(f'{r:g}' for r in grid)}, seed {seed}")
    quoted["elapsed"] = elapsed
    # the committed comparisons at the evidence size: every verdict word the page prints comes from them
    committed = findings.load_results(findings.EVIDENCE_DIR, findings.BENCH_CHAPTER, model)
    pair_keys = ["data", "range", "mode", "lower", "higher"]
    judged = None if committed is None else findings.judged_bench(committed.table)  # as findings.csv judges them
    ev_verdict = {} if committed is None else dict(zip(
        map(tuple, judged[pair_keys].astype(str).to_numpy()), judged["verdict"]))
    ev_label = (None if committed is None else
                f"evidence (exploratory sample, {committed.metadata.get('parameters', {}).get('n_documents')} "
                "documents per data set)")
    quoted_md["rerun_label"] = rerun_label(n_docs, profile)
    quoted_md["evidence_label"] = ev_label or "no committed evidence for this model"

    def committed_of(r) -> str | None:
        return ev_verdict.get(tuple(str(getattr(r, k)) for k in pair_keys))

    # Table 1 and the rankings the text quotes
    table1 = aopc_table(areas, ["data", "range", "mode"], metrics, LABELS)
    full = "full" if "full" in set(areas["range"]) else areas["range"].iloc[0]

    def ranked(data, mode):
        part = areas[(areas["data"] == data) & (areas["range"] == full) & (areas["mode"] == mode)]
        part = part.sort_values("aopc_nll", ascending=mode == "sufficiency")
        return ", ".join(f"{LABELS.get(r.metric, r.metric)} "
                         f"{interval_cell(r.aopc_nll, r.aopc_nll_ci_low, r.aopc_nll_ci_high)}"
                         for r in part.itertuples())

    for i, data in enumerate(datasets):
        quoted_md[f"rank_comp_{i}"] = f"`{data}`: " + ranked(data, "comprehensiveness")
        quoted_md[f"rank_suff_{i}"] = f"`{data}`: " + ranked(data, "sufficiency")
    quoted_md["range_name"] = f"`{full}`"

    # Table 2 and the verdicts the text quotes
    comp = comparisons.assign(pair=[f"{LABELS.get(h, h)} vs {LABELS.get(l, l)}"
                                    for l, h in zip(comparisons["lower"], comparisons["higher"])])
    # the rerun's interval and whether it agrees with the evidence's verdict of the same pair (never its own)
    comp["cell"] = [f"{r.difference:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}]; "
                    f"{AGREEMENT_SHORT[rerun_agrees(r.verdict, committed_of(r))]}" for r in comp.itertuples()]
    pair_table = comp.pivot_table(index=["data", "range", "mode"], columns="pair", values="cell", aggfunc="first",
                                  sort=False)
    power = comparisons.groupby(["data", "range", "mode"], sort=False).agg(n=("n", "max"), mde=("mde", "median"))
    pair_table = pair_table.join(power).reset_index().rename(columns={"mde": "mde (median)"})

    def verdicts(data, mode, lower=None, higher=None):
        part = comparisons[(comparisons["data"] == data) & (comparisons["range"] == full)
                           & (comparisons["mode"] == mode)]
        if lower is not None:
            part = part[part["lower"] == lower]
        if higher is not None:
            part = part[part["higher"] == higher]
        return part

    def phrase(rows, who):
        out = []
        for r in rows.itertuples():
            said = committed_of(r)
            out.append(f"{LABELS.get(getattr(r, who), getattr(r, who))} {r.difference:+.3f} "
                       f"[{r.ci_low:+.3f}, {r.ci_high:+.3f}] "
                       + (f"(evidence **{said}**, rerun {AGREEMENT_SHORT[rerun_agrees(r.verdict, said)]})" if said
                          else f"({rerun_direction(r.verdict)})"))
        return "; ".join(out) or "none"

    for i, data in enumerate(datasets):
        for mode, tag in (("comprehensiveness", "comp"), ("sufficiency", "suff")):
            quoted_md[f"ref_{tag}_{i}"] = f"`{data}`: " + phrase(verdicts(data, mode, higher=reference), "lower")
            rows = verdicts(data, mode, lower="random")
            # beating random: by the evidence's verdict where committed, else where the rerun's interval lies
            beat = [LABELS.get(r.higher, r.higher) for r in rows.itertuples()
                    if (committed_of(r) if committed is not None else r.verdict) == "holds"]
            quoted_md[f"random_{tag}_{i}"] = f"`{data}`: " + (", ".join(beat) if beat else "none")
    # where the bench disagrees with the paper's ladder (contribution above every lower rung)
    ladder_lower = [m for m in ("attention", "value_weighted", "value_weighted_output_normalized") if m in metrics]
    # the evidence's verdicts and numbers where committed (this rerun's otherwise, where nothing is)
    decided = (comparisons if committed is None else judged).assign(  # both by the margin rule
        decided=lambda t: t["verdict"])
    where = f" (in the {ev_label})" if committed is not None else f" (in the {quoted_md['rerun_label']})"
    against = decided[(decided["higher"] == reference) & decided["lower"].isin(ladder_lower)
                      & (decided["decided"] == "contradicted")]
    name = LABELS.get(reference, reference)
    quoted_md["reference_name"] = name  # the prose names the reference it was run with (not always contribution)
    # one phrase per list over every data set (the prose quoted the first two by number: one data set left two keys
    # unglued, which fails the book build, and a third was computed and never shown)
    for key in ("rank_comp", "rank_suff", "ref_comp", "ref_suff", "random_comp", "random_suff"):
        quoted_md[key] = "; ".join(quoted_md[f"{key}_{i}"] for i in range(len(datasets)))
    quoted_md["ladder_contradicted"] = (
        "; ".join(f"{LABELS[r.lower]} over {name} ({r.data}, {r.range}, {r.mode}, "
                  f"{r.difference:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}])"
                  for r in against.itertuples()) or "none of the ladder's steps") + where
    beaten = decided[(decided["higher"] == reference) & ~decided["lower"].isin(ladder_lower + ["random"])
                     & (decided["decided"] == "contradicted")]
    quoted_md["reference_beaten"] = (
        "; ".join(f"{LABELS.get(r.lower, r.lower)} ({r.data}, {r.range}, {r.mode}, "
                  f"{r.difference:+.3f} [{r.ci_low:+.3f}, {r.ci_high:+.3f}])"
                  for r in beaten.itertuples()) or "no method") + where
    counts = comparisons["verdict"].value_counts()  # the rerun's: said by where the intervals lie
    quoted_md["verdict_counts"] = ", ".join(f"{int(counts.get(v, 0))} {RERUN_DIRECTION[v]}"
                                            for v in ("holds", "contradicted", "negligible", "inconclusive",
                                                      "not measured"))
    quoted["mde_median"] = float(comparisons["mde"].median())
    quoted["n_docs"] = int(comparisons["n"].max())

    costs = pd.DataFrame([{"method": name, "needs": ", ".join(sorted(methods.get_method(name).needs)) or "-",
                           "cost per batch": methods.get_method(name).cost or "no extra forward"}
                          for name in metrics])
    # the documents each data set really gave (a short local file gives fewer than asked for)
    parameters = dict(data=",".join(datasets), n_documents=min(len(blocks[d]) for d in datasets), seq_len=seq_len,
                      ratios=grid,
                      metrics=",".join(metrics), reference=reference, n_bootstrap=n_bootstrap, seed=seed,
                      dtype=dtype)
    return Bench(list(metrics), blocks, grids, common, per_seq, areas, comparisons, curves, table1, pair_table,
                 costs, timing, elapsed, parameters, quoted, quoted_md)


def save_results(results_file, bench: Bench, *, model: str, profile: str) -> None:
    """Write the comparisons to ``results_file``, where the findings page reads them."""
    findings.save_results(results_file, bench.comparisons, chapter="04b_attribution_bench", model=model,
                          profile=profile, parameters=bench.parameters)


def committed_answer(model: str, evidence_dir=None):
    """The page's answer from the committed bench (evidence size): ``(markdown, figure or None)``, the markdown
    one bullet per method compared with contribution weights (per mode, how many of its cells, data set x
    ratio range, hold or are contradicted) and one on the random control, the figure the paired comparisons
    as a forest (:func:`cwbook.forests.bench_forest`)."""
    from cwbook.forests import bench_forest

    committed = findings.load_results(evidence_dir or findings.EVIDENCE_DIR, findings.BENCH_CHAPTER, model)
    if committed is None:
        return ("no bench is committed for this model (`data/results/evidence/04b_attribution_bench/`): the "
                "numbers below are this build's own, too few documents to decide"), None
    # judged by the registered rule of these secondary rows, as findings.csv judges them (negligible inside the margin)
    table, ran = findings.judged_bench(committed.table), committed.metadata.get("parameters", {})

    def counted(rows) -> str:
        said = [f"{int((rows['verdict'] == v).sum())} {v}" for v in ("holds", "contradicted", "negligible",
                                                                      "inconclusive", "not measured")
                if (rows["verdict"] == v).any()]
        return ", ".join(said) + f" of {len(rows)}"

    reference = str(ran.get("reference", "contribution"))
    lines = [f"Committed: {ran.get('n_documents', '?')} documents per data set "
             f"({', '.join(str(ran.get('data', '')).split(','))}), signed importance; a cell is one data set and "
             f"ratio range, its verdict the paired AOPC difference's 95% interval against 0 and the 0.01-nat margin, "
             f"unadjusted (exploratory). "
             f"Is {'contribution weights' if reference == 'contribution' else LABELS.get(reference, reference)} "
             f"more faithful than ...?"]
    against = table[(table["higher"] == reference) & (table["lower"] != "random")]
    for method, rows in against.groupby("lower", sort=False):
        per_mode = "; ".join(f"{mode}: {counted(part)}" for mode, part in rows.groupby("mode", sort=False))
        lines.append(f"- {LABELS.get(method, method)}: {per_mode}")
    control = table[table["lower"] == "random"]
    beaten = [m for m, rows in control.groupby("higher", sort=False) if (rows["verdict"] == "holds").all()]
    lines.append(f"- *Every method against the random ranking*: {len(beaten)} of {control['higher'].nunique()} "
                 f"beat it in every cell" + (f" (not: {', '.join(LABELS.get(m, m) for m in sorted(set(control['higher']) - set(beaten)))})"
                                            if len(beaten) < control["higher"].nunique() else "") + ".")
    figure = bench_forest(table, title=f"{model}: the bench at the evidence size", labels=LABELS)
    return "\n".join(lines), figure


def evidence_size(bench: Bench, *, model: str, profile: str) -> str:
    """The committed comparisons at the evidence size beside this page's, in markdown for the prose (their
    forest is :func:`committed_answer`'s figure)."""
    comparisons = bench.comparisons
    committed_bench = findings.load_results(findings.EVIDENCE_DIR, findings.BENCH_CHAPTER, model)
    if profile == "evidence":
        return ("This page was built with the `evidence` profile: Table 2 *is* the evidence, "
                "so nothing is set beside it.")
    if committed_bench is None:
        return ("No bench table is committed for this model (`data/results/evidence/"
                "04b_attribution_bench/`), so there is no figure here.")
    ev = findings.judged_bench(committed_bench.table)  # by the registered margin rule, as findings.csv judges them
    ran = committed_bench.metadata.get("parameters", {})
    keys = ["data", "range", "mode", "lower", "higher"]
    both = comparisons.merge(ev, on=keys, suffixes=("", "_ev"))
    decisive = ["holds", "contradicted"]
    decided = both[(both["verdict"] == "inconclusive") & both["verdict_ev"].isin(decisive)]
    flipped = both[both["verdict"].isin(decisive) & both["verdict_ev"].isin(decisive)
                   & (both["verdict"] != both["verdict_ev"])]
    counts = ev["verdict"].value_counts()
    note = (f"Committed: {ran.get('n_documents', '?')} documents of "
            + ", ".join(f"`{d}`" for d in str(ran.get("data", "")).split(",") if d)
            + f", blocks of {ran.get('seq_len', '?')} tokens, ratios "
              f"{', '.join(f'{r:g}' for r in ran.get('ratios', []))}: "
            + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in ("holds", "contradicted", "negligible",
                                                                  "inconclusive", "not measured"))
            + f". Of the {len(both)} comparisons made at both sizes, "
              f"{int((both['verdict'] == both['verdict_ev']).sum())} "
            f"get the same verdict; {len(decided)} that are inconclusive on this page are decided at the evidence "
            f"size, and {len(flipped)} decided ones change side.")
    return note


def curves_figure(bench: Bench, datasets, model: str):
    """Figure 1: comprehensiveness and sufficiency curves of every method, one row per data set."""
    curves, metrics, low_max = bench.curves, bench.metrics, bench.grids.low_max
    colour = colours(metrics)
    fig, axes = plt.subplots(len(datasets), 2, figsize=(11, 3.8 * len(datasets)), squeeze=False,
                             constrained_layout=True)
    for row, data in enumerate(datasets):
        for ax, mode in zip(axes[row], ("comprehensiveness", "sufficiency")):
            part = curves[(curves["data"] == data) & (curves["mode"] == mode)]
            for metric in metrics:
                m = part[part["metric"] == metric].sort_values("ratio")
                style = (":" if metric == "random" else "-" if metric in evidence.SIGN_INVARIANT + ("contribution",)
                         else "--")
                ax.plot(m["ratio"], m["delta_nll"], style, marker="o", ms=3, color=colour[metric],
                        label=LABELS.get(metric, metric))
                ax.fill_between(m["ratio"], m["nll_ci_low"], m["nll_ci_high"], color=colour[metric], alpha=0.12,
                                lw=0)
            ax.set_xscale("log")
            ax.axvline(low_max, color="grey", lw=0.8, ls=":")
            ax.set_xlabel("fraction of terms removed $r$ (log scale)")
            ax.set_ylabel(r"$\Delta \log$ PPL")
            ax.set_title(f"{mode} ({data})")
    axes[0, 0].legend(fontsize=7, loc="upper left", ncol=2)
    fig.suptitle(f"{model}: the ladder and five attribution methods on the same interventions", fontweight="bold")
    return fig
