"""The project's statistics: intervals over independent units, and the one verdict vocabulary.

Every chapter and the findings page use these functions, so "holds" means the same thing
everywhere. Conventions shared by every interval function:

* NaN values are dropped first; with no finite value every number is NaN; with one value the
  estimate is that value and the interval is NaN (one unit has no spread to resample);
* intervals are two-sided at ``confidence`` (0.95), returned as :class:`Interval`
  ``(estimate, low, high)``, which unpacks like a 3-tuple;
* resampling is deterministic for a fixed ``seed`` (``numpy.random.default_rng(seed)``).

The resampled unit is always the independent one (a document, a sequence, an example, or a layer
of heads): :func:`bootstrap_ci` and :func:`paired_bootstrap_ci` take one value per unit and use
:func:`scipy.stats.bootstrap`; :func:`cluster_bootstrap` pools the many rows of each unit (queries,
heads) and resamples whole units, which scipy does not offer.

Verdicts (:func:`verdict`): a claim "the statistic is above (below) the threshold" **holds** when
its whole interval lies strictly on the claimed side, is **contradicted** when the whole interval
lies strictly on the other side, is **inconclusive** when the interval contains (or touches) the
threshold, and is **not measured** when there is no interval (no data, one unit, an empty group).
With an equivalence ``margin`` (a difference too small to matter, stated before looking), a claim is
**negligible** when its whole interval lies inside ``threshold +- margin``: the effect, whichever its
sign, is practically zero (checked before holds/contradicted, so a tiny but precisely measured effect
is negligible, not "holds").

Tests (:func:`sign_flip_p`, :func:`holm`): a two-sided paired permutation test over independent units
(:func:`scipy.stats.permutation_test`, signs of the paired differences flipped), and Holm's
step-down adjustment within a pre-registered family.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np
import pandas as pd
from scipy import integrate, stats as _scipy_stats

__all__ = [
    "CONTRADICTED", "HOLDS", "INCONCLUSIVE", "MIN_CLUSTERS", "NEGLIGIBLE", "NOT_MEASURED", "VERDICTS",
    "ClusterBootstrap", "Interval", "bootstrap_ci", "bootstrap_rows", "cluster_bootstrap", "combine_all", "combine_verdicts",
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
#: The one verdict vocabulary of the project, from strongest to weakest evidence (``negligible``: the
#: interval lies inside the equivalence margin, see :func:`verdict`).
VERDICTS = (HOLDS, CONTRADICTED, NEGLIGIBLE, INCONCLUSIVE, NOT_MEASURED)

_NAN = float("nan")

#: the fewest whole clusters a cluster bootstrap resamples to give an interval: with fewer (e.g. the three
#: global layers of Gemma 3 270M) the resamples take only a handful of distinct values, and a percentile
#: interval over them can be a point ("[0.75, 0.75]") that looks decisive; it is "not measured" instead
MIN_CLUSTERS = 5


class Interval(NamedTuple):
    """A point estimate with its confidence interval."""

    estimate: float
    low: float
    high: float


def _finite(values) -> np.ndarray:
    x = np.asarray(values, dtype=float).reshape(-1)
    return x[np.isfinite(x)]


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
    """``statistic`` of one value per independent unit, with a bootstrap interval (:func:`scipy.stats.bootstrap`).

    ``statistic`` takes an array and ``axis=`` (``np.mean``, ``np.median``, ...); ``method`` is
    ``"percentile"`` or ``"BCa"``.
    """
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
    """``statistic(x - y)`` over paired units (the same documents under two conditions), resampling pairs.

    Pairs where either value is NaN are dropped. Uses :func:`scipy.stats.bootstrap` with ``paired=True``.
    """
    _check_confidence(confidence)
    x, y = np.asarray(x, dtype=float).reshape(-1), np.asarray(y, dtype=float).reshape(-1)
    if x.shape != y.shape:
        raise ValueError(f"paired samples need equal lengths, got {x.size} and {y.size}")
    ok = np.isfinite(x) & np.isfinite(y)
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


def bootstrap_rows(matrix, statistic: Callable = np.nanmean, *, n_resamples: int = 1000, confidence: float = 0.95,
                   seed: int = 0, indices: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Percentile intervals for each row of ``matrix [group, unit]``, every row resampled with the same units.

    Returns ``(estimate [group], low [group], high [group])``. ``statistic`` must ignore NaN (a unit
    without a value in that row); rows with fewer than two finite units get a NaN interval.
    ``indices`` (from :func:`resample_indices`) fixes the resamples, e.g. to share them across calls.
    """
    _check_confidence(confidence)
    m = np.asarray(matrix, dtype=float)
    if m.ndim == 1:
        m = m[None]
    groups, units = m.shape
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows
        estimate = statistic(m, axis=1) if units else np.full(groups, _NAN)
        if units == 0:
            return estimate, np.full(groups, _NAN), np.full(groups, _NAN)
        idx = resample_indices(units, n_resamples, seed) if indices is None else np.asarray(indices)
        replicates = statistic(m[:, idx], axis=2)  # [group, resample]
        tail = (1 - confidence) / 2
        low, high = np.nanquantile(replicates, [tail, 1 - tail], axis=1)
    few = np.isfinite(m).sum(1) < 2
    low[few] = high[few] = _NAN
    return estimate, low, high


