"""The run driver every experiment uses: one model identity, content-named batches, cached pieces.

A long experiment is a loop over batches; each batch's results are a few DataFrames. The driver
names each batch by its content (:func:`tensor_digest`), reads the batch's pieces back from the
result cache when a complete set exists, computes and stores them otherwise (the parts first, a
``.done`` marker last, each file atomically), and shows one progress bar. An interrupted run
therefore resumes where it stopped, and a longer run over the same first batches reuses them.

:func:`model_fingerprint` is the model's identity in every cache key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import pandas as pd
import torch
from torch import nn

from .cache import ResultCache
from .core.inputs import InputError, InputTypeError, check_batch_size, check_count, check_inputs  # the counts: one home, the core's inputs

__all__ = ["PieceStore", "check_batch_size", "check_count", "check_token_blocks", "for_each_batch",
           "model_fingerprint", "progress", "tensor_digest"]

_SAMPLES_PER_PARAMETER = 4096


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model: its class, configuration name and, for every parameter and buffer-free
    weight, its name, shape, dtype and a strided sample of its values (about 4k per parameter).

    Two models with different weights never share cached results. Parameters that accelerate keeps on
    the ``meta`` device (offloaded to disk or CPU) contribute their name, shape and dtype only, so an
    offloaded model has one stable identity.
    """
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    digest.update(type(model).__name__.encode())
    digest.update(str(getattr(config, "name_or_path", getattr(config, "_name_or_path", ""))).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            if param.device.type == "meta":
                continue
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_PARAMETER)
            digest.update(flat[::step].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:20]


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return f"{tuple(t.shape)}{t.dtype}".encode() + t.numpy().tobytes()
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


def check_token_blocks(input_ids, model: nn.Module | None = None, *, argument: str = "input_ids",
                       caller: str = "the experiment") -> torch.Tensor:
    """Token blocks an experiment runs on, as a ``[sequence, token]`` integer tensor: at least one
    sequence of at least one token, inside ``model``'s vocabulary and context when a model is given
    (through :func:`cwcore.core.inputs.check_inputs`, so the sentences are the core's)."""
    if model is not None:
        return check_inputs(model, {"input_ids": input_ids}, caller=caller)["input_ids"]
    ids = torch.as_tensor(input_ids)
    if ids.ndim != 2 or ids.numel() == 0:
        raise InputError(f"{caller}: {argument} must be a non-empty [sequence, token] block, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise InputTypeError(f"{caller}: {argument} must hold integer token ids, got {ids.dtype}")
    return ids


class PieceStore:
    """The cached pieces of one run (a :class:`cwcore.cache.ResultCache` folder).

    ``parameters`` are every option that changes the result; ``model`` adds :func:`model_fingerprint`;
    ``code`` names the producing module or subpackage (``"faithfulness"``, ``"sinks"``, ``"analysis"``)
    whose source, with the core's, is part of the key. ``cache=False`` (or ``$CWCORE_NO_CACHE=1``)
    stores nothing. Every piece is read through :class:`cwcore.cache.ResultCache`, which verifies its
    checksum: a damaged part makes its batch incomplete, so the batch is computed again.
    """

    def __init__(self, namespace: str, parameters: Mapping, *, model: nn.Module | None = None,
                 code: str | tuple | list | None = None, cache: bool = True, cache_root: str | Path | None = None):
        parameters = dict(parameters)
        if model is not None:
            parameters["model"] = model_fingerprint(model)
        self.namespace = namespace
        self.cache = ResultCache(namespace, parameters, root=None if cache_root is None else Path(cache_root),
                                 enabled=bool(cache), code=code)

    @property
    def parameters(self) -> dict:
        return self.cache.parameters

    @property
    def directory(self) -> Path:
        return self.cache.directory

    def get(self, piece: str) -> pd.DataFrame | None:
        """One stored piece, or None."""
        return self.cache.get(piece)

    def put(self, piece: str, frame: pd.DataFrame) -> None:
        self.cache.put(piece, frame)

    def get_group(self, key: str) -> dict[str, pd.DataFrame] | None:
        """The parts stored under ``key`` by :meth:`put_group`, or None unless all of them are complete."""
        index = self.cache.get(f"{key}.done")  # written last: the batch's parts are complete
        if index is None:
            return None
        frames = {part: self.cache.get(f"{key}.{part}") for part in index["part"]}
        return None if any(f is None for f in frames.values()) else frames

    def put_group(self, key: str, frames: Mapping[str, pd.DataFrame]) -> None:
        """Store ``frames`` under ``key``: every part, then the ``.done`` marker that lists them."""
        for part, frame in frames.items():
            self.cache.put(f"{key}.{part}", frame)
        self.cache.put(f"{key}.done", pd.DataFrame({"part": list(frames)}))


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass


def progress(total: int | None, desc: str, unit: str = "batch", enabled: bool = True, **kwargs):
    """A tqdm progress bar (notebook or terminal, :mod:`tqdm.auto`), or a silent stand-in."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, **kwargs)


def for_each_batch(
    batches: Iterable[Any],
    compute: Callable[[Any], Mapping[str, pd.DataFrame]],
    store: PieceStore,
    *,
    key: Callable[[Any], str] = tensor_digest,
    desc: str = "",
    total: int | None = None,
    show_progress: bool = True,
) -> Iterator[tuple[Any, dict[str, pd.DataFrame]]]:
    """For each batch, ``(batch, frames)``: read from ``store`` under ``key(batch)`` when complete,
    otherwise ``compute(batch)`` (a dict of DataFrames) and stored. One progress bar over the batches."""
    if total is None and hasattr(batches, "__len__"):
        total = len(batches)
    bar = progress(total, desc or store.namespace, "batch", show_progress)
    try:
        for batch in batches:
            name = key(batch)
            frames = store.get_group(name)
            if frames is None:
                frames = dict(compute(batch))
                store.put_group(name, frames)
            bar.update(1)
            yield batch, frames
    finally:
        bar.close()
