"""Sessions are safe: per thread, restored, never in train() mode, in the model's own float64, with a cache;
every keyword reaching cwcore's attention function is one it implements; a missing layer is a clear error."""

import threading

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cwcore
from cwcore.core.attention import AttentionSession, cwcore_attention, every_layer
from tiny_models import VOCAB, tiny_model

IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))


def _run(target, *args):
    """Run ``target`` in a thread; return (thread, box) where box holds its result or its exception."""
    box = {}

    def wrapped():
        try:
            box["result"] = target(*args)
        except BaseException as error:  # reported by the test
            box["error"] = error

    thread = threading.Thread(target=wrapped, daemon=True)
    thread.start()
    return thread, box


def test_two_threads_on_two_models_interleaved_are_both_exact_and_each_sees_only_its_own_session():
    """Thread A is stopped inside its layer 0 while thread B starts its own decomposition and stops inside its
    layer 0; A then finishes while B's session is active (a shared session list gave A B's session). The numbers
    alone did not guard that: with a process-wide session list, the session that numbers the module is still
    found, so both stayed exact. So each thread also records its active sessions while the other's is active:
    its own only."""
    from cwcore.core.attention import _sessions

    first, second = tiny_model("llama"), tiny_model("qwen2")
    expected = {id(first): cwcore.decompose(first, input_ids=IDS), id(second): cwcore.decompose(second, input_ids=IDS)}
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()
    seen = {}  # thread name -> (its active sessions while the other's session is active, its own session)

    def decompose_a():
        def pause(call):
            if call.layer == 0:
                a_inside.set()
                assert b_inside.wait(30)
                seen["a"] = (list(_sessions()), session)  # B is paused inside its session now
        recorded = {}
        session = AttentionSession(first, observers=every_layer(first, lambda c: (
            pause(c), recorded.__setitem__(c.layer, c.probs.clone()))))
        with torch.no_grad(), cwcore_attention(first, session):
            logits = first(input_ids=IDS).logits
        a_done.set()
        return logits, recorded

    def decompose_b():
        assert a_inside.wait(30)

        def pause(call):
            if call.layer == 0:
                seen["b"] = (list(_sessions()), session)  # A is paused inside its session now
                b_inside.set()
                assert a_done.wait(30)
        recorded = {}
        session = AttentionSession(second, observers=every_layer(second, lambda c: (
            pause(c), recorded.__setitem__(c.layer, c.probs.clone()))))
        with torch.no_grad(), cwcore_attention(second, session):
            logits = second(input_ids=IDS).logits
        return logits, recorded

    (ta, a), (tb, b) = _run(decompose_a), _run(decompose_b)
    ta.join(60), tb.join(60)
    for box in (a, b):  # a thread's own error first, not a KeyError of what it did not get to record
        assert "error" not in box, box.get("error")
    for name in ("a", "b"):
        active, own = seen[name]
        assert len(active) == 1 and active[0] is own, (name, active)
    assert seen["a"][1] is not seen["b"][1]  # the control: two sessions, each thread saw its own
    for model, box in ((first, a), (second, b)):
        assert "error" not in box, box.get("error")
        logits, recorded = box["result"]
        reference = expected[id(model)]
        assert torch.equal(logits, reference.outputs.logits)
        for layer in reference.layers:
            torch.testing.assert_close(recorded[layer], reference.attention[layer], rtol=0, atol=1e-7)
        assert model.config._attn_implementation == "eager"


def test_two_threads_on_one_model_serialise_and_restore_its_implementation():
    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    try:
        reference = cwcore.decompose(model, layers=0, input_ids=IDS)
        spans, lock = [], threading.Lock()

        def work():
            out = []
            for _ in range(3):
                start = len(spans)
                d = cwcore.decompose(model, layers=0, input_ids=IDS)
                with lock:
                    spans.append((threading.get_ident(), start))
                out.append(d)
            return out

        runs = [_run(work) for _ in range(2)]
        for thread, _ in runs:
            thread.join(120)
        for _, box in runs:
            assert "error" not in box, box.get("error")
            for d in box["result"]:
                assert torch.equal(d.outputs.logits, reference.outputs.logits)
                torch.testing.assert_close(d.inter[0], reference.inter[0], rtol=0, atol=0)
        assert model.config._attn_implementation == "sdpa"  # restored, whichever thread left last
    finally:
        model.config._attn_implementation = "eager"


