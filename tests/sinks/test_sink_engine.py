"""The sinks engine: determinism, the shared cache, precompute, the registry and the command line."""

import numpy as np
import pandas as pd
import pytest
import torch

from cwcore import sinks
from cwcore.cache import caching
from cwcore.sinks import engine
from sink_fixtures import FAST, planted_ids, planted_model, random_ids, word_tokenizer as _word_tokenizer
from tiny_models import tiny_model


# -- determinism, cache, batch size ----------------------------------------------------------------


@pytest.mark.slow  # one of the quick tier's slowest
def test_results_are_deterministic_cached_and_batch_size_invariant(tmp_path, monkeypatch):
    model, ids = tiny_model("llama"), random_ids(n=4)
    kwargs = dict(progress=False, batch_size=2)
    with caching(tmp_path):
        first = sinks.run_analyses(model, None, ids, **kwargs)
    second = sinks.run_analyses(model, None, ids, **kwargs)  # outside caching(): computed
    for name in sinks.ANALYSES:
        for a, b in zip(*(r[name] if isinstance(r[name], tuple) else (r[name],) for r in (first, second))):
            pd.testing.assert_frame_equal(a, b)

    def boom(*args, **kwargs):
        raise AssertionError("recomputed instead of reading the cache")

    monkeypatch.setattr(engine, "forward", boom)
    with caching(tmp_path):
        cached = sinks.sink_semantic_cone(model, None, ids, **kwargs)  # the single function reads run_analyses' pieces
    pd.testing.assert_frame_equal(cached.ppl, first["semantic_cone"].ppl)
    monkeypatch.undo()
    other = sinks.sink_decomposition(model, None, ids, batch_size=3, sample_size=50, **FAST)
    pd.testing.assert_frame_equal(other.summary, first["decomposition"].summary, atol=1e-5, rtol=1e-4)
    assert (sinks.model_fingerprint(model) != sinks.model_fingerprint(tiny_model("llama", seed=1)))


def test_every_table_is_the_same_whatever_the_batch_size():
    """cwcore.sinks promises that no result depends on batch_size (random choices are seeded per sequence).
    Before, anti-alignment's random-key baseline was drawn per (layer, batch) and the decomposition's sample
    per joined batch order: their contrast moved by up to 0.1 and the sample shared half its rows between
    batch sizes 1 and 4. Every table of every analysis at batch sizes 1 and 3 (four sequences: batches of 1, and
    of 3 + 1) must agree: exactly for what is drawn, to summation rounding for the rest."""
    model, ids = tiny_model("llama"), random_ids(n=4)
    options = dict(sample_size=40, quantile_sample=30, progress=False)
    one, three = (sinks.run_analyses(model, None, ids, sinks.ANALYSES, batch_size=size, **options) for size in (1, 3))
    for name in sinks.ANALYSES:
        tables = [r[name] if isinstance(r[name], tuple) else (r[name],) for r in (one, three)]
        for a, b in zip(*tables):
            pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-4, atol=1e-6)
    drawn = [r["anti_alignment"]["cos_key_mean"] for r in (one, three)]
    assert drawn[0].equals(drawn[1])
    samples = [r["decomposition"].sample for r in (one, three)]
    assert samples[0][["sequence", "layer", "head", "query", "key"]].equals(
        samples[1][["sequence", "layer", "head", "query", "key"]])