class ClusterBootstrap(NamedTuple):
    """The result of :func:`cluster_bootstrap`.

    ``table``: one row per group (the ``by`` keys, ``n`` rows, ``n_clusters``, each column's pooled
    estimate with ``<column>_low`` / ``<column>_high``); ``replicates``: ``{column: [n_resamples, group]}``
    in ``table``'s row order. The same resampled clusters serve every group and column, so two groups'
    replicates can be subtracted for a paired interval of their difference (:meth:`contrast`).
    """

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
    """Mean of ``values [units, replicates]`` (e.g. documents x seeds of a random control) with a percentile
    interval that resamples both factors: each resample draws the units and, independently, the
    replicates with replacement (the documents from :func:`resample_indices` with ``seed``, the
    replicates with ``seed + 1``) and averages the crossed cells, so the spread between replicates is in
    the interval as well as the spread between units. NaN with fewer than two units; one replicate gives
    the units-only bootstrap."""
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
    """Pooled means of ``columns`` per group ``by``, with intervals that resample whole clusters.

    The rows of one cluster (a document's queries and heads, a layer's heads) are not independent,
    so each resample draws the ``cluster`` values with replacement and pools the rows of every drawn
    cluster. The estimate of a column in a group is sum(w x) / sum(w) over its rows with a finite x
    (w = the ``weight`` column, or 1). Groups are in sorted order of ``by``. With fewer than two
    clusters the intervals are NaN.
    """
    _check_confidence(confidence)
    columns = [columns] if isinstance(columns, str) else list(columns)
    by = [by] if isinstance(by, str) else list(by)
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
        size = groups * n_clusters
        sums = np.bincount(cell[ok], weights=(w_all * x)[ok], minlength=size).reshape(groups, n_clusters)
        counts = np.bincount(cell[ok], weights=w_all[ok], minlength=size).reshape(groups, n_clusters)
        with np.errstate(invalid="ignore", divide="ignore"):
            table[column] = sums.sum(1) / counts.sum(1)
            replicates[column] = (draws @ sums.T) / (draws @ counts.T)
        table[f"{column}_low"], table[f"{column}_high"] = percentile_interval(replicates[column], confidence)
        if n_clusters < 2:
            table[f"{column}_low"] = table[f"{column}_high"] = np.nan
    return ClusterBootstrap(table, replicates, confidence)


def wilson_ci(successes: int, n: int, confidence: float = 0.95) -> Interval:
    """A proportion ``successes / n`` with its Wilson score interval (:func:`scipy.stats.binomtest`).

    Unlike a bootstrap, the interval does not collapse to a point when every unit agrees.
    """
    _check_confidence(confidence)
    if n <= 0:
        return Interval(_NAN, _NAN, _NAN)
    interval = _scipy_stats.binomtest(int(successes), int(n)).proportion_ci(confidence_level=confidence,
                                                                          method="wilson")
    return Interval(successes / n, float(interval.low), float(interval.high))


