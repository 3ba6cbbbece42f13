"""Downstream: multiple-choice scoring under interventions against an independent scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cwcore import faithfulness as fa
from faith_helpers import mc_dataset, word_tokenizer


def test_downstream_clean_accuracy_and_collapse(peaked):
    from cwcore.data import choice_batches, continuation_logprobs

    model, _ = peaked
    tokenizer = word_tokenizer()
    data = mc_dataset()
    kwargs = dict(metric=["contribution", "random"], ratios=[0, 0.3], progress=False, task="toy",
                  per_example=True, batch_size=5)
    table = fa.downstream_eval(model, tokenizer, data, **kwargs)
    full = fa.downstream_eval(model, tokenizer, data, collapse=False, **kwargs)
    np.testing.assert_allclose(table.nll, full.nll, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(table.correct, full.correct)
    # clean accuracy and gold NLL against an independent scoring with cwcore.data
    for example, row in enumerate(data):
        batch = choice_batches(row, tokenizer)
        with torch.no_grad():
            logps = continuation_logprobs(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch)
        clean = table[(table.example == example) & (table.ratio == 0)].iloc[0]
        n_gold = int(batch["continuation_mask"][row["gold"]].sum())
        assert clean.correct == (int(logps.argmax()) == row["gold"])
        assert clean.nll == pytest.approx(-float(logps[row["gold"]]) / n_gold, abs=1e-5)
    summary = fa.summarize_downstream(table)
    for column in ("task", "metric", "mode", "ratio", "delta_ppl", "ci_low", "ci_high", "accuracy",
                   "accuracy_ci_low", "accuracy_ci_high", "clean_accuracy", "n_examples"):
        assert column in summary
    zero = summary[summary.ratio == 0]
    assert (zero.delta_ppl == 0).all() and (zero.accuracy == zero.clean_accuracy).all()
    assert (summary.n_examples == 5).all()
