"""One plotting style for the book, the notebooks and ``cwcore explain``: :func:`set_style` (seaborn,
colour-blind-safe), :func:`save_figure` (PNG and SVG, atomically), :func:`contribution_heatmap` (a
[query, key] matrix on a zero-centred diverging map: negative contributions blue, positive red) and
per-layer figures (:func:`per_layer`, :func:`band`, :func:`layer_axis`). Importing it loads neither
torch nor seaborn."""

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


def _quiet_font_fallback() -> None:
    """Silence matplotlib's "findfont: ... Falling back to DejaVu Sans" notices: an installation without the
    optional fonts prints some twenty per process, and the fallback is the font the style uses anyway."""
    import logging

    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)


def set_style(context: str = "notebook") -> None:
    """Apply the project's one plotting style (seaborn whitegrid + the ``colorblind`` palette)."""
    import matplotlib as mpl
    import seaborn as sns

    _quiet_font_fallback()

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
    _quiet_font_fallback()
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
