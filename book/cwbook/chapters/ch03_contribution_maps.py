"""Chapter 3, contribution maps on real text: the maps of one sentence in one head and one layer, and
statistics of attention and contribution weights over blocks of real text, per layer."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

import cwcore
from cwbook import analysis
from cwcore.core.architectures import input_device
from cwcore.data import lm_batches, lm_blocks
from cwcore.plotting import band, layer_axis, legend_below, per_layer
from cwbook.chapters.common import (ATTN, COLOURS, FACTOR_COLUMNS, INTER, INTRA, OTHER, VIEWS, SentenceMaps,
                                    Statistics, collect_statistics, decompose_sentence, factors_figure,
                                    maps_head_figure, maps_layer_figure)
from cwbook.notebook import tick

NEGATIVE = COLOURS[3]


def sentence_maps(lm, tokenizer, text: str, layer: int | None, head: int | None, rank_min_keys: int,
                  model_name: str) -> SentenceMaps:
    """Decompose ``text`` (the tokenizer's default special tokens) and pick the layer (``layer``, or the
    middle one) and head (``head``, or the one whose attention on position 0, over queries 1..n-1,
    exceeds its intra-head contribution the most) of the maps."""
    maps = decompose_sentence(lm, tokenizer, text, layer, head, lambda L, _: (
        L.attention[0, :, 1:, 0].mean(-1) - L.contribution("intra")[0, :, 1:, 0].mean(-1)), chapter="chapter 3")
    tokens, layer_shown, head_shown, n_heads, L = (maps.tokens, maps.layer_shown, maps.head_shown, maps.n_heads, maps.L)
    ids = maps.inputs["input_ids"][0].tolist()
    quoted, quoted_md = {"n_layers": len(maps.layers)}, {}

    bos = tokenizer.bos_token_id
    if bos is not None and ids[0] == bos:
        quoted_md["bos_sentence"] = (
            f"The tokenizer of {model_name} prepends its "
            f"beginning-of-sequence token {tick(tokens[0])}, so position 0 is "
            "that token, not a word of the text; the maps show all "
            f"{len(tokens)} tokens, {tick(tokens[0])} included.")
    else:
        quoted_md["bos_sentence"] = (
            f"The tokenizer of {model_name} adds no "
            "beginning-of-sequence token, so position 0 is the first word of "
            f"the text, {tick(tokens[0])}; the maps show exactly the "
            f"{len(tokens)} tokens of the sentence.")
    if head is None:
        quoted_md["head_reason"] = (
            "the head of this layer in which the attention on "
            "position 0 exceeds its intra-head contribution the most. The "
            "code picks it to show the effect; the statistics further down "
            "say how typical it is.")
    else:
        quoted_md["head_reason"] = "the head set by the `head` parameter."
    quoted.update(layer_shown=layer_shown, head_shown=head_shown, n_heads=n_heads)
    quoted_md["first_token"] = tick(tokens[0])

    # [query, key]: the keys each query can see
    visible = analysis.visible_keys(L.attention)[0]

    def hide(weights):
        # keys a query cannot see are not weights: NaN, drawn grey
        return weights.masked_fill(~visible, float("nan")).cpu().numpy()

    alpha_map = hide(L.attention[0, head_shown])
    intra_map = hide(L.contribution("intra")[0, head_shown])
    inter_map = hide(L.contribution("inter")[0, head_shown])

    # queries 1..n-1: query 0 sees only itself (its weight is 1 trivially)
    rows = slice(1, None)
    q_min, k_min = np.unravel_index(np.nanargmin(intra_map[rows]), intra_map[rows].shape)
    q_min += 1
    alpha_h, intra_h = L.attention[0, head_shown], L.contribution("intra")[0, head_shown]
    head_rho = analysis.spearman_rows(alpha_h, intra_h, visible, rank_min_keys)
    head_tau = analysis.kendall_rows(alpha_h, intra_h, visible, rank_min_keys)
    quoted.update(
        alpha_first=np.nanmean(alpha_map[rows, 0]),
        intra_first=np.nanmean(intra_map[rows, 0]),
        inter_first=np.nanmean(inter_map[rows, 0]),
        n_negative=int((intra_map[rows] < 0).sum()),
        n_weights=int(np.isfinite(intra_map[rows]).sum()),
        min_intra=intra_map[q_min, k_min],
        max_intra=np.nanmax(intra_map[rows]),
        head_rho=np.nanmean(head_rho.cpu().numpy()),
        head_tau=np.nanmean(head_tau.cpu().numpy()),
        rank_min_keys=rank_min_keys)
    quoted_md["min_pair"] = f"key {tick(tokens[k_min])} for query {tick(tokens[q_min])}"

    q = len(tokens) - 1
    row = pd.DataFrame({
        "attention α": L.attention[0, head_shown, q].cpu(),
        "relative norm ‖ṽ‖/‖oʰ‖": L.relative_norm("intra")[0, head_shown, q].cpu(),
        "alignment cos(oʰ, ṽ)": L.cosine("intra")[0, head_shown, q].cpu(),
        "contribution c": L.contribution("intra")[0, head_shown, q].cpu(),
    }).astype(float)  # one row per key; the first three multiply to the fourth
    top = int(row["contribution c"].argmax())
    for i, column in enumerate(["alpha", "rel", "cos", "c"]):
        quoted[f"row_first_{column}"] = row.iloc[0, i]
    quoted["row_top_rel"] = row.iloc[:, 1].max()
    quoted_md["row_top_c_token"] = tick(tokens[top])
    quoted_md["last_token"] = tick(tokens[q])

    # attention: mean over heads; contribution: inter-head, sum over heads
    token_attention = hide(L.token_level("attention")[0])
    token_contribution = hide(L.token_level("contribution", "inter")[0])
    quoted.update(
        layer_alpha_first=np.nanmean(token_attention[1:, 0]),
        layer_c_first=np.nanmean(token_contribution[1:, 0]),
        layer_n_negative=int((token_contribution[1:] < 0).sum()),
        layer_n_weights=int(np.isfinite(token_contribution[1:]).sum()))
    quoted_md["explain_command"] = (f'`cwcore explain "{text}" --model {model_name} '
                                    f'--layer {layer_shown} --out fig.png`')
    quoted_md["explorer_command"] = f'`cwcore explain "{text}" --model {model_name} --out fig.html`'
    maps.alpha_map, maps.intra_map, maps.inter_map, maps.row, maps.query = alpha_map, intra_map, inter_map, row, q
    maps.token_attention, maps.token_contribution, maps.quoted, maps.quoted_md = (
        token_attention, token_contribution, quoted, quoted_md)
    return maps


def statistics(lm, tokenizer, *, model_name: str, data: str, n_sequences: int, seq_len: int,
               batch_size: int, kind: str, min_keys: int, rank_min_keys: int, factor_samples: int,
               n_bootstrap: int, seed: int, cache: bool) -> Statistics:
    """Collect and summarise the statistics on ``n_sequences`` blocks of ``seq_len`` tokens of ``data``."""
    blocks = lm_blocks(cwcore.load_dataset(data), tokenizer, block_size=seq_len, num_blocks=n_sequences)
    collected = collect_statistics(lm, lm_batches(blocks, batch_size, device=input_device(lm)), chapter="chapter 3",
                                   seq_len=seq_len, kind=kind,
                                   min_keys=min_keys, rank_min_keys=rank_min_keys, factor_samples=factor_samples,
                                   n_bootstrap=n_bootstrap, seed=seed, cache=cache, blocks=blocks)
    factors, summary, n_layers = collected.factors, collected.summary, collected.n_layers

    quoted, quoted_md = {}, {}
    bos = tokenizer.bos_token_id
    starts_with_bos = bos is not None and all(b[0] == bos for b in blocks["input_ids"])
    quoted.update(n_sequences=len(blocks), seq_len=seq_len, min_keys=min_keys)
    quoted_md["data_name"] = f"`{data}`"
    if starts_with_bos:
        quoted_md["blocks_note"] = (
            "Every block starts with "
            f"{tick(tokenizer.decode([bos]))}, as the tokenizer of {model_name} "
            "starts any text, so position 0, \"the first token\" below, is "
            "always that token.")
    else:
        quoted_md["blocks_note"] = (
            f"The tokenizer of {model_name} adds no "
            "beginning-of-sequence token, so position 0, \"the first token\" "
            "below, is whatever token the cut falls on, often in the middle "
            "of a document. It is still the first token the model sees.")
    quoted_md["caption"] = (f"{model_name}, {len(blocks)} sequences of {seq_len} tokens "
                            f"of {data}, seed {seed}")

    # the three factors
    quoted["factor_samples"] = factor_samples
    quoted_md["kind_name"] = f"{kind}-head"
    med = factors.groupby("group")[FACTOR_COLUMNS].median()
    for column, short in zip(FACTOR_COLUMNS, ("alpha", "rel", "cos")):
        for group in ("first", "other"):
            quoted[f"med_{group}_{short}"] = med.loc[group, column]
    shorter = (med.loc["first", "relative_norm"] < med.loc["other", "relative_norm"])
    quoted_md["rel_cmp"] = "shorter" if shorter else "not shorter"

    # mass on position 0
    att_first = per_layer(summary, "mass", "attention", "first")
    intra_first = per_layer(summary, "mass", "intra", "first")
    token_first = per_layer(summary, "mass", "token", "first")
    below = att_first["mean"] > token_first["mean"]
    peak = int(att_first["mean"].idxmax())
    quoted.update(
        att_first_mean=att_first["mean"].mean(),
        intra_first_mean=intra_first["mean"].mean(),
        token_first_mean=token_first["mean"].mean(),
        n_layers_less=int(below.sum()),
        n_layers_less_ci=int((att_first["low"] > token_first["high"]).sum()),
        n_layers_more_ci=int((token_first["low"] > att_first["high"]).sum()),
        peak_layer=peak,
        peak_att=att_first.loc[peak, "mean"],
        peak_token=token_first.loc[peak, "mean"],
        peak_token_low=token_first.loc[peak, "low"],
        peak_token_high=token_first.loc[peak, "high"])
    if below.sum() > n_layers / 2:
        quoted_md["first_conclusion"] = (
            "In most layers, then, the attention the "
            "first token receives overstates its share of the output: what "
            "it carries is short, or points away from the output (Figure 4).")
    else:
        quoted_md["first_conclusion"] = (
            "In this model, then, the attention the "
            "first token receives does not overstate its share of the output "
            "in most layers.")

    # negative weights
    neg_intra = per_layer(summary, "negative_share", "intra")["mean"]
    neg_token = per_layer(summary, "negative_share", "token")["mean"]
    negm_token = per_layer(summary, "negative_mass", "token")["mean"]
    quoted.update(
        neg_intra_mean=neg_intra.mean(),
        neg_intra_max=neg_intra.max(),
        neg_intra_max_layer=int(neg_intra.idxmax()),
        neg_inter_mean=per_layer(summary, "negative_share", "inter")["mean"].mean(),
        neg_token_mean=neg_token.mean(),
        negm_token_mean=negm_token.mean(),
        negm_token_max=negm_token.max(),
        negm_token_max_layer=int(negm_token.idxmax()))

    # rank agreement
    rho_intra = per_layer(summary, "spearman", "intra")
    low = int(rho_intra["mean"].idxmin())
    quoted.update(
        rho_intra_mean=rho_intra["mean"].mean(),
        rho_inter_mean=per_layer(summary, "spearman", "inter")["mean"].mean(),
        rho_token_mean=per_layer(summary, "spearman", "token")["mean"].mean(),
        rho_low_layer=low,
        rho_low=rho_intra.loc[low, "mean"],
        rho_low_lo=rho_intra.loc[low, "low"],
        rho_low_hi=rho_intra.loc[low, "high"],
        rho_high=rho_intra["mean"].max(),
        rho_high_layer=int(rho_intra["mean"].idxmax()))
    collected.quoted, collected.quoted_md = quoted, quoted_md
    return collected


# --- figures -------------------------------------------------------------------------------------------

def maps_head(maps: SentenceMaps, model_name: str):
    """Figure 1: the four maps of the head shown (:func:`cwbook.chapters.common.maps_head_figure`)."""
    return maps_head_figure(maps.alpha_map, maps.intra_map, maps.inter_map, maps.tokens,
                            f"{model_name} · layer {maps.layer_shown} · head {maps.head_shown}")


def row_factors(maps: SentenceMaps, model_name: str):
    """Figure 2: the last query's weights and their three factors, per key (negative weights red)."""
    tokens = maps.tokens
    fig, axes = plt.subplots(4, 1, figsize=(10, 8.6), sharex=True, constrained_layout=True)
    x = np.arange(len(tokens))
    colours = [ATTN, OTHER, OTHER, INTRA]
    for ax, (name, values), colour in zip(axes, maps.row.items(), colours):
        if name.startswith("contribution"):
            colour = [INTRA if v >= 0 else NEGATIVE for v in values]
        ax.bar(x, values, color=colour, width=0.7)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
    axes[2].set_ylim(-1.05, 1.05)
    axes[-1].set_xticks(x, [repr(t)[1:-1] for t in tokens], rotation=60, ha="right", rotation_mode="anchor")
    q = maps.query
    axes[0].set_title(f"{model_name} · layer {maps.layer_shown} · head {maps.head_shown} · "
                      f"query {q} ({tokens[q]!r})")
    return fig


