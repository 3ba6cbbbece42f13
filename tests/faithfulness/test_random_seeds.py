"""The random control at several seeds: its interval resamples documents and seeds together."""

from __future__ import annotations

import numpy as np
import pandas as pd

from cwcore import faithfulness as fa
from cwcore import stats
from cwcore.faithfulness.methods import random_controls


def naive_crossed(values, n_resamples, seed):
    rng_rows, rng_cols = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    u, s = values.shape
    rows = rng_rows.integers(0, u, size=(n_resamples, u))
    cols = rng_cols.integers(0, s, size=(n_resamples, s))
    draws = [values[np.ix_(r, c)].mean() for r, c in zip(rows, cols)]
    return np.percentile(draws, 2.5), np.percentile(draws, 97.5)


def test_crossed_bootstrap_matches_a_naive_double_resample():
    values = np.random.default_rng(3).normal(size=(12, 4))
    ci = stats.crossed_bootstrap_ci(values, n_resamples=500, seed=7)
    assert np.isclose(ci.estimate, values.mean())
    assert np.allclose((ci.low, ci.high), naive_crossed(values, 500, 7))
    # identical seeds: only the documents vary, the interval is the documents-only one of the same draws
    same = np.repeat(values[:, :1], 4, axis=1)
    rows = stats.resample_indices(12, 500, 7)
    docs_only = np.percentile([values[r, 0].mean() for r in rows], [2.5, 97.5])
    assert np.allclose(stats.crossed_bootstrap_ci(same, n_resamples=500, seed=7)[1:], docs_only)
    # seed spread widens the interval against the documents-only interval of one seed
    spread = values[:, :1] + np.array([[-1.0, 0.0, 1.0, 2.0]])
    wide = stats.crossed_bootstrap_ci(spread, n_resamples=500, seed=7)
    assert wide.high - wide.low > docs_only[1] - docs_only[0]


def test_random_baseline_pools_the_seeds(peaked):
    model, ids = peaked
    controls = random_controls((0, 1, 2))
    table = fa.faithfulness_curve(model, None, ids, ["contribution", controls], [0.2, 0.5],
                                  progress=False, batch_size=5).per_sequence
    assert {"random_s0", "random_s1", "random_s2"} <= set(table["metric"])
    # random_s0 is the registered random control at the protocol's seed 0, bit for bit
    plain = fa.faithfulness_curve(model, None, ids, ["random"], [0.2, 0.5], progress=False, batch_size=5).per_sequence
    assert np.array_equal(plain["nll"].to_numpy(), table.loc[table["metric"] == "random_s0", "nll"].to_numpy())
    assert not np.array_equal(table.loc[table["metric"] == "random_s1", "nll"].to_numpy(),
                              table.loc[table["metric"] == "random_s0", "nll"].to_numpy())
    out = fa.random_baseline(table, n_bootstrap=300)
    areas = fa.aopc(table, n_bootstrap=20).set_index(["mode", "metric"])["aopc_nll"]
    for mode in fa.MODES:
        row = out[(out["mode"] == mode) & (out["metric"] == "random")].iloc[0]
        seeds = [areas[(mode, f"random_s{s}")] for s in range(3)]
        assert row["n_seeds"] == 3 and row["n"] == len(ids)
        assert np.isclose(row["aopc"], np.mean(seeds)) and np.isclose(row["seed_sd"], np.std(seeds, ddof=1))
        assert row["ci_low"] <= row["aopc"] <= row["ci_high"]
        gap = out[(out["mode"] == mode) & (out["metric"] == "contribution")].iloc[0]
        assert np.isclose(gap["difference"], areas[(mode, "contribution")] - np.mean(seeds))
        assert gap["verdict"] in stats.VERDICTS
    assert isinstance(out, pd.DataFrame)


