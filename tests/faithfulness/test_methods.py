"""The attribution methods of cwcore.faithfulness.methods against naive implementations written here
(loops, the model's own modules, eager forwards), and metric= as a name, a callable or a tensor."""

from __future__ import annotations

import pytest
import torch

from cwcore import faithfulness as fa
from cwcore.cache import caching
from cwcore.faithfulness import methods
from faith_helpers import mc_dataset, peaked_llama, self_sampled, word_tokenizer
from tiny_models import VOCAB, tiny_model


def _model(family):
    model = tiny_model(family).double()
    with torch.no_grad():  # non-trivial norm gains, so the norms' handling is exercised
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.normal_(1.0 if family == "llama" else 0.0, 0.3)
    return model


def _ids(n=2, length=9, seed=1):
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


def _decoder_layers(model):
    return model.model.layers


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _eager(model, ids):
    """Attention probabilities ``{layer: [b, h, q, k]}``, values ``{layer: [b, h, k, d]}`` (repeated for
    GQA), decoder-layer inputs and outputs, from one eager forward with hooks on the model's modules."""
    values, inputs, outputs, handles = {}, {}, {}, []
    config = model.config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    for l, layer in enumerate(_decoder_layers(model)):
        def v_hook(mod, args, out, l=l):
            b, n, _ = out.shape
            v = out.reshape(b, n, kv, -1).transpose(1, 2)
            values[l] = v.repeat_interleave(heads // kv, dim=1)
        handles.append(layer.self_attn.v_proj.register_forward_hook(v_hook))
        handles.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs, l=l: inputs.__setitem__(l, (args[0] if args else kwargs["hidden_states"]).clone()),
            with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda mod, args, out, l=l: outputs.__setitem__(l, _first(out).clone())))
    with torch.no_grad():
        out = model(input_ids=ids, output_attentions=True)
    for h in handles:
        h.remove()
    return {l: a for l, a in enumerate(out.attentions)}, values, inputs, outputs


