"""The command line: all sink analyses on a named model and data set, written as small CSVs::

    python -m cwcore.sinks --model smollm2-135m --data gsm8k --num-sequences 32 --out my-results/

One block per document (``--sampling documents``; ``stream``: consecutive blocks), written as
``sinks_<table>_<model>_<data>.csv`` plus ``sinks_summary_<model>_<data>.csv`` into ``--out``
(default ``./cwcore-results/``). Arguments are checked before the model loads; ``--help`` needs no torch."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Iterable

__all__ = ["main", "DEFAULT_OUT", "CLI_OPTIONS"]

_DESCRIPTION = ("The value geometry of attention sinks (the paper's section 'Value geometry of attention sinks'), "
                "as five analyses returning tidy tables.")
from ..provenance import RESULTS_FOLDER as DEFAULT_OUT  # ./cwcore-results/: never a repository's committed data
from ..cli import (ArgumentParser, UsageError, add_model_options, check_block_size, debug_requested, given_flags,
                   loading_bar, run_command, sampled_blocks)
from ..provenance import confined, output_folder
#: run flags the raw material records, compared with it under --from-raw
_RECORDED = ("block_size", "sampling", "num_sequences", "add_bos")
ANALYSIS_NAMES = ("rates", "decomposition", "anti_alignment", "convexity", "semantic_cone")
#: the flags of :class:`cwcore.sinks.SinkOptions`' command-line options (``name: (default, help, choices)``),
#: declared here so that ``--help`` needs no torch; a test checks them against ``SinkOptions.OPTIONS``
CLI_OPTIONS = {
    "eps": (0.3, "sink heads: a sink rate (mean alpha_i0 over queries >= 1) above eps", None),
    "kind": ("intra", "contribution weights within the head (intra) or of the layer's output (inter)", ("intra", "inter")),
    "quantile_sample": (128, "(query, key) pairs kept per sequence, head and token class", None),
    "sample_size": (2000, "pairs per token class in the decomposition's sample table", None),
    "seed": (0, "seed of every random choice", None),
    "bins": (10, "equal-width bins of the sink rate in the convexity curves", None),
    "fit_on": ("norm", "the convexity fits' y: the output norm or its square", ("norm", "squared_norm")),
    "min_range": (0.05, "heads whose sink rates span less (q95 - q05) are not fitted", None),
    "heads": ("all", "semantic-cone interventions in all heads, or only in sink heads (rate above threshold)", ("all", "sink")),
    "threshold": (0.3, "heads='sink': a head's sink rate in the sequence above this", None),
    "quantiles": (5, "bins of the clean output norm (bin 1: the lowest-norm outputs)", None),
}


def file_name(name: str) -> str:
    """A model or data-set name as one file-name component: ``org/name``, a local path or ``../x`` become
    letters, digits and dashes (:func:`cwcore.provenance.slug`), so no output nests folders or leaves ``--out``."""
    from ..provenance import slug

    return slug(name)


def _round(frame, digits: int = 6):
    floats = frame.select_dtypes("floating").columns
    return frame.assign(**{c: frame[c].astype(float).round(digits) for c in floats})


def _npy(array) -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _save_raw(folder: Path, parts: dict, blocks, sampling: str, dtype: str, run: dict) -> None:
    """The raw material of one run, in place of any earlier run's: written into a new folder that then replaces
    ``folder`` whole, so a killed run leaves the earlier material (or none), never a mixture of the two.
    ``run``: the analyses and the options that shaped the material, which --from-raw holds to."""
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        for name, frames in parts.items():
            for part, frame in frames.items():
                (new / f"{name}.{part}.parquet").write_bytes(frame.to_parquet(index=False))
        (new / "ids.npy").write_bytes(_npy(blocks.ids.numpy()))
        if blocks.classes is not None:
            (new / "classes.npy").write_bytes(_npy(blocks.classes))
        meta = {"add_bos": blocks.add_bos, "first_token_is_bos": blocks.first_token_is_bos, "sampling": sampling,
                "dtype": dtype, "run": run}
        (new / "blocks.json").write_text(json.dumps(meta))
        old = folder.with_name(f".{folder.name}.old-{new.name[-8:]}")
        if folder.exists():
            folder.rename(old)
        new.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(new, ignore_errors=True)  # gone already unless the run failed before the swap


def _refuse_another_run(args, given: set[str], blocks, recorded: dict, folder: Path) -> None:
    """--from-raw rebuilds the run the raw material in ``folder`` records (``recorded``: its ``sampling``,
    ``dtype`` and ``run``): a flag given that describes another run (other blocks, another sampling, fewer
    sequences, another dtype, BOS or collector option, an analysis it did not run) is refused rather than
    ignored; the same command with --from-raw appended passes."""
    n, length = blocks.ids.shape
    run = recorded.get("run") or {}
    for name, value in run.get("options", {}).items():
        if name in given and getattr(args, name) != value:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {getattr(args, name)}, but the raw material in {folder} was collected with "
                             f"{flag} {value}: give that run's {flag}, or leave it out")
    if "add_bos" in given and "add_bos" in run and args.add_bos != run["add_bos"]:
        raise UsageError(f"--add-bos {args.add_bos}, but the raw material in {folder} was made with --add-bos "
                         f"{run['add_bos']}: give that run's --add-bos, or leave it out")
    if args.dtype is not None and _dtype_name(args.dtype) != recorded["dtype"]:
        raise UsageError(f"--dtype {args.dtype}, but the raw material in {folder} was computed in {recorded['dtype']}: "
                         "give that run's --dtype, or leave it out")
    sampling = recorded["sampling"]
    if "block_size" in given and args.block_size != length:
        raise UsageError(f"--block-size {args.block_size}, but the raw material in {folder} holds blocks of {length} "
                         "tokens: give that run's --block-size, or leave it out")
    if "sampling" in given and args.sampling != sampling:
        raise UsageError(f"--sampling {args.sampling}, but the raw material in {folder} was sampled as {sampling}: "
                         "give that run's --sampling, or leave it out")
    asked = run.get("num_sequences")  # what that run asked for (older material: at least the sequences it holds)
    if "num_sequences" in given and asked is not None and args.num_sequences != asked:
        raise UsageError(f"--num-sequences {args.num_sequences}, but the raw material in {folder} was made with "
                         f"--num-sequences {asked}: give that run's --num-sequences, or leave it out")
    if "num_sequences" in given and args.num_sequences < n:  # more is the same run: fewer were available
        raise UsageError(f"--num-sequences {args.num_sequences}, but the raw material in {folder} holds {n} sequences: "
                         "give that run's --num-sequences, or leave it out")


def _dtype_name(dtype: str | None) -> str:
    """The model's dtype as a name (``bfloat16`` for ``bf16``; None: ``float32``)."""
    from ..models import resolve_dtype

    return str(resolve_dtype(dtype)).removeprefix("torch.")


