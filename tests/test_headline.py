"""The generated headline (chapter 9, the introduction and the README) says what the findings say: the
step that decides a contradiction is named only when it alone decides it, a sink claim holds only when its
registered controls hold, and the committed pages carry the text the committed findings generate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import cwbook as book
from cwcore import stats as cstats
from cwbook import findings, headline, registration, table1
from cwbook import ladder as evidence

REPO = Path(__file__).resolve().parents[1]
STEP_OF = {"step 1->2": "default", "step 2->3": "per-head", "step 3->4": "default", "contribution beats random": "default"}


def _primary(verdicts: dict, sample: str = "exploratory") -> pd.DataFrame:
    """Primary rows of every model, data set and mode; ``verdicts[(model, claim)]`` overrides "holds"."""
    rows = []
    for model in evidence.PRIMARY["models"]:
        for data in evidence.PRIMARY["data"]:
            for mode in evidence.PRIMARY["modes"]:
                for claim, protocol in STEP_OF.items():
                    v = verdicts.get((model, data, mode, claim), verdicts.get((model, claim), "holds"))
                    rows.append({"claim": claim, "model": model, "data": data, "mode": mode, "protocol": protocol,
                                 "importance": "absolute", "range": "full", "variant": "main", "verdict": v,
                                 "estimate": 0.1 if v == "holds" else -0.1, "ci_low": 0.0, "ci_high": 0.2,
                                 "primary": True, "sample": sample})
    return pd.DataFrame(rows)


def test_a_contradiction_is_pinned_on_one_step_only_when_that_step_alone_decides_it():
    table = _primary({("smollm2-135m", "step 2->3"): "contradicted"})
    text = " ".join(headline.ladder_sentences(table, "exploratory"))
    assert "ordering 1 < 2 < 3 < 4 over its 8 cells (model x data set x mode): holds in 4 and contradicted in 4" in text
    assert "**smollm2-135m**, the ordering over its 4 cells (data set x mode): contradicted in 4 of 4" in text
    assert "rests on step 2 → 3 (value-weighted → output-normalised) alone, every other step holds" in text
    assert "**gemma3-270m**, the ordering over its 4 cells (data set x mode): holds in 4 of 4" in text and "no step contradicts it" in text
    # the control: one more contradicted step in one cell and the sentence names both, never "alone"
    table = _primary({("smollm2-135m", "step 2->3"): "contradicted",
                      ("smollm2-135m", "gsm8k", "sufficiency", "step 1->2"): "contradicted"})
    text = " ".join(headline.ladder_sentences(table, "exploratory"))
    assert "alone" not in text.split("**gemma3-270m**")[0]
    assert "contradicted by step 1 → 2 (attention → value-weighted), step 2 → 3" in text


def test_a_sample_without_rows_says_it_is_not_computed():
    table = _primary({})
    assert headline.ladder_sentences(table, "confirmatory") == [
        "None of the 32 registered tests is judged on this sample yet."]
    cells = [{"model": m, "data": d, "protocol": p, "documents": n}
             for m, d, p, n in [("a", "x", "default", 64), ("a", "x", "per-head", 64), ("a", "y", "default", 17),
                                ("a", "y", "per-head", 0)]]
    assert headline.ladder_sentences(table, "confirmatory", cells) == [
        "None of the 32 registered tests is judged on this sample yet: 2 of its 4 ladder cells (model x data set x "
        "mode) hold all 64 documents and 1 more is partly computed; the tests are judged once every cell is in."]
    assert "are partly computed" in headline.progress_clause(cells[:2] + [dict(cells[2], documents=5)] * 2)
    assert headline.progress_clause(cells[:2]).startswith("all 2 of its ladder cells") and "tables step" in \
        headline.progress_clause(cells[:2])
    assert "partly" not in headline.progress_clause(cells[:2] + [dict(cells[3])])
    assert set(table1.side_by_side(table)["comp. confirmatory"].str.strip()) <= {"—", ""}


def _claims(tmp_path, model: str, values: dict) -> None:
    """Sink chapters' claims tables holding the registered parts of every claim, each with interval
    ``values.get(key, (0.6, 0.7))`` (above every "above" threshold, below every "below" one when negated)."""
    rows = {chapter: [] for chapter in ("05_sink_decomposition", "06_sinks_as_suppressors", "07_semantic_cone")}
    for data in registration.CONFIRMATORY_DATA:
        for claim in registration.SINK_CLAIMS:
            for key, threshold, side, _ in claim["parts"]:
                low, high = values.get(key, (threshold + 0.1, threshold + 0.2) if side == "above"
                                       else (threshold - 0.2, threshold - 0.1))
                rows["06_sinks_as_suppressors"].append(
                    {"chapter": "06", "claim": claim["claim"], "part": key, "statistic": "x", "key": f"{data}/{key}",
                     "estimate": (low + high) / 2, "low": low, "high": high, "threshold": threshold, "side": side,
                     "n": 10, "verdict": "", "why": "", "unit": "head", "n_units": 10, "source": "paper"})
    for chapter, part in rows.items():
        findings.save_results(book.results_path(tmp_path, chapter, model), pd.DataFrame(part) if part else
                              pd.DataFrame(columns=["key"]), chapter=chapter, model=model, profile="evidence")


def test_a_sink_claim_holds_only_when_its_registered_controls_hold(tmp_path):
    _claims(tmp_path, "m", {})
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"]).set_index(["data", "claim"])["verdict"]
    assert (verdicts == "holds").all() and len(verdicts) == 2 * len(registration.SINK_CLAIMS)
    # the centred-values control reverses the sign: anti-alignment is contradicted although its main part holds
    _claims(tmp_path, "m", {"cos_semantic_centred": (0.01, 0.05)})
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"])
    anti = verdicts[verdicts["claim"] == "anti-alignment"]
    assert (anti["verdict"] == "contradicted").all()
    assert "the centred-values control is contradicted" in " ".join(headline.sink_sentences(verdicts))
    assert "main cos_semantic: -0.15 [-0.2, -0.1] holds" in anti["parts"].iloc[0]


def test_a_claim_is_explained_by_the_data_set_that_decides_it(tmp_path):
    # contradicted on one data set, inconclusive on the other: the sentence gives the contradiction and where
    _claims(tmp_path, "m", {})
    table = book.results_path(tmp_path, "06_sinks_as_suppressors", "m")
    frame = pd.read_csv(table)
    first, second = registration.CONFIRMATORY_DATA
    control = "share_interior_minus_random_direction"
    frame.loc[frame["key"] == f"{first}/{control}", ["low", "high"]] = (-0.1, 0.3)
    frame.loc[frame["key"] == f"{second}/{control}", ["low", "high"]] = (-0.3, -0.2)
    findings.save_results(table, frame, chapter="06_sinks_as_suppressors", model="m", profile="evidence")
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"])
    convexity = verdicts[verdicts["claim"] == "convexity"].set_index("data")["verdict"]
    assert (convexity[first], convexity[second]) == ("inconclusive", "contradicted")
    sentence = next(line for line in headline.sink_sentences(verdicts) if line.startswith("*convexity*"))
    assert sentence == f"*convexity*: m contradicted (the random-direction control is contradicted on {headline.DATA_NAMES[second]})."
    # both data sets agree: no data set named
    assert headline.stopping_part(verdicts[verdicts["claim"] == "anti-alignment"], "holds") == ""


def test_a_missing_registered_control_leaves_the_claim_not_measured(tmp_path):
    _claims(tmp_path, "m", {})
    table = book.results_path(tmp_path, "06_sinks_as_suppressors", "m")
    frame = pd.read_csv(table)
    findings.save_results(table, frame[~frame["key"].str.endswith("/share_interior_minus_random_direction")],
                          chapter="06_sinks_as_suppressors", model="m", profile="evidence")
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"])
    assert (verdicts.loc[verdicts["claim"] == "convexity", "verdict"] == "not measured").all()
    assert (verdicts.loc[verdicts["claim"] != "convexity", "verdict"] == "holds").all()


def test_the_confirmatory_sample_is_told_beside_the_exploratory_one():
    exploratory = _primary({("smollm2-135m", "step 2->3"): "contradicted"})
    # nothing decided on the confirmatory sample yet: nothing to compare
    assert headline.ladder_agreement(pd.concat([exploratory, _primary({}, "confirmatory").assign(
        verdict="not measured")])) == ""
    same = pd.concat([exploratory, _primary({("smollm2-135m", "step 2->3"): "contradicted"}, "confirmatory")])
    assert headline.ladder_agreement(same) == "Beside the exploratory sample: the same verdict in 32 of the 32 tests judged on both."
    # the control: one test moves, one is not decided on the new sample; the moved one is named, the other not counted
    moved = _primary({("smollm2-135m", "step 2->3"): "contradicted",
                      ("gemma3-270m", "web-text", "sufficiency", "step 3->4"): "inconclusive",
                      ("gemma3-270m", "gsm8k", "comprehensiveness", "step 1->2"): "not measured"}, "confirmatory")
    assert headline.ladder_agreement(pd.concat([exploratory, moved])) == (
        "Beside the exploratory sample: the same verdict in 30 of the 31 tests judged on both; different in 1: "
        "gemma3-270m, web text, sufficiency, step 3 → 4 (output-normalised → contribution weights): holds there, "
        "inconclusive here.")


def test_the_exploratory_title_counts_what_the_findings_hold():
    table = _primary({}).assign(unit="document", n_units=64, prospective=True)
    table.loc[:21, "prospective"] = False
    assert headline.exploratory_title(table) == (
        "**Exploratory sample** (64 documents per data set; 22 of its 32 tests were computed before their "
        "registration, so these verdicts generate hypotheses rather than confirm them)")
    # the control: other sizes and every test computed after its registration
    assert headline.exploratory_title(table.assign(n_units=16, prospective=True)) == \
        "**Exploratory sample** (16 documents per data set)"


def test_the_sink_claims_are_told_beside_the_exploratory_sample(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    _claims(here, "m", {"cos_semantic_centred": (0.01, 0.05)})  # anti-alignment contradicted here ...
    _claims(there, "m", {})  # ... holds there
    table = book.results_path(there, "06_sinks_as_suppressors", "m")
    frame = pd.read_csv(table)  # and convexity's registered control was never computed there
    findings.save_results(table, frame[~frame["key"].str.endswith("/share_interior_minus_random_direction")],
                          chapter="06_sinks_as_suppressors", model="m", profile="evidence")
    a, b = headline.registered_sink_verdicts(here, ["m"]), headline.registered_sink_verdicts(there, ["m"])
    n = len(registration.SINK_CLAIMS)
    assert headline.sink_agreement(a, b) == (
        f"Beside the exploratory sample, the sink claims: the same verdict for {n - 2} of the {n - 1} (claim, model) "
        "pairs judged on both; different for 1: *anti-alignment*, m: holds there, contradicted here; 1 more is "
        "judged here only, the exploratory tables lacking a registered control: *convexity*, m: holds.")
    assert headline.sink_agreement(b.assign(verdict="not measured"), b) == ""


def test_the_committed_pages_carry_the_generated_headline():
    assert headline.HEADLINE_PAGES == {REPO / "book" / "intro.md": False, REPO / "README.md": True}
    for page, compact in headline.HEADLINE_PAGES.items():
        text = headline.headline_markdown(compact=compact)
        body = page.read_text()
        block = body[body.index(headline.START) + len(headline.START):body.index(headline.END)]
        assert block.strip() == text.strip(), f"{page.name} is stale: run python -m cwbook.headline --write"


def test_the_readmes_compact_headline_keeps_the_confirmatory_sample_whole_and_counts_the_exploratory_one():
    full, compact = headline.headline_markdown(), headline.headline_markdown(compact=True)
    confirmatory = full.split("**Exploratory sample**")[0]
    assert compact.startswith(confirmatory)  # the confirmatory sample's sentences, every one
    exploratory = compact.split("**Exploratory sample**")[1]
    first = full.split("**Exploratory sample**")[1].split("\n- ")[1].split("\n")[0]
    assert f"- {first}" in exploratory and "(claim, model) pairs" in exploratory
    verdicts = headline.registered_sink_verdicts(findings.EVIDENCE_DIR, list(evidence.PRIMARY["models"]))
    pairs = verdicts.groupby(["claim", "model"])["verdict"].agg(cstats.combine_all)
    assert f"of {len(pairs)} (claim, model) pairs" in exploratory and len(pairs) == 18
    assert f"{int((pairs == cstats.CONTRADICTED).sum())} contradicted" in exploratory
    assert len(compact) < len(full)


def test_the_chapter_answers_name_the_deciding_part_and_what_is_not_computed(tmp_path):
    table = _primary({("smollm2-135m", "step 2->3"): "contradicted"})
    answer = headline.chapter4_answer(table, "smollm2-135m", confirmatory_dir=tmp_path / "none")
    assert "*Confirmatory sample (registered before it was computed)*: not judged yet (0 of its 4 ladder cells " \
           "(model x data set x mode) hold all 64 documents; the tests are judged once every cell is in)." in answer
    assert "rests on step 2 → 3 (value-weighted → output-normalised) alone" in answer
    assert "no step contradicts it" in headline.chapter4_answer(table, "gemma3-270m")
    _claims(tmp_path / "exploratory", "m", {"cos_semantic_centred": (0.01, 0.05)})
    answer = headline.sink_chapter_answer("06_sinks_as_suppressors", "m", exploratory_dir=tmp_path / "exploratory",
                                          confirmatory_dir=tmp_path / "confirmatory")
    assert "- *anti-alignment*: confirmatory: not computed yet; exploratory: **contradicted** (the centred-values " \
           "control is contradicted)." in answer
    assert "- *convexity*: confirmatory: not computed yet; exploratory: **holds**." in answer
    assert "cone" not in answer  # chapter 7's claims are chapter 7's


@pytest.mark.slow
def test_the_confirmatory_tables_step_decides_the_whole_family_once_every_cell_is_in(tmp_path):
    """The last step of the confirmatory build, run on a complete copy of the committed confirmatory folder
    whose missing gemma3-270m cells are stood in by smollm2-135m's rows (renamed, hashes recorded): 32
    confirmatory primary rows, Holm over those 32 (so p_holm is Holm's step-down of their p), the combined
    findings written to the sibling exploratory folder of the copy, never to this checkout's, and a headline
    that reports the confirmatory sample. The control: before the step, the headline says it is not computed."""
    import gzip
    import hashlib
    import json
    import shutil

    from cwbook import confirmatory

    exploratory, trial = tmp_path / "evidence", tmp_path / "confirmatory"
    shutil.copytree(findings.EVIDENCE_DIR, exploratory, ignore=shutil.ignore_patterns("0*"))
    trial.mkdir()
    for data in registration.CONFIRMATORY_DATA:
        for model in registration.CONFIRMATORY_MODELS:
            source = findings.CONFIRMATORY_DIR / f"per_document_smollm2-135m_{data}"
            if not source.with_suffix(".json").is_file() or \
                    json.loads(source.with_suffix(".json").read_text())["documents"] != registration.CONFIRMATORY_DOCUMENTS:
                pytest.skip("smollm2-135m's confirmatory cells are not all committed")
            table = gzip.decompress(source.with_suffix(".csv.gz").read_bytes()).decode()
            data_bytes = gzip.compress(table.replace(",smollm2-135m,", f",{model},").encode(), mtime=0)
            meta = json.loads(source.with_suffix(".json").read_text())
            meta.update(model=model, csv_sha256=hashlib.sha256(data_bytes).hexdigest())
            (trial / f"per_document_{model}_{data}.csv.gz").write_bytes(data_bytes)
            (trial / f"per_document_{model}_{data}.json").write_text(json.dumps(meta, indent=1))
    before = (findings.EVIDENCE_DIR / "findings.csv").read_bytes()
    committed = headline.committed_findings(exploratory)  # the findings before this trial's tables step:
    committed = committed[committed["sample"] == registration.EXPLORATORY]  # the exploratory sample's rows
    assert "None of the 32 registered tests is judged on this sample yet: all 8 of its ladder cells (model x " \
           "data set x mode) hold all 64 documents; the tables step" in headline.headline_markdown(
               committed, exploratory_dir=exploratory, confirmatory_dir=trial).split("**Exploratory sample**")[0]
    confirmatory.tables(trial)
    assert (findings.EVIDENCE_DIR / "findings.csv").read_bytes() == before
    both = pd.read_csv(exploratory / "findings.csv")
    primary = both[(both["sample"] == registration.CONFIRMATORY) & both["primary"]]
    assert len(primary) == 32 and primary["p_holm"].notna().all()
    p = primary["p"].to_numpy()
    order = p.argsort()
    holm = (p[order] * (len(p) - np.arange(len(p)))).clip(max=1)
    holm = pd.Series(holm).cummax().to_numpy()
    assert abs(primary["p_holm"].to_numpy()[order] - holm).max() < 1e-12
    opening = headline.headline_markdown(both, exploratory_dir=exploratory, confirmatory_dir=trial)
    assert "32 of the 32 registered tests are judged" in opening.split("**Exploratory sample**")[0]


def test_the_findings_table_and_the_headline_judge_the_sink_claims_alike():
    # chapter 9's Table 2 once judged the sink claims by the chapters' own parts (no registered controls) and
    # disagreed with the headline above it on five (claim, model) pairs of the exploratory sample (one of them
    # holds against contradicted: anti-alignment on smollm2-135m, whose registered centred-values control fails)
    from cwbook.chapters.ch09_findings import registered_sink_findings

    models = list(evidence.PRIMARY["models"])
    said = headline.claim_model_verdicts(headline.registered_sink_verdicts(findings.EVIDENCE_DIR, models))
    for model in models:
        found, _ = findings.model_findings(findings.EVIDENCE_DIR, model)
        table = findings.findings_table({model: registered_sink_findings(found, findings.EVIDENCE_DIR, model)})
        board = table.set_index("key")["verdict"]
        for claim in registration.SINK_CLAIMS:
            assert board[claim["claim"]] == said[(claim["claim"], model)], (model, claim["claim"])
        assert "sink_position" in board.index  # the book's own check, not registered, stays


def test_a_sink_chapter_draws_the_verdicts_of_its_answer(tmp_path):
    # Figure 0 of a sink chapter: one cell per (claim, data set) of the chapter, coloured by the answer's verdict
    import matplotlib

    matplotlib.use("Agg")
    _claims(tmp_path, "m", {"cos_semantic_centred": (0.01, 0.05)})  # anti-alignment contradicted by its control
    figure = headline.sink_chapter_figure("06_sinks_as_suppressors", "m", exploratory_dir=tmp_path,
                                          confirmatory_dir=tmp_path / "none")
    explored = figure.axes[0]
    claims = [t.get_text() for t in explored.get_yticklabels()]
    assert claims == [c for c, where in headline.SINK_CLAIM_CHAPTER.items() if where == "06_sinks_as_suppressors"]
    codes = explored.images[0].get_array()
    row = claims.index("anti-alignment")
    assert (codes[row] == 3).all() and (codes[[i for i in range(len(claims)) if i != row]] == 0).all()
    assert headline.sink_chapter_figure("06_sinks_as_suppressors", "other", exploratory_dir=tmp_path,
                                        confirmatory_dir=tmp_path / "none") is None


def test_each_part_is_judged_against_its_own_registered_threshold(tmp_path):
    # "many heads are sink heads" needs its share above 0.5 and the tail shares above 0.1: intervals above 0
    # but below those thresholds contradict the claims (a rule reading 0 for every part would call them holds)
    _claims(tmp_path, "m", {"sink_eps_by_layer": (0.3, 0.45), "tail_alpha_share": (0.02, 0.08)})
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"]).set_index(["data", "claim"])["verdict"]
    for data in registration.CONFIRMATORY_DATA:
        assert verdicts[(data, "many heads are sink heads")] == "contradicted"
        assert verdicts[(data, "sink driven by value geometry, tail by attention and alignment")] == "contradicted"
        assert verdicts[(data, "anti-alignment")] == "holds"  # the control: the other claims are untouched


def test_a_sink_claim_not_computed_on_one_data_set_is_not_measured_for_its_model(tmp_path):
    # the registered rule combines a model's data sets by combine_all: a claim that holds on GSM8K but whose
    # control is missing on web text is not decided for the model (never "holds")
    _claims(tmp_path, "m", {})
    table = book.results_path(tmp_path, "06_sinks_as_suppressors", "m")
    frame = pd.read_csv(table)
    first, second = registration.CONFIRMATORY_DATA
    findings.save_results(table, frame[frame["key"] != f"{second}/share_interior_minus_random_direction"],
                          chapter="06_sinks_as_suppressors", model="m", profile="evidence")
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"])
    convexity = verdicts[verdicts["claim"] == "convexity"].set_index("data")["verdict"]
    assert (convexity[first], convexity[second]) == ("holds", "not measured")
    assert headline.claim_model_verdicts(verdicts)[("convexity", "m")] == "not measured"
    sentence = next(line for line in headline.sink_sentences(verdicts) if line.startswith("*convexity*"))
    assert sentence == (f"*convexity*: m not measured (the random-direction control was not computed on "
                        f"{headline.DATA_NAMES[second]}).")
    n = len(registration.SINK_CLAIMS)
    assert headline.sink_tally(verdicts).endswith(f"{n - 1} holds, 1 not measured of {n} (claim, model) pairs.")


def test_an_ordering_with_a_step_missing_is_not_measured_and_the_judged_tests_are_counted():
    # a primary step without a row (its cell not computed) is not measured, and so is the ordering of that cell:
    # never "holds" because the other steps hold
    table = _primary({})
    missing = (table["model"] == "smollm2-135m") & (table["data"] == "gsm8k") & \
              (table["mode"] == "comprehensiveness") & (table["claim"] == "step 2->3")
    summary = headline.ordering_summary(table[~missing]).set_index(["model", "data", "mode"])
    cell = summary.loc[("smollm2-135m", "gsm8k", "comprehensiveness")]
    assert cell["step 2->3"] == "not measured" and cell["ordering"] == "not measured"
    assert (summary.drop(index=("smollm2-135m", "gsm8k", "comprehensiveness"))["ordering"] == "holds").all()
    # two tests not measured: 30 of the 32 are judged, and the not measured ones are not among the counted
    gone = table.assign(verdict=np.where(missing | ((table["model"] == "gemma3-270m") & (table["claim"] == "step 1->2")
                                                    & (table["data"] == "web-text") & (table["mode"] == "sufficiency")),
                                         "not measured", table["verdict"]))
    first = headline.ladder_sentences(gone, "exploratory")[0]
    assert first.startswith("30 of the 32 registered tests are judged (30 holds; Holm-adjusted")
    assert "over its 8 cells (model x data set x mode): holds in 6 and not measured in 2." in first
    # secondary rows (not primary: other signs, ranges, variants) are never counted among the 32
    secondary = gone.assign(primary=False, verdict="contradicted", importance="signed")
    assert headline.ladder_sentences(pd.concat([gone, secondary]), "exploratory")[0] == first


def test_the_agreement_counts_only_tests_judged_on_both_samples():
    # a test not measured on the exploratory sample is not "the same" nor "different": it is left out
    exploratory = _primary({("gemma3-270m", "web-text", "sufficiency", "step 3->4"): "not measured"})
    confirmatory = _primary({}, "confirmatory")
    assert headline.ladder_agreement(pd.concat([exploratory, confirmatory])) == (
        "Beside the exploratory sample: the same verdict in 31 of the 31 tests judged on both.")


def test_a_cell_one_document_short_is_partly_computed_not_complete():
    cells = [{"model": "a", "data": "x", "protocol": p, "documents": n}
             for p, n in (("default", registration.CONFIRMATORY_DOCUMENTS),
                          ("per-head", registration.CONFIRMATORY_DOCUMENTS - 1))]
    assert headline.progress_clause(cells) == (
        "1 of its 2 ladder cells (model x data set x mode) hold all 64 documents and 1 more is partly computed; "
        "the tests are judged once every cell is in")


def test_a_claim_is_explained_by_its_contradicted_part_before_an_inconclusive_one(tmp_path):
    # anti-alignment's main part is inconclusive and its centred-values control contradicted: the claim is
    # contradicted, and its sentence names the contradiction, not the part merely left open
    _claims(tmp_path, "m", {"cos_semantic": (-0.1, 0.1), "cos_semantic_centred": (0.01, 0.05)})
    verdicts = headline.registered_sink_verdicts(tmp_path, ["m"])
    sentence = next(line for line in headline.sink_sentences(verdicts) if line.startswith("*anti-alignment*"))
    assert sentence == "*anti-alignment*: m contradicted (the centred-values control is contradicted)."
    anti = verdicts[verdicts["claim"] == "anti-alignment"]
    assert (anti["failing"] == "the centred-values control is contradicted; the sink's cosine with the semantic "
                               "component is inconclusive").all()