def test_command_line_writes_tables_and_rebuilds_them_from_raw(tmp_path, monkeypatch, capsys):
    import cwcore.data
    import cwcore.models

    texts = [" ".join(f"w{(i * 5 + j) % 20}" for j in range(40)) for i in range(6)]
    loaded = []

    def load(name, dtype=None, device=None):  # the tiny model in the dtype asked for, as load_model does
        loaded.append(dtype)
        return tiny_model("llama", dtype=cwcore.models.resolve_dtype(dtype)), _word_tokenizer()

    monkeypatch.setattr(cwcore.models, "load_model", load)
    monkeypatch.setattr(cwcore.data, "load_dataset", lambda name: texts)
    args = ["--model", "tiny", "--data", "words", "--num-sequences", "3", "--block-size", "12",
            "--add-bos", "yes", "--raw", str(tmp_path / "raw")]
    running = ["--batch-size", "2", "--no-cache"]  # flags of running the model: refused with --from-raw (below)
    assert sinks.main([*args, *running, "--out", str(tmp_path / "a")]) == 0
    written = sorted(p.name for p in (tmp_path / "a").iterdir())
    stems = ["anti_alignment", "convexity", "convexity-curves", "decomposition", "decomposition-sample", "rates",
             "semantic_cone", "semantic_cone-heads", "semantic_cone-ppl", "summary"]
    assert written == sorted(f"sinks_{s}_tiny_words.csv" for s in stems)
    rates = pd.read_csv(tmp_path / "a" / "sinks_rates_tiny_words.csv")
    # documents sampling, --add-bos yes: recorded as True (before: blank, in the rates table and the summary)
    assert rates["add_bos"].eq(True).all() and (rates["first_token_is_bos"] == 1.0).all()
    assert (rates["model"] == "tiny").all()
    summary = pd.read_csv(tmp_path / "a" / "sinks_summary_tiny_words.csv")
    assert {"sink_rate", "decomposition", "anti_alignment", "convexity", "semantic_cone"} <= set(summary["claim"])
    assert loaded == [None] and (summary["dtype"] == "float32").all()
    assert summary["add_bos"].eq(True).all()
    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: pytest.fail("--from-raw must not load the model"))
    assert sinks.main([*args, "--from-raw", "--out", str(tmp_path / "b")]) == 0
    for name in written:
        pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "a" / name), pd.read_csv(tmp_path / "b" / name))
    # nothing runs the model: --device cuda passed on a CPU-only torch, --batch-size and --no-cache read by nothing
    for extra, flags in ((running, "--batch-size, --no-cache apply"), (["--device", "cuda"], "--device applies")):
        assert sinks.main([*args, *extra, "--from-raw", "--out", str(tmp_path / "b2")]) == 2
        assert f"{flags} to running the model, which --from-raw does not" in capsys.readouterr().err
    # a run flag that describes another run is refused, not ignored (before: --block-size 64 rebuilt the
    # 12-token run's tables without a word); the same command with --from-raw appended passed above
    # (before: --kind, --quantile-sample, --heads, --seed, --add-bos and a larger --num-sequences were ignored)
    for flag, value, message in (("--block-size", "64", "holds blocks of 12 tokens"),
                                 ("--sampling", "stream", "was sampled as documents"),
                                 ("--num-sequences", "2", "was made with --num-sequences 3"),
                                 ("--num-sequences", "9", "was made with --num-sequences 3"),
                                 ("--dtype", "bf16", "was computed in float32"),
                                 ("--kind", "inter", "was collected with --kind intra"),
                                 ("--quantile-sample", "8", "was collected with --quantile-sample 128"),
                                 ("--seed", "5", "was collected with --seed 0"),
                                 ("--add-bos", "no", "was made with --add-bos yes")):
        changed = list(args)
        if flag in changed:
            changed[changed.index(flag) + 1] = value
        else:
            changed += [flag, value]
        assert sinks.main([*changed, "--from-raw", "--out", str(tmp_path / "c")]) == 2, flag  # one line
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, flag
    assert sinks.main([*args, "--dtype", "fp32", "--from-raw", "--out", str(tmp_path / "d")]) == 0  # float32's alias
    assert not (tmp_path / "c").exists()
    # --dtype reaches the model, is recorded in the summary and in the raw material for --from-raw
    monkeypatch.setattr(cwcore.models, "load_model", load)
    bf16 = [*args[:-1], str(tmp_path / "raw16"), "--dtype", "bfloat16"]
    assert sinks.main([*bf16, *running, "--analyses", "rates", "--out", str(tmp_path / "e")]) == 0
    assert loaded[-1] == "bfloat16"
    assert (pd.read_csv(tmp_path / "e" / "sinks_summary_tiny_words.csv")["dtype"] == "bfloat16").all()
    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: pytest.fail("--from-raw must not load the model"))
    assert sinks.main([*bf16, "--analyses", "rates", "--from-raw", "--out", str(tmp_path / "f")]) == 0
    pd.testing.assert_frame_equal(pd.read_csv(tmp_path / "e" / "sinks_summary_tiny_words.csv"),
                                  pd.read_csv(tmp_path / "f" / "sinks_summary_tiny_words.csv"))
    # a later run into the same folder replaces the material whole: the earlier run's other analyses are gone, not
    # rebuilt beside the later run's blocks (before: a mixture, labelled with the later run's settings)
    monkeypatch.setattr(cwcore.models, "load_model", load)
    assert sinks.main([*args, *running, "--analyses", "rates", "--out", str(tmp_path / "g")]) == 0
    monkeypatch.setattr(cwcore.models, "load_model", lambda *a, **k: pytest.fail("--from-raw must not load the model"))
    from cwcore.sinks.cli import _load_raw

    with pytest.raises(FileNotFoundError, match="holds rates, not anti_alignment, convexity"):
        _load_raw(tmp_path / "raw" / "tiny_words", ["rates", "anti_alignment", "convexity"])
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["tiny_words"]  # nothing left beside it
    # --seed draws the documents every analysis reads (it was refused with rates alone); no analysis is refused
    monkeypatch.setattr(cwcore.models, "load_model", load)
    assert sinks.main([*args, "--analyses", "rates", "--seed", "5", "--out", str(tmp_path / "h")]) == 0
    assert sinks.main([*args, "--analyses", " , ", "--out", str(tmp_path / "i")]) == 2
    assert "--analyses names none" in capsys.readouterr().err


