"""The book's forest plots: the ladder's step claims (:func:`ladder_forest`) and the attribution bench's
pairs (:func:`bench_forest`), each line a 95% interval coloured by its verdict (they were in
``cwcore.plotting``)."""

from __future__ import annotations


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

    from cwcore.stats import NOT_MEASURED

    rows = claims[claims["claim"].isin(list(_STEP_LABELS)) & claims["estimate"].notna()
                  & (claims["verdict"] != NOT_MEASURED)]
    if "variant" in rows:  # the main protocols' steps; a variant's are shown beside them, never on their line
        rows = rows[rows["variant"].astype(object).fillna("main") == "main"]
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