def test_a_plain_forward_in_another_thread_during_a_session_is_the_models_own():
    """While one thread holds a session on an SDPA model, another thread's plain forward of that model ran cwcore's
    eager arithmetic (bf16 logits 0.18 from the model's own SDPA) or was refused by the session's hooks."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    with torch.no_grad():
        for parameter in model.parameters():  # large scores, as in trained models: eager and SDPA differ in bf16
            parameter.mul_(4.0)
    ids = torch.randint(3, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(input_ids=ids).logits.float()
        model.config._attn_implementation = "sdpa"
        own = model(input_ids=ids).logits.float()
    assert (own - eager).abs().max() > 1e-2  # the control: the two implementations differ here
    for layers in ({}, {0: torch.zeros(1, 1, 16, 16, dtype=torch.bool)}):
        with cwcore.intervene(model, layers), torch.no_grad():
            thread, box = _run(lambda: model(input_ids=ids).logits.float())
            thread.join(30)
        assert "error" not in box, box.get("error")
        torch.testing.assert_close(box["result"], own, rtol=0, atol=0)


def test_a_per_layer_curve_and_an_attribution_hold_the_model_against_other_threads():
    """per_layer_curve's frozen layers and recording hooks, and grad_x_input's capture hooks, were installed outside
    the model's lock: a decomposition in another thread saw them (19 of 150 wrong, layers reported missing) and they
    saw its forwards. Each thread's results equal its single-thread ones."""
    from cwcore.faithfulness.layers import per_layer_curve

    model = tiny_model("llama", num_layers=4)
    generator = torch.Generator().manual_seed(1)
    texts, other = (torch.randint(3, VOCAB, (4, 10), generator=generator) for _ in range(2))
    options = dict(metric="contribution", ratios=[0.5], mode="comprehensiveness", batch_size=4)
    reference, table = cwcore.decompose(model, input_ids=other), per_layer_curve(model, None, texts, **options)
    gradients = cwcore.attribute(model, {"input_ids": texts}, method="grad_x_input")
    stop, results = threading.Event(), {"A": [], "B": []}

    def a():
        while not stop.is_set():
            results["A"].append(per_layer_curve(model, None, texts, **options)["nll"].to_numpy())
            results["A"].append(cwcore.attribute(model, {"input_ids": texts}, method="grad_x_input"))

    def b():
        try:
            for _ in range(60):
                results["B"].append(cwcore.decompose(model, input_ids=other))
        finally:
            stop.set()

    threads = [threading.Thread(target=a, daemon=True), threading.Thread(target=b, daemon=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(results["B"]) == 60 and results["A"]
    for d in results["B"]:
        assert d.layers == reference.layers
        for layer in d.layers:
            torch.testing.assert_close(d[layer].inter, reference[layer].inter, rtol=0, atol=0, equal_nan=True)
    for got in results["A"]:
        if isinstance(got, type(gradients)):
            for layer in gradients.layers:
                torch.testing.assert_close(got[layer], gradients[layer], rtol=0, atol=0, equal_nan=True)
        else:
            assert (got == table["nll"].to_numpy()).all()


def test_a_forward_that_failed_inside_an_intervene_block_leaves_the_next_one_exact():
    """Inside one intervene block, a batch refused half-way (its length does not fit the mask) left the block's
    per-forward counts behind: the next, valid batch was refused as "differential attention"."""
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, VOCAB, (1, n), generator=generator) for n in (8, 9, 8)]
    mask = torch.zeros(1, 4, 8, 8, dtype=torch.bool)
    mask[..., 2:, 0] = True
    model = tiny_model("llama")
    with torch.no_grad():
        with cwcore.intervene(model, {0: mask}):
            expected = model(input_ids=batches[2]).logits
        with cwcore.intervene(model, {0: mask}):
            model(input_ids=batches[0])
            with pytest.raises(ValueError, match="does not broadcast"):  # cwcore.core.inputs.InputError
                model(input_ids=batches[1])
            torch.testing.assert_close(model(input_ids=batches[2]).logits, expected, rtol=0, atol=0)