def test_the_ladder_sweep_averages_the_random_rung_over_its_seeds(peaked):
    # evidence.ladder_sweep(random_seeds=3) runs random (seed 0) and random_s1, random_s2; evidence_tables
    # gives the random rung's AOPC and every "x beats random" step from the three seeds, recomputed here
    # by hand from the per-document rows (AOPC per document and seed, crossed bootstrap, sign-flip p)
    from cwbook import ladder as ev
    from cwcore.faithfulness.summary import curve_mean

    model, ids = peaked
    metrics = ["attention", "contribution", "random"]
    kw = dict(batch_size=5, cache=False, progress=False, n_bootstrap=200, seed=0)
    rows = ev.ladder_sweep(model, None, ids, metrics, [0.1, 0.4], importances=("signed", "absolute"),
                           random_seeds=3, **kw)
    assert {"random", "random_s1", "random_s2"} <= set(rows["metric"]) and "random_s0" not in set(rows["metric"])
    # the extra seeds are sign-invariant: the absolute rows reuse the signed ones
    for label in ("random_s1", "random_s2"):
        part = rows[rows["metric"] == label]
        assert np.array_equal(part[part.importance == "signed"]["nll"].to_numpy(),
                              part[part.importance == "absolute"]["nll"].to_numpy())
    areas, ladder = ev.evidence_tables(rows, n_bootstrap=200, seed=0, low_max=0.1, n_permutations=99)
    assert not ({"random_s1", "random_s2"} & set(areas["metric"]) | {"random_s1", "random_s2"} & set(ladder["lower"]))

    def per_doc_aopc(metric, mode, importance, r_max):
        part = rows[(rows.metric == metric) & (rows["mode"] == mode) & (rows.importance == importance)
                    & (rows.ratio <= r_max + 1e-12)]
        curve = (part["nll"] - part["clean_nll"]).groupby([part["sequence"], part["ratio"]]).mean().unstack()
        return curve_mean(np.array(curve.columns, dtype=float), curve.to_numpy())

    for (mode, importance, rng), part in ladder[ladder["lower"] == "random"].groupby(["mode", "importance", "range"]):
        r_max = 0.1 if rng == "low" else 0.4
        noise = np.stack([per_doc_aopc(m, mode, importance, r_max) for m in ("random", "random_s1", "random_s2")], 1)
        row = part[part["higher"] == "contribution"].iloc[0]
        gap = per_doc_aopc("contribution", mode, importance, r_max)[:, None] - noise
        ci = stats.crossed_bootstrap_ci(gap, n_resamples=200, seed=0)
        assert row["n_seeds"] == 3 and row["seeds"] == "0,1,2" and np.isclose(row["difference"], gap.mean())
        assert np.allclose([row["ci_low"], row["ci_high"]], [ci.low, ci.high])
        assert np.isclose(row["p"], stats.sign_flip_p(gap.mean(1), n_resamples=99, seed=0))
        assert np.isclose(row["aopc_lower"], noise.mean())
        a = areas[(areas.metric == "random") & (areas["mode"] == mode) & (areas.importance == importance)
                  & (areas["range"] == rng)].iloc[0]
        assert np.isclose(a["aopc_nll"], noise.mean()) and a["n_seeds"] == 3
        assert np.allclose([a["aopc_nll_ci_low"], a["aopc_nll_ci_high"]],
                           stats.crossed_bootstrap_ci(noise, n_resamples=200, seed=0)[1:])
    # one seed: the random rung is seed 0 alone and the tables are the plain ones
    one = rows[~rows["metric"].isin(["random_s1", "random_s2"])]
    _, plain = ev.evidence_tables(one, n_bootstrap=200, seed=0, low_max=0.1, n_permutations=0)
    assert "n_seeds" not in plain
    own = fa.ladder_comparison(one[one.importance == "signed"].drop(columns=["importance", "protocol"]),
                               n_bootstrap=200, seed=0)
    mine = plain[(plain["range"] == "full") & (plain.importance == "signed")]
    assert np.allclose(mine.sort_values(["mode", "lower", "higher"])["ci_low"],
                       own.sort_values(["mode", "lower", "higher"])["ci_low"])
