"""book/preregistration.md and the code that applies it say the same thing: the page is in the table of
contents, dated, and names the family, the headline choices, the margins and the level that
``cwbook.ladder`` holds; the committed findings.csv marks exactly that family."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

import cwbook as book
from cwbook import ladder as evidence

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "book" / "preregistration.md"


def test_the_page_is_in_the_table_of_contents_before_the_chapters(tmp_path):
    config = book.load_config(REPO / "book" / "run.yml")
    names = [c.name for c in book.read_chapters(config)]
    assert "preregistration" in names and names.index("preregistration") < names.index("04_faithfulness")
    _, chosen, runs = book.plan(config, profile="smoke", generated_dir=tmp_path / "generated", book_dir=REPO / "book")
    assert {"file": "preregistration"} in book.toc(chosen, runs, tmp_path / "generated", REPO / "book")["chapters"]


def test_the_page_states_what_the_code_applies():
    text = PAGE.read_text()
    assert text.startswith("# Pre-registration")
    assert "Dated 2026-12-02" in text and re.search(r"commit `[0-9a-f]{7,40}`", text)
    family = evidence.primary_family()
    assert f"**{len(family)} tests**" in text and len(family) == 32
    for model in evidence.PRIMARY["models"]:
        assert f"**{model}**" in text
    for mode, margin in evidence.MARGINS.items():
        assert f"**{margin:g} nats** for {mode}" in text
    assert f"α = {evidence.ALPHA:g}" in text and f"{evidence.N_PERMUTATIONS} resamples" in text
    assert evidence.PRIMARY["importance"] == "absolute" and "`importance = absolute`" in text
    assert evidence.PRIMARY["range"] == "full" and "**full ratio range**" in text
    for lower, higher, protocol in evidence.PRIMARY["pairs"]:
        assert not evidence.identical_by_construction(protocol, lower, higher)  # each where it is measured
    # the step the default protocol cannot measure is registered under per-head
    assert evidence.identical_by_construction("default", "value_weighted", "value_weighted_output_normalized")


def test_the_committed_findings_mark_exactly_the_registered_family():
    table = pd.read_csv(REPO / "data" / "results" / "evidence" / "findings.csv")
    assert set(table["sample"]) <= {"exploratory", "confirmatory"} and "exploratory" in set(table["sample"])
    for _, one in table.groupby("sample"):  # each sample's family is decided on its own
        _marks_the_family(one)


def test_the_exploratory_tests_seen_before_registration_are_marked():
    """22 of the exploratory family's 32 tests were computed before the registration of 2026-12-02: their
    rows say ``prospective = False``; the other 10 (gemma3-270m's later cells) and every confirmatory test
    say True."""
    from cwbook import registration

    table = pd.read_csv(REPO / "data" / "results" / "evidence" / "findings.csv")
    primary = table[table["primary"]]
    exploratory = primary[primary["sample"] == "exploratory"]
    seen = [(m, d, p) in set(registration.SEEN_BEFORE_REGISTRATION)
            for m, d, p in zip(exploratory["model"], exploratory["data"], exploratory["protocol"])]
    assert (exploratory["prospective"].astype(bool) == [not s for s in seen]).all()
    assert sum(seen) == 22 and len(exploratory) - sum(seen) == 10
    assert primary.loc[primary["sample"] == "confirmatory", "prospective"].astype(bool).all()
    assert table.loc[~table["primary"], "prospective"].isna().all()


def _marks_the_family(table):
    primary = table[table["primary"]]
    claim = {("attention", "value_weighted"): "step 1->2", ("value_weighted", "value_weighted_output_normalized"): "step 2->3",
             ("value_weighted_output_normalized", "contribution"): "step 3->4",
             ("random", "contribution"): "contribution beats random"}
    registered = {(m["model"], m["data"], m["mode"], m["protocol"], claim[(m["lower"], m["higher"])])
                  for m in evidence.primary_family()}
    marked = set(zip(primary["model"], primary["data"], primary["mode"], primary["protocol"], primary["claim"]))
    assert marked <= registered and len(marked) == len(primary)
    assert (primary["importance"] == "absolute").all() and (primary["range"] == "full").all()
    assert primary["p_holm"].notna().all() and table.loc[~table["primary"], "p_holm"].isna().all()
    assert (primary["p_holm"] >= primary["p"]).all() and (primary["variant"] == "main").all()
