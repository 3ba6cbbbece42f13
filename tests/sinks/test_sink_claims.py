"""The sink chapters' claims tables (cwbook.sink_claims) against independent computations.

Shares of heads are checked against scipy's Wilson interval, medians and rank correlations against
numpy/scipy, pooled means against naive sums, and paired intervals against constructions where the
pairing makes them collapse to a point. The last test runs the planted one-layer model of
sink_fixtures through every analysis and checks the table against the raw points.
"""

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from cwcore import stats as cstats
from cwbook import sink_claims as SC
from cwcore import sinks
from cwcore.sinks import intervals
from sink_fixtures import FAST, planted_ids, planted_model


def wilson(k, n):
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    return ci.low, ci.high


def decomposition_inputs(seed=0, heads=24):
    rng = np.random.default_rng(seed)
    layer, head = np.divmod(np.arange(heads), 4)
    rates = pd.DataFrame({"layer": layer, "head": head, "sink_rate": rng.uniform(0, 1, heads)})
    rows = []
    for l, h in zip(layer, head):
        for cls in ("sink", "tail"):
            shares = rng.dirichlet([1, 1, 1])
            rows += [{"scope": "head", "layer": l, "head": h, "token_class": cls, "factor": f, "share": v}
                     for f, v in zip(("alpha", "relative_norm", "cosine"), shares)]
    rows.append({"scope": "sink_heads", "layer": -1, "head": -1, "token_class": "sink", "factor": "alpha", "share": 0.3})
    return rates, pd.DataFrame(rows)


def test_decomposition_claims_count_sink_heads_with_wilson_intervals():
    rates, summary = decomposition_inputs()
    eps = 0.4
    claims = SC.decomposition_claims(rates, summary, eps)
    share = summary[summary["scope"] == "head"].pivot_table(index=["layer", "head", "token_class"], columns="factor",
                                                             values="share")
    expected = {}
    for cls, key in (("sink", "sink_geometry_share"), ("tail", "tail_attention_share")):
        flags = []
        for _, r in rates[rates["sink_rate"] > eps].iterrows():
            s = share.loc[(r["layer"], r["head"], cls)]
            geometry = s["relative_norm"] + s["cosine"]
            flags.append(geometry > s["alpha"] if cls == "sink" else s["alpha"] > geometry)
        k, n = int(np.sum(flags)), len(flags)
        est, low, high = SC.triple(claims, key)
        assert est == pytest.approx(k / n)
        assert (low, high) == pytest.approx(wilson(k, n), abs=1e-9)
        expected[key] = sinks.verdict(low, high, threshold=0.5)
    per_head = claims[claims["key"].isin(expected)]
    assert list(per_head["verdict"]) == list(expected.values())
    assert list(per_head["n"]) == [int((rates["sink_rate"] > eps).sum())] * 2
    assert list(claims.columns) == SC.COLUMNS
    # the same sink part, heads clustered by layer: the mean margin over sink heads
    margin = []
    for _, r in rates[rates["sink_rate"] > eps].iterrows():
        s = share.loc[(r["layer"], r["head"], "sink")]
        margin.append(s["relative_norm"] + s["cosine"] - s["alpha"])
    est, low, high = SC.triple(claims, "sink_geometry_margin_by_layer")
    assert est == pytest.approx(np.mean(margin)) and low <= est <= high


def suppressor_inputs(seed=0, heads=30, sequences=6, queries=20):
    rng = np.random.default_rng(seed)
    layer, head = np.divmod(np.arange(heads), 5)
    rate = rng.uniform(0, 1, heads)
    aa = pd.DataFrame({"layer": layer, "head": head, "sink_rate": rate, "is_sink_head": rate > 0.3,
                       # planted: stronger sinks point further against the text
                       "cos_value_mean": -0.5 * rate + rng.normal(0, 0.05, heads),
                       "cos_semantic_mean": -0.8 * rate + rng.normal(0, 0.05, heads)})
    fits = pd.DataFrame({"scope": "head", "layer": layer, "head": head, "sink_rate": rate,
                         "is_sink_head": rate > 0.3, "fitted": rng.uniform(0, 1, heads) > 0.2,
                         "interior_minimum": rng.uniform(0, 1, heads) > 0.3,
                         "minimum_in_range": rng.uniform(0, 1, heads) > 0.7})
    grid = pd.MultiIndex.from_product([range(sequences), range(heads), range(queries)],
                                      names=["sequence", "index", "query"]).to_frame(index=False)
    points = grid.assign(layer=layer[grid["index"]], head=head[grid["index"]],
                         norm=rng.uniform(0, 2, len(grid)), s_sq=rng.uniform(-0.1, 2, len(grid)))
    points["alpha0"] = rng.uniform(0, 0.99, len(grid))  # drawn last: the columns above are unchanged
    # the direction control's inputs (a unit sink value, a random direction orthogonal to every s_i)
    points["v0_sq"], points["u_s"] = 1.0, 0.0
    return aa, fits, points.drop(columns="index"), 0.3


