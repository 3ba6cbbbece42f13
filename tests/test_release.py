"""Published like a paper's companion: licence, citation, version and repository address each written
once, launch buttons that open a chapter's source notebook, and the release check (a built wheel
installed into a fresh environment runs `cwcore --help`, `cwcore explain` and `cwcore.decompose`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

import cwcore

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CITATION = yaml.safe_load((ROOT / "CITATION.cff").read_text())
REPOSITORY = PYPROJECT["project"]["urls"]["Repository"]


def cffconvert(path: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "cffconvert"
    if not exe.exists():
        pytest.fail("cffconvert is not installed: `make test` installs it with the test extra")
    return subprocess.run([str(exe), "--validate", "-i", str(path)], capture_output=True, text=True)


# --------------------------------------------------------------------------------------------------
# One home each: version, licence, citation, repository address
# --------------------------------------------------------------------------------------------------
def test_version_is_written_once_and_everything_reads_it():
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cwcore.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", cwcore.__version__)
    assert metadata.version("cwcore") == cwcore.__version__  # the installed distribution's metadata
    assert str(CITATION["version"]) == cwcore.__version__
    newest = re.search(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert newest == cwcore.__version__


def test_license_file_is_the_apache_2_0_text_pyproject_declares():
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and CITATION["license"] == "Apache-2.0"
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) > 190  # the full text
    for section in range(1, 10):
        assert re.search(rf"^\s+{section}\. \w", text, re.M), f"section {section} is missing"


def test_citation_validates_and_names_the_paper():
    result = cffconvert(ROOT / "CITATION.cff")
    assert result.returncode == 0, result.stdout + result.stderr
    paper = CITATION["preferred-citation"]
    assert paper["title"] == "Contribution Weights: A Geometrical Analysis of Self-Attention Transformers"
    assert [a["family-names"] for a in paper["authors"]] == ["Cunningham", "Muça Cirone"]
    assert paper["year"] == 2026 and "ICML 2026" in paper["conference"]["name"]
    assert "arXiv:2606.07604" in [i["value"] for i in paper["identifiers"]]


def test_cffconvert_rejects_a_broken_citation(tmp_path):
    """The control for the validation above: a preferred-citation without authors is invalid."""
    broken = dict(CITATION, **{"preferred-citation": {k: v for k, v in CITATION["preferred-citation"].items()
                                                        if k != "authors"}})
    path = tmp_path / "CITATION.cff"
    path.write_text(yaml.safe_dump(broken, allow_unicode=True))
    assert cffconvert(path).returncode != 0


def test_repository_address_has_one_home():
    book_config = yaml.safe_load((ROOT / "book" / "_config.yml").read_text())
    assert REPOSITORY.startswith("https://github.com/") and not REPOSITORY.endswith("/")
    assert book_config["repository"]["url"] == REPOSITORY
    assert CITATION["repository-code"] == REPOSITORY
    assert PYPROJECT["project"]["urls"]["Issues"] == REPOSITORY + "/issues"
    assert REPOSITORY in (ROOT / "README.md").read_text()
    html = book_config["html"]
    assert html["use_repository_button"] and html["use_issues_button"]
    launch = book_config["launch_buttons"]
    assert launch["binderhub_url"] == "https://mybinder.org"
    assert launch["colab_url"] == "https://colab.research.google.com"


# --------------------------------------------------------------------------------------------------
# Launch buttons: the theme's links to the executed page become links to its source notebook
# --------------------------------------------------------------------------------------------------
def _launch_module():
    sys.path.insert(0, str(ROOT / "book" / "_ext"))
    try:
        import cwcore_launch
    finally:
        sys.path.pop(0)
    return cwcore_launch


@pytest.mark.parametrize("chapter_metadata", [{"chapter": "03_contribution_maps", "model": "smollm2-135m"},
                                              '{"chapter": "03_contribution_maps", "model": "smollm2-135m"}'])
def test_launch_buttons_open_the_source_notebook(chapter_metadata):
    launch = _launch_module()
    page = "generated/03_contribution_maps/smollm2-135m"
    app = SimpleNamespace(env=SimpleNamespace(metadata={page: {"kernelspec": {}, "cwcore": chapter_metadata}}))
    org_repo = REPOSITORY.removeprefix("https://github.com/")
    buttons = [{"label": "launch-buttons", "buttons": [
        {"text": "Binder", "url": f"https://mybinder.org/v2/gh/{org_repo}/main?urlpath=tree/book/{page}.ipynb"},
        {"text": "Colab", "url": f"https://colab.research.google.com/github/{org_repo}/blob/main/book/{page}.ipynb"},
    ]}, {"label": "download-buttons", "buttons": [{"url": f"_sources/{page}.ipynb"}]}]
    context = {"header_buttons": buttons}
    launch.rewrite_launch_buttons(app, page, "page.html", context, None)
    binder, colab = (b["url"] for b in context["header_buttons"][0]["buttons"])
    assert binder == f"https://mybinder.org/v2/gh/{org_repo}/main?urlpath=tree/notebooks/03_contribution_maps.ipynb"
    assert colab == f"https://colab.research.google.com/github/{org_repo}/blob/main/notebooks/03_contribution_maps.ipynb"
    assert (ROOT / "notebooks" / "03_contribution_maps.ipynb").is_file()
    assert context["header_buttons"][1]["buttons"][0]["url"] == f"_sources/{page}.ipynb"  # not a launch link
    # a notebook page the runner did not execute: no launch buttons rather than links to nothing
    context = {"header_buttons": [{"label": "launch-buttons", "buttons": []}]}
    app.env.metadata["other"] = {"kernelspec": {}}
    launch.rewrite_launch_buttons(app, "other", "page.html", context, None)
    assert context["header_buttons"] == []


def test_every_launch_link_of_the_smoke_book_opens_a_committed_notebook_with_a_parameters_cell(smoke_book):
    _, _, html = smoke_book
    links = set()
    for page in (html / "generated").rglob("*.html"):
        links |= set(re.findall(r'href="(https://(?:mybinder\.org|colab\.research\.google\.com)/[^"]+)"', page.read_text()))
    assert links, "no launch buttons in the built book"
    for link in links:
        path = re.search(r"(?:urlpath=tree/|/blob/main/)(.+\.ipynb)$", link.replace("&amp;", "&")).group(1)
        assert path.startswith("notebooks/"), link
        notebook = json.loads((ROOT / path).read_text())
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in notebook["cells"]), path


# --------------------------------------------------------------------------------------------------
# The release check: sdist and wheel, installed into a fresh environment
# --------------------------------------------------------------------------------------------------
def fresh_venv(folder: Path) -> Path:
    """A new virtual environment whose own site-packages comes first, with this environment's
    site-packages appended after it (a plain path in a .pth file: its .pth files, among them the
    editable install of the checkout, are not processed), so dependencies come from here and cwcore
    only from what is installed into the new environment."""
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    python = folder / "bin" / "python"
    own = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                       text=True).strip())
    (own / "zz_parent_environment.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


def run(args, cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


DECOMPOSE = r"""
import json, sys, torch
import cwcore
model, tokenizer = cwcore.load_model("smollm2-135m")
inputs = dict(tokenizer("The cat sat on the mat because it was warm", return_tensors="pt"))
d = cwcore.decompose(model, layers=[5], **inputs)
with torch.no_grad():
    plain = model(**inputs)
