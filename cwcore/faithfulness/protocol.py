"""The protocol of the paper's section 'Faithfulness by causal intervention': which metric ranks the terms, how, and where.

:class:`Protocol` holds the choices (unit, scope, layers, first token, clean or live scores, kind,
importance, seed; the package docstring gives each default's reason); :func:`parse_metric` turns
a metric name into a :class:`MetricSpec`; :func:`layer_windows` and :func:`layer_heads` read what the
protocol needs from a model's config.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

import torch

from ..core.decomposition import METRICS
from ..core.inputs import InputTypeError, did_you_mean, is_integer_number, is_seed
from . import methods as _methods
from .ranking import MODES, SCOPES, UNITS, layer_heads, layer_windows  # noqa: F401  (re-exported)

__all__ = [
    "DEFAULT_RATIOS",
    "REMOVALS",
    "DEFAULT_METRICS",
    "LADDER",
    "KINDS",
    "MetricSpec",
    "parse_metric",
    "Protocol",
    "PROTOCOL_FIELDS",
    "as_protocol",
    "refuse_removed",
    "VARIANTS",
    "layer_windows",
    "layer_heads",
    "ranking_identity",
    "same_ranking",
    "identical_steps",
]

#: how a removed term leaves the head output (:attr:`Protocol.removal`)
REMOVALS = ("zero", "mean")
DEFAULT_RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
#: The geometric ladder (the paper's section 'The metrics compared'), least to most geometric.
LADDER = METRICS
DEFAULT_METRICS = METRICS + ("random",)
KINDS = ("inter", "intra")
_RUNGS = {str(rung): rung for rung in METRICS}


@dataclass(frozen=True)
class MetricSpec:
    """One ranked metric: ``label`` (column value), ``name`` (a registered method's name, ``"callable"``
    or ``"precomputed"``), ``kind``, the :class:`~cwcore.faithfulness.methods.Method` that scores it and
    ``key``, its identity in cached piece names (the label for the ladder and random)."""

    label: str
    name: str
    kind: str
    method: Any = field(default=None, compare=False, repr=False)
    key: str = ""

    def __post_init__(self):
        if self.method is None and self.name in _methods.available_methods():
            object.__setattr__(self, "method", _methods.get_method(self.name))

    @property
    def piece_key(self) -> str:
        return self.key or self.label


def parse_metric(metric, kind: str = "inter", label: str | None = None) -> MetricSpec:
    """A metric as a :class:`MetricSpec`: a registered name (``"contribution"``, ``"contribution_intra"``,
    ``"value_zeroing"``, ``"random"``, ...: :func:`cwcore.faithfulness.methods.available_methods`), a
    callable (see :mod:`cwcore.faithfulness.methods`), or precomputed scores (a tensor or a
    ``{layer: tensor}`` dict, see :func:`~cwcore.faithfulness.methods.precomputed`).

    The label of a name is the name with a ``_<kind>`` suffix only when the kind differs from the
    default ``kind`` (and matters: only value_weighted_output_normalized and contribution have one);
    a callable's label is its ``__name__``; ``label`` replaces either.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    if isinstance(metric, (torch.Tensor, Mapping)):
        method = _methods.precomputed(metric, label or "precomputed")
        return MetricSpec(method.name, "precomputed", "", method, method.key)
    if callable(metric):  # it reads the protocol's kind from its context (the sweep's kind; before: always "inter")
        method = _methods.as_method(metric, label)
        return MetricSpec(method.name, "callable", "", method,
                          method.key if kind == "inter" else f"{method.key}-{kind}")
    if not isinstance(metric, str):
        raise TypeError(f"a metric is a name, a callable or precomputed scores, not {type(metric).__name__}")
    match = re.fullmatch(r"(.+?)(?:_(inter|intra))?", metric)
    base, suffix = match.group(1), match.group(2)
    if base not in _methods.available_methods() or (suffix and metric in _methods.available_methods()):
        base, suffix = metric, None
    method = _methods.get_method(base)
    code = _methods.code_identity(method)  # a user's registered function: its code and what it reads

    def spec(shown: str, chosen: str, key: str) -> MetricSpec:
        return MetricSpec(shown, base, chosen, method, f"{key or shown}-{code}" if code else key)

    if not method.kind_dependent:
        if suffix:
            raise ValueError(f"metric {base!r} has no intra/inter kind")
        return spec(label or base, "", base if label else "")
    chosen = suffix or kind
    default = base if chosen == kind else f"{base}_{chosen}"
    return spec(label or default, chosen, default if label else "")


