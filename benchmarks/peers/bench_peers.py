"""cwcore against its peers, TransformerLens and inseq, on the same model, the same input, in one process.

Runs in its own environment, ``benchmarks/peers/.venv`` (``make peers`` builds it and runs this script),
never the project's ``.venv``: transformer-lens 4.3 and inseq 0.7.1 beside an editable cwcore, all on the
project's torch 2.13.0 (CPU) and transformers 5.24.0, so every workload runs the same model code, in the
same process, on the same threads.

Workloads (smollm2-135m, float32, one GSM8K block of ``--tokens`` tokens, batch 1), timed interleaved,
round by round (load from other processes hits them alike), medians over ``--rounds``:

- ``cwcore.decompose`` of one layer and of all layers, reading attention and the inter contribution
  weights c_ij = alpha_ij <o_i, v~_j> / ||o_i||^2 of every decomposed layer (they are computed when read);
  untouched layers run SDPA (``config._attn_implementation = "sdpa"``, as in ``bench_engine.py``);
- TransformerLens 4 (``TransformerBridge.boot_transformers(folder)``: raw HF weights, no LayerNorm folding,
  no centring; every layer eager, forced by the bridge): ``run_with_cache`` of the hooks a user needs
  (``hook_pattern``, ``hook_v``, ``hook_z``) and the weights written by hand, two ways: *as the formula
  reads* (project each key's value with W_O per head into model space, then the inner product with o_i,
  o_i = sum over heads of z^h_i W_O^h, no b_O) and *in head space* (pull o_i back with W_O^h first: the
  trick cwcore uses; an expert's version);
- inseq 0.7.1 ``attention`` (one forward with ``output_attentions``, all layers and heads; its default
  aggregation is the mean over layers then over heads), attributing every token after the first;
- the model's own SDPA forward, as the unit of time.

Numerical agreement (outside the timing): per layer, the max abs difference of attention and of inter
weights, TransformerLens vs cwcore, and of attention, inseq vs cwcore; TransformerLens' logits vs the
model's. ``value_zeroing`` of inseq is tried once on a short prefix; the exact error is reported.
Usage::

    benchmarks/peers/.venv/bin/python benchmarks/peers/bench_peers.py [--tokens 512] [--rounds 5] [--layer 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from importlib.metadata import version

import torch

import cwcore
from cwcore.data import load_dataset
from cwcore.models import packaged_model_path

warnings.filterwarnings("ignore")


# ------------------------------------------------------------------------------------------ inputs
def gsm8k_ids(tokenizer, tokens: int) -> tuple[list[int], str]:
    """The first ``tokens`` tokens of the GSM8K test texts joined by blank lines, and their text.

    inseq takes text (and drops special tokens such as a document separator), so the common input is
    plain text whose decoded form tokenises back to the same ids.
    """
    texts = load_dataset("gsm8k")["text"]
    text = "\n\n".join(texts[: max(4, tokens // 40)])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for start in range(16):  # a cut inside a multi-token word may not survive: slide the window
        window = ids[start : start + tokens]
        text = tokenizer.decode(window)
        if tokenizer(text, add_special_tokens=False)["input_ids"] == window:
            return window, text
    raise RuntimeError("could not find a GSM8K prefix that survives decode -> encode")


# ------------------------------------------------------------------------------------------ TransformerLens
def tl_hooks(layers):
    return {f"blocks.{l}.attn.hook_{n}" for l in layers for n in ("pattern", "v", "z")}


def tl_weights(bridge, ids, layers, head_space: bool):
    """Attention and inter contribution weights per layer from ``run_with_cache``, written by hand."""
    names = tl_hooks(layers)
    with torch.inference_mode():
        _, cache = bridge.run_with_cache(ids, names_filter=lambda name: name in names)
        out = {}
        for l in layers:
            pattern = cache[f"blocks.{l}.attn.hook_pattern"]       # [b, h, q, k]
            v = cache[f"blocks.{l}.attn.hook_v"]                   # [b, k, kv_heads, d]
            z = cache[f"blocks.{l}.attn.hook_z"]                   # [b, q, h, d]
            w_o = bridge.blocks[l].attn.W_O                        # [h, d, m]
            v = v.repeat_interleave(pattern.shape[1] // v.shape[2], dim=2)  # grouped-query: kv head h // group
            o = torch.einsum("bqhd,hdm->bqm", z, w_o)              # o_i: sum over heads, without b_O
            if head_space:
                pulled = torch.einsum("bqm,hdm->bhqd", o, w_o)     # W_O^h^T o_i
                dot = torch.einsum("bhqd,bkhd->bhqk", pulled, v)
            else:
                v_tilde = torch.einsum("bkhd,hdm->bhkm", v, w_o)   # v~^h_j = v^h_j W_O^h
                dot = torch.einsum("bqm,bhkm->bhqk", o, v_tilde)
            out[l] = (pattern, pattern * dot / o.pow(2).sum(-1)[:, None, :, None])
    return out


# ------------------------------------------------------------------------------------------ cwcore
def cw_weights(model, ids, layers, attention: str = "sdpa"):
    """``attention``: how the model is configured; ``"sdpa"`` (the default of a loaded model) adds the model's own
    SDPA call per decomposed layer, whose output cwcore's arithmetic must reproduce; ``"eager"`` runs the
    arithmetic TransformerLens runs, with no SDPA call."""
    model.config._attn_implementation = attention
    d = cwcore.decompose(model, layers=layers, input_ids=ids)
    return {l: (d[l].attention, d[l].contribution("inter")) for l in (range(len(d)) if layers is None else layers)}


# ------------------------------------------------------------------------------------------ inseq
def inseq_attention(inseq_model, tokenizer, ids, text):
    prefix = tokenizer.decode(ids[:1])
    out = inseq_model.attribute(input_texts=prefix, generated_texts=text, show_progress=False,
                                skip_special_tokens=False)
    return out.sequence_attributions[0]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Max abs difference where both are finite, and how many entries are not finite in either."""
    a, b = a.double(), b.double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    diff = (a - b).abs()[finite]
    return (diff.max().item() if diff.numel() else float("nan")), int((~finite).sum())