def test_precompute_fills_the_cache_for_later_calls(tmp_path, monkeypatch):
    model = planted_model()
    ids = planted_ids(n=2, length=16)
    options = dict(batch_size=2, progress=False)
    with caching(tmp_path):
        first = sinks.run_analyses(model, None, ids, ["rates"], precompute=sinks.ANALYSES, **options)
    assert set(first) == {"rates"}  # tables only for what was asked

    def no_forward(*args, **kwargs):
        raise AssertionError("a forward pass ran although the cache was filled")

    monkeypatch.setattr(engine, "forward", no_forward)
    with caching(tmp_path):
        later = sinks.run_analyses(model, None, ids, ["convexity", "semantic_cone"], raw=True, **options)
    assert set(later) == {"convexity", "semantic_cone", "raw"} and set(later["raw"]) == {"convexity", "semantic_cone"}
    monkeypatch.undo()
    fresh = sinks.sink_convexity(model, None, ids, batch_size=2, progress=False)
    pd.testing.assert_frame_equal(later["convexity"].fits, fresh.fits)
    with pytest.raises(ValueError, match="unknown analyses"):
        sinks.run_analyses(model, None, ids, ["rates"], precompute=["nonsense"], **options)


def test_a_new_analysis_is_one_registered_object(monkeypatch):
    """The extension point: an Analysis registered from outside runs through run_analyses, shares the forward
    pass with the built-in ones, and its table agrees with an independent computation (here: sink_rates)."""
    from cwcore.sinks.engine import REGISTRY, Analysis, Collector

    class MeanSink(Collector):
        def __init__(self, *args, **options):
            super().__init__(*args, **options)
            self.rows = []

        def on_layer(self, s):
            mean = s.probs[:, :, 1:, 0].mean(-1).sum(0)  # [head]: summed over the batch's sequences
            self.rows.append(pd.DataFrame({"layer": s.layer, "head": range(len(mean)),
                                           "total": mean.cpu().numpy(), "n": s.probs.shape[0]}))

        def finish(self, logits):
            return {"means": pd.concat(self.rows, ignore_index=True)}

    def tables(parts, blocks, **_):
        sums = parts["means"].groupby(["layer", "head"])[["total", "n"]].sum()
        return (sums["total"] / sums["n"]).rename("mean_sink").reset_index()

    toy = Analysis("toy", MeanSink, tables, stems=("toy",))
    monkeypatch.setitem(REGISTRY, "toy", toy)
    model, ids = tiny_model("llama"), random_ids()
    result = sinks.run_analyses(model, None, ids, ["toy", "rates"], batch_size=2, **FAST)
    np.testing.assert_allclose(result["toy"]["mean_sink"], result["rates"]["sink_rate"], atol=1e-6)
    assert toy.named_tables(result["toy"]).keys() == {"toy"}
    assert "toy" not in sinks.ANALYSES  # the built-in order is fixed at import; the registry is open


