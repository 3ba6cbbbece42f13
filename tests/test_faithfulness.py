"""Faithfulness sweeps: ranking against a naive sort, the protocol's sanity properties, caching.

The sanity properties need a model whose clean predictions are good, so that any perturbation
hurts: a tiny Llama with peaked random weights scored on sequences sampled from itself (its own
distribution). On such data removing the most important terms must raise the NLL far more than
removing the least important ones, for every metric but the random control.
"""

from __future__ import annotations

import math

import datasets
import numpy as np
import pandas as pd
import pytest
import torch
import transformers as tf

from cwcore import faithfulness as fa
from cwcore.ranking import candidate_mask, removal_mask, selection, selection_buckets
from tiny_models import VOCAB, tiny_model

NON_RANDOM = ["attention", "value_weighted", "value_weighted_output_normalized", "contribution"]


# ------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------


def _peaked_llama(seed: int = 0):
    torch.manual_seed(seed)
    config = tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager", initializer_range=0.2)
    return tf.LlamaForCausalLM(config).eval()


def _self_sampled(model, n: int = 10, length: int = 18, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, 1), generator=generator)
    with torch.no_grad():
        for _ in range(length - 1):
            probs = torch.softmax(model(input_ids=ids).logits[:, -1], -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], 1)
    return ids


@pytest.fixture(scope="module")
def peaked():
    model = _peaked_llama()
    return model, _self_sampled(model)


@pytest.fixture(scope="module")
def sweep(peaked):
    model, ids = peaked
    return fa.faithfulness_curve(model, None, ids, ratios=[0, 0.2, 0.5], batch_size=6, cache=False, progress=False,
                                 per_sequence=True)


