"""A model without sink heads: the sink claims say "not measured" and why, never raise, never excuse a
measured part. The same inputs as test_sink_claims, with every sink rate pushed below eps."""

import numpy as np
import pandas as pd
import pytest

from cwbook import findings
from cwbook import sink_claims as SC
from test_sink_claims import decomposition_inputs, suppressor_inputs

WHY = "no sink heads at eps=0.3"


def without_sinks(frame: pd.DataFrame) -> pd.DataFrame:
    frame = frame.copy()
    if "sink_rate" in frame:
        frame["sink_rate"] = frame["sink_rate"] * 0.25  # all below 0.3
    if "is_sink_head" in frame:
        frame["is_sink_head"] = False
    return frame


def test_claims_over_sink_heads_are_not_measured_with_the_reason():
    rates, summary = decomposition_inputs()
    decomposition = SC.decomposition_claims(without_sinks(rates), summary, 0.3)
    aa, fits, points, eps = suppressor_inputs()
    suppressor = SC.suppressor_claims(without_sinks(aa), without_sinks(fits), points, eps, n_resamples=200)
    claims = pd.concat([decomposition, suppressor], ignore_index=True).set_index("key")
    for key in ("sink_geometry_share", "tail_attention_share", "cos_value", "cos_semantic", "shortened"):
        assert claims.loc[key, "verdict"] == "not measured" and claims.loc[key, "why"] == WHY, key
    # what does not need sink heads is still measured, and a measured part gives no reason
    for key in ("rho_semantic", "share_interior", "share_in_range"):
        assert claims.loc[key, "verdict"] != "not measured" and claims.loc[key, "why"] == "", key
    shown = SC.display(suppressor)
    assert f"not measured: {WHY}" in list(shown["verdict"])
    assert set(shown["verdict"]) - {f"not measured: {WHY}"} <= {"holds", "contradicted", "inconclusive"}


def test_with_sink_heads_nothing_is_excused():
    aa, fits, points, eps = suppressor_inputs()
    claims = SC.suppressor_claims(aa, fits, points, eps, n_resamples=200)
    assert (claims["why"] == "").all() and (claims["verdict"] != "not measured").all()
    assert list(SC.display(claims)["verdict"]) == list(claims["verdict"])


def test_a_part_without_an_interval_says_so_even_without_a_reason():
    fits = pd.DataFrame({"scope": "head", "layer": [0], "head": [0], "sink_rate": [0.9], "is_sink_head": [True],
                         "fitted": [False], "interior_minimum": [False], "minimum_in_range": [False]})
    points = pd.DataFrame({"sequence": [0, 0], "layer": [0, 0], "head": [0, 0], "norm": [1.0, 2.0],
                           "s_sq": [1.0, 1.0]})
    aa = pd.DataFrame({"layer": [0], "head": [0], "sink_rate": [0.9], "is_sink_head": [True],
                       "cos_value_mean": [-0.5], "cos_semantic_mean": [-0.4]})
    claims = SC.suppressor_claims(aa, fits, points, 0.3, n_resamples=50).set_index("key")
    assert claims.loc["share_interior", "verdict"] == "not measured"
    assert "none of 1 fitted" in claims.loc["share_interior", "why"]


def test_the_findings_page_repeats_the_reason():
    aa, fits, points, eps = suppressor_inputs()
    claims = SC.suppressor_claims(without_sinks(aa), without_sinks(fits), points, eps, n_resamples=200)
    keys = [k for k, names in findings.CHAPTER_CLAIMS.items() if SC.SUPPRESSION in names]
    finding = findings.from_claims(keys[0], claims)
    assert finding.verdict == "not measured"
    assert f"not measured: {WHY}" in finding.measured
    # a table written before the `why` column existed still reads
    old = claims.drop(columns="why")
    assert findings.from_claims(keys[0], old).verdict == "not measured"
    assert np.isnan(SC.triple(claims, "shortened")[0])


def test_claim_verdict_texts_give_the_reason_of_an_unmeasured_claim():
    aa, fits, points, eps = suppressor_inputs()
    plain = SC.suppressor_claims(aa, fits, points, eps, n_resamples=200)
    assert SC.claim_verdict_texts(plain).equals(SC.claim_verdicts(plain).rename("verdict"))
    claims = SC.suppressor_claims(without_sinks(aa), without_sinks(fits), points, eps, n_resamples=200)
    texts, verdicts = SC.claim_verdict_texts(claims), SC.claim_verdicts(claims)
    assert texts[SC.ANTI_ALIGNMENT] == f"not measured: {WHY}" and texts[SC.SUPPRESSION] == f"not measured: {WHY}"
    assert texts[f"{SC.CONVEXITY} [per head]"] == verdicts[f"{SC.CONVEXITY} [per head]"] != "not measured"  # measured: no reason added


