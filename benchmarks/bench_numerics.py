"""How fast this CPU multiplies in float32 and bfloat16, and what a model's forward achieves of it.

Is there a faster numeric path? A bfloat16 forward is worth trying only where the
CPU multiplies bfloat16 faster than float32 (avx512_bf16/AMX), and only if the primary estimates barely
move. This script measures the first half on one thread: a square matmul in both dtypes (GFLOP/s), then
the forward of ``--model`` on ``--batch`` web-text documents of ``--tokens`` tokens in both dtypes
(seconds, achieved GFLOP/s counted as 2 x non-embedding parameters x tokens plus the attention products,
and how far the bfloat16 logits' next-token NLL is from float32's). Prints a Markdown table and the CPU's
capability as torch reports it.

    python benchmarks/bench_numerics.py --model smollm2-135m --batch 4 --tokens 128

``--check-documents N`` then runs the second half: chapter 4's ladder cells of the primary family (both
main protocols, the absolute sign) on the first N documents of each data set with the model in
bfloat16 (the geometry in float32, as always), and compares every primary estimate with the one the
committed float32 rows of the same documents give (``data/results/evidence``): the path is acceptable
only if each moves by less than a tenth of its margin.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import pandas as pd
import torch
import torch.nn.functional as F

from cwcore.data import document_blocks, load_dataset
from cwbook import ladder as evidence
from cwcore.models import load_model


def best_of(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (seconds), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_gflops(size: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size ** 3 / best_of(lambda: a @ b, repeats) / 1e9


def forward_flops(model, batch: int, tokens: int) -> float:
    """2 x (parameters outside the embedding) x tokens, plus QK^T and AV: 4 x layers x tokens^2 x width."""
    cfg = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if getattr(cfg, "tie_word_embeddings", False):  # the LM head is the embedding, still multiplied
        params += model.get_input_embeddings().weight.numel()
    width = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    return batch * (2 * params * tokens + 4 * cfg.num_hidden_layers * tokens ** 2 * width)


def nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean next-token NLL, in float32: ``[batch]``."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none").mean(-1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--size", type=int, default=1024, help="matmul side")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--check-documents", type=int, default=0,
                        help="documents of the primary family's bfloat16 check (0: no check)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        rows.append((f"{name} matmul, {args.size} x {args.size}",
                     f"{matmul_gflops(args.size, dtype, args.repeats):.1f} GFLOP/s"))
    fp32, tokenizer = load_model(args.model, dtype="float32", device="cpu")
    blocks = document_blocks(load_dataset("web-text"), tokenizer, args.tokens, args.batch, seed=0)
    ids = torch.tensor(blocks["input_ids"])
    flops = forward_flops(fp32, args.batch, args.tokens)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = fp32 if dtype == torch.float32 else load_model(args.model, dtype="bfloat16", device="cpu")[0]
        with torch.inference_mode():
            seconds = best_of(lambda: model(input_ids=ids), args.repeats)
            out[name] = nll(model(input_ids=ids).logits, ids)
        rows.append((f"{args.model} forward, {name}, {args.batch} x {args.tokens} tokens",
                     f"{seconds:.3f} s, {flops / seconds / 1e9:.1f} GFLOP/s"))
    drift = (out["bfloat16"] - out["float32"]).abs().max().item()
    rows.append(("max |NLL bfloat16 - NLL float32| per sequence", f"{drift:.4f} nats"))
    print(f"CPU capability (torch): {torch.backends.cpu.get_cpu_capability()}; {platform.processor() or ''} "
          f"threads {args.threads}; load average before {os.getloadavg()[0]:.2f}")
    print(f"forward cost counted: {flops / 1e9:.1f} GFLOP per batch\n")
    print("| measurement | value |\n|---|---:|")
    for what, value in rows:
        print(f"| {what} | {value} |")
    if args.check_documents:
        print()
        check_primary(args.model, args.check_documents)
    return 0


def check_primary(model: str, documents: int) -> None:
    """Print each primary estimate of ``model`` on its first ``documents`` documents in float32 (the committed
    rows) and bfloat16 (recomputed, uncached), with the difference against a tenth of the margin."""
    from cwbook import evidence_export as ee

    loaded = load_model(model, dtype="bfloat16", device="cpu")
    out = []
    for data in evidence.PRIMARY["data"]:
        committed, meta = ee.read_committed(model, data)
        ids = meta["document_ids"][:documents]
        fp32 = committed[committed["document"].isin(ids) & (committed["variant"] == "main")
                         & (committed["importance"] == evidence.PRIMARY["importance"])]
        t0 = time.monotonic()
        bf16 = ee.per_document("evidence", model, data, documents, ("default", "per-head"),
                               (evidence.PRIMARY["importance"],), cache=False, loaded=loaded, variants=())
        seconds = time.monotonic() - t0
        grids = ee.grids_of(meta if "grids" in meta else ee.notebook_parameters("evidence", model))
        for name, rows in (("float32", fp32), ("bfloat16", bf16)):
            rows = ee.whole_seeds(rows).drop(columns=["data", "model", "delta_nll"])
            _, ladder = evidence.evidence_tables(rows, grids=grids, n_bootstrap=200, seed=0, n_permutations=0)
            ladder = ladder[[evidence.is_primary(model, data, r.mode, r.protocol, r.importance, r.range, r.lower,
                                                 r.higher) for r in ladder.itertuples()]]
            out.append(ladder.assign(data=data, dtype=name, sweep_s=seconds if name == "bfloat16" else None))
    table = pd.concat(out, ignore_index=True)
    keys = ["data", "mode", "protocol", "lower", "higher"]
    wide = table.pivot_table(index=keys, columns="dtype", values="difference", aggfunc="first").reset_index()
    wide["moved"] = (wide["bfloat16"] - wide["float32"]).abs()
    wide["tenth of margin"] = [evidence.MARGINS[m] / 10 for m in wide["mode"]]
    wide["within"] = wide["moved"] < wide["tenth of margin"]
    print(f"{model}, first {documents} documents per data set, primary family (absolute, full range); "
          f"bfloat16 sweeps {', '.join(f'{s:.0f} s' for s in table['sweep_s'].dropna().unique())}")
    print(wide.to_markdown(index=False, floatfmt=".5f"))
    print(f"\n{int(wide['within'].sum())} of {len(wide)} primary estimates move by less than a tenth of their margin")


if __name__ == "__main__":
    raise SystemExit(main())
