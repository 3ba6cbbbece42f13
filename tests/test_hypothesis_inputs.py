"""Property-based: random malformed inputs at every public entry give either the reference result or one
of cwcore's own one-sentence errors, never a third-party message, a crash or a plausible wrong number.

The reference of a valid input is the same entry on the input's canonical form (int64 ids, 2-D; ratios
sorted without duplicates; layers as non-negative numbers; an int target as a full tensor), so a
validation that accepted something wrong, or refused something right, fails here. Tiny models, a bounded
number of examples, derandomised (the same examples on every run).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import cwcore  # noqa: E402
from cwcore.core.architectures import UnsupportedModelError  # noqa: E402
from cwcore.core.inputs import InputError  # noqa: E402
from tiny_models import VOCAB, tiny_model  # noqa: E402

PACKAGE = Path(cwcore.__file__).resolve().parent
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MODEL = tiny_model("llama")
LAYERS = 2
CONTEXT = 64
FC = dict(progress=False, n_bootstrap=10, batch_size=2, metric="contribution", mode="comprehensiveness")


def own_error(error: BaseException) -> bool:
    """One of the project's errors: its own classes, or a built-in error raised by cwcore's code (whose
    message is cwcore's sentence, not a library's)."""
    if isinstance(error, (InputError, UnsupportedModelError)):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    inner = tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)
    return isinstance(error, (ValueError, TypeError, IndexError)) and inner


def outcome(call):
    """``("ok", result)`` or ``("refused", error)``; anything else fails the test with the error."""
    try:
        return "ok", call()
    except Exception as error:  # noqa: BLE001 - classified below
        if own_error(error):
            return "refused", error
        raise AssertionError(f"not one of cwcore's errors: {type(error).__name__}: {error}") from error


# -- token ids: any dtype, shape and value range -----------------------------------------------------
DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32, torch.float64, torch.bool]


@st.composite
def token_ids(draw):
    dtype = draw(st.sampled_from(DTYPES))
    ndim = draw(st.sampled_from([1, 2, 2, 2, 3]))
    shape = [draw(st.integers(1, 2))] * (ndim - 1) + [draw(st.sampled_from([0, 1, 2, 5, 8, 70]))]
    low = draw(st.sampled_from([0, 0, -5]))
    high = draw(st.sampled_from([VOCAB, VOCAB, VOCAB + 10]))
    values = torch.randint(low, high, shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if dtype.is_floating_point and draw(st.booleans()):
        values = values + 0.5
    if dtype == torch.bool:
        return values.bool()
    if dtype == torch.uint8:
        values = values.clamp_min(0)
    return values.to(dtype)


def valid_ids(ids: torch.Tensor, min_length: int = 1) -> torch.Tensor | None:
    """The canonical ``[batch, sequence]`` int64 form of ``ids``, or None if they are not valid ids."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.ndim not in (1, 2) or ids.numel() == 0:
        return None
    ids = ids.long().reshape(-1, ids.shape[-1])
    if ids.shape[-1] < min_length or ids.shape[-1] > CONTEXT or ids.numel() == 0:
        return None
    if int(ids.min()) < 0 or int(ids.max()) >= VOCAB:
        return None
    return ids


@SETTINGS
@given(token_ids())
def test_decompose_takes_valid_ids_exactly_and_refuses_the_rest(ids):
    kind, result = outcome(lambda: cwcore.decompose(MODEL, input_ids=ids))
    reference = valid_ids(ids)
    assert (kind == "ok") == (reference is not None), (ids.dtype, tuple(ids.shape), result)
    if kind == "ok":
        with torch.no_grad():
            want = MODEL(input_ids=reference).logits
        torch.testing.assert_close(result.outputs.logits, want, rtol=0, atol=0)


@SETTINGS
@given(token_ids())
def test_sink_rates_refuses_exactly_what_decompose_refuses(ids):
    kind, result = outcome(lambda: cwcore.sinks.sink_rates(MODEL, None, ids, progress=False))
    reference = valid_ids(ids, min_length=2) if ids.ndim == 2 else None  # ready blocks are [sequence, token]
    assert (kind == "ok") == (reference is not None), (ids.dtype, tuple(ids.shape), result)
    if kind == "ok":
        want = _sink_reference(tuple(map(tuple, reference.tolist())))
        assert result["sink_rate"].tolist() == want


@functools.lru_cache(maxsize=None)
def _sink_reference(rows):
    return cwcore.sinks.sink_rates(MODEL, None, torch.tensor(rows), progress=False)["sink_rate"].tolist()


# -- the sweep's arguments ---------------------------------------------------------------------------
NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.integers(-2, 3),
                    st.sampled_from([0.0, 0.1, 0.5, 1.0, "0.2", None, True]))
IDS = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