#: fields added to :class:`Protocol` after results were cached and exported, each with its default: the settings
#: leave a field out at its default (a new field with a default that changes nothing goes here)
LATER_FIELDS = {"removal": "zero"}


@dataclass(frozen=True)
class Protocol:
    """The choices of the paper's section 'Faithfulness by causal intervention' (see :mod:`cwcore.faithfulness` for the defaults' reasons)."""

    unit: str = "head_key"
    scope: str = "row"
    layers: tuple[int, ...] | None = None
    keep_first_token: bool = True
    scores: str = "clean"
    kind: str = "inter"
    importance: str = "signed"
    seed: int = 0
    #: how a removed term leaves the head output: ``"zero"`` (alpha_ij zeroed, no renormalisation: the term is
    #: gone) or ``"mean"`` (in distribution: alpha_ij v_j replaced by alpha_ij mu_h, mu_h head h's mean value
    #: vector estimated on the *other* documents of the call, see :func:`cwcore.faithfulness.sweep.stand_ins`)
    removal: str = "zero"

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"unit must be one of {UNITS}, not {self.unit!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, not {self.scope!r}")
        if self.scores not in ("clean", "live"):
            raise ValueError(f"scores must be 'clean' or 'live', not {self.scores!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {self.kind!r}")
        if self.importance not in ("signed", "absolute"):
            raise ValueError(f"importance must be 'signed' or 'absolute', not {self.importance!r}")
        if self.removal not in REMOVALS:
            raise ValueError(f"removal must be one of {REMOVALS}, not {self.removal!r}")
        if not isinstance(self.keep_first_token, bool):  # "False" is truthy: the opposite protocol ran
            raise TypeError(f"keep_first_token must be True or False, not {self.keep_first_token!r}")
        if not is_seed(self.seed) or self.seed >= 2 ** 63:
            raise TypeError(f"seed must be an int in 0 .. 2**63 - 1, not {self.seed!r}")
        if self.layers is not None:
            layers = [self.layers] if isinstance(self.layers, (int, str, float)) else list(self.layers)
            if any(not is_integer_number(layer) for layer in layers):  # 1.5, "1" and True were cut to ints
                raise InputTypeError(f"layers must hold layer numbers (int), got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(sorted({int(layer) for layer in layers})))
        object.__setattr__(self, "seed", int(self.seed))

    def settings(self) -> dict:
        """The fields as a dict (``dataclasses.asdict``), the identity of cached pieces and exports, without the
        fields of :data:`LATER_FIELDS` at their defaults: a run at those defaults has the settings it had before
        the field existed, so its cached pieces and committed exports stay valid."""
        out = asdict(self)
        for name, default in LATER_FIELDS.items():
            if out[name] == default:
                del out[name]
        return out

    @property
    def variant(self) -> str:
        """Which variant of the removal unit this is, against the main protocols' shared choices (unit
        ``head_key``, scope ``row``, clean scores, first token kept, all layers, zeroing removal; the main
        protocols differ only in ``kind`` and the sign): ``"main"``, or the deviations joined by ``+``, named by
        :data:`VARIANTS` (``"token-unit"``: the paper's token-level unit, a key removed from every head;
        ``"first-token-removable"``) or ``field=value``."""
        parts = []
        for name, main in _MAIN_CHOICES.items():
            value = getattr(self, name)
            if value != main:
                parts.append(VARIANTS.get((name, value), f"{name}={_column_value(name, value)}"))
        return "+".join(parts) or "main"

    def columns(self) -> dict:
        """The protocol as tidy-table columns."""
        return {
            "unit": self.unit, "scope": self.scope, "scores": self.scores,
            "keep_first_token": self.keep_first_token, "importance": self.importance,
            "layers": "all" if self.layers is None else ",".join(map(str, self.layers)),
            "variant": self.variant,
        }


#: the choices every main protocol shares (they differ in ``kind`` and ``importance`` only)
_MAIN_CHOICES = {"unit": "head_key", "scope": "row", "scores": "clean", "keep_first_token": True, "layers": None,
                 "removal": "zero"}
#: named variants of the removal unit (the paper's section 'Faithfulness by causal intervention': the paper masks the values of tokens)
VARIANTS = {("unit", "token"): "token-unit", ("keep_first_token", False): "first-token-removable"}
#: the fields of :class:`Protocol`, the only protocol keywords the entry points take
PROTOCOL_FIELDS = tuple(f.name for f in fields(Protocol))


#: keywords the entry points no longer take, and what replaces each
REMOVED_KEYWORDS = {
    "cache": "caching is opt-in around the call: `with cwcore.cache.caching(): ...`",
    "cache_dir": "caching is opt-in around the call: `with cwcore.cache.caching(folder): ...`",
    "per_sequence": "the result holds both layouts: read `.per_sequence` (or `.table`) of what it returns",
    "first_sequence": "give `sequence_ids=range(first, first + n)` (the texts' ids)",
}


def refuse_removed(caller: str, keywords: Mapping, names=tuple(REMOVED_KEYWORDS)) -> None:
    """Raise a one-line :class:`TypeError` for a keyword of :data:`REMOVED_KEYWORDS` (those of ``names``)
    in ``keywords``, saying what replaces it."""
    for name in keywords:
        if name in names:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}: {REMOVED_KEYWORDS[name]}")


