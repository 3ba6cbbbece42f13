"""The command line: all sink analyses on a named model and data set, written as small CSVs::

    python -m cwcore.sinks --model smollm2-135m --data gsm8k --num-sequences 32 --out data/results/

samples one block per document (``--sampling documents``, as the book does; ``--sampling stream`` cuts
consecutive blocks in data-set order, as the tables before issue 12 were made) and
writes ``sinks_<table>_<model>_<data>.csv`` (the registered analyses' stems) plus
``sinks_summary_<model>_<data>.csv`` (:func:`cwcore.sinks.summarize`).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Iterable

import numpy as np
import pandas as pd
import torch

from ..cache import atomic_write_bytes, write_csv
from ..core.inputs import check_batch_size, check_count
from .analyses import ANALYSES, REGISTRY, SinkOptions
from .engine import Blocks, collect
from .summary import summarize

__all__ = ["main"]

_DESCRIPTION = "The value geometry of attention sinks (PAPER.md section 6), as five analyses returning tidy tables."


def _round(frame: pd.DataFrame, digits: int = 6) -> pd.DataFrame:
    floats = frame.select_dtypes("floating").columns
    return frame.assign(**{c: frame[c].astype(float).round(digits) for c in floats})


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _save_raw(folder: Path, parts: dict, blocks: Blocks, sampling: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, frames in parts.items():  # every file atomically: a full disk leaves no partial file
        for part, frame in frames.items():
            atomic_write_bytes(folder / f"{name}.{part}.parquet", frame.to_parquet(index=False))
    atomic_write_bytes(folder / "ids.npy", _npy(blocks.ids.numpy()))
    if blocks.classes is not None:
        atomic_write_bytes(folder / "classes.npy", _npy(blocks.classes))
    meta = {"add_bos": blocks.add_bos, "first_token_is_bos": blocks.first_token_is_bos, "sampling": sampling}
    atomic_write_bytes(folder / "blocks.json", json.dumps(meta).encode())


def _load_raw(folder: Path, analyses: list[str]) -> tuple[dict, Blocks]:
    if not (folder / "blocks.json").is_file():
        raise FileNotFoundError(f"--from-raw: no raw material in {folder} (write it first with --raw, without --from-raw)")
    meta = json.loads((folder / "blocks.json").read_text())
    classes = np.load(folder / "classes.npy") if (folder / "classes.npy").is_file() else None
    blocks = Blocks(torch.from_numpy(np.load(folder / "ids.npy")), meta["add_bos"], meta["first_token_is_bos"],
                     classes)
    parts = {}
    for name in analyses:
        files = sorted(folder.glob(f"{name}.*.parquet"))
        if not files:
            raise FileNotFoundError(f"no raw material for {name} in {folder}")
        parts[name] = {f.name[len(name) + 1 : -len(".parquet")]: pd.read_parquet(f) for f in files}
    return parts, blocks


def _add_options(parser: argparse.ArgumentParser) -> None:
    """One flag per option of :class:`SinkOptions` that has one (``--eps``, ``--heads``, ...), its default
    and help from the option's declaration; ``--cone-heads`` is the older name of ``--heads``."""
    for name, option in SinkOptions.OPTIONS.items():
        if not option.cli:
            continue
        flags = [f"--{name.replace('_', '-')}"] + (["--cone-heads"] if name == "heads" else [])
        kind = {bool: None, int: int, float: float, str: str}.get(type(option.default), str)
        parser.add_argument(*flags, dest=name, default=option.default, type=kind, choices=option.choices,
                            help=f"{option.help} (default {option.default!r})")


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m cwcore.sinks --model NAME --data NAME --num-sequences N --out DIR``; returns the exit
    status: 0, 2 for bad input (one line on stderr), 1 for a bug (``--debug``: the traceback)."""
    from ..cli import debug_requested, run_command

    argv = list(argv) if argv is not None else None
    return run_command("python -m cwcore.sinks", lambda: _main(argv), debug_requested(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwcore.sinks", description=_DESCRIPTION)
    parser.add_argument("--model", required=True, help="a name cwcore.models.load_model knows, e.g. smollm2-135m")
    parser.add_argument("--data", required=True, help="a data set cwcore.data.load_dataset knows, e.g. gsm8k, web-text")
    parser.add_argument("--num-sequences", type=int, default=32, help="documents (or stream blocks) to analyse")
    parser.add_argument("--sampling", choices=("documents", "stream"), default="documents",
                        help="documents (default): the first block of each of N documents drawn with the seed, as "
                             "the book does (cwcore.data.document_blocks); stream: consecutive blocks of the "
                             "concatenated texts in data-set order (cwcore.data.lm_blocks, the tables before issue 12)")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--add-bos", choices=("default", "yes", "no"), default="default")
    parser.add_argument("--analyses", default=",".join(ANALYSES), help=f"comma-separated subset of {','.join(ANALYSES)}")
    _add_options(parser)
    parser.add_argument("--no-cache", action="store_true")
    parser.add_argument("--out", default="data/results/")
    parser.add_argument("--raw", default=None,
                        help="also keep the raw per-batch material under RAW/<model>_<data>/ (parquet), independent "
                             "of the code version, so the tables can be rebuilt with --from-raw")
    parser.add_argument("--from-raw", action="store_true", help="rebuild the tables from --raw without running the model")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    args = parser.parse_args(argv)
    check_batch_size(args.batch_size)
    check_count(args.num_sequences, "--num-sequences")
    check_count(args.block_size, "--block-size", minimum=2)
    try:  # the analyses' options, checked by SinkOptions (an eps of 1.5 is refused here, with its reason)
        checked = SinkOptions(**{name: getattr(args, name) for name, o in SinkOptions.OPTIONS.items() if o.cli})
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    options = {name: getattr(checked, name) for name, o in SinkOptions.OPTIONS.items() if o.cli}
    wanted = [a.strip() for a in args.analyses.split(",") if a.strip()]
    unknown = sorted(set(wanted) - set(ANALYSES))
    if unknown:
        parser.error(f"unknown analyses: {', '.join(unknown)}")

    from ..data import load_dataset
    from ..models import load_model

    suffix = f"{args.model}_{args.data}"
    raw = Path(args.raw) / suffix if args.raw else None
    if args.from_raw:
        if raw is None:
            parser.error("--from-raw needs --raw")
        parts, blocks = _load_raw(raw, wanted)
    else:
        torch.manual_seed(args.seed)
        model, tokenizer = load_model(args.model)
        dataset = load_dataset(args.data)
        add_bos = {"default": None, "yes": True, "no": False}[args.add_bos]
        if args.sampling == "documents":  # independent units: one block per document (intervals over documents)
            from ..data import document_blocks

            dataset = document_blocks(dataset, tokenizer, args.block_size, args.num_sequences, seed=args.seed,
                                      add_bos=add_bos)
            add_bos = None  # applied: the blocks are tokenised
        parts, blocks = collect(model, tokenizer, dataset, [REGISTRY[a].spec(options) for a in wanted],
                                block_size=args.block_size,
                                num_sequences=args.num_sequences, add_bos=add_bos, batch_size=args.batch_size,
                                cache=not args.no_cache, progress=True)
        if raw is not None:
            _save_raw(raw, parts, blocks, args.sampling)
    tables: dict[str, pd.DataFrame] = {}
    for name in wanted:
        tables.update(REGISTRY[name].named_tables(REGISTRY[name].tables(parts[name], blocks, **options)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for stem, table in tables.items():
        frame = table.copy()
        frame.insert(0, "data", args.data)
        frame.insert(0, "model", args.model)
        write_csv(_round(frame), out / f"sinks_{stem}_{suffix}.csv", index=False)
    summary = summarize(tables)
    summary.insert(0, "data", args.data)
    summary.insert(0, "model", args.model)
    summary["add_bos"] = blocks.add_bos
    summary["num_sequences"] = int(blocks.ids.shape[0])
    summary["sampling"] = (json.loads((raw / "blocks.json").read_text()).get("sampling", "stream")  # older raw: stream
                           if args.from_raw else args.sampling)
    write_csv(_round(summary), out / f"sinks_summary_{suffix}.csv", index=False)
    print(summary.to_string(index=False), file=sys.stdout)
    return 0
