"""Ranking: the removal masks against a naive per-group sort, and the candidate terms."""

from __future__ import annotations

import math

import pytest
import torch

from cwcore.faithfulness.protocol import layer_windows
from cwcore.faithfulness.ranking import candidate_mask, removal_mask, selection
from tiny_models import tiny_model


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
    buckets, counted = selection(scores, cand, ratios, unit=unit, scope=scope)
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
    assert layer_windows(tiny_model("mistral"), 2) == [4, 4]
    assert layer_windows(tiny_model("gemma3"), 2) == [4, None]
    assert layer_windows(tiny_model("qwen2"), 2) == [None, None]


def test_a_config_window_the_model_does_not_apply_is_refused_and_a_real_one_is_taken():
    """A Llama config carrying ``sliding_window`` (the family never reads it): cwcore ranked and removed terms of a
    window of 2 that the model does not have (delta ppl 0.25 became -0.46). Measured on the applied
    probabilities, it is refused; Mistral's window, which its mask applies, is taken (control)."""
    import cwcore
    from cwcore.faithfulness import faithfulness_curve
    from cwcore.faithfulness.methods import method_scores

    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    stray = tiny_model("llama")
    stray.config.sliding_window = 2
    with torch.no_grad():  # the model is the plain Llama: every earlier key is read
        torch.testing.assert_close(stray(input_ids=ids).logits, tiny_model("llama")(input_ids=ids).logits,
                                   rtol=0, atol=0)
    refusal = r"attention layer 0 attends to keys 2 or more tokens back .* beyond the sliding window of 2 tokens"
    with pytest.raises(cwcore.UnsupportedModelError, match=refusal):
        faithfulness_curve(stray, None, ids, metric=["contribution"], ratios=[0.2], n_bootstrap=10, progress=False)
    with pytest.raises(cwcore.UnsupportedModelError, match=refusal):
        method_scores(stray, "contribution", ids)
    mistral = tiny_model("mistral")
    assert layer_windows(mistral, 2) == [4, 4]
    curve = faithfulness_curve(mistral, None, ids, metric=["contribution"], ratios=[0.2], n_bootstrap=10,
                               progress=False)
    assert curve.table["delta_ppl"].notna().all()


def test_removed_fractions_count_the_heads_each_layer_computes():
    """removed_fraction divided by candidates x the config's head count: 0.875 at ratio 1 with one head of layer 1
    pruned, 0.5 after config.num_attention_heads was edited to 8. At ratio 1 every candidate term is removed."""
    from torch import nn
    from cwcore.core.architectures import block_heads
    from cwcore.faithfulness import faithfulness_curve

    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))

    def at_one(model):
        table = faithfulness_curve(model, None, ids, metric=["contribution"], ratios=[1.0], n_bootstrap=10,
                                   progress=False).table
        return float(table.loc[table["ratio"] == 1.0, "removed_fraction"].iloc[0])

    edited = tiny_model("llama")
    edited.config.num_attention_heads = 8  # after loading: the layers still compute 4 heads
    assert block_heads(edited) == {0: 4, 1: 4} and at_one(edited) == 1.0
    pruned = tiny_model("llama")
    attention = pruned.model.layers[1].self_attn
    # query heads 0 and 1 of 4 and their key-value head (2 query heads per key-value head; head_dim 16)
    keep, keep_kv = torch.arange(32), torch.arange(16)

    def sliced(linear, rows=None, cols=None):
        weight = linear.weight.data if rows is None else linear.weight.data[rows]
        weight = weight if cols is None else weight[:, cols]
        new = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        new.weight.data = weight.clone()
        return new.eval()

    attention.q_proj = sliced(attention.q_proj, rows=keep)
    attention.k_proj, attention.v_proj = sliced(attention.k_proj, rows=keep_kv), sliced(attention.v_proj, rows=keep_kv)
    attention.o_proj = sliced(attention.o_proj, cols=keep)
    assert block_heads(pruned) == {0: 4, 1: 2} and at_one(pruned) == 1.0


def test_removal_counts_round_the_float64_product_as_documented():
    """k(r) = floor(r n + 1/2) with r n in float64: 0.7 x 45 is 31.499999999999996 there, so 31 (the committed
    tables were counted so); an exact binary half rounds up."""
    import torch
    from cwcore.faithfulness.ranking import removal_counts

    counts = torch.tensor([45, 405, 10, 3])
    assert removal_counts(counts, 0.7).tolist() == [31, 284, 7, 2]  # 0.7 x 405 is 283.5 in float64 too
    assert removal_counts(torch.tensor([5]), 0.5).tolist() == [3]  # 2.5: a half in binary too


def test_the_random_controls_hashed_scores_depend_on_every_documented_input():
    """The random control ranks by hashed_uniform, "a hash of (seed, group id, layer, head, query, key)", but no
    test called it: with layer and head dropped from the hash every head got the same scores (with
    unit="head_key" the control then removed the same positions in every head) and every test passed. The
    checks: changing any one input changes almost every score; the same group and positions give the same
    scores whatever the batch and padding; the scores lie on the 2^-24 grid in [0, 1) and are uniform there
    (Kolmogorov-Smirnov against U(0, 1))."""
    from scipy import stats

    from cwcore.faithfulness.ranking import hashed_uniform

    n, heads = 24, 4
    positions = torch.arange(n).expand(2, n)
    groups = torch.tensor([3, 7])
    base = hashed_uniform(0, groups, 1, heads, positions)  # [2, heads, n, n]
    assert base.shape == (2, heads, n, n) and base.dtype == torch.float32

    def share_equal(a, b):
        return float((a == b).double().mean())

    assert share_equal(base, hashed_uniform(0, groups, 1, heads, positions)) == 1.0  # deterministic
    for name, other in (("seed", hashed_uniform(1, groups, 1, heads, positions)),
                        ("group", hashed_uniform(0, groups + 1, 1, heads, positions)),
                        ("layer", hashed_uniform(0, groups, 2, heads, positions))):
        assert share_equal(base, other) < 0.01, name  # equal by chance: about 2^-24 each
    for h in range(1, heads):
        assert share_equal(base[:, 0], base[:, h]) < 0.01, h  # the head enters the hash
    assert share_equal(base[0], base[1]) < 0.01  # two groups
    assert share_equal(base[:, :, 1:, :], base[:, :, :-1, :]) < 0.01  # the query position
    assert share_equal(base[..., 1:], base[..., :-1]) < 0.01  # the key position
    # the same group at the same positions: the same scores, in another batch and with left padding
    alone = hashed_uniform(0, groups[1:], 1, heads, positions[1:])
    assert torch.equal(alone, base[1:])
    padded = hashed_uniform(0, groups, 1, heads, torch.cat([torch.zeros(2, 3, dtype=torch.long), positions], 1))
    assert torch.equal(padded[..., 3:, 3:], base)
    # on the grid k / 2^24 in [0, 1), and uniform
    values = base.double().reshape(-1)
    assert values.min() >= 0 and values.max() < 1
    assert torch.equal(values * 2**24, (values * 2**24).round())
    assert stats.kstest(values.numpy(), "uniform").pvalue > 1e-3
    assert 0.45 < float(values.mean()) < 0.55 and len(values) == 2 * heads * n * n
