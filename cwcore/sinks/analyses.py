"""The registered analyses, in order, their options (:class:`SinkOptions`) and :func:`run_analyses`.

A new analysis is a module ``cwcore/sinks/<name>.py`` ending in ``register(Analysis(...))`` plus its
name in :data:`_MODULES`; its options join :class:`SinkOptions`, :func:`run_analyses` and the command line."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Iterable

from .engine import REGISTRY, collect, options_class, refuse_unread

# importing the analysis modules registers them, in this order (the order of ANALYSES, of the CSVs,
# of the summary rows and of the claims); by name (the functions are cwcore.sinks.sink_<analysis>,
# the modules keep the analyses' names)
_MODULES = ("rates", "decomposition", "anti_alignment", "convexity", "semantic_cone")
for _name in _MODULES:
    importlib.import_module(f"{__package__}.{_name}")

__all__ = ["ANALYSES", "SinkOptions", "run_analyses"]

#: the names of the registered analyses
ANALYSES = tuple(REGISTRY)

#: Every option of the registered analyses and of the run, each declared once by the module that uses
#: it (eps by :data:`cwcore.sinks.engine.EPS`), checked when the object is made: a frozen dataclass.
SinkOptions = options_class()


def run_analyses(model, tokenizer, data, analyses: Iterable[str] = ANALYSES, options: SinkOptions | None = None, *,
                 raw: bool = False, precompute: Iterable[str] = (), **keywords) -> dict:
    """Several analyses sharing one clean forward pass per batch.

    ``analyses``: names of :data:`ANALYSES` (one name alone is a list of one). ``options``: a
    :class:`SinkOptions`; ``keywords`` replace its fields (unknown names and bad values refused). Returns ``{name: result}``, equal to what the single functions return (they share the
    cache). ``raw=True`` adds ``"raw"``: ``{name: {part: DataFrame}}``, the per-point material (not in
    the key). ``precompute``: further analyses whose raw material the same passes compute and cache."""
    analyses = [analyses] if isinstance(analyses, str) else list(analyses)  # "rates" is one name, not five letters
    precompute = [precompute] if isinstance(precompute, str) else precompute
    precompute = [a for a in dict.fromkeys(precompute) if a not in analyses]
    unknown = sorted((set(analyses) | set(precompute)) - set(REGISTRY))
    if unknown:
        raise ValueError(f"unknown analyses {unknown}; choose from {', '.join(REGISTRY)}")
    fields = {f.name for f in dataclasses.fields(SinkOptions)}
    wrong = sorted(set(keywords) - fields)
    if wrong:
        raise TypeError(f"run_analyses takes no option {', '.join(map(repr, wrong))}; the options are "
                        f"{', '.join(sorted(fields))}")
    # an option none of the chosen analyses reads is refused, as each single function refuses it (kind= for the
    # anti-alignment alone ran without a word)
    read = {o.name for a in analyses + precompute for o in REGISTRY[a].options} | set(SinkOptions().run_options())
    unread = sorted(set(keywords) - read)
    if unread:
        raise TypeError(f"no analysis of {analyses + precompute} reads {', '.join(map(repr, unread))}")
    checked = dataclasses.replace(options, **keywords) if options is not None else SinkOptions(**keywords)
    for name in analyses + precompute:  # a threshold with heads='all' ...
        refuse_unread(REGISTRY[name], keywords, checked.analysis_options(name))
    every = {name: getattr(checked, name) for name in fields if name not in checked.run_options()}
    parts, blocks = collect(model, tokenizer, data, [REGISTRY[a].spec(every) for a in analyses + precompute],
                            **checked.run_options())
    results = {name: REGISTRY[name].tables(parts[name], blocks, **every) for name in analyses}
    if raw:
        results["raw"] = {name: parts[name] for name in analyses}
    return results
