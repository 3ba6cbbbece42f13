"""Chapter 4's cells are one function of the package (:func:`cwbook.ladder.ladder_evidence`),
called by the notebook (through its chapter module, :mod:`cwbook.chapters.ch04_faithfulness`) and by the
evidence export alike, with the parameters of one reader of run.yml
(:func:`cwbook.parameters.run_parameters`); the named grids travel with the run, so the low range
is the profile's low grid, not a constant. On a tiny Llama with a word tokenizer and a local text file."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import cwcore
from cwbook import evidence_export as es
from cwbook.chapters import ch04_faithfulness as ch04
from cwbook.chapters.common import unlabelled_verdicts
from cwbook.parameters import declared_defaults, run_parameters
from cwbook import ladder as ev
from faith_helpers import peaked_llama, word_tokenizer

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "04_faithfulness.ipynb"
MODEL = "tiny-llama"
WORDS = "the a cat dog sat on mat and ran away one two three four five six seven eight nine ten it far so".split()


def _run_yml(tmp_path: Path, data: Path, low_ratios, **chapter) -> Path:
    """A run.yml with chapter 4 and a profile that sizes it for the tiny model (``chapter``: more of
    chapter 4's parameters)."""
    config = {"chapters": [{"notebook": "04_faithfulness", "runs": "per_model"}],
              "profiles": {"tiny": {"models": [MODEL],
                                    "params": {"seed": 0, "device": "cpu", "dtype": "float32", "n_sequences": 3,
                                               "seq_len": 10, "batch_size": 2},
                                    "notebooks": {"04_faithfulness": {
                                        "datasets": [str(data)], "low_ratios": list(low_ratios), "ratios": [0.5],
                                        "protocols": ["default"], "n_bootstrap": 50, "cache": False,
                                        **chapter}}}}}
    path = tmp_path / f"run_{len(low_ratios)}_{len(chapter)}.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chapter4")
    rng = np.random.default_rng(0)
    data = tmp / "docs.txt"
    data.write_text("\n\n".join(" ".join(rng.choice(WORDS, 14)) for _ in range(6)) + "\n")
    return tmp, data, peaked_llama(), word_tokenizer()


def _notebook_ladder(parameters: dict, loaded):
    """Chapter 4's ladder as notebook 04 computes it: its one call, ``ch04.ladder(lm, tokenizer, ...)``, read
    from the notebook's setup cell, with ``parameters`` (what the runner injects) in place of each parameter
    the call names and the tiny model in place of ``load_model``'s."""
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "parameters" in code[0]["metadata"]["tags"]
    setup = next(c for c in code if "ch04.ladder(" in "".join(c["source"]))  # the sweeps' cell
    call = next(node for node in ast.walk(ast.parse("".join(setup["source"])))
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "ch04.ladder")
    assert [ast.unparse(a) for a in call.args] == ["lm", "tokenizer"]
    # every keyword is a parameter of the notebook passed by its own name
    assert all(isinstance(k.value, ast.Name) and k.value.id == k.arg for k in call.keywords), ast.unparse(call)
    return ch04.ladder(*loaded, **{k.arg: parameters[k.arg] for k in call.keywords})