def share_ci(flags, confidence: float = 0.95) -> Interval:
    """The share of true ``flags`` (NaN/None dropped) with its Wilson interval (:func:`wilson_ci`)."""
    f = pd.Series(flags, dtype="object").dropna().astype(bool).to_numpy()
    return wilson_ci(int(f.sum()), len(f), confidence)


def spearman_ci(x, y, *, clusters=None, n_resamples: int = 1000, seed: int = 0, confidence: float = 0.95) -> Interval:
    """Spearman's rho of the pairs (x, y) with a percentile bootstrap interval resampling the pairs, or,
    with ``clusters`` (one label per pair, e.g. the layer of each head), resampling whole clusters with
    replacement and pooling their pairs (pairs of one cluster are not independent).

    Pairs with a NaN are dropped; ties get average ranks (:func:`scipy.stats.spearmanr`). NaN where
    undefined (fewer than three pairs, a constant variable; for the interval, fewer than
    :data:`MIN_CLUSTERS` clusters).
    """
    _check_confidence(confidence)
    x, y = np.asarray(x, dtype=float).reshape(-1), np.asarray(y, dtype=float).reshape(-1)
    ok = np.isfinite(x) & np.isfinite(y)
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
            with warnings.catch_warnings(), np.errstate(invalid="ignore", divide="ignore"):
                warnings.simplefilter("ignore")  # a constant resample gives NaN
                replicates[r] = _rowwise_spearman(x[rows], y[rows])
        replicates = replicates[np.isfinite(replicates)]
        if not len(replicates):
            return Interval(estimate, _NAN, _NAN)
        low, high = percentile_interval(replicates[:, None], confidence)
        return Interval(estimate, float(low[0]), float(high[0]))

    def rho(a, b, axis=-1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # constant resamples give NaN
            return _rowwise_spearman(a, b)

    result = _scipy_bootstrap((x, y), rho, paired=True, n_resamples=n_resamples, confidence_level=confidence,
                                    method="percentile", rng=np.random.default_rng(seed), vectorized=True, axis=-1)
    return Interval(estimate, float(result.confidence_interval.low), float(result.confidence_interval.high))


def _rowwise_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rho of each pair of rows, ``[..., n] x [..., n] -> [...]`` (Pearson of average ranks)."""
    ra, rb = _scipy_stats.rankdata(a, axis=-1), _scipy_stats.rankdata(b, axis=-1)
    ra, rb = ra - ra.mean(-1, keepdims=True), rb - rb.mean(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (ra * rb).sum(-1) / np.sqrt((ra**2).sum(-1) * (rb**2).sum(-1))


def trapezoid_mean(x, y, axis: int = -1) -> np.ndarray:
    """The mean of the curve y(x) over [x_0, x_last]: trapezoid area / width (:func:`scipy.integrate.trapezoid`).

    ``x`` ``[n]`` sorted; ``y`` ``[..., n]`` along ``axis``. A single point returns its value.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.size == 1:
        return np.take(y, 0, axis=axis)
    return integrate.trapezoid(y, x, axis=axis) / (x[-1] - x[0])


def min_detectable_effect(sd: float, n: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean difference a sample of ``n`` independent units with standard deviation
    ``sd`` detects with probability ``power`` in a two-sided test at level ``alpha``:
    (z_{1-alpha/2} + z_{power}) sd / sqrt(n). NaN with fewer than two units."""
    if n < 2 or not np.isfinite(sd):
        return _NAN
    z = _scipy_stats.norm.ppf(1 - alpha / 2) + _scipy_stats.norm.ppf(power)
    return float(z * sd / math.sqrt(n))


def mde_at_level(mde: float, alpha: float, *, from_alpha: float = 0.05, power: float = 0.8) -> float:
    """:func:`min_detectable_effect` computed at level ``from_alpha``, restated at level ``alpha`` (the
    same sample and power): ``mde * (z_{1-alpha/2} + z_power) / (z_{1-from_alpha/2} + z_power)``, e.g. a
    family's Holm-adjusted level."""
    z = _scipy_stats.norm.ppf(power)
    return float(mde * (_scipy_stats.norm.ppf(1 - alpha / 2) + z) / (_scipy_stats.norm.ppf(1 - from_alpha / 2) + z))


def detectable_from_interval(low: float, high: float, *, confidence: float = 0.95, alpha: float = 0.05,
                             power: float = 0.8) -> float:
    """The smallest distance from the threshold a test with this interval's precision detects with
    probability ``power`` at level ``alpha``, for an interval whose standard error is its half-width over
    z_{(1+confidence)/2} (a normal approximation, for intervals such as bootstraps and Wilson's that
    carry no standard deviation): (z_{1-alpha/2} + z_{power}) * SE. NaN without an interval."""
    if not (np.isfinite(low) and np.isfinite(high)):
        return _NAN
    se = (high - low) / (2 * _scipy_stats.norm.ppf((1 + confidence) / 2))
    return float((_scipy_stats.norm.ppf(1 - alpha / 2) + _scipy_stats.norm.ppf(power)) * se)


def verdict(low: float, high: float, *, threshold: float = 0.0, side: str = "above",
            margin: float | None = None) -> str:
    """The verdict on "the statistic is above (``side="above"``) / below ``threshold``" from its interval.

    :data:`NEGLIGIBLE` (only with a ``margin``): the whole interval lies strictly inside
    ``(threshold - margin, threshold + margin)``; otherwise :data:`HOLDS`: the whole interval is
    strictly on the claimed side; :data:`CONTRADICTED`: strictly on the other side;
    :data:`INCONCLUSIVE`: it contains or touches the threshold (a zero-width interval at the threshold
    included); :data:`NOT_MEASURED`: a bound is NaN.
    """
    if side not in ("above", "below"):
        raise ValueError(f"side must be 'above' or 'below', not {side!r}")
    if not (np.isfinite(low) and np.isfinite(high)):
        return NOT_MEASURED
    if margin is not None and np.isfinite(margin):
        if margin <= 0:
            raise ValueError(f"an equivalence margin must be positive, got {margin}")
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
    """Two-sided p-value of "the mean of the paired ``differences [units]`` is 0": a paired permutation
    test that flips the sign of each unit's difference (:func:`scipy.stats.permutation_test`,
    ``permutation_type="samples"``; exact when 2^n <= ``n_resamples``). NaN values are dropped; NaN with
    fewer than two units; 1.0 when every difference is 0."""
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
    """Holm's step-down adjusted p-values of one family ``[m]`` (same order; NaN counts as p = 1, so an
    unmeasured member keeps the family its pre-registered size). Sorted ascending, the k-th smallest
    (k = 1..m) becomes max over j <= k of min(1, (m - j + 1) p_(j)) (Holm 1979; the rule of
    ``statsmodels.stats.multitest.multipletests(method="holm")``, not a dependency here)."""
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
    """One verdict for a claim made of several parts: :data:`NOT_MEASURED` if no part was measured;
    :data:`CONTRADICTED` if any measured part is; :data:`HOLDS` if every measured part holds;
    :data:`NEGLIGIBLE` if every measured part is negligible; otherwise :data:`INCONCLUSIVE`. A claim
    that needs *every* part measured (the ladder's ordering) uses :func:`combine_all`."""
    return _combine(list(parts), require_all=False)


def combine_all(parts: Iterable[str]) -> str:
    """:func:`combine_verdicts` for a claim that holds only when *every* part is measured and holds
    (a chain such as 1 < 2 < 3 < 4): any contradicted part -> contradicted; otherwise any unmeasured
    part -> not measured; every part holds -> holds; every part negligible -> negligible; otherwise
    inconclusive."""
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
