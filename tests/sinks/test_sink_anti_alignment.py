"""Anti-alignment of the sink's value (cwcore.sinks.anti_alignment)."""

import numpy as np
import pytest

from cwcore import sinks
from sink_fixtures import (FAST, P_TAIL, Q_SINK, V0, VT, cos as _cos, expected_alpha, naive_run, planted_ids,
                           planted_model, random_ids)
from tiny_models import tiny_model


# -- 3. anti-alignment -----------------------------------------------------------------------------


def test_anti_alignment_recovers_the_planted_cosines():
    model, ids = planted_model(), planted_ids()
    table = sinks.anti_alignment(model, None, ids, **FAST).set_index("head")
    np.testing.assert_allclose(table["sink_rate"], expected_alpha().mean(), atol=1e-5)
    assert table.loc[0, "cos_value_mean"] == pytest.approx(-1.0, abs=1e-5)
    assert table.loc[0, "cos_semantic_mean"] == pytest.approx(-1.0, abs=1e-5)
    assert table.loc[0, "cos_value_frac_negative"] == 1.0
    planted = np.dot(V0, VT) / (np.linalg.norm(V0) * np.linalg.norm(VT))
    for column in ("cos_value_mean", "cos_value_median", "cos_semantic_mean", "cos_axis_mean"):
        assert table.loc[1, column] == pytest.approx(planted, abs=1e-5)
    assert table.loc[0, "relative_sink_value_norm"] == pytest.approx(Q_SINK / P_TAIL, rel=1e-5)
    assert table.loc[1, "sink_value_norm"] == pytest.approx(np.linalg.norm(V0), rel=1e-5)


def test_anti_alignment_matches_naive_cosines():
    model, ids = tiny_model("llama"), random_ids()
    table = sinks.anti_alignment(model, None, ids, batch_size=2, **FAST).set_index(["layer", "head"])
    reference, _ = naive_run(model, ids)
    for l, ref in enumerate(reference):
        v, o, a = ref["values"], ref["outputs"], ref["attention"]
        v0 = v[:, :, :1]
        cos_v = _cos(v0, v)[:, :, 1:]  # [b, h, k-1]
        s = o - a[..., :1] * v0  # [b, h, q, m]
        cos_s = _cos(v0, s)[:, :, 1:]
        axis = v[:, :, 1:].mean(2, keepdim=True)
        np.testing.assert_allclose(table.loc[l, "cos_value_mean"], cos_v.mean((0, 2)), atol=1e-5)
        np.testing.assert_allclose(table.loc[l, "cos_semantic_mean"], cos_s.mean((0, 2)), atol=1e-5)
        np.testing.assert_allclose(table.loc[l, "cos_axis_mean"], _cos(v0, axis)[..., 0].mean(0), atol=1e-5)
        ratio = v0[..., 0, :].norm(dim=-1) / v[:, :, 1:].norm(dim=-1).median(-1).values
        np.testing.assert_allclose(table.loc[l, "relative_sink_value_norm"], ratio.mean(0), rtol=1e-4)
