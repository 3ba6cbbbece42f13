"""The engine against the user's real alternative: transformers' SDPA forward.

Targets, measured in one run of this script on the default model (smollm2-135m, float32, CPU):
- ``decompose(one layer)`` <= 1.10x the SDPA forward, at 512 and at 2048 tokens (the untouched
  layers keep running SDPA, see ``cwcore.core.attention_features.FAST_IMPLEMENTATIONS``);
- ``decompose(all layers)`` <= 1.25x the eager forward with attention maps, reported against SDPA too;
- one layer at 8192 tokens under 8 GiB peak memory and within 2x the SDPA forward;
- the same layer with its ``inter`` weights read: within 8 GiB peak and 1.5x the SDPA forward;
  all layers with ``attention`` and ``inter`` of every layer read: <= 1.25x the SDPA forward at 512 tokens.
The self-check (hooks on the output projections) is on in every cwcore measurement.

Timed workloads of one length run interleaved, round by round, in one process (medians), so load
from other processes hits them alike; every peak-memory figure is the peak resident set of a fresh
process that loads the model and runs the workload once. Usage::

    .venv/bin/python benchmarks/bench_engine.py [--model smollm2-135m] [--repeats 5] [--long 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

import cwcore

GIB = 1024**3


def _model(name: str, implementation: str):
    model, _ = cwcore.load_model(name)
    model.config._attn_implementation = implementation
    return model


def _ids(model, tokens: int) -> torch.Tensor:
    return torch.randint(100, model.config.vocab_size - 100, (1, tokens), generator=torch.Generator().manual_seed(0))


def workloads(model, ids, layer: int) -> dict:
    def forward(implementation, **kwargs):
        def run():
            model.config._attn_implementation = implementation
            with torch.inference_mode():
                model(input_ids=ids, **kwargs)
        return run

    def decompose(layers, implementation="sdpa", read=False):
        def run():
            model.config._attn_implementation = implementation
            d = cwcore.decompose(model, layers=layers, input_ids=ids)
            if read:  # what a user reads: attention and the inter weights of every decomposed layer
                return {l.layer: (l.attention, l.contribution("inter")) for l in d}
        return run

    return {
        "sdpa forward": forward("sdpa"),
        "eager forward with attention maps": forward("eager", output_attentions=True),
        "decompose, one layer": decompose([layer]),
        "decompose, all layers": decompose(None),
        "decompose, one layer, inter read": decompose([layer], read=True),
        "decompose, all layers, inter read": decompose(None, read=True),
    }


def child(args) -> dict:
    torch.manual_seed(0)
    model = _model(args.model, "sdpa")
    ids = _ids(model, args.tokens)
    jobs = workloads(model, ids, args.layer)
    names = args.what.split(";")
    if args.mode == "memory":
        start = time.perf_counter()
        jobs[names[0]]()
        return {"seconds": time.perf_counter() - start,
                "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
    for name in names:
        jobs[name]()  # warm-up
    times = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            start = time.perf_counter()
            jobs[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def spawn(args, mode: str, what: list[str], tokens: int, repeats: int) -> dict:
    command = [sys.executable, __file__, "--child", "--mode", mode, "--what", ";".join(what), "--model", args.model,
               "--tokens", str(tokens), "--repeats", str(repeats), "--layer", str(args.layer)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--long", type=int, default=8192)
    parser.add_argument("--parts", default="512,2048,long",
                        help="which measurements to run, comma-separated (default: all three)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="time", help=argparse.SUPPRESS)
    parser.add_argument("--what", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    parts = set(args.parts.split(","))
    t512 = spawn(args, "time", ["sdpa forward", "decompose, one layer", "eager forward with attention maps",
                                "decompose, all layers", "decompose, all layers, inter read"], 512,
                 args.repeats) if "512" in parts else None
    t2048 = spawn(args, "time", ["sdpa forward", "decompose, one layer"], 2048, args.repeats) if "2048" in parts else None
    if "long" in parts:
        long_sdpa = spawn(args, "memory", ["sdpa forward"], args.long, 1)
        long_one = spawn(args, "memory", ["decompose, one layer"], args.long, 1)
        long_read = spawn(args, "memory", ["decompose, one layer, inter read"], args.long, 1)
    print(f"model {args.model}, float32, torch threads {torch.get_num_threads()}, layer {args.layer}; "
          f"medians of {args.repeats} interleaved rounds at each length")
    print("| measurement | tokens | time (s) |")
    print("|---|---:|---:|")
    for tokens, times in ((512, t512), (2048, t2048)):
        for name, seconds in (times or {}).items():
            print(f"| {name} | {tokens} | {seconds:.3f} |")
    if "long" in parts:
        for name, run in (("sdpa forward", long_sdpa), ("decompose, one layer", long_one),
                          ("decompose, one layer, inter read", long_read)):
            print(f"| {name} (fresh process) | {args.long} | {run['seconds']:.2f} (peak {run['peak_gib']:.2f} GiB) |")
    ratio = lambda t, a, b: t[a] / t[b]  # noqa: E731
    print()
    if t512 and t2048:
        print(f"decompose(one layer) / SDPA forward: {ratio(t512, 'decompose, one layer', 'sdpa forward'):.2f}x at 512, "
              f"{ratio(t2048, 'decompose, one layer', 'sdpa forward'):.2f}x at 2048 (target <= 1.10x)")
    if t512:
        print(f"decompose(all layers) / eager forward with attention maps: "
              f"{ratio(t512, 'decompose, all layers', 'eager forward with attention maps'):.2f}x (target <= 1.25x); "
              f"/ SDPA forward: {ratio(t512, 'decompose, all layers', 'sdpa forward'):.2f}x")
        print(f"decompose(all layers) with attention and inter read / SDPA forward: "
              f"{ratio(t512, 'decompose, all layers, inter read', 'sdpa forward'):.2f}x (target <= 1.25x)")
    if "long" in parts:
        print(f"one layer at {args.long} tokens: {long_one['seconds'] / long_sdpa['seconds']:.2f}x the SDPA forward "
              f"(target <= 2x), peak {long_one['peak_gib']:.2f} GiB (target < 8 GiB)")
        print(f"one layer at {args.long} tokens with inter read: {long_read['seconds'] / long_sdpa['seconds']:.2f}x the "
              f"SDPA forward (target <= 1.5x), peak {long_read['peak_gib']:.2f} GiB (target <= 8 GiB)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