def refuse_unknown(caller: str, keywords: Mapping, options) -> None:
    """Raise a one-line :class:`TypeError` for a keyword of ``keywords`` that is no protocol field, suggesting
    the closest of the caller's own ``options`` (its parameter names) and the protocol's fields: ``ratio``
    gets "did you mean 'ratios'?"."""
    unknown = sorted(set(keywords) - set(PROTOCOL_FIELDS))
    if unknown:
        hints = ", ".join(f"{name!r}" + did_you_mean(name, [*options, *PROTOCOL_FIELDS]) for name in unknown)
        raise InputTypeError(f"{caller}() got unexpected keyword argument(s) {hints}; it takes {', '.join(options)} "
                             f"and the protocol's fields {', '.join(PROTOCOL_FIELDS)}")


def _column_value(name: str, value):
    return ("all" if value is None else ",".join(map(str, value))) if name == "layers" else value


def as_protocol(protocol: "Protocol | Mapping | None" = None, **keywords) -> Protocol:
    """One :class:`Protocol` from ``protocol`` (a Protocol, a mapping of its fields, or None = the
    defaults) with ``keywords`` (any of :data:`PROTOCOL_FIELDS`) replacing its fields: the entry points'
    ``protocol=`` argument, and their old per-field keywords. An unknown keyword is an error."""
    unknown = sorted(set(keywords) - set(PROTOCOL_FIELDS))
    if unknown:
        raise TypeError(f"unknown protocol keyword(s) {unknown}; a protocol has {list(PROTOCOL_FIELDS)}")
    if protocol is None:
        base = Protocol()
    elif isinstance(protocol, Protocol):
        base = protocol
    elif isinstance(protocol, Mapping):
        base = as_protocol(None, **protocol)
    else:
        raise TypeError(f"protocol must be a Protocol or a mapping of its fields, not {type(protocol).__name__}")
    if keywords.get("layers") is not None:
        keywords["layers"] = tuple(keywords["layers"])
    return replace(base, **keywords) if keywords else base


def model_protocol(model, protocol=None, **keywords) -> Protocol:
    """:func:`as_protocol` with its ``layers`` read against ``model`` as every entry point reads layers (one
    number, or negative ones counting from the last), whether given as a keyword or in a protocol object."""
    from ..core.architectures import attention_blocks
    from ..core.inputs import check_layers

    count = len(attention_blocks(model))
    if keywords.get("layers") is not None:
        keywords["layers"] = check_layers(keywords["layers"], count)
    protocol = as_protocol(protocol, **keywords)
    if protocol.layers is not None:
        protocol = replace(protocol, layers=tuple(check_layers(list(protocol.layers), count)))
    return protocol


# -- rankings identical by construction ------------------------------------------------------------
def _constant_within_group(kind: str, unit: str, scope: str) -> bool:
    """Whether the output norm of ``kind`` is one number within every group the protocol ranks together:
    ||o_i|| (inter) is shared by the heads and keys of a query row, ||o^h_i|| (intra) only by the keys of
    one head's row; a layer-scope group averages over queries, whose norms differ."""
    if scope != "row":
        return False
    return kind == "inter" or unit == "key"


