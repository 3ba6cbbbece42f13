"""The zoo: tiny randomly initialised models of many transformers families, for tests/core/test_zoo.py.

Each :class:`Species` builds a 2-layer (hybrids: 3-4 layers), width-32/64 model with eager attention
and random biases, and says what cwcore must do with it: decompose it exactly (``refused=None``) or
refuse it with an :class:`~cwcore.UnsupportedModelError` whose message matches ``refused``.
``projection`` names the output projection W_O relative to the attention block (``"../output.dense"``:
the parent's ``output.dense``), written here independently of cwcore's registry, so the test can hook
the module the model really calls.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import transformers as tf
from packaging.version import Version
from torch import nn

VOCAB = 97
SEQ = 9
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, attn_implementation="eager")


@dataclass(frozen=True)
class Species:
    name: str
    build: Callable[[], nn.Module] = field(repr=False)
    kind: str = "decoder"  # decoder (left padding), encoder (right padding), vision (no padding)
    what: str = ""  # the feature this family brings to the zoo
    projection: str = "o_proj"  # W_O, relative to the attention block ("../x.y": from its parent)
    blocks: int = 2  # softmax attention blocks cwcore must find
    layers: tuple[int, ...] | None = None  # the decoder layers that hold them (hybrids), None: 0..blocks-1
    refused: str | None = None  # regex of the expected UnsupportedModelError, None: must be exact
    undecomposable: tuple[int, ...] = ()  # blocks numbered but refused by name (skipped, with a warning, by layers=None)
    pad_token: int = 0  # the id padded positions carry (RoBERTa-style models number positions from it)


def _randomise_biases(model: nn.Module) -> nn.Module:
    """Random init leaves biases at zero; give them values so bias handling is exercised."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
    return model


def _make(config_cls, model_cls, common=COMMON, **extra):
    def build():
        torch.manual_seed(0)
        config = config_cls(**{**common, **extra})
        model = model_cls(config).eval()
        model.config._attn_implementation = "eager"
        return _randomise_biases(model)
    return build


GQA = dict(num_key_value_heads=2)
# Falcon moved from its own attention code to the attention interface in transformers 5.25
FALCON_OWN_CODE = Version(tf.__version__) < Version("5.25.0")
_ENC = dict(COMMON, max_position_embeddings=64)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def _falcon_species() -> list[Species]:
    """Falcon: its own attention code before transformers 5.25 (refused), the attention interface since
    (exact), with ALiBi then passed to the attention function as an additive float mask."""
    def build(**extra):
        return _make(tf.FalconConfig, tf.FalconForCausalLM, dict(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, parallel_attn=True,
            attn_implementation="eager", **extra))
    falcon = Species("falcon", build(multi_query=True, alibi=False), projection="dense",
                     refused="did not run through cwcore's attention function" if FALCON_OWN_CODE else None,
                     what="MQA with fused query_key_value, parallel block (own attention code before 5.25)")
    if FALCON_OWN_CODE:
        return [falcon]
    return [falcon, Species("falcon_alibi", build(multi_query=False, alibi=True), projection="dense",
                            what="ALiBi: a per-head position bias inside the float attention mask")]


