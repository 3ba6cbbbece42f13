"""The run driver: one model identity (safe with offloaded weights) and resumable cached batches."""

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from cwcore import runs
from tiny_models import tiny_model


@pytest.fixture(autouse=True)
def _caching_on(monkeypatch):
    """These tests exercise the result cache itself, which caches only when asked: asked here."""
    monkeypatch.setenv("CWCORE_CACHING", "1")


def test_fingerprint_tracks_weights_and_names():
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    assert runs.model_fingerprint(a) == runs.model_fingerprint(b)
    with torch.no_grad():
        b.model.layers[1].self_attn.o_proj.weight[3, 5] += 1e-3  # one weight, inside the strided sample
    assert runs.model_fingerprint(a) != runs.model_fingerprint(b)
    assert runs.model_fingerprint(a) != runs.model_fingerprint(tiny_model("qwen2"))


def test_tensor_digest_is_content_based():
    x = torch.arange(6).reshape(2, 3)
    assert runs.tensor_digest({"a": x, "b": x + 1}) == runs.tensor_digest({"b": x + 1, "a": x.clone()})
    assert runs.tensor_digest(x) != runs.tensor_digest(x.float())
    assert runs.tensor_digest(x) != runs.tensor_digest(x.reshape(3, 2))


def test_for_each_batch_computes_once_and_resumes_after_an_interruption(tmp_path):
    batches = [torch.full((2, 3), i) for i in range(4)]
    calls = []

    def compute(batch, fail_at=None):
        value = int(batch[0, 0])
        if value == fail_at:
            raise KeyboardInterrupt
        calls.append(value)
        return {"x": pd.DataFrame({"v": [value]}), "y": pd.DataFrame({"w": [value * 2]})}

    store = runs.PieceStore("demo", {"p": 1}, cache_root=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        for _ in runs.for_each_batch(batches, lambda b: compute(b, fail_at=2), store, show_progress=False):
            pass
    assert calls == [0, 1]
    got = [frames["y"]["w"].item() for _, frames in runs.for_each_batch(batches, compute, store, show_progress=False)]
    assert got == [0, 2, 4, 6] and calls == [0, 1, 2, 3]  # batches 0-1 were read back, not recomputed
    # a group without its `.done` marker is incomplete
    (store.directory / f"{runs.tensor_digest(batches[3])}.done.parquet").unlink()
    assert store.get_group(runs.tensor_digest(batches[3])) is None


def test_piece_store_keys_by_model_and_parameters(tmp_path):
    model = tiny_model("llama")
    one = runs.PieceStore("demo", {"p": 1}, model=model, code="sinks", cache_root=tmp_path)
    same = runs.PieceStore("demo", {"p": 1}, model=tiny_model("llama"), code="sinks", cache_root=tmp_path)
    other = runs.PieceStore("demo", {"p": 1}, model=tiny_model("llama", seed=1), code="sinks", cache_root=tmp_path)
    assert one.directory == same.directory != other.directory
    assert runs.PieceStore("demo", {"p": 1}, cache=False, cache_root=tmp_path).get("anything") is None


def test_the_main_ranks_bar_is_written_for_the_book_build_to_show(tmp_path, monkeypatch):
    import io
    import json

    from cwbook import progress as book_progress

    path = tmp_path / "bar.json"
    monkeypatch.setenv(runs.PROGRESS_FILE_ENV_VAR, str(path))
    monkeypatch.setenv(runs.JOBS_ENV_VAR, "2")  # two ranks: rank 0's bar counts the helper's batches too
    bar = runs.progress(7, "sweep", enabled=False)  # not shown in the page, still written for the build
    assert json.loads(path.read_text())["n"] == 0
    assert runs.shard_map(range(7), lambda i: i * i, progress=bar) == [i * i for i in range(7)]
    bar.close()
    state = json.loads(path.read_text())
    assert (state["desc"], state["n"], state["total"], state["unit"]) == ("sweep", 7, 7, "batch")
    # the build's line: elapsed, and the time left at the mean rate so far
    line = book_progress.describe({"desc": "faithfulness", "n": 3, "total": 12, "unit": "batch", "started": 0.0},
                                  now=60.0)
    assert line == "faithfulness 3/12 batch, 60 s elapsed, ~3 min left"
    log = io.StringIO()  # not a terminal: a line when log_every has passed, then the prefix again
    with book_progress.Watch(path, "[1/2] 04", stream=log, interval=3600, log_every=0) as watch:
        watch.poll()
    assert log.getvalue().startswith("\n    ... sweep 7/7 batch, ") and log.getvalue().endswith("\n[1/2] 04")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    shown = Terminal()
    with book_progress.Watch(path, "[1/2] 04", stream=shown, interval=3600) as watch:
        watch.poll()
    assert shown.getvalue().startswith("\r\033[K[1/2] 04 sweep 7/7 batch") and shown.getvalue().endswith("\r\033[K[1/2] 04")
    monkeypatch.delenv(runs.PROGRESS_FILE_ENV_VAR)
    assert isinstance(runs.progress(3, "quiet", enabled=False), runs._NoBar)  # outside a build: nothing written


def test_fingerprint_hashes_every_weight_byte():
    """One edited value anywhere (off any strided sample, through ``.data`` which moves no version
    counter, a tied embedding, one zeroed MLP neuron, a bfloat16 model's last byte) changes the identity."""
    a = nn.Sequential(nn.Embedding(5000, 8), nn.Linear(8, 8))
    base = runs.model_fingerprint(a)
    weight = a[0].weight
    for index in (1, 4097, weight.numel() - 1):  # positions between the old sample's stride
        before = weight.view(-1)[index].item()
        weight.data.view(-1)[index] += 1e-6 * (1 + abs(before))
        assert runs.model_fingerprint(a) != base, index
        weight.data.view(-1)[index] = before
        assert runs.model_fingerprint(a) == base
    model = tiny_model("llama", seed=0)
    base = runs.model_fingerprint(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[:, 7] = 0  # one neuron
    assert runs.model_fingerprint(model) != base
    half = tiny_model("llama", seed=0).to(torch.bfloat16)
    base = runs.model_fingerprint(half)
    half.model.embed_tokens.weight.data.view(-1)[-1] += 1  # tied or not: the embedding's last value
    assert runs.model_fingerprint(half) != base


THRESHOLD = 0.5


def _global_reading_metric(layer_decomposition, **_):
    return layer_decomposition.attention * THRESHOLD


def test_metric_key_covers_the_globals_it_reads():
    """A callable metric that reads a module-level value gets another cache key when the value changes."""
    from cwcore.faithfulness.methods import method_key

    global THRESHOLD
    first = method_key(_global_reading_metric)
    THRESHOLD = 0.25
    try:
        assert method_key(_global_reading_metric) != first
    finally:
        THRESHOLD = 0.5
    assert method_key(_global_reading_metric) == first


def test_metric_key_covers_the_state_of_a_callable_object_with_slots():
    """A callable object keeping its state in __slots__ (a dataclass(slots=True)) gets another key for another
    state (the slots were not read: Scaled(1.0) and Scaled(-1.0) had one key); an equal one keeps its key."""
    import dataclasses

    from cwcore.faithfulness.methods import method_key

    @dataclasses.dataclass(slots=True)
    class Scaled:
        sign: float

        def __call__(self, layer_decomposition, **_):
            return layer_decomposition.attention * self.sign

    assert method_key(Scaled(1.0)) != method_key(Scaled(-1.0))
    assert method_key(Scaled(1.0)) == method_key(Scaled(1.0))

def test_metric_reading_an_object_without_identity_is_not_cached():
    from cwcore.faithfulness.methods.registry import as_method

    class Opaque:
        pass

    holder = Opaque()

    def metric(layer_decomposition, **_):
        return layer_decomposition.attention * (holder is not None)

    from cwcore.cache import CacheWarning

    with pytest.warns(CacheWarning, match="is not cached") as record:
        first = as_method(metric)
    assert [w.filename for w in record] == [__file__]  # the user's line, not the registry's
    with pytest.warns(CacheWarning, match="is not cached"):
        assert as_method(metric).key != first.key


SCALES = __import__("pandas").DataFrame({"layer": range(200), "scale": [1.0] * 200})


def _frame_reading_metric(layer_decomposition, layer, **_):
    return layer_decomposition.attention * float(SCALES["scale"].iloc[layer])


def test_metric_key_covers_every_row_of_a_global_table():
    """A global table's repr shows a few rows: the key hashes them all."""
    from cwcore.faithfulness.methods import method_key

    first = method_key(_frame_reading_metric)
    SCALES.loc[100, "scale"] = 2.0  # a row the repr does not show
    try:
        assert method_key(_frame_reading_metric) != first
    finally:
        SCALES.loc[100, "scale"] = 1.0
    assert method_key(_frame_reading_metric) == first


def test_fingerprint_tracks_the_settings_a_forward_reads_besides_the_weights():
    # before: a norm's epsilon edited in place (an ablation) kept the identity, so a cached curve of the
    # unedited model was served (the helper's measurement: a fresh run differs)
    a, b = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
    base_a = runs.model_fingerprint(a)
    b.model.layers[0].input_layernorm.variance_epsilon = 0.5
    ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(a(input_ids=ids).logits, b(input_ids=ids).logits)  # it matters to the output
    assert runs.model_fingerprint(b) != base_a
    gemma = tiny_model("gemma3", seed=0)
    base = runs.model_fingerprint(gemma)
    gemma.config.final_logit_softcapping = 3.0  # read from the configuration at every forward
    assert runs.model_fingerprint(gemma) != base
    # the controls: what does not change the output leaves the identity alone
    a.train()
    assert runs.model_fingerprint(a) == base_a
    a.eval()
    with torch.no_grad():
        a(input_ids=ids)  # a forward pass changes no setting
    assert runs.model_fingerprint(a) == base_a


def _clean_nll(model, ids, root):
    from cwcore import cache
    from cwcore import faithfulness as fa

    with cache.caching(root):
        table = fa.faithfulness_curve(model, None, ids, metric=["contribution"], ratios=[0.3],
                                      mode="comprehensiveness", batch_size=4, progress=False).per_sequence
    return table["clean_nll"].to_numpy()


def test_a_forward_hook_is_part_of_the_models_identity_and_a_cached_curve_is_not_served_across_it(tmp_path):
    # before: a hook that scales one MLP's output (the usual way to ablate) kept the identity, so the cached
    # curve of the model without it was served: clean NLL of the unhooked model for the hooked one
    from tiny_models import VOCAB

    model = tiny_model("llama", seed=0)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    base = runs.model_fingerprint(model)
    plain = _clean_nll(model, ids, tmp_path)
    scale = torch.tensor(0.0)
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * scale)
    assert runs.model_fingerprint(model) != base
    hooked = _clean_nll(model, ids, tmp_path)
    assert not np.allclose(plain, hooked)  # computed, not served
    first = runs.model_fingerprint(model)
    scale.fill_(0.5)  # a value the hook reads, edited in place
    assert runs.model_fingerprint(model) != first
    handle.remove()
    assert runs.model_fingerprint(model) == base  # the control: without the hook, the same identity
    assert (_clean_nll(model, ids, tmp_path) == plain).all()


def test_a_replaced_forward_a_users_class_and_global_hooks_are_in_the_identity():
    model = tiny_model("llama", seed=0)
    base = runs.model_fingerprint(model)
    mlp = model.model.layers[1].mlp
    original = mlp.forward
    mlp.forward = lambda x: original(x) * 0
    assert runs.model_fingerprint(model) != base
    del mlp.forward
    assert runs.model_fingerprint(model) == base

    class Silent(nn.Module):
        def forward(self, x):
            return x * 0

    act = mlp.act_fn
    mlp.act_fn = Silent()  # no weights: only its class says what it computes
    assert runs.model_fingerprint(model) != base
    mlp.act_fn = act
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: None)
    try:
        assert runs.model_fingerprint(model) != base
    finally:
        handle.remove()
    assert runs.model_fingerprint(model) == base


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_offloaded_weights_are_read_from_accelerates_weights_map(tmp_path, where):
    """accelerate keeps offloaded weights on the meta device and their values in its hooks' weights maps: an
    edit there changes the model's output, so it must change the key (name and shape alone did not)."""
    from accelerate import cpu_offload, disk_offload

    ids = torch.tensor([[1, 2, 3, 4]])
    model = tiny_model("llama", seed=0)
    reference = model(input_ids=ids).logits
    if where == "cpu":
        cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        disk_offload(model, str(tmp_path / "offload"), execution_device=torch.device("cpu"))
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    torch.testing.assert_close(model(input_ids=ids).logits, reference, rtol=0, atol=0)
    base = runs.model_fingerprint(model)
    assert runs.model_fingerprint(model) == base and not base.startswith("uncached-")
    weights = model.model.layers[0].self_attn.q_proj._hf_hook.weights_map
    if where == "cpu":  # a dict of CPU tensors: one value edited in place
        weights["weight"][0, 0] += 1.0
        assert not torch.equal(model(input_ids=ids).logits, reference)
        assert runs.model_fingerprint(model) != base
        weights["weight"][0, 0] -= 1.0
        assert runs.model_fingerprint(model) == base
    else:  # memory-mapped values cannot be edited in place: the same model with one value changed, offloaded
        # before, this branch only checked that the key was stable, which name and shape alone also give
        same, edited = tiny_model("llama", seed=0), tiny_model("llama", seed=0)
        with torch.no_grad():
            edited.model.layers[0].self_attn.q_proj.weight[0, 0] += 1.0
        for other, folder in ((same, "same"), (edited, "edited")):
            disk_offload(other, str(tmp_path / folder), execution_device=torch.device("cpu"))
        assert edited.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
        assert not torch.equal(edited(input_ids=ids).logits, reference)
        assert runs.model_fingerprint(same) == base  # another folder, the same values: the same key
        assert runs.model_fingerprint(edited) != base


