import numpy as np
import pandas as pd

from cwcore import findings as F
from cwcore import sink_claims as SC
from cwcore import sinks


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


def claims_table(parts):
    """A claims table of cwcore.sink_claims from (claim, low, high, threshold, side) parts."""
    rows = [{"chapter": 6, "claim": claim, "part": f"part {i}", "statistic": "s", "key": f"k{i}",
             "estimate": (low + high) / 2, "low": low, "high": high, "threshold": threshold, "side": side, "n": 10,
             "verdict": sinks.verdict(low, high, threshold=threshold, side=side)}
            for i, (claim, low, high, threshold, side) in enumerate(parts)]
    return pd.DataFrame(rows, columns=SC.COLUMNS)


def test_sink_findings_take_the_chapters_verdicts():
    claims = claims_table([
        (SC.DECOMPOSITION, 0.6, 0.9, 0.5, "above"), (SC.DECOMPOSITION, 0.7, 0.95, 0.5, "above"),  # both hold
        (SC.ANTI_ALIGNMENT, -0.3, -0.1, 0.0, "below"), (SC.ANTI_ALIGNMENT, -0.2, 0.1, 0.0, "below"),  # one holds
        (SC.TREND, 0.1, 0.4, 0.0, "below"),  # the other side: does not hold
        (SC.SUPPRESSION, 0.3, 0.6, 0.5, "above"),  # interval contains the threshold: inconclusive
        (SC.CONE, 0.1, 0.2, 0.0, "above"), (SC.PERPLEXITY, 0.4, 0.9, 0.0, "above"),  # two claims, one finding
    ])
    summary = pd.DataFrame({"claim": "sink_rate", "statistic": ["sink_eps", "mean_sink_rate"], "value": [0.55, 0.4]})
    got = {f.claim: f for f in F.sink_findings(summary, claims)}
    verdicts = {k: f.verdict for k, f in got.items()}
    assert verdicts == {"sink_rates": F.AGREES, "decomposition": F.AGREES, "anti_alignment": F.PARTLY,
                        "anti_alignment_trend": F.NO, "suppression": F.PARTLY, "convexity": F.UNMEASURED,
                        "semantic_cone": F.AGREES}
    # the measured text quotes every part's estimate and interval
    assert "[-0.3, -0.1] holds" in got["anti_alignment"].measured
    assert "[-0.2, 0.1] inconclusive" in got["anti_alignment"].measured
    assert got["semantic_cone"].measured.count("holds") == 2
    # one part of the cone failing makes the finding partly, as the chapter's "holds partly"
    worse = claims_table([(SC.CONE, 0.1, 0.2, 0.0, "above"), (SC.PERPLEXITY, -0.4, -0.1, 0.0, "above")])
    assert F.from_claims("semantic_cone", worse).verdict == F.PARTLY
    assert sinks.combine_verdicts(list(worse["verdict"])) == "holds partly"


def test_table_and_chapter_verdicts():
    table = F.findings_table({"m": [F.from_chapter("encoders", "holds", "x"),
                                    F.from_chapter("anti_alignment", "inconclusive"),
                                    F.from_chapter("convexity", None)]})
    assert list(table["verdict"]) == [F.AGREES, F.PARTLY, F.UNMEASURED]
    assert F.scoreboard(table).shape == (3, 1)


def test_sink_tables_names_parts_as_the_cli():
    out = F.sink_tables({"rates": "r", "decomposition": ("d", "ds"), "raw": {}})
    assert out == {"rates": "r", "decomposition": "d", "decomposition-sample": "ds"}
