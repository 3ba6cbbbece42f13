"""Build the executable companion book: papermill runs the notebooks, Jupyter Book renders them."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

try:
    import fcntl  # POSIX: serialises the kernel's installation between builds started together
except ImportError:  # Windows
    fcntl = None

import cwcore
from cwcore.cache import atomic_write_bytes, current_umask, parameters_key
from cwcore import provenance as _provenance
from .checkout import warn_if_other_checkout

warn_if_other_checkout(Path(cwcore.__file__).parent)  # a clone sharing another checkout's environment runs that code
from .figures import FIGURES, FigureFolder, copy_figures

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BOOK_DIR = REPO_ROOT / "book"
DEFAULT_NOTEBOOKS_DIR = REPO_ROOT / "notebooks"
KERNEL_NAME = "cwcore"
RUN_MODES = ("once", "per_model")
RESULTS = "results"  # generated/results/<profile>/: the tables chapters write for later pages
RUN_PARAMETERS = "run_parameters"  # a dict parameter: run.yml's parameters the notebook does not declare by name
RUNNER_PARAMETERS = ("profile", "model", "models", "output_dir", "results_file", "results_dir")  # added by plan()
PAGE = "page"  # a chapter entry `- page: NAME`: the static page book/NAME.md (NAME may hold folders: manual/cli)
#: folders of book/ that the build writes, so a static page cannot live there
RESERVED_PAGE_FOLDERS = ("generated", "_build")
BUILD_STAMP = ".cwcore-build-stamp"
# Warnings filtered in the kernels (appended to PYTHONWARNINGS): tqdm.auto's "IProgress not found"
# (no ipywidgets here) would otherwise print to stderr in every page that imports transformers.
KERNEL_WARNING_FILTERS = ("ignore:IProgress not found",)
# Environment defaults of the kernels (the environment wins): passive OpenMP waiting (spinning threads made a
# decomposition 4x slower on 2 shared cores), no tqdm bars in the pages, and the result cache on, so that an
# interrupted build resumes.
KERNEL_ENVIRONMENT_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE", "TQDM_DISABLE": "1", "CWCORE_CACHING": "1"}


#: profile -> what ``build`` runs for it instead of :func:`build` (``evidence``: cwbook.evidence_build)
PROFILE_BUILDS: dict = {}
#: profile -> what ``plan`` prints for it instead of its notebook runs, for a build that executes none
#: (``confirmatory``); its ``--only`` names the build's own steps, not chapters
PROFILE_PLANS: dict = {}
#: profile -> the module that registers its build in :data:`PROFILE_BUILDS`, imported only when that profile
#: is built (they load torch: ``python -m cwbook --help`` and ``plan`` stay quick)
PROFILE_MODULES = {"evidence": "cwbook.evidence_build", "confirmatory": "cwbook.confirmatory"}


class BookError(RuntimeError):
    """A problem the user must fix (bad run.yml, failing notebook, failing Sphinx build)."""


# -- Run configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chapter:
    name: str  # notebook stem in notebooks/, e.g. "02_geometry"; for a page, the stem of book/<name>.md
    runs: str  # "once" or "per_model"; "page" for a static page (nothing is executed)
    models: tuple[str, ...] | None = None  # fixed models (e.g. an encoder chapter); None: the profile's

    @property
    def is_page(self) -> bool:
        return self.runs == PAGE


@dataclass
class Run:
    """One notebook execution: a chapter, on one model for per_model chapters."""

    chapter: Chapter
    model: str | None
    source: Path  # notebooks/<chapter>.ipynb
    output: Path  # executed copy under generated/
    parameters: dict = field(default_factory=dict)  # everything the profile offers this run
    explicit: frozenset = frozenset()  # parameters run.yml sets for this very notebook

    @property
    def label(self) -> str:
        return self.chapter.name if self.model is None else f"{self.chapter.name} [{self.model}]"


def slug(name: str) -> str:
    """A model name as a file and URL component: 'Qwen/Qwen3-8B' -> 'qwen-qwen3-8b'."""
    try:
        return _provenance.slug(name)
    except ValueError as err:
        raise BookError(str(err)) from None


def git(root: str | os.PathLike, *args: str) -> str | None:
    """``git -C root args...``'s output, stripped, or None when git or the repository is absent (it was
    ``cwcore.provenance.git``)."""
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def load_config(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise BookError(f"run configuration {path} does not exist")
    try:
        with path.open() as fh:
            config = yaml.safe_load(fh) or {}
    except yaml.YAMLError as err:  # one sentence with the place, not PyYAML's traceback
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise BookError(f"{path} is not valid YAML{where} ({getattr(err, 'problem', None) or err})") from None
    if not isinstance(config, dict):
        raise BookError(f"{path}: needs a 'chapters' list and a 'profiles' mapping, got a {type(config).__name__}")
    if not isinstance(config.get("chapters"), list) or not isinstance(config.get("profiles"), dict):
        raise BookError(f"{path}: needs a 'chapters' list and a 'profiles' mapping")
    return config


def read_chapters(config: dict) -> list[Chapter]:
    out = []
    for i, entry in enumerate(config["chapters"]):
        if isinstance(entry, dict) and PAGE in entry and "notebook" not in entry:
            unknown = set(entry) - {PAGE}
            if unknown:
                raise BookError(f"run.yml page {entry[PAGE]}: unknown keys {sorted(unknown)} (a page is not executed)")
            name = str(entry[PAGE])
            parts = name.split("/")
            if (not name or name.endswith(".md") or "\\" in name or any(p in ("", ".", "..") for p in parts)
                    or parts[0] in RESERVED_PAGE_FOLDERS):
                raise BookError(f"run.yml page {name!r}: give the path of book/<name>.md inside book/ without '.md' "
                                f"(a folder such as manual/models is allowed; not '..', not {', '.join(RESERVED_PAGE_FOLDERS)})")
            out.append(Chapter(name, PAGE))
            continue
        if not isinstance(entry, dict) or "notebook" not in entry:
            raise BookError(f"run.yml chapter #{i + 1}: each chapter needs 'notebook: <name>' (or 'page: <name>')")
        unknown = set(entry) - {"notebook", "runs", "models"}
        if unknown:
            raise BookError(f"run.yml chapter {entry['notebook']}: unknown keys {sorted(unknown)}")
        runs = entry.get("runs", "once")
        if runs not in RUN_MODES:
            raise BookError(f"run.yml chapter {entry['notebook']}: runs must be one of {RUN_MODES}, not {runs!r}")
        models = entry.get("models")
        if models is not None and (runs != "per_model" or not isinstance(models, list) or not models):
            raise BookError(f"run.yml chapter {entry['notebook']}: 'models' is a non-empty list, for per_model chapters")
        out.append(Chapter(str(entry["notebook"]), runs, tuple(models) if models else None))
    names = [c.name for c in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BookError(f"run.yml lists chapters more than once: {dupes}")
    return out


def select_chapters(all_chapters: list[Chapter], only: str | list[str] | None) -> list[Chapter]:
    """Chapters named by ``only`` (comma-separated names or unique prefixes such as '02'), in book order."""
    if not only:
        return all_chapters
    wanted = [w.strip() for w in (only.split(",") if isinstance(only, str) else only) if w.strip()]
    chosen = set()
    for w in wanted:
        exact = [c.name for c in all_chapters if c.name == w]
        hits = exact or [c.name for c in all_chapters if c.name.startswith(w)]
        if len(hits) != 1:
            known = ", ".join(c.name for c in all_chapters)
            what = "matches no chapter" if not hits else f"is ambiguous ({', '.join(hits)})"
            raise BookError(f"--only {w!r} {what}; run.yml lists: {known}")
        chosen.add(hits[0])
    return [c for c in all_chapters if c.name in chosen]


def profile_config(config: dict, profile: str | None) -> tuple[str, dict]:
    name = profile or config.get("default_profile") or "default"
    profiles = config["profiles"]
    if name not in profiles:
        raise BookError(f"profile {name!r} is not in run.yml; known profiles: {', '.join(profiles)}")
    prof = profiles[name] or {}
    unknown = set(prof) - {"description", "models", "params", "notebooks"}
    if unknown:
        raise BookError(f"run.yml profile {name}: unknown keys {sorted(unknown)}")
    return name, prof


def _refuse_slug_collisions(models: list, where: str) -> None:
    """Models whose file names (:func:`slug`) coincide would write over each other's notebooks and tables."""
    seen: dict[str, str] = {}
    for model in models:
        name = slug(model)
        if name in seen:
            raise BookError(f"{where}: model {model!r} is listed twice" if seen[name] == model else
                            f"{where}: models {seen[name]!r} and {model!r} have the same file name {name!r}; "
                            "rename one (its results would overwrite the other's)")
        seen[name] = model