def maps_layer(maps: SentenceMaps, model_name: str):
    """Figure 3: the whole layer at token level (:func:`cwbook.chapters.common.maps_layer_figure`)."""
    return maps_layer_figure(maps.token_attention, maps.token_contribution, maps.tokens,
                             f"{model_name} · layer {maps.layer_shown} · all {maps.n_heads} heads")


def factors_per_layer(stats: Statistics, kind: str, model_name: str):
    """Figure 4: the three factors per layer, for position 0 and for all other keys."""
    groups = [("first", "position 0", INTRA), ("other", "other keys", OTHER)]
    return factors_figure(stats.factors, kind, groups, f"{model_name}: factors of {kind}-head contribution weights")


def first_token_mass(stats: Statistics, model_name: str):
    """Figure 5: attention and contribution mass on position 0 per layer, with intervals."""
    summary = stats.summary
    fig, ax = plt.subplots(figsize=(9, 4.4), constrained_layout=True)
    band(ax, per_layer(summary, "mass", "attention", "first"), ATTN, r"attention $\alpha_{i0}$, mean over heads")
    band(ax, per_layer(summary, "mass", "intra", "first"), INTRA, r"intra-head $c^h_{i0}$, mean over heads")
    band(ax, per_layer(summary, "mass", "token", "first"), INTER, r"inter-head $c^h_{i0}$, sum over heads")
    ax.axhline(0, color="black", lw=0.8)
    layer_axis(ax)
    ax.set_ylabel("mass on position 0")
    legend_below(fig, ax)
    ax.set_title(model_name, fontsize=12)
    return fig


