"""Speed and memory of cwcore.decompose against a plain eager forward and the naive approach.

Targets, all measured in one run of this script on the default model:
- decompose(all layers) at 512 tokens <= 1.5x a plain eager forward that returns attention maps;
- one layer at 3072 tokens under 3 GiB peak memory for the whole process.

Each memory figure comes from a fresh subprocess (peak resident set size, ``ru_maxrss``), so one
measurement cannot inherit another's allocations. Usage::

    .venv/bin/python benchmarks/bench_decompose.py [--model smollm2-135m] [--tokens 512] [--long 3072]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import cwcore
from cwcore.core.architectures import attention_blocks
from cwcore.core.geometry import naive_geometry, split_output_projection

GIB = 1024**3


def naive_layers(model, input_ids, layers):
    """The naive approach: materialise every alpha_ij v~_j ([batch, head, query, key, model]) per layer."""
    d = cwcore.decompose(model, layers=layers, input_ids=input_ids)  # alpha only; values re-derived below
    values = {}
    blocks = attention_blocks(model)
    handles = [
        blocks[l].module.v_proj.register_forward_hook(lambda m, a, out, l=l: values.__setitem__(l, out))
        for l in layers
    ]
    with torch.inference_mode():
        model(input_ids=input_ids)
    for handle in handles:
        handle.remove()
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for l in layers:
        v = values[l].reshape(*input_ids.shape, cfg.num_key_value_heads, head_dim).transpose(1, 2)
        v = v.repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads, dim=1).float()
        w_o = split_output_projection(blocks[l].output_projection()[0].detach().float(), cfg.num_attention_heads)
        naive_geometry(d.attention[l], v, w_o)


def workloads(model, ids, layer):
    def eager():
        with torch.inference_mode():
            model(input_ids=ids, output_attentions=True)

    def decompose():
        cwcore.decompose(model, input_ids=ids)

    def decompose_weights():  # every layer's intra- and inter-head weights materialised too
        d = cwcore.decompose(model, input_ids=ids)
        for layer_d in d:
            layer_d.contribution("intra"), layer_d.contribution("inter")

    return {
        "eager": eager,
        "decompose": decompose,
        "decompose+weights": decompose_weights,
        "decompose-one-layer": lambda: cwcore.decompose(model, layers=[layer], input_ids=ids),
        "naive-one-layer": lambda: naive_layers(model, ids, [layer]),
    }


def measure(args) -> dict:
    """Runs inside a subprocess. ``--child time``: the timed workloads interleaved round by round
    (so that load from other processes hits them alike), medians. Otherwise one workload, once,
    for its peak memory."""
    torch.manual_seed(0)
    model, _ = cwcore.load_model(args.model)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, args.tokens))
    jobs = workloads(model, ids, args.layer)
    if args.what == "time":
        names = ["eager", "decompose", "decompose+weights"]
        for name in names:
            jobs[name]()  # warm-up
        times = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                start = time.perf_counter()
                jobs[name]()
                times[name].append(time.perf_counter() - start)
        return {name: statistics.median(values) for name, values in times.items()}
    start = time.perf_counter()
    jobs[args.what]()
    return {"what": args.what, "tokens": args.tokens, "seconds": time.perf_counter() - start,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}


def spawn(model: str, what: str, tokens: int, repeats: int = 1, layer: int = 0) -> dict:
    command = [sys.executable, __file__, "--child", what, "--model", model, "--tokens", str(tokens),
               "--repeats", str(repeats), "--layer", str(layer)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--long", type=int, default=3072)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.what = args.child
        print(json.dumps(measure(args)))
        return
    times = spawn(args.model, "time", args.tokens, args.repeats)
    memory = [spawn(args.model, what, args.tokens) for what in ("eager", "decompose", "decompose+weights", "naive-one-layer")]
    memory.append(spawn(args.model, "decompose-one-layer", args.long, layer=args.layer))
    layers = len(attention_blocks(cwcore.load_model(args.model)[0]))
    print(f"model {args.model}, {layers} layers, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats} interleaved rounds")
    print("| measurement | tokens | time (s) | peak memory of the process (GiB) |")
    print("|---|---|---|---|")
    for row in memory:
        seconds = times.get(row["what"], row["seconds"])
        print(f"| {row['what']} | {row['tokens']} | {seconds:.3f} | {row['peak_gib']:.2f} |")
    print(f"decompose(all layers) / eager forward with attention maps = "
          f"{times['decompose'] / times['eager']:.2f}x (target <= 1.5x)")
    print(f"decompose(all layers) with every intra and inter weight materialised / eager forward = "
          f"{times['decompose+weights'] / times['eager']:.2f}x")
    naive = memory[3]["seconds"]
    print(f"naive, one layer: {naive:.2f} s and {memory[3]['peak_gib']:.2f} GiB; ~{naive * layers:.0f} s for all layers "
          f"= {naive * layers / times['decompose+weights']:.0f}x decompose with weights")
    print(f"one layer at {args.long} tokens: peak {memory[4]['peak_gib']:.2f} GiB (target < 3 GiB)")

if __name__ == "__main__":
    main()