def ranking_identity(metric: str, kind: str = "inter", unit: str = "head_key", scope: str = "row") -> tuple[str, str]:
    """``(rung, kind)`` whose ranking ``metric`` (a rung of :data:`METRICS`, or any other name) equals by
    construction under ``kind``, ``unit`` and ``scope``: a rung that only rescales a lower one by an output
    norm (:attr:`cwcore.core.decomposition.Rung.rescales`) ranks as that rung wherever the norm is constant
    within a ranked group, and a kind-independent metric has no kind. The sweep ranks a metric by its
    identity's scores, so two metrics with one identity remove the same terms, bit for bit (float
    rounding of the division can otherwise turn an order into a tie)."""
    rung = _RUNGS.get(metric)
    if rung is None:
        return metric, kind
    while rung.rescales is not None and _constant_within_group(kind, unit, scope):
        rung = _RUNGS[rung.rescales]
    return str(rung), kind if rung.kind_dependent else ""


def same_ranking(lower: str, higher: str, protocol: "Protocol", lower_kind: str | None = None,
                 higher_kind: str | None = None) -> bool:
    """Whether metrics ``lower`` and ``higher`` (rung names; kinds default to the protocol's) rank
    identically by construction under ``protocol`` (the answer never looks at scores)."""
    unit, scope = protocol.unit, protocol.scope
    a = ranking_identity(lower, lower_kind or protocol.kind, unit, scope)
    b = ranking_identity(higher, higher_kind or protocol.kind, unit, scope)
    return a == b


def identical_steps(protocol: "Protocol") -> set[tuple[str, str]]:
    """The consecutive ladder steps ``(lower, higher)`` whose two rungs rank identically by construction
    under ``protocol`` (so the step cannot be measured): ``{("value_weighted",
    "value_weighted_output_normalized")}`` under ``kind="inter"`` with row scope, or ``kind="intra"``
    with ``unit="key"`` and row scope; empty otherwise."""
    return {(str(a), str(b)) for a, b in zip(METRICS, METRICS[1:]) if same_ranking(a, b, protocol)}


def _as_list(value, default) -> list:
    if value is None:
        return list(default)
    if isinstance(value, (str, float, int)):
        return [value]
    return list(value)


def modes(mode) -> list[str]:
    """``mode`` (a name, a list or None = both) as a list of :data:`MODES` entries, duplicates dropped."""
    chosen = _as_list(mode, MODES)
    for m in chosen:
        if m not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {m!r}")
    return list(dict.fromkeys(chosen))


def ratios(values) -> list[float]:
    """``values`` (a number, a list or None = :data:`DEFAULT_RATIOS`) sorted, deduplicated, in [0, 1]."""
    chosen = sorted({float(r) for r in _as_list(values, DEFAULT_RATIOS)})
    if any(not 0.0 <= r <= 1.0 for r in chosen):
        raise ValueError(f"ratios must lie in [0, 1], got {chosen}")
    return chosen


def _metric_items(metric) -> list[tuple[str | None, Any]]:
    """``(label or None, metric)`` pairs: a dict with string keys names its metrics."""
    if metric is None:
        return [(None, m) for m in DEFAULT_METRICS]
    if isinstance(metric, Mapping) and metric and all(isinstance(k, str) for k in metric):
        return list(metric.items())
    if isinstance(metric, (str, torch.Tensor, Mapping)) or callable(metric) or not hasattr(metric, "__iter__"):
        return [(None, metric)]
    return [item for m in metric for item in _metric_items(m)]


def specs(metric, kind) -> list[MetricSpec]:
    """``metric`` (a name, callable, precomputed scores, ``{label: metric}``, a list of them, or None =
    :data:`DEFAULT_METRICS`) as specs, one per label; two different metrics may not share a label."""
    chosen: dict[str, MetricSpec] = {}
    for label, m in _metric_items(metric):
        spec = parse_metric(m, kind, label)
        if spec.label in chosen and chosen[spec.label].piece_key != spec.piece_key:
            raise ValueError(f"two different metrics share the label {spec.label!r}; name them with a dict "
                             "{label: metric}")
        chosen.setdefault(spec.label, spec)
    return list(chosen.values())
