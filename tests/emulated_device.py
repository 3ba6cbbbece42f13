"""A second device, emulated on the CPU: a model moved there catches every tensor that stays on the CPU.

No GPU runs this project's tests, so code that forgets to move a tensor to the model's device would pass
here and stop on a GPU with torch's device error. On the emulated device each tensor is a wrapper
(:class:`OnDevice`) that reports the ``meta`` device (the one device besides the CPU that a CPU build of
torch can name and guard) and keeps its values in a CPU tensor; every operation runs on those values, so
results are the CPU's to the bit. As on CUDA:

- an operation that mixes it with a CPU tensor of one or more dimensions raises "Expected all tensors to
  be on the same device" (0-dim CPU tensors pass, as CUDA lets them);
- a CPU tensor indexed by a tensor on the device raises; CPU index tensors into the device's tensors pass;
- ``.numpy()`` refuses; ``.cpu()``, ``.item()`` and ``.tolist()`` copy to the host;
- ``torch.tensor(..., device=...)``, factories with ``device=`` and ``.to(device)`` make tensors there.

Within :func:`emulated_device`, ``torch.inference_mode`` acts as ``torch.no_grad`` (a wrapper cannot be an
inference tensor), and a model's weights on it are not taken for the weights of a model made without them.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

DEVICE = torch.device("meta")
aten = torch.ops.aten

# CUDA takes a CPU tensor beside its own here: copies between devices, index tensors, reading a scalar
_MIXED_OK = {aten._to_copy.default, aten.copy_.default, aten.index.Tensor, aten.index_put_.default,
             aten.index_put.default, aten._index_put_impl_.default, aten.lift_fresh.default,
             aten._local_scalar_dense.default, aten.detach.default, aten.alias.default}
_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


class OnDevice(torch.Tensor):
    """A CPU tensor that lives, for everything that asks, on the emulated device."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        assert not isinstance(elem, OnDevice) and elem.device.type == "cpu", elem.device
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=DEVICE, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    def __repr__(self):
        return f"OnDevice({self.elem!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl

    # a list index becomes a tensor where no mode sees it (on this device, its values lost): a CPU one here
    def __getitem__(self, index):
        return super().__getitem__(_index(index))

    def __setitem__(self, index, value):
        return super().__setitem__(_index(index), value)

    def data_ptr(self):
        return self.elem.data_ptr()

    def __format__(self, spec):  # a 0-dim tensor formats as its number, as on CUDA
        return self.elem.__format__(spec)

    def tolist(self):  # CUDA copies to the host
        return self.elem.tolist()

    def numpy(self, *, force=False):  # CUDA refuses
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _index(index):
    if isinstance(index, list):
        return torch.tensor(index)
    if isinstance(index, tuple):
        return tuple(torch.tensor(i) if isinstance(i, list) else i for i in index)
    return index


def _is_device(device) -> bool:
    return device is not None and torch.device(device).type == DEVICE.type


def _lift(value):
    """A real meta tensor (made where the mode is not seen, as ``torch.tensor`` makes one) as an OnDevice one."""
    if isinstance(value, torch.Tensor) and not isinstance(value, OnDevice) and value.device.type == DEVICE.type:
        if value.numel():
            raise AssertionError("emulated device: a tensor with values was made on the device where the emulation "
                                 "cannot see them")
        return OnDevice(torch.empty(value.shape, dtype=value.dtype))
    return value


def _run(func, args, kwargs):
    args, kwargs = tree_map(_lift, (args, kwargs))
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on = [t for t in tensors if isinstance(t, OnDevice)]
    devices = [torch.device(d) for d in flat if isinstance(d, torch.device)]
    if isinstance(kwargs.get("device"), str):
        devices.append(torch.device(kwargs["device"]))
    to_device = any(_is_device(d) for d in devices)
    moves = func is aten._to_copy.default or func.overloadpacket is aten.to
    if on and func in _INDEXING and not isinstance(args[0], OnDevice):
        raise RuntimeError("indices should be either on cpu or on the same device as the indexed tensor (cpu)")
    if on and func not in _MIXED_OK and not moves:
        if any(not isinstance(t, OnDevice) and t.dim() > 0 and t.device.type == "cpu" for t in tensors):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{DEVICE.type} and cpu! ({func})")

    def unwrap(value):
        if isinstance(value, OnDevice):
            return value.elem
        if isinstance(value, torch.device) and _is_device(value):
            return torch.device("cpu")
        return value

    plain_args, plain_kwargs = tree_map(unwrap, (args, kwargs))
    if isinstance(plain_kwargs.get("device"), str) and _is_device(plain_kwargs["device"]):
        plain_kwargs = dict(plain_kwargs, device=torch.device("cpu"))
    out = func(*plain_args, **plain_kwargs)
    if not (to_device or (bool(on) and not (moves and devices))):
        return out
    same = {id(t.elem): t for t in on}  # an in-place operation or a no-op .to returns its input

    def wrap(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, OnDevice):
            known = same.get(id(value))
            return OnDevice(value) if known is None else known
        return value

    return tree_map(wrap, out)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


class _NoGrad:
    """``torch.inference_mode(mode=True)`` as ``torch.no_grad``: context manager and decorator."""

    def __init__(self, mode: bool = True):
        self.mode = mode

    def __enter__(self):
        self.previous = torch.is_grad_enabled()
        if self.mode:
            torch.set_grad_enabled(False)

    def __exit__(self, *exc):
        torch.set_grad_enabled(self.previous)

    def __call__(self, function):
        def run(*args, **kwargs):
            with _NoGrad(self.mode):
                return function(*args, **kwargs)
        return run


@contextlib.contextmanager
def emulated_device():
    """Within: the emulated device (``model.to(device)``, ``tensor.to(device)``, ``device=device``)."""
    import cwcore.core.decomposition as decomposition

    saved = (torch.tensor, torch.as_tensor, torch.inference_mode,
             torch.__future__.get_swap_module_params_on_conversion(), decomposition.check_materialised)

    def made_on_device(factory):
        def make(data, *args, device=None, **kwargs):
            if _is_device(device):
                with _disable_current_modes():
                    return OnDevice(factory(data, *args, **kwargs))
            return factory(data, *args, device=device, **kwargs)
        return make

    torch.tensor, torch.as_tensor = made_on_device(saved[0]), made_on_device(saved[1])
    torch.inference_mode = _NoGrad
    torch.__future__.set_swap_module_params_on_conversion(True)  # model.to keeps the parameters' class
    decomposition.check_materialised = lambda *args, **kwargs: None  # the weights have values: they are not meta
    try:
        with _Mode():
            yield DEVICE
    finally:
        torch.tensor, torch.as_tensor, torch.inference_mode = saved[:3]
        torch.__future__.set_swap_module_params_on_conversion(saved[3])
        decomposition.check_materialised = saved[4]
