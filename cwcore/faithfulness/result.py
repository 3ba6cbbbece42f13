"""What :func:`~cwcore.faithfulness.faithfulness_curve` returns: :class:`FaithfulnessResult`."""

from __future__ import annotations

from functools import cached_property

import pandas as pd

from .summary import aopc, summarize

__all__ = ["FaithfulnessResult"]


class FaithfulnessResult:
    """The result of one faithfulness sweep.

    ``per_sequence``
        one row per sequence and point: ``sequence, nll, n_tokens, n_removed, n_candidates, metric,
        kind, mode, ratio, clean_nll, document`` plus the protocol columns.
    ``table``
        the curve, one row per point (:func:`~cwcore.faithfulness.summarize` of ``per_sequence``).
    :meth:`summary` / :meth:`plot`
        AOPC per curve (:func:`~cwcore.faithfulness.aopc`) / the curves, one panel per mode.

    For one release ``result["metric"]``, ``len(result)`` and ``result.columns`` read :attr:`table`."""

    def __init__(self, per_sequence: pd.DataFrame, *, n_bootstrap: int = 1000, confidence: float = 0.95,
                 seed: int = 0):
        self.per_sequence = per_sequence
        self.n_bootstrap, self.confidence, self.seed = n_bootstrap, confidence, seed

    @cached_property
    def table(self) -> pd.DataFrame:
        """The curve: one row per (metric, mode, ratio) with bootstrap intervals over documents."""
        return summarize(self.per_sequence, n_bootstrap=self.n_bootstrap, confidence=self.confidence, seed=self.seed)

    def summary(self, max_ratio: float | None = None) -> pd.DataFrame:
        """:func:`~cwcore.faithfulness.aopc` of :attr:`per_sequence` with this sweep's bootstrap settings
        (``max_ratio``: only the ratios up to it)."""
        return aopc(self.per_sequence, n_bootstrap=self.n_bootstrap, confidence=self.confidence, seed=self.seed,
                    max_ratio=max_ratio)

    def plot(self, value: str = "delta_nll", axes=None):
        """The curves of :attr:`table`: ``value`` (``"delta_nll"``: Delta log-PPL, or ``"delta_ppl"``)
        against the removed ratio, one line and interval band per metric, one panel per mode. ``axes``:
        matplotlib axes to draw in (one per mode); returns them."""
        import matplotlib.pyplot as plt

        from ..plotting import palette

        bands = {"delta_nll": ("nll_ci_low", "nll_ci_high"), "delta_ppl": ("ci_low", "ci_high")}
        if value not in bands:
            raise ValueError(f"value must be one of {sorted(bands)}, not {value!r}")
        table = self.table
        modes = list(dict.fromkeys(table["mode"]))
        if axes is None:
            # constrained: the x labels inside the figure (3.6 in tall cut "removed ratio" off before)
            _, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 3.6), squeeze=False, layout="constrained")
            axes = list(axes[0])
        axes = list(axes) if hasattr(axes, "__iter__") else [axes]
        if len(axes) != len(modes):
            raise ValueError(f"plot needs one axis per mode ({len(modes)}: {modes}), got {len(axes)}")
        metrics = list(dict.fromkeys(table["metric"]))
        colours = dict(zip(metrics, palette(len(metrics))))
        low, high = bands[value]
        for ax, mode in zip(axes, modes):
            for metric in metrics:
                rows = table[(table["mode"] == mode) & (table["metric"] == metric)].sort_values("ratio")
                ax.plot(rows["ratio"], rows[value], marker="o", ms=3, color=colours[metric], label=metric)
                ax.fill_between(rows["ratio"], rows[low], rows[high], color=colours[metric], alpha=0.2, lw=0)
            ax.set_title(mode)
            ax.set_xlabel("removed ratio")
            ax.set_ylabel({"delta_nll": "Δ log-PPL", "delta_ppl": "Δ PPL"}[value])
        axes[0].legend(fontsize=8)
        return axes

    # -- the curve table's reading, for one release ----------------------------------------------------
    def __getitem__(self, key):
        return self.table[key]

    def __len__(self) -> int:
        return len(self.table)

    @property
    def columns(self) -> pd.Index:
        return self.table.columns

    def __repr__(self) -> str:
        rows = self.per_sequence
        return (f"FaithfulnessResult({rows['metric'].nunique()} metrics x {rows['mode'].nunique()} modes x "
                f"{rows['ratio'].nunique()} ratios over {rows['sequence'].nunique()} sequences; "
                ".table, .per_sequence, .summary(), .plot())")