def median(xs):
    return statistics.median(xs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--inseq-rounds", type=int, default=3, help="inseq is timed in this many of the rounds")
    parser.add_argument("--no-inseq", action="store_true", help="time and compare cwcore and TransformerLens only")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    started = time.time()

    folder = packaged_model_path(args.model)
    model, tokenizer = cwcore.load_model(args.model)
    ids_list, text = gsm8k_ids(tokenizer, args.tokens)
    ids = torch.tensor([ids_list])
    num_layers = model.config.num_hidden_layers
    one, every = [args.layer], list(range(num_layers))

    from transformer_lens.model_bridge import TransformerBridge
    bridge = TransformerBridge.boot_transformers(str(folder), device="cpu", dtype=torch.float32)
    bridge.eval()

    import inseq
    inseq_model = None if args.no_inseq else inseq.load_model(str(folder), "attention", model_kwargs={"attn_implementation": "eager",
                                                                             "dtype": torch.float32})

    def sdpa_forward():
        model.config._attn_implementation = "sdpa"
        with torch.inference_mode():
            model(input_ids=ids)

    EAGER_NAME = "cwcore.decompose, all layers, model configured eager"
    jobs = {
        "model's SDPA forward": sdpa_forward,
        "cwcore.decompose, one layer": lambda: cw_weights(model, ids, one),
        "cwcore.decompose, all layers": lambda: cw_weights(model, ids, None),
        EAGER_NAME: lambda: cw_weights(model, ids, None, "eager"),
        "TL run_with_cache + weights as the formula reads, one layer": lambda: tl_weights(bridge, ids, one, False),
        "TL run_with_cache + weights as the formula reads, all layers": lambda: tl_weights(bridge, ids, every, False),
        "TL run_with_cache + weights in head space, one layer": lambda: tl_weights(bridge, ids, one, True),
        "TL run_with_cache + weights in head space, all layers": lambda: tl_weights(bridge, ids, every, True),
        "inseq attention (all layers, heads)": lambda: inseq_attention(inseq_model, tokenizer, ids_list, text),
    }
    inseq_name = "inseq attention (all layers, heads)"
    if args.no_inseq:
        del jobs[inseq_name]

    # ---------------------------------------------------------------- agreement (also the warm-up)
    cw_all = cw_weights(model, ids, None)
    tl_all = tl_weights(bridge, ids, every, False)
    tl_head = tl_weights(bridge, ids, every, True)
    with torch.inference_mode():
        model.config._attn_implementation = "eager"
        hf_logits = model(input_ids=ids).logits
        tl_logits = bridge(ids)
    logits_diff = (hf_logits - tl_logits).abs().max().item()
    if args.no_inseq:  # compare cwcore with itself: the inseq columns then read 0 and are not reported
        seq = None
        ins = torch.stack([cw_all[l][0][0] for l in every]).permute(3, 2, 0, 1)[:, :-1]
        target_ids = ids_list
    else:
        seq = inseq_attention(inseq_model, tokenizer, ids_list, text)
        ins = seq.target_attributions  # [key, step, layer, head]
        target_ids = [t.id for t in seq.target]
    inseq_same_ids = target_ids == ids_list
    # step s predicts token s+1; its attention row: the query that inseq's final forward reports for it
    n_steps = ins.shape[1]
    cw_att = torch.stack([cw_all[l][0][0] for l in every])  # [layer, head, q, k]
    ins_lhqk = ins.permute(2, 3, 1, 0)  # [layer, head, step, key]
    if not inseq_same_ids:
        raise RuntimeError(f"inseq tokenised the text into {len(target_ids)} tokens, not the {len(ids_list)} common ids")
    candidates = {}
    for offset in (0, 1):
        rows = torch.arange(n_steps) + offset
        if rows.max() < cw_att.shape[2]:
            candidates[offset] = max_abs(ins_lhqk.nan_to_num(0.0), cw_att[:, :, rows, :].to(ins.dtype))[0]
    offset = min(candidates, key=candidates.get)
    rows = torch.arange(n_steps) + offset
    per_layer = []
    for l in every:
        a_tl, n1 = max_abs(tl_all[l][0], cw_all[l][0])
        c_tl, n2 = max_abs(tl_all[l][1], cw_all[l][1])
        c_head, _ = max_abs(tl_head[l][1], cw_all[l][1])
        a_in, _ = max_abs(ins_lhqk[l].nan_to_num(0.0), cw_att[l][:, rows, :])
        per_layer.append({"layer": l, "attention TL": a_tl, "inter TL (formula)": c_tl,
                          "inter TL (head space)": c_head, "attention inseq": a_in,
                          "non-finite": n1 + n2})
    agg_diff = float("nan")
    if seq is not None:
        agg = seq.aggregate().target_attributions  # inseq's default: mean over layers, then heads
        agg_diff = max_abs(agg.T.nan_to_num(0.0), cw_att.mean(dim=(0, 1))[rows, :])[0]
    del cw_all, tl_all, tl_head, seq, ins, ins_lhqk

    # value_zeroing: tried once, on a short prefix (it runs a forward per zeroed token and layer)
    vz = {"ran": False, "error": None, "where": None}
    try:
        if args.no_inseq:
            raise RuntimeError("not tried (--no-inseq)")
        vz_model = inseq.load_model(str(folder), "value_zeroing",
                                    model_kwargs={"attn_implementation": "eager", "dtype": torch.float32})
        vz_model.attribute(input_texts=tokenizer.decode(ids_list[:4]), generated_texts=tokenizer.decode(ids_list[:8]),
                           show_progress=False, skip_special_tokens=False)
        vz["ran"] = True
    except Exception as error:  # noqa: BLE001 - the point is to report it
        frame = traceback.extract_tb(error.__traceback__)[-1]
        vz["error"] = f"{type(error).__name__}: {error}"
        vz["where"] = f"{os.path.relpath(frame.filename, sys.prefix)}:{frame.lineno} ({frame.name}): {frame.line}"
    vz_model = None

    # ---------------------------------------------------------------- timing, interleaved
    for name, job in jobs.items():
        if name != inseq_name:
            job()  # warm-up (inseq was warmed by the agreement run)
    times = {name: [] for name in jobs}
    cpu = {name: [] for name in jobs}
    order = list(jobs)
    for r in range(args.rounds):
        names = order[r % len(order):] + order[:r % len(order)]  # rotate, so no job always follows another
        for name in names:
            if name == inseq_name and len(times[name]) >= args.inseq_rounds:
                continue
            start, start_cpu = time.perf_counter(), time.process_time()
            jobs[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
        print(f"round {r + 1}/{args.rounds} done, {time.time() - started:.0f} s", file=sys.stderr, flush=True)
    load_end = os.getloadavg()

    med = {name: median(ts) for name, ts in times.items()}
    base = med["model's SDPA forward"]

    def reference(name):
        if name == "model's SDPA forward":
            return None
        return "cwcore.decompose, one layer" if "one layer" in name else "cwcore.decompose, all layers"

    def vs_cw(name):
        ref = reference(name)
        return float("nan") if ref is None else med[name] / med[ref]

    def paired(name):
        """Median over the rounds of (this job's time / cwcore's time in the same round)."""
        ref = reference(name)
        if ref is None:
            return float("nan")
        return median([a / b for a, b in zip(times[name], times[ref])])

    med_cpu = {name: median(ts) for name, ts in cpu.items()}

    def fmt(x):
        return "" if x != x else f"{x:.2f}x"

    lines = []
    lines.append(f"smollm2-135m, float32, {args.tokens} GSM8K tokens, batch 1, torch {torch.__version__} with "
                 f"{torch.get_num_threads()} threads, transformers {version('transformers')}, "
                 f"transformer-lens {version('transformer-lens')}, inseq {version('inseq')}; "
                 f"{args.rounds} interleaved rounds (inseq in {len(times.get(inseq_name, []))}), medians; "
                 f"load average {load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end; "
                 f"{os.cpu_count()} CPU cores; "
                 f"whole run {time.time() - started:.0f} s.")
    lines.append("")
    lines.append("| workload | median (s) | / SDPA forward | / cwcore, same layers | same, per-round median "
                 "| median CPU (s) | CPU / cwcore |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for name in jobs:
        ref = reference(name)
        cpu_ratio = float("nan") if ref is None else med_cpu[name] / med_cpu[ref]
        lines.append(f"| {name} | {med[name]:.3f} | {med[name] / base:.2f}x | {fmt(vs_cw(name))} | "
                     f"{fmt(paired(name))} | {med_cpu[name]:.2f} | {fmt(cpu_ratio)} |")
    head_space = "TL run_with_cache + weights in head space, all layers"
    lines.append("")
    lines.append(f"Configured eager (no SDPA call, the arithmetic TransformerLens runs), all layers: TransformerLens "
                 f"with head-space weights takes {med[head_space] / med[EAGER_NAME]:.2f}x cwcore's time "
                 f"({median([a / b for a, b in zip(times[head_space], times[EAGER_NAME])]):.2f}x by per-round "
                 f"ratios, CPU {med_cpu[head_space] / med_cpu[EAGER_NAME]:.2f}x).")
    lines.append("")
    if args.no_inseq:
        for row in per_layer:
            row["attention inseq"] = float("nan")
    worst = {k: max(row[k] for row in per_layer) for k in per_layer[0]
             if k not in ("layer", "non-finite") and not (args.no_inseq and "inseq" in k)}
    lines.append("Agreement with cwcore (max abs difference over all 30 layers, heads, queries and keys):")
    lines.append("")
    lines.append("| quantity | max abs difference | worst layer |")
    lines.append("|---|---:|---:|")
    for k, v in worst.items():
        layer = max(per_layer, key=lambda row: row[k])["layer"]
        lines.append(f"| {k} | {v:.2e} | {layer} |")
    if not args.no_inseq:
        lines.append(f"| inseq default aggregate (mean over layers, then heads) vs cwcore's mean | {agg_diff:.2e} | |")
    lines.append(f"| TL logits vs the model's eager logits | {logits_diff:.2e} | |")
    lines.append("")
    lines.append(f"Non-finite entries in either (cwcore gives NaN where ||o_i|| <= 1e-12): "
                 f"{sum(row['non-finite'] for row in per_layer)}. inseq's target tokens equal the common ids: "
                 f"{inseq_same_ids}; inseq's step s is query row s+{offset} ({n_steps} steps).")
    lines.append("")
    lines.append("Per layer (max abs difference against cwcore):")
    lines.append("")
    lines.append("| layer | attention TL | inter TL (formula) | inter TL (head space) | attention inseq |")
    lines.append("|---:|---:|---:|---:|---:|")
    for row in per_layer:
        lines.append(f"| {row['layer']} | {row['attention TL']:.1e} | {row['inter TL (formula)']:.1e} | "
                     f"{row['inter TL (head space)']:.1e} | {row['attention inseq']:.1e} |")
    lines.append("")
    if vz["ran"]:
        lines.append("inseq `value_zeroing` ran on an 8-token input.")
    else:
        lines.append(f"inseq `value_zeroing` fails: `{vz['error']}` at `{vz['where']}`.")
    report = "\n".join(lines)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times": times, "cpu": cpu, "medians": med, "per_layer": per_layer, "aggregate_diff": agg_diff,
                       "logits_diff": logits_diff, "value_zeroing": vz, "load_start": load_start,
                       "load_end": load_end, "inseq_offset": offset, "inseq_same_ids": inseq_same_ids}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