def _word_tokenizer():
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
    """Counts the model's forwards; raises after ``fail_after`` of them (a simulated interruption)."""

    def __init__(self, model, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("simulated interruption")
        self.calls += 1

    def remove(self):
        self.handle.remove()


# ------------------------------------------------------------------------------------------------
# ranking against a naive per-group sort
# ------------------------------------------------------------------------------------------------


def _naive_masks(scores, cand, unit, scope, ratio, mode):
    """Python loops: sort each group's candidate units by (-score, index), NaN last; take k(r)."""
    b, h, q, k = scores.shape
    cand = cand[:, 0]
    out = torch.zeros(b, h, q, k, dtype=torch.bool)

    def chosen(items):
        def key(item):
            return (math.inf if math.isnan(item[0]) else -item[0], item[1])
        ordered = sorted(items, key=key)
        n = len(ordered)
        count = math.floor(ratio * n + 0.5)
        picked = ordered[:count] if mode == "comprehensiveness" else ordered[n - count:]
        return [item[2] for item in picked]

    def nanmean(values):
        values = [v for v in values if not math.isnan(v)]
        return sum(values) / len(values) if values else math.nan

    token = scores.sum(1)  # [b, q, k]
    for s in range(b):
        if scope == "row":
            for i in range(q):
                keys = [j for j in range(k) if cand[s, i, j]]
                if unit == "head_key":
                    items = [(float(scores[s, hh, i, j]), hh * k + j, (hh, j)) for hh in range(h) for j in keys]
                    for hh, j in chosen(items):
                        out[s, hh, i, j] = True
                elif unit == "key":
                    for hh in range(h):
                        for j in chosen([(float(scores[s, hh, i, j]), j, j) for j in keys]):
                            out[s, hh, i, j] = True
                else:
                    for j in chosen([(float(token[s, i, j]), j, j) for j in keys]):
                        out[s, :, i, j] = True
        else:
            seen = {j: [i for i in range(q) if cand[s, i, j]] for j in range(k)}
            keys = [j for j in range(k) if seen[j]]

            def unit_score(values_for_query, j):
                return nanmean([float(values_for_query(i)) for i in seen[j]])

            if unit == "head_key":
                items = [(unit_score(lambda i: scores[s, hh, i, j], j), hh * k + j, (hh, j)) for hh in range(h) for j in keys]
                for hh, j in chosen(items):
                    out[s, hh, seen[j], j] = True
            elif unit == "key":
                for hh in range(h):
                    for j in chosen([(unit_score(lambda i: scores[s, hh, i, j], j), j, j) for j in keys]):
                        out[s, hh, seen[j], j] = True
            else:
                for j in chosen([(unit_score(lambda i: token[s, i, j], j), j, j) for j in keys]):
                    for i in seen[j]:
                        out[s, :, i, j] = True
    return out


@pytest.mark.parametrize("unit", ["head_key", "key", "token"])
@pytest.mark.parametrize("scope", ["row", "layer"])
@pytest.mark.parametrize("keep_first", [True, False])
@pytest.mark.parametrize("n", [7, 37])  # 37: several query blocks, each sorting only its causal left part
def test_selection_matches_a_naive_per_group_sort(unit, scope, keep_first, n):
    generator = torch.Generator().manual_seed(0)
    b, h = 3, 3
    # coarse dyadic values: many ties, which must break by index; sums and means are exact in float64
    # (one rounding in the division), so layer-scope means tie exactly where they tie mathematically
    scores = (torch.rand(b, h, n, n, generator=generator, dtype=torch.float64) * 4).round() / 4 - 0.25
    scores[0, 1, 4, 2] = float("nan")
    attention_mask = torch.ones(b, n, dtype=torch.long)
    attention_mask[1, 5:] = 0  # right padding
    attention_mask[2, :2] = 0  # left padding
    cand = candidate_mask(attention_mask, keep_first_token=keep_first)
    ratios = [0.1, 0.25, 0.5, 0.8, 1.0]
    buckets = selection_buckets(scores, cand, ratios, unit=unit, scope=scope)
    counted = selection(scores, cand, ratios, unit=unit, scope=scope).removed
    for t, ratio in enumerate(ratios):
        for mode in ("comprehensiveness", "sufficiency"):
            mask = removal_mask(buckets[mode], t, cand if scope == "layer" else None).expand(b, h, n, n)
            expected = _naive_masks(scores, cand, unit, scope, ratio, mode)
            assert torch.equal(mask, expected), (unit, scope, ratio, mode)
            assert not (mask & ~cand).any()
            # the sweep counts removed terms from the bucket histogram instead of summing every mask
            assert torch.equal(counted[mode][:, t], expected.sum((1, 2, 3))), (unit, scope, ratio, mode)


def test_candidates_are_causal_real_and_exclude_the_first_real_token():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0]])
    cand = candidate_mask(mask, keep_first_token=True)[:, 0]
    assert cand[0].nonzero().tolist() == [[3, 3], [4, 3], [4, 4]]
    assert cand[1].nonzero().tolist() == [[1, 1], [2, 1], [2, 2]]
    with_first = candidate_mask(mask, keep_first_token=False)[:, 0]
    assert with_first[0, 4, 2] and with_first[1, 2, 0] and not with_first[1, 3, 0]
    windowed = candidate_mask(torch.ones(1, 6), keep_first_token=False, window=2)[0, 0]
    assert windowed[5, 4] and not windowed[5, 3] and windowed[1, 0]


def test_sliding_windows_come_from_the_config():
    assert fa._layer_windows(tiny_model("mistral"), 2) == [4, 4]
    assert fa._layer_windows(tiny_model("gemma3"), 2) == [4, None]
    assert fa._layer_windows(tiny_model("qwen2"), 2) == [None, None]


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
        sweep = fa._Sweep(model, [fa.parse_metric("contribution")], ["comprehensiveness"], [0.0], fa.Protocol(),
                          None, False, 1)
        batch = fa._pad_batch(0, ids.tolist(), list(range(len(ids))), 0, "right")
        logits, _, _ = sweep._clean_pass(batch, [fa.parse_metric("contribution")], sweep._candidates(batch))
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
    kwargs = dict(metric=["contribution", "random"], ratios=[0.3], cache=False, progress=False, batch_size=4)
    first = fa.faithfulness_curve(model, None, ids, **kwargs)
    again = fa.faithfulness_curve(model, None, ids, **kwargs)
    pd.testing.assert_frame_equal(first, again)
    other = fa.faithfulness_curve(model, None, ids, seed=1, **kwargs)
    random = lambda df: df[df.metric == "random"].delta_nll.to_numpy()
    assert not np.array_equal(random(first), random(other))