def test_the_exporter_and_the_notebook_compute_the_same_frames(setup, monkeypatch):
    tmp, data, model, tokenizer = setup
    config = _run_yml(tmp, data, [0.1, 0.2])
    params = run_parameters("04_faithfulness", "tiny", MODEL, config=config)
    # the reader: the notebook's declared defaults, replaced by what run.yml sets for this profile
    assert params["low_ratios"] == [0.1, 0.2] and params["n_sequences"] == 3 and params["seq_len"] == 10
    assert params["metrics"] == declared_defaults(NOTEBOOK)["metrics"] and params["model"] == MODEL
    page = _notebook_ladder(params, (model, tokenizer))
    exported = es.per_document("tiny", MODEL, str(data), 3, config=config, loaded=(model, tokenizer))
    assert len(page.per_seq) == len(exported) > 0
    # the same rows, the exporter's with model and delta_nll columns beside them
    pd.testing.assert_frame_equal(exported[list(page.per_seq.columns)].reset_index(drop=True),
                                  page.per_seq.reset_index(drop=True))
    assert np.allclose(exported["delta_nll"], exported["nll"] - exported["clean_nll"])
    used = exported.attrs["parameters"]
    assert used["grids"] == {"low": [0.1, 0.2], "paper": [0.5]} and used["grid"] == page.grid == [0.1, 0.2, 0.5]
    # the ladder the exporter's tables() computes from those rows, at the grids it carries, is the page's
    areas, ladder = ev.evidence_tables(exported.drop(columns=["data", "model", "delta_nll"]),
                                       grids=es.grids_of(used), n_bootstrap=50, seed=0)
    pd.testing.assert_frame_equal(ladder, page.ladder.drop(columns="data"))
    pd.testing.assert_frame_equal(areas, page.areas.drop(columns="data"))
    assert page.low_max == 0.2 and set(page.areas["range"]) == {"low", "full"}
    # the quoted clean perplexity is the data set's, exp(mean NLL) over its documents' blocks (it was the mean of
    # the documents' perplexities), computed here from the model's own logits
    nll = []
    for block in page.blocks[str(data)]:
        ids = torch.as_tensor(block["input_ids"] if isinstance(block, dict) else block).reshape(1, -1)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.double()
        nll.append(float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])))
    assert page.quoted["clean_ppl"] == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-5)


def _naive_low_aopc(per_sequence: pd.DataFrame, low_max: float) -> pd.Series:
    """Mean over documents of the trapezoid area of Delta NLL over (0, 0) and the ratios <= low_max,
    divided by the last ratio: {(metric, mode): AOPC}, from the rows alone."""
    frame = per_sequence[per_sequence["ratio"] <= low_max + 1e-12]
    frame = frame.assign(delta=frame["nll"] - frame["clean_nll"])
    out = {}
    for (metric, mode), g in frame.groupby(["metric", "mode"]):
        wide = g.groupby(["document", "ratio"])["delta"].mean().unstack("ratio")
        r = np.r_[0.0, wide.columns.to_numpy(float)]
        y = np.c_[np.zeros(len(wide)), wide.to_numpy()]
        out[(metric, mode)] = float(np.mean(np.trapezoid(y, r, axis=1) / r[-1]))
    out = pd.Series(out)
    # the random rung is the mean over the random control's seeds (random, random_s1, ...)
    seeded = [k for k in out.index if k[0] == "random" or k[0].startswith(ev.RANDOM_PREFIX)]
    for mode in {k[1] for k in seeded}:
        out[("random", mode)] = float(np.mean([out[k] for k in seeded if k[1] == mode]))
    return out.drop([k for k in seeded if k[0] != "random"])


def test_raising_low_ratios_moves_the_low_range_with_them(setup):
    tmp, data, model, tokenizer = setup
    lows = {}
    for low_ratios in ([0.01, 0.05], [0.01, 0.05, 0.1, 0.2]):
        config = _run_yml(tmp, data, low_ratios)
        rows = es.per_document("tiny", MODEL, str(data), 3, config=config, loaded=(model, tokenizer))
        grids = es.grids_of(rows.attrs["parameters"])
        assert grids.low_max == max(low_ratios)
        areas, _ = ev.evidence_tables(rows.drop(columns=["data", "model", "delta_nll"]), grids=grids,
                                      n_bootstrap=50, seed=0, n_permutations=0)
        low = areas[(areas["range"] == "low") & (areas["importance"] == "signed")].set_index(["metric", "mode"])
        naive = _naive_low_aopc(rows[rows["importance"] == "signed"], max(low_ratios))
        assert np.allclose(low["aopc_nll"].sort_index(), naive.sort_index(), rtol=1e-9, atol=1e-12)
        lows[max(low_ratios)] = low["aopc_nll"]
    # the control: the wider low grid's low range is not the 0.05 one (the old constant's)
    assert not np.allclose(lows[0.2].sort_index(), lows[0.05].sort_index())


