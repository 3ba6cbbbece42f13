"""Faithfulness sweeps: the protocol's sanity properties, live scores, caching and the command line.

The sanity properties need a model whose clean predictions are good, so that any perturbation
hurts: a tiny Llama with peaked random weights scored on sequences sampled from itself (its own
distribution). On such data removing the most important terms must raise the NLL far more than
removing the least important ones, for every metric but the random control.
"""

from __future__ import annotations

import datasets
import numpy as np
import pandas as pd
import pytest
import torch

from cwcore import faithfulness as fa
from cwcore.cache import caching
from cwcore.faithfulness.protocol import MetricSpec, Protocol, parse_metric
from cwcore.faithfulness.sweep import Sweep, pad_batch
from faith_helpers import NON_RANDOM, ForwardCounter, word_tokenizer


# ------------------------------------------------------------------------------------------------
# sanity properties of the protocol
# ------------------------------------------------------------------------------------------------


def test_ratio_zero_gives_exactly_zero(sweep):
    summary = fa.summarize(sweep)
    zero = summary[summary.ratio == 0]
    assert len(zero) == 10
    assert (zero.delta_ppl == 0).all() and (zero.delta_nll == 0).all()
    assert (zero.ci_low == 0).all() and (zero.ci_high == 0).all() and (zero.removed_fraction == 0).all()


def test_ratio_zero_run_is_bit_identical_to_the_clean_model(peaked):
    """Ratio 0 is not run but copied; check the claim that running it would change nothing."""
    model, ids = peaked
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        sweep = Sweep(model, [parse_metric("contribution")], ["comprehensiveness"], [0.0], Protocol(), None, False, 1)
        batch = pad_batch(0, ids.tolist(), list(range(len(ids))), 0, "right")
        logits, _, _ = sweep.clean_pass(batch, [parse_metric("contribution")], sweep.candidates(batch))
    assert torch.equal(logits, reference)


@pytest.mark.parametrize("metric", NON_RANDOM)
def test_comprehensiveness_beats_sufficiency_at_20_percent(sweep, metric):
    summary = fa.summarize(sweep).set_index(["metric", "mode", "ratio"])
    comp, suff = summary.loc[(metric, "comprehensiveness", 0.2)], summary.loc[(metric, "sufficiency", 0.2)]
    assert comp.delta_nll > suff.delta_nll
    assert comp.delta_ppl > suff.delta_ppl
    assert comp.nll_ci_low > suff.nll_ci_high  # not just on average: the intervals separate


def test_random_comprehensiveness_and_sufficiency_agree(sweep):
    summary = fa.summarize(sweep).set_index(["metric", "mode", "ratio"])
    for ratio in (0.2, 0.5):
        comp, suff = summary.loc[("random", "comprehensiveness", ratio)], summary.loc[("random", "sufficiency", ratio)]
        assert comp.nll_ci_low <= suff.nll_ci_high and suff.nll_ci_low <= comp.nll_ci_high
        assert comp.ci_low <= suff.ci_high and suff.ci_low <= comp.ci_high


def test_removed_fraction_follows_the_ratio(sweep):
    summary = fa.summarize(sweep)
    row = summary[summary.ratio > 0]
    assert (abs(row.removed_fraction - row.ratio) < 0.06).all()


def test_runs_are_deterministic_and_the_seed_matters(peaked):
    model, ids = peaked
    kwargs = dict(metric=["contribution", "random"], ratios=[0.3], progress=False, batch_size=4)
    first = fa.faithfulness_curve(model, None, ids, **kwargs).table
    again = fa.faithfulness_curve(model, None, ids, **kwargs).table
    pd.testing.assert_frame_equal(first, again)
    other = fa.faithfulness_curve(model, None, ids, seed=1, **kwargs).table
    random = lambda df: df[df.metric == "random"].delta_nll.to_numpy()
    assert not np.array_equal(random(first), random(other))


def test_batch_size_and_input_type_do_not_change_results(peaked):
    model, ids = peaked
    kwargs = dict(metric=["attention", "random"], ratios=[0.3], mode="comprehensiveness",
                  progress=False)
    base = fa.faithfulness_curve(model, None, ids, batch_size=10, **kwargs).per_sequence
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    for texts, batch_size in ((ids, 3), (blocks, 10), ({"input_ids": ids}, 4)):
        other = fa.faithfulness_curve(model, None, texts, batch_size=batch_size, **kwargs).per_sequence
        pd.testing.assert_frame_equal(base[["metric", "mode", "sequence", "n_removed"]],
                                      other[["metric", "mode", "sequence", "n_removed"]])
        np.testing.assert_allclose(base.nll, other.nll, rtol=0, atol=1e-5)


