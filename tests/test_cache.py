import os
from pathlib import Path

import pandas as pd
import pytest

from cwcore.cache import ResultCache, atomic_write_bytes, parameters_key


def test_key_depends_on_every_parameter_and_not_on_order():
    base = {"model": "m", "ratios": [0.1, 0.2], "seed": 0}
    assert parameters_key(base) == parameters_key(dict(reversed(list(base.items()))))
    for changed in ({"model": "n"}, {"ratios": [0.1, 0.3]}, {"seed": 1}):
        assert parameters_key({**base, **changed}) != parameters_key(base)


def test_pieces_round_trip_and_compute_once(tmp_path):
    cache = ResultCache("demo", {"a": 1}, root=tmp_path)
    calls = []

    def compute():
        calls.append(1)
        return pd.DataFrame({"x": [1.5, 2.5]})

    first = cache.get_or_compute("piece", compute)
    again = ResultCache("demo", {"a": 1}, root=tmp_path).get_or_compute("piece", compute)
    pd.testing.assert_frame_equal(first, again)
    assert len(calls) == 1
    assert ResultCache("demo", {"a": 2}, root=tmp_path).get("piece") is None


def test_interrupted_write_leaves_no_piece(tmp_path, monkeypatch):
    target = tmp_path / "out.parquet"

    def failing_replace(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(target, b"data")
    assert list(tmp_path.iterdir()) == []