_ZOO = [
    # ---- decoders ---------------------------------------------------------------------------------
    Species("llama", _make(tf.LlamaConfig, tf.LlamaForCausalLM, **GQA), what="GQA, RoPE"),
    Species("mistral", _make(tf.MistralConfig, tf.MistralForCausalLM, **GQA, sliding_window=4),
            what="sliding window 4"),
    Species("qwen2", _make(tf.Qwen2Config, tf.Qwen2ForCausalLM, **GQA), what="qkv biases"),
    Species("qwen3", _make(tf.Qwen3Config, tf.Qwen3ForCausalLM, **GQA, head_dim=16), what="q/k norms"),
    Species("gemma", _make(tf.GemmaConfig, tf.GemmaForCausalLM, num_key_value_heads=1, head_dim=16), what="MQA"),
    Species("gemma2", _make(tf.Gemma2Config, tf.Gemma2ForCausalLM, **GQA, head_dim=16, sliding_window=4,
                            attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                            layer_types=["sliding_attention", "full_attention"]),
            what="attention logit softcapping, sliding window"),
    Species("gemma3", _make(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, num_key_value_heads=1, head_dim=16,
                            sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
            what="MQA, sliding + global layers"),
    Species("phi", _make(tf.PhiConfig, tf.PhiForCausalLM, partial_rotary_factor=0.5), projection="dense",
            what="parallel block, partial rotary, biases"),
    Species("phi3", _make(tf.Phi3Config, tf.Phi3ForCausalLM, **GQA, pad_token_id=0), what="fused qkv_proj"),
    Species("gpt2", _make(tf.GPT2Config, tf.GPT2LMHeadModel, dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                                  n_positions=64, attn_implementation="eager")),
            projection="c_proj", what="Conv1D, absolute positions"),
    Species("gpt_neox", _make(tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM), projection="dense",
            what="parallel residual, fused qkv"),
    Species("gptj", _make(tf.GPTJConfig, tf.GPTJForCausalLM, dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                                  n_positions=64, rotary_dim=8,
                                                                  attn_implementation="eager")),
            projection="out_proj", what="parallel block, rotary on part of the head"),
    Species("stablelm", _make(tf.StableLmConfig, tf.StableLmForCausalLM, **GQA, use_qkv_bias=True,
                              partial_rotary_factor=0.25), what="partial rotary, qkv bias"),
    Species("olmo2", _make(tf.Olmo2Config, tf.Olmo2ForCausalLM, **GQA), what="q/k norm over all heads, post-norm"),
    Species("cohere", _make(tf.CohereConfig, tf.CohereForCausalLM, **GQA, use_qk_norm=False, pad_token_id=0),
            what="parallel block, logit scale"),
    Species("starcoder2", _make(tf.Starcoder2Config, tf.Starcoder2ForCausalLM, **GQA, sliding_window=4,
                                use_bias=True), what="biases everywhere, sliding window"),
    Species("granite", _make(tf.GraniteConfig, tf.GraniteForCausalLM, **GQA, attention_multiplier=0.3,
                             residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0),
            what="custom attention scaling"),
    Species("gpt_bigcode", _make(tf.GPTBigCodeConfig, tf.GPTBigCodeForCausalLM,
                                 dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      multi_query=True, attn_implementation="eager")),
            projection="c_proj", what="MQA with fused c_attn, absolute positions"),
    Species("opt", _make(tf.OPTConfig, tf.OPTForCausalLM, dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=96,
                                                               num_hidden_layers=2, num_attention_heads=4,
                                                               max_position_embeddings=64, word_embed_proj_dim=64,
                                                               pad_token_id=1, attn_implementation="eager")),
            projection="out_proj", pad_token=1, what="learned positions offset by 2, derived from the mask"),
    Species("persimmon", _make(tf.PersimmonConfig, tf.PersimmonForCausalLM, partial_rotary_factor=0.5, qk_layernorm=True),
            projection="dense", what="fused qkv, q/k layer norm, partial rotary"),
    Species("mixtral", _make(tf.MixtralConfig, tf.MixtralForCausalLM, **GQA, **_MOE), what="MoE"),
    Species("qwen2_moe", _make(tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, **GQA, **_QWEN_MOE),
            what="MoE with shared expert"),
    Species("gpt_oss", _make(tf.GptOssConfig, tf.GptOssForCausalLM, **GQA, head_dim=16, **_MOE,
                             layer_types=["sliding_attention", "full_attention"], sliding_window=4),
            what="learned sink logits, sliding window, MoE"),
    Species("granite_swa", _make(tf.GraniteSWAConfig, tf.GraniteSWAForCausalLM, **GQA),
            what="learned sinks applied as a scale on the attention output: its own maps exclude the sink"),
    Species("qwen3_next", _make(tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, **GQA, head_dim=16,
                                layer_types=["linear_attention", "full_attention"], **_QWEN_MOE,
                                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16),
            blocks=1, layers=(1,), refused="output projection received something other",
            what="output gate, linear attention"),
    Species("jamba", _make(tf.JambaConfig, tf.JambaForCausalLM, **GQA, num_hidden_layers=4, attn_layer_period=2,
                           attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                           num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                           mamba_dt_rank=8, use_mamba_kernels=False),
            layers=(1, 3), what="hybrid: 2 attention layers among 4 (Mamba), MoE"),
    Species("granitemoehybrid", _make(tf.GraniteMoeHybridConfig, tf.GraniteMoeHybridForCausalLM, **GQA,
                                      num_hidden_layers=3,
                                      layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
                                      num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                                      mamba_d_state=8, mamba_chunk_size=4),
            blocks=1, layers=(1,), what="hybrid: 1 attention layer among 3 (Mamba-2)"),
    Species("deepseek_v32", _make(tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM, num_key_value_heads=4,
                                  moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, n_group=1,
                                  topk_group=1, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
                                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, index_topk=4,
                                  index_head_dim=16, index_n_heads=2, first_k_dense_replace=1),
            refused=r"attention block 'model.layers.0.self_attn' \(DeepseekV32Attention\) passes `indices` to the "
                    r"attention function \(the top-k keys a sparse-attention indexer selected",
            what="sparse attention: an indexer passes its top-k keys as `indices=` (silently dense before)"),
    Species("deepseek_v4", _make(tf.DeepseekV4Config, tf.DeepseekV4ForCausalLM, num_key_value_heads=1, head_dim=16,
                                 q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                 num_experts_per_tok=2, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=16,
                                 index_topk=4, sliding_window=4, hc_mult=2, num_nextn_predict_layers=0),
            projection="o_b_proj",
            refused=r"`o_b_proj`, which cwcore took as its output projection W_O \(no registered name matched, so the "
                    r"block's last linear layer\), takes inputs of width 16, but the attention output has 4 heads x 16 "
                    r"= 64 values per token",
            what="grouped low-rank output projection (o_a_proj per group, then o_b_proj): W_O is not one linear map"),
    Species("diffllama", _make(tf.DiffLlamaConfig, tf.DiffLlamaForCausalLM, **GQA),
            refused="calls the attention function 2 times per layer, each time over all its 9 queries: it combines 2 "
                    "attention maps",
            what="differential attention: two softmax maps per layer, a_1 - lambda a_2"),
    # ---- refused: blocks that do not call transformers' attention interface -----------------------
    Species("gpt_neo", _make(tf.GPTNeoConfig, tf.GPTNeoForCausalLM, dict(vocab_size=VOCAB, hidden_size=64, num_layers=2,
                                                                         num_heads=4, max_position_embeddings=64,
                                                                         attention_types=[[["global", "local"], 1]],
                                                                         window_size=4, attn_implementation="eager")),
            projection="out_proj", refused="did not run through cwcore's attention function",
            what="local attention, unscaled scores, own code"),
    *_falcon_species(),
    Species("bloom", _make(tf.BloomConfig, tf.BloomForCausalLM, dict(vocab_size=VOCAB, hidden_size=64, n_layer=2,
                                                                     n_head=4, attn_implementation="eager")),
            projection="dense", refused="did not run through cwcore's attention function", what="ALiBi, own code"),
    # ---- encoders ---------------------------------------------------------------------------------
    Species("bert", _make(tf.BertConfig, tf.BertModel, _ENC), kind="encoder", projection="../output.dense",
            what="absolute positions, token types"),
    Species("roberta", _make(tf.RobertaConfig, tf.RobertaModel, _ENC, max_position_embeddings=80, pad_token_id=1),
            kind="encoder", projection="../output.dense", pad_token=1,
            what="positions numbered from padding_idx + 1"),
    Species("electra", _make(tf.ElectraConfig, tf.ElectraModel, _ENC, embedding_size=32), kind="encoder",
            projection="../output.dense", what="embedding projection"),
    Species("xlm_roberta", _make(tf.XLMRobertaConfig, tf.XLMRobertaModel, _ENC, max_position_embeddings=80,
                                 pad_token_id=1), kind="encoder", projection="../output.dense", pad_token=1,
            what="RoBERTa positions, another class tree"),
    Species("albert", _make(tf.AlbertConfig, tf.AlbertModel, _ENC, embedding_size=32), kind="encoder",
            projection="dense", what="one attention module shared by all layers",
            refused="ran 2 times in one forward pass"),
    Species("clip_text", _make(tf.CLIPTextConfig, tf.CLIPTextModel, _ENC), kind="encoder", projection="out_proj",
            what="causal text encoder: its attention modules say is_causal=False, the call passes is_causal=True"),
    Species("distilbert", _make(tf.DistilBertConfig, tf.DistilBertModel, dict(vocab_size=VOCAB, dim=64, n_layers=2,
                                                                              n_heads=4, hidden_dim=96,
                                                                              max_position_embeddings=64,
                                                                              attn_implementation="eager")),
            kind="encoder", projection="out_lin", what="output projection named out_lin"),
    Species("modernbert", _make(tf.ModernBertConfig, tf.ModernBertModel, _ENC, global_attn_every_n_layers=2,
                                local_attention=4, pad_token_id=0),
            kind="encoder", projection="Wo", what="output projection named Wo (found by structure), fused Wqkv, "
                                                  "local + global layers"),
    # ---- vision -----------------------------------------------------------------------------------
    Species("vit", _make(tf.ViTConfig, tf.ViTModel, dict(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                                                         num_hidden_layers=2, num_attention_heads=4,
                                                         intermediate_size=96, attn_implementation="eager")),
            kind="vision", what="patches, CLS"),
    Species("deit", _make(tf.DeiTConfig, tf.DeiTModel, dict(image_size=16, patch_size=4, num_channels=3,
                                                            hidden_size=64, num_hidden_layers=2,
                                                            num_attention_heads=4, intermediate_size=96,
                                                            attn_implementation="eager")),
            kind="vision", what="CLS + distillation token"),
    Species("dinov2", _make(tf.Dinov2Config, tf.Dinov2Model, dict(image_size=16, patch_size=4, num_channels=3,
                                                                  hidden_size=64, num_hidden_layers=2,
                                                                  num_attention_heads=4, mlp_ratio=2,
                                                                  attn_implementation="eager")),
            kind="vision", what="layer scale, interpolated positions"),
    Species("siglip", _make(tf.SiglipVisionConfig, tf.SiglipVisionModel, dict(image_size=16, patch_size=4, num_channels=3,
                                                                              hidden_size=64, num_hidden_layers=2,
                                                                              num_attention_heads=4,
                                                                              intermediate_size=96,
                                                                              attn_implementation="eager")),
            kind="vision", projection="out_proj", blocks=3, undecomposable=(2,),
            what="pooling head: a torch.nn.MultiheadAttention, numbered and refused by name"),
]
ZOO: dict[str, Species] = {s.name: s for s in _ZOO}


