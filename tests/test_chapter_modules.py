"""The book's chapter modules (cwbook.chapters) on a user's own small model: the parameters a rerun passes are
honoured or refused in one line, never wrapped or ignored."""

from __future__ import annotations

import math
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


def _roberta_style():
    """A tiny RoBERTa-style encoder (random weights, eager attention) and its word-level tokenizer, whose
    classifier and separator tokens are spelled ``<s>`` and ``</s>``."""
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = "the a cat dog sat on mat and ran away trophy did not fit in suitcase because it was too big . ,".split()
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + words)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                              special_tokens=[("<s>", 1), ("</s>", 2)])
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="<s>", eos_token="</s>",
                                           cls_token="<s>", sep_token="</s>", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    config = tf.RobertaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
                              attn_implementation="eager")
    return tf.RobertaModel(config, add_pooling_layer=False).eval(), tokenizer


def test_chapter_8_finds_the_special_tokens_by_their_ids_whatever_their_spelling():
    """Chapter 8 matched the strings "[CLS]" and "[SEP]": on a RoBERTa-style encoder (``<s>`` ... ``</s>``) it quoted
    0.0 attention on them where the head shown gave them 0.125, and picked its head on a gap of 0 everywhere."""
    import torch

    from cwbook.chapters import ch08_encoders as ch08

    model, tokenizer = _roberta_style()
    text = "the trophy did not fit in the suitcase because it was too big ."
    maps = ch08.sentence_maps(model, tokenizer, text, None, None, 5, "tiny-roberta")
    assert maps.tokens[0] == "<s>" and maps.tokens[-1] == "</s>"
    with torch.no_grad():  # the model's own eager attention, [batch, head, query, key] per layer
        attentions = model(**tokenizer(text, return_tensors="pt"), output_attentions=True).attentions
    probs = attentions[maps.layer_shown][0].double()
    on_special = probs[..., [0, -1]].sum(-1).mean(-1)  # per head, over all queries
    assert abs(float(maps.quoted["alpha_special"]) - float(on_special[maps.head_shown])) < 1e-5
    assert float(on_special[maps.head_shown]) > 0.05  # the control: the old code quoted 0.0 here
    assert abs(float(maps.quoted["layer_alpha_special"]) - float(on_special.mean())) < 1e-5
    assert "`<s>` and `</s>`" in maps.quoted_md["head_reason"]


def test_chapters_3_and_8_refuse_the_other_kind_of_model_with_the_measured_reason():
    """Chapter 3 (causal decoders: grey cells above the diagonal, "query 0 sees only itself") ran on an encoder,
    and chapter 8 (encoders: "no cell is grey") on a decoder, quoting 0 attention on keys a query cannot see."""
    from cwbook.chapters import ch08_encoders as ch08

    encoder, encoder_tokenizer = _roberta_style()
    decoder, decoder_tokenizer = peaked_llama(), word_tokenizer()
    with pytest.raises(UsageError, match=r"chapter 3 is written for causal decoders: layer \d of this model attends "
                                         r"to later keys \(up to 0\.\d+"):
        ch03.sentence_maps(encoder, encoder_tokenizer, "the cat sat on the mat", None, None, 5, "tiny")
    with pytest.raises(UsageError, match="chapter 8 is written for encoders: no query of this model attends"):
        ch08.sentence_maps(decoder, decoder_tokenizer, TEXT, None, None, 5, "tiny")
    # the controls: each chapter's own kind passes
    assert ch03.sentence_maps(decoder, decoder_tokenizer, TEXT, None, None, 5, "tiny").n_heads == 4
    assert ch08.sentence_maps(encoder, encoder_tokenizer, "the cat sat on the mat", None, None, 5, "tiny").n_heads == 4