class _Adapter(torch.nn.Module):
    """A LoRA-like adapter as peft keeps one: its scale per adapter in a public dict, the active adapter and the
    switch that disables it in private attributes; a private dict that counts calls changes every forward."""

    def __init__(self, base: torch.nn.Linear):
        super().__init__()
        self.base, self.delta = base, torch.nn.Linear(base.in_features, base.out_features, bias=False)
        self.scaling = {"default": 2.0, "other": 0.5}
        self._active_adapter, self._disable_adapters, self._calls = ["default"], False, {}

    def forward(self, x):
        self._calls[len(self._calls)] = True
        out = self.base(x)
        return out if self._disable_adapters else out + self.scaling[self._active_adapter[0]] * self.delta(x)


def test_an_adapters_switches_and_scales_are_part_of_the_identity():
    """Disabling an adapter, switching it or changing its scale changes the output without touching a weight:
    each must change the key; bookkeeping (a call counter, transformers' loading flag) must not."""
    ids = torch.tensor([[1, 2, 3, 4]])
    model = tiny_model("llama", seed=0)
    attention = model.model.layers[0].self_attn
    attention.q_proj = _Adapter(attention.q_proj)
    adapter = attention.q_proj
    base, logits = runs.model_fingerprint(model), model(input_ids=ids).logits
    assert runs.model_fingerprint(model) == base  # the forward above filled the call counter: not in the key
    model.model._is_hf_initialized = not getattr(model.model, "_is_hf_initialized", False)
    assert runs.model_fingerprint(model) == base
    keys = {base}
    for change, undo in ((lambda: setattr(adapter, "_disable_adapters", True),
                          lambda: setattr(adapter, "_disable_adapters", False)),
                         (lambda: setattr(adapter, "_active_adapter", ["other"]),
                          lambda: setattr(adapter, "_active_adapter", ["default"])),
                         (lambda: adapter.scaling.update(default=1.0), lambda: adapter.scaling.update(default=2.0))):
        change()
        assert not torch.equal(model(input_ids=ids).logits, logits)  # the output moved
        keys.add(runs.model_fingerprint(model))
        undo()
        assert runs.model_fingerprint(model) == base
    assert len(keys) == 4  # each change its own key


