"""Chapter 4's in-distribution removal check, one command per model (written to ``data/results``)::

    python -m cwbook.in_distribution --models smollm2-135m gemma3-270m --documents 16

For each packaged model, on the first ``--documents`` GSM8K documents of chapter 4's sample, the headline
ranking (|contribution|), the random control and attention are swept with removed terms zeroed and with
them replaced by the head's mean value from the other documents
(:func:`cwbook.chapters.ch04_faithfulness.removal_in_distribution`); the AOPC table and the paired steps go
to ``data/results/removal_in_distribution_<model>_gsm8k.csv`` with a ``.json`` of their provenance, and the
per-document rows behind them beside it (``..._per_document.csv.gz``).
Exploratory: no claim of the pre-registration depends on it.
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    """The command line; 0 when done, 2 for bad input (one line, before any model loads), 1 for a bug."""
    from cwcore.cli import debug_requested, run_command

    from cwbook import BookError

    return run_command("python -m cwbook.in_distribution", lambda: _main(argv), debug_requested(argv),
                       user_errors=(BookError,))


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwbook.in_distribution", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--documents", type=int, default=16, help="GSM8K documents per model (default 16)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--ratios", type=float, nargs="+", default=None,
                        help="removal fractions (default: the ladder's low and paper grids)")
    parser.add_argument("--n-bootstrap", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero-from-evidence", action="store_true",
                        help="take the zeroing rows from the committed exploratory evidence (same documents, protocol "
                             "and rankings) and compute only the mean stand-in")
    parser.add_argument("--out", default=None, help="a folder for the tables instead of data/results")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
    args = parser.parse_args(argv)
    # before the first model loads (--documents 0 and --ratios 2 failed after it, in a traceback)
    from cwcore.core.inputs import check_count
    from cwcore.faithfulness.protocol import ratios as parse_ratios

    check_count(args.documents, "--documents")
    check_count(args.seq_len, "--seq-len", minimum=2)
    check_count(args.batch_size, "--batch-size")
    check_count(args.n_bootstrap, "--n-bootstrap")
    if args.ratios is not None:
        parse_ratios(args.ratios)

    from pathlib import Path

    import cwcore
    from cwbook import REPO_ROOT
    from cwbook.chapters import ch04_faithfulness as ch04
    from cwbook import git

    commit = git(REPO_ROOT, "rev-parse", "--short", "HEAD")  # the code that runs, read before it runs

    for name in args.models:
        t0 = time.monotonic()
        lm, tokenizer = cwcore.load_model(name)
        table, per_document = ch04.removal_in_distribution(
            lm, tokenizer, model=name, n_documents=args.documents, seq_len=args.seq_len, ratios=args.ratios,
            batch_size=args.batch_size, n_bootstrap=args.n_bootstrap, seed=args.seed, progress=False,
            zero_from_evidence=args.zero_from_evidence)
        path = None if args.out is None else Path(args.out) / ch04.in_distribution_path(name).name
        written = ch04.save_in_distribution(table, per_document, model=name, n_documents=args.documents,
                                            seq_len=args.seq_len, batch_size=args.batch_size,
                                            n_bootstrap=args.n_bootstrap, seed=args.seed, path=path, commit=commit)
        print(f"{name}: {written} ({time.monotonic() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
