"""What a ranking removes: the anatomy of a faithfulness selection, measured in the clean run."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import torch

from cwcore import stats
from cwcore.core.architectures import attention_blocks
from cwcore.core.decomposition import METRICS, decompose
from cwcore.runs import progress as progress_bar, shard_map
from .ladder import PROTOCOLS
from cwcore.faithfulness.protocol import Protocol, as_protocol, modes as parse_modes, ranking_identity
from cwcore.faithfulness.ranking import candidate_mask, layer_windows, removal_mask, selection

__all__ = ["MEASURES", "LADDER", "STEPS", "selection_anatomy", "layer_average", "explain_step", "explain_held_out"]

MEASURES = ("removed_share", "output_shift", "head_norm", "first_token_attention")
LADDER = tuple(map(str, METRICS))


def _layer_rows(ld, attention_mask, metrics, ratios, modes, protocol: Protocol, window):
    """``{(metric, mode, ratio): {measure: [batch]}}`` for one layer."""
    kind, importance, unit, scope = protocol.kind, protocol.importance, protocol.unit, protocol.scope
    alpha = ld.attention.float()  # [b, h, q, k]
    cand = candidate_mask(attention_mask, protocol.keep_first_token, window).to(alpha.device)  # [b, 1, q, k]
    vw = ld.value_weighted.float()
    total_mass = (vw * cand).sum((1, 2, 3))
    values, w_o = ld.geometry.values, ld.geometry.w_o
    if values is None or w_o is None:
        raise ValueError("the layer's geometry has no head-space values: anatomy needs the head-space decomposition")
    values, w_o = values.float(), w_o.float()
    output_norm = ld.output_norm.float()  # [b, q]
    head_norm = ld.head_output_norm.float()  # [b, h, q]
    relative_head = head_norm / head_norm.mean(1, keepdim=True).clamp_min(torch.finfo(head_norm.dtype).tiny)
    first = attention_mask.long().argmax(-1).to(alpha.device)  # first real token of each row
    first_attention = alpha.gather(-1, first[:, None, None, None].expand(*alpha.shape[:3], 1))[..., 0]  # [b, h, q]
    queries = cand[:, 0].any(-1)  # [b, q] queries with at least one candidate
    out = {}
    for metric in metrics:
        rung, rung_kind = ranking_identity(metric, kind, unit, scope)  # ranked exactly as the sweep ranks it
        scores = ld.metric(rung, rung_kind or kind).float()
        if importance == "absolute":
            scores = scores.abs()
        chosen = selection(scores, cand, ratios, modes, unit, scope)
        for mode in modes:
            for t, ratio in enumerate(ratios):
                mask = (removal_mask(chosen.buckets[mode], t, cand) & cand).expand_as(alpha)  # [b, h, q, k]
                taken = mask.sum((1, 2, 3)).clamp_min(1)
                removed = (alpha * mask) @ values  # [b, h, q, head_dim]
                shift_vec = torch.einsum("bhqd,hmd->bqm", removed, w_o)
                shift = shift_vec.norm(dim=-1) / output_norm.clamp_min(torch.finfo(output_norm.dtype).tiny)
                shift = (shift * queries).sum(-1) / queries.sum(-1).clamp_min(1)
                out[(metric, mode, float(ratio))] = {
                    "removed_share": (vw * mask).sum((1, 2, 3)) / total_mass,
                    "output_shift": shift,
                    "head_norm": (relative_head[..., None] * mask).sum((1, 2, 3)) / taken,
                    "first_token_attention": (first_attention[..., None] * mask).sum((1, 2, 3)) / taken,
                    "n_removed": mask.sum((1, 2, 3)).float(),
                }
    return out


def selection_anatomy(model, blocks, metrics: Sequence[str] = LADDER, ratios: Sequence[float] = (0.01, 0.05),
                      modes: Sequence[str] = ("comprehensiveness",), *, protocol: "str | Protocol" = "per-head",
                      layers=None, batch_size: int = 8, progress: bool = True, **protocol_keywords) -> pd.DataFrame:
    """One row per (document, layer, metric, mode, ratio) with the :data:`MEASURES` of the terms that
    ``protocol`` removes (a :class:`~cwcore.faithfulness.Protocol`, or the name of a main protocol of
    :data:`cwbook.ladder.PROTOCOLS`; its fields may be replaced by keywords, e.g.
    ``importance="absolute"``), computed in float32 from the clean forward (so ``scores="live"`` is refused;
    the protocol's ``layers`` are the layers dissected, as is ``layers`` here)."""
    name = protocol if isinstance(protocol, str) else None
    if name is not None:
        if name not in PROTOCOLS:
            raise ValueError(f"protocol must be a Protocol or one of {list(PROTOCOLS)}, not {name!r}")
        protocol = Protocol(**PROTOCOLS[name])
    protocol = as_protocol(protocol, **protocol_keywords)
    if protocol.scores != "clean":
        raise ValueError("the anatomy measures the clean run: scores='live' has no clean selection to dissect")
    if layers is None and protocol.layers is not None:
        layers = list(protocol.layers)
    elif layers is not None and protocol.layers is not None and sorted(set(layers)) != list(protocol.layers):
        raise ValueError(f"layers={list(layers)} and the protocol's layers {list(protocol.layers)} disagree")
    modes = parse_modes(modes)
    ratios = [float(r) for r in ratios]
    if any(b <= a for a, b in zip(ratios, ratios[1:])) or not all(0 < r <= 1 for r in ratios):
        raise ValueError(f"ratios must be ascending in (0, 1], got {ratios}")
    num_layers = len(attention_blocks(model))
    windows = layer_windows(model, num_layers)
    device = next(model.parameters()).device
    ids_all = torch.as_tensor(blocks["input_ids"])
    mask_all = torch.as_tensor(blocks["attention_mask"]) if "attention_mask" in blocks.column_names \
        else torch.ones_like(ids_all)
    documents = list(blocks["document"]) if "document" in blocks.column_names else list(range(len(ids_all)))

    def one(start: int) -> list[dict]:
        """The rows of the batch of documents from ``start`` on."""
        ids, attention_mask = ids_all[start:start + batch_size], mask_all[start:start + batch_size]
        d = decompose(model, layers=layers, input_ids=ids.to(device), attention_mask=attention_mask.to(device))
        rows = []
        for layer in d.layers:
            found = _layer_rows(d[layer], attention_mask.to(device), metrics, ratios, modes, protocol, windows[layer])
            for (metric, mode, ratio), measures in found.items():
                values = {k: v.detach().cpu().numpy() for k, v in measures.items()}
                for i in range(len(ids)):
                    rows.append({"document": documents[start + i], "sequence": start + i, "layer": layer,
                                 "metric": metric, "mode": mode, "ratio": ratio,
                                 **{k: float(v[i]) for k, v in values.items()}})
        return rows

    starts = list(range(0, len(ids_all), batch_size))
    bar = progress_bar(len(starts), "anatomy", "batch", enabled=progress, leave=False)
    try:  # split over ranks when there are any (cwcore.runs.shard_map); the order stays the batches'
        rows = [row for part in shard_map(starts, one, progress=bar) for row in part]
    finally:
        bar.close()
    return pd.DataFrame(rows).assign(protocol=name or protocol.variant, importance=protocol.importance,
                                     variant=protocol.variant)


def layer_average(anatomy: pd.DataFrame) -> pd.DataFrame:
    """The measures averaged over layers (every layer weighs the same): one row per (document,
    metric, mode, ratio, protocol, importance)."""
    keys = [c for c in ("protocol", "importance", "metric", "mode", "ratio", "document") if c in anatomy]
    return anatomy.groupby(keys, sort=False)[list(MEASURES)].mean().reset_index()


def explain_step(anatomy: pd.DataFrame, curves: pd.DataFrame, lower: str, higher: str, *,
                 measure: str = "output_shift", n_bootstrap: int = 1000, seed: int = 0) -> pd.DataFrame:
    """Does a step's difference in damage go with its difference in what it removes?

    Per mode and ratio: the paired ``higher - lower`` gaps over documents of ``measure`` (``measure_gap``)
    and of ``delta_nll`` (``damage_gap``) with bootstrap intervals, and Spearman's rho between them
    (``rho``, judged by :func:`cwcore.stats.verdict` in ``rho_verdict``): the explanation predicts rho > 0."""
    doc = layer_average(anatomy) if "layer" in anatomy else anatomy
    cv = curves.copy()
    cv["metric"] = cv["metric"].str.replace(r"_(intra|inter)$", "", regex=True)
    cv["delta_nll"] = cv["nll"] - cv["clean_nll"]
    cv = cv.groupby(["metric", "mode", "ratio", "document"], sort=False)["delta_nll"].mean().reset_index()
    rows = []
    for (mode, ratio), part in doc.groupby(["mode", "ratio"], sort=False):
        dmg = cv[(cv["mode"] == mode) & np.isclose(cv["ratio"], ratio)]
        if dmg.empty:
            continue
        a = part.pivot_table(index="document", columns="metric", values=measure)
        b = dmg.pivot_table(index="document", columns="metric", values="delta_nll")
        if not {lower, higher} <= set(a.columns) or not {lower, higher} <= set(b.columns):
            continue
        both = pd.DataFrame({"measure_gap": a[higher] - a[lower], "damage_gap": b[higher] - b[lower]}).dropna()
        if len(both) < 2:
            continue
        m = stats.bootstrap_ci(both["measure_gap"].to_numpy(), np.mean, n_resamples=n_bootstrap, seed=seed)
        g = stats.bootstrap_ci(both["damage_gap"].to_numpy(), np.mean, n_resamples=n_bootstrap, seed=seed)
        rho = stats.spearman_ci(both["measure_gap"], both["damage_gap"], n_resamples=n_bootstrap, seed=seed)
        rows.append({"mode": mode, "ratio": float(ratio), "lower": lower, "higher": higher, "measure": measure,
                     "measure_gap": m.estimate, "measure_gap_ci_low": m.low, "measure_gap_ci_high": m.high,
                     "damage_gap": g.estimate, "damage_gap_ci_low": g.low, "damage_gap_ci_high": g.high,
                     "rho": rho.estimate, "rho_ci_low": rho.low, "rho_ci_high": rho.high,
                     "rho_verdict": stats.verdict(rho.low, rho.high) if np.isfinite(rho.low) else stats.NOT_MEASURED,
                     "n_units": len(both), "unit": "document"})
    return pd.DataFrame(rows)


#: the ladder's three steps: the explained one (2->3) and its negative controls (1->2, 3->4)
STEPS = tuple(zip(LADDER, LADDER[1:]))


def _gaps(doc: pd.DataFrame, cv: pd.DataFrame, lower: str, higher: str, mode: str, ratio: float, measure: str):
    """Per document: (measure gap, damage gap) of ``higher - lower`` at one mode and ratio."""
    part = doc[(doc["mode"] == mode) & np.isclose(doc["ratio"], ratio)]
    dmg = cv[(cv["mode"] == mode) & np.isclose(cv["ratio"], ratio)]
    a = part.pivot_table(index="document", columns="metric", values=measure)
    b = dmg.pivot_table(index="document", columns="metric", values="delta_nll")
    if not {lower, higher} <= set(a.columns) or not {lower, higher} <= set(b.columns):
        return None
    return pd.DataFrame({"measure_gap": a[higher] - a[lower], "damage_gap": b[higher] - b[lower]}).dropna()


def explain_held_out(anatomy: pd.DataFrame, curves: pd.DataFrame, steps=STEPS, *, measure: str = "output_shift",
                     seed: int = 0, alpha: float = 0.05) -> pd.DataFrame:
    """The explanation of :func:`explain_step` ("the step's damage gap follows its ``measure`` gap across
    documents") fitted on half of the documents and tested on the other half, for the explained step and
    its negative controls (default: all three ladder steps, 2->3 and the controls 1->2 and 3->4).

    One random split (``default_rng(seed)``); a cell is selected when its fit-half rho is above 0 and tested
    one-sided on the other half; ``p_holm`` over every cell (unselected ones count as p = 1); ``verdict``
    holds when ``p_holm < alpha``, else inconclusive (not measured when a half has fewer than three documents)."""
    from scipy import stats as scipy_stats

    doc = layer_average(anatomy) if "layer" in anatomy else anatomy
    cv = curves.copy()
    cv["metric"] = cv["metric"].str.replace(r"_(intra|inter)$", "", regex=True)
    cv["delta_nll"] = cv["nll"] - cv["clean_nll"]
    cv = cv.groupby(["metric", "mode", "ratio", "document"], sort=False)["delta_nll"].mean().reset_index()
    documents = np.array(sorted(set(doc["document"]) & set(cv["document"])))
    order = np.random.default_rng(seed).permutation(len(documents))
    fit = set(documents[order[: len(documents) // 2]].tolist())
    rows = []
    cells = doc[["mode", "ratio"]].drop_duplicates().itertuples(index=False)
    cells = list(cells)
    for lower, higher in steps:
        for mode, ratio in cells:
            both = _gaps(doc, cv, lower, higher, mode, ratio, measure)
            if both is None:
                continue
            in_fit = both.index.isin(list(fit))
            a, b = both[in_fit], both[~in_fit]
            row = {"lower": lower, "higher": higher, "role": "explained" if (lower, higher) == STEPS[1] else "control",
                   "mode": mode, "ratio": float(ratio), "measure": measure, "n_fit": len(a), "n_test": len(b),
                   "rho_fit": np.nan, "selected": False, "rho_test": np.nan, "p_test": np.nan}
            if len(a) >= 3 and len(b) >= 3:
                row["rho_fit"] = float(scipy_stats.spearmanr(a["measure_gap"], a["damage_gap"]).statistic)
                row["selected"] = bool(row["rho_fit"] > 0)
                test = scipy_stats.spearmanr(b["measure_gap"], b["damage_gap"], alternative="greater")
                row["rho_test"] = float(test.statistic)
                if row["selected"]:
                    row["p_test"] = float(test.pvalue)
            rows.append(row)
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table["p_holm"] = stats.holm(table["p_test"].to_numpy())
    measured = (table["n_fit"] >= 3) & (table["n_test"] >= 3)
    table["verdict"] = np.where(~measured, stats.NOT_MEASURED,
                                np.where(table["p_holm"] < alpha, stats.HOLDS, stats.INCONCLUSIVE))
    return table.assign(seed=seed, n_tests=len(table), unit="document")
