"""The set-up chapters 5, 6 and 7 share: one cached pass of the sink analyses on the same blocks.

Each of the three chapters asks :func:`cwcore.sinks.run_analyses` for the analyses it shows and passes
``precompute=sinks.ANALYSES``, with the same run parameters (:class:`cwbook.notebook.SinkRun`) and the same
blocks (the first ``seq_len`` tokens of ``n_sequences`` documents per data set drawn with ``seed``): whichever
chapter runs first computes all of the paper's section on attention sinks in one shared pass, the others read
the cache.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field

from cwbook.notebook import SinkRun


def sinks_module(name: str):
    """The submodule ``cwcore.sinks.<name>`` itself (e.g. ``"anti_alignment"``, ``"convexity"``,
    ``"semantic_cone"``), whatever the package binds under that name: the one place the chapters reach
    the analyses' modules."""
    return importlib.import_module(f"cwcore.sinks.{name}")


@dataclass
class SinkPass:
    """The sink analyses of one model on every data set of a run.

    ``results[d]`` is what :func:`cwcore.sinks.run_analyses` returns for data set ``d`` (with ``raw=True``:
    the per-query points under ``results[d]["raw"]``); ``seconds[d]`` the time it took (near zero when the
    shared pass was cached); ``blocks[d]`` the token blocks, one per document ([n_sequences, seq_len] ids).
    """

    model: str
    run: SinkRun
    lm: object
    tokenizer: object
    options: object  # cwcore.sinks.SinkOptions
    blocks: dict
    results: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)

    @property
    def datasets(self) -> list[str]:
        return list(self.run.datasets)

    @property
    def first(self) -> str:
        """The data set the figures show."""
        return self.datasets[0]

    @property
    def eps(self) -> float:
        """The sink-head threshold on the sink rate (``SinkOptions.eps``)."""
        return self.options.eps


class OnSinkPass:
    """What a sink chapter's result reads from its shared pass (``self.sinks``, a :class:`SinkPass`) and its
    ``n_bootstrap``: one home for the facts chapters 5, 6 and 7 all quote."""

    sinks: SinkPass
    n_bootstrap: int

    @property
    def model(self) -> str:
        return self.sinks.model

    @property
    def datasets(self) -> list[str]:
        return self.sinks.datasets

    @property
    def first(self) -> str:
        """The data set of the figures and of the prose's numbers."""
        return self.sinks.first

    @property
    def data(self) -> str:
        return self.sinks.first

    @property
    def results(self) -> dict:
        return self.sinks.results

    @property
    def eps(self) -> float:
        return self.sinks.eps

    @property
    def seed(self) -> int:
        return self.sinks.run.seed

    @property
    def seq_len(self) -> int:
        return self.sinks.run.seq_len

    @property
    def boot(self) -> dict:
        """The bootstrap arguments of every interval on the page."""
        return dict(n_resamples=self.n_bootstrap, seed=self.seed)


def sink_pass(model: str, run_parameters: dict | None, analyses: list[str], **analysis_options) -> SinkPass:
    """Load ``model`` and run ``analyses`` of :mod:`cwcore.sinks` on the blocks of every data set of
    ``run_parameters`` (``raw=True``, ``precompute=sinks.ANALYSES``: one shared, cached pass for chapters 5-7).

    ``analysis_options`` go to :func:`cwcore.sinks.run_analyses` (``bins``, ``min_range``, ``sample_size``, ...).
    Seeds torch with the run's seed before loading, as the chapters always have.
    """
    import torch
    from cwcore import sinks

    run = SinkRun.of(run_parameters)
    torch.manual_seed(run.seed)
    lm, tokenizer = run.load(model)
    options = run.options()  # the analyses' options, each declared once in cwcore.sinks with its default and check
    out = SinkPass(model=model, run=run, lm=lm, tokenizer=tokenizer, options=options, blocks=run.blocks(tokenizer))
    for d in out.datasets:
        t0 = time.monotonic()
        with run.caching():  # the run's ``cache`` parameter: on unless it is False
            out.results[d] = sinks.run_analyses(lm, tokenizer, out.blocks[d], list(analyses), options,
                                                precompute=sinks.ANALYSES, raw=True, **analysis_options)
        out.seconds[d] = time.monotonic() - t0
    return out