def test_the_grids_keep_their_names_through_a_slice():
    grids = ev.RatioGrids([0.001, 0.05], [0.05, 0.5, 0.9])
    assert grids.ratios == [0.001, 0.05, 0.5, 0.9] and grids.low_max == 0.05
    assert grids.ranges() == {"low": 0.05, "full": None}
    part = grids.restrict([0.9, 0.001])
    assert part.as_dict() == {"low": [0.001], "paper": [0.9]} and part.ranges() == {"low": 0.001, "full": None}
    assert ev.RatioGrids(**part.as_dict()) == part
    assert ev.RatioGrids([], [0.5]).ranges() == {"full": None}
    with pytest.raises(ValueError, match="neither grid"):
        grids.restrict([0.3])
    with pytest.raises(TypeError, match="grids or low_max"):
        ev.evidence_tables(pd.DataFrame(), grids=grids, low_max=0.05)


def _calls_exec(source: str) -> list[int]:
    """Lines of ``source`` that call the builtins exec, eval or compile."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("exec", "eval", "compile")]


def test_the_package_executes_no_source_text():
    assert _calls_exec("scope = {}\nexec(cell, {}, scope)\n") == [2]  # the detector finds the old way
    package = Path(cwcore.__file__).resolve().parent
    found = {str(p.relative_to(package)): lines for p in sorted(package.rglob("*.py"))
             if (lines := _calls_exec(p.read_text()))}
    assert not found, f"the package executes source text (a notebook's cells?): {found}"


def test_variant_cells_are_the_default_protocol_with_one_field_changed_on_the_models_named(setup):
    tmp, data, model, tokenizer = setup
    config = _run_yml(tmp, data, [0.1], variants=["token-unit", "first-token-removable"], variant_models=[MODEL],
                      random_seeds=1)
    rows = es.per_document("tiny", MODEL, str(data), 3, config=config, loaded=(model, tokenizer))
    assert rows.groupby("variant")["protocol"].unique().map(list).to_dict() == {
        "main": ["default"], "token-unit": ["default"], "first-token-removable": ["default"]}
    blocks = cwcore.data.document_blocks(cwcore.load_dataset(str(data)), tokenizer, 10, 3, seed=0)
    for variant, change in ev.VARIANT_CHANGES.items():
        alone = ev.ladder_sweep(model, tokenizer, blocks, rows.attrs["parameters"]["metrics"], [0.1, 0.5],
                                protocol_change=change, n_bootstrap=50, seed=0, batch_size=2, max_length=10,
                                cache=False, progress=False)
        mine = rows[rows["variant"] == variant].drop(columns=["data", "model", "delta_nll"])
        pd.testing.assert_frame_equal(mine[list(alone.columns)].reset_index(drop=True), alone)
    # the main cells do not move when variants run beside them
    plain = es.per_document("tiny", MODEL, str(data), 3, config=_run_yml(tmp, data, [0.1], random_seeds=1),
                            loaded=(model, tokenizer))
    pd.testing.assert_frame_equal(rows[rows["variant"] == "main"].reset_index(drop=True), plain)
    # a model the profile does not name runs none; an unknown variant is refused by name
    other = _run_yml(tmp, data, [0.1], variants=["token-unit"], variant_models=["somebody-else"], random_seeds=1)
    assert set(es.per_document("tiny", MODEL, str(data), 3, config=other, loaded=(model, tokenizer))["variant"]) == {"main"}
    with pytest.raises(ValueError, match="unknown variants \\['token'\\]"):
        ev.ladder_evidence(model, tokenizer, datasets=[str(data)], n_sequences=3, seq_len=10, low_ratios=[0.1],
                           ratios=[0.5], protocols=["default"], importances=["signed"], metrics=["random"],
                           n_bootstrap=10, seed=0, batch_size=2, variants=["token"])
    # each variant step beside the same step of the main protocol
    grids = es.grids_of(rows.attrs["parameters"])
    split = lambda t: ev.evidence_tables(t.drop(columns=["data", "model", "delta_nll"]), grids=grids,  # noqa: E731
                                         n_bootstrap=50, seed=0, n_permutations=0)[1]
    main, varied = split(rows[rows["variant"] == "main"]), split(rows[rows["variant"] != "main"])
    changes = ev.variant_changes(main, varied)
    assert len(changes) == len(varied) and set(changes["variant"]) == set(ev.VARIANT_CHANGES)
    first = changes.iloc[0]
    same = main[(main["mode"] == first["mode"]) & (main["importance"] == first["importance"])
                & (main["range"] == first["range"]) & (main["lower"] == first["lower"])
                & (main["higher"] == first["higher"])].iloc[0]
    assert first["verdict_main"] == same["verdict"] and first["changed"] == (first["verdict"] != same["verdict"])

    # the page's cell that says what changes (run here: the book's profiles run no variant)
    nb = json.loads(NOTEBOOK.read_text())
    source = "".join(next(c for c in nb["cells"] if c.get("id") == "faith22c")["source"])
    assert "ch04.variant_summary(lad.ladder, lad.variant_ladder, profile, model=model)" in source  # run here
    moved = int(changes["changed"].sum())
    evidence_build = ch04.variant_summary(main.assign(data="docs"), varied.assign(data="docs"), "evidence")[0]
    assert evidence_build.startswith(f"{moved} of {len(changes)} step verdicts differ")
    # any other profile's variants are its rerun check: where the intervals lie, never a verdict word
    rerun = ch04.variant_summary(main.assign(data="docs"), varied.assign(data="docs"), "default")[0]
    assert rerun.startswith(f"{moved} of {len(changes)} steps of this build's rerun check differ")
    assert not unlabelled_verdicts(rerun), rerun


def test_the_weights_variant_cell_runs_the_main_cells_on_the_other_weights_and_names_the_primary_changes(
        setup, monkeypatch):
    tmp, data, model, tokenizer = setup
    assert es.weight_variant_names("smollm2-135m", {"weight_variants": ["requantized"],
                                                   "weight_variant_models": ["smollm2-135m"]}) == [
        "smollm2-135m-requantized"]
    assert es.weight_variant_names("gemma3-270m", {"weight_variants": ["requantized"],
                                                  "weight_variant_models": ["smollm2-135m"]}) == []
    assert es.weight_variant_names("x", {"weight_variants": ["requantized"], "weight_variant_models": None}) == [
        "x-requantized"]
    # the other weights: the tiny model with W_V and W_O perturbed by about 1%, as a re-quantisation does
    import copy

    import torch

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith(("v_proj.weight", "o_proj.weight")):
                p.add_(0.01 * p.abs().mean() * torch.randn(p.shape, generator=g))
    loaded = {"tiny-requantized": (other, tokenizer)}
    common = dict(datasets=[str(data)], n_sequences=3, seq_len=10, low_ratios=[0.1], ratios=[0.5],
                  protocols=["default", "per-head"], importances=["signed", "absolute"],
                  metrics=["attention", "value_weighted", "value_weighted_output_normalized", "contribution", "random"],
                  random_seeds=1, n_bootstrap=50, seed=0, batch_size=2, cache=False)
    main = ev.ladder_evidence(model, tokenizer, **common).tables(n_permutations=0)[1]
    nb = json.loads(NOTEBOOK.read_text())
    source = "".join(next(c for c in nb["cells"] if c.get("id") == "faith22e")["source"])
    assert "ch04.weight_variants(" in source  # the page's call, run here on the tiny models
    monkeypatch.setattr(cwcore, "load_model", lambda name, **_: loaded[name])
    monkeypatch.setattr(ch04, "ladder_cell", lambda *a, model, profile, dtype, data, **k: ev.ladder_sweep(*a, **k))
    arguments = dict(model="tiny", weight_variants=["requantized"], weight_variant_models=None, profile="tiny",
                     dtype="float32", device="cpu", **{k: v for k, v in common.items() if k != "n_bootstrap"},
                     n_bootstrap=50)
    said, shown = {}, []
    said["weights_summary"], table = ch04.weight_variants(main, **arguments)
    shown.append(table)
    changes = ev.variant_changes(main, ev.ladder_evidence(other, tokenizer, **common).tables(n_permutations=0)[1]
                                 .assign(variant="requantized"))
    # both protocols are matched step by step (a step under per-head beside the same step under per-head)
    assert set(changes["protocol"]) == {"default", "per-head"} and len(changes) == len(main)
    assert not changes["verdict_main"].isna().any()
    # "tiny" is not a model of the primary family: no primary step to report
    assert said["weights_summary"].startswith("0 of 0 primary steps of this build's rerun check survive")
    said.clear()
    # a primary model, its text file read as GSM8K: the primary steps (4 per mode, |c|, full range) are named
    loaded["smollm2-135m-requantized"] = (other, tokenizer)
    is_primary = ev.is_primary
    as_gsm8k = lambda model, data, *rest: is_primary(model, "gsm8k", *rest)  # noqa: E731
    monkeypatch.setattr(ev, "is_primary", as_gsm8k)
    said["weights_summary"], table = ch04.weight_variants(main, **{**arguments, "model": "smollm2-135m",
                                                                    "profile": "evidence"})
    shown.append(table)
    primary = changes[[as_gsm8k("smollm2-135m", r.data, r.mode, r.protocol, r.importance, r.range, r.lower, r.higher)
                       for r in changes.itertuples()]]
    assert len(primary) == 8 and len(shown[-1]) == 8
    kept = int((~primary["changed"]).sum())
    assert said["weights_summary"].startswith(f"{kept} of 8 primary verdicts survive the re-quantisation")
    assert ("changed:" in said["weights_summary"]) == (kept < 8)


def _per_layer_section(scope: dict, monkeypatch, out: Path) -> tuple[dict, dict]:
    """Chapter 4's per-layer section as the notebook runs it (``ch04.per_layer``, and its figure when there
    are rows) with ``scope``'s parameters and the committed frames read from ``out``; returns the glued values
    and the section's names (``pl_areas``)."""
    import types

    import matplotlib

    matplotlib.use("Agg")

    from cwbook import evidence_frames as ef
    from cwcore.plotting import save_figure

    nb = json.loads(NOTEBOOK.read_text())
    cell = next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
                and "ch04.per_layer(" in "".join(c["source"]))
    assert "ch04.per_layer_figure(pl" in cell  # the page draws what the section returns
    monkeypatch.setattr(ef, "DEFAULT_OUT", out)
    arguments = {k: scope[k] for k in ("first", "metrics", "per_layer_sequences", "per_layer_ratios", "seed",
                                       "n_bootstrap", "model")}
    no_blocks = types.SimpleNamespace(blocks={})  # per_layer_sequences = 0: the ladder's documents are not read
    pl = ch04.per_layer(None, None, no_blocks, batch_size=2, seq_len=10, profile="tiny", dtype="float32",
                        **arguments)
    if pl.rows is not None:
        save_figure(ch04.per_layer_figure(pl, first=scope["first"], model=scope["model"]), scope["output_dir"],
                    "per_layer")
    return {**pl.quoted, **pl.quoted_md}, {"pl_areas": pl.areas}