# -- options: declared once, checked once, built from the registry ----------------------------------


def test_sink_options_check_eps_and_refuse_unknown_options():
    options = sinks.SinkOptions()
    assert options.eps == engine.EPS.default == 0.3 and options.heads == "all" and options.kind == "intra"
    for bad in (-0.2, 1.5, float("nan"), 0.0, 1.0, "0.3", True):
        with pytest.raises((TypeError, ValueError), match="eps"):
            sinks.SinkOptions(eps=bad)
    with pytest.raises(ValueError, match="heads"):
        sinks.SinkOptions(heads="some")
    with pytest.raises((TypeError, ValueError), match="quantile_sample"):
        sinks.SinkOptions(quantile_sample=0)
    model, ids = planted_model(), planted_ids(n=2, length=8)
    with pytest.raises(TypeError, match="no option 'bins'"):
        sinks.sink_rates(model, None, ids, bins=3, **FAST)  # convexity's option: not silently ignored
    with pytest.raises(TypeError, match="no option 'epsilon'"):
        sinks.run_analyses(model, None, ids, ["rates"], epsilon=0.2, **FAST)
    with pytest.raises(ValueError, match="eps"):
        sinks.run_analyses(model, None, ids, ["rates"], eps=1.5, **FAST)
    # an options object and keywords: the keywords replace its fields
    got = sinks.run_analyses(model, None, ids, ["rates"], sinks.SinkOptions(eps=0.9), eps=0.05, **FAST)["rates"]
    assert (got["eps"] == 0.05).all()
    # every analysis's public function lists its options with their declared defaults
    import inspect
    params = inspect.signature(sinks.sink_semantic_cone).parameters
    assert params["threshold"].default == 0.3 and params["heads"].default == "all" and "eps" not in params
    assert inspect.signature(sinks.sink_rates).parameters["eps"].default == engine.EPS.default


def test_command_line_options_come_from_the_registry(capsys):
    with pytest.raises(SystemExit):
        sinks.main(["--help"])
    text = capsys.readouterr().out
    for name, option in sinks.SinkOptions.OPTIONS.items():  # the run options have the CLI's own flags
        if option.cli:
            assert f"--{name.replace('_', '-')}" in text and option.help[:20] in " ".join(text.split()), name
    assert sinks.main(["--model", "m", "--data", "d", "--eps", "1.5"]) == 2
    assert "eps must be a finite number in (0, 1)" in capsys.readouterr().err


