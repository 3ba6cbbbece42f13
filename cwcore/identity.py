"""What a cached result's key says of the objects it was computed from: a model, tensors and the user's callables.

- :func:`model_fingerprint`: the model's identity. Every byte of every weight, its settings (the configuration's
  fields, its attention implementation, each module's plain attributes) and the code that runs beside its own classes' code: a module of the
  user's own class, a ``forward`` replaced on one module, forward hooks and pre-hooks (the usual way to ablate or
  steer) and torch's global forward hooks, each by :func:`method_key`. Hooks and replaced forwards of cwcore's own
  code are the code version's part of the key, not the model's; those of installed packages (accelerate's device
  hooks) are taken by their qualified name. A hook that only observes (it records activations or counts calls,
  so its state changes every call) can say so with an attribute ``cwcore_observer = True``: it is left out, and
  a cached result is served with it registered.
- :func:`tensor_digest`: a content hash of tensors, arrays or mappings of them (a batch).
- :func:`method_key`: a callable's identity (a metric, a hook): its code and everything it reads.

A value whose state cannot be read (an object whose ``repr`` is its address) raises :class:`UncacheableMetric`;
a model that holds one gets a fresh identity every call, with a :class:`~cwcore.cache.CacheWarning`, so what is
computed on it is never served from the cache."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd
import torch
from torch import nn

__all__ = ["UncacheableMetric", "method_key", "model_fingerprint", "tensor_digest"]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Every byte of ``tensor``'s values (a contiguous CPU copy where needed), as bytes, whatever its dtype
    (bfloat16 and float8 have no numpy dtype: their bytes are read as uint8)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


#: The plain values a module's attribute may hold and :func:`model_fingerprint` reads (a norm's epsilon, a softcap)
_SETTING_TYPES = (int, float, bool, str, type(None))
#: private attributes that record bookkeeping, not what a forward computes (transformers' loading flag, torch's
#: backward-hook kind): left out, so that a model's identity does not depend on how it was built
_BOOKKEEPING = frozenset({"_is_hf_initialized", "_is_full_backward_hook"})


def _setting_text(value: Any, containers: tuple = (tuple, list, set, frozenset, dict), depth: int = 0) -> str | None:
    """A plain value, or a ``containers`` value of plain values (nested: an adapter's ``{"default": 2.0}``), as
    text with sets and dicts in sorted order; None for anything else (a tensor, a module, a function)."""
    if isinstance(value, _SETTING_TYPES):
        return repr(value)
    if not isinstance(value, containers) or depth > 8:
        return None
    parts = []
    for item in (value.items() if isinstance(value, dict) else value):
        texts = [_setting_text(v, containers, depth + 1) for v in (item if isinstance(value, dict) else (item,))]
        if None in texts:
            return None
        parts.append(": ".join(texts))
    if isinstance(value, (set, frozenset, dict)):
        parts.sort()
    return f"{type(value).__name__}[{', '.join(parts)}]"


def _settings(model: nn.Module) -> str:
    """What a forward reads besides the tensors: the configuration's public fields and every module's
    plain-valued attributes, one per line: public ones (``variance_epsilon``, ``scaling``, an adapter's
    ``{"default": 2.0}``), and private plain values, tuples, lists and sets (an adapter's ``_disable_adapters``
    and ``_active_adapter``; not private dicts, where torch keeps its hooks' ids, nor :data:`_BOOKKEEPING`);
    and the attention implementation each module's configuration selects (``sdpa``, ``eager``).
    Edited in place after loading (an ablation, a switched adapter), they change the model's output and must
    change its identity."""
    lines = []
    config = getattr(model, "config", None)
    if callable(getattr(config, "to_dict", None)):
        fields = {key: value for key, value in config.to_dict().items() if not key.startswith("_")}
        lines.append(json.dumps(fields, sort_keys=True, default=repr))
    configs_seen = set()
    for name, module in model.named_modules():
        # the attention function a module's configuration selects (SDPA, eager, flex): one model under two
        # of them rounds differently, so the two are two computations; to_dict() leaves the field out. Each
        # configuration once: every layer of a model shares one
        config = getattr(module, "config", None)
        if config is not None and id(config) not in configs_seen:
            configs_seen.add(id(config))
            # attention's and the experts' (an MoE's grouped_mm or eager): every *_implementation choice
            for field in sorted(dir(config)) if hasattr(config, "to_dict") else ():
                if field.endswith("_implementation") and not field.startswith("__"):
                    implementation = getattr(config, field, None)
                    if isinstance(implementation, str):
                        lines.append(f"{name}.config.{field}={implementation!r}")
        for key, value in sorted(vars(module).items()):
            if key == "training" or key in _BOOKKEEPING:
                continue
            if isinstance(value, torch.Tensor):  # a tensor kept as a plain attribute (a steering vector)
                lines.append(f"{name}.{key}=<tensor {tuple(value.shape)} {value.dtype}" +
                             ("" if value.device.type == "meta" else " " + tensor_digest(value)) + ">")
                continue
            text = _setting_text(value) if not key.startswith("_") else \
                _setting_text(value, containers=(tuple, list, set, frozenset))
            if text is not None:
                lines.append(f"{name}.{key}={text}")
    return "\n".join(lines)


#: the hook tables a module's forward runs (torch keeps pre-hooks and hooks apart, per module and global)
_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks")
#: per thread, the models whose fingerprint is under way: a hook that reads its own model is not followed into
#: it again (another thread fingerprinting the same model meanwhile computes it in full)
_UNDER_WAY = threading.local()


def _unwrapped(fn):
    """The function behind ``fn``: a partial's function, a bound method's function, else ``fn`` itself."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__func__", fn)


def _defining_module(fn) -> str:
    """The name of the module that defines ``fn`` (a function, a bound method, a partial's function, or the
    class of a callable object)."""
    target = _unwrapped(fn)
    name = getattr(target, "__module__", None)
    return name if isinstance(name, str) else type(target).__module__


def _is_library_module(name: str) -> bool:
    """cwcore, torch, numpy, transformers, or a module that lies in an installed package's folder."""
    if _in_packages(name):
        return True
    file = getattr(sys.modules.get(name), "__file__", None)
    return bool(file) and str(Path(file).resolve()).startswith(_installed_folders())


def _in_packages(name: str, packages: tuple[str, ...] | None = None) -> bool:
    """Whether module ``name`` is one of ``packages`` (default :data:`_LIBRARY_PACKAGES`) or inside one: a user's
    ``cwcore_hooks.py`` or ``torch_metrics.py`` is not (a bare prefix test took them for library code)."""
    return any(name == p or name.startswith(p + ".") for p in (packages or _LIBRARY_PACKAGES))


def _code_identity(fn, members: frozenset = frozenset()) -> str | None:
    """What a model's identity says of code it runs besides its classes' own (a hook, a replaced ``forward``):
    None for cwcore's own (its code version is in every key) and for a hook marked ``cwcore_observer = True``
    (its owner's promise that it only observes: a recorder, a counter, whose state changes every call), the
    qualified name for an installed package's (accelerate's device hooks), else :func:`method_key` (the
    user's code and everything it reads). A library function's bound state counts: a partial's arguments, a
    bound method's owner (a module of the model, ``members`` its ids, by name; another, by its fingerprint)."""
    module_name = _defining_module(fn)
    if _in_packages(module_name, ("cwcore",)) or getattr(fn, "cwcore_observer", False):
        return None
    if _is_library_module(module_name):
        inner = _unwrapped(fn)
        name = f"{module_name}.{getattr(inner, '__qualname__', type(inner).__qualname__)}"
        bound = []
        while isinstance(fn, functools.partial):  # leaky_relu at slope 0.01 and at -5 are two computations
            bound.append(_bound_digest(list(fn.args) + sorted(fn.keywords.items()), members))
            fn = fn.func
        owner = getattr(fn, "__self__", None)
        if owner is not None and not isinstance(owner, (type, types.ModuleType)):  # another module's forward
            bound.append(_bound_digest([owner], members))
        return name + "".join(f"[{b}]" for b in bound)
    return method_key(fn)


def _bound_digest(values: list, members: frozenset) -> str:
    """The digest of a library callable's bound values: a module of the model by its class (its weights are in
    the fingerprint already, and accelerate binds each module to its own forward), anything else by value."""
    return ",".join(f"<member {type(v).__name__}>" if isinstance(v, nn.Module) and id(v) in members
                    else _repr_digest(v, set()) for v in values)


def _class_identity(cls: type) -> str:
    """A module's class: its qualified name; for a class of the user's own (and the user's classes it inherits
    from) every function it defines, by :func:`method_key`; for a library class, each function of the user's
    own set on it (a method monkeypatched on the class), by :func:`method_key`. (Libraries set functions on
    each other's classes too, transformers on torch's ``Module``: those are left out.)"""
    parts = [f"{cls.__module__}.{cls.__qualname__}"]
    for base in cls.__mro__:
        if base is object:
            continue
        library = _is_library_module(base.__module__)
        for name, value in sorted(vars(base).items()):
            # a static or class method, a property: the function inside
            inner = (value.__func__ if isinstance(value, (staticmethod, classmethod)) else
                     value.fget if isinstance(value, property) else value)
            if inspect.isfunction(inner) and not (library and _is_library_module(inner.__module__ or "")):
                if not getattr(inner, "cwcore_observer", False):
                    parts.append(f"{base.__qualname__}.{name}={method_key(inner)}")
            elif not library and not (name.startswith("__") and name.endswith("__")) and not inspect.isfunction(inner):
                # a user's class attribute (a gain read as self.GAIN): its value
                text = _setting_text(value)
                if text is None and isinstance(value, (torch.Tensor, np.ndarray)):
                    text = _repr_digest(value)
                if text is not None:
                    parts.append(f"{base.__qualname__}.{name}={text}")
    return ";".join(parts)


def _behaviour(model: nn.Module) -> str:
    """The code a forward runs, as far as the weights do not say it: each module's class (a module swapped for
    one of the user's classes), a public callable set on one module (``forward`` replaced), each forward hook
    and pre-hook, torch's global ones included, one per line (:func:`_code_identity`)."""
    import torch.nn.modules.module as torch_module

    lines, tables = [], [("<global>", kind, getattr(torch_module, "_global" + kind, {})) for kind in _FORWARD_HOOKS]
    classes: dict[type, str] = {}
    members = frozenset(id(module) for module in model.modules())
    for name, module in model.named_modules():
        if type(module) not in classes:
            classes[type(module)] = _class_identity(type(module))
        lines.append(f"{name}:{classes[type(module)]}")
        for key, value in sorted(vars(module).items()):
            if not key.startswith("_") and callable(value) and not isinstance(value, (nn.Module, type)):
                identity = _code_identity(value, members)
                if identity is not None:
                    lines.append(f"{name}.{key}={identity}")
        tables += [(name, kind, getattr(module, kind, {})) for kind in _FORWARD_HOOKS]
    for name, kind, table in tables:
        for hook in list(table.values()):
            identity = _code_identity(hook, members)
            if identity is not None:
                lines.append(f"{name}{kind}={identity}")
    return "\n".join(lines)


def _uncached(reason: str) -> str:
    """A fresh identity, with a warning that names ``reason``: results on the model are never served from the cache."""
    from .cache import never_cached_identity, warn_cache

    warn_cache(f"cwcore: results on this model are not cached: {reason}")
    return never_cached_identity()


def _offloaded_value(model: nn.Module, name: str) -> torch.Tensor | None:
    """The values accelerate keeps for the parameter or buffer ``name`` that sits on the ``meta`` device
    (:func:`cwcore.core.architectures.offloaded_value` of its module), else None."""
    from .core.architectures import offloaded_value

    prefix, _, local = name.rpartition(".")
    try:
        module = model.get_submodule(prefix) if prefix else model
    except AttributeError:
        return None
    return offloaded_value(module, local)


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 of the model: its class, configuration name, its settings (the configuration's fields and each
    module's plain attributes, e.g. a norm's epsilon: :func:`_settings`; not the train/eval mode), the code it
    runs besides its classes' own (forward hooks and pre-hooks, a replaced ``forward``, a module of the user's
    own class: :func:`_behaviour`) and every parameter's and buffer's name, shape, dtype and **every byte of
    its values**.

    Read every call (0.33 s for smollm2-135m in float32 on one core): an edit through ``param.data``
    does not move a tensor's version counter, so no digest is kept between calls. A tensor accelerate keeps
    on the ``meta`` device (offloaded to the CPU or to disk) is read from its hook's weights map. A model with a
    tensor on ``meta`` whose values cwcore cannot find, or a hook that reads a value with no stable identity,
    gets a fresh identity every call, with a :class:`~cwcore.cache.CacheWarning`: what is computed on it is
    never served from the cache."""
    under_way = _UNDER_WAY.__dict__.setdefault("models", set())
    if id(model) in under_way:  # a hook or a metric that reads the model being fingerprinted
        return "<the model itself>"
    under_way.add(id(model))
    try:
        digest = hashlib.sha256()
        config = getattr(model, "config", None)
        digest.update(type(model).__name__.encode())
        digest.update(str(getattr(config, "name_or_path", getattr(config, "_name_or_path", ""))).encode())
        digest.update(_settings(model).encode())
        try:
            digest.update(_behaviour(model).encode())
        except UncacheableMetric as err:
            return _uncached(f"code it runs beside its own (a hook, a replaced forward) reads a value whose state "
                             f"cwcore cannot fingerprint ({err})")
        with torch.no_grad():
            tensors = [("parameter", name, t) for name, t in model.named_parameters()]
            tensors += [("buffer", name, t) for name, t in model.named_buffers()]
            for kind, name, tensor in tensors:
                digest.update(f"{kind}:{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
                if tensor.device.type == "meta":
                    tensor = _offloaded_value(model, name)
                    if tensor is None:
                        return _uncached(f"{kind} {name} is on the meta device and no offloading hook holds its "
                                         "values")
                digest.update(_tensor_bytes(tensor))
        return digest.hexdigest()[:20]
    finally:
        under_way.discard(id(model))


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):  # bfloat16 too, as bytes (it has no numpy dtype)
        return f"{tuple(value.shape)}{value.dtype}".encode() + bytes(_tensor_bytes(value))
    if isinstance(value, np.ndarray):
        return f"{value.shape}{value.dtype}".encode() + np.ascontiguousarray(value).tobytes()
    return repr(value).encode()


def tensor_digest(*values: Any) -> str:
    """A content hash of tensors, arrays, or mappings of them (keys in sorted order), e.g. a batch."""
    digest = hashlib.sha256()
    for value in values:
        if isinstance(value, Mapping):
            for name in sorted(value):
                digest.update(str(name).encode())
                digest.update(_as_bytes(value[name]))
        else:
            digest.update(_as_bytes(value))
    return digest.hexdigest()[:20]


class UncacheableMetric(Exception):
    """A callable reads a value with no stable identity (an object whose ``repr`` is its address)."""


def _repr_digest(value: Any, seen: set | None = None) -> str:
    if isinstance(value, torch.Tensor):
        return tensor_digest(value.detach().cpu())
    if isinstance(value, np.ndarray):
        return tensor_digest(value)
    if isinstance(value, types.ModuleType):
        return f"<module {value.__name__}>"
    if isinstance(value, type):
        return _class_digest(value, seen if seen is not None else set())
    if isinstance(value, nn.Module):  # a model read by the metric: its weights, every byte
        return f"<module {type(value).__name__} {model_fingerprint(value)}>"
    if isinstance(value, functools.partial):  # its repr is the function's address: its parts instead
        return _partial_digest(value, seen if seen is not None else set())
    if callable(value) and hasattr(getattr(value, "__func__", value), "__code__"):
        return _method_digest(value, seen if seen is not None else set())
    if isinstance(value, (list, tuple)):
        return type(value).__name__ + "[" + ",".join(_repr_digest(v, seen) for v in value) + "]"
    if isinstance(value, (set, frozenset)):  # in a stable order (string hashes differ between processes)
        return type(value).__name__ + "{" + ",".join(sorted(_repr_digest(v, seen) for v in value)) + "}"
    if type(value).__module__.startswith("pandas") and hasattr(value, "to_numpy"):  # repr shows a few rows only
        rows = pd.util.hash_pandas_object(value, index=True).to_numpy()
        return f"<{type(value).__name__} {hashlib.sha256(rows.tobytes() + repr(list(getattr(value, 'columns', []))).encode()).hexdigest()}>"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_repr_digest(k, seen)}:{_repr_digest(v, seen)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):  # field by field: its repr elides a large tensor's values with "..."
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return f"{type(value).__qualname__}(" + _repr_digest(fields, seen) + ")"
    text = repr(value)
    if " at 0x" in text:  # the default object repr: its address, not its state
        raise UncacheableMetric(f"{type(value).__name__} has no stable identity ({text[:60]})")
    if "..." in text and not isinstance(value, (str, bytes)):  # a summary, not the values (a large array's repr)
        raise UncacheableMetric(f"{type(value).__name__}'s repr elides its values ({text[:60]})")
    return text


#: packages whose functions a metric's identity takes by name and code only (their globals are not read)
_LIBRARY_PACKAGES = ("cwcore", "torch", "numpy", "transformers")


def _class_digest(cls: type, seen: set) -> str:
    """A class's identity: its name and, for a user's class, what its own classes (the library's and builtins'
    left out) hold: every attribute's value and every method's code, so a setting read as ``Settings.SCALE``
    or through ``self`` (an ablation's or a steering hook's gain) is in the key."""
    name = f"<class {cls.__module__}.{cls.__qualname__}"

    def users(klass) -> bool:  # not the library's, nor an installed package's (accelerate's hooks, peft's layers)
        module = getattr(klass, "__module__", "") or ""
        where = str(getattr(sys.modules.get(module), "__file__", "") or "")
        return (klass is not object and module != "builtins" and not _in_packages(module)
                and "site-packages" not in where and "dist-packages" not in where)

    if not users(cls) or id(cls) in seen:
        return name + ">"
    seen.add(id(cls))
    parts = []
    for klass in filter(users, cls.__mro__):
        for key, value in sorted(vars(klass).items()):
            if key.startswith("__") and key.endswith("__"):
                continue
            inner = getattr(value, "__func__", getattr(value, "fget", value))
            code = getattr(inner, "__code__", None)
            shown = _code_digest(code)[:16] if code is not None else _repr_digest(value, seen)
            parts.append(f"{klass.__qualname__}.{key}={shown}")
    return f"{name} {';'.join(parts)}>"


def _code_digest(code) -> str:
    """A code object's identity by content: its bytecode, names and constants, nested code objects (a lambda, a
    comprehension) by their own content; their repr holds an address, new in every process."""
    consts = [_code_digest(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return hashlib.sha256(code.co_code + repr(code.co_names).encode() + repr(consts).encode()).hexdigest()


def _names_read(target) -> set:
    """Every name a function's code reads: globals and attribute names, nested functions' included."""
    names, stack = set(), [target.__code__]
    while stack:  # nested functions and comprehensions have code objects of their own
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if hasattr(c, "co_names"))
    return names


def _globals_read(target) -> dict:
    """The module-level values a function's code names (its globals and builtins are resolved as the
    function would), the attributes it reads from them included through the values themselves."""
    module_globals = getattr(target, "__globals__", {})
    return {name: module_globals[name] for name in sorted(_names_read(target)) if name in module_globals}


@functools.lru_cache(maxsize=1)
def _installed_folders() -> tuple[str, ...]:
    """The standard library's and the installed packages' folders, resolved, each ending in ``/`` (read once)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple({str(Path(paths[key]).resolve()) + "/" for key in ("stdlib", "platstdlib", "purelib", "platlib")})