def _terms(model, layer, alpha, values):
    """t[b, h, i, j, :] = alpha^h_ij W_O^h v^h_j in model space, one head slice at a time."""
    w = _decoder_layers(model)[layer].self_attn.o_proj.weight
    heads, d = alpha.shape[1], values.shape[-1]
    out = torch.zeros(*alpha.shape, w.shape[0], dtype=w.dtype)
    for h in range(heads):
        projected = values[:, h] @ w[:, h * d:(h + 1) * d].T  # [b, k, m]
        out[:, h] = alpha[:, h, :, :, None] * projected[:, None]
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_value_zeroing_matches_zeroing_the_value_rows(family):
    model, ids = _model(family), _ids()
    scores = methods.method_scores(model, "value_zeroing", ids, keep_first_token=False)
    _, _, _, clean = _eager(model, ids)
    n = ids.shape[1]
    for layer in range(2):
        naive = torch.zeros(ids.shape[0], n, n, dtype=torch.float64)
        v_proj = _decoder_layers(model)[layer].self_attn.v_proj
        for j in range(n):
            def zero(mod, args, out, j=j):
                out = out.clone()
                out[:, j] = 0.0
                return out
            handle = v_proj.register_forward_hook(zero)
            _, _, _, altered = _eager(model, ids)
            handle.remove()
            cos = torch.nn.functional.cosine_similarity(clean[layer], altered[layer], dim=-1)
            naive[:, j:, j] = (1 - cos)[:, j:]
        got = scores[layer]
        assert torch.equal(got, got[:, :1].expand_as(got))  # token-level: the same score in every head
        assert naive.abs().max() > 1e-4
        torch.testing.assert_close(got[:, 0].double(), naive, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_alti_matches_loops_over_the_residual_stream(family):
    model, ids = _model(family), _ids(seed=2)
    scores = methods.method_scores(model, "alti", ids, keep_first_token=False)
    attentions, values, inputs, _ = _eager(model, ids)
    b, n = ids.shape
    for layer in range(2):
        block = _decoder_layers(model)[layer]
        # the residual stream after the attention sub-block, as the model computes it
        seen = {}
        after = block.pre_feedforward_layernorm if family == "gemma3" else block.post_attention_layernorm
        handle = after.register_forward_pre_hook(lambda mod, args: seen.__setitem__("y", args[0].clone()))
        with torch.no_grad():
            model(input_ids=ids)
        handle.remove()
        terms = _terms(model, layer, attentions[layer], values[layer]).sum(1).detach()  # [b, i, j, m]
        bias = block.self_attn.o_proj.bias
        x = inputs[layer]
        naive = torch.zeros(b, n, n, dtype=torch.float64)
        for r, i in ((r, i) for r in range(b) for i in range(n)):
            with torch.no_grad():
                naive[r, i] = _alti_row(family, block, terms[r, i], bias, x[r, i], seen["y"][r, i], i, n)
        got = scores[layer][:, 0].double()
        torch.testing.assert_close(got, naive, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got.sum(-1), torch.ones(b, n, dtype=torch.float64))


def _alti_row(family, block, terms, bias, x, real_y, i, n):
    """ALTI's contributions of keys 0..i to query i, by hand (terms ``[j, m]``: sum_h alpha^h_ij v~^h_j), in the
    dtype of ``terms``; ``real_y``, where given, the residual stream the model computed, checked."""
    out = torch.zeros(n, dtype=torch.float64)
    a = terms.sum(0) + (0 if bias is None else bias)
    t = terms.clone()
    if family == "gemma3":  # the post-attention RMSNorm's linear part at this row's scale
        norm = block.post_attention_layernorm
        scale = torch.sqrt((a.float() ** 2).mean() + norm.eps).double()
        gain = 1.0 + norm.weight.double()
        y = x + gain * a / scale
        t = gain * t / scale
    else:
        y = x + a
    if real_y is not None:
        torch.testing.assert_close(y, real_y, rtol=1e-5, atol=1e-6)  # the residual stream the model computed
    t[i] = t[i] + x
    c = [max(0.0, float(y.abs().sum() - (y - t[j]).abs().sum())) for j in range(i + 1)]
    out[:i + 1] = torch.tensor(c, dtype=torch.float64) / sum(c)
    return out


def test_rollout_and_contribution_rollout_match_the_layer_product():
    model, ids = _model("llama"), _ids(seed=3)
    rolled = methods.method_scores(model, "rollout", ids, keep_first_token=False)
    contribution = methods.method_scores(model, "contribution_rollout", ids, keep_first_token=False)
    attentions, values, _, _ = _eager(model, ids)
    n = ids.shape[1]
    eye = torch.eye(n, dtype=torch.float64)
    product_a = product_c = None
    for layer in range(2):
        a = 0.5 * attentions[layer].mean(1) + 0.5 * eye
        a = a / a.sum(-1, keepdim=True)
        product_a = a if product_a is None else a @ product_a
        terms = _terms(model, layer, attentions[layer], values[layer])  # [b, h, i, j, m]
        output = terms.sum((1, 3))  # o_i without bias
        c = torch.einsum("bim,bhijm->bij", output, terms) / (output ** 2).sum(-1)[..., None]
        c = c.clamp_min(0)
        c = c / c.sum(-1, keepdim=True)
        c = 0.5 * c + 0.5 * eye
        c = c / c.sum(-1, keepdim=True)
        product_c = c if product_c is None else c @ product_c
        torch.testing.assert_close(rolled[layer][:, 0].double(), product_a, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(contribution[layer][:, 3].double(), product_c, rtol=1e-4, atol=1e-6)
    # only layer 1 asked: layer 0 is still multiplied in
    only = methods.method_scores(model, "rollout", ids, layers=[1], keep_first_token=False)
    assert list(only) == [1]
    torch.testing.assert_close(only[1], rolled[1])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_grad_x_input_matches_autograd_through_injected_terms(family):
    model, ids = _model(family), _ids(seed=4)
    scores = methods.method_scores(model, "grad_x_input", ids, keep_first_token=False)
    attentions, values, _, _ = _eager(model, ids)
    terms = {l: _terms(model, l, attentions[l], values[l]) for l in range(2)}
    e = {l: torch.zeros(attentions[l].shape, dtype=torch.float64, requires_grad=True) for l in range(2)}
    handles = []
    for l in range(2):
        def add(mod, args, out, l=l):  # adds sum_hij e_hij t_hij: zero, but with the gradient <g_i, t_hij>
            return out + torch.einsum("bhij,bhijm->bim", e[l], terms[l])
        handles.append(_decoder_layers(model)[l].self_attn.o_proj.register_forward_hook(add))
    logits = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()
    grads = torch.autograd.grad(logp, [e[0], e[1]])
    for l in range(2):
        naive = grads[l]
        assert naive.abs().max() > 1e-4
        torch.testing.assert_close(scores[l].double(), naive, rtol=1e-4, atol=1e-5 * float(naive.abs().max()))


# -- metric= as a callable or a tensor ----------------------------------------------------------------
@pytest.fixture(scope="module")
def data():
    model = peaked_llama()
    return model, self_sampled(model, n=8, length=12)


def _curve(model, ids, metric, **kwargs):
    options = dict(ratios=[0.5], batch_size=4, progress=False, n_bootstrap=50)
    options.update(kwargs)
    return fa.faithfulness_curve(model, None, ids, metric=metric, **options).table


VALUES = ["delta_ppl", "ci_low", "ci_high", "delta_nll", "ppl", "removed_fraction"]


@pytest.mark.parametrize("unit", ["head_key", "token"])
def test_a_callable_returning_attention_gives_the_attention_curve(data, unit):
    model, ids = data
    named = _curve(model, ids, "attention", unit=unit)
    called = _curve(model, ids, lambda layer_decomposition, **context: layer_decomposition.attention, unit=unit)
    assert list(called["metric"].unique()) == ["lambda"]
    assert named[VALUES].equals(called[VALUES])
    keywords = _curve(model, ids, {"attn": lambda layer_decomposition, layer, candidates: layer_decomposition.attention},
                      unit=unit)
    assert list(keywords["metric"].unique()) == ["attn"] and named[VALUES].equals(keywords[VALUES])


def test_token_level_scores_are_spread_over_heads(data):
    model, ids = data
    scores = methods.method_scores(model, lambda layer_decomposition, **_: layer_decomposition.attention.mean(1),
                                   ids[:2])
    for s in scores.values():
        assert s.shape[1] == 4 and torch.equal(s, s[:, :1].expand_as(s))
    assert _curve(model, ids, lambda layer_decomposition, **_: layer_decomposition.attention.sum(1)).shape[0] == 2


def test_precomputed_tensors_give_the_named_curve(data):
    model, ids = data
    parts = [methods.method_scores(model, "contribution", ids[i:i + 4]) for i in (0, 4)]
    per_layer = {l: torch.cat([p[l] for p in parts]) for l in parts[0]}
    named = _curve(model, ids, "contribution")
    as_dict = _curve(model, ids, per_layer)
    as_tensor = _curve(model, ids, {"stacked": torch.stack([per_layer[0], per_layer[1]])})
    assert named[VALUES].equals(as_dict[VALUES]) and named[VALUES].equals(as_tensor[VALUES])
    assert list(as_tensor["metric"].unique()) == ["stacked"]


def test_bad_metrics_fail_in_one_line(data):
    model, ids = data
    cases = [
        (lambda layer_decomposition, **_: layer_decomposition.attention[:, :, :3], ValueError, "returned shape"),
        (lambda layer_decomposition, **_: 1.0, TypeError, "not a tensor"),
        ("no_such_method", ValueError, "unknown metric"),
        ("value_zeroing_intra", ValueError, "no intra/inter"),
        (torch.zeros(2, 3), ValueError, "precomputed scores"),
        ({0: torch.zeros(3, 4, 12, 12), 1: torch.zeros(3, 4, 12, 12)}, ValueError, "hold 3 sequences for 8 texts"),
        ({0: torch.zeros(8, 4, 12, 12)}, ValueError, "no layer 1"),
        ({0: torch.zeros(8, 4, 5, 5), 1: torch.zeros(8, 4, 5, 5)}, ValueError, "are 5 positions long"),
        # scores that did not fit were taken: a layer the model lacks, a ninth sequence, rows of a padded batch
        (torch.zeros(3, 8, 4, 12, 12), ValueError, r"name layers \[2\], which the model does not have"),
        ({0: torch.zeros(8, 4, 12, 12), 1: torch.zeros(8, 4, 12, 12), 5: torch.zeros(8, 4, 12, 12)}, ValueError,
         r"name layers \[5\]"),
        ({0: torch.zeros(9, 4, 12, 12), 1: torch.zeros(9, 4, 12, 12)}, ValueError, "hold 9 sequences for 8 texts"),
        ({0: torch.zeros(8, 4, 15, 15), 1: torch.zeros(8, 4, 15, 15)}, ValueError,
         "are 15 positions long, the longest sequence 12 tokens"),
        ({0: torch.zeros(8, 3, 12, 12), 1: torch.zeros(8, 3, 12, 12)}, ValueError, "returned shape"),
        (3, TypeError, "a metric is a name"),
    ]
    for metric, error, text in cases:
        with pytest.raises(error, match=text) as info:
            _curve(model, ids, metric)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="share the label"):
        _curve(model, ids, [lambda layer_decomposition, **_: layer_decomposition.attention,
                            lambda layer_decomposition, **_: -layer_decomposition.attention])
    with pytest.raises(ValueError, match="faithfulness_curve") as info:
        fa.downstream_eval(model, word_tokenizer(), mc_dataset(), metric={0: torch.zeros(5, 4, 9, 9)}, ratios=[0.5],
                           progress=False)
    assert "\n" not in str(info.value)


def test_cache_keys_tell_callables_apart(data, tmp_path):
    model, ids = data

    def make(sign):
        def score(layer_decomposition, **_):
            return sign * layer_decomposition.attention
        return score

    keys = {fa.parse_metric(make(s)).piece_key for s in (1.0, -1.0)}
    assert len(keys) == 2 and fa.parse_metric(make(1.0)).piece_key == fa.parse_metric(make(1.0)).piece_key
    assert fa.parse_metric(make(1.0)).label == "score"
    with caching(tmp_path):
        first = _curve(model, ids, make(1.0))
        flipped = _curve(model, ids, make(-1.0))
        again = _curve(model, ids, make(1.0))
    assert not first[VALUES].equals(flipped[VALUES]) and first[VALUES].equals(again[VALUES])
    # comprehensiveness of -attention removes what sufficiency of attention removes
    comp = flipped[flipped["mode"] == "comprehensiveness"]["delta_nll"].to_numpy()
    suff = first[first["mode"] == "sufficiency"]["delta_nll"].to_numpy()
    assert comp.tolist() == pytest.approx(suff.tolist(), abs=1e-12)


def test_register_method_adds_a_named_metric(data):
    model, ids = data

    @methods.register_method("test_attention_copy")
    def copy(layer_decomposition, **_):
        return layer_decomposition.attention

    try:
        assert "test_attention_copy" in methods.available_methods()
        assert _curve(model, ids, "attention")[VALUES].equals(_curve(model, ids, "test_attention_copy")[VALUES])
    finally:
        methods._REGISTRY.pop("test_attention_copy")


def test_builtin_methods_run_in_the_sweep_and_downstream(data):
    model, ids = data
    table = _curve(model, ids[:4], list(methods.BUILT_IN), scores="live", mode="comprehensiveness")
    assert set(table["metric"]) == set(methods.BUILT_IN) and table["delta_nll"].notna().all()
    down = fa.downstream_eval(model, word_tokenizer(), mc_dataset(), metric=["rollout", "grad_x_input"],
                              ratios=[0.5], progress=False, n_bootstrap=50)
    assert set(down["metric"]) == {"rollout", "grad_x_input"}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_block_input_is_the_layers_own_after_alti_finds_the_post_attention_norm(family):
    """ALTI finds a model's post-attention norms in a probe forward, once per model. It ran that probe inside
    the scored forward, where the block-input hooks saw it: a method after ALTI (value zeroing) was handed
    the probe's hidden states on a model's first sweep (a wrong score where the probe's shape, [1, 4], was the
    batch's; a shape error elsewhere). The probe now runs before the forward."""
    seen: dict[int, torch.Tensor] = {}

    @methods.register_method("test_block_input_recorder", needs=("block_input",))
    def recorder(layer_decomposition, call, block_input, **_):
        args, kwargs = block_input
        seen.setdefault(call.layer, (args[0] if args else kwargs["hidden_states"]).detach().clone())
        return layer_decomposition.attention

    try:
        for ids in (torch.tensor([[5, 9, 2, 7]]), torch.tensor([[5, 9, 2, 7, 11, 3], [8, 1, 4, 6, 2, 10]])):
            model = tiny_model(family)  # new: ALTI has not probed it yet
            seen.clear()
            fa.faithfulness_curve(model, None, ids, metric=["alti", "test_block_input_recorder"], ratios=[0.5],
                                  mode="comprehensiveness", progress=False)
            with torch.no_grad():  # the layers' inputs, from the model's own output
                hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
            assert sorted(seen) == [0, 1]
            for layer, recorded in seen.items():
                torch.testing.assert_close(recorded, hidden[layer], rtol=0, atol=1e-6)
    finally:
        methods._REGISTRY.pop("test_block_input_recorder")
