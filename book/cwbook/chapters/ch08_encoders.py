"""Chapter 8, contribution weights in an encoder: the maps of one sentence in a BERT-style encoder, the
attention and contribution mass of its special tokens over real documents, and one call on a vision
transformer."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import matplotlib.pyplot as plt
import numpy as np
import torch

import cwcore
from cwbook import analysis
from cwcore.core.architectures import input_device
from cwcore.plotting import band, contribution_heatmap, layer_axis, legend_below, per_layer
from cwbook.chapters.common import (ATTN, COLOURS, FACTOR_COLUMNS, INTER, INTRA, OTHER, VIEWS, SentenceMaps,
                                    Statistics, collect_statistics, decompose_sentence, factors_figure,
                                    maps_head_figure, maps_layer_figure)

#: the key groups of the statistics and their colours
GROUPS = [("[CLS]", COLOURS[1]), ("[SEP]", COLOURS[4]), (". and ,", COLOURS[2]), ("other", OTHER)]


def _special(L, special):
    """Per head, over all queries: attention on the keys ``special`` ``[key]`` bool (the tokenizer's classifier
    and separator tokens), and their intra-head contribution."""
    contribution = L.contribution("intra")[0][..., special].sum(-1).mean(-1)
    return L.attention[0][..., special].sum(-1).mean(-1).cpu(), contribution.cpu()


def sentence_maps(encoder, tokenizer, text: str, layer: int | None, head: int | None,
                  rank_min_keys: int, model_name: str) -> SentenceMaps:
    """Decompose ``text`` (wrapped in the tokenizer's classifier and separator tokens: ``[CLS]`` ... ``[SEP]`` in
    BERT, ``<s>`` ... ``</s>`` in RoBERTa, found by their ids whatever their spelling) in every layer, and pick the
    layer (``layer``, or the middle one) and head (``head``, or the one whose attention on those tokens exceeds
    their intra-head contribution the most) of the maps."""
    groups = special_token_groups(tokenizer)  # the statistics' groups: the same ids
    marks = {i for name in ("[CLS]", "[SEP]") for i in groups[name]} - {None}
    special = torch.tensor([i in marks for i in tokenizer(text)["input_ids"]])
    maps = decompose_sentence(encoder, tokenizer, text, layer, head,
                              lambda L, _: torch.sub(*_special(L, special)), chapter="chapter 8")
    tokens = maps.tokens
    layer_shown, head_shown, n_heads, L = maps.layer_shown, maps.head_shown, maps.n_heads, maps.L
    special_attention, special_contribution = _special(L, special)
    quoted, quoted_md = {"n_layers": len(maps.layers)}, {"model_name": f"`{model_name}`"}
    names = " and ".join(f"`{t}`" for t in dict.fromkeys(tokenizer.convert_ids_to_tokens(sorted(marks))))

    if head is None:
        quoted_md["head_reason"] = (
            "the head of this layer in which the attention "
            f"on {names or 'the special tokens'} exceeds their intra-head contribution the "
            "most. The code picks it to show the effect; the statistics "
            "further down say how typical it is.")
    else:
        quoted_md["head_reason"] = "the head set by the `head` parameter."
    quoted.update(layer_shown=layer_shown, head_shown=head_shown, n_heads=n_heads, n_tokens=len(tokens))

    alpha_map = L.attention[0, head_shown].cpu().numpy()
    intra_map = L.contribution("intra")[0, head_shown].cpu().numpy()
    inter_map = L.contribution("inter")[0, head_shown].cpu().numpy()

    cls_, sep_ = 0, len(tokens) - 1
    q_min, k_min = np.unravel_index(intra_map.argmin(), intra_map.shape)
    quoted.update(
        alpha_special=special_attention[head_shown],
        intra_special=special_contribution[head_shown],
        alpha_cls=alpha_map[:, cls_].mean(),
        intra_cls=intra_map[:, cls_].mean(),
        alpha_sep=alpha_map[:, sep_].mean(),
        intra_sep=intra_map[:, sep_].mean(),
        n_negative=int((intra_map < 0).sum()),
        n_weights=intra_map.size,
        min_intra=intra_map[q_min, k_min])
    quoted_md["min_pair"] = f"key `{tokens[k_min]}` for query `{tokens[q_min]}`"
    every_key = torch.ones(len(tokens), dtype=torch.bool, device=L.attention.device)
    rho = analysis.spearman_rows(L.attention[0, head_shown], L.contribution("intra")[0, head_shown],
                                 every_key, rank_min_keys)
    quoted["head_rho"] = np.nanmean(rho.cpu().numpy())

    # attention: mean over heads; contribution: inter-head, sum over heads
    token_attention = L.token_level("attention")[0].cpu().numpy()
    token_contribution = L.token_level("contribution", "inter")[0].cpu().numpy()
    quoted["layer_alpha_special"] = token_attention[:, special].sum(-1).mean()
    quoted["layer_c_special"] = token_contribution[:, special].sum(-1).mean()
    quoted_md["explorer_command"] = f'`cwcore explain "{text}" --model {model_name} --out fig.html`'
    maps.alpha_map, maps.intra_map, maps.inter_map = alpha_map, intra_map, inter_map
    maps.token_attention, maps.token_contribution, maps.quoted, maps.quoted_md = (
        token_attention, token_contribution, quoted, quoted_md)
    return maps


def special_token_groups(tokenizer) -> dict:
    """The special tokens, and punctuation, as groups of keys: group name -> token ids."""
    return {"[CLS]": [tokenizer.cls_token_id], "[SEP]": [tokenizer.sep_token_id],
            ". and ,": tokenizer.convert_tokens_to_ids([".", ","])}


def key_groups(batch, special_ids: dict):
    """The key groups of a batch (``analysis.collect``'s ``key_groups``): ``special_ids``' groups."""
    return analysis.token_groups(batch["input_ids"], special_ids)


def statistics(encoder, tokenizer, *, model_name: str, data: str, n_sequences: int, seq_len: int,
               batch_size: int, kind: str, min_keys: int, rank_min_keys: int, factor_samples: int,
               n_bootstrap: int, seed: int, cache: bool) -> Statistics:
    """Collect and summarise the statistics on ``n_sequences`` documents of ``data``, each cut to
    ``seq_len`` tokens (``[CLS]`` and ``[SEP]`` included), padded per batch."""
    documents = cwcore.load_dataset(data, limit=n_sequences, seed=seed)["text"]
    batches = [tokenizer(documents[i:i + batch_size], truncation=True, max_length=seq_len, padding=True,
                         return_tensors="pt").to(input_device(encoder)) for i in range(0, len(documents), batch_size)]
    collected = collect_statistics(encoder, batches, key_groups=partial(key_groups, special_ids=special_token_groups(
        tokenizer)), chapter="chapter 8", seq_len=seq_len, kind=kind, min_keys=min_keys, rank_min_keys=rank_min_keys,
        factor_samples=factor_samples, n_bootstrap=n_bootstrap, seed=seed, cache=cache, documents=documents,
        batches=batches)
    collected.lengths = torch.cat([b["attention_mask"].sum(1) for b in batches])
    summary, med = collected.summary, collected.factors.groupby("group")[FACTOR_COLUMNS].median()
    quoted = {"n_sequences": len(documents), "seq_len": seq_len}
    quoted_md = {"data_name": f"`{data}`",
                 "caption": f"{model_name}, {len(documents)} documents of {data} cut to "
                            f"{seq_len} tokens, seed {seed}"}
    for group, name in [("[CLS]", "cls"), ("[SEP]", "sep"), (". and ,", "punct")]:
        att = per_layer(summary, "mass", "attention", group)["mean"]
        tok = per_layer(summary, "mass", "token", group)["mean"]
        quoted[f"{name}_att_max"] = att.max()
        quoted[f"{name}_att_max_layer"] = int(att.idxmax())
        quoted[f"{name}_tok_at_max"] = tok[att.idxmax()]
        quoted[f"{name}_att_mean"] = att.mean()
        quoted[f"{name}_tok_mean"] = tok.mean()

    quoted["factor_samples"] = factor_samples
    quoted_md["kind_name"] = f"{kind}-head"
    quoted.update(
        med_cls_rel=med.loc["[CLS]", "relative_norm"],
        med_other_rel=med.loc["other", "relative_norm"],
        med_cls_cos=med.loc["[CLS]", "cosine"],
        med_other_cos=med.loc["other", "cosine"],
        neg_intra_mean=per_layer(summary, "negative_share", "intra")["mean"].mean(),
        neg_token_mean=per_layer(summary, "negative_share", "token")["mean"].mean(),
        rho_intra_mean=per_layer(summary, "spearman", "intra")["mean"].mean(),
        rho_token_mean=per_layer(summary, "spearman", "token")["mean"].mean())
    collected.quoted, collected.quoted_md = quoted, quoted_md
    return collected


@dataclass
class RandomViT:
    """A tiny vision transformer with RANDOM weights (``vit``, its ``config``) decomposed on a synthetic
    ``image [y, x, channel]`` (``dv``, every layer), and ``[CLS]``'s attention and contribution over the
    patches of the last layer, ``[patch row, patch column]`` each."""
    config: object
    vit: object
    image: np.ndarray
    dv: object
    cls_attention: np.ndarray
    cls_contribution: np.ndarray
    quoted: dict = field(default_factory=dict)

    @property
    def last(self):
        """The decomposition of the last layer."""
        return self.dv[max(self.dv.layers)]


def random_vit(seed: int) -> RandomViT:
    """Build the tiny ViT (seeded with ``seed``) and decompose it on a red square on a gradient."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(seed)
    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, attn_implementation="eager")
    vit = ViTModel(config, add_pooling_layer=False).eval()  # RANDOM weights

    # a synthetic image: a red square on a gradient
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    image = np.stack([0.2 + 0.6 * xx, 0.3 + 0.4 * yy, 0.8 - 0.5 * xx], axis=-1)
    image[10:22, 6:18] = [0.9, 0.1, 0.1]
    pixel_values = torch.tensor(image, dtype=torch.float32)
    pixel_values = pixel_values.permute(2, 0, 1)[None]  # [1, channel, y, x]

    dv = cwcore.decompose(vit, pixel_values=pixel_values)
    last = dv[max(dv.layers)]
    # one sum per query, over heads and keys: should be 1
    sums = last.token_level("contribution", "inter")[0].sum(-1)
    quoted = {"vit_sum_error": (sums - 1).abs().max(),
              "vit_layers": config.num_hidden_layers,
              "vit_heads": config.num_attention_heads,
              "vit_patches": (config.image_size // config.patch_size) ** 2,
              "vit_size": config.image_size}
    grid = config.image_size // config.patch_size
    # query 0 is [CLS]; keys 1.. are the patches, row by row
    cls_attention = last.token_level("attention")[0, 0, 1:]
    cls_contribution = last.token_level("contribution", "inter")[0, 0, 1:]
    return RandomViT(config, vit, image, dv, cls_attention.reshape(grid, grid).numpy(),
                     cls_contribution.reshape(grid, grid).numpy(), quoted)


# --- figures -------------------------------------------------------------------------------------------

def maps_head(maps: SentenceMaps, model_name: str):
    """Figure 1: the four maps of the head shown (:func:`cwbook.chapters.common.maps_head_figure`)."""
    return maps_head_figure(maps.alpha_map, maps.intra_map, maps.inter_map, maps.tokens,
                            f"{model_name} · layer {maps.layer_shown} · head {maps.head_shown}")


def maps_layer(maps: SentenceMaps, model_name: str):
    """Figure 2: the whole layer at token level (:func:`cwbook.chapters.common.maps_layer_figure`)."""
    return maps_layer_figure(maps.token_attention, maps.token_contribution, maps.tokens,
                             f"{model_name} · layer {maps.layer_shown} · all {maps.n_heads} heads")


def special_token_mass(stats: Statistics, model_name: str):
    """Figure 3: attention and contribution mass of ``[CLS]``, ``[SEP]`` and punctuation per layer."""
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True, sharey=True, constrained_layout=True)
    lines = [("attention", ATTN, "attention, mean over heads"),
             ("intra", INTRA, "intra-head contribution, mean over heads"),
             ("token", INTER, "inter-head contribution, sum over heads")]
    for ax, (group, colour) in zip(axes, GROUPS[:3]):
        for view, colour, label in lines:
            band(ax, per_layer(stats.summary, "mass", view, group), colour, label)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel("mass on " + group.replace(". and ,", "'.' and ','"))
    layer_axis(axes[-1], stats.n_layers)
    legend_below(fig, axes[0], ncols=2)
    axes[0].set_title(model_name, fontsize=12)
    return fig


