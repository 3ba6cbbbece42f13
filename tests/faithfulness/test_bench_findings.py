"""The attribution bench's tables: method_pairs, and its comparisons as rows of findings.csv."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cwcore import faithfulness as fa
from cwcore import stats
from cwbook import findings
from faith_helpers import forest_points


def test_method_pairs():
    labels = ["attention", "contribution", "alti", "random"]
    assert fa.method_pairs(labels) == [("attention", "contribution"), ("alti", "contribution"),
                                       ("random", "attention"), ("random", "contribution"), ("random", "alti")]
    assert fa.method_pairs(["alti", "random"], reference="contribution") == [("random", "alti")]


def test_bench_comparisons_become_findings_rows(sweep, tmp_path):
    labels = list(dict.fromkeys(sweep["metric"]))
    pairs = fa.method_pairs(labels) + [("value_weighted", "value_weighted_output_normalized")]
    comparisons = fa.ladder_comparison(sweep, pairs=pairs, n_bootstrap=200).assign(
        data="toy", range="full", protocol="default")
    rows = findings.bench_findings(comparisons, model="tiny", profile="test")
    assert list(rows.columns) == findings.FAITHFULNESS_COLUMNS and len(rows) == len(comparisons)
    for (_, c), (_, r) in zip(comparisons.iterrows(), rows.iterrows()):
        assert r["claim"] == f"{c['higher']} beats {c['lower']}"
        side = "above" if c["mode"] == "comprehensiveness" else "below"
        identical = bool(c["identical"])  # by construction under the protocol, not read from the numbers
        expected = stats.NOT_MEASURED if identical else stats.verdict(c["ci_low"], c["ci_high"], side=side)
        assert r["verdict"] == expected and np.isclose(r["estimate"], c["difference"])
    # value-weighted and output-normalised rank identically under the default protocol: not measured
    same = rows[rows["claim"] == "value_weighted_output_normalized beats value_weighted"]
    assert len(same) == 2 and set(same["verdict"]) == {stats.NOT_MEASURED}
    # findings_csv appends the bench's rows to chapter 4's where chapter 4b's table exists
    results = tmp_path / "results"
    path = results / findings.BENCH_CHAPTER / "tiny.csv"
    findings.save_results(path, comparisons, chapter=findings.BENCH_CHAPTER, model="tiny", profile="test",
                          parameters={"n_documents": 10})
    table = findings.findings_csv(results, ["tiny"], "test")
    assert table.iloc[0]["measured"] == "chapter 4 was not built"
    bench = table[table["claim"].str.contains(" beats ") & (table["claim"] != "contribution beats random")]
    assert len(bench) == len(comparisons) - 2 and set(bench["profile"]) == {"test"}
    # where chapter 4 measures the same claim on the same slice ("contribution beats random"), findings.csv
    # keeps chapter 4's row only: no key has two verdicts; the bench's other claims all stay
    findings.save_results(results / "04_faithfulness" / "tiny.csv", comparisons.assign(importance="signed"),
                          chapter="04_faithfulness", model="tiny", profile="test")
    bench_rows = findings.bench_findings(comparisons.assign(importance="signed"), model="tiny", profile="test")
    findings.save_results(path, comparisons.assign(importance="signed"), chapter=findings.BENCH_CHAPTER,
                          model="tiny", profile="test", parameters={"n_documents": 10})
    table = findings.findings_csv(results, ["tiny"], "test")
    assert not table.duplicated(findings.FINDING_KEY).any()
    random_rows = table[table["claim"] == "contribution beats random"]
    assert len(random_rows) == 2 and set(random_rows["source"]) == {"paper"}  # both modes, chapter 4's
    kept = table[table["source"] == "book"]
    assert sorted(kept["claim"]) == sorted(bench_rows.loc[bench_rows["claim"] != "contribution beats random", "claim"])


def test_the_bench_forest_draws_every_measured_pair_in_the_faithful_direction(sweep):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cwbook.forests import VERDICT_COLOURS, bench_forest

    labels = list(dict.fromkeys(sweep["metric"]))
    pairs = fa.method_pairs(labels) + [("value_weighted", "value_weighted_output_normalized")]
    comparisons = pd.concat([fa.ladder_comparison(sweep, pairs=pairs, n_bootstrap=200, max_ratio=r_max)
                             .assign(data="toy", range=rng) for rng, r_max in (("low", 0.2), ("full", None))],
                            ignore_index=True)
    fig = bench_forest(comparisons)
    points = forest_points(fig)
    drawn = comparisons[~comparisons["identical"].astype(bool)]  # identical by construction: left out
    assert 0 < len(drawn) < len(comparisons)
    expected = [(round(float(d) * (-1 if m == "sufficiency" else 1), 12), VERDICT_COLOURS[v].lower())
                for d, m, v in zip(drawn["difference"], drawn["mode"], drawn["verdict"])]
    assert sorted(points) == sorted(expected)
    assert len(fig.axes) == 2  # one data set x two modes
    plt.close(fig)


def test_the_bench_page_counts_the_committed_verdicts_by_the_margin_rule():
    """Chapter 4b's note on the committed comparisons counted their stored verdicts, which predate the registered
    0.01 margin: gemma3-270m's read "8 inconclusive" where findings.csv and the same page's answers say 5
    inconclusive and 3 negligible."""
    from types import SimpleNamespace

    from cwbook.chapters.ch04b_attribution_bench import evidence_size

    committed = findings.load_results(findings.EVIDENCE_DIR, findings.BENCH_CHAPTER, "gemma3-270m")
    judged = findings.judged_bench(committed.table)
    counts = judged["verdict"].value_counts()
    assert counts.get("negligible", 0) > 0  # the control: the margin rule moves some of these verdicts
    note = evidence_size(SimpleNamespace(comparisons=judged), model="gemma3-270m", profile="small")
    said = ", ".join(f"{int(counts.get(v, 0))} {v}" for v in ("holds", "contradicted", "negligible", "inconclusive",
                                                               "not measured"))
    assert said in note
