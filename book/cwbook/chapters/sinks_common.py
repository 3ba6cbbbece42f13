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

from cwbook.chapters.common import AGREEMENT_SAID, interval_span, rerun_agrees, rerun_direction, rerun_label
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
    profile: str = "default"  # the run profile of book/run.yml the chapter was built with (its labels say so)

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

    @property
    def documents(self) -> dict:
        """The documents each data set's analyses really ran on ({data: count})."""
        return {d: len(self.sinks.blocks[d]) for d in self.datasets}

    @property
    def rerun_label(self) -> str:
        """``"rerun check (6 documents per data set, one seed, no adjustment)"``: what this page's own numbers
        are, beside the committed evidence that decides the claims (``"evidence build (...)"`` under the
        ``evidence`` profile, whose run is the evidence)."""
        return rerun_label(self.documents, self.sinks.profile)


def sink_pass(model: str, run_parameters: dict | None, analyses: list[str], *, profile: str = "default",
              **analysis_options) -> SinkPass:
    """Load ``model`` and run ``analyses`` of :mod:`cwcore.sinks` on the blocks of every data set of
    ``run_parameters`` (``raw=True``, ``precompute=sinks.ANALYSES``: one shared, cached pass for chapters 5-7).
    ``profile``: the run profile the chapter is built with (it names what the page's own numbers are).

    ``analysis_options`` go to :func:`cwcore.sinks.run_analyses` (``bins``, ``min_range``, ``sample_size``, ...).
    Seeds torch with the run's seed before loading, as the chapters always have.
    """
    import torch
    from cwcore import sinks

    run = SinkRun.of(run_parameters)
    torch.manual_seed(run.seed)
    lm, tokenizer = run.load(model)
    options = run.options()  # the analyses' options, each declared once in cwcore.sinks with its default and check
    out = SinkPass(model=model, run=run, lm=lm, tokenizer=tokenizer, options=options, blocks=run.blocks(tokenizer),
                   profile=profile)
    for d in out.datasets:
        t0 = time.monotonic()
        with run.caching():  # the run's ``cache`` parameter: on unless it is False
            out.results[d] = sinks.run_analyses(lm, tokenizer, out.blocks[d], list(analyses), options,
                                                precompute=sinks.ANALYSES, raw=True, **analysis_options)
        out.seconds[d] = time.monotonic() - t0
    return out


# -- the committed evidence beside the rerun check ------------------------------------------------------------------
@dataclass
class Evidence:
    """The committed evidence-size table of one sink chapter and model: the ``sample`` it is from
    (confirmatory where committed, else exploratory), the documents per data set it ran on
    (``n_documents``, from its metadata), its claims ``table`` (keys ``"<data>/<key>"``) and the registered
    claims' verdicts with their controls (``registered``: :func:`cwbook.headline.registered_sink_verdicts`).
    Every verdict word chapters 5-7 print comes from here."""

    sample: str
    n_documents: int
    table: object  # pd.DataFrame
    registered: object  # pd.DataFrame

    @property
    def label(self) -> str:
        return f"evidence ({self.sample} sample, {self.n_documents} documents per data set)"

    def part_verdict(self, data: str, key: str):
        """The committed verdict of part ``key`` on ``data`` (None where the table has no such part)."""
        from cwbook.findings import _part_verdict

        rows = self.table[self.table["key"] == f"{data}/{key}"]
        return _part_verdict(rows.iloc[0]) if len(rows) else None

    def claim_verdict(self, data: str, claim: str):
        """The committed verdict of ``claim`` on ``data``: by the registered rule with its controls for a
        registered claim, else by the chapter's rule over its parts in the committed table (None: absent)."""
        reg = self._registered(data, claim)
        if reg is not None:
            return str(reg["verdict"])
        rows = self.table[self.table["key"].astype(str).str.startswith(f"{data}/") & (self.table["claim"] == claim)]
        return claim_verdict_of(self.table, data, claim) if len(rows) else None


    def _registered(self, data: str, claim: str):
        reg = self.registered[(self.registered["data"] == data) & (self.registered["claim"] == claim)]
        return reg.iloc[0] if len(reg) and int(reg["computed"].iloc[0]) > 0 else None

    def claim_reason(self, data: str, claim: str) -> str:
        """For a registered claim that does not hold in the evidence: the part that stops it, decisive one first
        (e.g. "the null baseline (a random key) was not computed"); "" otherwise."""
        reg = self._registered(data, claim)
        if reg is None or reg["verdict"] == "holds" or not isinstance(reg["failing"], str):
            return ""
        return reg["failing"].split("; ")[0]

    def claim_text(self, data: str, claim: str) -> str:
        """``**verdict** on `data``` with the reason a registered claim does not hold, for the prose."""
        v = self.claim_verdict(data, claim)
        if v is None:
            return f"not committed on `{data}`"
        why = self.claim_reason(data, claim)
        return f"**{v}** on `{data}`" + (f" ({why})" if why else "")