def test_a_forward_started_inside_a_forward_and_a_session_inside_a_session_are_refused_saying_why():
    """A user hook calling the model during decompose: the decomposition of the inner input came back with the outer
    logits (0.11 off, no word). A decomposition inside an intervene block on the same model: refused as "does not
    call transformers' attention interface", which is false."""
    model = tiny_model("llama")
    other = IDS.flip(-1)

    def nested(module, args, output):
        model(input_ids=other)

    handle = model.model.layers[1].register_forward_hook(nested)
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"a forward pass of LlamaForCausalLM started inside "
                                                               r"another of its forward passes"):
            cwcore.decompose(model, input_ids=IDS)
    finally:
        handle.remove()
    with cwcore.intervene(model, {}):
        with pytest.raises(cwcore.UnsupportedModelError, match=r"inside another on the same model .* observers="):
            cwcore.decompose(model, input_ids=IDS)
    reference = cwcore.decompose(model, input_ids=IDS)  # control: alone, exact
    with torch.no_grad():
        torch.testing.assert_close(reference.outputs.logits, model(input_ids=IDS).logits, rtol=0, atol=0)


def test_a_block_whose_result_is_not_its_projections_is_named_and_refused_by_the_logit_attribution():
    """A hook on the attention block that doubles its output: the direct logit attribution took the projection's
    output as what enters the residual stream (half the model's direct effect; 98% off in a Gemma 3)."""
    from cwcore.logit_attribution import logit_attribution

    model = tiny_model("llama")
    block = model.model.layers[1].self_attn

    def doubled(module, args, output):
        return (output[0] * 2,) + tuple(output[1:])

    handle = block.register_forward_hook(doubled)
    try:
        refusal = r"'model.layers.1.self_attn' \(LlamaAttention\) returns another tensor than its output projection's"
        d = cwcore.decompose(model, input_ids=IDS)  # exact for the projection's output; the layer says what differs
        assert d[0].changed_output is None and "result (relative difference 1)" in d[1].changed_output
        with pytest.raises(cwcore.UnsupportedModelError, match="direct logit attribution: .*" + refusal):
            logit_attribution(model, input_ids=IDS)
    finally:
        handle.remove()
    handle = block.register_forward_hook(lambda module, args, output: (output[0].clone(),) + tuple(output[1:]))
    try:  # control: a hook that returns an equal copy changes nothing
        torch.testing.assert_close(logit_attribution(model, input_ids=IDS)[1],
                                   logit_attribution(tiny_model("llama"), input_ids=IDS)[1], rtol=0, atol=0)
    finally:
        handle.remove()


def test_a_model_in_train_mode_is_refused_saying_why():
    model = tiny_model("llama")
    model.train()
    try:
        # a Llama has no dropout: the reason is train-time behaviour in general (it blamed dropout it does not have)
        with pytest.raises(cwcore.UnsupportedModelError, match=r"train\(\) mode.*: a module may compute otherwise in "
                                                               r"training .*call model\.eval\(\)"):
            cwcore.decompose(model, input_ids=IDS)
        model.config.attention_dropout = 0.1
        with pytest.raises(cwcore.UnsupportedModelError, match=r"train\(\) mode.*: its dropout changes every forward"):
            cwcore.decompose(model, input_ids=IDS)
        model.config.attention_dropout = 0.0
        model.eval()
        with cwcore.intervene(model, {}), torch.no_grad():  # train() inside the block: the reason, not a failed check
            model.train()
            with pytest.raises(cwcore.UnsupportedModelError, match=r"train\(\) mode"):
                model(input_ids=IDS)
        model.train()
        with pytest.raises(cwcore.UnsupportedModelError, match=r"train\(\) mode"):
            with cwcore.intervene(model, {0: torch.zeros((), dtype=torch.bool)}):
                pass
        assert model.training and model.config._attn_implementation == "eager"  # left as it was
    finally:
        model.eval()


