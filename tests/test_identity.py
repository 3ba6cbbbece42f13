"""What a cache key says of the user's code and state (cwcore.identity): each case changes what a call computes,
so it must change the key; each was once served the earlier result from the cache."""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

import torch
from torch import nn

from cwcore.identity import method_key, model_fingerprint
from tiny_models import tiny_model


def _users_module(name: str, tmp_path, **values) -> types.ModuleType:
    """A module of the user's own (a file outside the installed packages), registered under ``name``."""
    module = types.ModuleType(name)
    module.__file__ = str(tmp_path / f"{name}.py")
    module.__dict__.update(values)
    sys.modules[name] = module
    return module


def test_a_users_module_named_like_a_library_is_the_users(tmp_path, monkeypatch):
    """torch_metrics.py and cwcore_hooks.py were taken for torch's and cwcore's own code: globals not read, the
    hook left out of the model's identity."""
    module = _users_module("torch_metrics", tmp_path, SIGN=1.0)
    monkeypatch.setitem(sys.modules, "torch_metrics", module)
    exec("def metric(x):\n    return SIGN * x\n", module.__dict__)
    module.metric.__module__ = "torch_metrics"
    before = method_key(module.metric)
    module.SIGN = -1.0
    assert method_key(module.metric) != before
    hooks = _users_module("cwcore_hooks", tmp_path, GAIN=2.0)
    monkeypatch.setitem(sys.modules, "cwcore_hooks", hooks)
    exec("def hook(module, args, out):\n    return out * GAIN\n", hooks.__dict__)
    model = tiny_model("llama")
    plain = model_fingerprint(model)
    model.model.layers[0].mlp.register_forward_hook(hooks.hook)
    assert model_fingerprint(model) != plain


def test_a_library_functions_bound_arguments_and_owner_are_in_the_identity():
    """partial(leaky_relu, negative_slope=0.01) and -5 had one key; so had two donors' bound forwards."""
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    keys = []
    for slope in (0.01, -5.0):  # a replaced forward, as a partial of a library function
        mlp.act_fn.forward = functools.partial(nn.functional.leaky_relu, negative_slope=slope)
        keys.append(model_fingerprint(model))
    donors = [nn.Linear(4, 4) for _ in range(2)]
    for donor in donors:
        mlp.forward = donor.forward
        keys.append(model_fingerprint(model))
    mlp.forward = model.model.layers[1].mlp.forward  # a module of the model itself: by name (its weights count)
    keys.append(model_fingerprint(model))
    assert len(set(keys)) == 5


class _Steered(nn.Module):
    GAIN = 1.0

    def __init__(self, inner):
        super().__init__()
        self.inner, self.vec = inner, torch.zeros(64)

    @staticmethod
    def scale(x):
        return x * LIMIT

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs) * self.GAIN + self.vec


LIMIT = 10.0


def test_a_users_module_class_attributes_static_methods_and_plain_tensors_are_in_the_identity():
    global LIMIT
    model = tiny_model("llama")
    layer = model.model.layers[0]
    layer.mlp = _Steered(layer.mlp)
    keys = [model_fingerprint(model)]
    layer.mlp.vec += 1  # a steering vector kept as a plain attribute
    keys.append(model_fingerprint(model))
    _Steered.GAIN = 100.0
    try:
        keys.append(model_fingerprint(model))
    finally:
        _Steered.GAIN = 1.0
    LIMIT = 1e-6  # read by a static method
    try:
        keys.append(model_fingerprint(model))
    finally:
        LIMIT = 10.0
    model.config._experts_implementation = "grouped_mm"  # an MoE's experts kernel, beside attention's
    keys.append(model_fingerprint(model))
    assert len(set(keys)) == 5


@dataclasses.dataclass
class _Settings:
    weights: torch.Tensor


SETTINGS = _Settings(torch.ones(2048))


def _weighted(x):
    return x * SETTINGS.weights[: x.shape[-1]].sum()


def test_a_dataclass_holding_a_large_tensor_a_local_import_and_bf16_values_are_read_whole(tmp_path, monkeypatch):
    before = method_key(_weighted)
    SETTINGS.weights[1000] = -1.0  # past what the tensor's repr shows ("...")
    try:
        assert method_key(_weighted) != before
    finally:
        SETTINGS.weights[1000] = 1.0
    settings = _users_module("audit_threshold_settings", tmp_path, THRESHOLD=1.0)
    monkeypatch.setitem(sys.modules, "audit_threshold_settings", settings)
    namespace = {}
    exec("def metric(x):\n    import audit_threshold_settings\n    return x * audit_threshold_settings.THRESHOLD\n",
         namespace)
    first = method_key(namespace["metric"])
    settings.THRESHOLD = -1.0
    assert method_key(namespace["metric"]) != first
    half = torch.ones(3, dtype=torch.bfloat16)  # crashed: bfloat16 has no numpy dtype
    namespace["HALF"] = half
    exec("def reads_half(x):\n    return x * HALF\n", namespace)
    key = method_key(namespace["reads_half"])
    half[0] = 2
    assert method_key(namespace["reads_half"]) != key


def test_code_with_a_lambda_has_one_identity_in_every_process():
    """A nested code object's repr holds its address: the key of a metric with a comprehension was new in
    every process, so the cache never hit across runs."""
    from cwcore.identity import _code_digest

    source = "def metric(x):\n    return sum(v for v in x) + (lambda y: y)(1)\n"
    first, second = ({} for _ in range(2))
    exec(compile(source, "<a>", "exec"), first)
    exec(compile(source, "<a>", "exec"), second)
    assert repr(first["metric"].__code__.co_consts) != repr(second["metric"].__code__.co_consts)  # two addresses
    assert _code_digest(first["metric"].__code__) == _code_digest(second["metric"].__code__)
