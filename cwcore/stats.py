"""The project's statistics: intervals over independent units, and the one verdict vocabulary.

Conventions of every interval function: NaN values are dropped first (infinite ones too, with a
``RuntimeWarning`` that counts them: a mean over them is not finite); with no finite value every
number is NaN; with one value the interval is NaN (one unit has no spread). Intervals are two-sided at
``confidence``, returned as :class:`Interval` ``(estimate, low, high)``; resampling is deterministic
for a fixed ``seed``. The resampled unit is always the independent one (a document, a sequence, a
layer of heads): :func:`cluster_bootstrap` pools the rows of each unit and resamples whole units,
which :func:`scipy.stats.bootstrap` does not offer.

Verdicts (:func:`verdict`): a claim "the statistic is above (below) the threshold" **holds** when its
whole interval lies strictly on the claimed side, is **contradicted** when it lies strictly on the
other side, **inconclusive** when it contains or touches the threshold, **not measured** without an
interval, and **negligible** when it lies inside an equivalence ``threshold +- margin`` (checked first,
so a tiny but precisely measured effect is negligible, not "holds")."""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
import pandas as pd
from scipy import integrate, stats as _scipy_stats

__all__ = [
    "CONTRADICTED", "HOLDS", "INCONCLUSIVE", "MIN_CLUSTERS", "NEGLIGIBLE", "NOT_MEASURED", "VERDICTS",
    "ClusterBootstrap", "Interval", "bootstrap_ci", "cluster_bootstrap", "combine_all", "combine_verdicts",
    "crossed_bootstrap_ci",
    "detectable_from_interval", "holm", "mde_at_level", "sign_flip_p",
    "min_detectable_effect", "paired_bootstrap_ci", "percentile_interval", "resample_indices", "share_ci", "spearman_ci",
    "trapezoid_mean", "verdict", "wilson_ci",
]

HOLDS = "holds"
CONTRADICTED = "contradicted"
INCONCLUSIVE = "inconclusive"
NEGLIGIBLE = "negligible"
NOT_MEASURED = "not measured"
#: the one verdict vocabulary of the project, from strongest to weakest evidence
VERDICTS = (HOLDS, CONTRADICTED, NEGLIGIBLE, INCONCLUSIVE, NOT_MEASURED)

_NAN = float("nan")

#: the fewest whole clusters a cluster bootstrap resamples for an interval: with fewer (Gemma 3 270M's three
#: global layers) a percentile interval can be a point ("[0.75, 0.75]") that looks decisive
MIN_CLUSTERS = 5


class Interval(NamedTuple):
    """A point estimate with its confidence interval."""

    estimate: float
    low: float
    high: float


def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=float).reshape(-1)
    ok = np.isfinite(x)
    _warn_infinite(x, ok)
    return x[ok]


def _warn_infinite(x: np.ndarray, kept: np.ndarray) -> None:
    """Say how many infinite values (an overflowed perplexity, say) ``kept`` leaves out: dropped without a
    word they would shrink the sample and pull the statistic towards the finite values."""
    infinite = int(np.isinf(x[~kept]).sum())
    if infinite:
        warnings.warn(f"{infinite} infinite value(s) of {x.size} left out: the statistic and its interval cover "
                      "the finite values only", RuntimeWarning, stacklevel=3)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be between 0 and 1, got {confidence}")