def test_strings_and_left_padding(peaked):
    model, _ = peaked
    tokenizer = word_tokenizer()
    texts = ["the cat sat on the mat and ran away", "hello world", "one two three four five six seven eight",
             "the dog ran far so it got away"]
    kwargs = dict(metric=["contribution", "random"], ratios=[0.3], progress=False)
    right = fa.faithfulness_curve(model, tokenizer, texts, padding_side="right", **kwargs).per_sequence
    left = fa.faithfulness_curve(model, tokenizer, texts, padding_side="left", **kwargs).per_sequence
    assert (right.n_tokens.to_numpy()[:4] == [9, 2, 8, 8]).all()  # BOS + words, 1 prediction per token after BOS
    np.testing.assert_array_equal(right.n_removed, left.n_removed)
    np.testing.assert_allclose(right.nll, left.nll, rtol=0, atol=1e-4)
    # alone, a sequence gets the same result (random scores are seeded by the sequence's index: skip them)
    single = fa.faithfulness_curve(model, tokenizer, texts[1:2], **kwargs).per_sequence
    same = right[(right.sequence == 1) & (right.metric == "contribution")]
    np.testing.assert_allclose(single[single.metric == "contribution"].nll, same.nll, rtol=0, atol=1e-4)


def test_rungs_two_and_three_coincide_under_the_default_protocol(peaked):
    """With kind=inter the normaliser ||o_i|| is shared by all (head, key) pairs of a query."""
    model, ids = peaked
    metrics = ["value_weighted", "value_weighted_output_normalized", "value_weighted_output_normalized_intra"]
    kwargs = dict(ratios=[0.2, 0.5], progress=False)
    table = fa.faithfulness_curve(model, None, ids, metrics, deduplicate=False, **kwargs).per_sequence.set_index(
        ["metric", "mode", "ratio", "sequence"])
    vw, inter, intra = (table.loc[m] for m in metrics)
    pd.testing.assert_series_equal(vw.nll, inter.nll)
    assert not np.allclose(vw.nll, intra.nll)
    deduplicated = fa.faithfulness_curve(model, None, ids, metrics, **kwargs).per_sequence.set_index(
        ["metric", "mode", "ratio", "sequence"])
    pd.testing.assert_series_equal(deduplicated.nll, table.nll)
    layer = fa.faithfulness_curve(model, None, ids, metrics[:2], scope="layer", **kwargs).per_sequence.set_index(
        ["metric", "mode", "ratio", "sequence"])
    assert not np.allclose(layer.loc[metrics[0]].nll, layer.loc[metrics[1]].nll)


def test_metric_names_and_kinds():
    assert parse_metric("contribution") == MetricSpec("contribution", "contribution", "inter")
    assert parse_metric("contribution_intra") == MetricSpec("contribution_intra", "contribution", "intra")
    assert parse_metric("contribution", kind="intra") == MetricSpec("contribution", "contribution", "intra")
    assert parse_metric("attention").kind == ""
    with pytest.raises(ValueError):
        parse_metric("attention_intra")
    with pytest.raises(ValueError):
        parse_metric("saliency")


def test_live_scores(peaked):
    model, ids = peaked
    kwargs = dict(metric=["attention", "contribution", "random"], ratios=[0.3], progress=False)
    # in the first layer nothing upstream has changed: live and clean scores are the same
    clean0 = fa.faithfulness_curve(model, None, ids, layers=[0], **kwargs).per_sequence
    live0 = fa.faithfulness_curve(model, None, ids, layers=[0], scores="live", **kwargs).per_sequence
    pd.testing.assert_series_equal(clean0.nll, live0.nll)
    pd.testing.assert_series_equal(clean0.n_removed, live0.n_removed)
    clean = fa.faithfulness_curve(model, None, ids, **kwargs).per_sequence.set_index(["metric", "mode", "sequence"])
    live = fa.faithfulness_curve(model, None, ids, scores="live", **kwargs).per_sequence.set_index(["metric", "mode", "sequence"])
    # the random control does not depend on the state; geometric scores do, from layer 1 on
    np.testing.assert_array_equal(clean.loc["random"].nll, live.loc["random"].nll)
    assert not np.allclose(clean.loc["contribution"].nll, live.loc["contribution"].nll)


