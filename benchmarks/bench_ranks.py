"""Speed-up of a faithfulness sweep split over N single-thread ranks of this machine, against 1 rank.

A small real workload: the ladder and random on smollm2-135m, ``--documents`` web-text documents of
``--tokens`` tokens, three ratios, both modes, the default protocol, uncached. The same sweep runs in
one single-thread process, then with ``$CWCORE_JOBS=N`` (N-1 forked helper ranks, cwcore.runs), then in
one process with N torch threads (what a build without ranks gets from N cores); the frames must be
identical bit for bit between the ranks and the one rank. Prints the wall times, the ratios and the load
average before and after (other processes on the machine slow the runs, unevenly). The defaults are the
evidence profile's batches (8 documents of 128 tokens), two of them, so that 2 ranks each get one.

    python benchmarks/bench_ranks.py --jobs 2 --documents 16
"""

from __future__ import annotations

import argparse
import os
import time

import pandas as pd
import torch

from cwcore import faithfulness as fa
from cwcore import runs
from cwcore.data import document_blocks, load_dataset
from cwcore.models import load_model


def sweep(model, blocks, batch_size):
    return fa.faithfulness_curve(model, None, blocks, ratios=[0, 0.1, 0.3, 0.5], batch_size=batch_size,
                                 progress=False).per_sequence  # uncached: outside cwcore.cache.caching


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="web-text")
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    blocks = document_blocks(load_dataset(args.data), tokenizer, args.tokens, args.documents)
    b = args.batch_size
    sweep(model, blocks.select(range(1)), b)  # warm-up
    os.environ.pop(runs.JOBS_ENV_VAR, None)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    alone = sweep(model, blocks, b)
    one = time.perf_counter() - t0
    os.environ[runs.JOBS_ENV_VAR] = str(args.jobs)
    t0 = time.perf_counter()
    shared = sweep(model, blocks, b)
    many = time.perf_counter() - t0
    os.environ.pop(runs.JOBS_ENV_VAR, None)
    torch.set_num_threads(args.jobs)
    t0 = time.perf_counter()
    threaded = sweep(model, blocks, b)
    threads = time.perf_counter() - t0
    load_after = os.getloadavg()
    pd.testing.assert_frame_equal(alone, shared, check_exact=True)
    drift = float((alone["nll"] - threaded["nll"]).abs().max())  # 2 threads sum in another order: not bit-equal
    print(f"{args.model} {args.data}: {args.documents} documents x {args.tokens} tokens, batches of {b}, "
          f"{len(alone)} rows")
    print(f"1 rank {one:.1f} s; {args.jobs} ranks {many:.1f} s: speed-up {one / many:.2f}x (identical frames); "
          f"1 process with {args.jobs} threads {threads:.1f} s: ranks {threads / many:.2f}x faster than threads (max |nll diff| {drift:.1e})")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f}, after {load_after[0]:.2f} {load_after[1]:.2f} "
          f"on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
