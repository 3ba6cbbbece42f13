"""Code the chapters share: the sentence maps, the per-layer statistics and the factors figure (chapters 3
and 8), the tables of the faithfulness chapters (4 and 4b), and the labels of every chapter's rerun check
(4-7): this build's own small-sample numbers, described by where their intervals lie, never by a verdict
word."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

import cwcore
from cwbook import analysis
from cwcore import stats
from cwcore.cache import caching
from cwcore.core.architectures import decomposable_layers, input_device
from cwcore.plotting import contribution_heatmap, layer_axis, legend_below, palette, plain_log

COLOURS = palette(10)
ATTN, INTRA, INTER, OTHER = (COLOURS[i] for i in (0, 1, 2, 7))
#: the three views of the per-layer statistics: (view, label, colour)
VIEWS = [("intra", "intra-head, per head", INTRA),
         ("inter", "inter-head, per head", INTER),
         ("token", "inter-head, per token", ATTN)]


@dataclass
class SentenceMaps:
    """One sentence decomposed in every layer (``d``), and the maps of the layer and head shown:
    ``alpha_map``, ``intra_map``, ``inter_map`` ``[query, key]`` of the head (NaN where a query cannot see a
    key); ``token_attention`` (mean over heads), ``token_contribution`` (inter-head, sum over heads)
    ``[query, key]`` of the layer; chapter 3's ``row``: the last query's (``query``) weights and factors, per key."""
    inputs: dict
    tokens: list
    layers: list
    d: object
    layer_shown: int
    head_shown: int
    n_heads: int
    alpha_map: np.ndarray = None
    intra_map: np.ndarray = None
    inter_map: np.ndarray = None
    token_attention: np.ndarray = None
    token_contribution: np.ndarray = None
    row: pd.DataFrame | None = None
    query: int | None = None
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)

    @property
    def L(self):
        """The decomposition of the layer shown."""
        return self.d[self.layer_shown]


#: the attention each chapter of sentence maps is written for: chapter 3 reads each query's keys 0..i, chapter 8
#: an encoder's keys on both sides of the query
CAUSAL = {"chapter 3": True, "chapter 8": False}


def require_attention_kind(d, chapter: str) -> None:
    """Refuse a decomposition ``d`` whose attention is not the kind ``chapter`` (a key of :data:`CAUSAL`) is
    written for, measured on the probabilities the model applied (``[batch, head, query, key]`` per layer): its
    prose, grey cells and first-token statistics would describe another kind of model."""
    from cwcore.cli import UsageError
    from cwcore.core.architectures import later_attention

    later = {layer: float(later_attention(d[layer].attention.nan_to_num(0.0)).max()) for layer in d.layers}
    attends_later = max(later.values(), default=0.0) > 0
    if CAUSAL[chapter] and attends_later:
        layer = max(later, key=later.get)
        raise UsageError(f"{chapter} is written for causal decoders: layer {layer} of this model attends to later keys "
                         f"(up to {later[layer]:.3g} of a query's attention lies above the diagonal); chapter 8 "
                         "treats encoders")
    if not CAUSAL[chapter] and not attends_later:
        raise UsageError(f"{chapter} is written for encoders: no query of this model attends to a later key in any "
                         "of its layers (a causal decoder); chapter 3 treats decoders")


def decompose_sentence(model, tokenizer, text: str, layer: int | None, head: int | None, gap, *,
                       chapter: str) -> SentenceMaps:
    """Decompose ``text`` in every layer and pick the layer (``layer``, or the middle one) and the head
    (``head``, or the argmax of ``gap(L, tokens)``: one value per head of the layer's decomposition ``L``).
    ``chapter``: ``"chapter 3"`` or ``"chapter 8"``, whose kind of model (:data:`CAUSAL`) is required."""
    from cwcore.tokens import token_labels

    from cwcore.cli import UsageError

    layers = decomposable_layers(model)  # never a block cwcore numbers but cannot decompose
    if layer is not None and not -len(layers) <= layer < len(layers):  # it wrapped around: layer 5 of 3 showed 2
        raise UsageError(f"layer={layer}: the model has {len(layers)} decomposable layers (-{len(layers)} to "
                         f"{len(layers) - 1}, negative from the end)")
    inputs = tokenizer(text, return_tensors="pt").to(input_device(model))
    if inputs["input_ids"].shape[-1] < 2:  # a map of one token has no pair to compare, its argmin no element
        raise UsageError(f"text={text!r} is {inputs['input_ids'].shape[-1]} token(s) long: the maps need at least 2")
    tokens = token_labels(tokenizer, inputs["input_ids"][0])
    d = cwcore.decompose(model, **inputs)  # every layer of one forward pass
    require_attention_kind(d, chapter)
    layer_shown = layers[len(layers) // 2 if layer is None else layer]
    n_heads = d[layer_shown].attention.shape[1]
    if head is not None and not -n_heads <= head < n_heads:
        raise UsageError(f"head={head}: layer {layer_shown} has {n_heads} heads (-{n_heads} to {n_heads - 1})")
    head_shown = int(gap(d[layer_shown], tokens).argmax()) if head is None else head % n_heads
    return SentenceMaps(inputs, tokens, layers, d, layer_shown, head_shown, n_heads)


@dataclass
class Statistics:
    """Per-layer statistics over real text: ``stats`` (per sequence), ``factors`` (sampled terms and their
    three factors), ``summary`` (means and bootstrap intervals per layer, statistic, view and group:
    :func:`cwbook.analysis.summarize`), the ``seconds`` the collection took; the sample: chapter 3's
    ``blocks``, chapter 8's ``documents``, ``batches``, ``key_groups`` and ``lengths [document]``."""
    stats: pd.DataFrame
    factors: pd.DataFrame
    summary: pd.DataFrame
    seconds: float
    n_layers: int
    blocks: dict | None = None
    documents: list | None = None
    batches: list | None = None
    key_groups: object = None
    lengths: object = None
    quoted: dict = field(default_factory=dict)
    quoted_md: dict = field(default_factory=dict)


#: the tokens of the first sequence whose attention decides the model's kind (:func:`require_attention_kind`):
#: any query of an encoder attends to later keys, so a few tokens decide it at a fraction of a sequence's forward
KIND_PROBE_TOKENS = 16


def _kind_probe(batch: dict) -> dict:
    """The first :data:`KIND_PROBE_TOKENS` real tokens of ``batch``'s first sequence, unpadded (``[1, tokens]`` for
    every per-token input: ids, token types, the mask), where the kind check runs."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    real = torch.arange(ids.shape[1], device=ids.device) if mask is None else mask[0].nonzero()[:, 0]
    real = real[:KIND_PROBE_TOKENS]
    return {name: value[:1, real] if torch.is_tensor(value) and value.shape[:2] == ids.shape[:2] else value[:1]
            for name, value in batch.items()}


def collect_statistics(model, model_inputs, *, chapter: str, seq_len: int, kind: str, min_keys: int,
                       rank_min_keys: int, factor_samples: int, n_bootstrap: int, seed: int, cache: bool,
                       key_groups=None, **sample) -> Statistics:
    """:func:`cwbook.analysis.collect` over the batches ``model_inputs`` (sequences of at most ``seq_len`` tokens)
    and :func:`cwbook.analysis.summarize`, cached when ``cache``; ``sample`` fills the :class:`Statistics` fields
    that describe the sample. Sizes that leave a quoted number without data are refused in one line, and so is a
    model of the other kind than ``chapter``'s (:func:`require_attention_kind`, on :func:`_kind_probe`'s tokens)."""
    from cwcore.cli import UsageError
    from cwcore.core.inputs import check_count

    model_inputs = list(model_inputs)
    n_sequences = sum(len(batch["input_ids"]) for batch in model_inputs)
    if n_sequences < 2:  # one sequence printed "nan to nan" as every interval
        raise UsageError(f"{n_sequences} sequence(s): the per-layer intervals are bootstraps over sequences and "
                         "need at least 2 (n_sequences)")
    check_count(n_bootstrap, "n_bootstrap")
    check_count(factor_samples, "factor_samples")  # the factor medians and their figure read the sampled terms
    check_count(seq_len, "seq_len", minimum=2)
    for name, value in (("min_keys", min_keys), ("rank_min_keys", rank_min_keys)):
        if check_count(value, name, minimum=0) > seq_len:
            raise UsageError(f"{name}={value}: no query of a {seq_len}-token sequence sees that many keys "
                             f"(seq_len={seq_len}), so its statistics would have no rows")
    require_attention_kind(cwcore.decompose(model, layers=decomposable_layers(model), **_kind_probe(model_inputs[0])),
                           chapter)
    t0 = time.monotonic()
    with caching(enabled=cache):
        stats, factors = analysis.collect(model, model_inputs, key_groups=key_groups, kind=kind, min_keys=min_keys,
                                          rank_min_keys=rank_min_keys, factor_samples=factor_samples, seed=seed)
    summary = analysis.summarize(stats, n_bootstrap=n_bootstrap, seed=seed)
    return Statistics(stats, factors, summary, time.monotonic() - t0, len(decomposable_layers(model)),
                      key_groups=key_groups, **sample)


def maps_head_figure(alpha_map, intra_map, inter_map, tokens, title: str):
    """The paper's Figure 1 for one head: (a) attention, (b) intra-head contribution weights on the same
    colour scale, (c) inter-head ones on their own scale, (d) the difference (b) - (a); each map
    ``[query, key]``, NaN (grey) where a query cannot see a key."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 10.5), constrained_layout=True)
    shared = np.nanmax(np.abs(np.r_[alpha_map.ravel(), intra_map.ravel()]))
    panels = [
        (alpha_map, r"(a) attention $\alpha^h_{ij}$", shared),
        (intra_map, r"(b) intra-head $c^h_{ij}$ (against $o^h_i$)", shared),
        (inter_map, r"(c) inter-head $c^h_{ij}$ (against $o_i$)", None),
        (intra_map - alpha_map, r"(d) difference (b) $-$ (a)", None),
    ]
    for ax, (weights, panel_title, scale) in zip(axes.ravel(), panels):
        contribution_heatmap(ax, weights, tokens, panel_title, vmin=None if scale is None else -scale, vmax=scale)
    for ax in axes.ravel():
        ax.tick_params(labelsize=9)
    for ax in axes[0]:
        ax.set_xlabel("")
    for ax in axes[:, 1]:
        ax.set_ylabel("")
    fig.suptitle(title, fontweight="bold")
    return fig