def plan(config: dict, *, profile: str | None = None, models: str | list[str] | None = None,
         only: str | list[str] | None = None, notebooks_dir: Path = DEFAULT_NOTEBOOKS_DIR,
         generated_dir: Path = DEFAULT_BOOK_DIR / "generated",
         book_dir: Path | None = None) -> tuple[str, list[Chapter], list[Run]]:
    """Resolve run.yml for a profile into the chapters of the book and the notebook runs."""
    name, prof = profile_config(config, profile)
    all_chapters = read_chapters(config)
    chosen = select_chapters(all_chapters, only)
    if isinstance(models, str):
        models = [m.strip() for m in models.split(",") if m.strip()]
    profile_models = list(models or prof.get("models") or [])
    _refuse_slug_collisions(profile_models, f"profile {name}")
    per_notebook = prof.get("notebooks") or {}
    stray = sorted(set(per_notebook) - {c.name for c in all_chapters if not c.is_page})
    if stray:
        raise BookError(f"run.yml profile {name}: notebooks {stray} are not chapters")
    book_dir = Path(book_dir) if book_dir is not None else Path(generated_dir).parent

    results = Path(generated_dir) / RESULTS / slug(name)
    runs: list[Run] = []
    for chapter in chosen:
        if chapter.is_page:
            if not (book_dir / f"{chapter.name}.md").is_file():
                raise BookError(f"run.yml lists page {chapter.name} but {book_dir / chapter.name}.md does not exist")
            continue
        source = Path(notebooks_dir) / f"{chapter.name}.ipynb"
        if not source.is_file():
            raise BookError(f"run.yml lists chapter {chapter.name} but {source} does not exist")
        overrides = dict(per_notebook.get(chapter.name) or {})
        chapter_models = overrides.pop("models", None)
        params = {**(prof.get("params") or {}), **overrides, "profile": name}
        explicit = frozenset(overrides)
        if chapter.runs == "once":
            out = Path(generated_dir) / f"{chapter.name}.ipynb"
            once_models = list(chapter_models or profile_models)
            runs.append(Run(chapter, None, source, out, {**params, "models": once_models,
                                                         "output_dir": f"figures/{chapter.name}",
                                                         **_results_parameters(results, chapter, None, out)},
                            explicit))
            continue
        chapter_models = list(chapter_models or chapter.models or profile_models)
        _refuse_slug_collisions(chapter_models, f"chapter {chapter.name}")
        if not chapter_models:
            raise BookError(f"chapter {chapter.name} runs per model but profile {name} names no models")
        for model in chapter_models:
            out = Path(generated_dir) / chapter.name / f"{slug(model)}.ipynb"
            runs.append(Run(chapter, model, source, out,
                            {**params, "model": model, "output_dir": f"figures/{slug(model)}",
                             **_results_parameters(results, chapter, model, out)}, explicit))
    return name, chosen, runs