def _load_raw(folder: Path, analyses: list[str]) -> tuple:
    """``(parts, blocks, {"sampling": ..., "dtype": ...})`` of the raw material in ``folder``."""
    import numpy as np
    import pandas as pd
    import torch

    from .engine import Blocks

    if not (folder / "blocks.json").is_file():
        raise FileNotFoundError(f"--from-raw: no raw material in {folder} (write it first with --raw, without --from-raw)")
    meta = json.loads((folder / "blocks.json").read_text())
    classes = np.load(folder / "classes.npy") if (folder / "classes.npy").is_file() else None
    blocks = Blocks(torch.from_numpy(np.load(folder / "ids.npy")), meta["add_bos"], meta["first_token_is_bos"],
                     classes)
    ran = (meta.get("run") or {}).get("analyses")
    if ran is not None and set(analyses) - set(ran):
        raise FileNotFoundError(f"--from-raw: the raw material in {folder} holds {', '.join(ran)}, not "
                                f"{', '.join(sorted(set(analyses) - set(ran)))}: rerun them with --raw")
    parts = {}
    for name in analyses:
        files = sorted(folder.glob(f"{name}.*.parquet"))
        if not files:
            raise FileNotFoundError(f"no raw material for {name} in {folder}")
        parts[name] = {f.name[len(name) + 1 : -len(".parquet")]: pd.read_parquet(f) for f in files}
    # older raw material: stream sampling; float32, the only dtype of the command line before --dtype
    return parts, blocks, {"sampling": meta.get("sampling", "stream"), "dtype": meta.get("dtype", "float32"),
                           "run": meta.get("run")}


def _add_options(parser: argparse.ArgumentParser) -> None:
    """One flag per command-line option of :class:`SinkOptions` (``--eps``, ``--heads``, ...,
    :data:`CLI_OPTIONS`); ``--cone-heads`` is the older name of ``--heads``."""
    for name, (default, text, choices) in CLI_OPTIONS.items():
        flags = [f"--{name.replace('_', '-')}"] + (["--cone-heads"] if name == "heads" else [])
        kind = {bool: None, int: int, float: float, str: str}.get(type(default), str)
        parser.add_argument(*flags, dest=name, default=default, type=kind, choices=choices,
                            help=f"{text} (default {default!r})")


