"""The book's evidence design for section 5: which protocols, ratio ranges and importance signs the
ladder is judged under, and one call that runs them all on one sample of documents."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd

import numpy as np

from cwcore import stats
from cwcore.core.decomposition import METRICS
from cwcore.data import document_blocks, load_dataset
from cwcore.faithfulness.protocol import DEFAULT_RATIOS, VARIANTS, Protocol, identical_steps, parse_metric
from cwcore.faithfulness.methods import random_controls
from cwcore.faithfulness.summary import aopc, ladder_comparison, random_baseline
from .cached import per_sequence_curve

PROTOCOLS = {"default": {}, "per-head": {"kind": "intra"}}
#: the removal-unit variants a ladder run can add under the ``default`` protocol, by name
#: (:data:`cwcore.faithfulness.protocol.VARIANTS`): the protocol fields each one changes
VARIANT_CHANGES = {name: {field_name: value} for (field_name, value), name in VARIANTS.items()}
LOW_RATIOS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05)
PAPER_RATIOS = DEFAULT_RATIOS
LOW_MAX = max(LOW_RATIOS)  # the top of the default low grid; a run's is RatioGrids.low_max
IMPORTANCES = ("signed", "absolute")
SIGN_INVARIANT = tuple(str(r) for r in METRICS if r.nonnegative) + ("random",)  # never negative

#: the equivalence margin of an AOPC difference per mode, in nats of log-perplexity, fixed before the
#: remaining evidence was computed (book/preregistration.md): 0.01 nats is a 1% change of perplexity
#: averaged over the removal curve, below what would tell two attribution methods apart in practice.
#: Both modes measure the same quantity (a mean Delta log PPL), so they share the value.
MARGINS = {"comprehensiveness": 0.01, "sufficiency": 0.01}
#: the level of the primary family's Holm-adjusted tests
ALPHA = 0.05
#: resamples of the sign-flip permutation test of each step (the smallest p is 1 / (N + 1))
N_PERMUTATIONS = 9999
#: the pre-registered primary family (book/preregistration.md): for each model and data set, in both
#: modes, under the headline importance and ratio range, each of these (lower, higher) rung pairs under
#: the protocol where the pair is measured. Everything else is secondary (exploratory).
PRIMARY = {
    "models": ("smollm2-135m", "gemma3-270m"),
    "data": ("gsm8k", "web-text"),
    "modes": ("comprehensiveness", "sufficiency"),
    "importance": "absolute",
    "range": "full",
    "pairs": (("attention", "value_weighted", "default"),
              ("value_weighted", "value_weighted_output_normalized", "per-head"),
              ("value_weighted_output_normalized", "contribution", "default"),
              ("random", "contribution", "default")),
}


def ratio_grid(low: Sequence[float] = LOW_RATIOS, paper: Sequence[float] = PAPER_RATIOS) -> list[float]:
    """The low grid and the paper's grid, merged, sorted and deduplicated."""
    return sorted({float(r) for r in (*low, *paper)})


def ranges(ratios: Sequence[float], low_max: float = LOW_MAX) -> dict[str, float | None]:
    """``{"low": low_max, "full": None}``, less the low range when no ratio lies at or below it, and
    less the full range when it would be the low one."""
    out: dict[str, float | None] = {}
    if any(r <= low_max for r in ratios):
        out["low"] = low_max
    if not out or max(ratios) > low_max:
        out["full"] = None
    return out