def test_a_new_analysis_declares_its_own_options(monkeypatch):
    from cwcore.sinks.engine import REGISTRY, Analysis, Collector, Option, count, options_class

    class Scaled(Collector):
        def __init__(self, *args, power):
            super().__init__(*args)
            self.power, self.rows = power, []

        def on_layer(self, s):
            self.rows.append(pd.DataFrame({"layer": [s.layer], "value": [float((s.probs[:, :, 1:, 0] ** self.power).mean())]}))

        def finish(self, logits):
            return {"values": pd.concat(self.rows, ignore_index=True)}

    power = Option("power", 1, "exponent of alpha_i0", count("power"))
    toy = Analysis("scaled", Scaled, lambda parts, blocks, **_: parts["values"], stems=("scaled",),
                   options=(power, engine.EPS), collector_options=("power",))
    monkeypatch.setitem(REGISTRY, "scaled", toy)

    @toy.public
    def scaled(model, tokenizer, data, **options) -> pd.DataFrame:
        """Mean alpha_i0 ** power per layer."""

    assert "power" in {f for f in options_class().OPTIONS} and options_class().OPTIONS["eps"] is engine.EPS
    model, ids = tiny_model("llama"), random_ids()
    one, two = (scaled(model, None, ids, power=p, batch_size=8, **FAST) for p in (1, 2))  # one batch: one row a layer
    rates = sinks.sink_rates(model, None, ids, batch_size=2, **FAST)
    np.testing.assert_allclose(one["value"], rates.groupby("layer")["sink_rate"].mean(), atol=1e-6)
    assert (two["value"] < one["value"]).all()
    with pytest.raises((TypeError, ValueError), match="power"):
        scaled(model, None, ids, power=0, **FAST)
    with pytest.raises(ValueError, match="declared twice"):
        monkeypatch.setitem(REGISTRY, "clash", Analysis("clash", Scaled, toy.tables, stems=("c",),
                                                        options=(Option("power", 2, "another"),)))
        options_class()


def test_the_analysis_modules_keep_their_names_and_the_functions_are_sink_prefixed():
    """cwcore.sinks.convexity is the module whatever was imported first (it used to be rebound to the
    function by the package), and the functions are sinks.sink_<analysis>."""
    import importlib
    import types
    import warnings

    import cwcore

    for name in ("anti_alignment", "convexity", "semantic_cone"):
        module = importlib.import_module(f"cwcore.sinks.{name}")
        assert getattr(sinks, name) is module, name
        assert isinstance(getattr(sinks, name), types.ModuleType)
        assert getattr(sinks, f"sink_{name}") is getattr(module, f"sink_{name}")
        assert f"sink_{name}" in sinks.__all__ and name not in sinks.__all__
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert getattr(cwcore, name) is getattr(sinks, f"sink_{name}")  # the old top-level name, deprecated
        assert any(issubclass(w.category, DeprecationWarning) and f"cwcore.sinks.sink_{name}" in str(w.message)
                   for w in caught)
    assert not {n for n in sinks.__all__ if isinstance(getattr(sinks, n), types.ModuleType)} - {"suppression"}


def test_one_analysis_named_alone_is_that_analysis_not_its_letters():
    # before: run_analyses(..., "rates") refused "unknown analyses ['a', 'e', 'r', 's', 't']"
    model, ids = tiny_model("llama"), random_ids(n=2)
    alone = sinks.run_analyses(model, None, ids, "rates", **FAST)
    listed = sinks.run_analyses(model, None, ids, ["rates"], **FAST)
    assert list(alone) == ["rates"]
    pd.testing.assert_frame_equal(alone["rates"], listed["rates"])
    pd.testing.assert_frame_equal(alone["rates"], sinks.sink_rates(model, None, ids, **FAST))


def test_an_encoder_is_refused_not_summarised_over_part_of_its_keys():
    # before: a bidirectional model ran, each analysis reading keys 1..i as query i's tail and silently leaving
    # out the keys after i (half of an encoder's attention)
    from cwcore.core.architectures import UnsupportedModelError

    ids = random_ids(n=2)
    with pytest.raises(UnsupportedModelError, match="attention layer 0 attends to later keys"):
        sinks.sink_rates(tiny_model("bert"), None, ids, **FAST)
    rates = sinks.sink_rates(tiny_model("llama"), None, ids, **FAST)  # the control: a decoder of the same size runs
    assert len(rates) > 0