def test_the_attention_implementation_is_part_of_the_identity():
    """One model under SDPA and under eager attention: the same weights, two computations that round
    differently, so two keys; switching back restores the first."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    model = tiny_model("llama", seed=0)
    model.set_attn_implementation("sdpa")
    sdpa, sdpa_logits = runs.model_fingerprint(model), model(input_ids=ids).logits
    model.set_attn_implementation("eager")
    eager, eager_logits = runs.model_fingerprint(model), model(input_ids=ids).logits
    assert model.model.layers[0].self_attn.config._attn_implementation == "eager"
    torch.testing.assert_close(eager_logits, sdpa_logits, rtol=1e-4, atol=1e-5)  # the same model ...
    assert eager != sdpa  # ... computed another way
    model.set_attn_implementation("sdpa")
    assert runs.model_fingerprint(model) == sdpa


def test_a_meta_tensor_no_hook_holds_is_never_cached():
    from cwcore.cache import CacheWarning

    model = tiny_model("llama", seed=0)
    model.model.layers[1].mlp.up_proj.to_empty(device="meta")
    with pytest.warns(CacheWarning, match="up_proj.weight is on the meta device") as record:
        first, second = runs.model_fingerprint(model), runs.model_fingerprint(model)
    assert first != second and first.startswith("uncached-") and {w.filename for w in record} == {__file__}


def test_a_hook_that_reads_its_model_and_one_that_reads_an_unidentifiable_value():
    from cwcore.cache import CacheWarning

    model = tiny_model("llama", seed=0)
    base = runs.model_fingerprint(model)
    handle = model.register_forward_hook(lambda module, args, out: (model, out)[1])  # reads the model itself
    assert runs.model_fingerprint(model) == runs.model_fingerprint(model) != base
    handle.remove()
    token = object()  # its repr is its address: nothing says whether it changed
    handle = model.model.layers[0].register_forward_pre_hook(lambda module, args: (token, args)[1])
    with pytest.warns(CacheWarning, match="not cached") as record:
        first, second = runs.model_fingerprint(model), runs.model_fingerprint(model)
    assert {w.filename for w in record} == {__file__}  # the user's line, not cwcore.identity's
    assert first != second and first.startswith("uncached-")  # never served from the cache
    handle.remove()
    assert runs.model_fingerprint(model) == base


def test_a_hook_that_says_it_only_observes_is_left_out_and_a_cached_result_is_served_with_it(tmp_path):
    from tiny_models import VOCAB

    model = tiny_model("llama", seed=0)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    base = runs.model_fingerprint(model)
    plain = _clean_nll(model, ids, tmp_path)
    seen = []

    def record(module, args, out):
        seen.append(out.detach().clone())  # its state grows every call

    handle = model.model.layers[0].mlp.register_forward_hook(record)
    assert runs.model_fingerprint(model) != base  # unmarked, it might change the output: in the identity
    record.cwcore_observer = True
    assert runs.model_fingerprint(model) == base
    assert (_clean_nll(model, ids, tmp_path) == plain).all() and not seen  # served: no forward ran
    handle.remove()


def test_a_method_monkeypatched_on_a_library_class_is_in_the_identity(monkeypatch):
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama", seed=0)
    base = runs.model_fingerprint(model)
    original = modeling_llama.LlamaMLP.forward

    def halved(self, x):
        return original(self, x) * 0.5

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", halved)
    assert runs.model_fingerprint(model) != base
    monkeypatch.undo()
    assert runs.model_fingerprint(model) == base


def test_two_threads_fingerprinting_one_model_both_get_its_full_identity():
    import threading

    model = tiny_model("llama", seed=0)
    expected = runs.model_fingerprint(model)
    entered, release = threading.Event(), threading.Event()
    seen = []
    import cwcore.identity as identity

    original = identity._settings

    def settings_waiting(m):
        if threading.current_thread().name == "first":
            entered.set()
            release.wait(10)
        return original(m)

    identity._settings = settings_waiting  # holds the first thread's fingerprint open
    try:
        first = threading.Thread(target=lambda: seen.append(runs.model_fingerprint(model)), name="first")
        first.start()
        assert entered.wait(10)
        seen.append(runs.model_fingerprint(model))  # while the first is under way in its own thread
        release.set()
        first.join(10)
    finally:
        identity._settings = original
    assert seen == [expected, expected]  # before: the second got the placeholder of a model under way
