"""One Protocol object for every entry point: the object and the old keywords give the same rows, an
unknown keyword is refused, and the rows name their variant of the removal unit."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cwcore import faithfulness as fa
from cwbook import anatomy
from cwcore.faithfulness.protocol import PROTOCOL_FIELDS, Protocol, as_protocol

KW = dict(progress=False, batch_size=5)


def test_as_protocol_replaces_fields_and_refuses_unknown_keywords():
    assert as_protocol() == Protocol()
    assert as_protocol(Protocol(kind="intra"), unit="token") == Protocol(unit="token", kind="intra")
    assert as_protocol({"scope": "layer"}, layers=[3, 1]) == Protocol(scope="layer", layers=(1, 3))
    with pytest.raises(TypeError, match="unknown protocol keyword"):
        as_protocol(unti="token")
    assert set(PROTOCOL_FIELDS) == {"unit", "scope", "layers", "keep_first_token", "scores", "kind", "importance", "seed",
                                    "removal"}


@pytest.mark.parametrize("entry", ["faithfulness_curve", "per_layer_curve", "downstream_eval"])
@pytest.mark.parametrize("typo, meant", [("ratio", "ratios"), ("modes", "mode"), ("max_len", "max_length"),
                                         ("unti", "unit")])
def test_a_misspelt_keyword_of_the_entry_point_or_the_protocol_is_suggested(peaked, entry, typo, meant):
    # before: "unknown protocol keyword(s) ['ratio']; a protocol has [...]", no suggestion and a list without ratios
    from cwcore.faithfulness.downstream import downstream_eval
    from cwcore.faithfulness.layers import per_layer_curve

    call = {"faithfulness_curve": fa.faithfulness_curve, "per_layer_curve": per_layer_curve,
            "downstream_eval": downstream_eval}[entry]
    model, ids = peaked
    with pytest.raises(TypeError, match=rf"^{entry}\(\) got unexpected keyword argument\(s\) '{typo}' "
                                        rf"\(did you mean '{meant}'\?\); it takes .*\bratios, mode\b.* and the "
                                        r"protocol's fields unit, scope, layers"):
        call(model, None, ids, "attention", **{typo: 1}, progress=False)


def test_variants_are_named_from_the_protocol():
    assert Protocol().variant == Protocol(kind="intra", importance="absolute").variant == "main"
    assert Protocol(unit="token").variant == "token-unit"
    assert Protocol(keep_first_token=False).variant == "first-token-removable"
    assert Protocol(unit="token", keep_first_token=False).variant == "token-unit+first-token-removable"
    assert Protocol(scope="layer").variant == "scope=layer" and Protocol(layers=[0]).variant == "layers=0"


def test_the_object_and_the_keywords_give_the_same_rows(peaked):
    model, ids = peaked
    metrics, ratios = ["attention", "contribution"], [0.2, 0.5]
    by_object = fa.faithfulness_curve(model, None, ids, metrics, ratios, protocol=Protocol(unit="token", kind="intra"), **KW).per_sequence
    by_keywords = fa.faithfulness_curve(model, None, ids, metrics, ratios, unit="token", kind="intra", **KW).per_sequence
    pd.testing.assert_frame_equal(by_object, by_keywords)
    assert set(by_object["variant"]) == {"token-unit"} and set(by_object["unit"]) == {"token"}
    # keywords replace the object's fields
    mixed = fa.faithfulness_curve(model, None, ids, metrics, ratios, protocol=Protocol(kind="intra"), unit="token", **KW).per_sequence
    pd.testing.assert_frame_equal(mixed, by_object)
    with pytest.raises(TypeError, match=r"got unexpected keyword argument\(s\) 'knd' \(did you mean 'kind'\?\)"):
        fa.faithfulness_curve(model, None, ids, metrics, ratios, knd="intra", **KW).per_sequence
    # the variant rides through the summaries
    assert set(fa.aopc(by_object, n_bootstrap=20)["variant"]) == {"token-unit"}


def test_first_token_removable_makes_the_first_token_a_candidate(peaked):
    model, ids = peaked
    main = fa.faithfulness_curve(model, None, ids, ["attention"], [0.5], "comprehensiveness", **KW).per_sequence
    free = fa.faithfulness_curve(model, None, ids, ["attention"], [0.5], "comprehensiveness",
                                 protocol=Protocol(keep_first_token=False), **KW).per_sequence
    assert set(main["variant"]) == {"main"} and set(free["variant"]) == {"first-token-removable"}
    # every query i >= 1 gains one candidate key (the first token) in each head and layer; query 0 gains its only one
    n, length = ids.shape
    heads, layers = 4, 2
    gained = free["n_candidates"].to_numpy() - main["n_candidates"].to_numpy()
    assert np.all(gained == length * heads * layers)


def test_the_anatomy_takes_a_protocol_object(peaked):
    import datasets

    model, ids = peaked
    blocks = datasets.Dataset.from_dict({"input_ids": ids[:3].tolist(), "attention_mask": [[1] * ids.shape[1]] * 3,
                                         "document": [0, 1, 2]})
    by_name = anatomy.selection_anatomy(model, blocks, ["attention"], [0.2], protocol="per-head", progress=False)
    by_object = anatomy.selection_anatomy(model, blocks, ["attention"], [0.2], protocol=Protocol(kind="intra"),
                                          progress=False)
    measures = list(anatomy.MEASURES)
    np.testing.assert_array_equal(by_name[measures].to_numpy(), by_object[measures].to_numpy())
    token = anatomy.selection_anatomy(model, blocks, ["attention"], [0.2], protocol="per-head", unit="token",
                                      progress=False)
    assert set(token["variant"]) == {"token-unit"} and not np.allclose(token["head_norm"], by_name["head_norm"])
    with pytest.raises(ValueError, match="clean run"):
        anatomy.selection_anatomy(model, blocks, ["attention"], [0.2], scores="live", progress=False)
    # before, the object equalled the name it was compared with and the control and the refusal came as keywords,
    # so an anatomy that ignored the object (always per-head) passed: here they ride inside the object
    token_object = anatomy.selection_anatomy(model, blocks, ["attention"], [0.2],
                                             protocol=Protocol(kind="intra", unit="token"), progress=False)
    assert set(token_object["variant"]) == {"token-unit"}
    np.testing.assert_array_equal(token_object[measures].to_numpy(), token[measures].to_numpy())
    with pytest.raises(ValueError, match="clean run"):
        anatomy.selection_anatomy(model, blocks, ["attention"], [0.2], protocol=Protocol(scores="live"),
                                  progress=False)
    # the default protocol, by name and as an object, is not per-head on a metric whose ranking depends on the kind
    default_name, default_object, per_head = (
        anatomy.selection_anatomy(model, blocks, ["contribution"], [0.2], protocol=p, progress=False)
        for p in ("default", Protocol(), "per-head"))
    np.testing.assert_array_equal(default_name[measures].to_numpy(), default_object[measures].to_numpy())
    assert not np.allclose(default_object[measures].to_numpy(), per_head[measures].to_numpy())


def test_a_protocol_refuses_non_bool_first_token_non_int_seeds_and_layers():
    """keep_first_token="False" ran the True protocol under a False label; seed=1.7 ran seed 1 and failed when the
    table was read; Protocol(layers=(1.5,)) ran layer 1 where the keyword refuses it."""
    for value in ("False", None, 1):
        with pytest.raises(TypeError, match="keep_first_token must be True or False"):
            Protocol(keep_first_token=value)
    for value in (1.7, True, -3, None, 2 ** 63):
        with pytest.raises(TypeError, match="seed must be an int"):
            Protocol(seed=value)
    for value in ((1.5,), ("1",), (True,)):
        with pytest.raises(TypeError, match="layers must hold layer numbers"):
            Protocol(layers=value)
    assert Protocol(layers=(np.int64(1), 0), seed=np.int64(3)) == Protocol(layers=(0, 1), seed=3)
    assert type(Protocol(seed=np.int64(3)).seed) is int
