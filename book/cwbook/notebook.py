"""Helpers every notebook of the book imports: numbers, phrases and tables quoted in the prose."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Iterable

__all__ = ["note", "note_md", "note_ci", "tick", "show", "plain", "SinkRun"]


def plain(value):
    """``value`` as a plain Python object: numpy and torch scalars (anything with ``.item()``) unwrapped."""
    return value.item() if hasattr(value, "item") else value


def note(name: str, value) -> None:
    """Glue a number quoted in the prose under ``name`` (``{glue:text}`name:.2f```), not displayed here."""
    from myst_nb import glue

    glue(name, plain(value), display=False)


def note_md(name: str, text: str) -> None:
    """Glue a phrase of inline Markdown under ``name`` (``{glue:md}`name```), not displayed here."""
    from IPython.display import Markdown
    from myst_nb import glue

    glue(name, Markdown(text), display=False)


def note_ci(name: str, estimate_low_high: Iterable) -> None:
    """Glue an estimate and its interval, ``(estimate, low, high)``, as ``name``, ``name_low`` and
    ``name_high`` (floats; a missing bound is NaN, which the prose shows as ``nan``)."""
    for suffix, value in zip(("", "_low", "_high"), estimate_low_high):
        note(name + suffix, float(value))


def tick(token: str) -> str:
    """A token as inline Markdown code for the prose: backticks become quotes, a newline ``\\n``, and a
    leading space the visible ``␣`` (so ``" the"`` reads ```␣the```)."""
    shown = str(token).replace("`", "'").replace("\n", "\\n")
    if shown.startswith(" "):
        shown = "\u2423" + shown[1:]
    return f"`{shown}`"


def show(frame, precision: int = 3, *, escape: str | None = None, na_rep: str = "\u2013", index: bool = False,
         formatter=None):
    """A pandas ``Styler`` of ``frame`` in the book's table style (the ``dataframe`` class of the theme)."""
    shown = frame.style.format(formatter, precision=precision, na_rep=na_rep, escape=escape)
    if not index:
        shown = shown.hide(axis="index")
    shown.set_table_attributes('class="dataframe"')
    return shown


@dataclass(frozen=True)
class SinkRun:
    """The run parameters of chapters 5-7, which share one cached pass of the sink analyses (so they
    must be equal in the three; run.yml gives them from one anchor). A notebook builds it from its
    ``run_parameters`` (:meth:`of`); a field left out keeps the default here."""

    datasets: tuple[str, ...] = ("gsm8k", "web-text")  # texts, each sampled by document; figures show the first
    n_sequences: int = 8  # documents per data set, one block each ...
    seq_len: int = 128  # ... of this many tokens; position 0 of a block is the sink
    batch_size: int = 4  # sequences per forward pass
    sink_options: dict = field(default_factory=dict)  # cwcore.sinks.SinkOptions fields beyond their defaults (eps, ...)
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # the model's dtype; the geometry is always computed in float32
    cache: bool = True  # reuse results cached under $CWCORE_CACHE/results/sinks-*

    @classmethod
    def of(cls, parameters: dict | None = None) -> "SinkRun":
        """The run of ``parameters`` (a notebook's ``run_parameters``); a name that is not a field is
        refused (a typo in run.yml, or a parameter these chapters do not take)."""
        parameters = dict(parameters or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise TypeError(f"run parameters {unknown} are not among those of chapters 5-7 ({sorted(known)})")
        if "datasets" in parameters:
            parameters["datasets"] = tuple(parameters["datasets"])
        return cls(**parameters)

    def options(self):
        """The analyses' options (:class:`cwcore.sinks.SinkOptions`): blocks of ``seq_len``, this batch
        size and seed, no progress bars, and ``sink_options`` (the cache: :meth:`caching`)."""
        from cwcore import sinks

        return sinks.SinkOptions(block_size=self.seq_len, batch_size=self.batch_size, seed=self.seed,
                                 progress=False, **self.sink_options)

    def caching(self):
        """The :func:`cwcore.cache.caching` block of this run's analyses: on unless ``cache`` is False."""
        from cwcore.cache import caching

        return caching(enabled=bool(self.cache))

    def load(self, model: str):
        """``(model, tokenizer)`` of ``model`` in this run's dtype, on its device."""
        from cwcore import models

        return models.load_model(model, dtype=self.dtype, device=self.device)

    def blocks(self, tokenizer) -> dict:
        """``{data set: its blocks}``: ``n_sequences`` documents of each data set, one ``seq_len``-token
        block each (:func:`cwcore.data.document_blocks`), the same blocks in chapters 5-7."""
        from cwcore.data import document_blocks, load_dataset

        return {name: document_blocks(load_dataset(name), tokenizer, self.seq_len, self.n_sequences, seed=self.seed)
                for name in self.datasets}