def test_the_per_layer_section_shows_the_committed_frame_when_the_profile_skips_it(tmp_path, monkeypatch):
    """A profile without per-layer interventions (the default) draws the committed evidence frame of this
    model and first data set, and says whose rows they are; without a frame it says it has none."""
    import datasets
    import torch

    from cwbook import evidence_frames as ef
    from cwcore.faithfulness.layers import per_layer_aopc, per_layer_curve
    from faith_helpers import self_sampled

    model = peaked_llama()
    ids = self_sampled(model, n=3, length=10)
    blocks = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist(),
                                         "document": [4, 9, 2]})
    frame = per_layer_curve(model, None, blocks, ["attention", "contribution"], [0.2], "comprehensiveness",
                            batch_size=2)
    out = tmp_path / "evidence"
    ef.write_frame(ef.PER_LAYER, frame, {"profile": "evidence", "commit": "abcdef0123", "settings": {"seq_len": 10}},
                   "tiny", "toy", out)
    scope = dict(per_layer_sequences=0, per_layer_ratios=[0.05], model="tiny", first="toy",
                 metrics=["attention", "contribution", "random"], n_bootstrap=50, seed=0,
                 output_dir=str(tmp_path / "figures"))
    glued, names = _per_layer_section(scope, monkeypatch, out)
    assert glued["pl_docs"] == 3 and glued["pl_ratios"] == "0.2"  # the frame's, not the profile's
    assert "per_layer_tiny_toy.csv.gz" in glued["pl_note"] and "commit abcdef0" in glued["pl_note"]
    assert (tmp_path / "figures").is_dir() and any((tmp_path / "figures").iterdir())
    # the areas drawn are those of the frame read back (8 digits): layer by layer, as per_layer_aopc gives them
    table, _ = ef.read_frame(ef.PER_LAYER, "tiny", "toy", out)
    pd.testing.assert_frame_equal(names["pl_areas"], per_layer_aopc(table, n_bootstrap=50, seed=0))
    assert np.allclose(names["pl_areas"]["aopc_nll"], per_layer_aopc(frame, n_bootstrap=50, seed=0)["aopc_nll"],
                       rtol=0, atol=1e-6)
    # another model's frame is not this model's evidence
    glued, _ = _per_layer_section({**scope, "model": "other"}, monkeypatch, out)
    assert glued["pl_docs"] == 0 and "no per-layer frame is committed" in glued["pl_note"]