@pytest.mark.parametrize("unit", ["head_key", "key", "token"])
@pytest.mark.parametrize("scope", ["row", "layer"])
def test_every_unit_and_scope_runs(peaked, unit, scope):
    model, ids = peaked
    summary = fa.faithfulness_curve(model, None, ids[:4], ["contribution", "random"], [0.3], "comprehensiveness",
                                    unit=unit, scope=scope, progress=False, importance="absolute").table
    assert (summary.removed_fraction > 0.1).all() and (summary.delta_nll != 0).all()
    assert set(summary.unit) == {unit} and set(summary.scope) == {scope}


def test_keep_first_token_false_removes_the_sink(peaked):
    model, ids = peaked
    kwargs = dict(metric="attention", ratios=[0.2], mode="comprehensiveness", progress=False)
    kept = fa.faithfulness_curve(model, None, ids, **kwargs).table
    removed = fa.faithfulness_curve(model, None, ids, keep_first_token=False, **kwargs).table
    assert kept.delta_nll.item() != removed.delta_nll.item()


# ------------------------------------------------------------------------------------------------
# cache
# ------------------------------------------------------------------------------------------------


def test_cache_hit_runs_no_forward(peaked, tmp_path):
    model, ids = peaked
    kwargs = dict(metric=["attention", "contribution"], ratios=[0, 0.2, 0.5], progress=False, batch_size=5)
    counter = ForwardCounter(model)
    try:
        with caching(tmp_path):
            first = fa.faithfulness_curve(model, None, ids, **kwargs).table
            assert counter.calls == 2 * (1 + 2 * 2 * 2)  # two batches: a clean pass + 8 points each
            counter.calls = 0
            again = fa.faithfulness_curve(model, None, ids, **kwargs).table
            assert counter.calls == 0
    finally:
        counter.remove()
    pd.testing.assert_frame_equal(first, again)
    # anything that affects the results changes the key
    counter = ForwardCounter(model)
    try:
        with caching(tmp_path):
            fa.faithfulness_curve(model, None, ids, keep_first_token=False, **kwargs)
        assert counter.calls > 0
    finally:
        counter.remove()


def test_a_longer_run_reuses_the_batches_of_a_shorter_one(peaked, tmp_path):
    model, ids = peaked
    kwargs = dict(metric="attention", ratios=[0.5], mode="comprehensiveness", progress=False,
                  batch_size=3)
    with caching(tmp_path):
        short = fa.faithfulness_curve(model, None, ids[:6], **kwargs).per_sequence
    counter = ForwardCounter(model)
    try:
        with caching(tmp_path):
            longer = fa.faithfulness_curve(model, None, ids[:9], **kwargs).per_sequence
        assert counter.calls == 2  # only the third batch: its clean pass and its one point
    finally:
        counter.remove()
    pd.testing.assert_frame_equal(longer[longer.sequence < 6].reset_index(drop=True), short)


def test_interrupted_run_resumes(peaked, tmp_path):
    model, ids = peaked
    kwargs = dict(metric=["attention", "random"], ratios=[0.2, 0.5], progress=False, batch_size=10)
    reference = fa.faithfulness_curve(model, None, ids, **kwargs).table
    counter = ForwardCounter(model, fail_after=4)  # the clean pass and 3 points finish
    try:
        with pytest.raises(KeyboardInterrupt), caching(tmp_path):
            fa.faithfulness_curve(model, None, ids, **kwargs)
    finally:
        counter.remove()
    counter = ForwardCounter(model)
    try:
        with caching(tmp_path):
            resumed = fa.faithfulness_curve(model, None, ids, **kwargs).table
        assert counter.calls == 1 + (8 - 3)  # clean pass again (for the masks) + the 5 missing points
    finally:
        counter.remove()
    pd.testing.assert_frame_equal(resumed, reference)


# ------------------------------------------------------------------------------------------------
# command line and the real model
# ------------------------------------------------------------------------------------------------


