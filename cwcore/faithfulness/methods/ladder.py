"""The geometric ladder (:data:`cwcore.core.decomposition.METRICS`: one method per rung, titles and
colours from there) and the seeded random control."""

from __future__ import annotations

from ...core.decomposition import METRICS
from ..ranking import hashed_uniform
from .registry import register_method

__all__ = ["random", "random_controls"]

for _rung in METRICS:
    def _ladder(layer_decomposition, kind="inter", _name=str(_rung), **_):
        return layer_decomposition.metric(_name, kind)
    _ladder.__name__ = str(_rung)
    register_method(str(_rung), cost="no extra forward", kind_dependent=_rung.kind_dependent, title=_rung.title,
                    colour=_rung.colour)(_ladder)


@register_method("random", cost="no extra forward", title="random", colour="#cc78bc")
def random(layer_decomposition, layer, groups, positions, seed=0, **_):
    """Seeded control: a hash of (seed, sequence, layer, head, query position, key position)."""
    heads = layer_decomposition.attention.shape[1]
    return hashed_uniform(seed, groups, layer, heads, positions)


def random_controls(seeds=(0, 1, 2)) -> dict:
    """``{"random_s<seed>": ranking}``: the random control at several seeds, for ``metric=`` (each ignores
    the protocol's seed and hashes its own; labels name the seed), so that
    :func:`~cwcore.faithfulness.summary.random_baseline` can put the seed spread in the interval."""
    def seeded(seed: int):
        def control(layer_decomposition, layer, groups, positions, **_):
            heads = layer_decomposition.attention.shape[1]
            return hashed_uniform(seed, groups, layer, heads, positions)
        control.__name__ = f"random_s{seed}"
        return control

    return {f"random_s{int(s)}": seeded(int(s)) for s in seeds}
