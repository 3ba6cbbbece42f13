"""Summaries of the per-sequence / per-example tables: curves, AOPC and the ladder's paired tests.

Intervals are percentile bootstraps (:mod:`cwcore.stats`) with the same draws for every point, metric
and mode of a table, so they are comparable, deterministic and, for :func:`ladder_comparison`,
paired. Documents are the units: a table with a ``document`` column is averaged over each
document's blocks first (a cluster bootstrap); without it each sequence is a document. ``max_ratio``
restricts :func:`aopc` and :func:`ladder_comparison` to the low range. Every paired difference
carries ``mde``, the smallest true difference its sample detects with 80% power at the 5% level."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from .. import stats
from .protocol import LADDER, Protocol, same_ranking

__all__ = ["summarize", "summarize_downstream", "aopc", "ladder_comparison", "method_pairs", "curve_mean",
           "random_baseline"]

_GROUP_COLUMNS = ("task", "metric", "kind", "mode", "ratio", "unit", "scope", "scores", "keep_first_token",
                  "importance", "layers", "variant")


def _per_unit_table(frame, caller: str) -> pd.DataFrame:
    """The per-sequence table a reduction reads: a DataFrame as given, or a :class:`FaithfulnessResult`'s
    ``per_sequence`` (so ``aopc(result)`` is ``result.summary()`` with this call's settings)."""
    table = getattr(frame, "per_sequence", frame)
    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"{caller}: expected a faithfulness_curve result or its per_sequence DataFrame, got "
                        f"{type(frame).__name__}")
    return table


def _group_columns(frame: pd.DataFrame, exclude=()) -> list[str]:
    return [c for c in _GROUP_COLUMNS if c in frame.columns and c not in exclude]


def _unit_column(frame: pd.DataFrame) -> str | None:
    """The resampled unit: ``document`` when the table has it, else ``sequence`` / ``example``."""
    for column in ("document", "sequence", "example"):
        if column in frame.columns:
            return column
    return None