def test_command_line_writes_tidy_csvs(peaked, tmp_path, monkeypatch):
    import cwcore.models

    model, _ = peaked
    monkeypatch.setattr(cwcore.models, "load_model", lambda name, dtype=None, device=None: (model, word_tokenizer()))
    code = fa.main(["--model", "tiny", "--data", "gsm8k", "boolq", "--num-sequences", "3", "--block-size", "12",
                    "--num-examples", "3", "--ratios", "0.5", "--metrics", "attention", "random",
                    "--n-bootstrap", "50", "--no-cache", "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    curve = pd.read_csv(tmp_path / "faithfulness_tiny_gsm8k.csv")
    assert {"model", "data", "metric", "mode", "ratio", "delta_ppl", "ci_low", "ci_high", "n_sequences"} <= set(curve)
    assert len(curve) == 4 and (curve.n_sequences == 3).all()
    assert len(pd.read_csv(tmp_path / "aopc_tiny_gsm8k.csv")) == 4
    downstream = pd.read_csv(tmp_path / "downstream_tiny.csv")
    assert set(downstream.task) == {"boolq"} and (downstream.n_examples == 3).all()


@pytest.mark.slow
def test_smollm2_comprehensiveness_beats_sufficiency():
    from cwcore.data import lm_blocks, load_dataset
    from cwcore.models import load_model

    model, tokenizer = load_model("smollm2-135m")
    blocks = lm_blocks(load_dataset("gsm8k", limit=20), tokenizer, block_size=48, num_blocks=4)
    summary = fa.faithfulness_curve(model, tokenizer, blocks, ratios=[0.2], progress=False).table
    table = summary.set_index(["metric", "mode"])
    for metric in NON_RANDOM:
        assert table.loc[(metric, "comprehensiveness")].delta_nll > table.loc[(metric, "sufficiency")].delta_nll


def test_a_model_without_an_lm_head_is_refused_not_scored_on_its_hidden_states():
    from cwcore.core.architectures import UnsupportedModelError
    from tiny_models import tiny_model

    # before: BertModel's hidden states (width 64) were read as logits; with every id below 64 the
    # cross-entropy over 64 "classes" gave a plausible perplexity and a Delta for each ratio
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(UnsupportedModelError, match=r"^faithfulness: BertModel has no language-model head \(its "
                                                    r"output has no logits\), so there is no perplexity"):
        fa.faithfulness_curve(tiny_model("bert"), None, ids, metric=["random"], ratios=[0.1],
                              mode="comprehensiveness", progress=False)


def test_a_callable_metric_reads_the_protocols_kind(peaked, tmp_path):
    """A callable that reads its context's ``kind`` was always told "inter" by the sweep, whatever the protocol's
    kind (method_scores told it the right one): under kind="intra" it ranked as contribution inter."""
    import torch

    from cwcore.cache import caching

    model, ids = peaked
    ids = torch.as_tensor(ids)[:5, :7]

    def by_kind(layer_decomposition, kind, **_):
        return layer_decomposition.contribution(kind)

    kw = dict(ratios=[0.3], mode="comprehensiveness", batch_size=5, progress=False)
    for kind in ("intra", "inter"):
        with caching(tmp_path):  # the pieces of the two kinds apart
            got = fa.faithfulness_curve(model, None, ids, metric=by_kind, kind=kind, **kw).per_sequence
        named = fa.faithfulness_curve(model, None, ids, metric="contribution", kind=kind, **kw).per_sequence
        pd.testing.assert_series_equal(got["nll"], named["nll"])


def test_a_document_column_of_the_wrong_length_and_a_bad_max_length_are_refused_before_any_forward(peaked):
    """document=[0, 0, 1] for 6 sequences left 3 sequences without a document: the summaries dropped them while
    n_sequences still counted 6. max_length=0 meant no truncation, -3 overflowed inside the tokenizer."""
    model, ids = peaked
    kwargs = dict(metric=["random"], ratios=[0.3], progress=False)
    for documents in ([0, 0, 1], [0, 0, 1, 1, 2, 2, 3], [0, 0, 1, 1, 2, None]):
        counter = ForwardCounter(model)
        try:
            with pytest.raises(ValueError, match="'document'"):
                fa.faithfulness_curve(model, None, {"input_ids": ids[:6], "document": documents}, **kwargs)
        finally:
            counter.remove()
        assert counter.calls == 0
    tokenizer = word_tokenizer()
    for bad in (0, -3, True, 2.5):
        with pytest.raises((ValueError, TypeError), match="max_length must be"):
            fa.faithfulness_curve(model, tokenizer, ["the cat sat on the mat"], max_length=bad, **kwargs)