def test_a_build_without_variants_reports_the_committed_evidence_variants_never_not_run(tmp_path):
    """A build that ran no variant says what the committed evidence found for the model (counted against an
    independent merge of findings.csv), and only says "not in the committed evidence" for a model without them."""
    import pandas as pd

    from cwbook import findings
    from cwbook.evidence_files import read_checked_csv

    empty = pd.DataFrame(columns=["data"])
    rows = read_checked_csv(findings.EVIDENCE_DIR / "findings.csv")
    rows = rows[(rows["sample"] == "exploratory") & (rows["model"] == "smollm2-135m") & rows["claim"].str.startswith("step")]
    cell = ["data", "mode", "protocol", "importance", "range", "claim"]
    main = rows[rows["variant"] == "main"].set_index(cell)["verdict"]
    varied = rows[rows["variant"].isin(["token-unit", "first-token-removable"])]
    expected = sum(main.get(tuple(r[c] for c in cell)) != r["verdict"] for _, r in varied.iterrows()
                   if tuple(r[c] for c in cell) in main.index)
    text, table = ch04.variant_summary(empty, empty, "default", model="smollm2-135m")
    assert table is not None and int(table["changed"].sum()) == expected
    assert text.startswith("not run by this build; in the committed evidence") and f"{expected} of {len(table)}" in text
    text, table = ch04.variant_summary(empty, empty, "default", model="gemma3-270m")  # the evidence ran none on it
    assert table is None and "not in the committed evidence for this model" in text
    assert "not run under this profile" not in text