def _committed(chapter: str, model: str, exploratory_dir=None, confirmatory_dir=None):
    """(sample, folder, loaded results) of the committed table of ``chapter`` for ``model``, or None."""
    from cwbook import findings, registration

    for sample, folder in ((registration.CONFIRMATORY, confirmatory_dir or findings.CONFIRMATORY_DIR),
                           (registration.EXPLORATORY, exploratory_dir or findings.EVIDENCE_DIR)):
        got = findings.load_results(folder, chapter, model)
        if got is not None:
            return sample, folder, got
    return None


def _other_settings(got, **settings) -> dict:
    """The committed table's settings that differ from this rerun's ``settings`` (``eps=0.9``, ``quantiles=10``;
    None: not given), as ``{name: (committed, rerun)}``. A table that records a setting not (the confirmatory
    build's) ran at its default, the registered one: eps :data:`cwcore.sinks.engine.EPS`, 5 quantiles."""
    from cwcore.sinks.engine import EPS

    defaults = {"eps": EPS.default, "quantiles": 5}
    recorded = got.metadata.get("parameters", {})
    committed = {name: float(recorded.get(name, defaults[name])) for name in settings}
    return {name: (committed[name], float(value)) for name, value in settings.items()
            if value is not None and abs(committed[name] - float(value)) > 1e-12}


def committed_evidence(chapter: str, model: str, *, eps: float | None = None, quantiles: int | None = None,
                       exploratory_dir=None, confirmatory_dir=None) -> Evidence | None:
    """The committed :class:`Evidence` of ``chapter`` for ``model``: the confirmatory sample's table where it
    is committed, else the exploratory one's; None where neither is (another model, an installed package), or
    where it was computed at another sink threshold than this rerun's ``eps``, or (chapter 7) with another number
    of output-norm bins than its ``quantiles``: its verdicts answer another question (a rerun at eps=0.9 read
    "holds in the evidence; the rerun check differs")."""
    from cwbook import headline

    found = _committed(chapter, model, exploratory_dir, confirmatory_dir)
    if found is None or _other_settings(found[2], eps=eps, quantiles=quantiles):
        return None
    sample, folder, got = found
    parameters = got.metadata.get("parameters", {})
    n = parameters.get("n_documents", parameters.get("n_sequences"))
    return Evidence(sample, int(n) if n is not None else 0, got.table,
                    headline.registered_sink_verdicts(folder, [model]))


def no_evidence_label(chapter: str, model: str, eps: float | None = None, quantiles: int | None = None) -> str:
    """What a sink chapter says where :func:`committed_evidence` gives none: no table for the model, or one
    computed at another sink threshold or number of bins (not compared)."""
    found = _committed(chapter, model)
    other = {} if found is None else _other_settings(found[2], eps=eps, quantiles=quantiles)
    if not other:
        return "no committed evidence for this model"
    return (f"committed evidence at {', '.join(f'{name}={committed:g}' for name, (committed, _) in other.items())}, "
            f"not compared with this rerun at {', '.join(f'{name}={rerun:g}' for name, (_, rerun) in other.items())}")


def rerun_claims_table(claims, evidence: Evidence | None, label: str, digits: int = 2):
    """A sink chapter's claims table (data sets stacked, :func:`cwbook.sink_claims.stack_data`) as the
    chapter shows it: the rerun's estimate, interval and direction (no verdict word), the claimed side, the
    committed evidence's verdict of the same part and whether the rerun agrees with it (the evidence column is
    named by :attr:`Evidence.label`). ``label``: the rerun check's (:func:`rerun_label`), for the caption.
    ``digits``: of the interval."""
    import pandas as pd

    from cwbook.findings import _part_verdict
    from cwbook import sink_claims

    rows = []
    for _, r in claims.iterrows():
        data, _, key = str(r["key"]).rpartition("/")
        live = _part_verdict(r)
        committed = evidence.part_verdict(data, key) if evidence is not None else None
        rows.append({
            "claim": r["claim"], "part": r["part"], "statistic": r["statistic"], "rerun estimate": r["estimate"],
            "rerun 95% interval": interval_span(r["low"], r["high"], lambda x: f"{x:.{digits}f}") or "no interval",
            "claimed side": f"{'<' if r['side'] == 'below' else '>'} {r['threshold']:g}",
            "rerun direction": rerun_direction(f"{live}: {r['why']}" if live == "not measured" and isinstance(
                r.get("why"), str) and r.get("why") else live),
            "evidence": committed if committed is not None else "not committed",
            "rerun agrees with the evidence?": rerun_agrees(live, committed),
            "claim by": "the book" if r.get("source") == sink_claims.BOOK else "the paper"})
    out = pd.DataFrame(rows)
    if evidence is not None:
        out = out.rename(columns={"evidence": evidence.label})
    return out


