"""A tiny randomly initialised model of a family cwcore does not package, saved as a local folder.

Rerunning the book on a new model is a promised use (``make book MODELS=<folder>``); the test of that
(tests/test_new_model_book.py) needs a model nobody tuned the chapters for. Random weights give what a
new model may lack: no sink heads, no attention to BOS, one layer type only. The tokenizer is the
packaged SmolLM2's (an encoder's: MiniLM's), so the book's data sets tokenise; the vocabulary matches it.
Three layouts: separate q/k/v projections (``qwen2``, ``olmo2``), one fused qkv projection (``phi3``:
``qkv_proj``; ``gpt_neox``: ``query_key_value`` and ``dense``), and a BERT-style encoder (``bert``:
``query``/``key``/``value`` and the sibling ``output.dense``).

    python tests/new_model.py /tmp/new-model [--family qwen2|olmo2|phi3|gpt_neox|bert]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import transformers as tf

# name -> (config class, model class, extra config); none of them is a packaged family
FAMILIES = {
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, dict(num_key_value_heads=2)),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(num_key_value_heads=2)),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, dict()),
    "bert": (tf.BertConfig, tf.BertModel, dict()),
}
ENCODERS = {"bert"}


def save_new_model(folder: str | Path, family: str = "qwen2", seed: int = 0, layers: int = 2) -> Path:
    """Save a ``layers``-layer, width-64 random ``family`` model with SmolLM2's tokenizer to ``folder``."""
    from cwcore.models import packaged_model_path

    folder = Path(folder)
    encoder = family in ENCODERS
    tokenizer = tf.AutoTokenizer.from_pretrained(packaged_model_path("minilm-l6" if encoder else "smollm2-135m"))
    config_cls, model_cls, extra = FAMILIES[family]
    special = dict(pad_token_id=tokenizer.pad_token_id) if encoder else dict(
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    config = config_cls(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, max_position_embeddings=512 if encoder else 2048, **special, **extra)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--family", default="qwen2", choices=sorted(FAMILIES))
    args = parser.parse_args()
    print(save_new_model(args.folder, args.family))
    sys.exit(0)