def canonical_ratios(ratios):
    items = [ratios] if not isinstance(ratios, (list, tuple)) else list(ratios)
    if not items or any(isinstance(r, (bool, str)) or r is None for r in items):
        return None
    if any(not math.isfinite(r) or not 0 <= r <= 1 for r in items):
        return None
    return tuple(sorted({float(r) for r in items}))


def canonical_layers(layers):
    if layers is None:
        return tuple(range(LAYERS))
    items = [layers] if not isinstance(layers, (list, tuple)) else list(layers)
    if not items or any(isinstance(l, bool) or not isinstance(l, int) or not -LAYERS <= l < LAYERS for l in items):
        return None
    return tuple(sorted({l % LAYERS for l in items}))


@functools.lru_cache(maxsize=None)
def _curve_reference(ratios, layers, batch_size):
    table = cwcore.faithfulness_curve(MODEL, None, IDS, ratios=list(ratios), layers=list(layers),
                                      **{**FC, "batch_size": batch_size}).table
    return table.set_index("ratio")["delta_nll"].round(12).to_dict()


@SETTINGS
@given(ratios=st.one_of(NUMBERS, st.lists(NUMBERS, max_size=3)),
       layers=st.one_of(st.none(), st.integers(-3, 3), st.lists(st.one_of(st.integers(-3, 3), st.floats(0, 1)),
                                                                max_size=3)),
       batch_size=st.one_of(st.integers(-1, 3), st.sampled_from([1.5, "2", None])))
def test_faithfulness_curve_gives_the_reference_or_refuses(ratios, layers, batch_size):
    kind, result = outcome(lambda: cwcore.faithfulness_curve(MODEL, None, IDS, ratios=ratios, layers=layers,
                                                             **{**FC, "batch_size": batch_size}).table)
    r, l = canonical_ratios(ratios), canonical_layers(layers)
    b = batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1 else None
    valid = r is not None and l is not None and b is not None
    assert (kind == "ok") == valid, (ratios, layers, batch_size, result)
    if kind == "ok":
        got = result.set_index("ratio")["delta_nll"].round(12).to_dict()
        assert got == _curve_reference(r, l, b)


# -- targets of logit attribution, masks of intervene --------------------------------------------------
@functools.lru_cache(maxsize=None)
def _attribution_reference(target):
    full = torch.full(IDS.shape, target)
    return cwcore.decompose(MODEL, input_ids=IDS), logit_attribution_of(full)


def logit_attribution_of(targets):
    from cwcore.logit_attribution import logit_attribution

    return logit_attribution(MODEL, targets=targets, input_ids=IDS)


@SETTINGS
@given(st.one_of(st.integers(-3, VOCAB + 3), st.floats(-2, VOCAB, width=32), st.booleans(),
                 st.lists(st.integers(-1, VOCAB), min_size=0, max_size=7)))
def test_logit_attribution_targets(targets):
    kind, result = outcome(lambda: logit_attribution_of(torch.tensor(targets) if isinstance(targets, list)
                                                        else targets))
    valid = (isinstance(targets, int) and not isinstance(targets, bool) and 0 <= targets < VOCAB)
    assert (kind == "ok") == valid, (targets, result)
    if kind == "ok":
        _, reference = _attribution_reference(targets)
        for layer, value in reference.by_layer.items():
            torch.testing.assert_close(result.by_layer[layer], value, rtol=0, atol=0)


@SETTINGS
@given(mask_dtype=st.sampled_from([torch.bool, torch.int64, torch.float32]),
       mask_shape=st.sampled_from([(1,), (2, 4, 6, 6), (1, 1, 6, 6), (2, 4, 6, 5), (3, 4, 6, 6)]),
       layer=st.integers(-3, 3),
       padding=st.one_of(st.none(), st.sampled_from([(2, 6), (2, 5), (1, 6)]), st.just("float")))
def test_intervene_masks_and_padding(mask_dtype, mask_shape, layer, padding):
    mask = torch.rand(mask_shape, generator=torch.Generator().manual_seed(2)) < 0.3
    given_mask = mask.to(mask_dtype)
    attention_mask = None if padding is None else (torch.full((2, 6), 0.5) if padding == "float"
                                                   else torch.ones(padding, dtype=torch.long))

    def run(m, attention):
        with cwcore.intervene(MODEL, {layer: m}, attention_mask=attention):
            return MODEL(input_ids=IDS).logits

    kind, result = outcome(lambda: run(given_mask, attention_mask))
    fits = mask_shape in ((1,), (2, 4, 6, 6), (1, 1, 6, 6))
    valid = (mask_dtype != torch.float32 and fits and -LAYERS <= layer < LAYERS
             and (padding is None or padding == (2, 6)))
    assert (kind == "ok") == valid, (mask_dtype, mask_shape, layer, padding, result)
    if kind == "ok":
        torch.testing.assert_close(result, run(mask, None), rtol=0, atol=0)
