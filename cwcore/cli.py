"""The ``cwcore`` command line.

    cwcore explain "The cat sat on the mat" --model smollm2-135m --layer 5 --kind inter --out fig.png
    cwcore explain "The cat sat on the mat" --model smollm2-135m --out fig.html   (the interactive explorer)
    cwcore explain --file report.txt --model gemma3-270m --summary --out report.html   (a long document)
    cwcore models
    cwcore cache [prune [--all] [--dry-run] | verify [--repair]]

Bad input ends with one ``cwcore: error: ...`` line and exit status 2 (``--debug`` or
``CWCORE_DEBUG=1``: the traceback); ``--no-cache`` runs without the result cache."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "explain", "run_command", "debug_requested", "UsageError", "ArgumentParser"]

_FORMATS = {".png", ".pdf", ".svg", ".jpg", ".jpeg", ".html"}  # .html: the interactive explorer (cwcore.explorer)
#: the widest figure `cwcore explain` draws (inches, both panels); longer texts get thinned labels
MAX_FIGURE_WIDTH = 40.0
DEFAULT_MAX_TOKENS = 512


class UsageError(Exception):
    """Bad input: reported as one line, without a traceback."""


def _check_output_path(out: str) -> Path:
    path = Path(out)
    if path.suffix.lower() not in _FORMATS:
        raise UsageError(f"output file must end in one of {', '.join(sorted(_FORMATS))}: {out}")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {out}: folder {parent} does not exist")
    if path.is_dir():
        raise UsageError(f"cannot write {out}: it is a folder")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"cannot write {out}: permission denied")
    try:  # a folder the access check passes may still take no new file (/proc, a read-only mount)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise UsageError(f"cannot write {out}: cannot create a file in {parent} ({error.strerror or error})") from None
    os.close(fd)
    os.unlink(probe)
    return path


@contextlib.contextmanager
def _writing(out: Path, only_writes: bool = False):
    """An ``OSError`` writing ``out`` (or its temporary file beside it) as one line naming ``out``; ``only_writes``:
    the block does nothing else, so any ``OSError`` is one (a full disk's has no file name)."""
    try:
        yield
    except OSError as error:
        beside = error.filename is not None and Path(error.filename).parent == out.parent
        if not (only_writes or beside):
            raise
        raise UsageError(f"cannot write {out}: {error.strerror or error}") from None


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise UsageError(f"the text must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a command-line argument that was not UTF-8 (surrogate escapes)
        raise UsageError(f"the text is not valid UTF-8 (a byte that is no character at position {err.start}); "
                         "pass UTF-8 text") from None
    if not text.strip():
        raise UsageError("the text is empty")


def _check_length(n_tokens: int, model, max_tokens: int | None) -> None:
    """Refuse a text of ``n_tokens`` tokens longer than ``max_tokens`` (the maps' limit; None for the summary
    page) or than the model's context, saying how long it is."""
    if max_tokens is not None and n_tokens > max_tokens:
        raise UsageError(f"the text has {n_tokens} tokens and the maps would have {n_tokens}x{n_tokens} cells; "
                         f"give a shorter text, or raise --max-tokens (now {max_tokens})")
    from .core.inputs import context_length

    limit = context_length(model)
    if limit is not None and n_tokens > limit:
        raise UsageError(f"the text has {n_tokens} tokens but the model reads at most {limit}; give a shorter text")


def explain(text: str, model, tokenizer, layer: int | None = None, head: int | None = None, kind: str = "inter",
            model_name: str | None = None, max_tokens: int | None = DEFAULT_MAX_TOKENS):
    """Attention beside contribution weights for one text: ``(figure, attention [query, key], contribution
    [query, key], tokens)``; ``head`` None draws the token-level views. Token labels come from the text's
    offsets (:func:`cwcore.tokens.token_labels`); more than ``max_tokens`` tokens is refused."""
    import matplotlib.pyplot as plt

    from .core.architectures import attention_blocks, decomposable_layers, input_device
    from .core.decomposition import decompose
    from .plotting import contribution_heatmap, set_style

    from .core.inputs import is_integer_number, plain_integer

    _check_text(text)
    for name, value in (("layer", layer), ("head", head)):  # from Python: True was layer 1, 1.5 an IndexError
        if value is not None and not is_integer_number(value):
            raise UsageError(f"{name} must be an integer (or None), not {value!r}")
    layer, head = plain_integer(layer), plain_integer(head)
    if kind not in ("intra", "inter"):
        raise UsageError(f"--kind must be intra or inter, not {kind!r}")
    if kind == "intra" and head is None:
        raise UsageError("--kind intra needs --head: intra-head weights are defined per head")
    blocks = attention_blocks(model)
    num_layers = len(blocks)
    if layer is None:  # the middle block cwcore can decompose (a model may number blocks it refuses)
        layers = decomposable_layers(model)
        if not layers:
            raise UsageError(f"no attention block of this model can be decomposed: {blocks[0].unsupported}")
        layer = layers[len(layers) // 2]
    if not -num_layers <= layer < num_layers:
        raise UsageError(f"layer {layer} out of range: the model has layers 0..{num_layers - 1} "
                         f"(or -{num_layers}..-1 from the end)")
    layer %= num_layers  # negative layers count from the end, as everywhere in cwcore
    from .tokens import token_labels

    inputs = tokenizer(text, return_tensors="pt", verbose=False)
    n_tokens = int(inputs["input_ids"].shape[1])
    _check_length(n_tokens, model, max_tokens)
    device = input_device(model)  # not model.device: an offloaded model's weights are on the meta device
    inputs = {k: v.to(device) for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    d = decompose(model, layers=[layer], **inputs)[layer]
    num_heads = d.attention.shape[1]
    if head is not None and not -num_heads <= head < num_heads:
        raise UsageError(f"head {head} out of range: layer {layer} has heads 0..{num_heads - 1} "
                         f"(or -{num_heads}..-1 from the end)")
    head = None if head is None else head % num_heads  # from the end, as the layer
    if head is None:
        attention, contribution = d.token_level("attention")[0], d.token_level("contribution", kind)[0]
    else:
        attention, contribution = d.attention[0, head], d.contribution(kind)[0, head]
    # Keys a query cannot see (causal mask, sliding window) are not weights: draw them grey.
    hidden = d.attention[0].sum(0) == 0
    attention = attention.masked_fill(hidden, float("nan")).cpu().numpy()
    contribution = contribution.masked_fill(hidden, float("nan")).cpu().numpy()
    tokens = token_labels(tokenizer, text)
    if len(tokens) != n_tokens:  # a tokenizer whose offsets disagree with its own call: label the ids
        tokens = token_labels(tokenizer, inputs["input_ids"][0])

    set_style()
    size = min(max(5.0, 0.32 * len(tokens) + 2.5), MAX_FIGURE_WIDTH / 2)
    fig, axes = plt.subplots(1, 2, figsize=(2 * size, size), constrained_layout=True)
    which = "all heads" if head is None else f"head {head}"
    contribution_heatmap(axes[0], attention, tokens, f"attention α ({which})")
    contribution_heatmap(axes[1], contribution, tokens, f"{kind}-head contribution weights c ({which})")
    name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    capped = size == MAX_FIGURE_WIDTH / 2 and len(tokens) > 40
    fig.suptitle(f"{name} · layer {layer}" + (f" · {len(tokens)} tokens, one label per "
                                               f"{-(-len(tokens) // 40)}" if capped else ""))
    return fig, attention, contribution, tokens


def _explain_command(args) -> None:
    import matplotlib

    matplotlib.use("Agg")  # the command line draws to a file, never to a window
    from .cache import atomic_write_bytes
    from .models import load_model

    out = _check_output_path(args.out)
    if args.text is None and args.file is None:
        raise UsageError("no text: give the text, or --file with a UTF-8 text file")
    if args.text is not None and args.file is not None:
        raise UsageError("give the text, or --file with a UTF-8 text file, not both")
    if args.file is not None:
        try:
            args.text = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read {args.file}: {error}") from None
    _check_text(args.text)
    if args.summary and out.suffix.lower() != ".html":
        raise UsageError("--summary writes the long-document page: give --out a .html file")
    # an option the chosen page does not read is refused, not silently dropped
    summary_only = [flag for flag, value in (("--query", args.query), ("--top-k", args.top_k)) if value is not None]
    maps_only = [flag for flag, value in (("--head", args.head), ("--max-tokens", args.max_tokens)) if value is not None]
    if summary_only and not args.summary:
        one = len(summary_only) == 1
        raise UsageError(f"{' and '.join(summary_only)} {'applies' if one else 'apply'} to the long-document page only: "
                         f"add --summary, or leave {'it' if one else 'them'} out")
    if maps_only and args.summary:
        one = len(maps_only) == 1
        raise UsageError(f"{' and '.join(maps_only)} {'does' if one else 'do'} not apply to --summary (every head's "
                         f"terms, up to the model's context): leave {'it' if one else 'them'} out")
    top_k = 5 if args.top_k is None else args.top_k
    max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the error line, if any, stays the only line on stderr
    # ModelNotFoundError, a device this torch lacks, ...: one line from main()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.summary or out.suffix.lower() == ".html":
        # the pages refuse a text longer than the model's context (the explorer's one longer than --max-tokens)
        # here, in the command's words, as explain() does for the figure; verbose=False: not transformers' own
        # warning about the length first
        _check_length(len(tokenizer(args.text, verbose=False)["input_ids"]), model,
                      None if args.summary else max_tokens)
    if args.summary:  # a long document: each key's total over the text, and the top terms of every query
        from .explorer import write_long_explorer

        try:
            with _writing(out):
                write_long_explorer(out, model, tokenizer, args.text, model_name=args.model, top_k=top_k,
                                    kind=args.kind, query=args.query, layer=args.layer)
        except ValueError as error:  # a layer or query out of range, a text longer than the model's context
            raise UsageError(str(error)) from None
        print(f"wrote {out} ({_size(out.stat().st_size)})")  # a small page read "(0.0 MB)" before
        return
    if out.suffix.lower() == ".html":  # every layer, head and quantity in one offline page
        from .explorer import write_explorer

        try:
            with _writing(out):
                write_explorer(out, model, tokenizer, args.text, model_name=args.model,
                               start={"layer": args.layer, "head": args.head, "quantity": args.kind})
        except ValueError as error:  # a layer or head out of range, a model cwcore refuses
            raise UsageError(str(error)) from None
        print(f"wrote {out} ({_size(out.stat().st_size)})")
        return
    fig, *_ = explain(args.text, model, tokenizer, layer=args.layer, head=args.head, kind=args.kind,
                      model_name=args.model, max_tokens=max_tokens)
    buffer = io.BytesIO()
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(buffer, format=out.suffix.lower().lstrip(".").replace("jpg", "jpeg"))
    import re

    missing = sorted({chr(int(m.group(1))) for w in caught if "missing from font" in str(w.message)
                      for m in [re.match(r"Glyph (\d+)", str(w.message))] if m})
    with _writing(out, only_writes=True):
        atomic_write_bytes(out, buffer.getvalue())
    print(f"wrote {out}")
    if missing:  # the labels hold the characters; the installed fonts cannot draw them
        print(f"cwcore: note: no installed font draws {', '.join(missing)}; they show as boxes in {out.name} "
              "(install e.g. Noto Sans CJK / Noto Emoji, or write .html)", file=sys.stderr)


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


def _verify_command(root: Path, repair: bool) -> int:
    from .cache import verify
    from .models import verify_models

    problems = verify(root, repair=repair) + verify_models(repair=repair)
    for p in problems:
        print(f"{p['path']}: {p['problem']} [{p['action']}]")
    fixed = sum(p["action"] in ("deleted", "converted again") for p in problems)
    if not problems:
        print(f"cwcore cache: {root}: every cached piece and converted model verifies")
        return 0
    repairable = sum(p["action"] != "left alone" for p in problems)
    print(f"{len(problems)} problem(s) under {root}" + (
        f", {fixed} repaired" if repair else
        "; `cwcore cache verify --repair` repairs " + ("them" if repairable == len(problems) else f"{repairable} of them")))
    return 0 if repair and fixed == len(problems) else 1


def _cache_command(args) -> int | None:
    from .cache import cache_root, prune, result_runs

    owner = {"--repair": "verify", "--all": "prune", "--dry-run": "prune"}  # the action each flag changes
    given = {"--repair": args.repair, "--all": args.all, "--dry-run": args.dry_run}
    misplaced = [flag for flag, on in given.items() if on and owner[flag] != args.action]
    if misplaced:  # e.g. `cwcore cache --all` would print the summary and delete nothing
        raise UsageError("; ".join(f"{flag} belongs to `cwcore cache {owner[flag]}`" for flag in misplaced)
                         + f", not to `cwcore cache {args.action}`")
    root = cache_root()
    if root.exists() and not root.is_dir():
        raise UsageError(f"the cache path {root} is a file, not a folder (set CWCORE_CACHE to a folder)")
    if args.action == "verify" and not root.is_dir():
        raise UsageError(f"the cache folder {root} does not exist: there is nothing to verify (is CWCORE_CACHE right?)")
    if args.action == "verify":
        return _verify_command(root, args.repair)
    if args.action == "prune":
        gone = prune(root, everything=args.all, dry_run=args.dry_run)
        verb = "would delete" if args.dry_run else "deleted"
        print(f"{verb} {len(gone)} cached run(s), {_size(gone['bytes'].sum())}, under {root / 'results'}")
        # the runs prune spares, said (before: "deleted 0" right after a run, without a word of why)
        runs = result_runs(root)
        candidates = runs if args.all else runs[~runs["current"].astype(bool)]
        recent = int((candidates["modified"] >= time.time() - 60).sum())
        if recent:
            print(f"spared {recent} run(s) written in the last minute (a process may still be writing them): "
                  "prune again later to delete them")
        if gone.attrs.get("in_use"):  # before: spared without a word
            print(f"spared {gone.attrs['in_use']} run(s) a running process is using (it holds the run's lock): "
                  "prune again when it has finished")
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose own errors (a value of the wrong type, an unknown flag, a misspelt command, a
    missing argument) end as every other bad input does: one ``<command>: error: ...`` line, exit status 2, no
    usage block. ``command`` is the prefix (default ``prog``); a subcommand's parser inherits its parent's."""

    def __init__(self, *args, command: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.command = command or self.prog

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", functools.partial(type(self), command=self.command))
        return super().add_subparsers(**kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.command}: error: {' '.join(str(message).split())}\n")


def _count(text: str) -> int:
    """An argparse type: a whole number of at least 1 (a count of tokens or terms)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="cwcore", description="Contribution weights of transformer attention.")
    common = argparse.ArgumentParser(add_help=False)  # accepted before and after the command
    for p, default in ((parser, False), (common, argparse.SUPPRESS)):
        p.add_argument("--debug", action="store_true", default=default,
                       help="show the traceback of any error (or CWCORE_DEBUG=1)")
        p.add_argument("--no-cache", action="store_true", default=default,
                       help="run without the result cache (or CWCORE_NO_CACHE=1)")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="draw attention beside contribution weights for a text", parents=[common])
    ex.add_argument("text", nargs="?", default=None, help="the text (or --file)")
    ex.add_argument("--file", default=None, help="read the text from this UTF-8 file (a long document)")
    ex.add_argument("--summary", action="store_true",
                    help="long documents (up to the model's context): write the summary page (.html) instead of the "
                         "maps: each token's total contribution as a heat strip over the text, and the top terms of "
                         "the query you pick; no [query, key] map is computed")
    ex.add_argument("--query", type=int, default=None, help="--summary: the first query shown (default: the last token)")
    ex.add_argument("--top-k", type=_count, default=None,
                    help="--summary: top (head, key) terms kept per query (default 5)")
    ex.add_argument("--model", default="smollm2-135m", help="packaged name, hub id or local path")
    add_model_options(ex)
    ex.add_argument("--layer", type=int, default=None, help="attention layer (default: the middle one)")
    ex.add_argument("--head", type=int, default=None, help="one head (default: all heads, token level; not with --summary)")
    ex.add_argument("--kind", default="inter", choices=["intra", "inter"],
                    help="contribution weights against the layer's output (inter, default) or within one head "
                         "(intra; a figure needs --head)")
    ex.add_argument("--out", required=True, help="figure file (.png, .pdf, .svg, .jpg), or .html for the interactive explorer "
                    "(every layer, head and quantity; --layer, --head and --kind pick the first view)")
    ex.add_argument("--max-tokens", type=_count, default=None,
                    help=f"refuse longer texts (default {DEFAULT_MAX_TOKENS}; not with --summary, which reads up to the "
                         "model's context)")
    ex.set_defaults(run=_explain_command)
    models = sub.add_parser("models", help="list the packaged models", parents=[common])
    models.set_defaults(run=_models_command)
    cache = sub.add_parser("cache", help="what the result cache holds; `prune` deletes what no code reads, "
                                         "`verify` checks every piece and converted model", parents=[common])
    cache.add_argument("action", nargs="?", default="info", choices=["info", "prune", "verify"],
                       help="info (default): size and runs per namespace; prune: delete what no code reads; verify: "
                            "check every piece and converted model")
    cache.add_argument("--repair", action="store_true", help="verify: delete damaged pieces, convert damaged "
                                                             "models again (exit 0 when everything was repaired)")
    cache.add_argument("--all", action="store_true", help="prune: delete every cached result, current ones too "
                       "(runs written in the last minute or in use by a process are spared, and said)")
    cache.add_argument("--dry-run", action="store_true", help="prune: only say what would be deleted")
    cache.set_defaults(run=_cache_command)
    return parser


_PACKAGE = Path(__file__).resolve().parent


def _raised_in_cwcore(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is cwcore's own code (a refused input),
    not a library's (more likely a bug of cwcore's call)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)


def _user_error(error: BaseException) -> bool:
    from .core.architectures import UnsupportedModelError
    from .core.inputs import InputError
    from .models import ModelCacheError, ModelNotFoundError

    if isinstance(error, (UsageError, InputError, UnsupportedModelError, ModelNotFoundError, ModelCacheError)):
        return True
    return isinstance(error, (TypeError, ValueError, IndexError, FileNotFoundError)) and _raised_in_cwcore(error)


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text


def _short_cache_warnings() -> None:
    """Show cwcore's cache warnings (a damaged piece, a model converted again) as one line each."""
    import warnings

    from .cache import CacheWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, CacheWarning):
            print(str(message), file=sys.stderr if file is None else file)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = args.debug or os.environ.get("CWCORE_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    if args.no_cache:
        os.environ["CWCORE_NO_CACHE"] = "1"
    import warnings

    shown = warnings.showwarning
    if not debug:
        _short_cache_warnings()
    try:
        return _run(args, debug)
    finally:
        warnings.showwarning = shown


def _run(args, debug: bool) -> int:
    return run_command("cwcore", lambda: args.run(args), debug)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``, the one spelling of how to load the model on every command line that
    loads one (:func:`cwcore.load_model`'s ``dtype`` and ``device``)."""
    parser.add_argument("--dtype", default=None, help="the model's dtype, e.g. bfloat16 (default float32; the "
                                                      "geometry is float32 either way)")
    parser.add_argument("--device", default=None, help="where the model runs, e.g. cuda or cuda:1 (default cpu)")


def given_flags(parser: argparse.ArgumentParser, argv, names) -> set[str]:
    """Which of the flags ``names`` (their ``dest``) ``argv`` gives, told apart from their defaults by parsing
    again with a sentinel default (abbreviations and ``--flag=value`` included); ``parser`` is a fresh one."""
    unset = object()
    parser.set_defaults(**{name: unset for name in names})
    return {name for name, value in vars(parser.parse_args(argv)).items() if name in names and value is not unset}


@contextlib.contextmanager
def loading_bar(shown: bool):
    """transformers' own progress bars ("Loading weights") hidden inside the block unless ``shown`` (a command
    line's ``--no-progress``), as they were after it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not shown:
            hf_logging.enable_progress_bar()


def check_block_size(block_size: int, model) -> None:
    """Refuse a ``--block-size`` longer than the model's context, in the command line's words."""
    from .core.inputs import context_length

    limit = context_length(model)
    if limit is not None and block_size > limit:
        raise UsageError(f"--block-size {block_size} is longer than the model's context ({limit} tokens): "
                         f"give at most {limit}")


def sampled_blocks(make, block_size: int, data: str, documents: bool):
    """The blocks ``make()`` returns (:func:`cwcore.data.document_blocks` when ``documents``, else
    :func:`cwcore.data.lm_blocks`); none at all is refused in one line naming ``--block-size``, without the
    data module's warning about the shortfall (a partial one is still warned about)."""
    import warnings

    blocks = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            blocks = make()
    finally:  # the data module's warnings are kept (a partial shortfall), unless no block at all is refused below
        if blocks is None or len(blocks):
            for warning in caught:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if len(blocks) == 0:
        what = (f"no document of {data} is {block_size} tokens long" if documents
                else f"{data} holds fewer than {block_size} tokens in all")
        raise UsageError(f"--block-size {block_size}: {what}; give a smaller --block-size")
    return blocks


def debug_requested(argv: list[str] | None = None) -> bool:
    """Whether ``--debug`` is on the command line (``argv``, default ``sys.argv``) or ``CWCORE_DEBUG`` is set."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # argparse takes an abbreviation ("--debu"): so does this check, made before parsing
    return (any(a.startswith("--deb") and "--debug".startswith(a) for a in argv)
            or os.environ.get("CWCORE_DEBUG", "").strip().lower() in ("1", "true", "yes", "on"))


def run_command(prog: str, body, debug: bool, *, user_errors: tuple = ()) -> int:
    """The one error path of every command line: runs ``body()`` and returns its exit status. Bad input
    (including ``user_errors``) ends with one ``<prog>: error: ...`` line and status 2; any other
    exception is a bug of cwcore, one line and status 1; ``debug`` re-raises."""
    restore = _terminate_as_interrupt()
    try:
        code = body()
    except KeyboardInterrupt as stop:
        if debug:
            raise
        terminated = isinstance(stop, Terminated)
        print(f"{prog}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 143 if terminated else 130
    except Exception as error:  # noqa: BLE001 - every error ends in one line unless --debug
        if debug:
            raise
        if isinstance(error, user_errors) or _user_error(error):
            print(f"{prog}: error: {_one_line(error)}", file=sys.stderr)
            return 2
        if isinstance(error, OSError):  # e.g. the disk filled up while writing a table
            where = getattr(error, "filename", "") or ""
            print(f"{prog}: error: {error.strerror or error}" + (f": {where}" if where else ""), file=sys.stderr)
            return 2
        print(f"{prog}: error: internal error {type(error).__name__}: {_one_line(error)} (this is a bug of cwcore; "
              "run again with --debug or CWCORE_DEBUG=1 for the traceback, and report it)", file=sys.stderr)
        return 1
    finally:
        restore()
    return int(code or 0)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler's time limit), raised where Ctrl-C would be: the same clean-up runs
    (a book build shuts its notebook kernel down, a cache write is abandoned before it is renamed into place)."""


def _terminate_as_interrupt():
    """Turn SIGTERM into :class:`Terminated` while a command runs (main thread only); returns the undo."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