def _scipy_bootstrap(data, statistic, **options):
    """:func:`scipy.stats.bootstrap`, quiet about degenerate resamples (few units, all alike): the
    interval is then NaN, which the verdict rule reports as not measured."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The BCa confidence interval cannot be calculated")
        warnings.filterwarnings("ignore", category=getattr(_scipy_stats, "DegenerateDataWarning", RuntimeWarning))
        return _scipy_stats.bootstrap(data, statistic, **options)


def bootstrap_ci(values, statistic: Callable = np.mean, *, n_resamples: int = 1000, confidence: float = 0.95,
                 method: str = "percentile", seed: int = 0) -> Interval:
    """``statistic`` (taking ``axis=``) of one value per independent unit, with a :func:`scipy.stats.bootstrap` interval."""
    _check_confidence(confidence)
    x = _finite(values)
    if x.size == 0:
        return Interval(_NAN, _NAN, _NAN)
    estimate = float(statistic(x, axis=0))
    if x.size < 2:
        return Interval(estimate, _NAN, _NAN)
    if np.all(x == x[0]):  # no spread: every resample gives the same value
        return Interval(estimate, estimate, estimate)
    result = _scipy_bootstrap((x,), statistic, n_resamples=n_resamples, confidence_level=confidence,
                                    method=method, rng=np.random.default_rng(seed), vectorized=True, axis=-1)
    return Interval(estimate, float(result.confidence_interval.low), float(result.confidence_interval.high))


def paired_bootstrap_ci(x, y, statistic: Callable = np.mean, *, n_resamples: int = 1000, confidence: float = 0.95,
                        method: str = "percentile", seed: int = 0) -> Interval:
    """``statistic(x - y)`` over paired units (the same documents under two conditions), resampling pairs."""
    _check_confidence(confidence)
    x, y = np.asarray(x, dtype=float).reshape(-1), np.asarray(y, dtype=float).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"paired samples need equal lengths, got {x.size} and {y.size}")
    ok = np.isfinite(x) & np.isfinite(y)
    _warn_infinite(np.concatenate([x, y]), np.concatenate([ok, ok]))
    x, y = x[ok], y[ok]
    if x.size == 0:
        return Interval(_NAN, _NAN, _NAN)
    estimate = float(statistic(x - y, axis=0))
    if x.size < 2:
        return Interval(estimate, _NAN, _NAN)
    if np.all(x - y == (x - y)[0]):
        return Interval(estimate, estimate, estimate)

    def difference(a, b, axis=-1):
        return statistic(a - b, axis=axis)

    result = _scipy_bootstrap((x, y), difference, paired=True, n_resamples=n_resamples,
                                    confidence_level=confidence, method=method, rng=np.random.default_rng(seed),
                                    vectorized=True, axis=-1)
    return Interval(estimate, float(result.confidence_interval.low), float(result.confidence_interval.high))


def resample_indices(n_units: int, n_resamples: int = 1000, seed: int = 0) -> np.ndarray:
    """``[n_resamples, n_units]`` unit indices drawn with replacement: one shared set of resamples, so
    intervals of many groups over the same units are comparable (and their differences paired)."""
    return np.random.default_rng(seed).integers(0, n_units, size=(n_resamples, n_units))


class ClusterBootstrap(NamedTuple):
    """The result of :func:`cluster_bootstrap`: ``table`` (one row per group: the ``by`` keys, ``n``,
    ``n_clusters``, each column with ``<column>_low`` / ``<column>_high``) and ``replicates``
    ``{column: [n_resamples, group]}``; the resamples are shared, so differences of groups are paired."""

    table: pd.DataFrame
    replicates: dict[str, np.ndarray]
    confidence: float = 0.95

    def interval(self, group: int, column: str) -> Interval:
        """The pooled estimate of ``column`` in row ``group`` of ``table`` with its interval."""
        row = self.table.iloc[group]
        return Interval(float(row[column]), float(row[f"{column}_low"]), float(row[f"{column}_high"]))

    def contrast(self, first: int, second: int, column: str) -> Interval:
        """``column`` of group ``first`` minus group ``second``, with a paired interval (same resamples)."""
        estimate = float(self.table[column].iloc[first] - self.table[column].iloc[second])
        n = int(min(self.table["n_clusters"].iloc[first], self.table["n_clusters"].iloc[second]))
        if not np.isfinite(estimate) or n < 2:
            return Interval(estimate, _NAN, _NAN)
        difference = self.replicates[column][:, first] - self.replicates[column][:, second]
        low, high = percentile_interval(difference[:, None], self.confidence)
        return Interval(estimate, float(low[0]), float(high[0]))


def percentile_interval(replicates: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval bounds of bootstrap ``replicates [n_resamples, ...]`` along axis 0 (NaNs ignored),
    e.g. for a statistic derived from :class:`ClusterBootstrap` replicates."""
    tail = 100 * (1 - confidence) / 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns give NaN
        return np.nanpercentile(replicates, tail, axis=0), np.nanpercentile(replicates, 100 - tail, axis=0)


def crossed_bootstrap_ci(values, *, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0) -> Interval:
    """Mean of ``values [units, replicates]`` (documents x seeds of a random control) with a percentile
    interval resampling both factors independently (units with ``seed``, replicates with ``seed + 1``), so
    the spread between replicates is in the interval too. NaN with fewer than two units."""
    _check_confidence(confidence)
    matrix = np.asarray(values, dtype=float)
    if matrix.ndim != 2:
        raise ValueError(f"values must be [units, replicates], got shape {matrix.shape}")
    estimate = float(np.nanmean(matrix)) if matrix.size else _NAN
    units, replicates = matrix.shape
    if units < 2 or replicates < 1:
        return Interval(estimate, _NAN, _NAN)
    rows = resample_indices(units, n_resamples, seed)
    cols = resample_indices(replicates, n_resamples, seed + 1)
    draws = np.array([np.nanmean(matrix[r][:, c]) for r, c in zip(rows, cols)])
    low, high = percentile_interval(draws, confidence)
    return Interval(estimate, float(low), float(high))