def test_batch_size_and_input_type_do_not_change_results(peaked):
    model, ids = peaked
    kwargs = dict(metric=["attention", "random"], ratios=[0.3], mode="comprehensiveness", cache=False,
                  progress=False, per_sequence=True)
    base = fa.faithfulness_curve(model, None, ids, batch_size=10, **kwargs)
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    for texts, batch_size in ((ids, 3), (blocks, 10), ({"input_ids": ids}, 4)):
        other = fa.faithfulness_curve(model, None, texts, batch_size=batch_size, **kwargs)
        pd.testing.assert_frame_equal(base[["metric", "mode", "sequence", "n_removed"]],
                                      other[["metric", "mode", "sequence", "n_removed"]])
        np.testing.assert_allclose(base.nll, other.nll, rtol=0, atol=1e-5)


def test_strings_and_left_padding(peaked):
    model, _ = peaked
    tokenizer = _word_tokenizer()
    texts = ["the cat sat on the mat and ran away", "hello world", "one two three four five six seven eight",
             "the dog ran far so it got away"]
    kwargs = dict(metric=["contribution", "random"], ratios=[0.3], cache=False, progress=False, per_sequence=True)
    right = fa.faithfulness_curve(model, tokenizer, texts, padding_side="right", **kwargs)
    left = fa.faithfulness_curve(model, tokenizer, texts, padding_side="left", **kwargs)
    assert (right.n_tokens.to_numpy()[:4] == [9, 2, 8, 8]).all()  # BOS + words, 1 prediction per token after BOS
    np.testing.assert_array_equal(right.n_removed, left.n_removed)
    np.testing.assert_allclose(right.nll, left.nll, rtol=0, atol=1e-4)
    # alone, a sequence gets the same result (random scores are seeded by the sequence's index: skip them)
    single = fa.faithfulness_curve(model, tokenizer, texts[1:2], **kwargs)
    same = right[(right.sequence == 1) & (right.metric == "contribution")]
    np.testing.assert_allclose(single[single.metric == "contribution"].nll, same.nll, rtol=0, atol=1e-4)


def test_rungs_two_and_three_coincide_under_the_default_protocol(peaked):
    """With kind=inter the normaliser ||o_i|| is shared by all (head, key) pairs of a query."""
    model, ids = peaked
    metrics = ["value_weighted", "value_weighted_output_normalized", "value_weighted_output_normalized_intra"]
    kwargs = dict(ratios=[0.2, 0.5], cache=False, progress=False, per_sequence=True)
    table = fa.faithfulness_curve(model, None, ids, metrics, deduplicate=False, **kwargs).set_index(
        ["metric", "mode", "ratio", "sequence"])
    vw, inter, intra = (table.loc[m] for m in metrics)
    pd.testing.assert_series_equal(vw.nll, inter.nll)
    assert not np.allclose(vw.nll, intra.nll)
    deduplicated = fa.faithfulness_curve(model, None, ids, metrics, **kwargs).set_index(
        ["metric", "mode", "ratio", "sequence"])
    pd.testing.assert_series_equal(deduplicated.nll, table.nll)
    layer = fa.faithfulness_curve(model, None, ids, metrics[:2], scope="layer", **kwargs).set_index(
        ["metric", "mode", "ratio", "sequence"])
    assert not np.allclose(layer.loc[metrics[0]].nll, layer.loc[metrics[1]].nll)


def test_metric_names_and_kinds():
    assert fa.parse_metric("contribution") == fa.MetricSpec("contribution", "contribution", "inter")
    assert fa.parse_metric("contribution_intra") == fa.MetricSpec("contribution_intra", "contribution", "intra")
    assert fa.parse_metric("contribution", kind="intra") == fa.MetricSpec("contribution", "contribution", "intra")
    assert fa.parse_metric("attention").kind == ""
    with pytest.raises(ValueError):
        fa.parse_metric("attention_intra")
    with pytest.raises(ValueError):
        fa.parse_metric("saliency")


