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


def test_collapse_gives_identical_results_under_mean_removal_too():
    """Collapsing shared-context single-token choices into one row changed which rows the mean stand-in of
    removal="mean" averages over: the gold NLL moved by up to 1 nat. Mean removal is now never collapsed."""
    import numpy as np

    from cwcore import faithfulness as fa
    from faith_helpers import mc_dataset, peaked_llama, word_tokenizer

    tokenizer, model, data = word_tokenizer(), peaked_llama(0).double(), mc_dataset()
    # grad_x_input differentiates the row's log-likelihood: a collapsed row holds no answer (gold NLL moved by
    # up to 4.85 nats); it is never collapsed either
    for metric, removal in (("contribution", "zero"), ("contribution", "mean"), ("grad_x_input", "zero")):
        out = [fa.downstream_eval(model, tokenizer, data, metric, [0.5], "comprehensiveness", per_example=True,
                                  collapse=collapse, removal=removal, progress=False).sort_values("example")
               for collapse in (True, False)]
        np.testing.assert_allclose(out[0]["nll"].to_numpy(), out[1]["nll"].to_numpy(), rtol=1e-9, atol=1e-9)


def test_downstream_reads_layers_as_the_other_entry_points_do():
    """layers=[-1] raised an IndexError and layers=1 a TypeError in downstream_eval, and a Protocol's negative
    layers failed in faithfulness_curve too, where the keyword read them as layer 1."""
    import numpy as np

    from cwcore import faithfulness as fa
    from faith_helpers import mc_dataset, peaked_llama, word_tokenizer

    tokenizer, model, data = word_tokenizer(), peaked_llama(0), mc_dataset()
    kw = dict(per_example=True, progress=False)
    expected = fa.downstream_eval(model, tokenizer, data, "contribution", [0.5], "comprehensiveness", layers=[1], **kw)
    for layers in ([-1], 1, -1):
        got = fa.downstream_eval(model, tokenizer, data, "contribution", [0.5], "comprehensiveness", layers=layers, **kw)
        np.testing.assert_array_equal(got["nll"].to_numpy(), expected["nll"].to_numpy())
    other = fa.downstream_eval(model, tokenizer, data, "contribution", [0.5], "comprehensiveness", layers=[0], **kw)
    assert not np.array_equal(other["nll"].to_numpy(), expected["nll"].to_numpy())  # the control
    texts = [" ".join(["a", "b", "c", "d", "e", "f"])] * 2
    by_object = fa.faithfulness_curve(model, tokenizer, texts, "contribution", [0.5], "comprehensiveness",
                                      protocol=fa.Protocol(layers=(-1,)), progress=False).per_sequence
    by_keyword = fa.faithfulness_curve(model, tokenizer, texts, "contribution", [0.5], "comprehensiveness",
                                       layers=[1], progress=False).per_sequence
    np.testing.assert_array_equal(by_object["nll"].to_numpy(), by_keyword["nll"].to_numpy())


def test_a_list_of_datasets_is_one_task_each_named_by_task():
    """Each Dataset of a list was labelled "task": their example ids overlapped, so the AOPC counted 5 examples
    of 8 and the clean accuracy averaged 5."""
    from cwcore import faithfulness as fa
    from faith_helpers import mc_dataset, peaked_llama, word_tokenizer

    tokenizer, model, data = word_tokenizer(), peaked_llama(0), mc_dataset()
    parts = [data.select(range(3)), data.select(range(3, len(data)))]
    kw = dict(per_example=True, progress=False)
    with pytest.raises(ValueError, match="one distinct task name each"):
        fa.downstream_eval(model, tokenizer, parts, "random", [0.5], "comprehensiveness", **kw)
    table = fa.downstream_eval(model, tokenizer, parts, "random", [0.5], "comprehensiveness", task=["a", "b"], **kw)
    assert table.groupby("task")["example"].nunique().to_dict() == {"a": 3, "b": len(data) - 3}
    summary = fa.summarize_downstream(table)
    assert summary.set_index("task")["n_examples"].to_dict() == {"a": 3, "b": len(data) - 3}


def test_the_accuracy_interval_is_wilsons_and_never_collapses():
    """The percentile bootstrap of 0/1 outcomes gave [0, 0] when every example was wrong (and [1, 1] when every one
    was right); the reference is Wilson's score interval written out by hand."""
    import math

    import pandas as pd

    from cwcore import faithfulness as fa

    def wilson(k, n, z=1.959963984540054):
        centre, half = (k + z * z / 2) / (n + z * z), z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
        return centre - half, centre + half

    rows = []
    for example in range(20):
        for ratio, correct in ((0.0, example < 7), (0.5, False)):
            rows.append({"task": "t", "example": example, "metric": "m", "mode": "comprehensiveness", "ratio": ratio,
                         "nll": 1.0 + ratio, "clean_nll": 1.0, "correct": correct, "clean_correct": example < 7,
                         "n_removed": 0, "n_candidates": 10, "n_tokens": 1})
    summary = fa.summarize_downstream(pd.DataFrame(rows), n_bootstrap=200).set_index("ratio")
    for ratio, k in ((0.0, 7), (0.5, 0)):
        low, high = wilson(k, 20)
        assert summary.loc[ratio, "accuracy"] == k / 20
        assert summary.loc[ratio, "accuracy_ci_low"] == pytest.approx(max(low, 0.0), abs=1e-12)
        assert summary.loc[ratio, "accuracy_ci_high"] == pytest.approx(high, abs=1e-12)
    assert summary.loc[0.5, "accuracy_ci_high"] > 0.15  # about 0.16: twenty wrong answers do not prove 0
