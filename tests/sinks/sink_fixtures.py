"""Shared material of the sink tests: a planted one-layer Llama and naive model-space references.

The planted model is a one-layer Llama whose weights are set by hand (see :func:`planted_model`):
every query attends to the first token with score ln(E) and to every other token with score 0, so
alpha_i0 = E / (E + i) exactly; head 0's sink value is exactly anti-parallel to every tail value and
head 1's sink value makes a known angle with them, so its output norm
||a v0 + (1 - a) vt|| has its minimum at a* = <vt, vt - v0> / ||vt - v0||^2.
The naive references materialise projected values in model space from hooks on ``v_proj`` and
``o_proj`` and take attention maps from the model's own eager implementation.
"""

import math

import numpy as np
import torch
import transformers as tf

import cwcore
from tiny_models import VOCAB

E = 8.0  # planted exp(score) of the sink
T = 48  # sequence length of the planted tests
P_TAIL = 1.0  # head 0: tail value = +P_TAIL e, sink value = -Q_SINK e
Q_SINK = 1.0
VT = (1.0, 0.0)  # head 1: tail value and sink value in the head's first two dimensions
V0 = (-0.5, 1.0)
FAST = dict(progress=False)


def planted_model(seed: int = 0) -> tf.LlamaForCausalLM:
    """One layer, hidden 16, two heads of dimension 8, o_proj = identity, MLP off."""
    hidden, heads, dim, vocab = 16, 2, 8, 12
    config = tf.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=dim, rms_norm_eps=1e-12,
        rope_theta=1e10, max_position_embeddings=128, tie_word_embeddings=False, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = torch.zeros(vocab, hidden)
        emb[0, 0] = 1.0  # token 0 (the sink / BOS): e_0, so its normed input is sqrt(H) e_0
        noise = torch.randn(vocab, hidden - 2, generator=g)
        emb[1:, 1] = 1.0  # every other token: e_1 + a unit vector in dims 2.. (same norm for all)
        emb[1:, 2:] = noise[1:] / noise[1:].norm(dim=-1, keepdim=True)
        model.model.embed_tokens.weight.copy_(emb)
        x0 = math.sqrt(hidden)  # normed sink input on dim 0
        x1 = math.sqrt(hidden / 2)  # normed tail input on dim 1
        attn = model.model.layers[0].self_attn
        # dimension 3 of each head is rotated by RoPE's lowest frequency: ~0 with rope_theta = 1e10
        score = math.log(E)
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            proj.weight.zero_()
        for h in range(heads):
            attn.q_proj.weight[h * dim + 3, 1] = score * math.sqrt(dim) / (x1 * x0)
            attn.k_proj.weight[h * dim + 3, 0] = 1.0
        # head 0: tail value +P e_0, sink value -Q e_0
        attn.v_proj.weight[0, 1] = P_TAIL / x1
        attn.v_proj.weight[0, 0] = -Q_SINK / x0
        # head 1: tail value VT, sink value V0 (dims 0 and 1 of the head)
        attn.v_proj.weight[dim + 0, 1] = VT[0] / x1
        attn.v_proj.weight[dim + 1, 1] = VT[1] / x1
        attn.v_proj.weight[dim + 0, 0] = V0[0] / x0
        attn.v_proj.weight[dim + 1, 0] = V0[1] / x0
        attn.o_proj.weight.copy_(torch.eye(hidden))
        model.model.layers[0].mlp.down_proj.weight.zero_()
    return model


def planted_ids(n=3, length=T, seed=0):
    ids = torch.randint(1, 12, (n, length), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = 0
    return ids


def expected_alpha(length=T):
    i = np.arange(1, length)
    return E / (E + i)


def random_ids(n=3, length=12, seed=1):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


# -- naive model-space references ----------------------------------------------------------------


def naive_run(model, ids, masks=None):
    """Per layer: attention [b,h,q,k] (eager maps), projected values [b,h,k,m], head outputs [b,h,q,m]; logits."""
    layers = model.model.layers
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    captured = {}
    handles = []
    for l, layer in enumerate(layers):
        attn = layer.self_attn
        handles.append(attn.v_proj.register_forward_hook(lambda m, i, o, l=l: captured.__setitem__(("v", l), o.detach())))
        handles.append(attn.o_proj.register_forward_pre_hook(lambda m, i, l=l: captured.__setitem__(("z", l), i[0].detach())))
    try:
        with torch.inference_mode():
            if masks:
                with cwcore.intervene(model, masks):
                    out = model(input_ids=ids, output_attentions=True)
            else:
                out = model(input_ids=ids, output_attentions=True)
    finally:
        for h in handles:
            h.remove()
    result = []
    b, n = ids.shape
    for l, layer in enumerate(layers):
        w = layer.self_attn.o_proj.weight.detach().double()  # [m, heads*dim]
        w_h = w.reshape(w.shape[0], heads, dim).permute(1, 0, 2)  # [h, m, d]
        v = captured[("v", l)].double().reshape(b, n, kv, dim).transpose(1, 2).repeat_interleave(heads // kv, 1)
        z = captured[("z", l)].double().reshape(b, n, heads, dim).transpose(1, 2)
        result.append({
            "attention": out.attentions[l].double(),
            "values": torch.einsum("bhkd,hmd->bhkm", v, w_h),
            "outputs": torch.einsum("bhqd,hmd->bhqm", z, w_h),
        })
    return result, out.logits.double()


def cos(a, b):
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))



def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>")


