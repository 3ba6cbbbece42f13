"""Launch buttons that open a chapter's source notebook, with its ``parameters`` cell.

The book's pages are executed copies under ``book/generated/``, which are built, not committed, so
the theme's Binder and Colab links (repository path of the page) would point at nothing. This
extension rewrites them to ``notebooks/<chapter>.ipynb``, the committed notebook the page was executed
from (named in the page's ``cwcore.chapter`` metadata, written by the book runner; the runner only runs
notebooks that exist there), and removes the launch buttons of a notebook page without that metadata.
"""

from __future__ import annotations

import ast
import json
import re

#: Where the source notebooks live, relative to the repository root (the book is ``book/``).
NOTEBOOKS = "notebooks"


def source_notebook(app, pagename: str) -> str | None:
    """The repository path of the notebook ``pagename`` was executed from, or None."""
    metadata = app.env.metadata.get(pagename, {}).get("cwcore") or {}
    if isinstance(metadata, str):  # myst-nb keeps nested notebook metadata as its JSON (or repr) text
        try:
            metadata = json.loads(metadata)
        except ValueError:
            metadata = ast.literal_eval(metadata)
    chapter = metadata.get("chapter") if isinstance(metadata, dict) else None
    return f"{NOTEBOOKS}/{chapter}.ipynb" if chapter else None


def rewrite_launch_buttons(app, pagename, templatename, context, doctree):
    groups = [b for b in context.get("header_buttons", []) if b.get("label") == "launch-buttons"]
    if not groups:
        return
    source = source_notebook(app, pagename)
    for group in groups:
        if source is None:
            context["header_buttons"].remove(group)
            continue
        for button in group["buttons"]:
            if "url" in button:
                button["url"] = re.sub(r"(book/)?generated/[^?#]*?\.ipynb", source, button["url"])


def setup(app):
    # after sphinx-book-theme's add_launch_buttons (priority 501), before the page is rendered
    app.connect("html-page-context", rewrite_launch_buttons, priority=502)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
