"""The figure files of the built book: each run's ``output_dir`` copied into ``html/figures/`` with an
index page (:func:`copy_figures`), for slides. Part of the runner (:mod:`cwbook`, which says where each
run's figures go: :func:`cwbook.figure_folders`)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

FIGURES = "figures"  # html/figures/<chapter>/[<slug>/]: the figure files of every run, for slides
FIGURE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


@dataclass(frozen=True)
class FigureFolder:
    """The figure files of one run: ``source`` (its ``output_dir``) goes to ``html/figures/<dest>``."""

    dest: str  # "<chapter>" or "<chapter>/<slug>"
    source: Path
    title: str  # the chapter's title
    model: str | None = None


def _figure_files(folder: Path) -> list[Path]:
    if not Path(folder).is_dir():
        return []
    return sorted(p for p in Path(folder).iterdir()
                  if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in FIGURE_SUFFIXES)


def copy_figures(html: Path, folders: list[FigureFolder]) -> Path:
    """Copy each run's figure files into ``html/figures/<dest>/`` and write ``html/figures/index.html``,
    one section per chapter (and model) with a preview of every figure and links to each of its files;
    a run without figure files (a missing or empty ``output_dir``) is left out."""
    import html as htmllib

    root = Path(html) / FIGURES
    root.mkdir(parents=True, exist_ok=True)
    esc = htmllib.escape
    body, total = [], 0
    chapter_seen = set()
    for folder in folders:
        files = _figure_files(folder.source)
        if not files:  # a page without figures (the findings page): not listed
            continue
        target = root / folder.dest
        target.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copyfile(f, target / f.name)
        chapter = folder.dest.split("/")[0]
        if chapter not in chapter_seen:
            chapter_seen.add(chapter)
            body.append(f'<h2 id="{esc(chapter)}">{esc(folder.title)} <small>({esc(chapter)})</small></h2>')
        if folder.model is not None:
            body.append(f"<h3>{esc(folder.model)}</h3>")
        stems: dict[str, list[Path]] = {}
        for f in files:
            stems.setdefault(f.stem, []).append(f)
        body.append('<div class="grid">')
        for stem, variants in stems.items():
            preview = next((v for v in variants if v.suffix.lower() in (".png", ".jpg", ".jpeg", ".svg")), None)
            links = " · ".join(f'<a href="{esc(folder.dest)}/{esc(v.name)}">{esc(v.suffix[1:].upper())}</a>'
                               for v in variants)
            img = (f'<a href="{esc(folder.dest)}/{esc(preview.name)}"><img src="{esc(folder.dest)}/'
                   f'{esc(preview.name)}" alt="{esc(stem)}" loading="lazy"></a>') if preview else ""
            body.append(f"<figure>{img}<figcaption><code>{esc(stem)}</code>: {links}</figcaption></figure>")
            total += 1
        body.append("</div>")
    page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>Slide-ready figures</title><style>"
            "body{font-family:system-ui,sans-serif;margin:2em auto;max-width:72em;padding:0 1em;color:#222}"
            ".grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(16em,1fr));gap:1em}"
            "figure{margin:0;border:1px solid #ddd;padding:.5em;border-radius:4px}"
            "img{width:100%;height:auto}figcaption{font-size:.9em;margin-top:.3em}"
            "</style></head><body>\n"
            "<p><a href=\"../index.html\">Back to the book</a></p>\n<h1>Slide-ready figures</h1>\n"
            f"<p>{total} figures, each as PNG (150 dpi) and SVG, in <code>figures/&lt;chapter&gt;/</code> "
            "(<code>figures/&lt;chapter&gt;/&lt;model&gt;/</code> for chapters run per model) next to this "
            "page. They are the files the chapters write with <code>cwcore.plotting.save_figure</code>, "
            "made again with every build.</p>\n" + "\n".join(body) + "\n</body></html>\n")
    (root / "index.html").write_text(page)
    return root / "index.html"