def _with_deltas(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    if "delta_nll" not in frame:
        frame["delta_nll"] = frame["nll"] - frame["clean_nll"]
    if "delta_ppl" not in frame:
        frame["delta_ppl"] = np.exp(frame["nll"]) - np.exp(frame["clean_nll"])
    return frame


def _mean_interval(values, n_bootstrap: int, confidence: float, seed: int) -> stats.Interval:
    """Mean of ``values [units]`` with its percentile bootstrap interval (zero-width for constant values)."""
    return stats.bootstrap_ci(values, np.mean, n_resamples=n_bootstrap, confidence=confidence, seed=seed)


def summarize(per_sequence: pd.DataFrame, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0) -> pd.DataFrame:
    """The curve of :func:`~cwcore.faithfulness.faithfulness_curve` from its per-sequence table, one row per
    point: ``delta_ppl, ci_low, ci_high, delta_nll, nll_ci_low, nll_ci_high, clean_ppl, ppl,
    removed_fraction, n_sequences``."""
    frame = _per_unit_table(per_sequence, "summarize").copy()
    frame["ppl"] = np.exp(frame["nll"])
    frame["clean_ppl"] = np.exp(frame["clean_nll"])
    frame["delta_nll"] = frame["nll"] - frame["clean_nll"]
    frame["delta_ppl"] = frame["ppl"] - frame["clean_ppl"]
    ids = np.sort(frame["sequence"].unique())
    rows = []
    keys = _group_columns(frame)
    clustered = "document" in frame and frame["document"].nunique() < len(ids)
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        group = group.sort_values("sequence")
        if len(group) != len(ids) or not np.array_equal(group["sequence"].to_numpy(), ids):
            raise ValueError("every point needs every sequence")
        units = group.groupby("document")[["delta_ppl", "delta_nll"]].mean() if clustered else group
        d_ppl = _mean_interval(units["delta_ppl"].to_numpy(), n_bootstrap, confidence, seed)
        d_nll = _mean_interval(units["delta_nll"].to_numpy(), n_bootstrap, confidence, seed)
        rows.append({
            **dict(zip(keys, key)),
            "delta_ppl": d_ppl.estimate, "ci_low": d_ppl.low, "ci_high": d_ppl.high,
            "delta_nll": d_nll.estimate, "nll_ci_low": d_nll.low, "nll_ci_high": d_nll.high,
            "clean_ppl": float(group["clean_ppl"].mean()), "ppl": float(group["ppl"].mean()),
            "removed_fraction": float(group["n_removed"].sum() / max(group["n_candidates"].sum(), 1)),
            "n_sequences": len(group),
            **({"n_documents": int(group["document"].nunique())} if "document" in group else {}),
        })
    return pd.DataFrame(rows)


def summarize_downstream(per_example: pd.DataFrame, n_bootstrap: int = 1000, confidence: float = 0.95,
                         seed: int = 0) -> pd.DataFrame:
    """The summary of :func:`~cwcore.faithfulness.downstream_eval` from its per-example table, one row per
    (task, point), with ``accuracy`` (and its Wilson score interval), ``clean_accuracy`` and ``n_examples``
    besides; the other intervals are percentile bootstraps over examples."""
    frame = _with_deltas(per_example)
    rows = []
    keys = _group_columns(frame)
    for task, task_frame in frame.groupby("task", sort=False):
        clean = task_frame.drop_duplicates("example").sort_values("example")
        clean_correct, clean_nll = clean["clean_correct"].to_numpy(float), clean["clean_nll"].to_numpy(float)
        for key, group in task_frame.groupby(keys, sort=False, dropna=False):
            group = group.sort_values("example")
            d_ppl = _mean_interval(group["delta_ppl"].to_numpy(), n_bootstrap, confidence, seed)
            d_nll = _mean_interval(group["delta_nll"].to_numpy(), n_bootstrap, confidence, seed)
            # a proportion: Wilson's interval (the bootstrap's collapsed to [0, 0] when every example was wrong)
            acc = stats.share_ci(group["correct"].to_numpy(), confidence)
            rows.append({
                **dict(zip(keys, key)),
                "delta_ppl": d_ppl.estimate, "ci_low": d_ppl.low, "ci_high": d_ppl.high,
                "delta_nll": d_nll.estimate, "nll_ci_low": d_nll.low, "nll_ci_high": d_nll.high,
                "accuracy": acc.estimate, "accuracy_ci_low": acc.low, "accuracy_ci_high": acc.high,
                "clean_accuracy": float(clean_correct.mean()),
                "clean_ppl": float(np.exp(clean_nll).mean()), "ppl": float(np.exp(group["nll"]).mean()),
                "removed_fraction": float(group["n_removed"].sum() / max(group["n_candidates"].sum(), 1)),
                "n_examples": len(group),
            })
    return pd.DataFrame(rows)


def curve_mean(ratios, values) -> np.ndarray:
    """Mean height over [0, max ratio] of curves ``values [..., len(ratios)]`` (trapezoid rule), with
    (0, 0) prepended when ratio 0 was not measured."""
    ratios = np.asarray(ratios, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    if ratios[0] > 0:
        ratios = np.concatenate([[0.0], ratios])
        values = np.concatenate([np.zeros(values.shape[:-1] + (1,)), values], axis=-1)
    if ratios[-1] == 0:
        return values[..., 0]
    return stats.trapezoid_mean(ratios, values, axis=-1)


def _in_range(frame: pd.DataFrame, max_ratio: float | None) -> pd.DataFrame:
    if max_ratio is None:
        return frame
    kept = frame[frame["ratio"] <= max_ratio + 1e-12]
    if kept.empty:
        raise ValueError(f"no ratio <= max_ratio={max_ratio:g} was measured")
    return kept


def _per_unit_curves(frame: pd.DataFrame, value: str, keys: list[str]):
    """{group key: (ratios [r], units [n], matrix [n, r])} from a per-sequence/per-example table
    (rows of one document averaged: the unit is the document when the table has the column). A table with a
    unit missing at some ratio, a sequence twice at one ratio or a unit without an id is refused: the curve
    would drop or double-count it while the counts still name it."""
    unit = _unit_column(frame)
    row_unit = "sequence" if "sequence" in frame else unit
    out = {}
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        if group[unit].isna().any():
            raise ValueError(f"{int(group[unit].isna().sum())} rows have no {unit}: every row needs its {unit} id")
        if group.duplicated([row_unit, "ratio"]).any():
            raise ValueError(f"a {row_unit} appears twice at one ratio (of {dict(zip(keys, key))}): each point "
                             f"needs each {row_unit} once")
        cells = group.groupby([unit, "ratio"]).size()
        if len(cells) != group[unit].nunique() * group["ratio"].nunique():
            raise ValueError(f"not every {unit} was measured at every ratio (of {dict(zip(keys, key))}): "
                             f"{len(cells)} of {group[unit].nunique()} x {group['ratio'].nunique()} points")
        pivot = group.pivot_table(index=unit, columns="ratio", values=value, aggfunc="mean").sort_index()
        out[key] = (pivot.columns.to_numpy(dtype=np.float64), pivot.index.to_numpy(), pivot.to_numpy())
    return out


def aopc(frame: pd.DataFrame, n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0,
         max_ratio: float | None = None) -> pd.DataFrame:
    """Area over the perturbation curve per metric and mode: the trapezoid mean height of delta(r) over
    [0, r_max] ((0, 0) prepended when ratio 0 was not run). ``aopc_nll`` (from ``delta_nll``, the primary
    summary: it stays comparable when the model is destroyed) and ``aopc_ppl``. Comprehensiveness:
    higher = more faithful; sufficiency: lower.

    ``frame``: a summary (point estimates only, intervals NaN) or a per-sequence / per-example table
    (then ``*_ci_low``/``*_ci_high`` are paired bootstraps over documents). ``max_ratio``: only the ratios
    up to it (column ``r_max``). A :class:`~cwcore.faithfulness.result.FaithfulnessResult` reads as its
    ``per_sequence``."""
    frame = _in_range(_per_unit_table(frame, "aopc"), max_ratio)
    unit = _unit_column(frame)
    keys = _group_columns(frame, exclude=("ratio",))
    rows = []
    if unit is None:
        for key, group in frame.groupby(keys, sort=False, dropna=False):
            group = group.sort_values("ratio")
            r = group["ratio"].to_numpy(dtype=np.float64)
            row = dict(zip(keys, key))
            for value, name in (("delta_nll", "aopc_nll"), ("delta_ppl", "aopc_ppl")):
                if value in group:
                    row[name] = float(curve_mean(r, group[value].to_numpy(dtype=np.float64)))
                    row[f"{name}_ci_low"] = row[f"{name}_ci_high"] = np.nan
            row["n_ratios"] = len(r)
            row["r_max"] = float(r[-1])
            rows.append(row)
        return pd.DataFrame(rows)
    frame = _with_deltas(frame)
    # one row per group, built directly: a pivot of the long table dropped groups with a NaN key (kind "" read
    # back from a CSV)
    curves = {name: _per_unit_curves(frame, value, keys)
              for value, name in (("delta_nll", "aopc_nll"), ("delta_ppl", "aopc_ppl"))}
    for key, (r, units, _) in curves["aopc_nll"].items():
        row = dict(zip(keys, key if isinstance(key, tuple) else (key,)))
        row.update({"n_ratios": len(r), "n": len(units)})
        for name, found in curves.items():
            area = _mean_interval(curve_mean(found[key][0], found[key][2]), n_bootstrap, confidence, seed)
            row.update({name: area.estimate, f"{name}_ci_low": area.low, f"{name}_ci_high": area.high})
        row["r_max"] = float(r[-1])
        rows.append(row)
    out = pd.DataFrame(rows)
    out = out.rename(columns={"n": {"sequence": "n_sequences", "document": "n_documents"}.get(unit, "n_examples")})
    if unit == "document" and "sequence" in frame:  # a per-document table has no sequences to count
        out.insert(list(out.columns).index("n_documents"), "n_sequences", int(frame["sequence"].nunique()))
    return out


def _default_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """Consecutive rungs present (every variant of a rung against every variant of the next present
    one), attention against each contribution variant, and random against every rung."""
    # a rung's variants are its _inter/_intra: "contribution_rollout" is another method, not a contribution
    rungs = [[m for m in labels if _rung(m) == base] for base in LADDER]
    present = [rung for rung in rungs if rung]  # a missing rung: compare its neighbours directly
    pairs = [(a, b) for lower, higher in zip(present, present[1:]) for a in lower for b in higher]
    if rungs[2] or rungs[1]:
        pairs += [(a, b) for a in rungs[0] for b in rungs[3]]
    if "random" in labels:
        pairs += [("random", m) for rung in rungs for m in rung]
    return pairs


def method_pairs(labels: Sequence[str], reference: str = "contribution", control: str = "random") -> list[tuple[str, str]]:
    """Pairs ``(lower, higher)`` for :func:`ladder_comparison` of an attribution bench: every other method
    against ``reference`` (difference = AOPC(reference) - AOPC(method): above zero for comprehensiveness,
    below for sufficiency when the reference is the more faithful), then ``control`` against every method."""
    labels = list(dict.fromkeys(labels))
    pairs = [(m, reference) for m in labels if reference in labels and m not in (reference, control)]
    if control in labels:
        pairs += [(control, m) for m in labels if m != control]
    return pairs


def _rung(label: str) -> str | None:
    """The ladder rung a metric label names (``"contribution_intra"`` -> ``"contribution"``), or None."""
    if label in LADDER:
        return label
    base, _, suffix = label.rpartition("_")
    return base if suffix in ("inter", "intra") and base in LADDER else None


def _identical_by_construction(frame: pd.DataFrame, group: dict, lower: str, higher: str) -> bool:
    """Whether the protocol of ``group`` (its ``unit`` and ``scope`` columns; kinds from each metric's
    ``kind`` column) makes the two metrics rank identically (:func:`~cwcore.faithfulness.protocol.same_ranking`)."""
    if lower == higher:
        return True
    a, b = _rung(lower), _rung(higher)
    if a is None or b is None:
        return False
    kinds = frame.drop_duplicates("metric").set_index("metric")["kind"] if "kind" in frame else {}
    protocol = Protocol(unit=group.get("unit", "head_key"), scope=group.get("scope", "row"))
    return same_ranking(a, b, protocol, kinds.get(lower) or "inter", kinds.get(higher) or "inter")


def ladder_comparison(
    per_unit: pd.DataFrame,
    value: str = "delta_nll",
    pairs: Sequence[tuple[str, str]] | None = None,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
    max_ratio: float | None = None,
    n_permutations: int | None = None,
) -> pd.DataFrame:
    """Paired bootstrap differences ``AOPC(higher) - AOPC(lower)`` between metrics, per mode (and task).

    Default pairs: consecutive rungs of the ladder present (every variant of a rung against every
    variant of the next), attention against contribution, and each rung against random. The ladder
    claims the difference is > 0 for comprehensiveness and < 0 for sufficiency: column ``verdict``
    (:func:`cwcore.stats.verdict` against 0), "not measured" also when the protocol makes the two rungs
    rank identically (column ``identical``, :func:`~cwcore.faithfulness.protocol.same_ranking`).
    Power columns ``sd``, ``mde`` and ``sample_unit``; with ``n_permutations`` a sign-flip ``p``."""
    frame = _with_deltas(_in_range(_per_unit_table(per_unit, "ladder_comparison"), max_ratio))
    unit = _unit_column(frame)
    keys = _group_columns(frame, exclude=("ratio", "metric", "kind"))
    labels = list(dict.fromkeys(frame["metric"]))
    if pairs is None:
        pairs = _default_pairs(labels)
    else:
        absent = sorted({m for pair in pairs for m in pair} - set(labels))
        if absent:  # a typo returned an empty table
            raise ValueError(f"pairs name metrics the table does not hold: {absent}; it holds {labels}")
    rows = []
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        curves = {m: _per_unit_curves(g, value, ["metric"]) for m, g in group.groupby("metric")}
        per, grids = {}, {}
        for metric, found in curves.items():
            (r, units, matrix), = found.values()
            per[metric], grids[metric] = (units, curve_mean(r, matrix)), r
        group_columns = dict(zip(keys, key))
        mode = group_columns.get("mode")
        side = "above" if mode == "comprehensiveness" else "below"
        for lower, higher in pairs:
            if lower not in per or higher not in per:
                continue
            units, a = per[lower]
            units_b, b = per[higher]
            if not np.array_equal(units, units_b):
                raise ValueError("metrics were measured on different sequences")
            if not np.array_equal(grids[lower], grids[higher]):  # two areas over different ranges
                raise ValueError(f"{lower!r} and {higher!r} were measured at different ratios "
                                 f"({grids[lower].tolist()} and {grids[higher].tolist()}): pass max_ratio, or "
                                 "measure both on one grid")
            difference = stats.paired_bootstrap_ci(b, a, np.mean, n_resamples=n_bootstrap, confidence=confidence,
                                                   seed=seed)
            sd = float(np.std(b - a, ddof=1)) if len(units) > 1 else np.nan
            identical = _identical_by_construction(group, group_columns, lower, higher)
            # below MIN_CLUSTERS documents the percentile interval covers far less than its level (a null
            # difference "holds" in 26% of samples of 2 documents): no verdict
            verdict = stats.NOT_MEASURED if identical or len(units) < stats.MIN_CLUSTERS else \
                stats.verdict(difference.low, difference.high, threshold=0.0, side=side)
            rows.append({**group_columns, "lower": lower, "higher": higher, "value": value,
                         "aopc_lower": float(a.mean()), "aopc_higher": float(b.mean()),
                         "difference": difference.estimate, "ci_low": difference.low, "ci_high": difference.high,
                         "verdict": verdict, "identical": identical,
                         "n": len(units), "sample_unit": unit, "sd": sd,
                         "mde": stats.min_detectable_effect(sd, len(units)), "r_max": float(grids[higher][-1])})
            if n_permutations:
                rows[-1]["p"] = stats.sign_flip_p(b - a, n_resamples=n_permutations, seed=seed)
    return pd.DataFrame(rows)


def random_baseline(per_unit: pd.DataFrame, against: Sequence[str] = ("contribution",), value: str = "delta_nll",
                    prefix: str = "random_s", n_bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0,
                    max_ratio: float | None = None, controls: Sequence[str] | None = None,
                    n_permutations: int | None = None) -> pd.DataFrame:
    """The random control over several seeds (metrics ``<prefix><seed>`` or ``controls``), the seed spread
    in the interval: ``metric="random"`` rows give the mean AOPC with :func:`cwcore.stats.crossed_bootstrap_ci`,
    ``seed_sd`` and ``n_seeds``; each metric of ``against`` gives ``difference`` = AOPC(metric) -
    AOPC(random) over the same resamples with the ladder's verdict rule, ``sd``, ``mde`` and, with
    ``n_permutations``, a sign-flip ``p`` (documents the units, seeds averaged within each)."""
    frame = _with_deltas(_in_range(_per_unit_table(per_unit, "random_baseline"), max_ratio))
    unit = _unit_column(frame)
    keys = _group_columns(frame, exclude=("ratio", "metric", "kind"))
    rows = []
    for key, group in frame.groupby(keys, sort=False, dropna=False):
        base = dict(zip(keys, key))
        present = list(dict.fromkeys(group["metric"]))
        seeded = [m for m in (controls if controls is not None else present) if m in present
                  and (controls is not None or m.startswith(prefix))]
        if not seeded:
            continue
        areas = {}
        for metric in seeded + [m for m in against if m in set(group["metric"])]:
            (r, units, matrix), = _per_unit_curves(group[group["metric"] == metric], value, ["metric"]).values()
            areas[metric] = pd.Series(curve_mean(r, matrix), index=units)
        noise = pd.concat([areas[m] for m in seeded], axis=1).to_numpy()  # [documents, seeds]
        side = "above" if base.get("mode") == "comprehensiveness" else "below"
        ci = stats.crossed_bootstrap_ci(noise, n_resamples=n_bootstrap, confidence=confidence, seed=seed)
        common = {"value": value, "n": noise.shape[0], "sample_unit": unit, "n_seeds": noise.shape[1],
                  "seeds": ",".join(m[len(prefix):] if m.startswith(prefix) else m for m in seeded),
                  "r_max": float(frame["ratio"].max())}
        rows.append({**base, "metric": "random", "aopc": ci.estimate, "ci_low": ci.low, "ci_high": ci.high,
                     "seed_sd": float(np.std(noise.mean(0), ddof=1)) if noise.shape[1] > 1 else np.nan, **common})
        for metric in against:
            if metric not in areas:
                continue
            gap = areas[metric].to_numpy()[:, None] - noise  # [documents, seeds]
            d = stats.crossed_bootstrap_ci(gap, n_resamples=n_bootstrap, confidence=confidence, seed=seed)
            per_doc = gap.mean(1)
            sd = float(np.std(per_doc, ddof=1)) if len(per_doc) > 1 else np.nan
            rows.append({**base, "metric": metric, "aopc": float(areas[metric].mean()), "difference": d.estimate,
                         "ci_low": d.low, "ci_high": d.high, "sd": sd,
                         "mde": stats.min_detectable_effect(sd, len(per_doc)),
                         "verdict": stats.NOT_MEASURED if len(per_doc) < stats.MIN_CLUSTERS else
                         stats.verdict(d.low, d.high, threshold=0.0, side=side), **common})
            if n_permutations:
                rows[-1]["p"] = stats.sign_flip_p(per_doc, n_resamples=n_permutations, seed=seed)
    return pd.DataFrame(rows)
