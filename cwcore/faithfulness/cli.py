"""The command line: ``python -m cwcore.faithfulness --model smollm2-135m --data gsm8k --out my-results/``.

Writes tidy CSVs (``faithfulness_*``, ``aopc_*``, ``ladder_*``, ``downstream_*``) into ``--out``
(default ``./cwcore-results/``); every argument is checked before the model is loaded."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

from ..cli import (ArgumentParser, UsageError, add_model_options, check_block_size, debug_requested, given_flags,
                   loading_bar, run_command, sampled_blocks)
from ..provenance import RESULTS_FOLDER, confined, output_folder

__all__ = ["main", "parser", "CHOICES"]

#: the defaults and choices of the flags (``cwcore.faithfulness.protocol`` and ``.ranking`` declare them;
#: written here so that ``--help`` needs no torch, and a test checks that they agree)
CHOICES = {
    "metrics": ("attention", "value_weighted", "value_weighted_output_normalized", "contribution", "random"),
    "ratios": (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
    "kinds": ("inter", "intra"),
    "modes": ("comprehensiveness", "sufficiency"),
    "scopes": ("row", "layer"),
    "units": ("head_key", "key", "token"),
}

_MC_TASKS = ("mmlu", "winogrande", "boolq")
#: flags read only for language-model data sets, and only for the multiple-choice tasks
_LM_ONLY = ("num_sequences", "block_size", "sampling")
_MC_ONLY = ("num_examples", "max_length", "downstream_ratios")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", str(name)).strip("_")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweeps named on the command line (``argv``, default ``sys.argv[1:]``); returns the exit
    status: 0, 2 for bad input (one line on stderr), 1 for a bug (``--debug``: the traceback)."""
    return run_command("python -m cwcore.faithfulness", lambda: _main(argv), debug_requested(argv))


