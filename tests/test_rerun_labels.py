"""Chapters 4-7 print verdict words only from the committed evidence-size tables: what a build computes itself
is a rerun check, labelled with the size it ran at, described by where its intervals lie and whether it agrees
with the evidence (:mod:`cwbook.chapters.common`, :mod:`cwbook.chapters.sinks_common`)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from cwbook.chapters import common
from cwbook.chapters.common import (AGREEMENT_SAID, AGREEMENT_SHORT, rerun_agrees, rerun_direction, rerun_label,
                                    unlabelled_verdicts)
from cwcore import stats

H, C, I, N, NM = stats.HOLDS, stats.CONTRADICTED, stats.INCONCLUSIVE, stats.NEGLIGIBLE, stats.NOT_MEASURED


def test_the_scan_finds_a_verdict_word_and_only_a_whole_one():
    assert unlabelled_verdicts("the ordering holds on gsm8k") == [H]
    assert unlabelled_verdicts("Contradicted; inconclusive elsewhere") == [C, I]
    assert unlabelled_verdicts("the holdout set is uncontradictedly fine") == []  # parts of words do not count
    assert unlabelled_verdicts("interval on the claimed side") == []


def test_the_label_says_the_size_the_run_really_had():
    assert rerun_label({"gsm8k": 6, "web-text": 6}) == "rerun check (6 documents per data set, one seed, no adjustment)"
    assert rerun_label({"gsm8k": 1}) == "rerun check (1 document per data set, one seed, no adjustment)"
    assert rerun_label({"gsm8k": 6, "web-text": 8}) == ("rerun check (6 and 8 documents (gsm8k, web-text), one seed, "
                                                        "no adjustment)")


def test_under_the_evidence_profile_the_pages_own_numbers_are_the_evidence_build():
    from cwbook.chapters.sinks_common import OnSinkPass, SinkPass

    assert rerun_label({"gsm8k": 64, "web-text": 64}, "evidence") == (
        "evidence build (64 documents per data set, one seed, no adjustment)")
    assert rerun_label({"gsm8k": 2}, "smoke") == rerun_label({"gsm8k": 2}) == (
        "rerun check (2 documents per data set, one seed, no adjustment)")

    class Page(OnSinkPass):
        pass

    for profile, said in (("default", "rerun check"), ("evidence", "evidence build")):
        page = Page()
        page.sinks = SinkPass(model="m", run=SimpleNamespace(datasets=["gsm8k", "web-text"]), lm=None, tokenizer=None,
                              options=None, blocks={"gsm8k": [0] * 3, "web-text": [0] * 3}, profile=profile)
        assert page.rerun_label == f"{said} (3 documents per data set, one seed, no adjustment)"


@pytest.mark.parametrize("verdict", [*stats.VERDICTS, "not measured: no sink heads at eps=0.3", None, float("nan")])
def test_a_rerun_is_described_without_a_verdict_word(verdict):
    for claim in (False, True):
        said = rerun_direction(verdict, claim=claim)
        assert said and not unlabelled_verdicts(said), said
    assert rerun_direction("not measured: no sink heads at eps=0.3") == "not measured: no sink heads at eps=0.3"
    assert not unlabelled_verdicts(" ".join([*AGREEMENT_SAID.values(), *AGREEMENT_SHORT.values()]))
    assert len(set(common.RERUN_DIRECTION.values())) == len(stats.VERDICTS)  # each verdict its own description


def test_agreement_with_the_evidence():
    assert rerun_agrees(H, H) == rerun_agrees(C, C) == rerun_agrees(N, N) == common.AGREES
    assert rerun_agrees(I, H) == rerun_agrees(NM, C) == rerun_agrees("not measured: why", H) == common.TOO_SMALL
    assert rerun_agrees(H, C) == rerun_agrees(C, H) == rerun_agrees(H, I) == common.DIFFERS
    assert rerun_agrees(H, None) == rerun_agrees(H, NM) == rerun_agrees(H, float("nan")) == common.NO_EVIDENCE
    assert rerun_agrees(I, I) == common.AGREES


# -- chapters 5-7 ----------------------------------------------------------------------------------------------------
def _claims(rows):
    """A stacked claims table: (claim, key "<data>/<part key>", estimate, low, high, threshold, side)."""
    out = []
    for claim, key, e, lo, hi, threshold, side in rows:
        data = key.split("/")[0]
        out.append({"chapter": 5, "claim": claim, "part": f"{data}: {key}", "statistic": "a share", "key": key,
                    "estimate": e, "low": lo, "high": hi, "threshold": threshold, "side": side, "n": 10,
                    "verdict": stats.verdict(lo, hi, threshold=threshold, side=side), "why": "", "unit": "head",
                    "n_units": 10, "source": "paper"})
    return pd.DataFrame(out)


def _evidence(table, registered=None):
    from cwbook.chapters.sinks_common import Evidence

    registered = registered if registered is not None else pd.DataFrame(
        columns=["model", "data", "claim", "computed", "verdict", "failing"])
    return Evidence("exploratory", 64, table, registered)


RERUN = _claims([("a claim", "gsm8k/p1", 0.8, 0.7, 0.9, 0.5, "above"),      # rerun: claimed side
                 ("a claim", "gsm8k/p2", 0.5, 0.3, 0.7, 0.5, "above"),      # rerun: straddles
                 ("a claim", "web-text/p1", 0.2, 0.1, 0.3, 0.5, "above"),   # rerun: opposite side
                 ("a claim", "web-text/p3", 0.6, 0.55, 0.7, 0.5, "above")])  # not committed
COMMITTED = _claims([("a claim", "gsm8k/p1", 0.7, 0.65, 0.75, 0.5, "above"),   # holds
                     ("a claim", "gsm8k/p2", 0.7, 0.6, 0.8, 0.5, "above"),     # holds
                     ("a claim", "web-text/p1", 0.7, 0.6, 0.8, 0.5, "above")])  # holds


def test_a_sink_chapters_table_shows_the_evidence_verdict_and_no_rerun_verdict():
    from cwbook.chapters.sinks_common import rerun_claims_table

    evidence = _evidence(COMMITTED)
    label = rerun_label({"gsm8k": 2, "web-text": 2})
    shown = rerun_claims_table(RERUN, evidence, label)
    assert not [c for c in shown.columns if unlabelled_verdicts(c)], list(shown.columns)  # headers too
    rerun_columns = [c for c in shown.columns if c.startswith("rerun")]
    assert rerun_columns == ["rerun estimate", "rerun 95% interval", "rerun direction",
                             "rerun agrees with the evidence?"]
    for column in rerun_columns:
        assert not unlabelled_verdicts(" ".join(map(str, shown[column]))), column
    assert shown[evidence.label].tolist() == [H, H, H, "not committed"]
    assert shown["rerun direction"].tolist() == ["interval on the claimed side", "interval straddles the threshold",
                                                 "interval on the opposite side", "interval on the claimed side"]
    assert shown["rerun agrees with the evidence?"].tolist() == ["yes", "too few documents to tell", "no",
                                                                 "no committed verdict"]
    bare = rerun_claims_table(RERUN, None, label)  # no evidence (another model): nothing is decided
    assert not unlabelled_verdicts(bare.drop(columns=["claim", "part", "statistic"]).to_string())


def test_a_claim_reads_the_evidence_verdict_and_says_whether_the_rerun_agrees():
    from cwbook.chapters.sinks_common import claim_phrase

    contradicting = _claims([("a claim", "gsm8k/p1", 0.2, 0.1, 0.3, 0.5, "above"),
                             ("a claim", "web-text/p1", 0.2, 0.1, 0.3, 0.5, "above")])
    rerun = _claims([("a claim", "gsm8k/p1", 0.8, 0.7, 0.9, 0.5, "above"),
                     ("a claim", "web-text/p1", 0.5, 0.4, 0.6, 0.5, "above")])
    said = claim_phrase("a claim", rerun, ["gsm8k", "web-text"], _evidence(contradicting))
    assert said.startswith("**contradicted** on `gsm8k` and **contradicted** on `web-text` in the evidence "
                           "(exploratory sample, 64 documents per data set)")
    assert unlabelled_verdicts(said) == [C]  # the rerun's own (holds, inconclusive) is never printed
    assert "the rerun check differs on `gsm8k` and has too few documents to tell on `web-text`" in said
    alone = claim_phrase("a claim", rerun, ["gsm8k", "web-text"], None)
    assert not unlabelled_verdicts(alone), alone
    assert "no committed evidence" in alone


def test_the_committed_evidence_is_read_by_the_registered_rule_with_its_controls():
    from cwbook import findings, headline, registration
    from cwbook.chapters.sinks_common import claim_verdict_of, committed_evidence

    evidence = committed_evidence("06_sinks_as_suppressors", "smollm2-135m")
    if evidence is None:
        pytest.skip("no committed evidence in this checkout")
    assert evidence.n_documents == 64 and evidence.label.endswith("64 documents per data set)")
    # the confirmatory sample's table where it is committed, else the exploratory one's
    folder = findings.CONFIRMATORY_DIR if evidence.sample == registration.CONFIRMATORY else findings.EVIDENCE_DIR
    assert evidence.sample == (registration.CONFIRMATORY if findings.load_results(
        findings.CONFIRMATORY_DIR, "06_sinks_as_suppressors", "smollm2-135m") is not None else registration.EXPLORATORY)
    expected = headline.registered_sink_verdicts(folder, ["smollm2-135m"])
    claims = [c["claim"] for c in registration.SINK_CLAIMS if headline.SINK_CLAIM_CHAPTER[c["claim"]] ==
              "06_sinks_as_suppressors"]
    for claim, data in itertools.product(claims, registration.CONFIRMATORY_DATA):
        row = expected[(expected["claim"] == claim) & (expected["data"] == data)].iloc[0]
        assert evidence.claim_verdict(data, claim) == row["verdict"] == claim_verdict_of(evidence.table, data, claim)
    # a part's verdict is the committed table's
    row = evidence.table.iloc[0]
    data, _, key = row["key"].rpartition("/")
    assert evidence.part_verdict(data, key) == row["verdict"]


def test_chapter_5_says_which_terms_clear_the_tail_margin_without_a_verdict_word():
    from cwbook.chapters.ch05_sink_decomposition import SinkDecomposition, tail_reading

    for attention, alignment in itertools.product(stats.VERDICTS, repeat=2):
        claims = pd.DataFrame({"key": ["tail_alpha_share", "tail_cosine_share"], "verdict": [attention, alignment]})
        r = SinkDecomposition(sinks=None, sample_size=10, n_bootstrap=10, claims_by_data={"gsm8k": claims})
        said = tail_reading(r, "gsm8k")
        assert said.startswith("on `gsm8k`") and not unlabelled_verdicts(said), said


def test_chapter_6_quotes_a_part_by_where_its_interval_lies_and_the_evidence_by_its_verdict():
    from cwbook.chapters.ch06_sinks_as_suppressors import Suppressors

    claims = pd.DataFrame([{"key": "contrast", "estimate": -0.3, "low": -0.4, "high": -0.2, "verdict": H, "why": ""}])
    r = Suppressors(sinks=None, bins=10, min_range=0.05, n_examples=4, n_bootstrap=10, runs={},
                    claims_of={"gsm8k": claims}, claims=claims)
    assert r.verdict_of("gsm8k", "contrast") == "interval on the claimed side"
    r.evidence = _evidence(_claims([("anti-alignment", "gsm8k/contrast", -0.1, -0.2, 0.05, 0.0, "below")]))
    assert r.verdict_of("gsm8k", "contrast") == "interval on the claimed side; evidence: inconclusive"


# -- chapter 4 -------------------------------------------------------------------------------------------------------
def _steps(verdicts, estimates=None):
    n = len(verdicts)
    return pd.DataFrame({"claim": ["step 1->2"] * n, "model": "m", "data": [f"d{i}" for i in range(n)],
                         "mode": "comprehensiveness", "protocol": "default", "importance": "signed", "range": "full",
                         "variant": "main", "verdict": verdicts,
                         "estimate": estimates if estimates is not None else [0.01] * n,
                         "ci_low": [-0.02] * n, "ci_high": [0.03] * n})


def test_chapter_4_shows_a_rerun_step_by_its_agreement_with_the_committed_step():
    from cwbook.chapters.ch04_faithfulness import agreement_cells

    rerun = _steps([H, I, C, H, NM, H], estimates=[0.01, 0.01, 0.01, 0.01, np.nan, 0.01])
    committed = _steps([H, H, H, C, NM])  # d5 is not committed
    cells = agreement_cells(rerun, committed)
    assert cells == ["+0.010 [-0.020, +0.030]; agrees", "+0.010 [-0.020, +0.030]; too few to tell",
                     "+0.010 [-0.020, +0.030]; differs", "+0.010 [-0.020, +0.030]; differs",
                     "no interval; not measured", "+0.010 [-0.020, +0.030]; no evidence"]
    assert not unlabelled_verdicts(" ".join(cells + agreement_cells(rerun, None)))


# -- chapter 9 -------------------------------------------------------------------------------------------------------
def test_chapter_9_sets_the_rerun_beside_the_evidence_without_its_verdict():
    from cwbook.chapters.ch09_findings import _without_verdict, beside_evidence, rerun_size

    rerun = _steps([H, I, C]).assign(n_units=4, unit="document")
    committed = _steps([H, H, H])
    label = rerun_size(rerun)
    assert label == "rerun check (4 documents per data set, one seed, no adjustment)"
    shown = beside_evidence(rerun, committed, label)
    assert "verdict" not in shown and not unlabelled_verdicts(" ".join(map(str, shown[label])))
    assert shown["evidence"].tolist() == [H, H, H]
    assert shown["rerun agrees with the evidence?"].tolist() == ["agrees", "too few to tell", "differs"]
    assert _without_verdict("+0.1 [+0.05, +0.2] holds") == "+0.1 [+0.05, +0.2]: interval on the claimed side"
    assert _without_verdict("not measured: identical") == "not measured: identical"