def results_path(results_dir: str | os.PathLike, chapter: str, model: str | None = None) -> Path:
    """Where chapter ``chapter`` (run on ``model``; None: a once chapter) writes its results table
    inside ``results_dir``: ``<chapter>/<slug(model)>.csv``, or ``<chapter>.csv``. Its metadata goes
    beside it, with the suffix ``.json`` (:func:`cwbook.findings.save_results`)."""
    if model is None:
        return Path(results_dir) / f"{chapter}.csv"
    return Path(results_dir) / chapter / f"{slug(model)}.csv"


def _results_parameters(results: Path, chapter: Chapter, model: str | None, output: Path) -> dict:
    """``results_file`` and ``results_dir`` of one run, relative to its working directory."""
    rel = lambda p: Path(os.path.relpath(p, output.parent)).as_posix()  # noqa: E731
    return {"results_file": rel(results_path(results, chapter.name, model)), "results_dir": rel(results)}


def results_digest(results_dir: Path, exclude: Path | None = None) -> str:
    """Hash of the result tables under ``results_dir`` (names and contents; ``exclude`` left out)."""
    h = hashlib.sha256()
    root = Path(results_dir)
    if root.is_dir():
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
            if exclude is not None and path.with_suffix("") == Path(exclude).with_suffix(""):
                continue  # the run's own table and its metadata
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


# -- Table of contents -------------------------------------------------------------------------------
def notebook_title(path: Path) -> str:
    """The first '# ' heading of a notebook's markdown cells (the page title), else its name."""
    nb = json.loads(Path(path).read_text())
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", "")).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return Path(path).stem


def toc(chapter_list: list[Chapter], runs: list[Run], generated_dir: Path, book_dir: Path, root: str = "intro") -> dict:
    """The jb-book table of contents: a page per chapter, a sub-page per model for per_model chapters;
    a static page chapter is its file ``book_dir/<name>.md``."""

    def docname(path: Path) -> str:
        return Path(os.path.relpath(path, book_dir)).with_suffix("").as_posix()

    entries = []
    for chapter in chapter_list:
        mine = [r for r in runs if r.chapter == chapter]
        if chapter.is_page:
            entries.append({"file": chapter.name})
        elif chapter.runs == "once":
            entries.extend({"file": docname(r.output)} for r in mine)
        else:
            entries.append({
                "file": docname(Path(generated_dir) / chapter.name / "index.md"),
                "sections": [{"file": docname(r.output), "title": r.model} for r in mine],
            })
    return {"format": "jb-book", "root": root, "chapters": entries}


