"""Speed of a full faithfulness sweep against one clean forward over the same batch.

Target: a full sweep, 5 metrics (the ladder + random) x 7 ratios x 2 modes, over 16 GSM8K
sequences of 128 tokens on smollm2-135m takes at most 75x one clean forward of the same batch. The
sweep is one decomposed clean pass (scores of every metric, sorted once) plus one forward per
(metric, mode, nonzero ratio) point; rankings identical to an earlier metric's (value-weighted and its
inter-normalised version under the default protocol) reuse its forwards (``deduplicate``), which the
script also measures switched off. It also reports how the ratio scales with the sequence length.

Everything is measured in one run. The clean forward is the model's own forward (eager attention,
as ``cwcore.models.load_model`` returns it) under ``torch.inference_mode()``; its time is the median
of ``--repeats`` runs taken right before and right after each sweep, so a shared machine's load
drifting during a sweep affects both sides. Process CPU time (``time.process_time``, all threads) is
reported beside wall-clock time: on a machine shared with other jobs it is the steadier measure of
the work done. Usage::

    .venv/bin/python benchmarks/bench_faithfulness.py [--model smollm2-135m] [--lengths 64 128 256]

``--per-layer`` instead times a per-layer sweep (:mod:`cwcore.faithfulness.layers`: one metric, one
mode, one ratio, every layer in turn, each forward starting from the clean residual stream at its
layer) and reports it in forward-equivalents against the (L + 1) / 2 its decoder layers need::

    .venv/bin/python benchmarks/bench_faithfulness.py --per-layer --num-sequences 4 --lengths 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from cwcore import faithfulness as fa
from cwcore.data import lm_batches, lm_blocks, load_dataset
from cwcore.models import load_model

TARGET = 75.0


class Counter:
    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_pre_hook(lambda module, args: self._count())

    def _count(self):
        self.calls += 1


def clean_forward_times(model, batch, repeats):
    """(wall-clock seconds, process CPU seconds) of each of ``repeats`` clean forwards."""
    walls, cpus = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            start, cpu = time.perf_counter(), time.process_time()
            model(**batch)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
    return walls, cpus


def measure(model, tokenizer, texts, length, num_sequences, repeats, deduplicate=True):
    blocks = lm_blocks(texts, tokenizer, block_size=length, num_blocks=num_sequences)
    batch = next(lm_batches(blocks, num_sequences))
    with torch.inference_mode():
        model(**batch)  # warm-up
    before_wall, before_cpu = clean_forward_times(model, batch, repeats)
    counter = Counter(model)
    start, cpu = time.perf_counter(), time.process_time()
    fa.faithfulness_curve(model, tokenizer, blocks, list(fa.DEFAULT_METRICS), list(fa.DEFAULT_RATIOS),
                          list(fa.MODES), batch_size=num_sequences, max_length=None, progress=False,
                          deduplicate=deduplicate)  # uncached: outside cwcore.cache.caching
    sweep, sweep_cpu = time.perf_counter() - start, time.process_time() - cpu
    counter.handle.remove()
    after_wall, after_cpu = clean_forward_times(model, batch, repeats)
    clean = statistics.median(before_wall + after_wall)
    clean_cpu = statistics.median(before_cpu + after_cpu)
    return {
        "length": length, "sequences": num_sequences, "deduplicate": deduplicate,
        "clean_forward_s": round(clean, 3), "sweep_s": round(sweep, 2), "forwards": counter.calls,
        "ratio": round(sweep / clean, 1),
        "clean_forward_cpu_s": round(clean_cpu, 3), "sweep_cpu_s": round(sweep_cpu, 2),
        "ratio_cpu": round(sweep_cpu / clean_cpu, 1),
        "clean_times_s": [round(t, 3) for t in before_wall + after_wall],
    }


def measure_per_layer(model, tokenizer, texts, length, num_sequences, repeats):
    """A per-layer sweep (contribution, comprehensiveness, r = 0.05, every layer) in clean forwards."""
    from cwcore.faithfulness import layers as per_layer

    blocks = lm_blocks(texts, tokenizer, block_size=length, num_blocks=num_sequences)
    batch = next(lm_batches(blocks, num_sequences))
    with torch.inference_mode():
        model(**batch)
    before_wall, before_cpu = clean_forward_times(model, batch, repeats)
    start, cpu = time.perf_counter(), time.process_time()
    per_layer.per_layer_curve(model, tokenizer, blocks, "contribution", [0.05], "comprehensiveness",
                              batch_size=num_sequences, max_length=None)  # uncached (no caching block): time the work, not a read
    sweep, sweep_cpu = time.perf_counter() - start, time.process_time() - cpu
    after_wall, after_cpu = clean_forward_times(model, batch, repeats)
    clean, clean_cpu = statistics.median(before_wall + after_wall), statistics.median(before_cpu + after_cpu)
    n_layers = len(per_layer.decoder_layers(model))
    return {"length": length, "sequences": num_sequences, "layers": n_layers,
            "expected_forwards": per_layer.forward_equivalents(n_layers), "naive_forwards": n_layers,
            "clean_forward_s": round(clean, 3), "sweep_s": round(sweep, 2), "forwards_wall": round(sweep / clean, 1),
            "clean_forward_cpu_s": round(clean_cpu, 3), "sweep_cpu_s": round(sweep_cpu, 2),
            "forwards_cpu": round(sweep_cpu / clean_cpu, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--num-sequences", type=int, default=16, help="sequences of the 128-token target")
    parser.add_argument("--scaling-sequences", type=int, default=None,
                        help="sequences for the other lengths and for a second 128-token point (default: the same)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-no-dedup", action="store_true", help="do not also time deduplicate=False at 128")
    parser.add_argument("--per-layer", action="store_true", help="time a per-layer sweep instead (see above)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    texts = load_dataset("gsm8k")
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr)
    if args.per_layer:
        for length in args.lengths:
            print(json.dumps(measure_per_layer(model, tokenizer, texts, length, args.num_sequences, args.repeats)),
                  flush=True)
        return 0
    results = []
    plan = []
    for length in args.lengths:
        if length == 128:
            plan.append((length, args.num_sequences))
        if args.scaling_sequences is not None and (length != 128 or args.scaling_sequences != args.num_sequences):
            plan.append((length, args.scaling_sequences))
        elif length != 128:
            plan.append((length, args.num_sequences))
    for length, sequences in plan:
        row = measure(model, tokenizer, texts, length, sequences, args.repeats)
        results.append(row)
        print(json.dumps(row), flush=True)
        if length == 128 and sequences == args.num_sequences and not args.skip_no_dedup:
            row = measure(model, tokenizer, texts, length, args.num_sequences, args.repeats, deduplicate=False)
            results.append(row)
            print(json.dumps(row), flush=True)
    print("\n| tokens | sequences | dedup | forwards | clean forward (s) | sweep (s) | sweep / clean (wall) "
          "| sweep / clean (CPU) |")
    print("|---:|---:|:---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['length']} | {r['sequences']} | {'yes' if r['deduplicate'] else 'no'} | {r['forwards']} "
              f"| {r['clean_forward_s']} | {r['sweep_s']} | {r['ratio']}x | {r['ratio_cpu']}x |")
    target = [r for r in results if r["length"] == 128 and r["sequences"] == args.num_sequences and r["deduplicate"]]
    if target:
        verdict = "PASS" if target[0]["ratio"] <= TARGET else "FAIL"
        print(f"\ntarget (128 tokens, {args.num_sequences} sequences): wall {target[0]['ratio']}x, "
              f"CPU {target[0]['ratio_cpu']}x <= {TARGET}x: {verdict} (judged on wall-clock)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
