"""Long documents: cwcore.summarize on every layer against the model's plain SDPA forward.

One mode per process (each figure is that process's own wall time and peak resident memory)::

    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 32768 --mode sdpa
    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 32768 --mode summary
    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 2048 --mode check
    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 32768 --mode ratios   # both, one process each

``sdpa``: the model's forward with its attention configured ``sdpa``; ``summary``: :func:`cwcore.summarize`
on every layer (top 8 terms per query, the last query's full rows); ``check``: the same summary compared
with the reduction of :func:`cwcore.decompose`'s dense tensors, layer group by layer group, at a length
the dense path holds. Each prints one JSON line: ``wall_s`` (the call alone, the model already loaded),
``cpu_s`` (its process CPU time, steadier on a shared machine), ``peak_rss_gib`` (the process's peak, model
included) and, for ``check``, ``max_relative_difference``
(max |summary - dense| / max |dense| per tensor, the largest over tensors and layers) with the tensor it
came from, and ``top_index_mismatch`` (the share of top-k indices that differ: two terms whose c agree to
rounding may rank in either order; the top terms' values are then compared with the dense values of the
terms the summary chose, and the k largest c rank by rank, see ``relative_differences``). Both forwards compute the
logits of the last position only (``logits_to_keep=1``): the logits of every position of a 32k-token
input would be the largest tensor of either run (34 GB for Gemma 3's vocabulary) and are no part of
the attention's cost. The input is ``--tokens`` random ids (seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

import cwcore

GIB = 1024**3


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _setup(args):
    model, _ = cwcore.load_model(args.model)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(100, model.config.vocab_size - 100, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    return model, ids


def run_sdpa(args) -> dict:
    model, ids = _setup(args)
    start, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1)
    return {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}


def run_summary(args) -> dict:
    model, ids = _setup(args)
    start, cpu = time.perf_counter(), time.process_time()
    summary = cwcore.summarize(model, input_ids=ids, top_k=args.top_k, rows=[-1], logits_to_keep=1)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "cpu_s": time.process_time() - cpu, "layers": len(summary)}


def run_check(args) -> dict:
    from cwcore.core.summary import dense_summary, relative_differences

    model, ids = _setup(args)
    start = time.perf_counter()
    summary = cwcore.summarize(model, input_ids=ids, top_k=args.top_k, rows=[-1], logits_to_keep=1)
    wall = time.perf_counter() - start
    worst, where, mismatch = 0.0, None, 0.0
    layers = summary.layers
    for first in range(0, len(layers), args.group):  # the dense maps of a few layers at a time
        group = layers[first:first + args.group]
        dense = cwcore.decompose(model, layers=group, input_ids=ids, logits_to_keep=1)
        for layer in group:
            reference = dense_summary(dense[layer], top_k=args.top_k, rows=[-1])
            for name, value in relative_differences(summary[layer], reference, dense[layer]).items():
                if name.startswith("top.") and name in ("top.head", "top.key"):
                    mismatch = max(mismatch, value)
                elif value > worst or where is None:
                    worst, where = max(worst, value), f"layer {layer} {name}"
        del dense
    return {"summary_wall_s": wall, "layers": len(layers), "max_relative_difference": worst, "largest_at": where,
            "top_index_mismatch": mismatch}


def _spawn(args, mode: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--tokens", str(args.tokens),
               "--mode", mode, "--top-k", str(args.top_k)] + (["--threads", str(args.threads)] if args.threads else [])
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--mode", choices=("sdpa", "summary", "check", "ratios"), required=True)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--group", type=int, default=6, help="check: dense layers held at a time (default 6)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's); on a shared machine 1 keeps the two modes comparable")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.mode == "ratios":
        sdpa, summary = _spawn(args, "sdpa"), _spawn(args, "summary")
        result = {"sdpa": sdpa, "summary": summary, "wall_ratio": summary["wall_s"] / sdpa["wall_s"],
                  "peak_rss_ratio": summary["peak_rss_gib"] / sdpa["peak_rss_gib"]}
    else:
        result = {"sdpa": run_sdpa, "summary": run_summary, "check": run_check}[args.mode](args)
        result["peak_rss_gib"] = _peak_gib()
    result = {"model": args.model, "tokens": args.tokens, "mode": args.mode, "threads": torch.get_num_threads(),
              "load_average": round(os.getloadavg()[0], 2),
              **result}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
