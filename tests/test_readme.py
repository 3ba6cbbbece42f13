"""The README is a newcomer's page: short, with runnable code early, and every example in it runs and prints
what its comments say. The manual it links to lives in book/manual/ and is part of the book."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MANUAL = ROOT / "book" / "manual"
#: the README's size limit in bytes (what `wc -c` counts); the manual holds the rest
MAX_BYTES = 12_000

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
#: a print line whose comment states what it prints: `print(x)  # torch.Size([1, 9, 6, 6]): what it is`;
#: the part before ": " must start a printed line ("..." at its end: a prefix of the printed value)
PRINT_COMMENT = re.compile(r"^\s*print\(.*\)\s+# (.+?)(?::\s|$)", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(offset, code) of each fenced block of ``language``."""
    return [(m.start(), m.group(2)) for m in FENCE.finditer(text) if m.group(1) == language]


def test_readme_is_short_and_its_code_comes_early():
    data = README.read_bytes()
    assert len(data) < MAX_BYTES, f"README.md has {len(data)} bytes; move detail to book/manual/"
    text = data.decode()
    first_python = text.index("```python")
    assert first_python < len(text) / 4, f"the first python block starts at {first_python} of {len(text)} characters"


def test_readme_keeps_the_generated_headline_and_cites_the_paper_by_title():
    text = README.read_text()
    assert text.count("<!-- headline:start -->") == 1 and text.count("<!-- headline:end -->") == 1
    assert "Contribution Weights: A Geometrical Analysis of Self-Attention Transformers" in " ".join(text.split())
    assert "python -m cwbook.headline --write" in text


def test_every_relative_link_of_the_readme_the_manual_and_the_architecture_page_exists():
    pages = [README, ROOT / "ARCHITECTURE.md", *sorted(MANUAL.glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_manual_pages_are_in_the_book():
    """Every page of book/manual/ is listed in book/run.yml (the book builds only listed pages), and
    every README link into the manual names one of them."""
    listed = {entry["page"] for entry in yaml.safe_load((ROOT / "book" / "run.yml").read_text())["chapters"]
              if "page" in entry}
    pages = {f"manual/{p.stem}" for p in MANUAL.glob("*.md")}
    assert pages and pages <= listed, sorted(pages - listed)
    linked = {f"manual/{Path(t).stem}" for t in LINK.findall(README.read_text()) if t.startswith("book/manual/")}
    assert linked and linked <= pages, sorted(linked - pages)


def test_readme_print_comments_are_parsed():
    """The expectations the slow test checks are found (so it cannot pass by checking nothing)."""
    code = "\n".join(c for _, c in blocks(README.read_text(), "python"))
    expected = PRINT_COMMENT.findall(code)
    assert "torch.Size([1, 9, 6, 6])" in expected and len(expected) >= 6, expected


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(PYTHONPATH=str(ROOT), CWCORE_NO_CACHE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "2"))
    return env


@pytest.mark.slow
def test_readme_python_examples_run_and_print_what_their_comments_say(tmp_path):
    """Every python block of the README, run in order in one fresh interpreter (they share names, as a
    reader running them one after another does), with the result cache off so that every number is
    computed; each commented print must print what its comment says."""
    code = "\n".join(c for _, c in blocks(README.read_text(), "python"))
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    printed = run.stdout.splitlines()
    position = 0
    for expected in PRINT_COMMENT.findall(code):
        prefix = expected.removesuffix("...")
        found = next((i for i in range(position, len(printed)) if printed[i].startswith(prefix)), None)
        assert found is not None, f"no printed line after line {position} starts with {prefix!r}:\n{run.stdout}"
        position = found + 1
    # the faithfulness table, and the prose's quote of it: within 0.05% (float32 sums in another thread order)
    quoted = re.search(r"It printed Δ perplexity ([\d.]+) \(attention\), ([\d.]+) \(contribution\), ([\d.]+) "
                       r"\(ALTI\) and ([\d.]+) \(random\)", " ".join(README.read_text().split()))
    assert quoted, "the README no longer quotes the faithfulness table's numbers"
    for metric, said in zip(("attention", "contribution", "alti", "random"), quoted.groups()):
        rows = [line.split() for line in printed if line.split()[1:2] == [metric]]
        assert rows, run.stdout
        assert float(rows[0][3]) == pytest.approx(float(said), rel=5e-4, abs=0.05), (metric, rows[0], said)


@pytest.mark.slow
def test_readme_cwcore_commands_run(tmp_path):
    """The `cwcore ...` lines of the README's bash blocks run and write the file they name."""
    commands = [shlex.split(line.split(" #")[0]) for _, code in blocks(README.read_text(), "bash")
                for line in code.splitlines() if line.startswith("cwcore ")]
    assert commands
    for args in commands:
        run = subprocess.run([sys.executable, "-m", "cwcore.cli", *args[1:]], cwd=tmp_path, env=_env(),
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        out = Path(tmp_path) / args[args.index("--out") + 1]
        assert out.is_file() and out.stat().st_size > 10_000, out


def test_the_manual_zoo_table_names_every_zoo_model():
    """book/manual/models.md's zoo table lists every family of tests/zoo_models.py, and its count is theirs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from zoo_models import ZOO

    text = (MANUAL / "models.md").read_text()
    table = text[text.index("| family | what it brings | result |"):]
    table = table[:table.index("\n\n")] if "\n\n" in table else table
    named = set(re.findall(r"[a-z][a-z0-9_]+", " ".join(line.split("|")[1] for line in table.splitlines()[2:]).lower()))
    aliases = {"falcon_alibi": "alibi"}  # "falcon with ALiBi"
    missing = [name for name in ZOO if name not in named and aliases.get(name) not in named]
    assert not missing, f"the zoo table lacks {missing}"
    assert f"runs {len(ZOO)} tiny random models" in " ".join(text.split())