def factors_per_layer(stats: Statistics, kind: str, model_name: str):
    """Figure 4: the three factors per layer and key group."""
    return factors_figure(stats.factors, kind, [(group, group, colour) for group, colour in GROUPS],
                          f"{model_name}: factors of {kind}-head contribution weights", band_alpha=0.2,
                          n_layers=stats.n_layers, ncols=4)


def negative_and_ranks(stats: Statistics, model_name: str):
    """Figure 5: the share of negative weights (top) and the rank agreement (bottom), per layer."""
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, constrained_layout=True)
    for view, label, colour in VIEWS:
        band(ax0, per_layer(stats.summary, "negative_share", view), colour, label)
        band(ax1, per_layer(stats.summary, "spearman", view), colour, label)
    ax0.set_ylabel("share of weights < 0")
    ax0.set_ylim(bottom=0)
    ax1.set_ylabel(r"Spearman $\rho$(attention, contribution)")
    ax1.axhline(1, color="0.5", lw=0.8, ls=":")
    layer_axis(ax1, stats.n_layers)
    legend_below(fig, ax0)
    ax0.set_title(model_name, fontsize=12)
    return fig


def vit_figure(tiny: RandomViT):
    """Figure 6: the synthetic image, and ``[CLS]``'s attention and contribution over the patches."""
    grid = tiny.config.image_size // tiny.config.patch_size
    cls_attention, cls_contribution = tiny.cls_attention, tiny.cls_contribution
    fig, axes = plt.subplots(1, 3, figsize=(12, 4), constrained_layout=True)
    axes[0].imshow(tiny.image, interpolation="nearest")
    axes[0].set_title("input (synthetic)")
    shared = np.abs(np.r_[cls_attention.ravel(), cls_contribution.ravel()]).max()
    cells = [str(i) for i in range(grid)]
    for ax, values, title in [
            (axes[1], cls_attention, "attention of [CLS] on patches"),
            (axes[2], cls_contribution, "contribution to [CLS]'s output")]:
        contribution_heatmap(ax, values, cells, title, key_tokens=cells, annotate=True, vmin=-shared, vmax=shared)
        ax.set_xlabel("patch column")
        ax.set_ylabel("patch row")
        ax.tick_params(axis="x", labelrotation=0)
    for ax in axes:
        ax.grid(False)
    axes[0].set_xticks([])
    axes[0].set_yticks([])
    fig.suptitle(f"a tiny ViT with RANDOM weights · layer {max(tiny.dv.layers)} · "
                 "all heads", fontweight="bold")
    return fig