def test_the_sink_position_is_fixed_not_an_option():
    """Every analysis is written for key 0 (the semantic part, the decomposition, the rates' query ranges): a
    LayerState told another sink position gave wrong numbers, so the position is read-only."""
    import torch

    state = engine.LayerState(0, torch.full((1, 2, 3, 3), 1 / 3), torch.randn(1, 2, 3, 4), torch.randn(8, 8),
                              torch.float64)
    assert state.sink_position == engine.SINK_POSITION == 0
    with pytest.raises(AttributeError):
        state.sink_position = 2


def test_a_tokenizers_output_is_read_as_token_blocks_not_tokenised_as_text():
    """A BatchEncoding (or a dict) of input_ids was tokenised as text made of its keys ("input_ids",
    "attention_mask"), and analysed without a word. Now its ids are the blocks; padding and other keys are
    refused."""
    import torch
    from transformers import BatchEncoding

    model, ids = tiny_model("llama"), random_ids(n=3)
    expected = sinks.sink_rates(model, None, ids, progress=False)
    encoded = BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    pd.testing.assert_frame_equal(sinks.sink_rates(model, None, encoded, progress=False), expected)
    pd.testing.assert_frame_equal(sinks.sink_rates(model, None, {"input_ids": ids.tolist()}, progress=False),
                                  expected)
    padded = torch.ones_like(ids)
    padded[0, :2] = 0
    with pytest.raises(ValueError, match="need unpadded blocks"):
        sinks.sink_rates(model, None, {"input_ids": ids, "attention_mask": padded}, progress=False)
    with pytest.raises(ValueError, match="input_ids \\(and an all-ones attention_mask\\) only, got 'input_ids', "
                                         "'token_type_ids'"):
        sinks.sink_rates(model, None, {"input_ids": ids, "token_type_ids": ids * 0}, progress=False)


def test_ids_as_numpy_or_a_list_of_lists_are_token_blocks():
    """A numpy array or a list of lists of ids was read as text: "text data needs a tokenizer" without one, and
    with one each row was tokenised as text. The reference is the same ids as a tensor; ragged rows are refused."""
    import numpy as np

    model, ids = tiny_model("llama"), random_ids(n=3)
    expected = sinks.sink_rates(model, None, ids, progress=False)
    for given in (ids.numpy(), ids.numpy().astype(np.int32), ids.tolist(), [row for row in ids.numpy()]):
        pd.testing.assert_frame_equal(sinks.sink_rates(model, None, given, progress=False), expected)
    with pytest.raises(ValueError, match=r"token blocks must all have one length, got lengths \[3, 4\]"):
        sinks.sink_rates(model, None, [[1, 2, 3, 4], [1, 2, 3]], progress=False)
    with pytest.raises(TypeError, match="must hold integer token ids"):
        sinks.sink_rates(model, None, ids.numpy().astype(float), progress=False)


def test_run_analyses_refuses_what_none_of_its_analyses_reads_and_a_half_geometry():
    """run_analyses(['anti_alignment'], kind='inter') ran as without kind (sink_anti_alignment refuses it); a
    threshold with heads='all' too. compute_dtype=bfloat16 failed after the forward, float16 ran in half."""
    model, ids = tiny_model("llama"), random_ids()
    for analyses, keywords, message in ((["anti_alignment"], dict(kind="inter"), "reads 'kind'"),
                                        (["rates"], dict(quantile_sample=5, bins=3), "reads 'bins', 'quantile_sample'"),
                                        (["semantic_cone"], dict(heads="all", threshold=0.2),
                                         "threshold is read only with heads")):
        with pytest.raises((TypeError, ValueError), match=message):
            sinks.run_analyses(model, None, ids, analyses, **FAST, **keywords)
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match="compute_dtype must be torch.float32 or torch.float64"):
            sinks.sink_rates(model, None, ids, compute_dtype=dtype, **FAST)
