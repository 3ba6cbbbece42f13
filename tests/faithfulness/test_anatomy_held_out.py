"""The held-out test of a ladder step's explanation, with negative controls and Holm's correction,
on synthetic per-document tables whose answer is known."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cwcore import stats
from cwbook import anatomy

RUNGS = anatomy.LADDER


def synthetic(n_docs=40, ratios=(0.01, 0.1), explained=True, seed=0):
    """Per-document measures and damages: the 2->3 damage gap follows the shift gap (when ``explained``),
    the other steps' damage is noise."""
    rng = np.random.default_rng(seed)
    shift_rows, damage_rows = [], []
    for mode in ("comprehensiveness", "sufficiency"):
        for ratio in ratios:
            shift = {m: rng.normal(size=n_docs) for m in RUNGS}
            damage = {m: rng.normal(size=n_docs) for m in RUNGS}
            if explained:
                damage[RUNGS[2]] = damage[RUNGS[1]] + 3 * (shift[RUNGS[2]] - shift[RUNGS[1]])
                damage[RUNGS[3]] = damage[RUNGS[2]] + rng.normal(size=n_docs)  # the 3->4 gap: noise again
            for m in RUNGS:
                for doc in range(n_docs):
                    shift_rows.append({"metric": m, "mode": mode, "ratio": ratio, "document": doc,
                                       **{k: 0.0 for k in anatomy.MEASURES}, "output_shift": shift[m][doc]})
                    damage_rows.append({"metric": m + "_intra" if m in RUNGS[2:] else m, "mode": mode, "ratio": ratio,
                                        "document": doc, "sequence": doc, "nll": 3 + damage[m][doc], "clean_nll": 3.0})
    return pd.DataFrame(shift_rows), pd.DataFrame(damage_rows)


def test_the_explained_step_holds_held_out_and_the_controls_do_not():
    shifts, damage = synthetic()
    table = anatomy.explain_held_out(shifts, damage, seed=1)
    assert len(table) == 3 * 2 * 2 and (table["n_tests"] == 12).all()
    assert (table["n_fit"] == 20).all() and (table["n_test"] == 20).all()
    explained = table[table["role"] == "explained"]
    assert (explained["lower"] == RUNGS[1]).all() and (explained["verdict"] == stats.HOLDS).all()
    assert (table.loc[table["role"] == "control", "verdict"] != stats.HOLDS).all()
    # Holm over the whole table (unselected cells count as p = 1): recomputed independently
    p = table["p_test"].fillna(1.0).to_numpy()
    order = np.argsort(p)
    m = len(p)
    naive = np.maximum.accumulate(np.minimum(1, (m - np.arange(m)) * p[order]))
    expected = np.empty(m)
    expected[order] = naive
    assert np.allclose(table["p_holm"], expected)


def test_without_the_link_nothing_holds_and_the_halves_do_not_overlap():
    shifts, damage = synthetic(explained=False, seed=3)
    table = anatomy.explain_held_out(shifts, damage, seed=0)
    assert (table["verdict"] != stats.HOLDS).all()
    # a different split seed gives different halves (so the fit half is not the test half)
    other = anatomy.explain_held_out(shifts, damage, seed=5)
    assert not np.allclose(table["rho_fit"], other["rho_fit"])