def claim_verdict_of(claims, data: str, claim: str) -> str:
    """The verdict of ``claim`` on ``data`` from a stacked claims table (keys ``"<data>/<key>"``): by the
    registered rule with its controls (:data:`cwbook.registration.SINK_CLAIMS`, as
    :func:`cwbook.headline.registered_sink_verdicts` reads the committed tables) for a registered claim, else
    by the chapter's rule over its parts (:func:`cwbook.sink_claims.claim_verdict_texts`). So a rerun is
    compared with the evidence by the same rule."""
    from cwbook import registration
    from cwcore import stats
    from cwbook import sink_claims

    spec = next((c for c in registration.SINK_CLAIMS if c["claim"] == claim), None)
    if spec is not None:
        verdicts = []
        for key, threshold, side, _role in spec["parts"]:
            hit = claims[claims["key"] == f"{data}/{key}"]
            verdicts.append(stats.NOT_MEASURED if hit.empty else stats.verdict(
                float(hit["low"].iloc[0]), float(hit["high"].iloc[0]), threshold=threshold, side=side))
        return stats.combine_all(verdicts)
    rows = claims[claims["key"].astype(str).str.startswith(f"{data}/") & (claims["claim"] == claim)]
    return sink_claims.claim_verdict_texts(rows).get(claim, stats.NOT_MEASURED) if len(rows) else stats.NOT_MEASURED


def claim_phrase(claim: str, rerun_claims, datasets, evidence: Evidence | None) -> str:
    """How a claim fares, for the prose: the committed evidence's verdict on each data set (bold), then
    whether the rerun check agrees by the same rule (``rerun_claims``: the rerun's claims, data sets stacked).
    Without committed evidence, only where the rerun's intervals lie (no verdict word)."""
    live = {d: claim_verdict_of(rerun_claims, d, claim) for d in datasets}
    if evidence is None:
        return ("no committed evidence for this model at this rerun's settings; the rerun check: "
                + "; ".join(f"on `{d}` {rerun_direction(v, claim=True)}" for d, v in live.items()))
    said = {d: evidence.claim_verdict(d, claim) for d in live}
    verdicts = " and ".join(evidence.claim_text(d, claim) for d in live)
    agreement = [(d, AGREEMENT_SAID[rerun_agrees(live[d], said[d])]) for d in live]
    if len({a for _, a in agreement}) == 1:
        rerun = f"the rerun check {agreement[0][1]}"
    else:
        rerun = "the rerun check " + " and ".join(f"{a} on `{d}`" for d, a in agreement)
    return f"{verdicts} in the {evidence.label}; {rerun}"


def part_phrase(claims, data: str, key: str, evidence: Evidence | None) -> str:
    """Where the rerun's interval of part ``key`` on ``data`` lies, with the committed evidence's verdict of
    the same part (``claims``: the rerun's claims, data sets stacked)."""
    from cwbook.findings import _part_verdict

    rows = claims[claims["key"] == f"{data}/{key}"]
    said = rerun_direction(_part_verdict(rows.iloc[0]) if len(rows) else None)
    committed = evidence.part_verdict(data, key) if evidence is not None else None
    return said if committed is None else f"{said}; evidence: {committed}"


def disagreement_opening(claim: str, what: str, rerun_claims, datasets, evidence: Evidence | None,
                         label: str) -> list[str] | None:
    """The first sentences of a sink chapter's paragraph on a claim that does not hold: its verdict on each data
    set in the committed evidence (or, with none committed, where the rerun's intervals lie), and what the
    data sets say; None when the claim holds on every data set (nothing to explain). ``label``: the rerun
    check's, for the numbers that follow."""
    from cwcore import stats

    live = {d: claim_verdict_of(rerun_claims, d, claim) for d in datasets}
    if evidence is None:
        if all(v == stats.HOLDS for v in live.values()):
            return None
        return [f"**{what}**, {label}: " + ", ".join(f"`{d}` {rerun_direction(v, claim=True)}"
                                                     for d, v in live.items()) + ".",
                "The numbers that can explain it:"]
    verdicts = {d: evidence.claim_verdict(d, claim) for d in datasets}
    if all(v == stats.HOLDS for v in verdicts.values()):
        return None
    lines = [f"**{what}**, {evidence.label}: " + ", ".join(evidence.claim_text(d, claim) for d in datasets) + "."]
    if len(set(verdicts.values())) > 1:
        lines.append("The data set matters: the verdicts differ between them.")
    elif set(verdicts.values()) != {stats.NOT_MEASURED} and len(verdicts) > 1:
        lines.append("The data set is not the explanation: the verdict is the same on "
                     + ("both." if len(verdicts) == 2 else f"all {len(verdicts)}."))
    lines.append(f"The numbers that can explain it, from the {label}:")
    return lines


def _on_every(count: int) -> str:
    return "on its data set" if count == 1 else "on both data sets" if count == 2 else f"on all {count} data sets"


def nothing_to_explain(evidence: Evidence | None, label: str, datasets) -> str:
    """A sink chapter's disagreement section when every claim holds on every data set of ``datasets``."""
    if evidence is not None:
        return f"Every claim of this page holds {_on_every(len(datasets))} in the {evidence.label}: nothing to explain."
    return (f"In the {label} every claim's parts lie on the claimed side {_on_every(len(datasets))}: nothing to "
            "explain.")
