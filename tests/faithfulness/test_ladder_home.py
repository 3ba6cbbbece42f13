"""The ladder has one home (core.decomposition.METRICS) and every registered method its display name:
the registry, the findings, the anatomy and the evidence design read them from there."""

from __future__ import annotations

import pickle


from cwbook import findings
from cwcore.core.decomposition import METRICS, Rung
from cwbook import anatomy, ladder as evidence
from cwcore.faithfulness import methods
from cwcore.faithfulness.protocol import LADDER


def test_every_reader_takes_the_ladder_from_metrics():
    names = tuple(map(str, METRICS))
    assert names == ("attention", "value_weighted", "value_weighted_output_normalized", "contribution")
    assert findings.RUNGS == anatomy.LADDER == names and LADDER == METRICS
    assert evidence.SIGN_INVARIANT == tuple(n for n in names if n != "contribution") + ("random",)
    for rung in METRICS:
        method = methods.get_method(rung)
        assert method.display_name == rung.title and method.colour == rung.colour
        assert method.kind_dependent == bool(rung.kinds)
    assert [r.title[0] for r in METRICS] == ["1", "2", "3", "4"]  # numbered in ladder order


def test_a_rung_is_a_plain_name_that_survives_pickling():
    rung = METRICS[2]
    assert rung == "value_weighted_output_normalized" and hash(rung) == hash(str(rung)) and "contribution" in METRICS
    copy = pickle.loads(pickle.dumps(rung))
    assert isinstance(copy, Rung) and copy.rescales == "value_weighted" and copy.title == rung.title


def test_the_sign_claim_of_metrics_is_true_on_a_model():
    """nonnegative rungs are never below 0 (so |score| ranks as the score); contribution can be."""
    from faith_helpers import peaked_llama, self_sampled

    model = peaked_llama()
    ids = self_sampled(model, n=3, length=12)
    for rung in METRICS:
        scores = methods.method_scores(model, str(rung), ids)
        lowest = min(float(s.nan_to_num(0.0).min()) for s in scores.values())
        assert (lowest >= 0) == rung.nonnegative, (rung, lowest)


def test_every_registered_method_has_a_display_name_and_a_colour():
    names = methods.display_names()
    assert set(names) == set(methods.available_methods())
    assert names["alti"] == "ALTI" and names["grad_x_input"] == "grad x input"
    colours = methods.colours()
    assert set(colours) == set(names) and len(set(colours.values())) == len(colours)
    assert methods.display_names(["contribution_intra"]) == {"contribution_intra": "contribution_intra"}
