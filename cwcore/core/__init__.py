"""The method itself (the paper's sections 'Multi-head attention as a sum of projected value vectors' to 'Faithfulness by causal intervention'): head-space geometry, where each architecture keeps its
output projection, the attention function with its session (transforms that change a layer,
observers that read it), the decomposition classes with :func:`decompose`, and :func:`intervene`.

Import order is the dependency order, with no cycle: geometry -> architectures -> attention ->
decomposition -> interventions, summary.
"""

from .architectures import AttentionBlock, UnsupportedModelError, attention_blocks, register_output_projection
from .attention import AttentionSession, LayerCall, cwcore_attention, every_layer
from .decomposition import METRICS, ZERO_NORM, Decomposition, LayerDecomposition, decompose, prepare_inputs
from .geometry import HeadSpaceGeometry, head_space_geometry, naive_geometry, split_output_projection
from .interventions import intervene, mean_values, removal, value_sums
from .summary import LayerSummary, Summary, summarize

__all__ = [
    "AttentionBlock", "AttentionSession", "Decomposition", "HeadSpaceGeometry", "LayerCall", "LayerDecomposition",
    "METRICS", "UnsupportedModelError", "ZERO_NORM", "attention_blocks", "cwcore_attention", "decompose",
    "every_layer", "head_space_geometry", "intervene", "naive_geometry", "prepare_inputs",
    "mean_values", "register_output_projection", "removal", "split_output_projection", "value_sums", "LayerSummary", "Summary", "summarize",
]