def cluster_bootstrap(points: pd.DataFrame, columns: str | Sequence[str], by: str | Sequence[str] = (), *,
                      cluster: str = "sequence", weight: str | None = None, n_resamples: int = 1000,
                      seed: int = 0, confidence: float = 0.95) -> ClusterBootstrap:
    """Pooled means sum(w x) / sum(w) of ``columns`` per group ``by`` (sorted), with intervals resampling
    whole ``cluster`` values (a document's queries, a layer's heads are not independent rows); ``w`` is
    the ``weight`` column or 1. NaN intervals where a group's values of a column lie in fewer than two clusters."""
    _check_confidence(confidence)
    columns = [columns] if isinstance(columns, str) else list(columns)
    by = [by] if isinstance(by, str) else list(by)
    for key in [*by, cluster]:  # groupby would drop such rows and leave them a group code of -1
        missing = int(points[key].isna().sum())
        if missing:
            raise ValueError(f"cluster_bootstrap: column {key!r} has {missing} missing value(s); a row must name "
                             "its group and its cluster (fill or drop them first)")
    clusters, cluster_index = np.unique(points[cluster].to_numpy(), return_inverse=True)
    if by:
        grouped = points.groupby(by, sort=True, observed=True)
        codes = grouped.ngroup().to_numpy()
        table = grouped.size().rename("n").reset_index()
        table["n_clusters"] = grouped[cluster].nunique().to_numpy()
    else:
        codes = np.zeros(len(points), dtype=np.int64)
        table = pd.DataFrame({"n": [len(points)], "n_clusters": [len(clusters)]})
    groups, n_clusters = len(table), len(clusters)
    cell = codes * n_clusters + cluster_index
    w_all = np.ones(len(points)) if weight is None else points[weight].to_numpy(float)
    rng = np.random.default_rng(seed)
    if n_clusters:
        draws = rng.multinomial(n_clusters, np.full(n_clusters, 1 / n_clusters), size=n_resamples).astype(float)
    else:
        draws = np.zeros((n_resamples, 0))
    replicates = {}
    for column in columns:
        x = points[column].to_numpy(float)
        ok = np.isfinite(x) & np.isfinite(w_all)
        _warn_infinite(np.concatenate([x, w_all]), np.concatenate([ok, ok]))
        size = groups * n_clusters
        sums = np.bincount(cell[ok], weights=(w_all * x)[ok], minlength=size).reshape(groups, n_clusters)
        counts = np.bincount(cell[ok], weights=w_all[ok], minlength=size).reshape(groups, n_clusters)
        with np.errstate(invalid="ignore", divide="ignore"):
            table[column] = sums.sum(1) / counts.sum(1)
            replicates[column] = (draws @ sums.T) / (draws @ counts.T)
        low, high = percentile_interval(replicates[column], confidence)
        # each group's own clusters holding a value of the column: one cluster resamples to a point interval,
        # which would read as decisive
        few = (counts != 0).sum(1) < 2
        table[f"{column}_low"], table[f"{column}_high"] = np.where(few, np.nan, low), np.where(few, np.nan, high)
    return ClusterBootstrap(table, replicates, confidence)


def wilson_ci(successes: int, n: int, confidence: float = 0.95) -> Interval:
    """A proportion ``successes / n`` with its Wilson score interval (no collapse to a point when all agree)."""
    _check_confidence(confidence)
    if n <= 0:
        return Interval(_NAN, _NAN, _NAN)
    interval = _scipy_stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence,
                                                                          method="wilson")
    return Interval(successes / n, float(interval.low), float(interval.high))


def share_ci(flags, confidence: float = 0.95) -> Interval:
    """The share of true ``flags`` (booleans or 0/1; NaN/None dropped) with its Wilson interval
    (:func:`wilson_ci`). Any other value (the string ``"False"``, a 2) is refused: ``bool`` would count it true."""
    f = pd.Series(flags, dtype="object").dropna().to_numpy()
    odd = [] if np.asarray(flags).dtype == bool else [
        flag for flag in f if isinstance(flag, (str, bytes)) or flag not in (0, 1)]  # True == 1, False == 0
    if odd:
        raise ValueError(f"share_ci: flags must be booleans (or 0/1), got {odd[0]!r}"
                         + (f" and {len(odd) - 1} more" if len(odd) > 1 else ""))
    f = f.astype(bool)
    return wilson_ci(int(f.sum()), len(f), confidence)


