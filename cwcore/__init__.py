"""cwcore: contribution weights, the geometry of self-attention outputs.

One call from a model to its decomposition::

    model, tokenizer = cwcore.load_model("smollm2-135m")
    d = cwcore.decompose(model, **tokenizer("The cat sat", return_tensors="pt"))
    d[3].contribution("inter")  # [batch, head, query, key] contribution weights of layer 3

Submodules load on first use, so ``import cwcore`` (and tools that only need plotting or the cache)
does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> submodule that defines it (each concept has one home; see ARCHITECTURE.md):
# the user's verbs and the few classes they meet; the engine stays in its modules (cwcore.core.attention, ...)
_EXPORTS = {
    "load_model": "models",
    "PACKAGED_MODELS": "models",
    "load_dataset": "data",
    "PACKAGED_DATASETS": "data",
    "decompose": "core.decomposition",
    "Decomposition": "core.decomposition",
    "summarize": "core.summary",
    "intervene": "core.interventions",
    "attribute": "attribution",
    "list_attribution_methods": "attribution",
    "UnsupportedModelError": "core.architectures",
    "register_output_projection": "core.architectures",
    # the paper's section on faithfulness by causal intervention
    "faithfulness_curve": "faithfulness",
    "aopc": "faithfulness",
}
#: subpackages named at the top level (``cwcore.sinks.sink_rates(...)``: the sink analyses)
_SUBPACKAGES = ("sinks",)
#: names the top level used to export, still reachable there with a DeprecationWarning (see CHANGELOG.md)
_MOVED = {
    "attention_blocks": "core.architectures",
    "decomposable_layers": "core.architectures",
    "METRICS": "core.decomposition",
    "LayerDecomposition": "core.decomposition",
    "prepare_inputs": "core.decomposition",
    "Summary": "core.summary",
    "LayerSummary": "core.summary",
    "AttentionSession": "core.attention",
    "LayerCall": "core.attention",
    "downstream_eval": "faithfulness",
    "ladder_comparison": "faithfulness",
    "sink_rates": "sinks",
    "sink_decomposition": "sinks",
    "anti_alignment": "sinks",
    "convexity": "sinks",
    "semantic_cone": "sinks",
    "run_analyses": "sinks",
}
#: a moved name whose new home spells it differently
_MOVED_NAMES = {"anti_alignment": "sink_anti_alignment", "convexity": "sink_convexity",
                "semantic_cone": "sink_semantic_cone"}
__all__ = sorted([*_EXPORTS, *_SUBPACKAGES])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in _MOVED:  # not cached in globals: every use says where the name lives now
        import warnings

        home, new = f"cwcore.{_MOVED[name]}", _MOVED_NAMES.get(name, name)
        warnings.warn(f"cwcore.{name} is deprecated: use {home}.{new} (the top level holds the user's verbs only)",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), new)
    raise AttributeError(f"module 'cwcore' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