def test_a_degenerate_interval_is_nan_without_a_warning_on_the_page():
    """The test's four pairs are fewer than stats.MIN_CLUSTERS, so spearman_ci returned before the bootstrap
    whose warnings it claimed to silence, and its estimate was compared with a second call of itself. Now: the
    four pairs have no interval by that rule, and seven tied pairs reach the bootstrap, where a third of the
    resamples hold x constant (rho undefined): scipy's own percentile interval is NaN there (the control),
    spearman_ci leaves those resamples out, as documented, without a warning. The estimates are scipy's
    spearmanr, computed here."""
    import warnings

    from scipy import stats as scipy_stats

    from cwcore import stats

    x, y = np.array([0.1, 0.1, 0.2, 0.1]), np.array([1.0, 2.0, 3.0, 4.0])  # four heads, three alike
    assert len(x) < stats.MIN_CLUSTERS
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = stats.spearman_ci(x, y, n_resamples=100, seed=0)
    assert np.isnan(got.low) and np.isnan(got.high)
    assert got.estimate == pytest.approx(scipy_stats.spearmanr(x, y).statistic, abs=1e-12)
    from cwcore.sinks.intervals import claim_row

    row = claim_row(6, "c", "p", "s", "k", got, 0.0, "below", 4)
    assert row["verdict"] == "not measured" and row["why"] == "too few values for an interval (n=4)"
    # seven pairs, six alike: a resample misses the odd x with probability (6/7)^7 = 0.34
    x, y = np.array([0.1] * 6 + [0.2]), np.arange(1.0, 8.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = scipy_stats.bootstrap((x, y), lambda a, b: scipy_stats.spearmanr(a, b).statistic, paired=True,
                                      vectorized=False, n_resamples=200, method="percentile",
                                      rng=np.random.default_rng(0)).confidence_interval
    assert np.isnan(plain.low) or np.isnan(plain.high)  # the control: the constant resamples poison scipy's interval
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = stats.spearman_ci(x, y, n_resamples=200, seed=0)
    assert got.estimate == pytest.approx(scipy_stats.spearmanr(x, y).statistic, abs=1e-12)
    assert np.isfinite(got.low) and np.isfinite(got.high) and -1 <= got.low <= got.high <= 1


def test_a_model_without_sink_heads_runs_every_claim_of_chapters_5_and_7():
    """A tiny random Llama has no head above eps = 0.3: chapters 5 and 7's claims (the sink-head parts of
    the decomposition, the cone restricted to sink heads, the drift curve) must say "not measured" and
    why, never raise; what needs no sink head is still measured."""
    import torch

    from cwcore import sinks
    from sink_fixtures import FAST
    from tiny_models import VOCAB, tiny_model

    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(3))
    results = sinks.run_analyses(model, None, ids, ["rates", "decomposition", "semantic_cone"], heads="sink",
                                 threshold=0.3, raw=True, batch_size=2, **FAST)
    assert not (results["rates"]["sink_rate"] > 0.3).any()
    rates = SC.rate_claims(results["rates"], 0.3, n_resamples=100).set_index("key")
    assert rates.loc["sink_eps", "estimate"] == 0 and rates.loc["sink_eps", "verdict"] == "contradicted"
    # two layers are too few to resample (cwcore.stats.MIN_CLUSTERS): not measured, and why
    assert rates.loc["sink_eps_by_layer", "verdict"] == "not measured"
    assert rates.loc["sink_eps_by_layer", "why"].startswith("2 layers, too few to resample")
    raw = results["raw"]
    decomposition = SC.decomposition_claims(results["rates"], results["decomposition"].summary, 0.3,
                                            stats=raw["decomposition"]["stats"], n_resamples=100).set_index("key")
    for key in ("sink_geometry_share", "sink_geometry_margin_by_layer", "sink_geometry_pooled", "tail_joint_share",
                "tail_alpha_share", "tail_cosine_share"):
        assert decomposition.loc[key, "verdict"] == "not measured", key
        assert decomposition.loc[key, "why"] == WHY, key
    cone = SC.cone_claims(raw["semantic_cone"], 5, n_resamples=100).set_index("key")
    intervened = cone[cone["claim"] != SC.DRIFT]
    assert (intervened["verdict"] == "not measured").all()  # nothing was intervened on, and it says so
    assert intervened["why"].str.startswith("no head intervened on").all()
    drift = cone[cone["claim"] == SC.DRIFT]  # measured on the clean pass, whatever was intervened on
    assert len(drift) == 4 and (drift["verdict"] != "not measured").all() and (drift["why"] == "").all()  # with the null
    text = SC.claim_verdict_texts(SC.decomposition_claims(results["rates"], results["decomposition"].summary, 0.3))
    assert text[SC.DECOMPOSITION] == f"not measured: {WHY}"
