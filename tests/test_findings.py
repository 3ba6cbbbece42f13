import numpy as np
import pandas as pd

from cwcore import findings as F


def ladder(diffs, mode="comprehensiveness", verdicts=None):
    """Consecutive rung pairs with (difference, ci_low, ci_high)."""
    rows = []
    for (a, b), (d, lo, hi) in zip(zip(F.RUNGS, F.RUNGS[1:]), diffs):
        sign = 1 if mode == "comprehensiveness" else -1
        v = "holds" if sign * lo > 0 and sign * hi > 0 else "reversed" if sign * lo < 0 and sign * hi < 0 else "tie"
        rows.append({"mode": mode, "lower": a, "higher": b, "difference": d, "ci_low": lo, "ci_high": hi,
                     "verdict": v})
    rows.append({"mode": mode, "lower": "random", "higher": "attention", "difference": 5.0, "ci_low": 4.0,
                 "ci_high": 6.0, "verdict": "holds"})
    return pd.DataFrame(rows)


def test_ordering_all_hold_agrees_and_identical_rungs_are_left_out():
    t = ladder([(0.2, 0.1, 0.3), (0.0, 0.0, 0.0), (0.4, 0.3, 0.5)])
    f = F.ordering(t)
    assert f.verdict == F.AGREES and "identical ranking" in f.measured


def test_ordering_partly_and_not():
    assert F.ordering(ladder([(0.2, 0.1, 0.3), (0.1, 0.05, 0.2), (-0.1, -0.2, 0.05)])).verdict == F.PARTLY
    assert F.ordering(ladder([(-0.2, -0.3, -0.1), (0.0, 0.0, 0.0), (-0.1, -0.2, 0.05)])).verdict == F.NO
    assert F.ordering(ladder([(0.0, 0.0, 0.0)] * 3)).verdict == F.UNMEASURED
    assert F.ordering(ladder([], mode="comprehensiveness")).verdict == F.UNMEASURED


def test_ordering_sufficiency_wants_negative_differences():
    t = ladder([(-0.2, -0.3, -0.1), (-0.1, -0.2, -0.05), (-0.3, -0.4, -0.2)], mode="sufficiency")
    assert F.ordering(t, mode="sufficiency").verdict == F.AGREES


def test_cosine_gain():
    assert F.cosine_gain(ladder([(0.2, 0.1, 0.3), (0.0, 0.0, 0.0), (0.6, 0.5, 0.7)])).verdict == F.AGREES
    assert F.cosine_gain(ladder([(0.2, 0.1, 0.35), (0.0, 0.0, 0.0), (0.4, 0.3, 0.5)])).verdict == F.PARTLY
    assert F.cosine_gain(ladder([(0.5, 0.4, 0.6), (0.0, 0.0, 0.0), (0.4, 0.3, 0.5)])).verdict == F.NO


def summary(**values):
    return pd.DataFrame({"claim": "x", "statistic": list(values), "value": list(values.values())})


def test_sink_claims_from_summary_rows():
    s = summary(sink_eps=0.55, mean_sink_rate=0.4,
                sink_heads_sink_share_of_heads_geometry_dominates=0.9,
                sink_heads_tail_share_of_heads_geometry_dominates=0.0,
                median_cos_semantic_sink_heads=-0.15, share_sink_heads_cos_semantic_negative=0.77,
                median_norm_over_semantic_sink_heads=1.05, share_sink_heads_mostly_suppressed=0.3,
                share_sink_heads_convex=1.0, share_sink_heads_interior_minimum=0.67,
                sink_delta_cos_lowest_norm_quantile=0.2, control_delta_cos_lowest_norm_quantile=0.01,
                sink_delta_log_ppl_ci_low=0.5, control_delta_log_ppl_ci_high=0.05)
    got = {f.claim: f.verdict for f in F.sink_findings(s)}
    assert got == {"sink_rates": F.AGREES, "decomposition": F.AGREES, "anti_alignment": F.AGREES,
                   "suppression": F.NO, "convexity": F.AGREES, "semantic_cone": F.AGREES}
    s2 = summary(sink_eps=0.2, share_sink_heads_convex=1.0, share_sink_heads_interior_minimum=0.2,
                 median_norm_over_semantic_sink_heads=0.9, share_sink_heads_mostly_suppressed=0.2)
    got = {f.claim: f.verdict for f in F.sink_findings(s2)}
    assert got["sink_rates"] == F.PARTLY and got["convexity"] == F.PARTLY and got["suppression"] == F.PARTLY
    assert got["anti_alignment"] == F.UNMEASURED and got["semantic_cone"] == F.UNMEASURED


def test_table_and_chapter_verdicts():
    table = F.findings_table({"m": [F.from_chapter("encoders", "holds", "x"),
                                    F.from_chapter("anti_alignment", "inconclusive"),
                                    F.from_chapter("convexity", None)]})
    assert list(table["verdict"]) == [F.AGREES, F.PARTLY, F.UNMEASURED]
    assert F.scoreboard(table).shape == (3, 1)


def test_sink_tables_names_parts_as_the_cli():
    out = F.sink_tables({"rates": "r", "decomposition": ("d", "ds"), "raw": {}})
    assert out == {"rates": "r", "decomposition": "d", "decomposition-sample": "ds"}
