"""One plotting style for the book, the notebooks and ``cwcore explain``: :func:`set_style` (seaborn,
colour-blind-safe), :func:`save_figure` (PNG and SVG, atomically), :func:`contribution_heatmap` (a
[query, key] matrix on a zero-centred diverging map: negative contributions blue, positive red),
per-layer figures (:func:`per_layer`, :func:`band`, :func:`layer_axis`) and the ladder's forest plot
(:func:`ladder_forest`). Importing it loads neither torch nor seaborn."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib.colors as mcolors
import numpy as np

from .cache import atomic_write_bytes

PALETTE_NAME = "colorblind"
DIVERGING_NAME = "vlag"  # seaborn's blue-white-red map; perceptually balanced, safe for red-green CVD
BAD_COLOUR = "#d9d9d9"  # cells that are undefined (NaN), e.g. keys after the query in a causal model


def set_style(context: str = "notebook") -> None:
    """Apply the project's one plotting style (seaborn whitegrid + the ``colorblind`` palette)."""
    import matplotlib as mpl
    import seaborn as sns

    sns.set_theme(context=context, style="whitegrid", palette=PALETTE_NAME)
    mpl.rcParams.update(
        {
            "figure.figsize": (6.4, 4.0),
            "figure.dpi": 110,
            "savefig.dpi": 150,
            "savefig.bbox": "tight",
            "axes.spines.top": False,
            "axes.spines.right": False,
            "axes.titleweight": "bold",
            "image.cmap": "viridis",
        }
    )


def palette(n: int | None = None) -> list[tuple[float, float, float]]:
    """The project's categorical colours (seaborn ``colorblind``), ``n`` of them (cycled)."""
    import seaborn as sns

    return list(sns.color_palette(PALETTE_NAME, n))


FIGURE_FORMATS = ("png", "svg")  # what save_figure writes by default: a bitmap and a vector file, for slides


def save_figure(fig, output_dir: str | os.PathLike, name: str, formats: Sequence[str] = FIGURE_FORMATS,
                dpi: int | None = None) -> Path:
    """Save ``fig`` as ``output_dir/name.<fmt>`` for each format, each atomically, and return the first path.
    The SVG is reproducible (no date, fixed ids). The book copies a chapter's figure files into the built book."""
    import matplotlib as mpl

    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"figure name must be a plain file name without a directory: {name!r}")
    if not formats:
        raise ValueError("at least one format is needed")
    paths = []
    for fmt in formats:
        fmt = fmt.lower().lstrip(".")
        buffer = io.BytesIO()
        metadata = {"Date": None} if fmt in ("svg", "pdf") else None
        with mpl.rc_context({"svg.hashsalt": f"cwcore-{name}"}):
            fig.savefig(buffer, format=fmt, dpi=dpi, metadata=metadata)
        paths.append(Path(output_dir) / f"{name}.{fmt}")
        atomic_write_bytes(paths[-1], buffer.getvalue())
    return paths[0]


def diverging_cmap() -> mcolors.Colormap:
    """The diverging colour map of contribution heatmaps; NaN cells are drawn light grey."""
    import seaborn as sns

    return sns.color_palette(DIVERGING_NAME, as_cmap=True).with_extremes(bad=BAD_COLOUR)


def centred_norm(values, vmin: float | None = None, vmax: float | None = None) -> mcolors.TwoSlopeNorm:
    """A norm symmetric about 0 over ``[-m, m]``, ``m`` the largest ``|value|``, so -0.03 beside +0.9 stays
    faint; ``vmin``/``vmax`` share one scale between panels."""
    arr = np.asarray(values, dtype=float)
    finite = arr[np.isfinite(arr)]
    largest = float(np.abs(finite).max()) if finite.size else 1.0
    lo = -largest if vmin is None else float(vmin)
    hi = largest if vmax is None else float(vmax)
    span = max(abs(lo), abs(hi), 1e-12)
    return mcolors.TwoSlopeNorm(vmin=min(lo, -1e-3 * span), vcenter=0.0, vmax=max(hi, 1e-3 * span))


def _label(token) -> str:
    """A token as a tick label: visible whitespace, no accidental matplotlib mathtext."""
    s = str(token).replace("\n", "\\n").replace("\t", "\\t").replace("$", r"\$")
    return s.replace(" ", "\u2423") if s.strip() == "" or s.startswith(" ") else s