@functools.lru_cache(maxsize=None)
def zoo_model(name: str) -> nn.Module:
    """The (cached) tiny model of ``name``; tests must not change its weights."""
    return ZOO[name].build()


def projection_of(block_module: nn.Module, parent: nn.Module | None, path: str) -> nn.Module:
    """The module at ``path`` relative to the attention block (``../a.b`` relative to its parent)."""
    root = block_module
    if path.startswith("../"):
        root, path = parent, path[3:]
    for part in path.split("."):
        root = getattr(root, part)
    return root


# ---- families whose inputs are more than one token sequence (tests/core/test_sequences.py) ------------------
IMAGE_TOKEN, VISION_START, VISION_END = 90, 92, 93
PATCH_GRID = (1, 4, 4)  # one image: 1 x 4 x 4 patches, merged 2 x 2 into 4 language tokens


@functools.lru_cache(maxsize=None)
def qwen2_vl() -> nn.Module:
    """Qwen2-VL: a vision tower that calls attention once per image, and multimodal RoPE (``[3, batch,
    sequence]`` temporal/height/width position ids that the model computes from the mask itself)."""
    torch.manual_seed(0)
    config = tf.Qwen2VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None,
                         rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3], rope_theta=10000.0)),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=2, spatial_merge_size=2,
                           temporal_patch_size=2, in_channels=3, mlp_ratio=2),
        image_token_id=IMAGE_TOKEN, video_token_id=91, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, attn_implementation="eager")
    model = tf.Qwen2VLForConditionalGeneration(config).eval()
    model.config._attn_implementation = "eager"
    return _randomise_biases(model)


