"""The protocol of PAPER.md section 5: which metric ranks the terms, how, and where.

:class:`Protocol` holds the choices (unit, scope, layers, first token, clean or live scores, kind,
importance, seed; the package docstring gives each default's reason); :func:`parse_metric` turns
a metric name into a :class:`MetricSpec`; :func:`layer_windows` and :func:`num_heads` read what the
protocol needs from a model's config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..core.decomposition import METRICS
from .ranking import MODES, SCOPES, UNITS

__all__ = [
    "DEFAULT_RATIOS",
    "DEFAULT_METRICS",
    "LADDER",
    "KINDS",
    "MetricSpec",
    "parse_metric",
    "Protocol",
    "layer_windows",
    "num_heads",
]

DEFAULT_RATIOS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
#: The geometric ladder (PAPER.md section 4), least to most geometric.
LADDER = METRICS
DEFAULT_METRICS = METRICS + ("random",)
KINDS = ("inter", "intra")
_KIND_DEPENDENT = ("value_weighted_output_normalized", "contribution")


@dataclass(frozen=True)
class MetricSpec:
    """One ranked metric: ``label`` (column value), ``name`` (a :data:`METRICS` entry or random), ``kind``."""

    label: str
    name: str
    kind: str


def parse_metric(metric: str, kind: str = "inter") -> MetricSpec:
    """``"contribution"``, ``"contribution_intra"``, ``"value_weighted_output_normalized_inter"``, ``"random"``...

    The label is the name with a ``_<kind>`` suffix only when the kind differs from the default
    ``kind`` (and matters: attention, value_weighted and random have no kind).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    match = re.fullmatch(r"(.+?)(?:_(inter|intra))?", metric)
    base, suffix = match.group(1), match.group(2)
    if base not in METRICS + ("random",):
        raise ValueError(f"unknown metric {metric!r}; choose from {', '.join(DEFAULT_METRICS)} (+ _intra/_inter)")
    if base not in _KIND_DEPENDENT:
        if suffix:
            raise ValueError(f"metric {base!r} has no intra/inter kind")
        return MetricSpec(base, base, "")
    chosen = suffix or kind
    return MetricSpec(base if chosen == kind else f"{base}_{chosen}", base, chosen)


@dataclass(frozen=True)
class Protocol:
    """The choices of PAPER.md section 5 (see :mod:`cwcore.faithfulness` for the defaults' reasons)."""

    unit: str = "head_key"
    scope: str = "row"
    layers: tuple[int, ...] | None = None
    keep_first_token: bool = True
    scores: str = "clean"
    kind: str = "inter"
    importance: str = "signed"
    seed: int = 0

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
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(sorted({int(l) for l in self.layers})))

    def columns(self) -> dict:
        """The protocol as tidy-table columns."""
        return {
            "unit": self.unit, "scope": self.scope, "scores": self.scores,
            "keep_first_token": self.keep_first_token, "importance": self.importance,
            "layers": "all" if self.layers is None else ",".join(map(str, self.layers)),
        }


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


def specs(metric, kind) -> list[MetricSpec]:
    """``metric`` (a name, a list or None = :data:`DEFAULT_METRICS`) as specs, one per label."""
    parsed = [parse_metric(m, kind) for m in _as_list(metric, DEFAULT_METRICS)]
    return list({s.label: s for s in parsed}.values())


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_windows(model: nn.Module, num_layers: int) -> list[int | None]:
    """Each layer's sliding window from the config (None = full attention)."""
    config = _text_config(model)
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    types = getattr(config, "layer_types", None)
    if types:
        return [int(window) if t == "sliding_attention" else None for t in list(types)[:num_layers]]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * num_layers
    return [int(window)] * num_layers


def num_heads(model: nn.Module) -> int:
    """Query heads per attention layer, from the config."""
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if heads is None:
        raise ValueError("cannot tell the number of attention heads from the model's config")
    return int(heads)