def _floats(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(sorted({float(r) for r in values}))


@dataclass(frozen=True)
class RatioGrids:
    """The two named ratio grids of a ladder run: ``low`` (the gentle range: the low-range AOPC runs up
    to its top, :attr:`low_max`) and ``paper`` (the paper's grid). A run removes the fractions of both,
    merged (:attr:`ratios`); the full range spans them all."""

    low: tuple[float, ...] = LOW_RATIOS
    paper: tuple[float, ...] = PAPER_RATIOS

    def __post_init__(self):
        object.__setattr__(self, "low", _floats(self.low))
        object.__setattr__(self, "paper", _floats(self.paper))

    @property
    def ratios(self) -> list[float]:
        """Both grids merged, sorted and deduplicated (:func:`ratio_grid`): the fractions a run removes."""
        return ratio_grid(self.low, self.paper)

    @property
    def low_max(self) -> float | None:
        """The end of the low range: the top of the low grid (None without a low grid)."""
        return max(self.low) if self.low else None

    def ranges(self, ratios: Sequence[float] | None = None) -> dict[str, float | None]:
        """:func:`ranges` of ``ratios`` (default :attr:`ratios`) with the low range ending at :attr:`low_max`."""
        ratios = self.ratios if ratios is None else sorted(float(r) for r in ratios)
        return {"full": None} if self.low_max is None else ranges(ratios, self.low_max)

    def restrict(self, ratios: Sequence[float]) -> "RatioGrids":
        """The grids less every fraction not in ``ratios`` (matched to 1e-9 relative): a slice of a run
        keeps the names of its grids."""
        keep = [float(r) for r in ratios]
        unknown = [r for r in keep if not any(np.isclose(r, g, rtol=1e-9, atol=0) for g in self.ratios)]
        if unknown:
            raise ValueError(f"ratios {unknown} are in neither grid {self.as_dict()}")
        inside = lambda grid: [g for g in grid if any(np.isclose(g, r, rtol=1e-9, atol=0) for r in keep)]  # noqa: E731
        return RatioGrids(inside(self.low), inside(self.paper))

    def as_dict(self) -> dict[str, list[float]]:
        """``{"low": [...], "paper": [...]}`` (for a JSON file; ``RatioGrids(**d)`` reads it back)."""
        return {"low": list(self.low), "paper": list(self.paper)}


def random_seeds_of(seed: int, n_seeds: int) -> list[int]:
    """The seeds of the random control with ``n_seeds`` seeds: the protocol's ``seed`` (the ``random``
    metric) and the next ``n_seeds - 1`` integers (:data:`RANDOM_PREFIX` labels)."""
    if int(n_seeds) < 1:
        raise ValueError(f"the random control needs at least one seed, got random_seeds={n_seeds!r}")
    return [int(seed) + k for k in range(int(n_seeds))]


def extra_seed_labels(metrics: Sequence, seed: int, random_seeds: int) -> list[str]:
    """The metric labels :func:`ladder_sweep` adds for the random control's seeds after the first
    (``random_s<seed>``; none unless ``"random"`` is among ``metrics`` and ``random_seeds`` > 1)."""
    if "random" not in list(metrics) or int(random_seeds) <= 1:
        return []
    return [f"{RANDOM_PREFIX}{s}" for s in random_seeds_of(seed, random_seeds)[1:]]


def sweep_order(rows: pd.DataFrame, metrics: Sequence[str], importances: Sequence[str] = IMPORTANCES,
                modes: Sequence[str] | None = None, kind: str = "inter") -> pd.DataFrame:
    """``rows`` of one :func:`ladder_sweep` cell (assembled from pieces: committed documents, slices)
    in the order :func:`ladder_sweep` returns them: importance as given, then its metrics in the
    sweep's order (the absolute sign: the reused sign-invariant rows first), mode as given, ratio,
    sequence. ``metrics``: the metric labels of the cell (extra seeds included), as requested."""
    from cwcore.faithfulness.ranking import MODES

    modes = list(modes or MODES)
    metrics = [str(m) for m in metrics]
    order = []
    for i, importance in enumerate(importances):
        listed = metrics
        if importance == "absolute" and "signed" in list(importances)[:i]:
            reused = lambda m: m.startswith(RANDOM_PREFIX) or parse_metric(m, kind).name in SIGN_INVARIANT  # noqa: E731
            listed = [m for m in metrics if reused(m)] + [m for m in metrics if not reused(m)]
        order += [(importance, m) for m in listed]
    position = {key: i for i, key in enumerate(order)}
    keys = pd.DataFrame({"p": [position.get(k, len(order)) for k in zip(rows["importance"], rows["metric"])],
                         "o": rows["mode"].map({m: i for i, m in enumerate(modes)}),
                         "r": rows["ratio"].astype(float), "s": rows["sequence"]}, index=rows.index)
    return rows.loc[keys.sort_values(["p", "o", "r", "s"], kind="stable").index].reset_index(drop=True)


def ladder_sweep(model, tokenizer, blocks, metrics, ratios, modes=None, *, protocol: str = "default",
                 importances: Sequence[str] = IMPORTANCES, random_seeds: int = 1, extra_seeds_only: bool = False,
                 **kwargs) -> pd.DataFrame:
    """The per-sequence table of :func:`~cwcore.faithfulness.faithfulness_curve` under one main
    ``protocol`` (a key of :data:`PROTOCOLS`) for every importance sign, stacked, with a ``protocol``
    column."""
    change = {**PROTOCOLS[protocol], **kwargs.pop("protocol_change", {})}
    kind = change.get("kind", kwargs.get("kind", "inter"))
    extra = {}
    if "random" in metrics and int(random_seeds) > 1:
        extra = random_controls(random_seeds_of(kwargs.get("seed", 0), random_seeds)[1:])
    if extra_seeds_only and not extra:
        raise ValueError("extra_seeds_only needs 'random' among the metrics and random_seeds > 1")
    base = [] if extra_seeds_only else list(metrics)
    frames = []
    signed = None
    for importance in importances:
        chosen = base + ([extra] if extra else [])
        if importance == "absolute" and signed is not None:  # the extra seeds are sign-invariant too
            chosen = [m for m in base if parse_metric(m, kind).name not in SIGN_INVARIANT]
        part = None
        if chosen:
            part = per_sequence_curve(model, tokenizer, blocks, chosen, ratios, modes, importance=importance,
                                      **{**kwargs, **change})
        if importance == "absolute" and signed is not None:
            reused = signed[signed["metric"].map(lambda m: m in extra or parse_metric(m, kind).name in SIGN_INVARIANT)]
            part = pd.concat([reused.assign(importance="absolute"), part], ignore_index=True)
        if importance == "signed":
            signed = part
        frames.append(part)
    return pd.concat(frames, ignore_index=True).assign(protocol=protocol)


def evidence_tables(per_sequence: pd.DataFrame, *, grids: RatioGrids | None = None, n_bootstrap: int = 1000,
                    seed: int = 0, low_max: float | None = None, confidence: float = 0.95,
                    n_permutations: int = N_PERMUTATIONS) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(AOPC, ladder) of a :func:`ladder_sweep` table (one or several protocols, stacked) over each
    ratio range of :meth:`RatioGrids.ranges` (the low range ends at the top of ``grids.low``; or at
    ``low_max`` where no grids are given; neither: the default grids'), with columns ``protocol`` and
    ``range``."""
    if grids is not None and low_max is not None:
        raise TypeError("give grids or low_max, not both (the low range ends at the top of grids.low)")
    if low_max is not None:
        split = lambda ratios: ranges(ratios, low_max)  # noqa: E731
    else:
        split = (grids or RatioGrids()).ranges
    areas, ladders = [], []
    for protocol, part in per_sequence.groupby("protocol", sort=False):
        part = part.drop(columns="protocol")
        for name, max_ratio in split(sorted(part["ratio"].unique())).items():
            kw = dict(n_bootstrap=n_bootstrap, seed=seed, confidence=confidence, max_ratio=max_ratio)
            area, ladder = with_seed_spread(part, aopc(part, **kw), ladder_comparison(part, n_permutations=n_permutations,
                                                                                      **kw), n_permutations, **kw)
            areas.append(area.assign(protocol=protocol, range=name))
            ladders.append(ladder.assign(protocol=protocol, range=name))
    return pd.concat(areas, ignore_index=True), judge(pd.concat(ladders, ignore_index=True))


@dataclass
class LadderRun:
    """Chapter 4's ladder sweeps on one sample (:func:`ladder_evidence`): the per-sequence rows of every
    data set, main protocol and importance sign, with what they were run with."""

    per_sequence: pd.DataFrame  # ladder_sweep rows with a ``data`` column, data sets then protocols in run order
    grids: RatioGrids  # the named grids the rows were run at
    blocks: dict = field(default_factory=dict)  # {data set: its document blocks}
    n_bootstrap: int = 1000
    seed: int = 0
    seconds: dict = field(default_factory=dict)  # {(data set, protocol): wall seconds of its sweep}
    variant_rows: pd.DataFrame | None = None  # the variant cells' rows (``default`` protocol, a ``variant`` column)

    def tables(self, n_permutations: int = N_PERMUTATIONS) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(AOPC, ladder): :func:`evidence_tables` of each data set at the run's grids, stacked with a
        ``data`` column."""
        return self._tables(self.per_sequence, n_permutations)

    def variant_tables(self, n_permutations: int = N_PERMUTATIONS) -> tuple[pd.DataFrame, pd.DataFrame]:
        """(AOPC, ladder) of the variant cells (:attr:`variant_rows`), as :meth:`tables` (empty without)."""
        if self.variant_rows is None or self.variant_rows.empty:
            return pd.DataFrame(), pd.DataFrame()
        return self._tables(self.variant_rows, n_permutations)

    def _tables(self, rows: pd.DataFrame, n_permutations: int) -> tuple[pd.DataFrame, pd.DataFrame]:
        areas, ladders = [], []
        for data, part in rows.groupby("data", sort=False):
            a, l = evidence_tables(part.drop(columns="data"), grids=self.grids, n_bootstrap=self.n_bootstrap,
                                   seed=self.seed, n_permutations=n_permutations)
            areas.append(a.assign(data=data))
            ladders.append(l.assign(data=data))
        return pd.concat(areas, ignore_index=True), pd.concat(ladders, ignore_index=True)

    def curves(self) -> pd.DataFrame:
        """The signed curves (:func:`~cwcore.faithfulness.summarize`) per data set and protocol, with
        ``data`` and ``protocol`` columns (the random control at the protocol's seed only)."""
        from cwcore.faithfulness.summary import summarize

        curves = []
        rows = self.per_sequence
        signed = rows[(rows["importance"] == "signed") & ~rows["metric"].astype(str).str.startswith(RANDOM_PREFIX)]
        for (data, protocol), part in signed.groupby(["data", "protocol"], sort=False):
            curves.append(summarize(part.drop(columns=["data", "protocol"]), n_bootstrap=self.n_bootstrap,
                                    seed=self.seed).assign(data=data, protocol=protocol))
        return pd.concat(curves, ignore_index=True)


def ladder_evidence(model, tokenizer, *, datasets: Sequence[str], n_sequences: int, seq_len: int,
                    low_ratios: Sequence[float], ratios: Sequence[float], protocols: Sequence[str],
                    importances: Sequence[str], metrics: Sequence[str], n_bootstrap: int, seed: int,
                    batch_size: int, random_seeds: int = 1, variants: Sequence[str] = (),
                    variant_models: Sequence[str] | None = None, model_name: str | None = None, cache: bool = True,
                    progress: bool = False, sweep: Callable | None = None, **kwargs) -> LadderRun:
    """Chapter 4's ladder sweeps: for each data set, ``n_sequences`` documents of one ``seq_len``-token
    block each (:func:`cwcore.data.document_blocks`), and for each main ``protocol``, :func:`ladder_sweep`
    over ``metrics`` at both named grids (``low_ratios``, the paper's ``ratios``; see :class:`RatioGrids`)
    for every importance sign."""
    unknown = [v for v in variants if v not in VARIANT_CHANGES]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {sorted(VARIANT_CHANGES)}")
    if variant_models is not None and model_name not in variant_models:
        variants = ()
    grids = RatioGrids(low_ratios, ratios)
    common = dict(n_bootstrap=n_bootstrap, seed=seed, batch_size=batch_size, max_length=seq_len,
                  random_seeds=random_seeds, progress=progress, cache=cache, **kwargs)
    run_cell = sweep or (lambda *args, data, **kw: ladder_sweep(*args, **kw))  # noqa: E731 - data names the cell only
    blocks, parts, varied, seconds = {}, [], [], {}
    cells = [(protocol, None) for protocol in protocols] + [("default", v) for v in variants]
    for data in datasets:
        blocks[data] = document_blocks(load_dataset(data), tokenizer, seq_len, n_sequences, seed=seed)
        for protocol, variant in cells:
            t0 = time.monotonic()
            call = {**common, **({"protocol_change": VARIANT_CHANGES[variant]} if variant else {})}
            cell = run_cell(model, tokenizer, blocks[data], metrics, grids.ratios, protocol=protocol,
                            importances=importances, data=data, **call)
            (varied if variant else parts).append(cell.assign(data=data))
            seconds[(data, protocol if variant is None else f"{protocol}/{variant}")] = time.monotonic() - t0
    return LadderRun(pd.concat(parts, ignore_index=True), grids, blocks, n_bootstrap, seed, seconds,
                     pd.concat(varied, ignore_index=True) if varied else None)


def variant_changes(main: pd.DataFrame, variant: pd.DataFrame) -> pd.DataFrame:
    """Each ladder step of the variant cells beside the same step of the main protocols (same protocol,
    data set, mode, sign and range; the removal-unit variants run under ``default``, a weights variant
    under every main protocol): ``difference`` and ``verdict`` of both, and ``changed`` where the
    verdicts differ."""
    if variant.empty:
        return pd.DataFrame()
    keys = [c for c in ("protocol", "data", "mode", "importance", "range", "lower", "higher")
            if c in variant and c in main]
    base = main.set_index(keys)[["difference", "verdict"]].add_suffix("_main")
    out = variant[[*keys, "variant", "difference", "verdict"]].join(base, on=keys)
    out["changed"] = out["verdict"] != out["verdict_main"]
    return out.reset_index(drop=True)


#: the label prefix of the random control's extra seeds (:func:`ladder_sweep` with ``random_seeds`` > 1)
RANDOM_PREFIX = "random_s"
_FILLED = ("difference", "ci_low", "ci_high", "sd", "mde", "p", "verdict")


def with_seed_spread(per_sequence: pd.DataFrame, areas: pd.DataFrame, ladder: pd.DataFrame,
                     n_permutations: int | None = None, **kw) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(AOPC, ladder) of one protocol's sweep with the ``random`` rung averaged over the random control's
    seeds when the sweep ran several (``random`` and ``random_s<seed>`` metrics, :func:`ladder_sweep`):
    the AOPC row of ``random`` and every ladder row against it take
    :func:`~cwcore.faithfulness.summary.random_baseline`'s values (documents and seeds resampled together:
    the seed spread is in the interval; ``sd``, ``mde`` and ``p`` over documents of the difference to the
    seeds' mean), with columns ``n_seeds`` and ``seeds``."""
    extra = [m for m in dict.fromkeys(per_sequence["metric"]) if str(m).startswith(RANDOM_PREFIX)]
    areas = areas[~areas["metric"].isin(extra)].copy()
    ladder = ladder[~ladder["lower"].isin(extra) & ~ladder["higher"].isin(extra)].copy()
    if not extra or "random" not in set(per_sequence["metric"]):
        return areas, ladder
    controls = ["random", *extra]
    against = list(dict.fromkeys(ladder.loc[ladder["lower"] == "random", "higher"]))
    rb = random_baseline(per_sequence, against=against, controls=controls, n_permutations=n_permutations, **kw)
    keys = [c for c in rb.columns if c in ladder.columns
            and c not in (*_FILLED, "value", "n", "sample_unit", "r_max", "n_seeds", "seeds", "aopc", "seed_sd")]
    gaps = rb[rb["metric"] != "random"].rename(columns={"metric": "higher"}).set_index([*keys, "higher"])
    target = ladder.set_index([*keys, "higher"]).index
    hit = (ladder["lower"] == "random").to_numpy() & target.isin(gaps.index)
    found = gaps.reindex(target[hit])
    for column in (*(c for c in _FILLED if c in gaps), "n_seeds"):
        ladder.loc[hit, column] = found[column].to_numpy()
    numbers = sorted(int(m[len(RANDOM_PREFIX):]) for m in extra)  # the protocol's seed is the one before
    ladder.loc[hit, "seeds"] = ",".join(str(s) for s in [numbers[0] - 1, *numbers])
    ladder.loc[hit, "aopc_lower"] = found["aopc"].to_numpy() - found["difference"].to_numpy()
    for value, column in (("delta_nll", "aopc_nll"), ("delta_ppl", "aopc_ppl")):
        if column not in areas:
            continue
        noise = rb if value == "delta_nll" else random_baseline(per_sequence, against=(), value=value,
                                                                 controls=controls, **kw)
        noise = noise[noise["metric"] == "random"].set_index(keys)
        rows = (areas["metric"] == "random").to_numpy()
        found = noise.reindex(areas.set_index(keys).index[rows])
        areas.loc[rows, column] = found["aopc"].to_numpy()
        areas.loc[rows, f"{column}_ci_low"] = found["ci_low"].to_numpy()
        areas.loc[rows, f"{column}_ci_high"] = found["ci_high"].to_numpy()
        areas.loc[rows, "n_seeds"] = found["n_seeds"].to_numpy()
    return areas, ladder


def identical_by_construction(protocol: str, lower: str, higher: str) -> bool:
    """Whether main ``protocol`` (a key of :data:`PROTOCOLS`) ranks rungs ``lower`` and ``higher``
    identically by construction (:func:`cwcore.faithfulness.protocol.identical_steps`: under
    ``default``, rung 3 divides rung 2 by ||o_i||, one number per query row)."""
    return (lower, higher) in identical_steps(Protocol(**PROTOCOLS.get(protocol, {})))


def judge(ladder: pd.DataFrame, margins: dict | None = None) -> pd.DataFrame:
    """A :func:`~cwcore.faithfulness.ladder_comparison` table (with a ``protocol`` column, or the
    default protocol) judged by the pre-registered rule: column ``margin`` (:data:`MARGINS` of the
    row's mode) and ``verdict`` = :func:`cwcore.stats.verdict` of the interval against 0 on the mode's
    side with that margin, or not measured where the protocol ranks the pair identically (the table's
    ``identical`` column, else :func:`identical_by_construction`). Returns a copy."""
    margins = MARGINS if margins is None else margins
    out = ladder.copy()
    if out.empty:
        return out.assign(margin=pd.Series(dtype=float))
    protocols = out["protocol"] if "protocol" in out else pd.Series("default", index=out.index)
    given = out["identical"] if "identical" in out else pd.Series(None, index=out.index, dtype=object)
    out["margin"] = [float(margins.get(m, np.nan)) for m in out["mode"]]
    verdicts = []
    for protocol, identical, (_, r) in zip(protocols, given, out.iterrows()):
        if not isinstance(identical, (bool, np.bool_)):
            identical = identical_by_construction(protocol, r["lower"], r["higher"])
        if identical:
            verdicts.append(stats.NOT_MEASURED)
            continue
        side = "above" if r["mode"] == "comprehensiveness" else "below"
        verdicts.append(stats.verdict(r["ci_low"], r["ci_high"], threshold=0.0, side=side,
                                      margin=r["margin"] if np.isfinite(r["margin"]) else None))
    out["verdict"] = verdicts
    return out


def primary_family(models=None, data=None) -> list[dict]:
    """The pre-registered primary family (:data:`PRIMARY`), one dict per test: ``model, data, mode,
    protocol, importance, range, lower, higher`` (``models``/``data`` default to PRIMARY's)."""
    return [{"model": m, "data": d, "mode": mode, "protocol": protocol, "importance": PRIMARY["importance"],
             "range": PRIMARY["range"], "lower": lower, "higher": higher}
            for m in (models or PRIMARY["models"]) for d in (data or PRIMARY["data"])
            for lower, higher, protocol in PRIMARY["pairs"] for mode in PRIMARY["modes"]]


def is_primary(model: str, data: str, mode: str, protocol: str, importance: str, range_: str,
               lower: str, higher: str) -> bool:
    """Whether this ladder comparison is a member of the primary family."""
    return (model in PRIMARY["models"] and data in PRIMARY["data"] and mode in PRIMARY["modes"]
            and importance == PRIMARY["importance"] and range_ == PRIMARY["range"]
            and (lower, higher, protocol) in PRIMARY["pairs"])
