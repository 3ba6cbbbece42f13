"""Long documents: cwcore.summarize on every layer against the model's plain SDPA forward.

One mode per process (each figure is that process's own wall time and peak resident memory)::

    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 32768 --mode sdpa
    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 32768 --mode summary
    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 2048 --mode check
    python benchmarks/bench_long_context.py --model gemma3-270m --tokens 32768 --mode ratios   # both, one process each

``sdpa``: the model's forward with its attention configured ``sdpa``; ``summary``: :func:`cwcore.summarize`
on every layer (top 8 terms per query, the last query's full rows), the model configured ``sdpa`` (each layer
then also runs the model's own SDPA call, whose output the forward keeps) or, with ``--summary-attention
eager``, ``eager`` (the summary's blockwise output goes on to the next layer, no SDPA call); ``check``: each layer's summary compared
with the reduction of :func:`cwcore.decompose`'s dense tensors of the same layer on the same input (both
record that layer alone), at a length the dense path holds; ``forward_drift`` compares the summary of every
layer in one forward with the same references (see :func:`run_check`). Each prints one JSON line: ``wall_s`` (the call alone, the model already loaded),
``cpu_s`` (its process CPU time, steadier on a shared machine), ``peak_rss_gib`` (the process's peak, model
included) and, for ``check``, ``max_relative_difference``
(max |summary - dense| / max |dense| per tensor, the largest over tensors and layers) with the tensor it
came from, and ``top_index_mismatch`` (the share of top-k indices that differ: two terms whose c agree to
rounding may rank in either order; the top terms' values are then compared with the dense values of the
terms the summary chose, and the k largest c rank by rank, see ``relative_differences``). Both forwards compute the
logits of the last position only (``logits_to_keep=1``): the logits of every position of a 32k-token
input would be the largest tensor of either run (34 GB for Gemma 3's vocabulary) and are no part of
the attention's cost. The input is ``--tokens`` random ids (seed 0). ``--first-layers N`` keeps the model's first N decoder layers
(a slice, for quick comparisons) and ``--profile`` prints the operators of a second call by self CPU time.
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
from cwcore.core.summary import relative_differences

GIB = 1024**3


def _peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


def _setup(args, attention: str = "sdpa"):
    model, _ = cwcore.load_model(args.model)
    model.config._attn_implementation = attention
    if args.first_layers:  # a slice of the model, for profiles: its first N decoder layers
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not 0 < args.first_layers <= len(layers):
            raise SystemExit(f"--first-layers {args.first_layers}: {args.model} has no model.layers of that length")
        model.model.layers = layers[: args.first_layers]
        model.config.num_hidden_layers = args.first_layers
        model.eval()  # the slice is a new ModuleList, in training mode
    if args.dtype == "float64":  # the check without float32 rounding: both paths then agree to float64's
        model = model.to(torch.float64)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    return model, ids


def _profiled(args, call) -> None:
    """``--profile``: the operators of a second call, by self CPU time, on stderr (the timed call was the first)."""
    if args.profile:
        from torch.profiler import profile

        with profile() as profiler:
            call()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


def run_sdpa(args) -> dict:
    model, ids = _setup(args)

    def forward():
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)

    start, cpu = time.perf_counter(), time.process_time()
    forward()
    result = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu}
    _profiled(args, forward)
    return result


def run_summary(args) -> dict:
    model, ids = _setup(args, args.summary_attention)

    def summary():
        return cwcore.summarize(model, input_ids=ids, top_k=args.top_k, rows=[-1], logits_to_keep=1,
                                progress=False)

    start, cpu = time.perf_counter(), time.process_time()
    layers = len(summary())
    result = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "layers": layers}
    _profiled(args, summary)
    return result


def _compare(summary, reference, dense, worst, where, mismatch):
    for name, value in relative_differences(summary, reference, dense).items():
        if name in ("top.head", "top.key"):
            mismatch = max(mismatch, value)
        elif value > worst or where is None:
            worst, where = max(worst, value), f"layer {summary.layer} {name}"
    return worst, where, mismatch


def run_check(args) -> dict:
    """Each layer's summary against the dense reduction of the same layer on the same input: ``summarize`` and
    ``decompose`` of that layer alone, the other layers running the model's SDPA in both. Then, as a diagnostic,
    the summary of every layer in one forward against those dense layers: there each summarised layer hands its
    own float32 arithmetic (not SDPA's bits) to the next, so deeper layers see inputs that differ by the rounding
    accumulated above them (``forward_drift``)."""
    from cwcore.core.summary import dense_summary

    model, ids = _setup(args)
    start = time.perf_counter()
    together = cwcore.summarize(model, input_ids=ids, top_k=args.top_k, rows=[-1], logits_to_keep=1)
    wall = time.perf_counter() - start
    worst, where, mismatch = 0.0, None, 0.0
    drift, drift_at, drift_mismatch = 0.0, None, 0.0
    for layer in together.layers:
        alone = cwcore.summarize(model, input_ids=ids, top_k=args.top_k, rows=[-1], logits_to_keep=1, layers=[layer])
        dense = cwcore.decompose(model, layers=[layer], input_ids=ids, logits_to_keep=1)
        reference = dense_summary(dense[layer], top_k=args.top_k, rows=[-1])
        worst, where, mismatch = _compare(alone[layer], reference, dense[layer], worst, where, mismatch)
        drift, drift_at, drift_mismatch = _compare(together[layer], reference, dense[layer], drift, drift_at,
                                                   drift_mismatch)
        del dense, alone
    return {"summary_wall_s": wall, "layers": len(together.layers), "max_relative_difference": worst,
            "largest_at": where, "top_index_mismatch": mismatch, "forward_drift": drift, "forward_drift_at": drift_at,
            "forward_drift_top_index_mismatch": drift_mismatch}


def _spawn(args, mode: str) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--tokens", str(args.tokens),
               "--mode", mode, "--top-k", str(args.top_k), "--summary-attention", args.summary_attention]
    command += ["--threads", str(args.threads)] if args.threads else []
    command += ["--first-layers", str(args.first_layers)] if args.first_layers else []
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--mode", choices=("sdpa", "summary", "check", "ratios"), required=True)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dtype", choices=("model", "float64"), default="model",
                        help="the model's own dtype (default), or float64 for both paths (check: rounding or not)")
    parser.add_argument("--summary-attention", choices=("sdpa", "eager"), default="sdpa",
                        help="the attention the model is configured with in summary mode: sdpa (default) keeps the "
                             "model's own SDPA output in every layer, one SDPA call per layer on top of the "
                             "summary's; eager hands the summary's blockwise output to the next layer")
    parser.add_argument("--first-layers", type=int, default=None,
                        help="keep the model's first N decoder layers only (a slice, for profiles)")
    parser.add_argument("--profile", action="store_true",
                        help="after the timed call, profile a second one and print its operators on stderr")
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
    result = {"model": args.model, "tokens": args.tokens, "first_layers": args.first_layers, "mode": args.mode, "dtype": args.dtype,
              "summary_attention": args.summary_attention if args.mode in ("summary", "ratios") else None,
              "threads": torch.get_num_threads(), "load_average": round(os.getloadavg()[0], 2), **result}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