def test_live_scores(peaked):
    model, ids = peaked
    kwargs = dict(metric=["attention", "contribution", "random"], ratios=[0.3], cache=False, progress=False,
                  per_sequence=True)
    # in the first layer nothing upstream has changed: live and clean scores are the same
    clean0 = fa.faithfulness_curve(model, None, ids, layers=[0], **kwargs)
    live0 = fa.faithfulness_curve(model, None, ids, layers=[0], scores="live", **kwargs)
    pd.testing.assert_series_equal(clean0.nll, live0.nll)
    pd.testing.assert_series_equal(clean0.n_removed, live0.n_removed)
    clean = fa.faithfulness_curve(model, None, ids, **kwargs).set_index(["metric", "mode", "sequence"])
    live = fa.faithfulness_curve(model, None, ids, scores="live", **kwargs).set_index(["metric", "mode", "sequence"])
    # the random control does not depend on the state; geometric scores do, from layer 1 on
    np.testing.assert_array_equal(clean.loc["random"].nll, live.loc["random"].nll)
    assert not np.allclose(clean.loc["contribution"].nll, live.loc["contribution"].nll)


@pytest.mark.parametrize("unit", ["head_key", "key", "token"])
@pytest.mark.parametrize("scope", ["row", "layer"])
def test_every_unit_and_scope_runs(peaked, unit, scope):
    model, ids = peaked
    summary = fa.faithfulness_curve(model, None, ids[:4], ["contribution", "random"], [0.3], "comprehensiveness",
                                    unit=unit, scope=scope, cache=False, progress=False, importance="absolute")
    assert (summary.removed_fraction > 0.1).all() and (summary.delta_nll != 0).all()
    assert set(summary.unit) == {unit} and set(summary.scope) == {scope}


def test_keep_first_token_false_removes_the_sink(peaked):
    model, ids = peaked
    kwargs = dict(metric="attention", ratios=[0.2], mode="comprehensiveness", cache=False, progress=False)
    kept = fa.faithfulness_curve(model, None, ids, **kwargs)
    removed = fa.faithfulness_curve(model, None, ids, keep_first_token=False, **kwargs)
    assert kept.delta_nll.item() != removed.delta_nll.item()


# ------------------------------------------------------------------------------------------------
# cache
# ------------------------------------------------------------------------------------------------


def test_cache_hit_runs_no_forward(peaked, tmp_path):
    model, ids = peaked
    kwargs = dict(metric=["attention", "contribution"], ratios=[0, 0.2, 0.5], cache_dir=tmp_path, progress=False,
                  batch_size=5)
    counter = ForwardCounter(model)
    try:
        first = fa.faithfulness_curve(model, None, ids, **kwargs)
        assert counter.calls == 2 * (1 + 2 * 2 * 2)  # two batches: a clean pass + 8 points each
        counter.calls = 0
        again = fa.faithfulness_curve(model, None, ids, **kwargs)
        assert counter.calls == 0
    finally:
        counter.remove()
    pd.testing.assert_frame_equal(first, again)
    # anything that affects the results changes the key
    counter = ForwardCounter(model)
    try:
        fa.faithfulness_curve(model, None, ids, keep_first_token=False, **kwargs)
        assert counter.calls > 0
    finally:
        counter.remove()


def test_a_longer_run_reuses_the_batches_of_a_shorter_one(peaked, tmp_path):
    model, ids = peaked
    kwargs = dict(metric="attention", ratios=[0.5], mode="comprehensiveness", cache_dir=tmp_path, progress=False,
                  batch_size=3, per_sequence=True)
    short = fa.faithfulness_curve(model, None, ids[:6], **kwargs)
    counter = ForwardCounter(model)
    try:
        longer = fa.faithfulness_curve(model, None, ids[:9], **kwargs)
        assert counter.calls == 2  # only the third batch: its clean pass and its one point
    finally:
        counter.remove()
    pd.testing.assert_frame_equal(longer[longer.sequence < 6].reset_index(drop=True), short)


