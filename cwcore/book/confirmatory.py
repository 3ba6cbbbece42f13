"""``make confirmatory``: the confirmatory sample's evidence, computed after its registration.

``python -m cwcore.book.confirmatory ladder [--models m1,m2] [--data d1,d2] [--jobs N]`` computes chapter 4's
eight ladder cells (2 models x 2 data sets x the main protocols ``default`` and ``per-head``, both modes,
both importance signs, every ratio of both grids, the random control at 3 seeds) on the registered
confirmatory sample (:func:`cwcore.book.registration.confirmatory_blocks`), with exactly the sweep the
evidence profile runs on the exploratory sample (:func:`cwcore.book.evidence_build.ladder_cell`). Each
cell merges every :data:`~cwcore.book.evidence_build.CHECKPOINT_DOCUMENTS` documents into
``data/results/confirmatory/per_document_<model>_<data>.csv.gz`` (its JSON says ``"sample":
"confirmatory"`` and lists the document ids), so what is finished can be committed while it runs and a
restarted build resumes from the committed rows after a 2-document check. The sweeps split their
documents over ``--jobs`` single-thread ranks (``$CWCORE_JOBS``); results are the same with 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import registration

__all__ = ["OUT", "PROFILE", "LADDER", "ladder", "main"]

#: the committed confirmatory evidence (beside the exploratory ``data/results/evidence``)
OUT = Path(__file__).resolve().parents[2] / "data" / "results" / "confirmatory"  # findings.CONFIRMATORY_DIR
#: the profile name the confirmatory exports carry (a committed export of another profile is never taken)
PROFILE = registration.CONFIRMATORY
#: the ladder sweep's settings: the evidence profile's chapter-4 parameters (book/run.yml), fixed here
LADDER = {"metrics": ["attention", "value_weighted", "value_weighted_output_normalized", "contribution", "random"],
          "importances": ["signed", "absolute"], "protocols": ["default", "per-head"], "random_seeds":
          registration.RANDOM_SEEDS, "batch_size": 8, "dtype": "float32", "device": "cpu", "seed": 0}


def ladder(models=registration.CONFIRMATORY_MODELS, datasets=registration.CONFIRMATORY_DATA, *,
           out: str | Path = OUT, log=print) -> list[Path]:
    """The confirmatory ladder cells of ``models`` x ``datasets`` (see the module's docstring), each
    protocol in turn, merged into ``out`` as they go. Returns the exports written."""
    import cwcore
    from ..faithfulness import evidence
    from .evidence_build import CHECKPOINT_DOCUMENTS, ladder_cell
    from .evidence_export import paths

    out = Path(out)
    ratios = evidence.ratio_grid()
    written = []
    for model in models:
        lm, tokenizer = cwcore.load_model(model, dtype=LADDER["dtype"], device=LADDER["device"])
        for data in datasets:
            blocks = registration.confirmatory_blocks(data, tokenizer)
            for protocol in LADDER["protocols"]:
                t0 = time.monotonic()
                ladder_cell(lm, tokenizer, blocks, LADDER["metrics"], ratios, model=model, data=data,
                            protocol=protocol, importances=LADDER["importances"], profile=PROFILE,
                            seed=LADDER["seed"], dtype=LADDER["dtype"], exports=out, checkpoint=CHECKPOINT_DOCUMENTS,
                            log=log, batch_size=LADDER["batch_size"], max_length=registration.CONFIRMATORY_SEQ_LEN,
                            random_seeds=LADDER["random_seeds"], n_bootstrap=registration.N_BOOTSTRAP,
                            progress=True, cache=True)
                log(f"confirmatory  {model} {data} {protocol}: {time.monotonic() - t0:.0f} s")
            written += list(paths(model, data, out))
        del lm
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwcore.book.confirmatory", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("ladder", help="compute (or resume) the confirmatory ladder cells")
    run.add_argument("--models", default=",".join(registration.CONFIRMATORY_MODELS))
    run.add_argument("--data", default=",".join(registration.CONFIRMATORY_DATA))
    run.add_argument("--jobs", type=int, default=None, help="single-thread ranks per sweep (default: $CWCORE_JOBS or 1)")
    run.add_argument("--out", default=str(OUT))
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    datasets = [d for d in args.data.split(",") if d]
    unknown = [m for m in models if m not in registration.CONFIRMATORY_MODELS] + \
              [d for d in datasets if d not in registration.CONFIRMATORY_DATA]
    if unknown:
        parser.error(f"not registered: {', '.join(unknown)} (registered models "
                     f"{', '.join(registration.CONFIRMATORY_MODELS)}, data {', '.join(registration.CONFIRMATORY_DATA)})")
    if args.jobs is not None:
        os.environ["CWCORE_JOBS"] = str(args.jobs)
    ladder(models, datasets, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
