"""Shared pieces of the faithfulness tests: a peaked tiny Llama, self-sampled data, a word tokenizer,
a forward counter and a toy multiple-choice data set."""

from __future__ import annotations

import datasets
import torch
import transformers as tf

from tiny_models import VOCAB

NON_RANDOM = ["attention", "value_weighted", "value_weighted_output_normalized", "contribution"]


def peaked_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager", initializer_range=0.2)
    return tf.LlamaForCausalLM(config).eval()


def self_sampled(model, n: int = 10, length: int = 18, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, 1), generator=generator)
    with torch.no_grad():
        for _ in range(length - 1):
            probs = torch.softmax(model(input_ids=ids).logits[:, -1], -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], 1)
    return ids


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ("the a cat dog sat on mat and ran away question answer : . ? , yes no A B C D is was hello world "
             "one two three four five six seven eight nine ten it far so always got").split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


class ForwardCounter:
    """Counts the model's forwards; raises after ``fail_after`` of them (a simulated interruption). It only
    observes, and says so (``cwcore_observer``): its count is not part of the model's identity."""

    cwcore_observer = True

    def __init__(self, model, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1

    def remove(self):
        self.handle.remove()


def mc_dataset():
    shared = ["question : is the cat on the mat ? answer :", "question : one two three ? answer :",
              "the dog ran far so it"]
    rows = []
    for i, context in enumerate(shared):
        rows.append({"contexts": [context] * 2, "continuations": [" yes", " no"], "gold": i % 2})
    rows.append({"contexts": ["the cat sat on the", "the dog sat on the"], "continuations": [" mat and ran"] * 2,
                 "gold": 1})
    rows.append({"contexts": ["hello"] * 4, "continuations": [" A", " B", " C", " D"], "gold": 2})
    return datasets.Dataset.from_list(rows)


def forest_points(fig) -> list[tuple[float, str]]:
    """(x, colour) of every single-point marker a forest plot drew, x rounded to 12 digits."""
    import matplotlib

    points = []
    for ax in fig.axes:
        for line in ax.get_lines():
            x = line.get_xdata()
            if len(x) == 1 and line.get_marker() not in (None, "None", ""):
                points.append((round(float(x[0]), 12), matplotlib.colors.to_hex(line.get_color())))
    return points