def test_interrupted_run_resumes(peaked, tmp_path):
    model, ids = peaked
    kwargs = dict(metric=["attention", "random"], ratios=[0.2, 0.5], progress=False, batch_size=10)
    reference = fa.faithfulness_curve(model, None, ids, cache=False, **kwargs)
    counter = ForwardCounter(model, fail_after=4)  # the clean pass and 3 points finish
    try:
        with pytest.raises(KeyboardInterrupt):
            fa.faithfulness_curve(model, None, ids, cache_dir=tmp_path, **kwargs)
    finally:
        counter.remove()
    counter = ForwardCounter(model)
    try:
        resumed = fa.faithfulness_curve(model, None, ids, cache_dir=tmp_path, **kwargs)
        assert counter.calls == 1 + (8 - 3)  # clean pass again (for the masks) + the 5 missing points
    finally:
        counter.remove()
    pd.testing.assert_frame_equal(resumed, reference)


# ------------------------------------------------------------------------------------------------
# summaries
# ------------------------------------------------------------------------------------------------


def test_aopc_is_the_trapezoid_mean_over_ratios():
    curve = pd.DataFrame({"metric": "m", "kind": "", "mode": "comprehensiveness", "ratio": [0.1, 0.5],
                          "delta_nll": [1.0, 3.0], "delta_ppl": [2.0, 2.0]})
    area = fa.aopc(curve)
    assert area.aopc_nll.item() == pytest.approx((0.1 * 0.5 + 0.4 * 2.0) / 0.5)
    assert area.aopc_ppl.item() == pytest.approx((0.1 * 1.0 + 0.4 * 2.0) / 0.5)
    with_zero = pd.concat([curve, curve.iloc[:1].assign(ratio=0.0, delta_nll=0.0, delta_ppl=0.0)])
    assert fa.aopc(with_zero).aopc_nll.item() == pytest.approx(area.aopc_nll.item())


def test_aopc_intervals_from_per_sequence_tables(sweep):
    area = fa.aopc(sweep, n_bootstrap=200).set_index(["metric", "mode"])
    point = fa.aopc(fa.summarize(sweep)).set_index(["metric", "mode"])
    np.testing.assert_allclose(area.aopc_nll, point.aopc_nll.loc[area.index], rtol=1e-10)
    assert (area.aopc_nll_ci_low <= area.aopc_nll).all() and (area.aopc_nll <= area.aopc_nll_ci_high).all()
    assert (area.n_sequences == 10).all()
    ladder = fa.ladder_comparison(sweep, n_bootstrap=200)
    verdicts = ladder[(ladder.lower == "random") & (ladder.higher == "contribution")].set_index("mode").verdict
    assert verdicts["comprehensiveness"] == "holds" and verdicts["sufficiency"] == "holds"


# ------------------------------------------------------------------------------------------------
# downstream
# ------------------------------------------------------------------------------------------------


def _mc_dataset():
    shared = ["question : is the cat on the mat ? answer :", "question : one two three ? answer :",
              "the dog ran far so it"]
    rows = []
    for i, context in enumerate(shared):
        rows.append({"contexts": [context] * 2, "continuations": [" yes", " no"], "gold": i % 2})
    rows.append({"contexts": ["the cat sat on the", "the dog sat on the"], "continuations": [" mat and ran"] * 2,
                 "gold": 1})
    rows.append({"contexts": ["hello"] * 4, "continuations": [" A", " B", " C", " D"], "gold": 2})
    return datasets.Dataset.from_list(rows)


def test_downstream_clean_accuracy_and_collapse(peaked):
    from cwcore.data import choice_batches, continuation_logprobs

    model, _ = peaked
    tokenizer = _word_tokenizer()
    data = _mc_dataset()
    kwargs = dict(metric=["contribution", "random"], ratios=[0, 0.3], cache=False, progress=False, task="toy",
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


# ------------------------------------------------------------------------------------------------
# command line and the real model
# ------------------------------------------------------------------------------------------------


def test_command_line_writes_tidy_csvs(peaked, tmp_path, monkeypatch):
    import cwcore.models

    model, _ = peaked
    monkeypatch.setattr(cwcore.models, "load_model", lambda name, dtype=None: (model, _word_tokenizer()))
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
    summary = fa.faithfulness_curve(model, tokenizer, blocks, ratios=[0.2], cache=False, progress=False)
    table = summary.set_index(["metric", "mode"])
    for metric in NON_RANDOM:
        assert table.loc[(metric, "comprehensiveness")].delta_nll > table.loc[(metric, "sufficiency")].delta_nll