def parser() -> argparse.ArgumentParser:
    """The command line's parser (standard library only: ``--help`` answers at once)."""
    parser = ArgumentParser(
        prog="python -m cwcore.faithfulness",
        description="Faithfulness sweeps (comprehensiveness / sufficiency) written as tidy CSVs.")
    parser.add_argument("--model", default="smollm2-135m", help="packaged name, hub id or local path (default %(default)s)")
    parser.add_argument("--data", nargs="+", default=["gsm8k"],
                        help="LM data sets (gsm8k, web-text, wikipedia, a path...) and/or mmlu, winogrande, boolq")
    parser.add_argument("--num-sequences", type=int, default=32, help="LM sequences per data set (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per LM sequence (default %(default)s)")
    parser.add_argument("--sampling", default="documents", choices=("documents", "stream"),
                        help="documents: the first block of each of --num-sequences documents drawn with --seed "
                             "(cwcore.data.document_blocks); stream: consecutive blocks of the data-set stream "
                             "(cwcore.data.lm_blocks)")
    parser.add_argument("--num-examples", type=int, default=100, help="examples per multiple-choice task")
    parser.add_argument("--max-length", type=int, default=512, help="multiple choice: context tokens kept")
    parser.add_argument("--metrics", nargs="+", default=list(CHOICES["metrics"]),
                        help="the rankings compared: registered method names (the ladder, random, value_zeroing, rollout, "
                             "contribution_rollout, alti, grad_x_input; suffix _intra/_inter sets the kind) (default: "
                             f"{' '.join(CHOICES['metrics'])})")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(CHOICES["ratios"]),
                        help="fractions of each ranking group's candidate terms removed, in [0, 1] (default: "
                             f"{' '.join(map(str, CHOICES['ratios']))})")
    parser.add_argument("--downstream-ratios", nargs="+", type=float, default=None,
                        help="ratios for the multiple-choice tasks (default: --ratios)")
    parser.add_argument("--modes", nargs="+", default=list(CHOICES["modes"]),
                        help="comprehensiveness (remove the most important terms) and/or sufficiency (remove the least) "
                             "(default: both)")
    parser.add_argument("--unit", default="head_key", choices=CHOICES["units"],
                        help="what is ranked as one item: head_key, a (head, key) pair ranked across heads; key, a key "
                             "within one head; token, a key by its head-aggregated score, removed from every head "
                             "(default %(default)s)")
    parser.add_argument("--scope", default="row", choices=CHOICES["scopes"],
                        help="row: one ranking per query; layer: one per sequence and layer, of the scores averaged "
                             "over the queries (default %(default)s)")
    parser.add_argument("--scores", default="clean", choices=("clean", "live"),
                        help="clean: rank on the clean run; live: rank layer l on the state the removals below it "
                             "produced, about 2.5x slower (default %(default)s)")
    parser.add_argument("--kind", default="inter", choices=CHOICES["kinds"],
                        help="contribution weights against the layer's combined output (inter) or the head's own "
                             "(intra) (default %(default)s)")
    parser.add_argument("--importance", default="signed", choices=("signed", "absolute"),
                        help="signed: rank by the score, the most negative terms least important; absolute: by "
                             "|score| (default %(default)s)")
    parser.add_argument("--remove-first-token", action="store_true", help="allow removing the first token (sink)")
    parser.add_argument("--layers", nargs="+", type=int, default=None, help="layers whose terms are removed (default: all)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the document draw, the random control and the bootstrap (default %(default)s)")
    parser.add_argument("--n-bootstrap", type=int, default=1000, help="bootstrap resamples per interval (default %(default)s)")
    add_model_options(parser)
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--out", default=RESULTS_FOLDER,
                        help=f"folder of the tables (default ./{RESULTS_FOLDER}/ in the working folder)")
    parser.add_argument("--no-cache", action="store_true", help="run without the result cache (or CWCORE_NO_CACHE=1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    return parser


def _refuse_unread_flags(argv: Sequence[str] | None, data: Sequence[str]) -> None:
    """A flag of the language-model sweeps with only multiple-choice tasks in ``--data`` (or the other way round)
    is refused, not silently dropped."""
    given = given_flags(parser(), argv, _LM_ONLY + _MC_ONLY)
    has_tasks = any(d in _MC_TASKS for d in data)
    has_lm = any(d not in _MC_TASKS for d in data)
    for names, present, what in ((_LM_ONLY, has_lm, "language-model data sets (gsm8k, web-text, a path, ...)"),
                                 (_MC_ONLY, has_tasks, "the multiple-choice tasks (mmlu, winogrande, boolq)")):
        unread = ["--" + name.replace("_", "-") for name in names if name in given]
        if unread and not present:
            one = len(unread) == 1
            raise UsageError(f"{' and '.join(unread)} {'applies' if one else 'apply'} to {what}, and --data names "
                             f"none: add one, or leave {'it' if one else 'them'} out")


def _main(argv: Sequence[str] | None) -> int:
    args = parser().parse_args(argv)
    _refuse_unread_flags(argv, args.data)
    from ..data import missing_local_file
    from .protocol import specs as parse_specs

    missing = [name for name in args.data if name not in _MC_TASKS and missing_local_file(name)]
    if missing:  # before the model loads (it was found missing after)
        raise UsageError(f"--data {missing[0]}: no such file")
    # a metric reads --kind when its kind follows the default: it has one, and its name does not fix it
    # (contribution_inter ran the same tables whatever --kind said)
    reads_kind = [inter.kind != intra.kind for inter, intra in zip(parse_specs(args.metrics, "inter"),
                                                                    parse_specs(args.metrics, "intra"))]
    if "kind" in given_flags(parser(), argv, ("kind",)) and not any(reads_kind):
        raise UsageError("--kind applies to the metrics with a kind (value_weighted_output_normalized, contribution) "
                         "named without _inter or _intra, and --metrics names none: add one, or leave --kind out")
    from ..cache import caching

    with caching(enabled=not args.no_cache):  # the command line caches its pieces unless --no-cache
        return _sweeps(args)


def _sweeps(args) -> int:
    import torch

    from .. import data, models
    from ..cache import write_csv
    from ..core.architectures import attention_blocks
    from ..core.inputs import check_batch_size, check_count, check_layers, check_ratios
    from .downstream import downstream_eval
    from .lm import faithfulness_curve
    from .protocol import Protocol, modes as parse_modes, specs as parse_specs
    from .summary import aopc, ladder_comparison, summarize, summarize_downstream

    # everything that can be checked without the model, before loading it (one sentence each)
    check_ratios(args.ratios, argument="--ratios")
    if args.downstream_ratios is not None:
        check_ratios(args.downstream_ratios, argument="--downstream-ratios")
    parse_specs(args.metrics, args.kind)
    parse_modes(args.modes)
    check_batch_size(args.batch_size)
    for name in ("num_sequences", "block_size", "num_examples", "max_length", "n_bootstrap"):
        check_count(getattr(args, name), "--" + name.replace("_", "-"), minimum=2 if name == "block_size" else 1)
    out = output_folder(args.out)

    torch.manual_seed(args.seed)
    with loading_bar(not args.no_progress):
        model, tokenizer = models.load_model(args.model, dtype=args.dtype, device=args.device)
    if args.layers is not None:
        check_layers(args.layers, len(attention_blocks(model)), argument="--layers", allow_empty=False)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"_{_slug(args.tag)}" if args.tag else ""
    protocol = dict(protocol=Protocol(unit=args.unit, scope=args.scope, layers=args.layers,
                                      keep_first_token=not args.remove_first_token, scores=args.scores, kind=args.kind,
                                      importance=args.importance, seed=args.seed),
                    n_bootstrap=args.n_bootstrap, progress=not args.no_progress)
    common = dict(model=args.model)
    tasks = [d for d in args.data if d in _MC_TASKS]
    for name in [d for d in args.data if d not in _MC_TASKS]:
        texts = data.load_dataset(name, seed=args.seed)
        check_block_size(args.block_size, model)  # after the data set's name is checked
        if args.sampling == "documents":
            blocks = sampled_blocks(lambda: data.document_blocks(texts, tokenizer, args.block_size, args.num_sequences,
                                                                 seed=args.seed), args.block_size, name, True)
        else:
            blocks = sampled_blocks(lambda: data.lm_blocks(texts, tokenizer, block_size=args.block_size,
                                                           num_blocks=args.num_sequences), args.block_size, name, False)
        per_seq = faithfulness_curve(model, tokenizer, blocks, args.metrics, args.ratios, args.modes,
                                     batch_size=args.batch_size, max_length=None, **protocol).per_sequence
        curve = summarize(per_seq, n_bootstrap=args.n_bootstrap, seed=args.seed)
        area = aopc(per_seq, n_bootstrap=args.n_bootstrap, seed=args.seed)
        ladder = ladder_comparison(per_seq, n_bootstrap=args.n_bootstrap, seed=args.seed)
        stem = f"{_slug(args.model)}_{_slug(name)}{tag}"
        for prefix, frame in (("faithfulness", curve), ("aopc", area), ("ladder", ladder)):
            frame.insert(0, "data", name)
            frame.insert(0, "model", common["model"])
            path = write_csv(frame, confined(out, f"{prefix}_{stem}.csv"), index=False, float_format="%.6g")
            print(f"wrote {path}", file=sys.stderr)
    if tasks:
        per_example = downstream_eval(model, tokenizer, tasks, args.metrics, args.downstream_ratios or args.ratios,
                                      args.modes, num_examples=args.num_examples, data_seed=args.seed,
                                      max_length=args.max_length, batch_size=args.batch_size, per_example=True,
                                      **protocol)
        summary = summarize_downstream(per_example, n_bootstrap=args.n_bootstrap, seed=args.seed)
        area = aopc(per_example, n_bootstrap=args.n_bootstrap, seed=args.seed)
        ladder = ladder_comparison(per_example, n_bootstrap=args.n_bootstrap, seed=args.seed)
        for prefix, frame in (("downstream", summary), ("downstream_aopc", area), ("downstream_ladder", ladder)):
            frame.insert(0, "model", args.model)
            path = write_csv(frame, confined(out, f"{prefix}_{_slug(args.model)}{tag}.csv"), index=False,
                             float_format="%.6g")
            print(f"wrote {path}", file=sys.stderr)
    return 0


def __getattr__(name: str):
    """``cli.data`` and ``cli.models``, imported on first use (``--help`` imports neither)."""
    if name in ("data", "models"):
        import importlib

        return importlib.import_module(f"cwcore.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