def _is_users_module(module) -> bool:
    """A module of the user's own (a file outside the standard library and the installed packages), whose
    values a metric may read as ``module.NAME``."""
    return bool(getattr(module, "__file__", None)) and not _is_library_module(module.__name__)


def _module_values_read(module, names: set, seen: set) -> str:
    """The digest of the values of a user's ``module`` that a function reads as ``module.<name>``
    (``names``: every name its code reads); a library module is its name only."""
    if id(module) in seen or not _is_users_module(module):
        return f"<module {module.__name__}>"
    seen.add(id(module))
    parts = [f"<module {module.__name__}>"]
    for name in sorted(names):
        if name in vars(module):
            value = vars(module)[name]
            parts.append(name + "=" + (_module_values_read(value, names, seen) if isinstance(value, types.ModuleType)
                                       else _repr_digest(value, seen)))
    return ";".join(parts)


def _method_digest(fn: Callable, seen: set) -> str:
    target = getattr(fn, "__func__", fn)
    if id(target) in seen:
        return f"<recursive {getattr(target, '__qualname__', '')}>"
    seen.add(id(target))
    code = target.__code__
    digest = hashlib.sha256(f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}".encode())
    try:
        digest.update(inspect.getsource(target).encode())
    except (OSError, TypeError):
        pass
    digest.update(_code_digest(code).encode())
    for value in (target.__defaults__ or ()) + tuple((target.__kwdefaults__ or {}).items()):
        digest.update(_repr_digest(value, seen).encode())
    for cell in target.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            digest.update(b"<empty>")
            continue
        digest.update(_repr_digest(contents, seen).encode())
    module = getattr(target, "__module__", "") or ""
    if not _in_packages(module):  # a user's code: what it reads too
        names = _names_read(target)
        for name in sorted(names - set(getattr(target, "__globals__", {}))):  # `import settings` inside the function
            imported = sys.modules.get(name)
            if isinstance(imported, types.ModuleType) and _is_users_module(imported):
                digest.update(_module_values_read(imported, names, seen).encode())
        for name, value in _globals_read(target).items():
            digest.update(name.encode())
            if isinstance(value, types.ModuleType):  # a value read through it: `settings.THRESHOLD`
                digest.update(_module_values_read(value, names, seen).encode())
            else:
                digest.update(_repr_digest(value, seen).encode())
    if hasattr(fn, "__self__"):
        owner = fn.__self__
        digest.update(_repr_digest(getattr(owner, "__dict__", owner), seen).encode())
        if not isinstance(owner, (type, types.ModuleType)):  # what it reads through self from its class
            digest.update(_class_digest(type(owner), seen).encode())
    return digest.hexdigest()


