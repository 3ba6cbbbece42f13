"""The ``cwcore`` command line.

    cwcore explain "The cat sat on the mat" --model smollm2-135m --layer 5 --kind inter --out fig.png
    cwcore models
    cwcore cache [prune [--all] [--dry-run]]

Bad input ends with one ``error: ...`` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

__all__ = ["main", "explain"]

_FORMATS = {".png", ".pdf", ".svg", ".jpg", ".jpeg"}


class UsageError(Exception):
    """Bad input: reported as one line, without a traceback."""


def _check_output_path(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in _FORMATS:
        raise UsageError(f"output file must end in one of {', '.join(sorted(_FORMATS))}: {out}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {out}: permission denied")
    return path


def explain(text: str, model, tokenizer, layer: int | None = None, head: int | None = None, kind: str = "inter",
            model_name: str | None = None):
    """Attention beside contribution weights for one text.

    Returns ``(figure, attention [query, key], contribution [query, key], tokens)``; with ``head``
    None the token-level views are drawn (attention averaged over heads, contributions summed).
    """
    import matplotlib.pyplot as plt

    from .core.architectures import attention_blocks
    from .core.decomposition import decompose
    from .plotting import contribution_heatmap, set_style

    if not text.strip():
        raise UsageError("the text is empty")
    if kind not in ("intra", "inter"):
        raise UsageError(f"--kind must be intra or inter, not {kind!r}")
    if kind == "intra" and head is None:
        raise UsageError("--kind intra needs --head: intra-head weights are defined per head")
    num_layers = len(attention_blocks(model))
    layer = num_layers // 2 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise UsageError(f"layer {layer} out of range: the model has layers 0..{num_layers - 1}")
    inputs = tokenizer(text, return_tensors="pt")
    inputs = {k: v.to(model.device) for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    d = decompose(model, layers=[layer], **inputs)[layer]
    num_heads = d.attention.shape[1]
    if head is not None and not 0 <= head < num_heads:
        raise UsageError(f"head {head} out of range: layer {layer} has heads 0..{num_heads - 1}")
    if head is None:
        attention, contribution = d.token_level("attention")[0], d.token_level("contribution", kind)[0]
    else:
        attention, contribution = d.attention[0, head], d.contribution(kind)[0, head]
    # Keys a query cannot see (causal mask, sliding window) are not weights: draw them grey.
    hidden = d.attention[0].sum(0) == 0
    attention = attention.masked_fill(hidden, float("nan")).cpu().numpy()
    contribution = contribution.masked_fill(hidden, float("nan")).cpu().numpy()
    tokens = [tokenizer.decode([int(t)]) for t in inputs["input_ids"][0]]

    set_style()
    size = max(5.0, 0.32 * len(tokens) + 2.5)
    fig, axes = plt.subplots(1, 2, figsize=(2 * size, size), constrained_layout=True)
    which = "all heads" if head is None else f"head {head}"
    contribution_heatmap(axes[0], attention, tokens, f"attention α ({which})")
    contribution_heatmap(axes[1], contribution, tokens, f"{kind}-head contribution weights c ({which})")
    name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    fig.suptitle(f"{name} · layer {layer}")
    return fig, attention, contribution, tokens


def _explain_command(args) -> None:
    import matplotlib

    matplotlib.use("Agg")  # the command line draws to a file, never to a window
    from .cache import atomic_write_bytes
    from .models import load_model

    out = _check_output_path(args.out)
    if not args.text.strip():
        raise UsageError("the text is empty")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the error line, if any, stays the only line on stderr
    try:
        model, tokenizer = load_model(args.model)
    except ValueError as error:  # ModelNotFoundError and bad dtype/device strings
        raise UsageError(str(error)) from None
    fig, *_ = explain(args.text, model, tokenizer, layer=args.layer, head=args.head, kind=args.kind,
                      model_name=args.model)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=out.suffix.lower().lstrip(".").replace("jpg", "jpeg"))
    atomic_write_bytes(out, buffer.getvalue())
    print(f"wrote {out}")


def _models_command(args) -> None:
    from .models import PACKAGED_MODELS

    for name, description in PACKAGED_MODELS.items():
        print(f"{name:16s} {description}")


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1024
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}"


def _cache_command(args) -> None:
    from .cache import cache_root, prune, result_runs

    root = cache_root()
    if args.action == "prune":
        gone = prune(root, everything=args.all, dry_run=args.dry_run)
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {len(gone)} cached run(s), {_size(gone['bytes'].sum())}, under {root / 'results'}")
        return
    runs = result_runs(root)
    print(f"cwcore cache: {root}")
    if runs.empty:
        print("no cached results")
        return
    table = runs.groupby("namespace").agg(runs=("key", "size"), current=("current", "sum"), pieces=("pieces", "sum"),
                                          size=("bytes", "sum"))
    for name, row in table.iterrows():
        print(f"  {name:28s} {int(row['runs']):4d} runs ({int(row['current'])} current)  {int(row['pieces']):6d} pieces"
              f"  {_size(row['size']):>9s}")
    stale = runs[~runs["current"]]
    print(f"{len(stale)} run(s) written by other versions of cwcore ({_size(stale['bytes'].sum())}) are never read "
          "again: `cwcore cache prune` deletes them")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cwcore", description="Contribution weights of transformer attention.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="draw attention beside contribution weights for a text")
    ex.add_argument("text")
    ex.add_argument("--model", default="smollm2-135m", help="packaged name, hub id or local path")
    ex.add_argument("--layer", type=int, default=None, help="attention layer (default: the middle one)")
    ex.add_argument("--head", type=int, default=None, help="one head (default: all heads, token level)")
    ex.add_argument("--kind", default="inter", choices=["intra", "inter"])
    ex.add_argument("--out", required=True, help="figure file (.png, .pdf, .svg, .jpg)")
    ex.set_defaults(run=_explain_command)
    models = sub.add_parser("models", help="list the packaged models")
    models.set_defaults(run=_models_command)
    cache = sub.add_parser("cache", help="what the result cache holds; `prune` deletes what no code reads")
    cache.add_argument("action", nargs="?", default="info", choices=["info", "prune"])
    cache.add_argument("--all", action="store_true", help="prune: delete every cached result, current ones too")
    cache.add_argument("--dry-run", action="store_true", help="prune: only say what would be deleted")
    cache.set_defaults(run=_cache_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # e.g. the disk filled up while writing the figure
        print(f"error: {error.strerror or error}: {getattr(error, 'filename', '') or ''}".rstrip(": "), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