def test_suppressor_claims_against_numpy_and_scipy():
    aa, fits, points, eps = suppressor_inputs()
    claims = SC.suppressor_claims(aa, fits, points, eps, n_resamples=400, seed=1)
    sink = aa[aa["is_sink_head"]]
    for key, column in (("cos_value", "cos_value_mean"), ("cos_semantic", "cos_semantic_mean")):
        est, low, high = SC.triple(claims, key)
        assert est == pytest.approx(np.median(sink[column]))
        assert low <= est <= high < 0  # planted: every sink head is anti-aligned
    rho, low, high = SC.triple(claims, "rho_semantic")
    assert rho == pytest.approx(stats.spearmanr(aa["sink_rate"], aa["cos_semantic_mean"]).statistic)
    assert high < 0
    # pooled share of shortened outputs over the sink heads' queries with s_sq > 0, naively
    rate = dict(zip(zip(fits["layer"], fits["head"]), fits["sink_rate"]))
    keep = [rate[(l, h)] > eps and s > 0 for l, h, s in zip(points["layer"], points["head"], points["s_sq"])]
    chosen = points[keep]
    est, low, high = SC.triple(claims, "shortened")
    assert est == pytest.approx(np.mean(chosen["norm"] < np.sqrt(chosen["s_sq"])))
    assert low < est < high
    fitted = fits[fits["fitted"]]
    for key, column in (("share_interior", "interior_minimum"), ("share_in_range", "minimum_in_range")):
        # per-head shares resample whole layers (cluster bootstrap, tested against a naive resampling in
        # test_sink_intervals.py); the estimate is the plain share of fitted heads
        k, n = int(fitted[column].sum()), len(fitted)
        est, low, high = SC.triple(claims, key)
        pooled = intervals.pooled_by_layer(fitted.assign(layer_type="global"), column, statistic="share",
                                           n_resamples=400, seed=1)
        row = pooled[pooled["scope"] == "all"].iloc[0]
        assert est == pytest.approx(k / n) and (low, high) == pytest.approx((row["low"], row["high"]), abs=1e-9)
        assert low < est < high
    verdicts = SC.claim_verdicts(claims)
    assert verdicts[SC.ANTI_ALIGNMENT] == "holds" and verdicts[SC.TREND] == "holds"
    for _, r in claims.iterrows():
        assert r["verdict"] == sinks.verdict(r["low"], r["high"], threshold=r["threshold"], side=r["side"])
    # deterministic for a seed
    assert claims.equals(SC.suppressor_claims(aa, fits, points, eps, n_resamples=400, seed=1))


def test_paired_contrast_collapses_when_the_difference_is_constant():
    rng = np.random.default_rng(0)
    base = pd.DataFrame({"sequence": np.repeat(np.arange(8), 5), "x": rng.normal(size=40)})
    points = pd.concat([base.assign(group="a", x=base["x"] + 1.0), base.assign(group="b")], ignore_index=True)
    boot = cstats.cluster_bootstrap(points, "x", "group", n_resamples=300, seed=0)
    est, low, high = SC.contrast(boot, "x", {"group": "a"}, {"group": "b"})
    assert (est, low, high) == pytest.approx((1.0, 1.0, 1.0))
    assert SC.group_value(boot, "x", group="b")[0] == pytest.approx(base["x"].mean())
    assert all(np.isnan(SC.contrast(boot, "x", {"group": "a"}, {"group": "zzz"})))


def test_perplexity_changes_are_token_weighted_and_paired():
    rng = np.random.default_rng(0)
    n_tokens = rng.integers(20, 60, 10)
    clean = rng.uniform(1.5, 3.0, 10) * n_tokens  # summed NLL per sequence
    seqs = pd.DataFrame({"sequence": np.arange(10), "n_tokens": n_tokens, "nll_clean": clean,
                         "nll_sink": clean + 0.5 * n_tokens, "nll_sink_renorm": clean + 0.1 * n_tokens,
                         "nll_control": clean + rng.uniform(0, 0.05, 10) * n_tokens,
                         "nll_control_mass": clean + 0.7 * n_tokens})
    changes = SC.perplexity_changes(seqs, n_resamples=300, seed=0)
    mean_clean = clean.sum() / n_tokens.sum()
    assert changes.ppl["clean"][0] == pytest.approx(np.exp(mean_clean))
    assert changes.delta_log["sink"] == pytest.approx((0.5, 0.5, 0.5))  # paired: every resample gives 0.5
    assert changes.delta_ppl["sink"][0] == pytest.approx(np.exp(mean_clean + 0.5) - np.exp(mean_clean))
    control = seqs["nll_control"].sum() / n_tokens.sum() - mean_clean
    est, low, high = changes.sink_minus_control
    assert est == pytest.approx(0.5 - control) and low <= est <= high
    assert changes.sink_minus_mass == pytest.approx((-0.2, -0.2, -0.2))  # paired: a constant difference


