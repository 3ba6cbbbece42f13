"""The book's chapter modules (cwbook.chapters) on a user's own small model: the parameters a rerun passes are
honoured or refused in one line, never wrapped or ignored."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import cwcore
from cwbook.chapters import ch03_contribution_maps as ch03
from cwcore.cli import UsageError

sys.path.insert(0, str(Path(__file__).resolve().parent / "faithfulness"))
from faith_helpers import peaked_llama, word_tokenizer  # noqa: E402

TEXT = "the cat sat on the mat and the dog ran away"


def test_a_layer_or_head_out_of_range_is_refused_not_wrapped():
    """layer=5 of a 2-layer model showed layer 1 and head=9 of 4 heads showed head 1 (taken modulo the count),
    while the prose said "the head set by the `head` parameter"."""
    model, tokenizer = peaked_llama(), word_tokenizer()
    layers = len(cwcore.decompose(model, **tokenizer(TEXT, return_tensors="pt")).layers)
    for layer, head in ((layers, None), (-layers - 1, None), (0, 4), (0, -5)):
        with pytest.raises(UsageError, match="layer=|head="):
            ch03.sentence_maps(model, tokenizer, TEXT, layer, head, 5, "tiny")
    maps = ch03.sentence_maps(model, tokenizer, TEXT, -1, -1, 5, "tiny")  # from the end, as Python counts
    assert (maps.layer_shown, maps.head_shown) == (layers - 1, 3)


def test_the_bench_names_its_reference_and_quotes_every_data_set(tmp_path):
    """Chapter 4b's prose said "over contribution" for any `reference` (with reference="alti" the numbers were
    alti's), and quoted `rank_comp_0` and `_1` by number: one data set left two names unglued (the book build
    fails), a third data set was computed and never shown. Every name the notebook quotes is glued here."""
    import json
    import re

    import numpy as np
    from cwbook.chapters import ch04b_attribution_bench as ch04b

    rng = np.random.default_rng(0)
    words = "the a cat dog sat on mat and ran away is was one two three it far so".split()
    data = tmp_path / "docs.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(words, 14)) for _ in range(3)) + "\n")
    bench = ch04b.run(peaked_llama(), word_tokenizer(), model="tiny", datasets=[str(data)],
                      metrics=["attention", "contribution", "alti", "random"], reference="alti", n_sequences=3,
                      seq_len=10, batch_size=2, low_ratios=[0.1], ratios=[0.5], n_bootstrap=20, seed=0, cache=False,
                      profile="tiny", dtype="float32")
    source = Path(__file__).resolve().parents[1] / "notebooks" / "04b_attribution_bench.ipynb"
    notebook = json.loads(source.read_text())
    prose = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    quoted = set(re.findall(r"\{glue:(?:md|text)\}`([a-z0-9_]+)", prose))
    code = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    glued_by_the_notebook = set(re.findall(r"note(?:_md)?\(\"([a-z0-9_]+)\"", code))  # its own cells' notes
    assert quoted - set(bench.quoted_md) - set(bench.quoted) - glued_by_the_notebook == set()
    assert bench.quoted_md["reference_name"] == ch04b.LABELS["alti"]
    assert "over contribution" not in bench.quoted_md["ladder_contradicted"]
    assert bench.quoted_md["rank_comp"].startswith(f"`{data}`: ")


def test_the_findings_page_sets_this_builds_rows_beside_the_evidence_only_where_both_have_them():
    """A rerun of one model: the note said "1368 of them have a row here too" where 110 had (an outer merge
    filtered on one side), the compared table carried every other committed model, answered "no" where the steps
    table said "too few to tell", and Table 1 said "too few to tell" for models this build never ran."""
    from cwbook import findings
    from cwbook.chapters import ch09_findings as ch09
    from cwbook.chapters.common import TOO_SMALL
    from cwbook.table1 import primary_table

    committed_dir = findings.EVIDENCE_DIR
    committed = findings.findings_csv(committed_dir, findings.held_variants(committed_dir, ["smollm2-135m"]),
                                      "evidence")
    assert set(committed["model"]) <= {"smollm2-135m", "smollm2-135m-requantized"}
    measured = committed[~committed["verdict"].astype(str).str.startswith("not measured")]
    live = measured[(measured["claim"] == "step 3->4") & (measured["variant"] == "main")].copy()
    live["verdict"] = "inconclusive"  # a small rerun whose intervals decide nothing
    r = ch09.Findings(models=["smollm2-135m"], profile="audit", committed_dir=committed_dir, use_committed=True,
                      faith_findings=live, committed_findings=committed)
    ch09._compared(r)
    note = r.phrases["committed_note"]
    assert f"hold {len(measured)} measured findings rows of this build's models (smollm2-135m" in note
    assert f"; {len(live)} of them have a row here too, and on 0 of those" in note
    answers = r.compared.loc[r.compared["claim"] == "step 3->4", "rerun agrees with the evidence?"]
    assert (answers == TOO_SMALL).sum() > 0 and set(answers) <= {TOO_SMALL, "not in this build"}
    shown = r.compared[r.compared["claim"] == "step 3->4"]
    assert shown["part"].str.contains("comprehensiveness|sufficiency").all()  # the mode tells rows apart
    table = primary_table(measured, live)  # gemma3-270m is in Table 1 but not in this build
    gemma = table[table["model"] == "gemma3-270m"]
    assert len(gemma) and set(gemma["rerun agrees? (|c| / signed, comprehensiveness; sufficiency)"]) == \
        {"not in this build"}


@pytest.mark.parametrize("plain, renormalised, reading", [
    (-0.0005, 0.0004, "does not raise the perplexity"),  # removing the sink lowers it: no cost to split
    (0.0, 0.0, "does not raise the perplexity"),  # nothing changes (it divided by zero)
    (0.2, 0.05, "That is 25% of the plain removal's change. In this rerun check (its point estimates), most of"),
    (0.2, 0.15, "That is 75% of the plain removal's change. In this rerun check (its point estimates), the cost"),
])
def test_chapter_7_splits_a_cost_only_where_removing_the_sink_has_one(monkeypatch, plain, renormalised, reading):
    """Where removing the sink lowered perplexity, chapter 7 still printed "-87% of the plain removal's -0.00 ...
    most of the plain removal's cost comes with the shrinking of the outputs"; a zero change raised
    ZeroDivisionError."""
    import math
    from types import SimpleNamespace

    from cwbook import sink_claims
    from cwbook.chapters import ch07_semantic_cone as ch07

    changes = {c: (0.0, 0.0, 0.0) for c in ("clean", *ch07.CONDITIONS)}
    changes.update(sink=(plain, plain, plain), sink_renorm=(renormalised, renormalised, renormalised))
    monkeypatch.setattr(sink_claims, "perplexity_changes", lambda *a, **k: (changes, changes, changes, 0, 0))
    r = SimpleNamespace(raw={"sequences": None}, boot={}, intervals={}, numbers={}, phrases={})
    ch07._perplexity(r)
    assert reading in r.phrases["renorm_reading"]
    assert math.isnan(r.numbers["renorm_share"]) == (plain <= 0)


@pytest.mark.parametrize("importances, protocols", [(["absolute"], ["default"]), (["signed"], ["per-head"])])
def test_chapter_4_refuses_a_ladder_without_what_its_page_quotes(importances, protocols):
    """importances=["absolute"] failed deep in pandas ("No objects to concatenate"); protocols=["per-head"] quoted
    NaN for every "default protocol, signed" area. Refused in one line before any sweep."""
    from cwbook.chapters import ch04_faithfulness as ch04

    with pytest.raises(UsageError, match="keep 'signed' among the importances|keep 'default' among the protocols"):
        ch04.ladder(None, None, model="tiny", datasets=["gsm8k"], n_sequences=2, seq_len=8, low_ratios=[0.1],
                    ratios=[0.5], protocols=protocols, importances=importances, metrics=["contribution", "random"],
                    random_seeds=1, variants=[], variant_models=None, n_bootstrap=10, seed=0, batch_size=2,
                    cache=False, profile="tiny", dtype="float32")


def test_chapter_4s_anatomy_refuses_ratios_off_the_ladders_grid():
    """anatomy_ratios [0.01, 0.05] on a ladder at [0.05, 0.5]: Table 4 kept 0.05 alone while Figure 2 showed 0.01."""
    from types import SimpleNamespace

    from cwbook.chapters import ch04_faithfulness as ch04

    ladder = SimpleNamespace(blocks={}, per_seq=None, grid=[0.05, 0.5])
    with pytest.raises(UsageError, match=r"anatomy_ratios \[0.01\] are not on the ladder's grid \[0.05, 0.5\]"):
        ch04.anatomy(None, ladder, first="gsm8k", metrics=["contribution"], anatomy_sequences=2,
                     anatomy_ratios=[0.01, 0.05], batch_size=2, n_bootstrap=10, seed=0)


def test_a_sink_chapter_sets_no_evidence_of_another_threshold_beside_its_rerun():
    """A rerun at eps=0.9 was compared with the evidence at eps=0.3: "holds ... in the evidence; the rerun check
    differs", with no word that the thresholds differ."""
    from cwbook.chapters.sinks_common import committed_evidence, no_evidence_label
    from cwcore.sinks.engine import EPS

    chapter, model = "05_sink_decomposition", "smollm2-135m"
    assert committed_evidence(chapter, model, eps=EPS.default) is not None  # the control: the committed threshold
    assert committed_evidence(chapter, model, eps=0.9) is None
    assert no_evidence_label(chapter, model, 0.9) == (f"committed evidence at eps={EPS.default:g}, not compared with "
                                                     "this rerun at eps=0.9")
    assert no_evidence_label(chapter, "no-such-model", 0.9) == "no committed evidence for this model"


def test_chapter_7_refuses_a_pass_that_intervened_on_no_head(tmp_path):
    """A model without sink heads run with sink_options heads="sink" stopped on "cannot convert float NaN to
    integer" (the first layer of an empty table). One line, naming the options."""
    import torch
    import transformers as tf

    from cwbook.chapters import ch07_semantic_cone as ch07
    from cwcore.models import packaged_model_path

    tokenizer = tf.AutoTokenizer.from_pretrained(packaged_model_path("smollm2-135m"))
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    run = dict(datasets=["gsm8k"], n_sequences=2, seq_len=16, batch_size=2, cache=False, sink_options={"heads": "sink"})
    refusal = r"no head output was intervened on in `gsm8k` \(sink_options \{'heads': 'sink'\}"
    with pytest.raises(UsageError, match=refusal):
        ch07.run(str(tmp_path / "tiny"), run, n_bootstrap=20, profile="tiny")