@pytest.mark.parametrize("change, refusal", [
    ({"n_sequences": 1}, r"1 sequence\(s\): the per-layer intervals are bootstraps over sequences and need at least 2"),
    ({"factor_samples": 0}, "factor_samples must be at least 1, got 0"),
    ({"n_bootstrap": 0}, "n_bootstrap must be at least 1, got 0"),
    ({"min_keys": 17}, r"min_keys=17: no query of a 16-token sequence sees that many keys"),
    ({"rank_min_keys": 17}, r"rank_min_keys=17: no query of a 16-token sequence sees that many keys"),
])
def test_chapter_3s_statistics_refuse_sizes_that_leave_a_quoted_number_without_data(change, refusal):
    """These sizes stopped deep in pandas or scipy ("KeyError 'first'", "Encountered all NA values"), or, with one
    sequence, quoted every interval as "nan to nan"."""
    parameters = dict(model_name="tiny", data="gsm8k", n_sequences=2, seq_len=16, batch_size=2, kind="intra",
                      min_keys=2, rank_min_keys=5, factor_samples=8, n_bootstrap=20, seed=0, cache=False)
    model, tokenizer = peaked_llama(), word_tokenizer()
    with pytest.raises(Exception, match=refusal):
        ch03.statistics(model, tokenizer, **{**parameters, **change})
    with pytest.raises(UsageError, match="is 1 token"):
        ch03.sentence_maps(model, tokenizer, "", None, None, 5, "tiny")  # only the tokenizer's <s>
    if change == {"n_sequences": 1}:  # the control: the smallest sizes allowed give finite intervals
        got = ch03.statistics(model, tokenizer, **parameters).quoted
        assert all(math.isfinite(got[name]) for name in ("peak_token_low", "peak_token_high"))


def test_the_statistics_decide_the_models_kind_on_a_few_real_tokens_of_the_first_sequence():
    """The kind check decomposed the whole first sequence in every layer, a forward more than the statistics need: now
    the first real tokens of it, unpadded (left or right padding), with every per-token input cut alike; and it still
    refuses the other kind of model in chapters 3 and 8."""
    import torch

    from cwbook.chapters import ch08_encoders as ch08
    from cwbook.chapters.common import KIND_PROBE_TOKENS, _kind_probe

    ids = torch.arange(1, 61).reshape(2, 30)
    left = torch.ones_like(ids)
    left[0, :6] = 0  # the first row is left-padded: its real tokens are ids 7..30
    probe = _kind_probe({"input_ids": ids, "attention_mask": left, "token_type_ids": ids % 2})
    assert probe["input_ids"].tolist() == [list(range(7, 7 + KIND_PROBE_TOKENS))]
    assert probe["attention_mask"].tolist() == [[1] * KIND_PROBE_TOKENS]
    assert probe["token_type_ids"].tolist() == [[i % 2 for i in range(7, 7 + KIND_PROBE_TOKENS)]]
    right = torch.ones_like(ids)
    right[0, 10:] = 0  # right padding: 10 real tokens, all of them
    assert _kind_probe({"input_ids": ids, "attention_mask": right})["input_ids"].tolist() == [list(range(1, 11))]
    assert _kind_probe({"input_ids": ids})["input_ids"].tolist() == [list(range(1, 1 + KIND_PROBE_TOKENS))]

    sizes = dict(model_name="tiny", data="gsm8k", n_sequences=2, seq_len=24, batch_size=2, kind="intra", min_keys=2,
                 rank_min_keys=5, factor_samples=8, n_bootstrap=20, seed=0, cache=False)
    encoder, encoder_tokenizer = _roberta_style()
    decoder, decoder_tokenizer = peaked_llama(), word_tokenizer()
    with pytest.raises(UsageError, match="chapter 3 is written for causal decoders"):
        ch03.statistics(encoder, encoder_tokenizer, **sizes)
    with pytest.raises(UsageError, match="chapter 8 is written for encoders"):
        ch08.statistics(decoder, decoder_tokenizer, **sizes)
    # the control: each chapter's own kind of model gets its statistics
    assert len(ch03.statistics(decoder, decoder_tokenizer, **sizes).summary)
    assert len(ch08.statistics(encoder, encoder_tokenizer, **sizes).summary)


def test_chapter_7_names_its_lowest_bin_and_compares_evidence_only_at_the_same_bins():
    """With quantiles=4 the numbers were the lowest quarter's while the page said "lowest-norm fifth" four times, and
    the rerun's lowest-bin claims were set beside the evidence's lowest fifth as if they were the same part."""
    import json

    from cwbook.chapters import ch07_semantic_cone as ch07
    from cwbook.chapters.sinks_common import committed_evidence, no_evidence_label
    from cwcore.sinks.engine import EPS

    assert [ch07.bin_name(q) for q in (4, 5, 10, 20)] == ["quarter", "fifth", "tenth", "1/20"]
    chapter, model = "07_semantic_cone", "smollm2-135m"
    assert committed_evidence(chapter, model, eps=EPS.default, quantiles=5) is not None  # the control: registered bins
    assert committed_evidence(chapter, model, eps=EPS.default, quantiles=10) is None
    assert no_evidence_label(chapter, model, EPS.default, 10) == ("committed evidence at quantiles=5, not compared "
                                                                  "with this rerun at quantiles=10")
    assert no_evidence_label(chapter, model, 0.9, 10) == (f"committed evidence at eps={EPS.default:g}, quantiles=5, "
                                                          "not compared with this rerun at eps=0.9, quantiles=10")
    notebook = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "07_semantic_cone.ipynb").read_text())
    prose = "".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    assert "fifth" not in prose and prose.count("{glue:md}`bin`") == 4