def test_all_claims_on_the_planted_model_match_its_raw_points():
    """On 24 tokens the control's keys (19, 12, 22, 12) lay past every lowest-norm output, so the control
    contrast was NaN on both sides (nan_ok) and could not fail. On 16 tokens the control reaches them (the
    control: its lowest-bin delta_cos is finite) and the contrast is compared without nan_ok."""
    model = planted_model()
    ids = planted_ids(n=4, length=16)
    results = sinks.run_analyses(model, None, ids, sinks.ANALYSES, batch_size=2, raw=True, **FAST)
    claims = SC.all_claims(results, eps=0.3, quantiles=5, n_resamples=200, seed=0)
    assert set(claims["chapter"]) == {5, 6, 7}
    # every chapter's claims are gathered (chapter 6's modules add further readings of their own)
    assert {SC.SINK_RATES, SC.DECOMPOSITION, SC.ANTI_ALIGNMENT, SC.TREND, SC.SUPPRESSION, SC.CONVEXITY, SC.CONE,
            SC.PERPLEXITY, SC.DRIFT} <= set(claims["claim"])
    points = sinks.cone_points(results["raw"]["semantic_cone"], quantiles=5)
    lowest = points[points["quantile"] == 1]
    naive = lowest.loc[lowest["condition"] == "sink", "delta_cos"].mean()
    # the raw points are float32; the claims pool them in float64
    assert SC.triple(claims, "dcos_sink_q1")[0] == pytest.approx(naive, abs=1e-6)
    control = lowest.loc[lowest["condition"] == "control", "delta_cos"].mean()
    # removing a tail key of the planted model turns the output towards v0, off the tail's axis: below 0
    assert np.isfinite(control) and control < -1e-3
    assert SC.triple(claims, "dcos_sink_minus_control")[0] == pytest.approx(naive - control, abs=1e-6)
    seqs = results["raw"]["semantic_cone"]["sequences"]
    dlog = (seqs["nll_sink"].sum() - seqs["nll_clean"].sum()) / seqs["n_tokens"].sum()
    assert SC.triple(claims, "dlog_sink")[0] == pytest.approx(dlog, rel=1e-6)
    # planted head 0: the sink value is exactly anti-parallel to the tail values
    assert SC.triple(claims, "cos_value")[0] < 0
    shown = SC.display(claims)
    assert len(shown) == len(claims) and shown["95% interval"].str.contains(" to ").all()


def test_tail_parts_need_a_share_above_the_margin_and_book_claims_are_labelled():
    from cwcore.sinks.decomposition import TAIL_MARGIN, _claim_rows, head_shares
    rates, summary = decomposition_inputs()
    heads = head_shares(rates, summary)

    def joint(alpha, cosine):
        rows = []
        for cls in ("sink", "tail"):
            row = {"group": "sink_heads", "layer_type": "all", "token_class": cls, "n_sequences": 10}
            for m, (e, lo, hi) in (("share_alpha", alpha), ("share_cosine", cosine),
                                   ("share_alpha_cosine", (0.8, 0.7, 0.9)), ("geometry_minus_alpha", (0.2, 0.1, 0.3))):
                row.update({m: e, f"{m}_low": lo, f"{m}_high": hi})
            rows.append(row)
        return pd.DataFrame(rows)

    # alignment's share is positive, with an interval above zero, but below the margin: not "driving" the tail
    rows = pd.DataFrame(_claim_rows(heads, 0.3, joint((0.7, 0.6, 0.8), (0.05, 0.03, 0.07)))).set_index("key")
    assert TAIL_MARGIN == 0.1
    assert rows.loc["tail_cosine_share", "threshold"] == TAIL_MARGIN
    assert rows.loc["tail_cosine_share", "verdict"] == "contradicted"
    assert rows.loc["tail_alpha_share", "verdict"] == "holds"
    rows = pd.DataFrame(_claim_rows(heads, 0.3, joint((0.7, 0.6, 0.8), (0.12, 0.08, 0.16)))).set_index("key")
    assert rows.loc["tail_cosine_share", "verdict"] == "inconclusive"
    # whose claim: the book's own claims are labelled as such
    assert rows.loc["tail_attention_share", "source"] == "book"
    assert (rows.loc[rows["claim"] == SC.DECOMPOSITION, "source"] == "paper").all()
    rates_rows = SC.rate_claims(rates.assign(layer_type="global"), 0.3, n_resamples=100)
    assert set(rates_rows["source"]) == {"book"}
    assert list(SC.display(rates_rows)["claim by"].unique()) == ["the book"]


