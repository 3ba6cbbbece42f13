"""Helpers every notebook of the book imports: numbers, phrases and tables quoted in the prose.

The chapters put computed values into their Markdown with `myst_nb.glue
<https://myst-nb.readthedocs.io/en/latest/render/glue.html>`_: a code cell calls ``note("n_heads", 9)``
and the prose reads ``{glue:text}`n_heads```. These helpers are that glue, once for the whole book:

* :func:`note` — a number (a numpy or torch scalar becomes a plain Python number);
* :func:`note_md` — a short phrase of inline Markdown, shown with ``{glue:md}`name```;
* :func:`note_ci` — an estimate and its interval, as ``name``, ``name_low`` and ``name_high``;
* :func:`tick` — a token as inline code, with a visible leading space;
* :func:`show` — a table in the book's table style.

The figure helpers (bands, per-layer axes, legends) are in :mod:`cwcore.plotting`; the tables the
chapters hand to the findings page are written by :func:`cwcore.book.findings.save_results`. Importing
this module loads neither torch nor myst_nb; ``glue`` is imported on first use.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["note", "note_md", "note_ci", "tick", "show", "plain"]


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
    """A pandas ``Styler`` of ``frame`` in the book's table style (the ``dataframe`` class of the theme).

    ``precision`` digits for floats, ``na_rep`` for missing values, the index hidden unless ``index``;
    ``escape="html"`` when cells contain ``<`` (e.g. the claims); ``formatter``: per-column formats, as
    :meth:`pandas.io.formats.style.Styler.format` takes them.
    """
    shown = frame.style.format(formatter, precision=precision, na_rep=na_rep, escape=escape)
    if not index:
        shown = shown.hide(axis="index")
    shown.set_table_attributes('class="dataframe"')
    return shown