def qwen2_vl_row(text: int = 7, images: int = 1, seed: int = 1) -> dict:
    """One unpadded row: 2 text tokens, ``images`` images (start, 4 image tokens, end), the rest of the text."""
    generator = torch.Generator().manual_seed(seed)
    words = torch.randint(2, 80, (text,), generator=generator)
    image = torch.tensor([VISION_START, *[IMAGE_TOKEN] * 4, VISION_END])
    ids = torch.cat([words[:2], *[image] * images, words[2:]])
    patches = PATCH_GRID[0] * PATCH_GRID[1] * PATCH_GRID[2]
    return dict(input_ids=ids, pixel_values=torch.randn(images * patches, 3 * 2 * 2 * 2, generator=generator),
                image_grid_thw=torch.tensor([PATCH_GRID] * images), mm_token_type_ids=(ids == IMAGE_TOKEN).int())


def qwen2_vl_inputs(row: dict, pad: int = 0) -> dict:
    """``row`` as a batch of one, left-padded by ``pad`` tokens (with the attention mask that says so)."""
    ids, types = row["input_ids"], row["mm_token_type_ids"]
    inputs = dict(input_ids=torch.cat([torch.zeros(pad, dtype=torch.long), ids])[None],
                  mm_token_type_ids=torch.cat([torch.zeros(pad, dtype=types.dtype), types])[None],
                  pixel_values=row["pixel_values"], image_grid_thw=row["image_grid_thw"])
    if pad:
        inputs["attention_mask"] = torch.cat([torch.zeros(pad), torch.ones(len(ids))]).long()[None]
    return inputs