def test_the_bench_page_answers_from_the_committed_bench(tmp_path):
    """Chapter 4b's generated answer: per method and mode, the verdict counts of the committed bench (recounted
    here from the table), and the methods that beat random everywhere; a model without a committed bench says so."""
    import re

    from cwbook import findings
    from cwbook.chapters import ch04b_attribution_bench as ch04b

    # judged as findings.csv judges the bench: three sufficiency cells lie inside the margin (negligible): two
    # GSM8K rows of findings.csv, and web-text's contribution against random (findings.csv keeps the ladder's)
    table = findings.judged_bench(findings.load_results(findings.EVIDENCE_DIR, findings.BENCH_CHAPTER,
                                                        "gemma3-270m").table)
    assert (table["verdict"] == "negligible").sum() == 3
    text, figure = ch04b.committed_answer("gemma3-270m")
    assert figure is not None
    for method in ("alti", "grad_x_input", "value_zeroing", "rollout", "contribution_rollout"):
        line = next(l for l in text.splitlines() if l.startswith(f"- {ch04b.LABELS[method]}:"))
        for mode in ("comprehensiveness", "sufficiency"):
            rows = table[(table["higher"] == "contribution") & (table["lower"] == method) & (table["mode"] == mode)]
            said = re.search(rf"{mode}: ([^;]*) of (\d+)", line)
            assert int(said.group(2)) == len(rows)
            text_counts = re.findall(r"(\d+) (holds|contradicted|negligible|inconclusive|not measured)", said.group(1))
            assert sum(int(count) for count, _ in text_counts) == len(rows)
            for count, verdict in text_counts:
                assert int(count) == int((rows["verdict"] == verdict).sum()), (method, mode, verdict)
    control = table[table["lower"] == "random"]
    everywhere = sum((rows["verdict"] == "holds").all() for _, rows in control.groupby("higher"))
    assert f"{everywhere} of {control['higher'].nunique()} beat it in every cell" in text
    text, figure = ch04b.committed_answer("no-such-model", evidence_dir=tmp_path)
    assert figure is None and text.startswith("no bench is committed")
