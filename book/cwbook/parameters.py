"""What a chapter runs with under a profile of ``book/run.yml``: the one reader of its parameters."""

from __future__ import annotations

import ast
import os

from . import DEFAULT_BOOK_DIR, BookError, injected_parameters, load_config, plan, profile_config


def declared_defaults(source: str | os.PathLike) -> dict:
    """``{name: default}`` of a notebook's ``parameters`` cell, each default a Python literal
    (:func:`ast.literal_eval` of papermill's reading of the cell; a non-literal default is refused)."""
    import papermill as pm

    out = {}
    for name, info in pm.inspect_notebook(str(source)).items():
        try:
            out[name] = ast.literal_eval(info["default"])
        except (ValueError, SyntaxError):
            raise BookError(f"{source}: parameter {name} = {info['default']} is not a literal; a parameters "
                            "cell holds plain values (the runner and its readers do not execute it)") from None
    return out


def _config(config: str | os.PathLike | dict | None) -> dict:
    if isinstance(config, dict):
        return config
    return load_config(config or DEFAULT_BOOK_DIR / "run.yml")


def run_parameters(chapter: str, profile: str | None = None, model: str | None = None, *,
                   config: str | os.PathLike | dict | None = None) -> dict:
    """Every parameter notebook ``chapter`` runs with under ``profile`` (default: run.yml's
    ``default_profile``) on ``model`` (per_model chapters; None for a once chapter): its parameters
    cell's defaults (:func:`declared_defaults`), replaced by those the book runner injects.
    ``config``: a run.yml path or its loaded mapping (default ``book/run.yml``)."""
    conf = _config(config)
    _, _, runs = plan(conf, profile=profile, models=[model] if model else None, only=chapter)
    runs = [r for r in runs if r.chapter.name == chapter]
    run = next((r for r in runs if r.model == model), None)
    if run is None:
        raise BookError(f"profile {profile!r} does not run {chapter} on {model!r} "
                        f"(it runs {[r.model for r in runs]})")
    defaults = declared_defaults(run.source)
    return {**defaults, **injected_parameters(run, set(defaults))}


def profile_models(profile: str | None = None, *, config: str | os.PathLike | dict | None = None) -> list[str]:
    """The models of ``profile`` (its ``models`` list, in order)."""
    _, prof = profile_config(_config(config), profile)
    return list(prof.get("models") or [])