@functools.lru_cache(maxsize=None)
def bart() -> nn.Module:
    """BART: an encoder-decoder whose self- and cross-attention blocks share one class (both numbered)."""
    return _make(tf.BartConfig, tf.BartModel, dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                                                   encoder_attention_heads=4, decoder_attention_heads=4,
                                                   encoder_ffn_dim=96, decoder_ffn_dim=96, max_position_embeddings=64,
                                                   pad_token_id=1, attn_implementation="eager"))()


class RecordedCall(NamedTuple):
    """One attention call as the recording probe saw it."""

    module: nn.Module
    queries: int
    keys: int
    keywords: list[str]  # the keywords passed with a value (not None)
    output: torch.Tensor  # what the attention function returned, [batch, query, head, dim]


@contextlib.contextmanager
def recorded_attention_calls(model):
    """The model's attention calls, recorded by an eager attention function of our own (with eager's masks, so
    the model computes what its eager forward computes): a list of :class:`RecordedCall` in call order."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    calls = []

    def recording(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # plain eager attention (no softcap, sinks or biases: the families probed here have none that matter)
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
        if attention_mask is not None:
            scores = (scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
                      if attention_mask.dtype == torch.bool else scores + attention_mask[..., : key.shape[-2]])
        weights = torch.softmax(scores, -1, dtype=torch.float32).to(query.dtype)
        output = (weights @ value).transpose(1, 2).contiguous()
        calls.append(RecordedCall(module, query.shape[-2], key.shape[-2],
                                  sorted(k for k, v in kwargs.items() if v is not None), output.detach().clone()))
        return output, weights

    AttentionInterface.register("recording_probe", recording)
    AttentionMaskInterface.register("recording_probe", eager_mask)  # the eager masks, as eager builds them
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    previous = [c._attn_implementation for c in configs]
    try:
        for config in configs:
            config._attn_implementation = "recording_probe"
        yield calls
    finally:
        for config, value in zip(configs, previous):
            config._attn_implementation = value


@functools.lru_cache(maxsize=None)
def minimax_hybrid() -> nn.Module:
    """MiniMax: a hybrid whose linear-attention block is named MiniMaxLightningAttention (layer 0) beside a
    softmax block (layer 1); its eager forward returns a non-softmax map for the linear layer too."""
    return _make(tf.MiniMaxConfig, tf.MiniMaxForCausalLM, **GQA, head_dim=16, **_MOE,
                 layer_types=["linear_attention", "full_attention"], block_size=4)()


def relative_bias_model(family: str) -> nn.Module:
    """T5 / UMT5: relative position biases passed to attention as ``position_bias`` (additive on the scores), and
    self- and cross-attention blocks of one class."""
    config_cls, model_cls = {"t5": (tf.T5Config, tf.T5Model), "umt5": (tf.UMT5Config, tf.UMT5Model)}[family]
    return _make(config_cls, model_cls, dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                             num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                             relative_attention_max_distance=16, attn_implementation="eager"))()