def _partial_digest(fn: functools.partial, seen: set) -> str:
    """A :func:`functools.partial`'s identity: its function's and every bound argument's."""
    func = fn.func
    inner = (_partial_digest(func, seen) if isinstance(func, functools.partial) else
             _method_digest(func, seen) if hasattr(getattr(func, "__func__", func), "__code__") else method_key(func))
    return f"partial({inner};{_repr_digest(list(fn.args), seen)};{_repr_digest(dict(sorted(fn.keywords.items())), seen)})"


def _slot_values(obj) -> dict:
    """The values an object keeps in ``__slots__`` (its classes' and their bases'), by name; unset ones left out."""
    values = {}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in values and hasattr(obj, slot):
                values[slot] = getattr(obj, slot)
    return values


def method_key(fn: Callable) -> str:
    """The identity of a callable, ``<qualified name>-<hash>``: its code, constants, defaults, closure and
    the module-level names it reads, recursively (a global threshold, a helper's code, a tensor's bytes,
    a value of the user's own module read as ``settings.THRESHOLD``),
    so a curve cached for one value of a global is never served after it changes. A value with no stable
    identity (``repr`` its address) raises :class:`UncacheableMetric`."""
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(fn).__name__)}"
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    digest = hashlib.sha256(name.encode())
    if isinstance(fn, functools.partial):  # the bound arguments too (they are not in the partial's __dict__)
        digest.update(_partial_digest(fn, set()).encode())
        return f"{name}-{digest.hexdigest()[:16]}"
    if code is None:  # a callable object: its class's source and its attributes
        target = type(fn)
        try:
            digest.update(inspect.getsource(target).encode())
        except (OSError, TypeError):
            digest.update(repr(vars(target)).encode())
        digest.update(_repr_digest(getattr(fn, "__dict__", {})).encode())
        slots = _slot_values(fn)
        if slots:  # attributes kept in __slots__ (a dataclass(slots=True)) are not in __dict__
            digest.update(_repr_digest(slots).encode())
        call = getattr(type(fn), "__call__", None)
        if call is not None and hasattr(call, "__code__"):
            digest.update(_method_digest(call, set()).encode())
        return f"{name}-{digest.hexdigest()[:16]}"
    digest.update(_method_digest(fn, set()).encode())
    return f"{name}-{digest.hexdigest()[:16]}"