def spearman_ci(x, y, *, clusters=None, n_resamples: int = 1000, seed: int = 0, confidence: float = 0.95) -> Interval:
    """Spearman's rho of the pairs (x, y) with a percentile bootstrap over pairs, or over whole ``clusters``
    (one label per pair, e.g. each head's layer). NaN where undefined (fewer than three pairs, a constant
    variable; for the interval, fewer than :data:`MIN_CLUSTERS` clusters, or pairs without clusters). Resamples
    in which a variable is constant (rho undefined: few pairs with ties) are left out of the interval, with or
    without clusters."""
    _check_confidence(confidence)
    x, y = np.asarray(x, dtype=float).reshape(-1), np.asarray(y, dtype=float).reshape(-1)
    ok = np.isfinite(x) & np.isfinite(y)
    _warn_infinite(np.concatenate([x, y]), np.concatenate([ok, ok]))
    labels = None if clusters is None else np.asarray(clusters).reshape(-1)[ok]
    x, y = x[ok], y[ok]
    if len(x) < 3 or np.all(x == x[0]) or np.all(y == y[0]):
        return Interval(_NAN, _NAN, _NAN)
    estimate = float(_scipy_stats.spearmanr(x, y).statistic)
    if labels is not None:
        units, index = np.unique(labels, return_inverse=True)
        if len(units) < MIN_CLUSTERS:
            return Interval(estimate, _NAN, _NAN)
        members = [np.flatnonzero(index == u) for u in range(len(units))]
        replicates = np.empty(n_resamples)
        for r, draw in enumerate(resample_indices(len(units), n_resamples, seed)):
            rows = np.concatenate([members[u] for u in draw])
            replicates[r] = _rowwise_spearman(x[rows], y[rows])  # NaN for a constant resample, quietly
        replicates = replicates[np.isfinite(replicates)]
        if not len(replicates):
            return Interval(estimate, _NAN, _NAN)
        low, high = percentile_interval(replicates[:, None], confidence)
        return Interval(estimate, float(low[0]), float(high[0]))

    if len(x) < MIN_CLUSTERS:  # as for clusters: four pairs' percentile interval is no evidence either way
        return Interval(estimate, _NAN, _NAN)

    def rho(a, b, axis=-1):
        return _rowwise_spearman(a, b)  # NaN for constant resamples, quietly

    result = _scipy_bootstrap((x, y), rho, paired=True, n_resamples=n_resamples, confidence_level=confidence,
                                    method="percentile", rng=np.random.default_rng(seed), vectorized=True, axis=-1)
    low, high = result.confidence_interval
    if not (np.isfinite(low) and np.isfinite(high)):  # a tied small sample: some resamples are constant, rho NaN
        replicates = np.asarray(result.bootstrap_distribution, dtype=float)
        replicates = replicates[np.isfinite(replicates)]  # left out, as the cluster path above leaves them out
        if not len(replicates):
            return Interval(estimate, _NAN, _NAN)
        low, high = (float(bound[0]) for bound in percentile_interval(replicates[:, None], confidence))
    return Interval(estimate, float(low), float(high))


def _rowwise_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rho of each pair of rows, ``[..., n] x [..., n] -> [...]`` (Pearson of average ranks)."""
    ra, rb = _scipy_stats.rankdata(a, axis=-1), _scipy_stats.rankdata(b, axis=-1)
    ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))


def trapezoid_mean(x, y, axis: int = -1) -> np.ndarray:
    """The mean of the curve y(x) over [x_0, x_last]: trapezoid area / width (``y [..., n]`` along ``axis``)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.size == 1:
        return np.take(y, 0, axis=axis)
    return integrate.trapezoid(y, x, axis=axis) / (x[-1] - x[0])


