"""Decomposition.to_frame, the tidy table of a decomposition, against loops written here over the
model's own eager forward of each unpadded sequence (attention maps, value rows, W_O): one row per real
(sequence, layer, head, query, key) term, nothing for padding or future keys."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import cwcore
from tiny_models import VOCAB, tiny_model


class NumberTokens:
    """The one tokenizer method to_frame reads: a token's name from its id."""

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return f"tok{token_id}"


def _naive_rows(model, ids: torch.Tensor, sequence: int) -> list[dict]:
    """Rows of one unpadded sequence from an eager forward: terms alpha^h_ij W_O^h v^h_j in model space."""
    heads, kv = model.config.num_attention_heads, model.config.num_key_value_heads
    values, handles = {}, []
    for l, block in enumerate(model.model.layers):
        def v_hook(mod, args, out, l=l):
            b, n, _ = out.shape
            values[l] = out.reshape(b, n, kv, -1).transpose(1, 2).repeat_interleave(heads // kv, dim=1)[0].double()
        handles.append(block.self_attn.v_proj.register_forward_hook(v_hook))
    with torch.no_grad():
        attentions = model(input_ids=ids[None], output_attentions=True).attentions
    for handle in handles:
        handle.remove()
    rows, n = [], ids.shape[0]
    for l, block in enumerate(model.model.layers):
        w = block.self_attn.o_proj.weight.detach().double()
        alpha = attentions[l][0].double()
        d = values[l].shape[-1]
        projected = torch.stack([values[l][h] @ w[:, h * d:(h + 1) * d].T for h in range(heads)])  # [h, j, m]
        output = torch.einsum("hij,hjm->im", alpha, projected)  # o_i, no bias
        for h in range(heads):
            for i in range(n):
                for j in range(i + 1):
                    v, o = projected[h, j], output[i]
                    rows.append(dict(sequence=sequence, layer=l, head=h, query=i, key=j,
                                     query_token=f"tok{int(ids[i])}", key_token=f"tok{int(ids[j])}",
                                     attention=float(alpha[h, i, j]), relative_norm=float(v.norm() / o.norm()),
                                     cosine=float(v @ o / (v.norm() * o.norm())),
                                     contribution=float(alpha[h, i, j] * (v @ o) / (o @ o))))
    return rows


def test_one_row_per_real_term_with_the_naive_values():
    model = tiny_model("llama")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    padded = ids.clone()
    padded[1, :2] = 0
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    d = cwcore.decompose(model, input_ids=padded, attention_mask=mask)
    frame = d.to_frame(tokenizer=NumberTokens())
    assert list(frame.columns) == ["sequence", "layer", "head", "query", "key", "query_token", "key_token",
                                   "attention", "relative_norm", "cosine", "contribution"]
    expected = pd.DataFrame(_naive_rows(model, ids[0], 0) + _naive_rows(model, ids[1, 2:], 1))
    assert len(frame) == len(expected) == 2 * 4 * (28 + 15)  # causal pairs of 7 and 5 real tokens, per head and layer
    order = ["sequence", "layer", "head", "query", "key"]
    frame = frame.sort_values(order).reset_index(drop=True)
    expected = expected.sort_values(order).reset_index(drop=True)
    pd.testing.assert_frame_equal(frame[order + ["query_token", "key_token"]], expected[order + ["query_token", "key_token"]],
                                  check_dtype=False)
    for column in ("attention", "relative_norm", "cosine", "contribution"):
        assert frame[column].notna().all(), column
        torch.testing.assert_close(torch.tensor(frame[column].to_numpy(), dtype=torch.float64),
                                   torch.tensor(expected[column].to_numpy()), rtol=2e-4, atol=2e-6, msg=column)
    # contribution weights of a query sum to 1 over heads and keys
    sums = frame.groupby(["sequence", "layer", "query"])["contribution"].sum()
    torch.testing.assert_close(torch.tensor(sums.to_numpy(), dtype=torch.float64), torch.ones(len(sums), dtype=torch.float64),
                               rtol=1e-4, atol=1e-5)


def test_selection_and_intra_read_the_tensors():
    model = tiny_model("gpt2")
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    d = cwcore.decompose(model, input_ids=ids)
    frame = d.to_frame(layers=1, heads=[0, 2], kind="intra")
    assert "query_token" not in frame.columns and set(frame["head"]) == {0, 2} and set(frame["layer"]) == {1}
    ld = d[1]
    for row in frame.itertuples():
        where = (0, row.head, row.query, row.key)
        assert row.attention == pytest.approx(float(ld.attention[where]), abs=1e-7)
        assert row.contribution == pytest.approx(float(ld.contribution("intra")[where]), abs=1e-7)
        assert row.cosine == pytest.approx(float(ld.cosine("intra")[where]), abs=1e-7)
        assert row.relative_norm == pytest.approx(float(ld.relative_norm("intra")[where]), rel=1e-6)
    assert len(frame) == 2 * 21
    with pytest.raises(ValueError, match=r"heads \[7\] are out of range: layer 0 has 4 heads"):
        d.to_frame(heads=7)
    # a head named twice gave every row twice (a query's contributions summed to twice theirs); -1 was refused
    once = d.to_frame(layers=1, heads=[3])
    pd.testing.assert_frame_equal(d.to_frame(layers=1, heads=[3, 3]), once)
    pd.testing.assert_frame_equal(d.to_frame(layers=1, heads=-1), once)
    pd.testing.assert_frame_equal(d.to_frame(layers=1, heads=[0, -4]), d.to_frame(layers=1, heads=0))
    with pytest.raises(ValueError, match=r"heads \[-5\] are out of range"):
        d.to_frame(heads=-5)


def test_an_encoder_keeps_every_pair_of_real_tokens():
    model = tiny_model("bert")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    frame = cwcore.decompose(model, input_ids=ids).to_frame(layers=[0])
    assert len(frame) == 4 * 25  # bidirectional: future keys are terms too


def test_an_encoder_decoder_is_refused_rather_than_read_with_the_encoders_mask_and_tokens():
    """BART: the decoder's self-attention and cross-attention rows were kept or dropped by the encoder's mask
    (84 rows of a decoder layer where there are 180) and named by the encoder's tokens."""
    from zoo_models import bart

    model = bart()
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    d = cwcore.decompose(model, input_ids=ids, attention_mask=mask, decoder_input_ids=ids.flip(-1))
    assert d.cross_attention and not cwcore.decompose(tiny_model("llama"), input_ids=ids).cross_attention
    with pytest.raises(ValueError, match="^to_frame: this decomposition is of a model with cross-attention"):
        d.to_frame()