inter = d.inter[5]
print(json.dumps({
    "file": cwcore.__file__, "version": cwcore.__version__,
    "shape": list(inter.shape), "heads": model.config.num_attention_heads,
    "inter_sum_error": float((inter.sum((1, 3)) - 1).abs().max()),
    "logits_error": float((d.outputs.logits - plain.logits).abs().max()),
}))
"""


@pytest.mark.slow
def test_built_wheel_installs_into_a_fresh_environment_and_works(tmp_path):
    dist = tmp_path / "dist"
    # sdist, then the wheel built from the sdist (what an installer from the sdist gets); no isolation:
    # the build backend (setuptools) comes from this environment, nothing is downloaded
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT], cwd=tmp_path)
    version = cwcore.__version__
    wheel = dist / f"cwcore-{version}-py3-none-any.whl"
    assert wheel.is_file() and (dist / f"cwcore-{version}.tar.gz").is_file(), sorted(os.listdir(dist))

    # everything the package needs at run time is in the wheel: every tracked file under cwcore/
    tracked = subprocess.check_output(["git", "ls-files", "cwcore"], cwd=ROOT, text=True).split()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        wheel_metadata = archive.read(f"cwcore-{version}.dist-info/METADATA").decode()
    missing = [f for f in tracked if f not in names]
    assert not missing, f"files of the package missing from the wheel: {missing}"
    assert f"cwcore-{version}.dist-info/licenses/LICENSE" in names
    assert not any(n.startswith(("tests/", "notebooks/", "book/", "data/", "cwbook/", "cwcore/book/")) for n in names)
    assert f"Version: {version}" in wheel_metadata and f"Project-URL: Repository, {REPOSITORY}" in wheel_metadata

    python = fresh_venv(tmp_path / "venv")
    work = tmp_path / "work"  # not the checkout: nothing can be imported from the current directory
    work.mkdir()
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-index", "--no-deps",
         "--disable-pip-version-check", "-q", wheel], cwd=work)
    # the wheel's dependencies, from its own metadata, are satisfied in the new environment
    check = ("import json, sys; from importlib import metadata; from packaging.requirements import Requirement\n"
             "reqs = [Requirement(r) for r in metadata.requires('cwcore') if 'extra ==' not in r]\n"
             "print(json.dumps({r.name: r.specifier.contains(metadata.version(r.name), prereleases=True) "
             "for r in reqs}))")
    satisfied = json.loads(run([python, "-c", check], cwd=work).stdout)
    assert satisfied and all(satisfied.values()), satisfied

    own = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=work).stdout.strip())
    cli = tmp_path / "venv" / "bin" / "cwcore"
    help_text = run([cli, "--help"], cwd=work).stdout
    assert "explain" in help_text and "cache" in help_text

    figure = work / "fig.png"
    run([cli, "explain", "The cat sat on the mat", "--model", "smollm2-135m", "--layer", "5", "--out", figure],
        cwd=work, timeout=600)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 10_000

    result = json.loads(run([python, "-c", DECOMPOSE], cwd=work, timeout=600).stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve().is_relative_to(own.resolve()), result["file"]  # the wheel, not the checkout
    assert result["version"] == version
    assert result["shape"][1] == result["heads"] and result["shape"][2] == result["shape"][3]
    assert result["inter_sum_error"] < 1e-4  # inter-head weights sum to one over (head, key)
    assert result["logits_error"] < 1e-4  # decomposing does not change what the model computes

    # the API reference page's names import from the installed wheel
    api = (ROOT / "book" / "api.md").read_text()
    # the library's modules (the page ends with the book's production, cwbook, which the wheel does not hold)
    modules = [m for m in re.findall(r"^\.\. automodule:: (\S+)", api, re.M) if m.split(".")[0] == "cwcore"]
    top_level = re.search(r"automodule:: cwcore\n(?:.*\n)*?\.\. autosummary::\n\n((?:   \w+\n)+)", api).group(1).split()
    script = ("import importlib, json, cwcore\n"
              f"mods = {modules!r}; names = {top_level!r}\n"
              "bad = [m for m in mods if not importlib.import_module(m).__file__.startswith(cwcore.__path__[0])]\n"
              "print(json.dumps({'bad': bad, 'missing': [n for n in names if not hasattr(cwcore, n)]}))")
    assert len(modules) > 10 and "decompose" in top_level
    assert json.loads(run([python, "-c", script], cwd=work).stdout) == {"bad": [], "missing": []}
