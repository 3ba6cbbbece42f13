"""Tiny randomly initialised models of every supported family, for fast exact tests."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 97

# name -> (config class, model class, config kwargs)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(num_key_value_heads=2)),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(num_key_value_heads=2, sliding_window=4)),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16)),
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(num_key_value_heads=1, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ),
    "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel, dict()),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict()),
    "bert": (tf.BertConfig, tf.BertModel, dict()),
}
DECODERS = [name for name in FAMILIES if name != "bert"]


def tiny_model(family: str, seed: int = 0, dtype=torch.float32, num_layers: int = 2):
    """A ``num_layers``-layer (2), 4-head, width-64 model of ``family`` with eager attention, in eval mode."""
    config_cls, model_cls, extra = FAMILIES[family]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    if family == "gpt2":
        common = dict(vocab_size=VOCAB, n_embd=64, n_layer=num_layers, n_head=4, n_positions=64, attn_implementation="eager")
    if "layer_types" in extra:  # the pattern repeated over the layers
        extra = dict(extra, layer_types=[extra["layer_types"][n % len(extra["layer_types"])] for n in range(num_layers)])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra)).eval()
    # Random init leaves biases at zero; give them values so bias handling is exercised.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    return model.to(dtype)


def tiny_vit(seed: int = 0):
    torch.manual_seed(seed)
    config = tf.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=96, attn_implementation="eager",
    )
    return tf.ViTModel(config, add_pooling_layer=False).eval()


def as_transformers_kernel(function):
    """``function`` (a stand-in for transformers' SDPA attention function) marked as transformers' own, as a
    kernel of other hardware would be (a half-precision GPU kernel whose output differs from eager's): cwcore
    refuses an attention function a user re-registered, and checks transformers' own against its arithmetic."""
    function.__module__ = "transformers.integrations.sdpa_attention"
    return function
