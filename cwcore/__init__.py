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

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "UnsupportedModelError": "architectures",
    "attention_blocks": "architectures",
    "register_output_projection": "architectures",
    "METRICS": "decomposition",
    "Decomposition": "decomposition",
    "LayerDecomposition": "decomposition",
    "decompose": "decomposition",
    "prepare_inputs": "decomposition",
    "intervene": "interventions",
    "PACKAGED_MODELS": "models",
    "load_model": "models",
    "PACKAGED_DATASETS": "data",
    "load_dataset": "data",
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
