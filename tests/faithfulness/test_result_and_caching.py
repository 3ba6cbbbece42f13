"""faithfulness_curve's result object, its refusal of the removed keywords, and caching as an opt-in."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd
import pytest

from cwcore import cache
from cwcore import faithfulness as fa
from cwcore.faithfulness import sweep as sweep_module

OPTIONS = dict(metric=["attention", "contribution", "random"], ratios=[0.2, 0.5], batch_size=5, progress=False,
               n_bootstrap=50)


def _files(root):
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


@pytest.fixture
def points(monkeypatch):
    """Every computed (metric, mode, ratio) point of a batch (a read piece is not computed)."""
    seen = []
    original = sweep_module.Sweep._point
    monkeypatch.setattr(sweep_module.Sweep, "_point", lambda self, *a, **k: seen.append(1) or original(self, *a, **k))
    return seen


def test_outside_caching_nothing_is_written_inside_pieces_are_and_a_rerun_computes_nothing(peaked, tmp_path,
                                                                                         monkeypatch, points):
    model, ids = peaked
    root = tmp_path / "cache"
    monkeypatch.setenv("CWCORE_CACHE", str(root))
    monkeypatch.delenv("CWCORE_CACHING", raising=False)
    monkeypatch.delenv("CWCORE_NO_CACHE", raising=False)
    plain = fa.faithfulness_curve(model, None, ids, **OPTIONS)
    assert not root.exists()  # nothing read or written outside caching()
    n_points = 2 * 3 * 2 * 2  # batches x metrics x modes x ratios, less the deduplicated rungs
    computed = len(points)
    assert 0 < computed <= n_points
    points.clear()
    with cache.caching():  # the default folder: $CWCORE_CACHE
        first = fa.faithfulness_curve(model, None, ids, **OPTIONS)
    assert len(points) == computed
    written = _files(root)
    assert any(name.endswith("-clean.parquet") for name in written)
    assert sum(name.endswith(".parquet") for name in written) == 2 + n_points  # two clean pieces + every point
    points.clear()
    with cache.caching():
        again = fa.faithfulness_curve(model, None, ids, **OPTIONS)
    assert points == [] and _files(root) == written  # everything read back, nothing new
    for other in (first, again):
        pd.testing.assert_frame_equal(other.per_sequence, plain.per_sequence, check_exact=True)
    # a folder of one's own; enabled=False inside a caching block; $CWCORE_NO_CACHE wins over the block
    own = tmp_path / "own"
    with cache.caching(own):
        fa.faithfulness_curve(model, None, ids[:5], **OPTIONS)
    assert (own / "results" / "faithfulness").is_dir()
    points.clear()
    with cache.caching(), cache.caching(enabled=False):
        fa.faithfulness_curve(model, None, ids, **OPTIONS)
    assert len(points) == computed
    points.clear()
    monkeypatch.setenv("CWCORE_NO_CACHE", "1")
    with cache.caching():
        fa.faithfulness_curve(model, None, ids, **OPTIONS)
    assert len(points) == computed and _files(root) == written


def test_caching_env_var_turns_caching_on_outside_every_block(peaked, tmp_path, monkeypatch, points):
    model, ids = peaked
    monkeypatch.setenv("CWCORE_CACHE", str(tmp_path))
    monkeypatch.delenv("CWCORE_NO_CACHE", raising=False)
    monkeypatch.setenv("CWCORE_CACHING", "1")
    assert cache.caching_enabled()
    with cache.caching(enabled=False):
        assert not cache.caching_enabled()
    fa.faithfulness_curve(model, None, ids[:5], **OPTIONS)
    assert (tmp_path / "results" / "faithfulness").is_dir()
    monkeypatch.setenv("CWCORE_CACHING", "0")
    assert not cache.caching_enabled()


@pytest.mark.parametrize("keyword, value, hint", [
    ("cache", True, "cwcore.cache.caching"), ("cache_dir", "somewhere", "cwcore.cache.caching"),
    ("per_sequence", True, ".per_sequence"), ("first_sequence", 3, "sequence_ids"),
])
def test_a_removed_keyword_is_refused_in_one_line_naming_it(peaked, keyword, value, hint):
    model, ids = peaked
    with pytest.raises(TypeError) as caught:
        fa.faithfulness_curve(model, None, ids, **{keyword: value})
    message = str(caught.value)
    assert f"unexpected keyword argument {keyword!r}" in message and hint in message and "\n" not in message
    with pytest.raises(TypeError, match=f"'{keyword}'"):
        fa.downstream_eval(model, None, "boolq", **{keyword: value})


def test_an_unknown_keyword_is_refused_naming_it(peaked):
    model, ids = peaked
    with pytest.raises(TypeError, match="'caches'"):
        fa.faithfulness_curve(model, None, ids, caches=True)


def test_the_result_summarises_and_reads_like_its_table(peaked):
    model, ids = peaked
    result = fa.faithfulness_curve(model, None, ids, **OPTIONS)
    per = result.per_sequence
    assert len(per) == len(ids) * 3 * 2 * 2 and {"sequence", "nll", "clean_nll", "document"} <= set(per.columns)
    pd.testing.assert_frame_equal(result.table, fa.summarize(per, n_bootstrap=50), check_exact=True)
    pd.testing.assert_frame_equal(result.summary(), fa.aopc(per, n_bootstrap=50), check_exact=True)
    pd.testing.assert_frame_equal(result.summary(max_ratio=0.2), fa.aopc(per, n_bootstrap=50, max_ratio=0.2),
                                  check_exact=True)
    # the result itself reads as its per-sequence table (before: AttributeError "... has no attribute 'groupby'"),
    # so the intervals stay bootstraps over documents; anything else is refused in one line
    pd.testing.assert_frame_equal(fa.aopc(result, n_bootstrap=50), result.summary(), check_exact=True)
    pd.testing.assert_frame_equal(fa.summarize(result, n_bootstrap=50), result.table, check_exact=True)
    assert fa.aopc(result, n_bootstrap=50)["aopc_nll_ci_low"].notna().all()
    pd.testing.assert_frame_equal(fa.ladder_comparison(result, n_bootstrap=50), fa.ladder_comparison(per, n_bootstrap=50))
    with pytest.raises(TypeError, match=r"^aopc: expected a faithfulness_curve result or its per_sequence DataFrame, "
                                        r"got list$"):
        fa.aopc([1, 2])
    # for one release: column access, len and columns are the table's
    pd.testing.assert_series_equal(result["delta_nll"], result.table["delta_nll"])
    assert len(result) == len(result.table) == 3 * 2 * 2 and list(result.columns) == list(result.table.columns)
    assert repr(result).startswith("FaithfulnessResult(3 metrics x 2 modes x 2 ratios over 10 sequences")
    axes = result.plot()
    assert [ax.get_title() for ax in axes] == ["comprehensiveness", "sufficiency"]
    lines = axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["attention", "contribution", "random"]
    contribution = result.table.query("mode == 'comprehensiveness' and metric == 'contribution'").sort_values("ratio")
    assert list(lines[1].get_ydata()) == list(contribution["delta_nll"])
    # every axis label inside the figure (before: "removed ratio" began 3.9 px below its bottom edge, cut off)
    figure = axes[0].figure
    figure.canvas.draw()
    renderer, (width, height) = figure.canvas.get_renderer(), figure.canvas.get_width_height()
    for ax in axes:
        for label in (ax.xaxis.label, ax.yaxis.label):
            box = label.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, (label.get_text(), box)


def test_sequence_ids_seed_the_random_control_and_a_slice_gives_the_whole_runs_rows(peaked):
    model, ids = peaked
    options = {**OPTIONS, "metric": ["random", "contribution"]}
    whole = fa.faithfulness_curve(model, None, ids, **options).per_sequence
    part = fa.faithfulness_curve(model, None, ids[5:], sequence_ids=range(5, 10), **options).per_sequence
    expected = whole[whole["sequence"] >= 5].reset_index(drop=True)
    pd.testing.assert_frame_equal(part, expected, check_exact=True)
    renumbered = fa.faithfulness_curve(model, None, ids[5:], **options).per_sequence
    random = lambda table: table[table["metric"] == "random"]["nll"].to_numpy()  # noqa: E731
    assert list(random(renumbered)) != list(random(part))  # other ids: another random control
    for bad, error in (([1, 1, 2, 3, 4], ValueError), ([0, 1], ValueError), ([-1, 1, 2, 3, 4], ValueError),
                       ("01234", TypeError)):
        with pytest.raises(error, match="sequence_ids"):
            fa.faithfulness_curve(model, None, ids[5:], sequence_ids=bad, **options)


@pytest.mark.parametrize("layers, same", [(0, [0]), (-1, [1]), ([-2, 1], [0, 1])])
def test_a_layer_number_and_negative_layers_are_read_as_the_check_reads_them(peaked, layers, same):
    model, ids = peaked  # two layers; before, an int raised "'int' object is not iterable" and -1 an IndexError
    options = {**OPTIONS, "metric": ["contribution"], "ratios": [0.3]}
    got = fa.faithfulness_curve(model, None, ids[:4], layers=layers, **options).per_sequence
    want = fa.faithfulness_curve(model, None, ids[:4], layers=same, **options).per_sequence
    pd.testing.assert_frame_equal(got, want, check_exact=True)


def test_a_metric_reading_a_value_of_the_users_module_recomputes_when_it_changes(peaked, tmp_path, monkeypatch,
                                                                                   points):
    """`settings.SIGN` read through an imported module of the user's own is in the key like a global of the
    metric's module: the curve cached for SIGN = 1 is not served once SIGN = -1 (it was, before)."""
    import importlib

    (tmp_path / "fault_settings.py").write_text("SIGN = 1.0\n")
    (tmp_path / "fault_metric.py").write_text(
        "import fault_settings\n\n\ndef signed_attention(layer_decomposition, **context):\n"
        "    return layer_decomposition.attention * fault_settings.SIGN\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings, metric = importlib.import_module("fault_settings"), importlib.import_module("fault_metric")
    model, ids = peaked
    options = dict(ratios=[0.3], batch_size=4, progress=False, n_bootstrap=10)
    with cache.caching(tmp_path / "cache"):
        fa.faithfulness_curve(model, None, ids[:4], {"mine": metric.signed_attention}, **options)
        assert len(points) == 2
        points.clear()
        monkeypatch.setattr(settings, "SIGN", -1.0)
        cached = fa.faithfulness_curve(model, None, ids[:4], {"mine": metric.signed_attention}, **options)
    assert len(points) == 2  # computed again, not served
    fresh = fa.faithfulness_curve(model, None, ids[:4], {"mine": metric.signed_attention}, **options)
    pd.testing.assert_frame_equal(cached.per_sequence, fresh.per_sequence, check_exact=True)


def _signed_attention(layer_decomposition, sign=1.0, **context):
    return layer_decomposition.attention * sign


def test_partial_metrics_with_other_bound_arguments_are_not_served_each_others_curves(peaked, tmp_path, points):
    """functools.partial(metric, sign=-1.0) after partial(metric, sign=1.0): its bound arguments are in the key
    (both had one key, so the second was served the first's curve, reversed ranking and all)."""
    import functools

    model, ids = peaked
    options = dict(ratios=[0.3], batch_size=4, progress=False, n_bootstrap=10)
    with cache.caching(tmp_path):
        fa.faithfulness_curve(model, None, ids[:4], {"m": functools.partial(_signed_attention, sign=1.0)}, **options)
        points.clear()
        cached = fa.faithfulness_curve(model, None, ids[:4], {"m": functools.partial(_signed_attention, sign=-1.0)},
                                       **options)
        assert len(points) == 2  # computed, not served
        points.clear()
        again = fa.faithfulness_curve(model, None, ids[:4], {"m": functools.partial(_signed_attention, sign=-1.0)},
                                      **options)
        assert points == []  # an equal partial is served
    fresh = fa.faithfulness_curve(model, None, ids[:4], {"m": functools.partial(_signed_attention, sign=-1.0)},
                                  **options)
    for other in (cached, again):
        pd.testing.assert_frame_equal(other.per_sequence, fresh.per_sequence, check_exact=True)


def test_two_ratios_equal_to_six_digits_are_two_pieces(peaked, tmp_path):
    """Ratios 2e-9 apart around 369/1224 remove 1464 and 1472 terms of these two sequences; their pieces were
    both named r0.301471, so a cached rerun served the second ratio's rows for the first."""
    model, ids = peaked
    ratios = [369 / 1224 - 1e-9, 369 / 1224 + 1e-9]
    options = dict(metric="attention", ratios=ratios, batch_size=2, progress=False, n_bootstrap=10)
    fresh = fa.faithfulness_curve(model, None, ids[:2], **options).per_sequence
    assert fresh.groupby("ratio")["n_removed"].sum().tolist() == [1464, 1472]
    for _ in range(2):  # computed and stored, then read back
        with cache.caching(tmp_path):
            cached = fa.faithfulness_curve(model, None, ids[:2], **options).per_sequence
    pd.testing.assert_frame_equal(cached, fresh, check_exact=True)


def test_max_length_truncates_text_and_is_refused_for_longer_token_sequences(peaked):
    """max_length cuts text. Token input is taken whole: without max_length, with None or with one at least as
    long the rows are the same; a max_length shorter than the sequences is refused. Before, max_length=5 on
    sequences of ids[:, :12] was ignored without a word (n_tokens stayed 11)."""
    from cwcore.faithfulness.layers import per_layer_curve
    from faith_helpers import word_tokenizer

    model, ids = peaked
    ids = ids[:6, :12]
    options = dict(metric=["contribution"], ratios=[0.2], mode="comprehensiveness", progress=False, n_bootstrap=20)
    plain = fa.faithfulness_curve(model, None, ids, **options).per_sequence
    assert (plain["n_tokens"] == 11).all()
    for max_length in (None, 12, 500):
        pd.testing.assert_frame_equal(fa.faithfulness_curve(model, None, ids, max_length=max_length, **options)
                                      .per_sequence, plain)
    for tokens in (ids, {"input_ids": ids}):
        with pytest.raises(ValueError, match=r"^max_length=5 truncates text; these sequences are already tokenised, "
                                             r"up to 12 tokens"):
            fa.faithfulness_curve(model, None, tokens, max_length=5, **options)
    with pytest.raises(ValueError, match="max_length=5 truncates text"):
        per_layer_curve(model, None, ids, max_length=5, layers=[0], metric=["contribution"], ratios=[0.2])
    # text: truncated to max_length tokens
    tokenizer, text = word_tokenizer(), " ".join(f"w{i % 20}" for i in range(40))
    short = fa.faithfulness_curve(model, tokenizer, [text, text], max_length=7, **options).per_sequence
    assert (short["n_tokens"] == 6).all()


def test_a_registered_methods_code_is_in_the_key(peaked, tmp_path, monkeypatch):
    """A method the user registers by name in a module of their own, run cached, then edited (its sign flipped)
    and run again: before, its pieces were named by the name alone, so the edited method was served the old
    curve. cwcore's own methods are covered by the package's code hash; a user's are keyed by their code and
    what they read. The reference: the same call outside the cache."""
    import importlib

    from cwcore.faithfulness.methods import _REGISTRY

    source = ("from cwcore.faithfulness import register_method\n\n\n@register_method('audit_user_method')\n"
              "def audit_user_method(layer_decomposition, **context):\n    return SIGN * layer_decomposition.attention\n")
    (tmp_path / "user_methods.py").write_text("SIGN = 1.0\n" + source)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, ids = peaked
    options = dict(ratios=[0.3], batch_size=4, progress=False, n_bootstrap=10)
    try:
        module = importlib.import_module("user_methods")
        with cache.caching(tmp_path / "cache"):
            first = fa.faithfulness_curve(model, None, ids[:4], "audit_user_method", **options)
            (tmp_path / "user_methods.py").write_text("SIGN = -1.0\n" + source)
            importlib.reload(module)
            cached = fa.faithfulness_curve(model, None, ids[:4], "audit_user_method", **options)
        fresh = fa.faithfulness_curve(model, None, ids[:4], "audit_user_method", **options)
    finally:
        _REGISTRY.pop("audit_user_method", None)
    assert not first.per_sequence["nll"].equals(fresh.per_sequence["nll"])  # the control: the edit matters
    pd.testing.assert_frame_equal(cached.per_sequence, fresh.per_sequence, check_exact=True)


class _Settings:
    SIGN = 1.0

    def signed(self, layer_decomposition, **context):
        return layer_decomposition.attention * self.SIGN


def _by_class_attribute(layer_decomposition, **context):
    return layer_decomposition.attention * _Settings.SIGN


@pytest.mark.parametrize("metric", [_by_class_attribute, _Settings().signed], ids=["class attribute", "self"])
def test_a_class_attribute_a_metric_reads_is_in_the_key(peaked, tmp_path, monkeypatch, metric):
    """A metric reading a setting kept on a class (``Settings.SIGN``, or through ``self``): before, a class was
    keyed by its name only, so the curve cached for SIGN = 1 was served for SIGN = -1 (a steering hook reading
    its gain from a class was served the unsteered run the same way)."""
    model, ids = peaked
    options = dict(ratios=[0.3], batch_size=4, progress=False, n_bootstrap=10)
    with cache.caching(tmp_path / "cache"):
        first = fa.faithfulness_curve(model, None, ids[:4], {"mine": metric}, **options)
        monkeypatch.setattr(_Settings, "SIGN", -1.0)
        cached = fa.faithfulness_curve(model, None, ids[:4], {"mine": metric}, **options)
    fresh = fa.faithfulness_curve(model, None, ids[:4], {"mine": metric}, **options)
    assert not first.per_sequence["nll"].equals(fresh.per_sequence["nll"])  # the control
    pd.testing.assert_frame_equal(cached.per_sequence, fresh.per_sequence, check_exact=True)


def test_per_layer_curves_key_a_metric_by_what_it_is_not_its_label(peaked, tmp_path):
    """per_layer_curve with ``{"x": "attention"}`` cached, then ``{"x": "contribution"}``: before, its key held
    the label only, so the second call was served the attention curve."""
    from cwcore.faithfulness.layers import per_layer_curve

    model, ids = peaked
    options = dict(ratios=[0.3], mode="comprehensiveness", batch_size=4, layers=[0])
    with cache.caching(tmp_path / "cache"):
        first = per_layer_curve(model, None, ids[:4], {"x": "attention"}, **options)
        cached = per_layer_curve(model, None, ids[:4], {"x": "contribution"}, **options)
    fresh = per_layer_curve(model, None, ids[:4], {"x": "contribution"}, **options)
    assert not first["nll"].equals(fresh["nll"])  # the control
    pd.testing.assert_frame_equal(cached, fresh, check_exact=True)


def test_progress_false_silences_the_bars_of_the_methods_a_sweep_runs(peaked, capsys, monkeypatch):
    """``progress=False`` (the command line's --no-progress) still drew value zeroing's per-layer bars."""
    import torch

    from cwcore.faithfulness.methods import value_zeroing

    model, ids = peaked
    monkeypatch.setattr(value_zeroing, "PROGRESS_PAIRS", 1)  # a bar for every layer, however short
    ids = torch.as_tensor(ids)[:2, :8]
    fa.faithfulness_curve(model, None, ids, metric="value_zeroing", ratios=[0.5], mode="comprehensiveness",
                          batch_size=2, progress=False)
    assert "value zeroing" not in capsys.readouterr().err
    fa.faithfulness_curve(model, None, ids, metric="value_zeroing", ratios=[0.5], mode="comprehensiveness",
                          batch_size=2, progress=True)
    assert "value zeroing" in capsys.readouterr().err  # the control: with progress, they are drawn


def test_a_metric_or_model_without_a_stable_identity_writes_no_piece(peaked, tmp_path, points):
    """Such a metric (or model) gets a fresh key every call, so it is never served: it still wrote every piece
    under that key, a cache that grew with pieces no call could read. Now it reads and writes nothing; the
    control, the same metric with an identity, writes its pieces."""
    import warnings

    from cwcore.cache import CacheWarning

    class Opaque:  # its repr is its address: nothing says whether it changed
        pass

    holder = Opaque()

    def opaque(layer_decomposition, **_):
        return layer_decomposition.attention * (holder is not None)

    def plain(layer_decomposition, **_):
        return layer_decomposition.attention

    model, ids = peaked
    options = dict(ratios=[0.3], batch_size=4, progress=False, n_bootstrap=10)
    root = tmp_path / "cache"
    with cache.caching(root), warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        for _ in range(2):
            unkeyed = fa.faithfulness_curve(model, None, ids[:4], {"mine": opaque}, **options)
    pieces = [name for name in _files(root) if name.endswith(".parquet")]
    assert len(points) == 4 and pieces and all(name.endswith("-clean.parquet") for name in pieces)  # read again
    with cache.caching(root):
        keyed = fa.faithfulness_curve(model, None, ids[:4], {"mine": plain}, **options)
    assert len([name for name in _files(root) if name.endswith(".parquet")]) == len(pieces) + 2
    pd.testing.assert_frame_equal(unkeyed.per_sequence, keyed.per_sequence, check_exact=True)
    other = tmp_path / "model"  # a model whose hook reads such a value: no piece of the run at all
    handle = model.model.layers[0].register_forward_pre_hook(lambda module, args: (holder, args)[1])
    try:
        with cache.caching(other), warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            hooked = fa.faithfulness_curve(model, None, ids[:4], {"mine": plain}, **options)
    finally:
        handle.remove()
    assert not [name for name in _files(other) if name.endswith(".parquet")] if other.exists() else True
    pd.testing.assert_frame_equal(hooked.per_sequence, keyed.per_sequence, check_exact=True)
