"""No user-facing text (code and its help texts, notebooks, the book's pages) names a file a user does not
have (the paper's method summary, a developer's folder) or the project's history (issue numbers): the paper
is cited by section title."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what a user of a clone or of the installed package does not have
FORBIDDEN = {
    "the method summary file": re.compile(r"PAPER\.md"),
    "an issue number": re.compile(r"\b[Ii]ssues?\s*#?\d+|/issues/\d+|\bbefore issue\b"),
    "a developer's shared folder": re.compile(r"\.\./shared/"),
}
#: files another change owns; each still holds one reference (remove an entry once its file is clean)
OWNED_ELSEWHERE: set[str] = set()


def _texts():
    # the chapters' modules hold the texts the notebooks glue into their pages
    # and what a clone holds beside them: the book's production, the benchmarks' code and logs, the evidence's
    # provenance, the tests (but this file, whose patterns name what they forbid)
    for folder, pattern in (("cwcore", "**/*.py"), ("notebooks", "*.ipynb"), ("book", "**/*.md"),
                            ("book/cwbook", "**/*.py"), ("benchmarks", "**/*.py"), ("benchmarks", "*.md"),
                            ("data/results", "README.md"), ("tests", "**/*.py")):
        # never an environment's installed packages (`make peers` builds benchmarks/peers/.venv): not the project's
        yield from sorted(p for p in (ROOT / folder).glob(pattern) if "_build" not in p.parts and "generated" not in
                          p.parts and p != Path(__file__).resolve()
                          and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
    yield ROOT / "README.md"
    yield ROOT / "ARCHITECTURE.md"


def test_no_user_facing_text_names_a_file_or_an_issue_the_user_does_not_have():
    found = []
    for path in _texts():
        relative = path.relative_to(ROOT).as_posix()
        text = path.read_text(encoding="utf-8")
        for what, pattern in FORBIDDEN.items():
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                if relative not in OWNED_ELSEWHERE:
                    found.append(f"{relative}:{line}: {what} ({match.group(0)!r})")
    assert not found, "\n".join(found)


def test_the_paper_is_cited_by_its_section_titles():
    """The titles the code cites are the paper's (so a reader can find them)."""
    titles = {"Multi-head attention as a sum of projected value vectors", "Contribution weights",
              "The metrics compared", "Faithfulness by causal intervention", "Value geometry of attention sinks"}
    cited = set()
    for path in _texts():
        cited |= set(re.findall(r"the paper's sections? '([^']+)'", path.read_text(encoding="utf-8")))
    assert cited and cited <= titles, cited - titles