def contribution_heatmap(ax, weights, tokens: Sequence, title: str | None = None, *,
                         key_tokens: Sequence | None = None, vmin: float | None = None,
                         vmax: float | None = None, colorbar: bool = True, annotate: bool | None = None,
                         fmt: str = ".2f", max_labels: int = 40):
    """Draw a [query, key] weight matrix on ``ax`` with a zero-centred diverging colour map (NaN grey);
    ``tokens`` label rows and, without ``key_tokens``, columns; ``annotate`` writes values (default up to
    12x12). Returns the ``AxesImage``."""
    w = np.asarray(weights, dtype=float)
    if w.ndim != 2:
        raise ValueError(f"weights must be a [query, key] matrix, got shape {w.shape}")
    keys = list(tokens if key_tokens is None else key_tokens)
    queries = list(tokens)
    if len(queries) != w.shape[0] or len(keys) != w.shape[1]:
        raise ValueError(f"{len(queries)} query and {len(keys)} key labels for a matrix of shape {w.shape}")

    norm = centred_norm(w, vmin, vmax)
    image = ax.imshow(np.ma.masked_invalid(w), cmap=diverging_cmap(), norm=norm, aspect="auto",
                      interpolation="nearest")
    step_q = max(1, -(-len(queries) // max_labels))
    step_k = max(1, -(-len(keys) // max_labels))
    ax.set_yticks(range(0, len(queries), step_q), [_label(t) for t in queries[::step_q]])
    ax.set_xticks(range(0, len(keys), step_k), [_label(t) for t in keys[::step_k]], rotation=60,
                  ha="right", rotation_mode="anchor")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.grid(False)
    if title:
        ax.set_title(title)
    if annotate is None:
        annotate = w.shape[0] <= 12 and w.shape[1] <= 12
    if annotate:
        for (q, k), value in np.ndenumerate(w):
            if np.isfinite(value):
                strong = abs(norm(value) - 0.5) > 0.3
                ax.text(k, q, format(value, fmt), ha="center", va="center", fontsize=8,
                        color="white" if strong else "black")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return image


# Per-layer figures (chapters 3 and 8)
def per_layer(summary, statistic: str, view: str, group: str = ""):
    """``mean, low, high`` per layer of one ``statistic``, ``view`` and key ``group`` of a per-layer summary
    (columns ``layer, statistic, view, group, mean, low, high, n``)."""
    rows = summary[(summary["statistic"] == statistic) & (summary["view"] == view) & (summary["group"] == group)]
    return rows.set_index("layer")[["mean", "low", "high"]]


def band(ax, frame, colour, label: str | None = None, *, alpha: float = 0.25, lw: float = 2):
    """Draw ``frame["mean"]`` against its index as a line and ``low``-``high`` as a band."""
    ax.plot(frame.index, frame["mean"], color=colour, lw=lw, label=label)
    ax.fill_between(frame.index, frame["low"], frame["high"], color=colour, alpha=alpha, lw=0)


def layer_axis(ax, n_layers: int | None = None, label: str = "layer") -> None:
    """Label the x axis with layer numbers: every layer ``0 .. n_layers - 1`` when ``n_layers`` is given
    (a small encoder), otherwise integer ticks chosen by matplotlib (a deep decoder)."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(label)
    if n_layers is None:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax.set_xticks(range(n_layers))


def plain_log(ax, axis: str = "y") -> None:
    """A logarithmic ``axis`` labelled 0.01, 0.1, 1 rather than 10^-2, 10^-1, 10^0 (no minor labels)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    getattr(ax, f"set_{axis}scale")("log")
    target = ax.yaxis if axis == "y" else ax.xaxis
    target.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    target.set_minor_formatter(NullFormatter())


def legend_below(fig, ax, ncols: int = 3, fontsize: float = 9) -> None:
    """The legend of ``ax`` under the figure, where it cannot hide a curve (a constrained-layout figure)."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=fontsize)


#: verdict colours of :func:`ladder_forest` (colour-blind-safe: blue / vermilion / grey), keyed by the
#: values of :data:`cwcore.stats.HOLDS`, ``CONTRADICTED`` and ``INCONCLUSIVE`` (literals: importing
#: this module does not load scipy)
VERDICT_COLOURS = {"holds": "#0072B2", "contradicted": "#D55E00", "negligible": "#009E73", "inconclusive": "#7f7f7f"}
_STEP_LABELS = {"step 1->2": "1→2", "step 2->3": "2→3", "step 3->4": "3→4",
                "contribution beats random": "4 vs random"}
_VARIANTS = [("signed", "low", "o"), ("signed", "full", "s"), ("absolute", "low", "^"), ("absolute", "full", "D")]


def _interval(ax, row, estimate: str, sign: float, y: float, marker: str) -> None:
    """One forest line at height ``y``: ``row[estimate]`` with its 95% interval (``ci_low``, ``ci_high``),
    times ``sign`` (the faithful direction), in the colour of the row's verdict."""
    lo, hi = sorted((sign * row["ci_low"], sign * row["ci_high"]))
    colour = VERDICT_COLOURS.get(row["verdict"], "black")
    ax.plot([lo, hi], [y, y], color=colour, lw=1.4)
    ax.plot([sign * row[estimate]], [y], marker=marker, ms=4.5, color=colour, ls="none")


def _forest_axes(ax, labels: list[str], title: str, xlabel: str, tick_size: float | None = None) -> None:
    """A forest panel's frame: zero line, symmetric-log x (linear within ±0.01), one labelled line per entry."""
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xscale("symlog", linthresh=0.01)
    ax.margins(x=0.06)  # the outermost markers inside the frame
    ax.set_yticks(range(len(labels)), labels, fontsize=tick_size)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.grid(axis="y", visible=False)


def _forest_panels(rows, n_lines: int, line_height: float, pad: float):
    """The grid of a forest plot, one panel per (data set, mode) of ``rows``: ``(fig, panels)``, each panel
    ``(ax, rows of that panel, data, mode, sign)``, ``sign`` -1 for sufficiency (lower is better)."""
    import matplotlib.pyplot as plt

    datas = list(dict.fromkeys(rows["data"]))
    modes = [m for m in ("comprehensiveness", "sufficiency") if m in set(rows["mode"])]
    fig, axes = plt.subplots(max(len(datas), 1), max(len(modes), 1), squeeze=False, constrained_layout=True,
                             figsize=(5.2 * max(len(modes), 1), line_height * n_lines * max(len(datas), 1) + pad),
                             sharey=True)
    panels = [(axes[i, j], rows[(rows["data"] == data) & (rows["mode"] == mode)], data, mode,
               -1.0 if mode == "sufficiency" else 1.0)
              for i, data in enumerate(datas) for j, mode in enumerate(modes)]
    return fig, panels


def ladder_forest(claims, title: str = ""):
    """A forest plot of the ladder's step claims (rows of the book's faithfulness findings): one panel per
    (data set, mode), one line per step x protocol, one marker per importance sign x ratio range with its
    95% interval, on a symmetric-log axis in the paper's direction (right of zero supports the paper)."""
    from matplotlib.lines import Line2D

    from .stats import NOT_MEASURED

    rows = claims[claims["claim"].isin(list(_STEP_LABELS)) & claims["estimate"].notna()
                  & (claims["verdict"] != NOT_MEASURED)]
    if "variant" in rows:  # the main protocols' steps; a variant's are shown beside them, never on their line
        rows = rows[rows["variant"].fillna("main") == "main"]
    protocols = list(dict.fromkeys(rows["protocol"]))
    lines = [(c, p) for c in _STEP_LABELS for p in protocols]
    fig, panels = _forest_panels(rows, len(lines), line_height=0.42, pad=1.2)
    for ax, part, data, mode, sign in panels:
        for y, (claim, protocol) in enumerate(lines):
            for k, (importance, rng, marker) in enumerate(_VARIANTS):
                hit = part[(part["claim"] == claim) & (part["protocol"] == protocol)
                           & (part["importance"] == importance) & (part["range"] == rng)]
                if hit.empty:
                    continue
                _interval(ax, hit.iloc[0], "estimate", sign, y + (k - 1.5) * 0.17, marker)
        _forest_axes(ax, [f"{_STEP_LABELS[c]} ({p})" for c, p in lines], f"{mode} ({data})",
                     "step in the paper's direction (ΔAOPC, > 0 supports)")
    handles = [Line2D([], [], color=c, lw=1.4, label=v) for v, c in VERDICT_COLOURS.items()]
    handles += [Line2D([], [], color="black", marker=m, ls="none", label=f"{'|c|' if imp == 'absolute' else imp}, "
                       f"{rng} range") for imp, rng, m in _VARIANTS]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8)
    if title:
        fig.suptitle(title, fontweight="bold")
    return fig


def bench_forest(comparisons, title: str = "", labels: dict | None = None):
    """A forest plot of :func:`cwcore.faithfulness.ladder_comparison`'s pairs (with ``data`` and ``range``
    columns), as :func:`ladder_forest` draws the ladder: right of zero, ``higher`` is the more faithful.
    ``labels``: display names of the methods."""
    from matplotlib.lines import Line2D

    labels = labels or {}
    rows = comparisons[~comparisons["identical"].astype(bool)] if "identical" in comparisons else comparisons
    pairs = list(dict.fromkeys(zip(rows["higher"], rows["lower"])))
    ranges = list(dict.fromkeys(rows["range"]))
    markers = dict(zip(ranges, "osD^v"))
    fig, panels = _forest_panels(rows, len(pairs), line_height=0.3, pad=1.4)
    for ax, part, data, mode, sign in panels:
        for y, (higher, lower) in enumerate(pairs):
            for k, rng in enumerate(ranges):
                hit = part[(part["higher"] == higher) & (part["lower"] == lower) & (part["range"] == rng)]
                if hit.empty:
                    continue
                _interval(ax, hit.iloc[0], "difference", sign, y + (k - (len(ranges) - 1) / 2) * 0.22, markers[rng])
        _forest_axes(ax, [f"{labels.get(h, h)} vs {labels.get(lo, lo)}" for h, lo in pairs], f"{mode} ({data})",
                     "difference, faithful direction (ΔAOPC, > 0: first more faithful)", tick_size=8)
    handles = [Line2D([], [], color=c, lw=1.4, label=v) for v, c in VERDICT_COLOURS.items()]
    handles += [Line2D([], [], color="black", marker=markers[rng], ls="none", label=f"{rng} range") for rng in ranges]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
    if title:
        fig.suptitle(title, fontweight="bold")
    return fig