def main(argv: Iterable[str] | None = None) -> int:
    """``python -m cwcore.sinks --model NAME --data NAME --num-sequences N --out DIR``; returns the exit
    status: 0, 2 for bad input (one line on stderr), 1 for a bug (``--debug``: the traceback)."""
    argv = list(argv) if argv is not None else None
    return run_command("python -m cwcore.sinks", lambda: _main(argv), debug_requested(argv))


def parser() -> argparse.ArgumentParser:
    """The command line's parser (standard library only: ``--help`` answers at once)."""
    parser = ArgumentParser(prog="python -m cwcore.sinks", description=_DESCRIPTION)
    parser.add_argument("--model", required=True, help="a name cwcore.models.load_model knows, e.g. smollm2-135m")
    parser.add_argument("--data", required=True, help="a data set cwcore.data.load_dataset knows, e.g. gsm8k, web-text")
    parser.add_argument("--num-sequences", type=int, default=32, help="documents (or stream blocks) to analyse")
    parser.add_argument("--sampling", choices=("documents", "stream"), default="documents",
                        help="documents (default): the first block of each of N documents drawn with the seed, as "
                             "the book does (cwcore.data.document_blocks); stream: consecutive blocks of the "
                             "concatenated texts in data-set order (cwcore.data.lm_blocks)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default %(default)s)")
    add_model_options(parser)
    parser.add_argument("--add-bos", choices=("default", "yes", "no"), default="default",
                        help="start every sequence with the tokenizer's BOS token: yes, no, or as the tokenizer "
                             "itself does (default)")
    parser.add_argument("--analyses", default=",".join(ANALYSIS_NAMES),
                        help=f"comma-separated subset of {','.join(ANALYSIS_NAMES)}")
    _add_options(parser)
    parser.add_argument("--no-cache", action="store_true", help="run without the result cache (or CWCORE_NO_CACHE=1)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder of the tables (default ./{DEFAULT_OUT}/ in the working folder)")
    parser.add_argument("--raw", default=None,
                        help="also keep the raw per-batch material under RAW/<model>_<data>/ (parquet), independent "
                             "of the code version, so the tables can be rebuilt with --from-raw")
    parser.add_argument("--from-raw", action="store_true", help="rebuild the tables from --raw without running the model")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    return parser