def test_each_sink_chapter_builds_its_claims_in_one_place_and_the_confirmatory_build_uses_it():
    """chapter_claims is the claims table of chapters 5-7 (the chapters and the confirmatory build both call
    it): here against each chapter's analyses called directly, and the confirmatory tables against it."""
    from cwcore import sinks
    from cwcore.sinks.engine import EPS, REGISTRY
    from cwcore.sinks.intervals import claims_frame
    from cwbook import confirmatory, sink_claims
    from sink_fixtures import FAST, planted_ids, planted_model

    result = sinks.run_analyses(planted_model(), None, planted_ids(), list(sinks.ANALYSES), raw=True, **FAST)
    boot = dict(n_resamples=200, seed=3)
    expected = {
        "05_sink_decomposition": pd.concat([
            sink_claims.rate_claims(result["rates"], EPS.default, **boot),
            sink_claims.decomposition_claims(result["rates"], result["decomposition"].summary, EPS.default,
                                             stats=result["raw"]["decomposition"]["stats"], **boot)],
            ignore_index=True),
        "06_sinks_as_suppressors": claims_frame([row for name in ("anti_alignment", "convexity") for row in
                                                 REGISTRY[name].claims(result, eps=EPS.default, quantiles=5, **boot)]),
        "07_semantic_cone": sink_claims.cone_claims(result["raw"]["semantic_cone"], 3, **boot),
    }
    for chapter, table in expected.items():
        built = sink_claims.chapter_claims(chapter, result, EPS.default, quantiles=3 if chapter == "07_semantic_cone"
                                           else 5, **boot)
        pd.testing.assert_frame_equal(built, table)
        assert len(table) > 0 and table["verdict"].notna().all()
    parameters = {c: {"n_bootstrap": 200, "quantiles": 3, "run_parameters": {"seed": 3}}
                  for c in confirmatory.SINK_CHAPTERS}
    tables = confirmatory.sink_tables({"gsm8k": result}, parameters)
    for chapter, table in expected.items():
        pd.testing.assert_frame_equal(tables[chapter], sink_claims.stack_data({"gsm8k": table}))
    with pytest.raises(ValueError, match="not a sink chapter"):
        sink_claims.chapter_claims("04_faithfulness", result)


def test_claim_verdicts_combine_the_parts_of_each_claim_as_the_chapters_rule_says():
    # cwcore.stats.combine_verdicts, by hand: any contradicted part contradicts the claim; parts not measured
    # are left aside while another part is measured; all holding parts hold; a mix is inconclusive
    H, C, I, N = cstats.HOLDS, cstats.CONTRADICTED, cstats.INCONCLUSIVE, cstats.NOT_MEASURED
    parts = [("a", H), ("a", C), ("b", H), ("b", N), ("c", N), ("d", H), ("d", I), ("e", C), ("e", N)]
    claims = pd.DataFrame(parts, columns=["claim", "verdict"])
    assert SC.claim_verdicts(claims).to_dict() == {"a": C, "b": H, "c": N, "d": I, "e": C}


def test_pooled_suppression_counts_strictly_shorter_outputs_of_heads_strictly_above_eps():
    # head 0 (rate 0.9) is a sink head; head 1 sits exactly at eps = 0.3, so it is not one ("exceeds eps");
    # head 2 is far below. Per sequence, head 0 has one output exactly as long as ||s_i|| (not shortened),
    # one shorter, one longer and one shorter again: 2 of 4 shortened in each of 4 sequences
    eps = 0.3
    fits = pd.DataFrame({"scope": "head", "layer": 0, "head": [0, 1, 2], "sink_rate": [0.9, eps, 0.1]})
    rows = []
    for sequence in range(4):
        rows += [{"sequence": sequence, "layer": 0, "head": 0, "norm": n, "s_sq": s}
                 for n, s in ((1.0, 1.0), (0.5, 1.0), (2.0, 1.0), (0.25, 0.25))]
        rows += [{"sequence": sequence, "layer": 0, "head": h, "norm": 0.1, "s_sq": 1.0} for h in (1, 2)]
    share, low, high = SC.pooled_suppression(fits, pd.DataFrame(rows), eps=eps, n_resamples=200, seed=0)
    # every sequence holds the same share: the bootstrap over sequences collapses onto it
    assert (share, low, high) == pytest.approx((0.5, 0.5, 0.5))