def test_sink_chapters_count_the_documents_they_ran_on_and_the_data_sets_they_have(monkeypatch):
    """A 2-document local file run with n_sequences=5 saved n_documents=5 for the findings page and captioned "5
    documents" beside a rerun label of 2; one data set read "the verdict is the same on both" and "holds on both data
    sets"."""
    from types import SimpleNamespace

    from cwbook.chapters import ch05_sink_decomposition as ch05, ch07_semantic_cone as ch07
    from cwbook.chapters.sinks_common import SinkPass, nothing_to_explain
    from cwbook.notebook import SinkRun

    run = SinkRun.of({"datasets": ["two-docs", "gsm8k"], "n_sequences": 5})
    shared = SinkPass("tiny", run, None, None, SimpleNamespace(eps=0.3), blocks={"two-docs": [0, 1], "gsm8k": [0] * 5})
    assert ch05.SinkDecomposition(sinks=shared, sample_size=8, n_bootstrap=10).parameters["n_documents"] == 2
    assert ch07.SemanticCone(sinks=shared, quantiles=5, n_bootstrap=10).parameters["n_documents"] == 2
    assert nothing_to_explain(None, "rerun check", ["gsm8k"]) == (
        "In the rerun check every claim's parts lie on the claimed side on its data set: nothing to explain.")
    assert "on both data sets" in nothing_to_explain(None, "rerun check", ["gsm8k", "web-text"])  # the control
    from cwbook.chapters import sinks_common
    from cwbook.chapters.sinks_common import disagreement_opening

    monkeypatch.setattr(sinks_common, "claim_verdict_of", lambda *args: "contradicted")  # the rerun's, not read here
    evidence = SimpleNamespace(label="evidence", claim_verdict=lambda d, c: "contradicted",
                               claim_text=lambda d, c: f"**contradicted** on `{d}`")
    one = disagreement_opening("claim", "The claim", None, ["gsm8k"], evidence, "rerun check")
    two = disagreement_opening("claim", "The claim", None, ["gsm8k", "web-text"], evidence, "rerun check")
    assert not any("same on" in line for line in one)
    assert "The data set is not the explanation: the verdict is the same on both." in two  # the control


def test_chapter_2_says_what_the_sink_does_at_the_seed_it_ran():
    """At seed 27 the sink has cos +0.265 and c +0.394, but the page said it "points against it ... It does not build
    the output, it shrinks it" (seed 27 is the only such seed in 0-299); n_trials=0 gave NaN shares."""
    from cwbook.chapters import ch02_geometry as ch02
    from cwcore.core.inputs import InputError

    turned, drawn = ch02.sink(27), ch02.sink(0)
    assert turned.cos[0] > 0 and turned.c[0] > 0 and "points with it" in ch02.sink_reading(turned)["sink_direction"]
    drawn_reading = ch02.sink_reading(drawn)
    assert drawn.cos[0] < 0 and drawn.c[0] < 0 and "it shrinks it" in drawn_reading["sink_effect"]  # the control
    with pytest.raises(InputError, match="n_trials must be at least 1, got 0"):
        ch02.random_heads(0, 0)


def test_the_committed_evidence_size_is_read_from_its_tables(tmp_path):
    """Chapters 4 and 9 typed "64 documents per data set" for the committed evidence; the size is now read from the
    tables' metadata, so another evidence size is said as it is."""
    import json

    from cwbook import findings

    assert findings.documents_per_data_set(findings.EVIDENCE_DIR) == "64 documents per data set"  # what is committed
    for chapter, model, parameters in (("04_faithfulness", "a", {"n_documents": 16}),
                                       ("06_sinks_as_suppressors", "a", {"n_sequences": 32})):
        (tmp_path / chapter).mkdir()
        (tmp_path / chapter / f"{model}.json").write_text(json.dumps({"parameters": parameters}))
    assert findings.documents_per_data_set(tmp_path) == "16 to 32 documents per data set"
    assert findings.documents_per_data_set(tmp_path, "04_faithfulness", "a*") == "16 documents per data set"
    assert findings.documents_per_data_set(tmp_path / "none") == "no committed table here"