def maps_layer_figure(token_attention, token_contribution, tokens, title: str):
    """A whole layer at token level, ``[query, key]`` each: attention averaged over heads (left) and
    inter-head contribution weights summed over heads (right), on one colour scale."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.4), constrained_layout=True)
    both = np.r_[token_attention.ravel(), token_contribution.ravel()]
    shared = np.nanmax(np.abs(both))
    for ax, weights, panel_title in [
            (axes[0], token_attention, "attention, mean over heads"),
            (axes[1], token_contribution, "inter-head contribution, sum")]:
        image = contribution_heatmap(ax, weights, tokens, panel_title, vmin=-shared, vmax=shared, colorbar=False)
    fig.colorbar(image, ax=axes, fraction=0.03, pad=0.02)
    axes[1].set_ylabel("")
    for ax in axes:
        ax.tick_params(labelsize=9)
    fig.suptitle(title, fontweight="bold")
    return fig


FACTOR_COLUMNS = ["attention", "relative_norm", "cosine"]


def factors_figure(factors, kind: str, groups, title: str, *, band_alpha: float = 0.25,
                   n_layers: int | None = None, ncols: int = 3):
    """Median and interquartile range of the three factors of contribution weights (attention, relative
    norm, alignment) per layer, one line per ``(group, label, colour)`` of ``groups`` present in ``factors``
    (:func:`cwbook.analysis.collect`'s sampled terms); ``kind``: ``"intra"`` or ``"inter"``."""
    quantiles = (factors.groupby(["layer", "group"])[FACTOR_COLUMNS].quantile([0.25, 0.5, 0.75]).unstack(-1))
    out = "o^h_i" if kind == "intra" else "o_i"
    labels = [r"attention $\alpha_{ij}$", rf"relative norm $\|\tilde v_j\| / \|{out}\|$",
              rf"alignment $\cos({out}, \tilde v_j)$"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True, constrained_layout=True)
    present = set(quantiles.index.get_level_values("group"))
    for ax, column, label in zip(axes, FACTOR_COLUMNS, labels):
        for group, name, colour in groups:
            if group in present:
                part = quantiles.xs(group, level="group")[column]
                ax.plot(part.index, part[0.5], color=colour, lw=2, label=name)
                ax.fill_between(part.index, part[0.25], part[0.75], color=colour, alpha=band_alpha, lw=0)
        ax.set_ylabel(label)
    plain_log(axes[0])
    plain_log(axes[1])
    axes[2].axhline(0, color="black", lw=0.8)
    axes[2].set_ylim(-1, 1)
    layer_axis(axes[2], n_layers)
    legend_below(fig, axes[0], ncols=ncols)
    axes[0].set_title(title, fontsize=12)
    return fig


def explorer_page(model, tokenizer, text: str, model_name: str, layer: int, head: int) -> str:
    """Every layer and head of ``text`` in one offline page (no network: the script and the numbers are
    inside it), opened at ``layer`` and ``head`` on the intra-head weights; the figures stay for print."""
    from cwcore.explorer import explorer_data, explorer_html

    return explorer_html(explorer_data(model, tokenizer, text, model_name=model_name),
                         start={"layer": layer, "head": head, "quantity": "intra"})


# --- the faithfulness chapters' tables (4 and 4b) -------------------------------------------------------

def interval_span(low, high, fmt=lambda x: f"{x:.2f}") -> str | None:
    """``"low to high"`` with ``fmt`` applied to each end, or None where either end is not finite (an interval
    that could not be computed, e.g. too few layers of a type to resample): the caller says so in its words."""
    import math

    return f"{fmt(low)} to {fmt(high)}" if math.isfinite(low) and math.isfinite(high) else None


def interval_cell(value, low, high) -> str:
    """``value [low, high]`` with three decimals: an estimate and its interval in one table cell."""
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def aopc_table(areas, index: list[str], metrics, labels):
    """AOPC per metric with its interval, one column per metric (in ``metrics``' order, named by
    ``labels``), one row per ``index`` combination (``faith.aopc``'s ``aopc_nll``, ``aopc_nll_ci_low``
    and ``aopc_nll_ci_high`` columns)."""
    a = areas.assign(cell=[interval_cell(v, lo, hi) for v, lo, hi in
                           zip(areas["aopc_nll"], areas["aopc_nll_ci_low"], areas["aopc_nll_ci_high"])])
    table = a.pivot_table(index=index, columns="metric", values="cell", aggfunc="first", sort=False)
    return table[[m for m in metrics if m in table.columns]].rename(columns=labels).reset_index()


class SweepOptions:
    """Chapters 4 and 4b's results: ``options`` reads the library's keywords out of their ``common``."""

    common: dict

    @property
    def options(self) -> dict:
        """The library's keywords the sweeps ran with (``common`` less the book's ``cache`` switch), for a
        reader's own :func:`cwcore.faithfulness.faithfulness_curve` call."""
        return {k: v for k, v in self.common.items() if k != "cache"}


# --- the rerun check: this build's small-sample numbers, labelled, never read as verdicts -------------------------
#
# A chapter's verdicts come from the committed evidence-size tables; what a default build computes itself is a
# rerun check at its own (small) size, one seed, no multiplicity adjustment. Its intervals are described by where
# they lie, never in the verdict vocabulary of cwcore.stats, so a reader cannot take a rerun for a verdict.

#: where a rerun's interval lies, by the verdict cwcore.stats.verdict gives it (no verdict word in any)
RERUN_DIRECTION = {stats.HOLDS: "interval on the claimed side", stats.CONTRADICTED: "interval on the opposite side",
                   stats.INCONCLUSIVE: "interval straddles the threshold",
                   stats.NEGLIGIBLE: "interval inside the margin", stats.NOT_MEASURED: "no interval"}
#: the same for a claim of several parts (cwcore.stats.combine_verdicts / combine_all of the parts)
RERUN_CLAIM_DIRECTION = {stats.HOLDS: "every part on the claimed side",
                         stats.CONTRADICTED: "a part on the opposite side",
                         stats.INCONCLUSIVE: "a part straddles its threshold",
                         stats.NEGLIGIBLE: "every part inside its margin", stats.NOT_MEASURED: "no interval"}
#: the words a rerun's text must not use unlabelled (the verdicts of cwcore.stats that decide a claim)
VERDICT_WORDS = (stats.HOLDS, stats.CONTRADICTED, stats.INCONCLUSIVE, stats.NEGLIGIBLE)
#: the rerun-agreement answers (column "rerun agrees with the evidence?")
AGREES, TOO_SMALL, DIFFERS, NO_EVIDENCE = ("yes", "too few documents to tell", "no", "no committed verdict")


#: a rerun's agreement with the evidence, as a verb phrase for the prose
AGREEMENT_SAID = {AGREES: "agrees", TOO_SMALL: "has too few documents to tell", DIFFERS: "differs",
                  NO_EVIDENCE: "has no committed verdict to compare with"}
#: ... and as a short table cell
AGREEMENT_SHORT = {AGREES: "agrees", TOO_SMALL: "too few to tell", DIFFERS: "differs", NO_EVIDENCE: "no evidence"}


def documents_text(counts) -> str:
    """``"6 documents per data set"`` from the documents each data set ran on (``{data: n}`` or a list of
    counts); ``"6 and 8 documents (gsm8k, web-text)"`` where they differ."""
    counts = dict(counts) if isinstance(counts, dict) else {i: n for i, n in enumerate(counts)}
    sizes = sorted({int(n) for n in counts.values()})
    if len(sizes) == 1:
        return f"{sizes[0]} document{'s' if sizes[0] != 1 else ''} per data set"
    return (" and ".join(str(int(n)) for n in counts.values()) + " documents ("
            + ", ".join(str(d) for d in counts) + ")")


def rerun_label(counts, profile: str | None = None) -> str:
    """The label every number of this build's own run carries: ``"rerun check (6 documents per data set, one
    seed, no adjustment)"``, from the documents it really ran on (see :func:`documents_text`). Under the
    ``evidence`` profile the build's own run is the evidence build itself, not a check of it:
    ``"evidence build (64 documents per data set, one seed, no adjustment)"``."""
    what = "evidence build" if profile == "evidence" else "rerun check"
    return f"{what} ({documents_text(counts)}, one seed, no adjustment)"


def _base(verdict) -> str:
    # "not measured: no sink heads" -> "not measured"; anything outside the vocabulary -> not measured
    text = str(verdict) if isinstance(verdict, str) else stats.NOT_MEASURED
    for v in stats.VERDICTS:
        if text == v or text.startswith(v + ":"):
            return v
    return stats.NOT_MEASURED


def rerun_direction(verdict, *, claim: bool = False) -> str:
    """Where a rerun's interval lies (:data:`RERUN_DIRECTION`), given the verdict the rule gives it; with
    ``claim``, for a claim of several parts (:data:`RERUN_CLAIM_DIRECTION`). A "not measured: why" is said as
    it is: the reason is a fact about the run (no sink heads), not a verdict on the claim."""
    base = _base(verdict)
    said = (RERUN_CLAIM_DIRECTION if claim else RERUN_DIRECTION)[base]
    why = str(verdict).partition(":")[2].strip() if base == stats.NOT_MEASURED and isinstance(verdict, str) else ""
    return f"{stats.NOT_MEASURED}: {why}" if why else said


def rerun_agrees(rerun_verdict, evidence_verdict) -> str:
    """Whether a rerun agrees with the committed evidence on one part or claim: :data:`AGREES` when both give
    the same verdict, :data:`TOO_SMALL` when the rerun's interval decides nothing (it straddles the threshold,
    or there is none) and the evidence's does, :data:`DIFFERS` otherwise, :data:`NO_EVIDENCE` when the evidence
    has no verdict for it (nothing committed, or not measured there)."""
    rerun, evidence = _base(rerun_verdict), _base(evidence_verdict)
    if evidence_verdict is None or (isinstance(evidence_verdict, float) and np.isnan(evidence_verdict)) \
            or evidence == stats.NOT_MEASURED:
        return NO_EVIDENCE
    if rerun == evidence:
        return AGREES
    if rerun in (stats.INCONCLUSIVE, stats.NOT_MEASURED):
        return TOO_SMALL
    return DIFFERS


def unlabelled_verdicts(text: str) -> list[str]:
    """The verdict words (:data:`VERDICT_WORDS`) a rerun's ``text`` uses: what a rerun-check section must
    not say (tests scan every rerun text and column a chapter generates with it)."""
    import re

    return [w for w in VERDICT_WORDS if re.search(rf"\b{w}\b", str(text), flags=re.I)]
