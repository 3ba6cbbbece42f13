"""Code the chapters share: the contribution maps of one sentence and the factors figure (chapters 3 and
8), and the tables of the faithfulness chapters (4 and 4b)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from cwcore.plotting import contribution_heatmap, layer_axis, legend_below, plain_log


def maps_head_figure(alpha_map, intra_map, inter_map, tokens, title: str):
    """The paper's Figure 1 for one head: (a) attention, (b) intra-head contribution weights on the same
    colour scale, (c) inter-head ones on their own scale, (d) the difference (b) - (a).

    Each map is ``[query, key]`` (NaN where a query cannot see a key: drawn grey); ``tokens`` label both
    axes; ``title`` goes above the four panels.
    """
    fig, axes = plt.subplots(2, 2, figsize=(11, 10.5), constrained_layout=True)
    shared = np.nanmax(np.abs(np.r_[alpha_map.ravel(), intra_map.ravel()]))
    panels = [
        (alpha_map, r"(a) attention $\alpha^h_{ij}$", shared),
        (intra_map, r"(b) intra-head $c^h_{ij}$ (against $o^h_i$)", shared),
        (inter_map, r"(c) inter-head $c^h_{ij}$ (against $o_i$)", None),
        (intra_map - alpha_map, r"(d) difference (b) $-$ (a)", None),
    ]
    for ax, (weights, panel_title, scale) in zip(axes.ravel(), panels):
        contribution_heatmap(ax, weights, tokens, panel_title,
                             vmin=None if scale is None else -scale, vmax=scale)
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
        image = contribution_heatmap(ax, weights, tokens, panel_title, vmin=-shared,
                                     vmax=shared, colorbar=False)
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
    norm, alignment) per layer, one line per key group.

    ``factors``: :func:`cwbook.analysis.collect`'s sampled terms (columns ``layer``, ``group`` and the
    three factors); ``kind``: ``"intra"`` or ``"inter"`` (the output the factors are measured against);
    ``groups``: ``(group, label, colour)`` triples, those absent from ``factors`` left out.
    """
    quantiles = (factors.groupby(["layer", "group"])[FACTOR_COLUMNS]
                 .quantile([0.25, 0.5, 0.75]).unstack(-1))
    out = "o^h_i" if kind == "intra" else "o_i"
    labels = [r"attention $\alpha_{ij}$",
              rf"relative norm $\|\tilde v_j\| / \|{out}\|$",
              rf"alignment $\cos({out}, \tilde v_j)$"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True,
                             constrained_layout=True)
    present = set(quantiles.index.get_level_values("group"))
    for ax, column, label in zip(axes, FACTOR_COLUMNS, labels):
        for group, name, colour in groups:
            if group in present:
                part = quantiles.xs(group, level="group")[column]
                ax.plot(part.index, part[0.5], color=colour, lw=2, label=name)
                ax.fill_between(part.index, part[0.25], part[0.75], color=colour,
                                alpha=band_alpha, lw=0)
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
