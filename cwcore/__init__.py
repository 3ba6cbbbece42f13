"""cwcore: contribution weights, the geometry of self-attention outputs.

One call from a model to its decomposition::

    model, tokenizer = cwcore.load_model("smollm2-135m")
    d = cwcore.decompose(model, **tokenizer("The cat sat", return_tensors="pt"))
    d.inter[3]      # [batch, head, query, key] contribution weights of layer 3
"""

__version__ = "0.1.0"

from .architectures import UnsupportedModelError, attention_blocks, register_output_projection
from .decompose import METRICS, Decomposition, LayerDecomposition, decompose
from .decompose import prepare_inputs
from .interventions import intervene
from .models import PACKAGED_MODELS, load_model