def negative_weights(stats: Statistics, model_name: str):
    """Figure 6: the share of negative weights (top) and their mass per row (bottom), per layer."""
    summary = stats.summary
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, constrained_layout=True)
    for view, label, colour in VIEWS:
        band(ax0, per_layer(summary, "negative_share", view), colour, label)
    for view, label, colour in [VIEWS[0], VIEWS[2]]:
        band(ax1, per_layer(summary, "negative_mass", view), colour, "_" + label)
    ax0.set_ylabel("share of weights < 0")
    ax1.set_ylabel(r"$-\sum_j \min(c_{ij}, 0)$ per row")
    layer_axis(ax1)
    for ax in (ax0, ax1):
        ax.set_ylim(bottom=0)
    legend_below(fig, ax0)
    ax0.set_title(model_name, fontsize=12)
    return fig


def rank_agreement(stats: Statistics, model_name: str):
    """Figure 7: Spearman's rho of attention and contribution weights per layer, with intervals."""
    fig, ax = plt.subplots(figsize=(9, 4.4), constrained_layout=True)
    for view, label, colour in VIEWS:
        band(ax, per_layer(stats.summary, "spearman", view), colour, label)
    ax.axhline(1, color="0.5", lw=0.8, ls=":")
    layer_axis(ax)
    ax.set_ylabel(r"Spearman $\rho$(attention, contribution)")
    legend_below(fig, ax)
    ax.set_title(model_name, fontsize=12)
    return fig