def notebook_question(path: Path) -> str:
    """The paragraph right after a notebook's '# ' title (its question, by the chapters' convention), or ""."""
    nb = json.loads(Path(path).read_text())
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            text = "".join(cell.get("source", ""))
            if text.lstrip().startswith("# "):
                paragraphs = [p.strip() for p in text.split("\n\n")[1:] if p.strip()]
                if not paragraphs or paragraphs[0].startswith(("#", "$$", "-", "{")):
                    return ""
                taken = [paragraphs[0]]  # a sentence that runs on into a displayed formula is taken whole
                for more in paragraphs[1:3]:
                    if taken[-1].rstrip().endswith((".", "?", "!")):
                        break
                    taken.append(more)
                return "\n\n".join(taken)
    return ""


def chapter_index(chapter: Chapter, runs: list[Run], profile: str) -> str:
    """The page of a per_model chapter: its title, its question (the notebook's opening paragraph) and a link
    to each model's executed copy, which opens with that model's answer."""
    title = notebook_title(runs[0].source)
    question = notebook_question(runs[0].source)
    lines = [f"# {title}", "", *([question, ""] if question else []),
             "Each model's page opens with its answer, generated from the committed evidence where the chapter "
             f"decides claims, then the page's own run (profile `{profile}`; one notebook, "
             f"`notebooks/{chapter.name}.ipynb`, executed once per model):", ""]
    lines += [f"- {{doc}}`{r.model} <{r.output.stem}>`" for r in runs]
    return "\n".join(lines) + "\n"


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` atomically unless it already holds exactly that; True if written."""
    path = Path(path)
    if path.is_file() and path.read_text() == text:
        return False
    atomic_write_bytes(path, text.encode())
    return True


# -- Stamps: is an executed copy current? ------------------------------------------------------------
def book_code_hash() -> str:
    """SHA-256 of the book's production code (every ``.py`` of this package): a chapter module's edit
    makes its notebooks stale, as an edit of cwcore does."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def stamp(source: Path, parameters: dict, inputs: str | None = None) -> str:
    """What an executed copy was made from: the source notebook, its parameters, ``inputs`` (the
    :func:`results_digest` of the tables a page reads, if any), the book's code (:func:`book_code_hash`)
    and (through :func:`cwcore.cache.parameters_key`) the hash of cwcore's source files."""
    notebook = hashlib.sha256(Path(source).read_bytes()).hexdigest()
    key = {"notebook": notebook, "parameters": parameters, "book_code": book_code_hash()}
    if inputs is not None:
        key["inputs"] = inputs
    return parameters_key(key)


def run_stamp(run: Run, parameters: dict) -> str:
    """:func:`stamp` of one run: a page that declares ``results_dir`` also depends on its tables."""
    inputs = None
    if "results_dir" in parameters:
        own = run.output.parent / parameters["results_file"] if "results_file" in parameters else None
        inputs = results_digest(run.output.parent / parameters["results_dir"], exclude=own)
    return stamp(run.source, parameters, inputs)


def outputs_present(run: Run, parameters: dict) -> bool:
    """False when the run declares ``results_file`` and that table is missing, or does not match the hash
    its metadata records (edited, torn by a kill): then it runs again."""
    if "results_file" not in parameters:
        return True
    from .findings import results_verified  # findings loads cwcore's statistics: only when a run has a table

    return results_verified(run.output.parent / parameters["results_file"])


def read_stamp(executed: Path) -> str | None:
    """The stamp stored in an executed copy (None if there is no readable copy)."""
    try:
        nb = json.loads(Path(executed).read_text())
    except (OSError, ValueError):
        return None
    return nb.get("metadata", {}).get("cwcore", {}).get("stamp")


def notebook_parameters(source: Path) -> set[str]:
    """Names the notebook's ``parameters`` cell declares."""
    import papermill as pm

    return set(pm.inspect_notebook(str(source)))


def injected_parameters(run: Run, declared: set[str]) -> dict:
    """The parameters given to one run: those its notebook declares."""
    collect = RUN_PARAMETERS in declared
    missing = sorted(k for k in run.explicit if k not in declared and not collect)
    if run.model is not None:
        missing += [] if "model" in declared else ["model"]
    if missing:
        raise BookError(f"{run.label}: notebooks/{run.chapter.name}.ipynb does not declare {missing} "
                        f"in its 'parameters' cell (declared: {sorted(declared)})")
    given = {k: v for k, v in run.parameters.items() if k in declared}
    if collect:
        given[RUN_PARAMETERS] = {k: v for k, v in run.parameters.items()
                                 if k not in declared and k not in RUNNER_PARAMETERS}
    return given


def check_collected_parameters(run: Run, collected: dict) -> None:
    """Refuse what a ``run_parameters`` notebook (chapters 5-7, whose one reader is
    :class:`cwbook.notebook.SinkRun`) would refuse when executed: a name that is not a field."""
    from .notebook import SinkRun

    try:
        SinkRun.of(collected)
    except TypeError as err:
        raise BookError(f"{run.label}: {err}") from None


def refuse_untaken_parameters(config: dict, profile: str, notebooks_dir: Path, book_dir: Path,
                              declared: dict | None = None) -> None:
    """Refuse a name of the profile's ``params`` that no chapter of run.yml takes (declared by name, or a
    field of :class:`cwbook.notebook.SinkRun` where a notebook collects ``run_parameters``): a typo there
    was left out of every notebook without a word. ``declared``: ``{notebook: its parameter names}`` already
    read (:func:`notebook_parameters`); the other chapters' notebooks are read here."""
    from dataclasses import fields

    from .notebook import SinkRun

    name, prof = profile_config(config, profile)
    offered = set(prof.get("params") or {}) - set(RUNNER_PARAMETERS)
    if not offered:
        return
    _, _, runs = plan(config, profile=name, notebooks_dir=notebooks_dir, generated_dir=book_dir / "generated",
                      book_dir=book_dir)
    taken: set[str] = set()
    declared = declared or {}
    for source in {run.source for run in runs}:
        taken |= declared[source] if source in declared else notebook_parameters(source)
    if RUN_PARAMETERS in taken:
        taken |= {f.name for f in fields(SinkRun)}
    untaken = sorted(offered - taken)
    if untaken:
        import difflib

        close = {u: difflib.get_close_matches(u, taken, n=1) for u in untaken}
        hints = "; ".join(f"{u!r}: did you mean {c[0]!r}?" for u, c in close.items() if c)
        raise BookError(f"run.yml profile {name}: params {untaken} are declared by no chapter's 'parameters' "
                        f"cell{' (' + hints + ')' if hints else ''}")


# -- Execution ---------------------------------------------------------------------------------------
def ensure_kernel(name: str = KERNEL_NAME) -> str:
    """Make sure Jupyter kernel ``name`` runs this interpreter; (re)install it into sys.prefix if not."""
    from ipykernel.kernelspec import get_kernel_dict, write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    quiet = ["--IPKernelApp.log_level=ERROR"]
    argv = get_kernel_dict(extra_arguments=quiet)["argv"]

    def current() -> list[str] | None:
        try:
            return KernelSpecManager().get_kernel_spec(name).argv
        except NoSuchKernel:
            return None
        except ValueError:  # a kernel.json half written (another build installing it now): install it again
            return None

    if current() == argv:
        return name
    kernels = Path(sys.prefix) / "share" / "jupyter" / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    # two builds started together would both install it, and the second fails with "File exists"
    with open(kernels / f".{name}.lock", "w") as lock, tempfile.TemporaryDirectory() as tmp:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if current() != argv:
            spec_dir = write_kernel_spec(Path(tmp) / name, extra_arguments=quiet,
                                         overrides={"display_name": f"Python (cwcore, {sys.prefix})"})
            KernelSpecManager().install_kernel_spec(spec_dir, name, prefix=sys.prefix)
    found = current()
    if found != argv:
        raise BookError(f"Jupyter kernel {name!r} runs {found}, not {argv}: another kernelspec named "
                        f"{name!r} shadows the one in {sys.prefix}/share/jupyter/kernels; remove it")
    return name


@contextlib.contextmanager
def _kernel_environment():
    """Environment of the kernels papermill starts (they inherit this process's)."""
    old = {name: os.environ.get(name) for name in ("PYTHONWARNINGS", "CWCORE_CACHE", *KERNEL_ENVIRONMENT_DEFAULTS)}
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [old["PYTHONWARNINGS"], *KERNEL_WARNING_FILTERS]))
    if old["CWCORE_CACHE"]:
        os.environ["CWCORE_CACHE"] = str(Path(old["CWCORE_CACHE"]).expanduser().absolute())
    for name, value in KERNEL_ENVIRONMENT_DEFAULTS.items():
        if not os.environ.get(name):  # unset or empty
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _tag(cell, tag: str) -> None:
    tags = cell.setdefault("metadata", {}).setdefault("tags", [])
    if tag not in tags:
        tags.append(tag)


def _finish(nb, run: Run, stamp_value: str) -> None:
    """Post-process an executed notebook: record the stamp, fold the parameter cells, name the model."""
    nb.metadata["cwcore"] = {"stamp": stamp_value, "chapter": run.chapter.name, "model": run.model,
                             "profile": run.parameters.get("profile")}
    nb.metadata.setdefault("papermill", {})["output_path"] = run.output.name
    heading_done = run.model is None
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if "parameters" in tags or "injected-parameters" in tags:
            _tag(cell, "hide-cell")
        if not heading_done and cell.cell_type == "markdown":
            lines = cell.source.splitlines()
            for i, line in enumerate(lines):
                if line.startswith("# "):
                    lines[i] = f"{line.rstrip()} ({run.model})"
                    cell.source = "\n".join(lines)
                    heading_done = True
                    break


@contextlib.contextmanager
def _progress_shown(prefix: str):
    """The notebook's sweeps shown after ``prefix`` while it runs (:mod:`cwbook.progress`): its
    kernel inherits ``$CWCORE_PROGRESS_FILE``, a file of this build's."""
    from .progress import PROGRESS_FILE_ENV_VAR, Watch

    saved = os.environ.get(PROGRESS_FILE_ENV_VAR)
    with tempfile.TemporaryDirectory(prefix="cwcore-progress-") as folder:
        path = Path(folder) / "bar.json"
        os.environ[PROGRESS_FILE_ENV_VAR] = str(path)
        try:
            with Watch(path, prefix):
                yield
        finally:
            if saved is None:
                os.environ.pop(PROGRESS_FILE_ENV_VAR, None)
            else:
                os.environ[PROGRESS_FILE_ENV_VAR] = saved


def execute(run: Run, parameters: dict, stamp_value: str, kernel: str, failed_dir: Path) -> None:
    """Execute ``run`` with papermill into a temporary file, then rename it onto ``run.output``."""
    import nbformat
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    out = run.output
    (out.parent / parameters.get("output_dir", ".")).mkdir(parents=True, exist_ok=True)
    for name in ("results_file", "results_dir"):
        if name in parameters:
            folder = out.parent / parameters[name]
            (folder.parent if name == "results_file" else folder).mkdir(parents=True, exist_ok=True)
    # the writer's pid in the name: the next build removes the copies of builds that were killed
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}.{os.getpid()}.", suffix=PARTIAL_SUFFIX)
    os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp's 0600 would become the executed copy's mode
    os.close(fd)
    try:
        try:
            with _kernel_environment():
                nb = pm.execute_notebook(str(run.source), tmp, parameters=parameters, kernel_name=kernel,
                                         cwd=str(out.parent), progress_bar=False, log_output=False,
                                         request_save_on_cell_execute=False)
        except PapermillExecutionError as err:
            failed = _keep_failed(tmp, run, failed_dir)
            src = "\n".join("    " + line for line in err.source.splitlines())
            raise BookError(
                f"{run.label}: notebook notebooks/{run.chapter.name}.ipynb failed in cell {err.cell_index} "
                f"(In [{err.exec_count}]) with {err.ename}: {err.evalue}\n"
                f"--- failing cell ---\n{src}\n--- traceback ---{err}"
                f"executed copy with the error: {failed}") from None
        except Exception as err:  # kernel died, missing kernel, unreadable notebook, ...
            failed = _keep_failed(tmp, run, failed_dir)
            raise BookError(f"{run.label}: papermill could not execute notebooks/{run.chapter.name}.ipynb: "
                            f"{type(err).__name__}: {err}" + (f"\npartial copy: {failed}" if failed else "")) from err
        _finish(nb, run, stamp_value)
        nbformat.write(nb, tmp)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)


PARTIAL_SUFFIX = ".partial.ipynb"
# a partial copy without a writer's pid in its name (older cwcore) is stale after this long
STALE_PARTIAL_SECONDS = 3600


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process
    return True


def remove_stale_partials(folder: Path) -> list[Path]:
    """Delete the partial executed copies (``.<chapter>.<pid>.*.partial.ipynb``) under ``folder`` whose
    writer is no longer running (a killed build); one without a pid when it is an hour old. Returns them."""
    removed = []
    now = time.time()
    for path in Path(folder).rglob(f".*{PARTIAL_SUFFIX}") if Path(folder).is_dir() else []:
        parts = path.name[: -len(PARTIAL_SUFFIX)].split(".")
        pid = int(parts[2]) if len(parts) >= 4 and parts[2].isdigit() else None
        try:
            stale = not _pid_alive(pid) if pid is not None else now - path.stat().st_mtime > STALE_PARTIAL_SECONDS
            if stale and pid != os.getpid():
                path.unlink()
                removed.append(path)
        except OSError:
            pass
    return removed


def _keep_failed(tmp: str, run: Run, failed_dir: Path) -> Path | None:
    if not Path(tmp).is_file() or Path(tmp).stat().st_size == 0:
        return None
    failed_dir.mkdir(parents=True, exist_ok=True)
    name = run.chapter.name + (f"--{slug(run.model)}" if run.model else "") + ".ipynb"
    os.replace(tmp, failed_dir / name)
    return failed_dir / name


# -- HTML --------------------------------------------------------------------------------------------
def _book_inputs_hash(book_dir: Path, build_dir: Path) -> str:
    """Hash of everything the HTML is made from: the book's files and the jupyter-book version."""
    from importlib.metadata import version

    h = hashlib.sha256(f"jupyter-book {version('jupyter-book')}\0".encode())
    skip = {Path(book_dir) / "_build", Path(build_dir)}
    for root, dirs, files in os.walk(book_dir):
        root_path = Path(root)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and root_path / d not in skip)
        for f in sorted(files):
            if not f.startswith("."):
                path = root_path / f
                h.update(path.relative_to(book_dir).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def figure_folders(runs: list[Run]) -> list[FigureFolder]:
    """Where each run's figure files (its ``output_dir``) go in the built book, in book order."""
    out, titles = [], {}
    for run in runs:
        rel = run.parameters.get("output_dir")
        if rel is None:
            continue
        if run.source not in titles:
            titles[run.source] = notebook_title(run.source) if Path(run.source).is_file() else run.chapter.name
        dest = run.chapter.name if run.model is None else f"{run.chapter.name}/{slug(run.model)}"
        out.append(FigureFolder(dest, run.output.parent / rel, titles[run.source], run.model))
    return out


def build_html(book_dir: Path, build_dir: Path, force: bool = False, figures: list[FigureFolder] | None = None) -> Path:
    """``jupyter-book build -W`` into a temporary folder, the figure files of ``figures`` (see
    :func:`figure_folders`; None: none) copied into its ``figures/``; replace ``build_dir/html`` only
    on success."""
    book_dir, build_dir = Path(book_dir), Path(build_dir)
    html = build_dir / "html"
    inputs = _book_inputs_hash(book_dir, build_dir)
    stamp_file = html / BUILD_STAMP
    figures_ok = not figures or (html / FIGURES / "index.html").is_file()
    if (not force and stamp_file.is_file() and stamp_file.read_text() == inputs and (html / "index.html").is_file()
            and figures_ok):
        print(f"html  up to date: {html}", flush=True)
        return html
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=build_dir, prefix=".tmp-build-"))
    t0 = time.monotonic()
    try:
        cmd = [sys.executable, "-c", "import sys; from jupyter_book.cli.main import main; sys.exit(main())",
               "build", str(book_dir), "--path-output", str(tmp), "--warningiserror", "--keep-going",
               "--builder", "html"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        new = tmp / "_build" / "html"
        if proc.returncode != 0 or not (new / "index.html").is_file():
            log = (proc.stdout + proc.stderr).strip().splitlines()
            warnings = [line for line in log if "WARNING" in line or "ERROR" in line]
            shown = "\n".join(warnings or log[-40:])
            raise BookError(f"jupyter-book build failed (warnings are errors); {html} was left as it was:\n{shown}")
        if figures:
            copy_figures(new, figures)
        (new / BUILD_STAMP).write_text(inputs)
        old = build_dir / f".old-html-{os.getpid()}"
        if html.exists():
            os.replace(html, old)
        os.replace(new, html)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"html  built in {time.monotonic() - t0:.1f}s: {html / 'index.html'}", flush=True)
    return html


# -- The whole build ---------------------------------------------------------------------------------
def build(*, profile: str | None = None, models: str | list[str] | None = None,
          only: str | list[str] | None = None, book_dir: str | os.PathLike = DEFAULT_BOOK_DIR,
          build_dir: str | os.PathLike | None = None, notebooks_dir: str | os.PathLike = DEFAULT_NOTEBOOKS_DIR,
          config_path: str | os.PathLike | None = None, force: bool = False, html: bool = True) -> Path | None:
    """Execute the notebooks of a profile, write the table of contents, build the HTML."""
    book_dir = Path(book_dir).resolve()
    build_dir = Path(build_dir).resolve() if build_dir else book_dir / "_build"
    generated = book_dir / "generated"
    config = load_config(config_path or book_dir / "run.yml")
    name, chosen, runs = plan(config, profile=profile, models=models, only=only,
                              notebooks_dir=Path(notebooks_dir), generated_dir=generated, book_dir=book_dir)
    kernel = None
    t_all = time.monotonic()
    stale = remove_stale_partials(generated)
    if stale:
        print(f"book  removed {len(stale)} partial copies left by a killed build", flush=True)
    print(f"book  profile {name}: {len(runs)} notebook run(s) of {len(chosen)} chapter(s)", flush=True)
    declared: dict[Path, set[str]] = {}
    for i, run in enumerate(runs, 1):
        if run.source not in declared:
            declared[run.source] = notebook_parameters(run.source)
        params = injected_parameters(run, declared[run.source])
        current = run_stamp(run, params)
        prefix = f"[{i}/{len(runs)}] {run.label:<44}"
        if not force and read_stamp(run.output) == current and outputs_present(run, params):
            print(f"{prefix} up to date", flush=True)
            continue
        kernel = kernel or ensure_kernel()
        run.output.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        print(f"{prefix} executing ...", end="", flush=True)
        try:
            with _progress_shown(f"{prefix} executing ..."):
                execute(run, params, current, kernel, build_dir / "failed")
        except BaseException:
            print(f" FAILED after {time.monotonic() - t0:.1f}s", flush=True)
            raise
        print(f" done in {time.monotonic() - t0:.1f}s", flush=True)

    for chapter in chosen:
        if chapter.runs == "per_model":
            mine = [r for r in runs if r.chapter == chapter]
            write_if_changed(generated / chapter.name / "index.md", chapter_index(chapter, mine, name))
    toc_text = ("# Generated by `python -m cwbook build` from run.yml; do not edit.\n"
                + yaml.safe_dump(toc(chosen, runs, generated, book_dir), sort_keys=False))
    write_if_changed(book_dir / "_toc.yml", toc_text)
    out = build_html(book_dir, build_dir, force=force, figures=figure_folders(runs)) if html else None
    print(f"book  finished in {time.monotonic() - t_all:.1f}s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m cwbook build|plan``: 0 when done; 2 for bad input (run.yml, a profile, a chapter:
    one line), 1 when a notebook or the HTML build failed, or for a bug of cwcore (``--debug``: traceback)."""
    from cwcore.cli import debug_requested, run_command

    return run_command("python -m cwbook", lambda: _main(argv), debug_requested(argv))


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cwbook", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd, text in (("build", "execute the notebooks and build the HTML book"),
                      ("plan", "print the notebook runs and their parameters; execute nothing")):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("--profile", help="profile of run.yml (default: its default_profile)")
        p.add_argument("--models", help="comma-separated models replacing the profile's (per_model chapters "
                                        "without a fixed model list)")
        p.add_argument("--only", help="comma-separated chapters (names or unique prefixes, e.g. 02)")
        p.add_argument("--book-dir", default=os.environ.get("CWCORE_BOOK_DIR", DEFAULT_BOOK_DIR), type=Path)
        p.add_argument("--notebooks-dir", default=DEFAULT_NOTEBOOKS_DIR, type=Path)
        p.add_argument("--config", type=Path, help="run configuration (default: <book-dir>/run.yml)")
        p.add_argument("--debug", action="store_true", help="show the traceback of any error (or CWCORE_DEBUG=1)")
        if cmd == "build":  # plan executes and builds nothing: it takes none of these
            p.add_argument("--build-dir", default=os.environ.get("CWCORE_BOOK_BUILD_DIR"), type=Path,
                           help="where html/ goes (default: <book-dir>/_build)")
            p.add_argument("--force", action="store_true", help="execute every notebook and rebuild the HTML")
            p.add_argument("--no-html", action="store_true", help="execute the notebooks only")
            p.add_argument("--jobs", type=int, default=None,
                           help="ranks per sweep on this machine: each notebook's sweeps split their documents "
                                "over N single-thread ranks (cwcore.runs); results are the same as with 1")
    args = parser.parse_args(argv)
    if getattr(args, "jobs", None) is not None:
        if args.jobs < 1:  # one line, as every bad input (parser.error printed the usage first)
            from cwcore.cli import UsageError

            raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
        from cwcore.runs import JOBS_ENV_VAR

        os.environ[JOBS_ENV_VAR] = str(args.jobs)  # the kernels inherit it
    try:  # the configuration, the profile and the chapters first: a mistake there is bad input (status 2)
        config = load_config(args.config or args.book_dir / "run.yml")
        name = profile_config(config, args.profile)[0]
        if name in PROFILE_MODULES:
            importlib.import_module(PROFILE_MODULES[name])  # registers the profile's own build (and plan)
        own_plan = PROFILE_PLANS.get(name)
        name, chosen, runs = plan(config, profile=args.profile, models=args.models,
                                  only=None if own_plan else args.only,
                                  notebooks_dir=args.notebooks_dir, generated_dir=args.book_dir / "generated",
                                  book_dir=args.book_dir)
        declared = {source: notebook_parameters(source) for source in {run.source for run in runs}}  # each once
        for run in runs:  # a parameter a notebook does not declare: bad input (it ended as "book build FAILED")
            given = injected_parameters(run, declared[run.source])
            if RUN_PARAMETERS in given:
                check_collected_parameters(run, given[RUN_PARAMETERS])
        refuse_untaken_parameters(config, name, args.notebooks_dir, args.book_dir, declared)
    except BookError as err:
        print(f"python -m cwbook: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 2
    try:
        if own_plan is not None and args.command == "plan":
            print("\n".join(own_plan(models=args.models, only=args.only)))
            return 0
        if args.command == "plan":
            for chapter in chosen:
                if chapter.is_page:
                    print(f"{chapter.name:<44} -> {chapter.name}.md  (page, not executed)")
                for run in (r for r in runs if r.chapter == chapter):
                    params = injected_parameters(run, declared[run.source])
                    print(f"{run.label:<44} -> {os.path.relpath(run.output, args.book_dir)}  {json.dumps(params)}")
            return 0
        PROFILE_BUILDS.get(name, build)(profile=name, models=args.models, only=args.only, book_dir=args.book_dir,
              build_dir=args.build_dir, notebooks_dir=args.notebooks_dir, config_path=args.config,
              force=args.force, html=not args.no_html)
    except BookError as err:
        print(f"\nbook build FAILED: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