def test_probe_passes_keep_each_modules_own_training_flag():
    """The probe passes set model.eval() and then model.train(flag): every submodule took the top module's flag, so a
    module the user left in train() came back in eval() (and a decomposition refused before was then taken), and a
    module set to eval() in a training model came back in train()."""
    from cwcore.core.architectures import post_attention_norms
    from cwcore.sinks import SinkOptions, run_analyses

    def flags(model):
        return {name: module.training for name, module in model.named_modules()}

    model = tiny_model("llama")
    model.model.layers[0].mlp.train()  # one module left in train() in an eval() model
    before = flags(model)
    for call in (lambda: cwcore.attribute(model, {"input_ids": IDS}, method="alti"),
                 lambda: cwcore.decompose(model, input_ids=IDS)):
        with pytest.raises(cwcore.UnsupportedModelError,
                           match=r"train\(\) mode \(5 modules, e.g. 'model.layers.0.mlp'\)"):
            call()
        assert flags(model) == before
    run_analyses(model, None, IDS, ["rates"], SinkOptions(block_size=7, batch_size=2, progress=False))
    assert flags(model) == before  # the sink analyses run in eval() and give every flag back
    model.train()
    model.model.layers[1].self_attn.o_proj.eval()
    before = flags(model)
    post_attention_norms(model)
    assert flags(model) == before


def test_a_float64_model_is_decomposed_in_float64_by_default():
    model = tiny_model("llama", dtype=torch.float64)
    with torch.no_grad():
        eager = model(input_ids=IDS, output_attentions=True)
    d = cwcore.decompose(model, input_ids=IDS)
    assert d[0].attention.dtype == torch.float64 and d[0].inter.dtype == torch.float64
    assert torch.equal(d.outputs.logits, eager.logits)
    for layer in d.layers:
        torch.testing.assert_close(d.attention[layer], eager.attentions[layer], rtol=0, atol=1e-12)
        sums = d.inter[layer].sum((1, 3))
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-10)
    # float32 geometry of a float64 model is checked to float32's tolerance, not refused
    single = cwcore.decompose(model, compute_dtype=torch.float32, input_ids=IDS)
    torch.testing.assert_close(single.inter[1].double(), d.inter[1], rtol=1e-4, atol=1e-5)


def test_a_float64_eager_layer_that_leaves_its_padded_rows_nan_is_decomposed_on_its_real_rows():
    """transformers' eager attention in float64 leaves a left-padded row that sees no key NaN; the next layer
    reads that NaN through the masked keys (0 x NaN), so the model's own logits of that sequence are NaN from
    layer 1 on. Layer 0 is exact on its real rows and must be decomposed: before, its padded rows were compared
    as NaN against NaN and the call refused as "relative error inf". Layer 1 is refused with its true reason
    (the model's own NaN). The reference: the sequence alone."""
    from cwcore.core.architectures import UnsupportedModelError
    from cwcore.core.decomposition import prepare_inputs

    model = tiny_model("llama", dtype=torch.float64)  # eager
    mask = torch.ones_like(IDS)
    mask[1, :2] = 0
    with torch.no_grad():
        own = model(**prepare_inputs(model, dict(input_ids=IDS, attention_mask=mask)))
    assert own.logits[1, 2:].isnan().any()  # the control: the model's own forward fails from layer 1 on
    d = cwcore.decompose(model, input_ids=IDS, attention_mask=mask, layers=[0])
    alone = cwcore.decompose(model, input_ids=IDS[1:, 2:], layers=[0])
    torch.testing.assert_close(d[0].inter[1, :, 2:, 2:], alone[0].inter[0], rtol=0, atol=1e-12)
    summary = cwcore.summarize(model, input_ids=IDS, attention_mask=mask, layers=[0], rows=[-1])  # its check too
    torch.testing.assert_close(summary[0].row(-1)[1, :, 2:], alone[0].inter[0, :, -1], rtol=0, atol=1e-12)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.1\.self_attn.*holds NaN or inf"):
        cwcore.decompose(model, input_ids=IDS, attention_mask=mask)


