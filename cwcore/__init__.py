"""cwcore: contribution weights, the geometry of self-attention outputs.

One call from a model to its decomposition::

    model, tokenizer = cwcore.load_model("smollm2-135m")
    d = cwcore.decompose(model, **tokenizer("The cat sat", return_tensors="pt"))
    d.inter[3]      # [batch, head, query, key] contribution weights of layer 3

Submodules load on first use, so ``import cwcore`` (and tools that only need plotting or the cache)
does not pay for torch and transformers.
"""

from __future__ import annotations

import importlib

from . import _compat

_compat.install()  # old module paths (cwcore.attention, cwcore.sink_claims, ...) keep importing

from ._checkout import warn_if_other_checkout

warn_if_other_checkout(__path__[0])  # a clone sharing another checkout's environment would run that code silently

__version__ = "0.1.0"

# public name -> submodule that defines it (each concept has one home; see the README's layout table)
_EXPORTS = {
    "UnsupportedModelError": "core.architectures",
    "attention_blocks": "core.architectures",
    "decomposable_layers": "core.architectures",
    "register_output_projection": "core.architectures",
    "METRICS": "core.decomposition",
    "Decomposition": "core.decomposition",
    "LayerDecomposition": "core.decomposition",
    "decompose": "core.decomposition",
    "prepare_inputs": "core.decomposition",
    "summarize": "core.summary",
    "Summary": "core.summary",
    "LayerSummary": "core.summary",
    "AttentionSession": "core.attention",
    "LayerCall": "core.attention",
    "intervene": "core.interventions",
    "attribute": "attribution",
    "list_attribution_methods": "attribution",
    "PACKAGED_MODELS": "models",
    "load_model": "models",
    "PACKAGED_DATASETS": "data",
    "load_dataset": "data",
    # section 5: faithfulness by causal intervention
    "faithfulness_curve": "faithfulness",
    "downstream_eval": "faithfulness",
    "aopc": "faithfulness",
    "ladder_comparison": "faithfulness",
    # section 6: the value geometry of attention sinks
    "sink_rates": "sinks",
    "sink_decomposition": "sinks",
    "anti_alignment": "sinks",
    "convexity": "sinks",
    "semantic_cone": "sinks",
    "run_analyses": "sinks",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cwcore' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