def min_detectable_effect(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference ``n`` units with standard deviation ``sd`` detect with probability
    ``power`` in a two-sided test at level ``alpha``: (z_{1-alpha/2} + z_power) sd / sqrt(n)."""
    if n < 2 or not np.isfinite(sd):
        return _NAN
    z = _scipy_stats.norm.ppf(1 - alpha / 2) + _scipy_stats.norm.ppf(power)
    return float(z * sd / math.sqrt(n))


def mde_at_level(mde: float, alpha: float, *, from_alpha: float = 0.05, power: float = 0.8) -> float:
    """:func:`min_detectable_effect` at level ``from_alpha`` restated at level ``alpha`` (e.g. a Holm-adjusted level)."""
    z = _scipy_stats.norm.ppf(power)
    return float(mde * (_scipy_stats.norm.ppf(1 - alpha / 2) + z) / (_scipy_stats.norm.ppf(1 - from_alpha / 2) + z))


def detectable_from_interval(low: float, high: float, *, confidence: float = 0.95, alpha: float = 0.05,
                             power: float = 0.8) -> float:
    """:func:`min_detectable_effect` of an interval without a standard deviation (bootstrap, Wilson): the
    standard error is taken as its half-width over z_{(1+confidence)/2}. NaN without an interval."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return _NAN
    se = (high - low) / (2 * _scipy_stats.norm.ppf((1 + confidence) / 2))
    return float((_scipy_stats.norm.ppf(1 - alpha / 2) + _scipy_stats.norm.ppf(power)) * se)


def verdict(low: float, high: float, *, threshold: float = 0.0, side: str = "above",
            margin: float | None = None) -> str:
    """The verdict on "the statistic is above (``side="above"``) / below ``threshold``" from its interval (see the module)."""
    if side not in ("above", "below"):
        raise ValueError(f"side must be 'above' or 'below', not {side!r}")
    if not np.isfinite(threshold):  # every comparison with NaN is False: it read "inconclusive"
        raise ValueError(f"threshold must be a finite number, got {threshold}")
    if margin is not None and not (np.isfinite(margin) and margin > 0):  # inf was ignored, as was NaN
        raise ValueError(f"an equivalence margin must be a positive finite number (or None), got {margin}")
    if not (np.isfinite(low) and np.isfinite(high)):
        return NOT_MEASURED
    if low > high:  # a swapped interval "held"
        raise ValueError(f"the interval's low end {low} is above its high end {high}")
    if margin is not None:
        if threshold - margin < low and high < threshold + margin:
            return NEGLIGIBLE
    if side == "below":
        low, high, threshold = -high, -low, -threshold
    if low > threshold:
        return HOLDS
    if high < threshold:
        return CONTRADICTED
    return INCONCLUSIVE


def sign_flip_p(differences, *, n_resamples: int = 9999, seed: int = 0) -> float:
    """Two-sided p-value of "the mean of the paired ``differences [units]`` is 0" by flipping each unit's
    sign (:func:`scipy.stats.permutation_test`; exact when 2^n <= ``n_resamples``); 1.0 when all are 0."""
    d = _finite(differences)
    if d.size < 2:
        return _NAN
    if np.all(d == 0):
        return 1.0

    def mean(x, axis=-1):
        return np.mean(x, axis=axis)

    result = _scipy_stats.permutation_test((d,), mean, permutation_type="samples", vectorized=True,
                                           n_resamples=n_resamples, alternative="two-sided",
                                           rng=np.random.default_rng(seed))
    return float(result.pvalue)


def holm(pvalues) -> np.ndarray:
    """Holm's step-down adjusted p-values of one family ``[m]``, in the same order; NaN counts as p = 1, so an
    unmeasured member keeps the family its registered size (statsmodels' rule, not a dependency here)."""
    p = np.asarray(pvalues, dtype=float).reshape(-1)
    p = np.where(np.isfinite(p), p, 1.0)
    m = p.size
    if m == 0:
        return p
    order = np.argsort(p, kind="stable")
    stepped = np.minimum(1.0, (m - np.arange(m)) * p[order])
    adjusted = np.empty(m)
    adjusted[order] = np.maximum.accumulate(stepped)
    return adjusted


def combine_verdicts(parts: Iterable[str]) -> str:
    """One verdict of a claim's parts: not measured if none is measured, else contradicted if any is,
    holds (negligible) if every measured part holds (is negligible), else inconclusive."""
    return _combine(list(parts), require_all=False)


def combine_all(parts: Iterable[str]) -> str:
    """:func:`combine_verdicts` for a chain that holds only when *every* part is measured and holds
    (1 < 2 < 3 < 4): an unmeasured part makes it not measured unless another part contradicts it."""
    return _combine(list(parts), require_all=True)


def _combine(parts: list, require_all: bool) -> str:
    unknown = sorted(set(parts) - set(VERDICTS))
    if unknown:
        raise ValueError(f"unknown verdicts {unknown}; the vocabulary is {VERDICTS}")
    measured = [p for p in parts if p != NOT_MEASURED]
    if not measured:
        return NOT_MEASURED
    if CONTRADICTED in measured:
        return CONTRADICTED
    if require_all and len(measured) < len(parts):
        return NOT_MEASURED
    if all(p == HOLDS for p in measured):
        return HOLDS
    if all(p == NEGLIGIBLE for p in measured):
        return NEGLIGIBLE
    return INCONCLUSIVE