def _main(argv: list[str] | None) -> int:
    parser_ = parser()
    args = parser_.parse_args(argv)
    from ..core.inputs import check_batch_size, check_count

    check_batch_size(args.batch_size)
    check_count(args.num_sequences, "--num-sequences")
    check_count(args.block_size, "--block-size", minimum=2)
    out = output_folder(args.out)
    suffix = f"{file_name(args.model)}_{file_name(args.data)}"
    raw = confined(Path(args.raw).expanduser(), suffix) if args.raw else None
    if raw is not None and raw.exists() and not raw.is_dir():
        raise ValueError(f"--raw {args.raw}: {raw} is a file")
    if args.from_raw and raw is None:
        raise UsageError("--from-raw needs --raw")
    if args.from_raw:  # no model runs: these were read by nothing (--device cuda passed on a CPU-only torch)
        unread = sorted(given_flags(parser(), argv, ("device", "batch_size", "no_cache")))
        if unread:
            raise UsageError(f"{', '.join('--' + name.replace('_', '-') for name in unread)} "
                             f"{'applies' if len(unread) == 1 else 'apply'} to running the model, which --from-raw "
                             "does not: leave it out")
    import pandas as pd
    import torch

    from ..cache import write_csv
    from .analyses import ANALYSES, REGISTRY, SinkOptions
    from .engine import refuse_unread
    from .engine import collect
    from .summary import summarize

    try:  # the analyses' options, checked by SinkOptions (an eps of 1.5 is refused here, with its reason)
        checked = SinkOptions(**{name: getattr(args, name) for name, o in SinkOptions.OPTIONS.items() if o.cli})
    except (TypeError, ValueError) as error:
        raise UsageError(str(error))
    options = {name: getattr(checked, name) for name, o in SinkOptions.OPTIONS.items() if o.cli}
    wanted = [a.strip() for a in args.analyses.split(",") if a.strip()]
    if not wanted:  # before: nothing ran, and a summary of a header only was written
        raise UsageError(f"--analyses names none: give one or more of {','.join(ANALYSIS_NAMES)}")
    unknown = sorted(set(wanted) - set(ANALYSES))
    if unknown:
        raise UsageError(f"unknown analyses: {', '.join(unknown)}")
    # an option flag given for analyses that do not run is refused, not silently dropped
    given_run = given_flags(parser(), argv, (*CLI_OPTIONS, *_RECORDED))
    given = [name for name in CLI_OPTIONS if name in given_run]
    takers = {name: [a for a in ANALYSES if name in {o.name for o in REGISTRY[a].options}] for name in given}
    for name in given:
        if name == "seed" and args.sampling == "documents":  # it draws the documents every analysis reads
            continue
        if not set(takers[name]) & set(wanted):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} applies to {', '.join(takers[name])}, which --analyses {','.join(wanted)} does "
                             f"not run: add it, or leave {flag} out")
    for name in wanted:  # and one its settings leave unread (--threshold without --heads sink)
        try:
            refuse_unread(REGISTRY[name], given, options, flags=True)
        except ValueError as error:
            raise UsageError(str(error))

    from ..data import load_dataset, missing_local_file
    from ..models import load_model

    if not args.from_raw and missing_local_file(args.data):  # before the model loads (it was found after)
        raise UsageError(f"--data {args.data}: no such file")

    applied_bos = None  # the blocks come tokenised, with the BOS the command line asked for
    if args.from_raw:
        parts, blocks, recorded = _load_raw(raw, wanted)
        _refuse_another_run(args, given_run & {*_RECORDED, *CLI_OPTIONS}, blocks, recorded, raw)
        sampling, dtype = recorded["sampling"], recorded["dtype"]
        options.update((recorded.get("run") or {}).get("options", {}))  # what the material was collected with
    else:
        sampling, dtype = args.sampling, _dtype_name(args.dtype)
        torch.manual_seed(args.seed)
        with loading_bar(not args.no_progress):
            model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
        dataset = load_dataset(args.data)
        check_block_size(args.block_size, model)  # after the data set's name is checked
        add_bos = {"default": None, "yes": True, "no": False}[args.add_bos]
        from ..data import _resolve_bos, document_blocks, lm_blocks

        if args.sampling == "documents":  # independent units: one block per document (intervals over documents)
            make = functools.partial(document_blocks, dataset, tokenizer, args.block_size, args.num_sequences,
                                     seed=args.seed, add_bos=add_bos)
        else:  # consecutive blocks of the texts, as the analyses cut them, made here to refuse too few in one line
            make = functools.partial(lm_blocks, dataset, tokenizer, block_size=args.block_size,
                                     num_blocks=args.num_sequences, add_bos=add_bos)
        dataset = sampled_blocks(make, args.block_size, args.data, args.sampling == "documents")
        applied_bos = _resolve_bos(tokenizer, add_bos) is not None  # what the summary records
        add_bos = None  # applied: the blocks are tokenised
        from ..cache import caching

        with caching(enabled=not args.no_cache):  # the command line caches its pieces unless --no-cache
            parts, blocks = collect(model, tokenizer, dataset, [REGISTRY[a].spec(options) for a in wanted],
                                    block_size=args.block_size, num_sequences=args.num_sequences, add_bos=add_bos,
                                    batch_size=args.batch_size, progress=not args.no_progress)
        if blocks.add_bos is None and applied_bos is not None:  # the tables, the summary and the raw record say so
            blocks = dataclasses.replace(blocks, add_bos=applied_bos)
        if raw is not None:
            collected = {name: options[name] for a in wanted for name in ("seed", *REGISTRY[a].collector_options)}
            _save_raw(raw, parts, blocks, args.sampling, dtype,
                      {"analyses": wanted, "options": collected, "add_bos": args.add_bos,
                       "num_sequences": args.num_sequences})
    tables: dict[str, pd.DataFrame] = {}
    for name in wanted:
        tables.update(REGISTRY[name].named_tables(REGISTRY[name].tables(parts[name], blocks, **options)))
    out.mkdir(parents=True, exist_ok=True)
    for stem, table in tables.items():
        frame = table.copy()
        frame.insert(0, "data", args.data)
        frame.insert(0, "model", args.model)
        write_csv(_round(frame), confined(out, f"sinks_{stem}_{suffix}.csv"), index=False)
    summary = summarize(tables)
    summary.insert(0, "data", args.data)
    summary.insert(0, "model", args.model)
    summary["add_bos"] = blocks.add_bos
    summary["num_sequences"] = int(blocks.ids.shape[0])
    summary["sampling"] = sampling
    summary["dtype"] = dtype
    write_csv(_round(summary), confined(out, f"sinks_summary_{suffix}.csv"), index=False)
    print(summary.to_string(index=False), file=sys.stdout)
    return 0