def test_a_cached_call_with_the_full_length_mask_is_exact():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
        full = model(input_ids=ids, output_attentions=True)
    d = cwcore.decompose(model, input_ids=ids[:, 5:], attention_mask=torch.ones(1, 8, dtype=torch.long),
                         cache=cache)
    whole = cwcore.decompose(model, input_ids=ids)
    torch.testing.assert_close(d.outputs.logits, full.logits[:, 5:], rtol=1e-5, atol=1e-5)
    for layer in d.layers:
        assert d.attention[layer].shape == (1, 4, 3, 8)  # the new queries over cached and new keys
        torch.testing.assert_close(d.attention[layer], full.attentions[layer][:, :, 5:], rtol=0, atol=1e-6)
        torch.testing.assert_close(d.inter[layer], whole.inter[layer][:, :, 5:], rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        cache = model(input_ids=ids[:, :5], use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"with 5 cached tokens .* must be \(1, 8\)"):
        cwcore.decompose(model, input_ids=ids[:, 5:], attention_mask=torch.ones(1, 3, dtype=torch.long),
                         cache=cache)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_a_sliding_window_layers_cached_keys_are_the_last_positions(family):
    """A sliding-window layer's cache keeps only its last tokens: the decomposition of the new tokens has fewer
    keys there, and key j is position total - keys + j (as the manual says), in a left-padded batch too; every
    earlier key has no weight in the whole-sequence decomposition."""
    import copy

    from cwcore.core.decomposition import prepare_inputs

    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    whole = cwcore.decompose(model, input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        cache = model(**prepare_inputs(model, dict(input_ids=ids[:, :10], attention_mask=mask[:, :10])),
                      use_cache=True).cache
    d = cwcore.decompose(model, input_ids=ids[:, 10:], attention_mask=mask, cache=copy.deepcopy(cache))
    torch.testing.assert_close(d.outputs.logits, whole.outputs.logits[:, 10:], rtol=1e-4, atol=1e-5)
    key_counts = []
    for layer in d.layers:
        new = d[layer].contribution("inter")
        keys = new.shape[-1]
        key_counts.append(keys)
        reference = whole[layer].contribution("inter")[:, :, 10:]
        torch.testing.assert_close(new, reference[..., 14 - keys:], rtol=1e-4, atol=1e-6, equal_nan=True)
        assert (reference[..., :14 - keys].nan_to_num(0) == 0).all()
    assert min(key_counts) < 14  # the control: a sliding layer's cache really is shorter than the sequence


def test_asking_for_a_layer_the_decomposition_does_not_hold_is_a_clear_error():
    d = cwcore.decompose(tiny_model("llama"), layers=0, input_ids=IDS)
    with pytest.raises(KeyError, match=r"^layer 1 was not decomposed \(it holds layers \[0\]\); pass layers=1"):
        d[1]
    with pytest.raises(KeyError, match=r"^layer 5 is out of range: the model has 2 attention layers"):
        d.inter[5]
    with pytest.raises(KeyError, match=r"^layer 1 was not decomposed"):
        d[-1]  # the last of the model's 2 layers
    torch.testing.assert_close(d[-2].inter, d.inter[0], rtol=0, atol=0)


def test_a_summary_or_attribution_without_the_layer_names_its_own_entry_point():
    # before: both said "pass layers=1 to cwcore.decompose to decompose it"
    model = tiny_model("llama")
    s = cwcore.summarize(model, layers=0, input_ids=IDS)
    with pytest.raises(KeyError, match=r"^layer 1 was not summarized \(it holds layers \[0\]\); pass layers=1 to "
                                       r"cwcore\.summarize$"):
        s[1]
    a = cwcore.attribute(model, method="alti", layers=0, input_ids=IDS)
    with pytest.raises(KeyError, match=r"^layer 1 was not attributed \(it holds layers \[0\]\); pass layers=1 to "
                                       r"cwcore\.attribute$"):
        a[1]


def test_a_decomposition_a_summary_and_an_attribution_are_mappings_from_layer_number():
    # before: iterating a decomposition gave its LayerDecomposition objects, so `1 in d` was always False and
    # `for layer in d: d[layer]` failed, while a summary and an attribution iterated layer numbers
    model = tiny_model("llama")
    d = cwcore.decompose(model, layers=1, input_ids=IDS)
    s = cwcore.summarize(model, layers=1, input_ids=IDS)
    a = cwcore.attribute(model, method="alti", layers=1, input_ids=IDS)
    for result in (d, s, a):
        assert list(result) == [1] == result.layers and len(result) == 1
        assert 1 in result and -1 in result and 0 not in result and -2 not in result and "1" not in result
        assert [layer for layer, _ in result.items()] == [1] and list(result.values()) == [result[1]]
        assert result.get(0) is None
    assert d[1].layer == 1 and s[1].layer == 1


class _KeywordAttention(nn.Module):
    """Calls the attention interface with one extra keyword (``extra`` -> ``value``)."""

    def __init__(self, config, keyword, value):
        super().__init__()
        self.config, self.keyword, self.value = config, keyword, value
        self.qkv, self.o_proj = nn.Linear(8, 24), nn.Linear(8, 8)
        self.scaling, self.is_causal = 0.5, False

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 2, 4).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        name = self.config._attn_implementation
        if name == "eager":  # the model's own arithmetic
            out = (torch.softmax(q @ k.transpose(2, 3) * self.scaling, -1, dtype=torch.float32) @ v).transpose(1, 2)
        else:
            out, _ = ALL_ATTENTION_FUNCTIONS[name](self, q, k, v, None, scaling=self.scaling,
                                                   **{self.keyword: self.value})
        return self.o_proj(out.reshape(b, n, 8))


class _KeywordModel(nn.Module):
    def __init__(self, keyword, value):
        super().__init__()
        self.config = PretrainedConfig()
        self.config._attn_implementation = "eager"
        self.embed = nn.Embedding(11, 8)
        self.attn = _KeywordAttention(self.config, keyword, value)

    def forward(self, input_ids, attention_mask=None):
        return self.attn(self.embed(input_ids))


@pytest.mark.parametrize("keyword,value,meaning", [
    ("indices", torch.zeros(1, 3, 2, dtype=torch.int32), "the top-k keys a sparse-attention indexer selected"),
    ("alibi", torch.zeros(1, 2, 3, 3), "ALiBi position biases"),
    ("my_new_feature", 1.5, "a keyword cwcore's attention function does not know"),
])
def test_a_keyword_cwcore_does_not_implement_is_refused_naming_block_and_keyword(keyword, value, meaning):
    torch.manual_seed(0)
    model = _KeywordModel(keyword, value).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(ids)
    message = (rf"attention block 'attn' \(_KeywordAttention\) passes `{keyword}` to the attention function "
               rf"\({meaning}")
    with pytest.raises(cwcore.UnsupportedModelError, match=message):
        cwcore.decompose(model, input_ids=ids)
    with pytest.raises(cwcore.UnsupportedModelError, match=message):  # entering the context alone, too
        with torch.no_grad(), cwcore_attention(model):
            model(ids)
    with torch.no_grad():
        assert torch.equal(model(ids), before)


@pytest.mark.parametrize("keyword,value", [("sliding_window", 4), ("position_ids", torch.arange(3)[None]),
                                           ("indices", None), ("output_attentions", False)])
def test_keywords_cwcore_handles_or_that_are_off_pass(keyword, value):
    torch.manual_seed(0)
    model = _KeywordModel(keyword, value).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(ids)
    d = cwcore.decompose(model, input_ids=ids)
    assert torch.equal(d.outputs, before)


def test_a_decomposition_is_a_snapshot_of_its_forward_pass():
    """Views computed on demand must not read the weights as they are later (exercise 3.3 scales W_O in place)."""
    model = tiny_model("llama")
    before = cwcore.decompose(model, input_ids=IDS)
    reference = {layer: (before[layer].inter.clone(), before[layer].output_norm.clone()) for layer in before.layers}
    later = cwcore.decompose(model, input_ids=IDS)
    weight = model.model.layers[0].self_attn.o_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(3.0)
        for layer in later.layers:  # read only after the change
            torch.testing.assert_close(later[layer].inter, reference[layer][0], rtol=0, atol=0)
            torch.testing.assert_close(later[layer].output_norm, reference[layer][1], rtol=0, atol=0)
            torch.testing.assert_close(later[layer].relative_norm("inter"), before[layer].relative_norm("inter"),
                                       rtol=0, atol=0, equal_nan=True)
    finally:
        with torch.no_grad():
            weight.copy_(saved)


def test_the_output_bias_of_a_decomposition_is_a_copy():
    """``output_bias`` shared the live bias: zeroing it after decompose changed the stored decomposition."""
    model = tiny_model("gpt2")
    bias = model.transformer.h[1].attn.c_proj.bias
    d, saved = cwcore.decompose(model, input_ids=IDS), bias.detach().clone()
    try:
        with torch.no_grad():
            bias.zero_()
        torch.testing.assert_close(d[1].output_bias, saved, rtol=0, atol=0)
        assert bool(saved.abs().max() > 0)
    finally:
        with torch.no_grad():
            bias.copy_(saved)


@pytest.mark.parametrize("length", [1, 7])
def test_an_in_place_head_ablation_of_the_projections_input_is_refused_whatever_the_length(length):
    """A pre-hook that zeroes head 0's slice of o_proj's input in place: with one query the input shared storage with
    cwcore's stored mixed values, so both sides of the self-check changed alike and the inter weights summed to
    0.96 instead of 1 without a word (seven queries were refused)."""
    model = tiny_model("llama")

    def ablate(module, args):
        args[0][..., :16] = 0.0  # head 0 of 4 (head_dim 16), in place

    handle = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(ablate)
    try:
        with pytest.raises(cwcore.UnsupportedModelError, match=r"model.layers.1.self_attn.*do not reproduce the "
                                                               r"output projection's result"):
            cwcore.decompose(model, input_ids=IDS[:, :length])
    finally:
        handle.remove()
    d = cwcore.decompose(model, input_ids=IDS[:, :length])  # control: without the ablation, exact
    torch.testing.assert_close(d[1].inter.sum((1, 3)), torch.ones(2, length), rtol=1e-5, atol=1e-5)


def test_a_layer_number_from_numpy_or_a_tensor_indexes_like_an_int():
    # before: d[np.int64(1)] (what to_frame's `layer` column yields) raised "layer np.int64(1) is out of
    # range: the model has 2 attention layers (0 to 1, ...)", a contradiction
    import numpy as np

    model = tiny_model("llama")
    d = cwcore.decompose(model, input_ids=IDS)
    s = cwcore.summarize(model, input_ids=IDS)
    a = cwcore.attribute(model, method="alti", input_ids=IDS)
    for layer in d.to_frame()["layer"].unique():  # numpy.int64
        assert torch.equal(d[layer].contribution("inter"), d[int(layer)].contribution("inter"))
        assert torch.equal(d.attention[layer], d.attention[int(layer)])
        assert s[layer] is s[int(layer)] and a[layer] is a[int(layer)]
    assert d[torch.tensor(-1)] is d[1] and d[np.int64(-2)] is d[0]
    with pytest.raises(KeyError, match=r"^layer 1\.0 is out of range"):
        d[1.0]  # a float is still not a layer number


def test_heads_and_row_positions_from_numpy_read_as_ints():
    # before: to_frame(heads=np.int64(1)) and summarize(rows=np.int64(2)) raised "'numpy.int64' object is not
    # iterable", and rows=[np.int64(2)] "rows must be query positions in -6..5 ..., got np.int64(2)"
    import numpy as np

    model = tiny_model("llama")
    d = cwcore.decompose(model, input_ids=IDS)
    assert d.to_frame(heads=np.int64(1)).equals(d.to_frame(heads=1))
    for rows in (np.int64(2), [np.int64(2)], torch.tensor(2)):
        s = cwcore.summarize(model, rows=rows, input_ids=IDS)
        assert s[0].row_positions == (2,)
        torch.testing.assert_close(s[0].row(2), cwcore.summarize(model, rows=2, input_ids=IDS)[0].row(2), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_token_type_ids_a_tokenizer_returns_pass_as_the_model_ignores_them(family):
    # before: transformers 5 hands `token_type_ids` down to the attention function, which ignores it; cwcore
    # refused it as a keyword it does not implement, so `decompose(model, **tokenizer(text, ...))` failed for a
    # tokenizer that returns segment ids
    model = tiny_model(family)
    mask = torch.ones_like(IDS)
    mask[1, :2] = 0  # left padding, so the mask matters
    segments = torch.ones_like(IDS)
    with torch.no_grad():
        plain_logits = model(input_ids=IDS, attention_mask=mask).logits
        assert torch.equal(model(input_ids=IDS, attention_mask=mask, token_type_ids=segments).logits, plain_logits)
    plain = cwcore.decompose(model, input_ids=IDS, attention_mask=mask)
    with_segments = cwcore.decompose(model, input_ids=IDS, attention_mask=mask, token_type_ids=segments)
    for layer in plain.layers:
        torch.testing.assert_close(with_segments[layer].contribution("inter"), plain[layer].contribution("inter"),
                                   rtol=0, atol=0, equal_nan=True)
    summary = cwcore.summarize(model, input_ids=IDS, attention_mask=mask, token_type_ids=segments, rows=[-1])
    torch.testing.assert_close(summary[0].token_row(-1, "contribution"), plain[0].contribution("inter")[:, :, -1].sum(1),
                               rtol=1e-5, atol=1e-6)
    scores = cwcore.attribute(model, {"input_ids": IDS, "attention_mask": mask, "token_type_ids": segments},
                              method="contribution")
    reference = cwcore.attribute(model, {"input_ids": IDS, "attention_mask": mask}, method="contribution")
    torch.testing.assert_close(scores, reference, rtol=0, atol=0, equal_nan=True)


def test_a_probe_pass_of_one_model_hides_it_from_its_sessions_only():
    """A user's hook on model A that decomposes model B: during attribute(A, method="alti") the hook first fired in
    the probe pass of A, which hid every model's forward passes from every session of the thread, so decompose(B)
    was refused ("did not run in the forward pass"). The probe hides A's passes only."""
    from cwcore.core.architectures import attention_blocks

    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    a, b = tiny_model("llama"), tiny_model("gpt2", seed=3)
    alone, got = cwcore.decompose(b, input_ids=ids), []
    handle = attention_blocks(a)[1].module.register_forward_hook(
        lambda *args: got.append(cwcore.decompose(b, input_ids=ids)))
    try:
        cwcore.attribute(a, {"input_ids": ids}, method="alti")
    finally:
        handle.remove()
    assert got and all(d.layers == [0, 1] for d in got)
    for d in got:
        torch.testing.assert_close(d[1].inter, alone[1].inter, rtol=0, atol=0)
