"""``cwcore.summarize``: contribution summaries of long inputs, a block of queries at a time.

:func:`cwcore.decompose` keeps alpha ``[batch, head, query, key]`` for every layer it decomposes, and each
weight it is asked for is another tensor of that size: at 32k tokens one layer's map is gigabytes. The
summary mode computes, inside the attention function and a block of queries at a time, only what a
reader of a long document uses (for layer l, head h, query i, key j; c_ij as in :mod:`.decomposition`,
inter- or intra-head):

- ``contribution_received`` / ``attention_received`` ``[batch, head, key]``: sum over the real queries of
  c^h_ij and of alpha^h_ij (what each key gives the whole document), with :meth:`LayerSummary.received`
  summing over heads too;
- :class:`TopTerms` ``[batch, query, k]``: the k (head, key) terms of each query with the largest c (or
  |c|), with c, alpha, ||v~_j|| / ||o_i|| and cos(o_i, v~_j);
- ``rows``: the full ``[batch, head, row, key]`` rows of chosen query positions (c, alpha, relative norm,
  cosine), and ``token_rows`` ``[batch, row, key]``: head-summed c and head-averaged alpha of chosen
  positions (the convention of :meth:`LayerDecomposition.token_level`).

No ``[head, query, key]`` tensor of the whole input exists: a block's scores, alpha and inner products
are ``[head, block, keys the block can see]``, so a sliding-window layer costs what its window costs.
The summary is the exact reduction of the dense decomposition, to float32 rounding (the tests check
1e-5 relative), with the same conventions: padded query rows are NaN and excluded from the sums, padded
keys receive zero, NaN where an output norm is at most ``ZERO_NORM``. It is checked like the dense path:
the block's output projection must receive exactly the attention output the layer returned, and sum_h
W_O^h z^h_i plus the bias must reproduce the projection's result, or the call raises
:class:`UnsupportedModelError`. The softmax is computed blockwise (the arithmetic of the dense path on an
SDPA-configured model). A model configured for SDPA keeps its own forward: each summarised layer returns the
model's SDPA output for the call, which the blockwise arithmetic must reproduce within the same tolerance (where
no key is padded that output is taken as z and the blockwise alpha is checked against it along random
directions, see :func:`_summarise_layer`; otherwise the blockwise alpha @ V is compared entry by entry); a
model configured ``eager`` gets the blockwise output, its own outputs to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .architectures import AttentionBlock, UnsupportedModelError
from .attention import AttentionSession, cwcore_attention, default_compute_dtype
from .decomposition import (ZERO_NORM, layer_by_number, layers_not_run, positional_inputs, prepare_inputs,
                            select_layers)
from .geometry import probe_directions, rebuilt_error, split_output_projection
from .inputs import (InputError, check_compute_dtype, check_count, check_inputs, own_options, query_positions,
                     query_positions_as_given)

__all__ = ["LayerSummary", "Summary", "SummarySession", "TopTerms", "summarize", "ROW_FIELDS"]

#: ``summarize(progress=None)`` shows a bar over the layers from this many tokens (batch x sequence) on:
#: about 10 s of a 135M-parameter model on one CPU core
PROGRESS_TOKENS = 2048

#: The quantities of a full row ``[batch, head, row, key]`` (and of :class:`TopTerms`).
ROW_FIELDS = ("contribution", "attention", "relative_norm", "cosine")


def _nan_at_zero(norm: torch.Tensor) -> torch.Tensor:
    return norm.masked_fill(norm.abs() <= ZERO_NORM, float("nan"))


@dataclass
class TopTerms:
    """The ``k`` (head, key) terms of each query with the largest c (or |c|), best first, ``[batch, query, k]``.

    Only terms with alpha > 0 and a number for c compete (not those of a head whose output is zero, ``intra``);
    where terms tie exactly at the k-th value (a token repeated at two distances of one relative-position bucket)
    which of them enter is ``torch.topk``'s choice. A query that sees fewer than ``k`` of them (the first
    tokens), and every padded query, has ``head`` and ``key`` -1 and NaN values in the slots left over.
    """

    head: torch.Tensor
    key: torch.Tensor
    contribution: torch.Tensor
    attention: torch.Tensor
    relative_norm: torch.Tensor
    cosine: torch.Tensor


def _field(fields: Mapping[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    if name not in fields:
        raise InputError(f"{what} name must be one of {', '.join(map(repr, fields))}, got {name!r}")
    return fields[name]


class LayerSummary:
    """The summary of one attention layer (see :mod:`cwcore.core.summary`); tensors in the compute dtype.

    ``contribution_received``, ``attention_received`` ``[batch, head, key]``; ``top`` (:class:`TopTerms`);
    ``rows[name]`` ``[batch, head, row, key]`` for ``row_positions``; ``token_rows[name]`` ``[batch, row, key]``
    (``contribution`` summed over heads, ``attention`` averaged) for ``token_row_positions``;
    ``value_norm`` ||v~_j|| ``[batch, head, key]``, ``head_output_norm`` ||o^h_i|| ``[batch, head, query]``,
    ``output_norm`` ||o_i|| ``[batch, query]``. ``kind`` is ``"inter"`` or ``"intra"``.
    """

    def __init__(self, layer: int, block_name: str, kind: str, contribution_received, attention_received, top,
                 row_positions, rows, token_row_positions, token_rows, value_norm, head_output_norm, output_norm,
                 output_bias=None):
        self.layer, self.block_name, self.kind = layer, block_name, kind
        self.contribution_received, self.attention_received = contribution_received, attention_received
        self.top = top
        self.row_positions, self.rows = tuple(row_positions), rows
        self.token_row_positions, self.token_rows = tuple(token_row_positions), token_rows
        self.value_norm, self.head_output_norm, self.output_norm = value_norm, head_output_norm, output_norm
        self.output_bias = output_bias

    def received(self, name: str = "contribution", per_head: bool = False) -> torch.Tensor:
        """What each key receives, summed over the real queries: ``[batch, key]`` summed over heads too, or
        ``[batch, head, key]`` with ``per_head``. ``name``: ``"contribution"`` or ``"attention"``."""
        if name not in ("contribution", "attention"):
            raise InputError(f"name must be 'contribution' or 'attention', got {name!r}")
        values = self.contribution_received if name == "contribution" else self.attention_received
        return values if per_head else values.sum(1)

    def row(self, position: int, name: str = "contribution") -> torch.Tensor:
        """The full ``[batch, head, key]`` row of one chosen query position (as given, or counted from the end);
        ``name``: one of :data:`ROW_FIELDS`."""
        return _field(self.rows, name, "row")[:, :, self._index(position, self.row_positions, "row_positions")]

    def token_row(self, position: int, name: str = "contribution") -> torch.Tensor:
        """The head-aggregated ``[batch, key]`` row of one chosen query position; ``name``: ``"contribution"``
        (summed over heads) or ``"attention"`` (averaged)."""
        return _field(self.token_rows, name, "token_row")[
            :, self._index(position, self.token_row_positions, "token_row_positions")]

    def _index(self, position: int, positions: Sequence[int], what: str) -> int:
        length = self.output_norm.shape[-1]
        wanted = position + length if position < 0 else position
        if wanted not in positions:
            raise InputError(f"query position {position} was not kept; this summary holds {what} {list(positions)} "
                             "(pass rows=... to cwcore.summarize)")
        return positions.index(wanted)

    def __repr__(self) -> str:
        b, h, k = self.contribution_received.shape
        return (f"LayerSummary(layer={self.layer}, block={self.block_name!r}, kind={self.kind!r}, batch={b}, heads={h}, "
                f"keys={k}, top_k={self.top.head.shape[-1]}, rows={list(self.row_positions)})")


class Summary(Mapping):
    """The summaries of a forward pass: ``s[layer]`` is a :class:`LayerSummary` (negative numbers count from
    the last layer); ``outputs`` is the model's own output of that forward pass."""

    def __init__(self, layers: dict[int, LayerSummary], outputs=None, attention_mask=None, num_blocks=None,
                 undecomposable=None):
        self.layer_summaries = dict(sorted(layers.items()))
        self.outputs, self.attention_mask, self.num_blocks = outputs, attention_mask, num_blocks
        self.undecomposable = dict(undecomposable or {})

    @property
    def layers(self) -> list[int]:
        return list(self.layer_summaries)

    def __getitem__(self, layer: int) -> LayerSummary:
        return layer_by_number(self.layer_summaries, layer, self.num_blocks, self.undecomposable, "summarize")

    def __iter__(self) -> Iterator[int]:
        return iter(self.layer_summaries)

    def __len__(self) -> int:
        return len(self.layer_summaries)

    def __repr__(self) -> str:
        return f"Summary(layers={self.layers})"


#: :func:`_top_terms` takes the maximum of each GROUP consecutive keys first, then looks inside the best groups only
GROUP = 64


def _top_terms(ranking: torch.Tensor, k: int, plain: bool = False):
    """The ``k`` largest entries of each query's ``[head, key]`` terms, ``ranking`` ``[head, query, key]``:
    ``(values, heads, keys)`` ``[query, min(k, head * key)]``.

    One pass over the block, not a sort: the k largest terms lie in the k groups of :data:`GROUP` keys with the
    largest maxima (any other group's maximum is at most k terms' values), so only those groups are searched."""
    heads, n, width = ranking.shape
    if plain or width <= 4 * GROUP:
        taken = min(k, heads * width)
        values, index = ranking.transpose(0, 1).reshape(n, heads * width).topk(taken, dim=-1)
        return values, index // width, index % width
    groups, tail = divmod(width, GROUP)
    maxima = ranking[..., :groups * GROUP].unflatten(-1, (groups, GROUP)).amax(-1)  # [head, query, group]
    if tail:
        maxima = torch.cat([maxima, ranking[..., groups * GROUP:].amax(-1, keepdim=True)], -1)
    count = maxima.shape[-1]
    _, chosen = maxima.transpose(0, 1).reshape(n, heads * count).topk(min(k, heads * count), dim=-1)
    group_head, group_start = chosen // count, (chosen % count) * GROUP  # [query, groups chosen]
    keys = group_start[..., None] + torch.arange(GROUP, device=ranking.device)  # [query, chosen, GROUP]
    inside = keys < width
    keys = keys.clamp_max(width - 1)
    candidates = ranking[group_head[..., None], torch.arange(n, device=ranking.device)[:, None, None], keys]
    candidates = candidates.masked_fill(~inside, -torch.inf).reshape(n, -1)
    values, index = candidates.topk(min(k, heads * width), dim=-1)
    return values, group_head.gather(1, index // GROUP), keys.reshape(n, -1).gather(1, index)


def _canonical_order(best: torch.Tensor, heads: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The permutation ``[..., k]`` (for ``gather``) that orders the top terms by ranking value, largest first, and
    equal values by (head, key): one order whatever order ``topk`` returned them in (it is not stable)."""
    by_position = (heads * (int(keys.max()) + 1 if keys.numel() else 1) + keys).sort(dim=-1, stable=True).indices
    order = best.gather(-1, by_position).sort(dim=-1, descending=True, stable=True).indices
    return by_position.gather(-1, order)


#: A block of queries is computed one key/value head (group of query heads) at a time, and a group's tensors
#: ``[group heads, block, keys it sees]`` hold about BLOCK_ELEMENTS scores (2 MiB in float32) where the keys are
#: few (short inputs, a sliding window: the block grows, up to MAX_BLOCK queries, and its passes stay in cache),
#: and at least ROWS_PER_DIM x head_dim (head, query) rows (MIN_BLOCK queries at least) where the keys are many: the
#: products [group heads x block, head_dim] x [head_dim, keys] then read each key once for enough rows. Measured
#: on CPU, one thread, one global layer at 8,192 tokens: SmolLM2 135M (3 groups of 3 heads, head_dim 64), the
#: layer in the model's forward, three interleaved rounds: 192 rows 2.85, 2.36, 2.39 s; 384 rows 3.16, 3.12, 2.34
#: s; 576 rows 3.27, 2.74, 2.62 s (all 9 heads at once, 85 queries: 3.4-4.1 s). Gemma 3 270M (1 group of 4
#: heads, head_dim 256), random inputs of its shapes: 384 rows 2.56 s, 768 rows 2.34 s, 1536 rows 2.57 s.
BLOCK_ELEMENTS = 1 << 19
ROWS_PER_DIM = 3
MIN_BLOCK, MAX_BLOCK = 16, 512


def _upper_triangle(rows: int, columns: int, device) -> torch.Tensor:
    """``[rows, columns]`` bool, True where key ``start + j`` is after query ``start + i`` (j > i)."""
    return torch.ones(rows, columns, dtype=torch.bool, device=device).triu_(1)


def _block_spans(attention_mask, causal: bool, b: int, q_len: int, k_len: int, heads: int, head_dim: int):
    """Per query block of batch row ``b``: ``(start, stop, first, limit, allowed, additive)`` where every key outside
    ``first:limit`` is masked for every query of the block, ``allowed`` is ``[head or 1, block, limit - first]``
    bool (None: every key of the span is allowed; ``"causal"``: a plain causal pattern, query i sees keys up to i)
    and ``additive`` the float mask's slice (or None). ``heads``: the query heads computed together (one group of
    ``head_dim``-sized heads), which size the blocks (see :data:`BLOCK_ELEMENTS`)."""
    minimum = torch.finfo(torch.float32).min
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape((1,) * (4 - attention_mask.dim()) + tuple(attention_mask.shape))
        mask = mask[b if mask.shape[0] > 1 else 0]
    width = k_len if attention_mask is None and not causal else 1  # the keys the last block saw
    fewest = max(MIN_BLOCK, int(ROWS_PER_DIM * head_dim) // max(1, heads))
    start = 0
    while start < q_len:
        rows = max(fewest, min(MAX_BLOCK, BLOCK_ELEMENTS // max(1, heads * width)))
        if attention_mask is None and causal:
            rows = max(fewest, min(MAX_BLOCK, BLOCK_ELEMENTS // max(1, heads * min(k_len, start + rows))))
        stop = min(q_len, start + rows)
        if mask is None:
            if not causal:
                yield start, stop, 0, k_len, None, None
            else:  # SDPA's is_causal alignment (top-left): query i sees keys 0..i, so only the block's diagonal masks
                limit = min(k_len, stop)
                yield start, stop, 0, limit, "causal", None
                width = limit
            start = stop
            continue
        block = mask[:, start:stop, :k_len]
        additive = None
        if block.dtype == torch.bool:
            allowed = block
        else:
            additive = block.to(torch.float32)
            allowed = additive > minimum
        first, limit = 0, k_len
        if bool(allowed.any(-1).all()):  # no row masks every key: drop the keys all rows mask
            columns = allowed.any(1).any(0).nonzero()
            first, limit = int(columns[0]), int(columns[-1]) + 1
        width = limit - first
        yield (start, stop, first, limit, allowed[..., first:limit],
               None if additive is None else additive[..., first:limit])
        start = stop


class SummarySession(AttentionSession):
    """An :class:`AttentionSession` that computes the summarised layers itself, a block of queries at a time,
    and checks each against the model's output projection (see :func:`summarize`)."""

    streaming = True

    def __init__(self, model: nn.Module, layers: Iterable[int], *, top_k: int, rows: Sequence[int],
                 token_rows: Sequence[int], kind: str, absolute: bool, compute_dtype=None):
        self.summarised = set(layers)  # before the base class reads `layers`
        super().__init__(model, compute_dtype=compute_dtype)
        # layer -> [batch, query] bool of its current call (None: nothing padded), read from the call's own mask
        self._query_validity: dict[int, torch.Tensor | None] = {}
        self.top_k, self.row_positions, self.token_row_positions = top_k, tuple(rows), tuple(token_rows)
        self.kind, self.absolute = kind, absolute
        self.summaries: dict[int, LayerSummary] = {}
        self.bar = None  # a tqdm bar over the summarised layers, or None
        self._pending: dict[int, torch.Tensor] = {}  # layer -> o_i [batch, query, model], until its projection runs

    @property
    def layers(self) -> set[int]:
        return super().layers | self.summarised

    def streams(self, module: nn.Module) -> bool:
        block = self._by_module.get(id(module))
        return block is not None and block.layer in self.summarised

    # -- the check: the projection's result is o_i plus its bias ------------------------------------------
    def attach(self) -> None:
        super().attach()
        if not self.verify:
            return
        for layer in sorted(self.summarised):
            block = self.blocks[layer]
            self._hooks.append(block.output_module().register_forward_hook(self._check_summary(block)))

    def _check_summary(self, block: AttentionBlock):
        def hook(projection, args, result):
            rebuilt = self._pending.pop(block.layer, None)
            if rebuilt is None:
                return
            output = (result[0] if isinstance(result, tuple) else result).detach()
            _, bias = block.output_projection()
            if bias is not None:
                rebuilt = rebuilt + bias.detach().to(rebuilt.dtype)
            error, rows_finite = rebuilt_error(rebuilt, output, self._query_validity.pop(block.layer, None))
            allowed = self.tolerance(output.dtype, block.layer)
            self._own_differences.pop(block.layer, None)
            if not rows_finite or error > allowed:
                self.summaries.pop(block.layer, None)
                raise UnsupportedModelError(
                    f"attention block {block.name!r}: the terms alpha_ij v~_j plus the bias do not reproduce the "
                    f"output projection's result (relative error {error:.3g} > {allowed:g} for a {output.dtype} model "
                    f"summarised in compute_dtype={self.compute_dtype}); cwcore refuses to report this summary")
        return hook

    # -- the computation -------------------------------------------------------------------------------
    def streamed_output(self, module, query, key, value, attention_mask, scaling, causal, softcap, s_aux, own=None,
                        groups: int = 1):
        block = self._by_module[id(module)]
        record = self.count_call(block)
        if s_aux is not None:
            raise UnsupportedModelError(
                f"attention block {block.name!r} has learned sink logits (s_aux), which cwcore.summarize does not "
                "compute; use cwcore.decompose for this model")
        if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
            raise UnsupportedModelError("cwcore.summarize computes no gradients; call it under torch.no_grad()")
        output, summary, rebuilt, adopted = _summarise_layer(self, block, query, key, value, attention_mask, scaling,
                                                             causal, softcap, own, groups)
        if record:
            self.summaries[block.layer] = summary
            if self.bar is not None:
                self.bar.update(1)
            if self.verify:
                self._pending[block.layer] = rebuilt
        return output, adopted

    def detach(self) -> None:
        super().detach()
        self._pending.clear()
        self._query_validity.clear()


def _summarise_layer(session: SummarySession, block: AttentionBlock, query, key, value, attention_mask, scaling,
                     causal, softcap, own=None, groups: int = 1):
    """One layer: (its output ``[batch, head, query, dim]`` in the model's dtype, its :class:`LayerSummary`, o_i
    ``[batch, query, model]`` in the compute dtype for the check, whether the output is ``own`` adopted).

    ``groups``: query heads per key/value head (``key`` and ``value`` come repeated, ``[batch, head, key, dim]``).
    Each block of queries is computed one key/value head at a time: its ``groups`` query heads stacked as the
    rows of one product with that head's keys (then values), ``[groups * block, dim] x [dim, keys]``, so each
    key is read once for all of them and a group's ``[groups, block, keys]`` tensors stay in cache; the top
    terms of the groups are then merged (the k largest of every group's k largest are the k largest).

    ``own``: the model's own output for the call ``[batch, query, head, dim]`` (its SDPA's), or None. Where it is
    in the compute dtype and no key is padded, it is adopted as z^h_i: each block computes its scores and alpha
    but not alpha @ V, one of its three attention-sized products, and alpha is checked against ``own`` along
    :data:`~cwcore.core.geometry.PROBES` random directions r of head space (Freivalds' test, as the dense path's
    projected check): alpha (V r) against z r, relative to max |z|. An error e_i of a row shows as e_i r ~
    N(0, ||e_i||^2), at least the size of its largest entry with high probability over the directions and the
    queries: as strict as comparing entries. Otherwise the layer computes alpha @ V, which
    :meth:`~cwcore.core.attention.AttentionSession.models_own_output` compares with ``own`` entry by entry."""
    dtype = session.compute_dtype
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[-2]
    # the chosen rows among this layer's own queries (a decoder's, a cross-attention's: not the encoder's tokens)
    what = f"layer {block.layer} has {{length}} queries"
    row_positions = query_positions(session.row_positions, q_len, "rows", what)
    token_positions = query_positions(session.token_row_positions, q_len, "token_rows", what)
    if groups < 1 or heads % groups:
        groups = 1
    group_count = heads // groups
    weight, bias = block.output_projection()
    w_o = split_output_projection(weight.detach().to(dtype, copy=True), heads)  # [head, model, head_dim]
    model_dim = w_o.shape[1]
    flat_w_o = w_o.permute(1, 0, 2).reshape(model_dim, heads * head_dim)
    gram = w_o.transpose(1, 2) @ w_o  # W_O^h^T W_O^h [head, head_dim, head_dim], symmetric
    values = value.detach().to(dtype)
    # padding from the call's own mask, never from the user's matched by length (a text as long as an image's
    # patches); self-attention without a cache: query i is key i, so a padded key is a padded query
    keys_valid, valid = session.call_validity(block, attention_mask, batch, q_len, k_len)
    session._query_validity[block.layer] = valid
    if keys_valid is not None:
        values = values.masked_fill(~keys_valid[:, None, :, None], 0.0)
    value_norm = ((values @ gram) * values).sum(-1).clamp_min(0).sqrt()  # [batch, head, key]
    if keys_valid is not None:
        value_norm = value_norm.masked_fill(~keys_valid[:, None, :], float("nan"))
    # <o_i, v~_j> = (W_O^h^T o_i)^T v_j (inter, v_j shared by a group's heads); <z_i, v~_j> = z_i^T (G^h v_j) (intra)
    keys_side = values if session.kind == "inter" else values @ gram  # [batch, head, key, head_dim]
    # one head of each group: the group's keys and values [batch, group, key, dim] (repeated copies otherwise)
    group_keys = key[:, ::groups].transpose(2, 3)  # [batch, group, dim, key]
    group_values = values[:, ::groups]
    # a power-of-two scaling scales the queries exactly; any other is applied to the products, as eager and the
    # dense path do (scaling the queries first rounds the scores differently, which exp turns into relative
    # differences of alpha near 1e-5 at Gemma 3's score sizes)
    prescaled = isinstance(scaling, float) and scaling > 0 and math.frexp(scaling)[0] == 0.5
    # the model's dtype when it equals the compute dtype and nothing was masked: the layer's own alpha @ V
    own_mixed = value.dtype == dtype and keys_valid is None
    adopt = own is not None and own_mixed and own.dtype == dtype
    if adopt:
        output = own.detach().transpose(1, 2)  # [batch, head, query, dim], a view
        probes = probe_directions(head_dim, dtype, value.device)  # [dim, probes]
        probed_t = (group_values @ probes).transpose(2, 3).contiguous()  # (V r)^T [batch, group, probes, key]
        probe_error = torch.zeros((), dtype=dtype, device=value.device)
    else:
        output = torch.empty(batch, heads, q_len, head_dim, dtype=value.dtype, device=value.device)
    rebuilt = torch.empty(batch, q_len, model_dim, dtype=dtype, device=value.device)
    output_norm = torch.empty(batch, q_len, dtype=dtype, device=value.device)
    head_output_norm = torch.empty(batch, heads, q_len, dtype=dtype, device=value.device)
    contribution_received = torch.zeros(batch, heads, k_len, dtype=dtype, device=value.device)
    attention_received = torch.zeros_like(contribution_received)
    k = session.top_k
    top = {name: torch.full((batch, q_len, k), float("nan"), dtype=dtype, device=value.device) for name in ROW_FIELDS}
    top_head = torch.full((batch, q_len, k), -1, dtype=torch.long, device=value.device)
    top_key = torch.full_like(top_head, -1)
    rows = {name: torch.zeros(batch, heads, len(row_positions), k_len, dtype=dtype, device=value.device)
            for name in ROW_FIELDS}
    token_rows = {name: torch.zeros(batch, len(token_positions), k_len, dtype=dtype, device=value.device)
                  for name in ("contribution", "attention")}
    # the masks' fill: an eager model's own, as its float32 softmax reads it (-inf from a float64 model: a query that
    # sees no key is NaN there, as it is in decompose, which refuses what reaches the real rows)
    minimum = torch.finfo(torch.float32).min if own is not None else float(torch.finfo(query.dtype).min)
    minimum = float(torch.tensor(minimum, dtype=torch.float64).to(torch.float32))
    nan = torch.tensor(float("nan"), dtype=dtype, device=value.device)

    for b in range(batch):
        valid_b = None if valid is None else valid[b]
        for start, stop, first, limit, allowed, additive in _block_spans(attention_mask, causal, b, q_len, k_len,
                                                                         groups, head_dim):
            n, width = stop - start, limit - first

            def probabilities(g: int) -> torch.Tensor:
                """alpha of group ``g``'s heads for this block, ``[groups, n, width]`` in float32."""
                heads_of_g = slice(g * groups, (g + 1) * groups)
                rows_of_g = query[b, heads_of_g, start:stop].reshape(groups * n, head_dim)
                if prescaled:  # exact: a power of two
                    rows_of_g = rows_of_g * scaling
                scores = (rows_of_g @ group_keys[b, g, :, first:limit]).view(groups, n, width)
                if not prescaled:
                    scores = scores.mul_(scaling)
                if softcap is not None:  # in the scores' dtype, as the eager forward caps them (bf16 rounds here)
                    scores = torch.tanh(scores / softcap) * softcap
                scores = scores.to(torch.float32)
                if additive is not None:
                    scores += additive[heads_of_g] if additive.shape[0] > 1 else additive
                elif isinstance(allowed, str):  # the causal triangle: keys start..stop-1 against queries start..stop-1
                    diagonal = scores[..., start - first:]
                    diagonal.masked_fill_(_upper_triangle(n, diagonal.shape[-1], query.device), minimum)
                elif allowed is not None:
                    scores.masked_fill_(~(allowed[heads_of_g] if allowed.shape[0] > 1 else allowed), minimum)
                return torch.softmax(scores, -1)

            # z^h_i of the block [head, n, head_dim]: the model's, or alpha @ V (each group's alpha kept for below)
            kept_alpha = {}
            if adopt:
                mixed = output[b, :, start:stop]
            else:
                mixed = torch.empty(heads, n, head_dim, dtype=dtype, device=value.device)
                for g in range(group_count):
                    heads_of_g = slice(g * groups, (g + 1) * groups)
                    alpha = kept_alpha[g] = probabilities(g)
                    flat = alpha.view(groups * n, width)
                    output[b, heads_of_g, start:stop] = (flat.to(value.dtype) @ value[b, g * groups, first:limit]
                                                        ).view(groups, n, head_dim)
                    mixed[heads_of_g] = (output[b, heads_of_g, start:stop] if own_mixed
                                         else (flat.to(dtype) @ group_values[b, g, first:limit]).view(groups, n, -1))
            o = mixed.transpose(0, 1).reshape(n, heads * head_dim) @ flat_w_o.T  # o_i [n, model]
            rebuilt[b, start:stop] = o
            o_norm = o.norm(dim=-1)  # [n]
            h_norm = ((mixed @ gram) * mixed).sum(-1).clamp_min(0).sqrt()  # [head, n]
            if session.kind == "inter":
                norm = o_norm[None, :].expand(heads, n)
                side = (o @ flat_w_o).view(n, heads, head_dim).transpose(0, 1)  # W_O^h^T o_i [head, n, head_dim]
            else:
                norm = h_norm
                side = mixed
            side = side / _nan_at_zero(norm).square()[..., None]  # so that side_i^T v_j = <o_i, v~_j> / ||o_i||^2
            real = None
            if valid_b is not None:
                real = valid_b[start:stop]
                o_norm = o_norm.masked_fill(~real, float("nan"))
                h_norm = h_norm.masked_fill(~real[None], float("nan"))
            output_norm[b, start:stop] = o_norm
            head_output_norm[b, :, start:stop] = h_norm
            weights = torch.ones(groups, 1, n, dtype=dtype, device=value.device)
            candidates = []  # per group: (ranking value, head, key, c, alpha) [n, taken]
            for g in range(group_count):
                heads_of_g = slice(g * groups, (g + 1) * groups)
                alpha = kept_alpha.pop(g) if g in kept_alpha else probabilities(g)
                alpha_c = alpha.to(dtype)
                flat = alpha_c.view(groups * n, width)
                if adopt:  # z^h_i is the model's; alpha (V r) must give z r: [probes, rows], rows by key
                    probed = probed_t[b, g, :, first:limit] @ flat.T
                    expected = (mixed[heads_of_g] @ probes).reshape(groups * n, -1).T
                    probe_error = torch.maximum(probe_error, (probed - expected).abs().max())
                # <o_i, v~_j> / ||o_i||^2 [groups, n, width]; the row positions need it where alpha is 0 too: their
                # rows are computed below, over every key
                if session.kind == "inter":  # the group's heads share v_j: one product for all their rows
                    scaled = (side[heads_of_g].reshape(groups * n, head_dim)
                              @ group_values[b, g, first:limit].T).view(groups, n, width)
                else:
                    scaled = side[heads_of_g] @ keys_side[b, heads_of_g, first:limit].transpose(-1, -2)
                contribution = scaled.mul_(alpha_c)  # c_ij, in place: one [groups, n, width] tensor besides alpha
                del scaled
                # what each key receives, from the real queries (a product with the row weights: one pass)
                if real is None:
                    contribution_received[b, heads_of_g, first:limit] += torch.bmm(weights, contribution)[:, 0]
                    attention_received[b, heads_of_g, first:limit] += torch.bmm(weights, alpha_c)[:, 0]
                else:
                    contribution_received[b, heads_of_g, first:limit] += contribution[:, real].sum(1)
                    attention_received[b, heads_of_g, first:limit] += alpha_c[:, real].sum(1)
                # the top (head, key) terms of each query in this group, among those with alpha > 0
                ranking = contribution.abs() if session.absolute else contribution
                best, heads_of, keys_of = _top_terms(ranking, k)
                query_of = torch.arange(n, device=best.device)[:, None].expand_as(best)
                a_top = alpha_c[heads_of, query_of, keys_of]  # read once: the redo test and the candidates
                # a term with alpha = 0 (masked) has c = 0 and ranks above negative terms, and topk ranks NaN (a head
                # whose output is zero, intra) above every number: redo those queries without them
                redo = ((a_top == 0) | best.isnan()).any(-1).nonzero()[:, 0]
                if len(redo):
                    masked = ranking[:, redo]
                    masked = masked.masked_fill(~(alpha_c[:, redo] > 0) | masked.isnan(), -torch.inf)
                    best[redo], heads_of[redo], keys_of[redo] = _top_terms(masked, k, plain=True)
                    a_top = alpha_c[heads_of, query_of, keys_of]
                candidates.append((best, heads_of + g * groups, keys_of + first,
                                   contribution[heads_of, query_of, keys_of], a_top))
                # the full rows of chosen positions: over every key (alpha is 0 outside the span)
                for r, position in enumerate(row_positions):
                    if start <= position < stop:
                        i = position - start
                        row_scaled = (side[heads_of_g, i, None] @ keys_side[b, heads_of_g].transpose(-1, -2))[:, 0]
                        row_alpha = torch.zeros(groups, k_len, dtype=dtype, device=value.device)
                        row_alpha[:, first:limit] = alpha_c[:, i]
                        row_norm = _nan_at_zero(norm[heads_of_g, i])[:, None]
                        rows["attention"][b, heads_of_g, r] = row_alpha
                        rows["contribution"][b, heads_of_g, r] = row_scaled * row_alpha
                        rows["relative_norm"][b, heads_of_g, r] = value_norm[b, heads_of_g] / row_norm
                        rows["cosine"][b, heads_of_g, r] = (row_scaled * row_norm
                                                            / _nan_at_zero(value_norm[b, heads_of_g]))
                for r, position in enumerate(token_positions):
                    if start <= position < stop:
                        i = position - start
                        token_rows["contribution"][b, r, first:limit] += contribution[:, i].sum(0)
                        token_rows["attention"][b, r, first:limit] += alpha_c[:, i].sum(0) / heads
                del alpha, alpha_c, contribution, ranking, flat  # the next group may reuse their memory
            # the k largest terms of the block's queries: the k largest among every group's k largest
            best, heads_of, keys_of, c_top, a_top = (torch.cat(parts, -1) for parts in zip(*candidates))
            if group_count > 1:
                best, chosen = best.topk(min(k, best.shape[-1]), dim=-1)
                heads_of, keys_of, c_top, a_top = (part.gather(-1, chosen)
                                                   for part in (heads_of, keys_of, c_top, a_top))
            taken = best.shape[-1]
            order = _canonical_order(best, heads_of, keys_of)
            best, heads_of, keys_of, c_top, a_top = (part.gather(-1, order)
                                                     for part in (best, heads_of, keys_of, c_top, a_top))
            kept = best != -torch.inf
            if real is not None:
                kept &= real[:, None]
            query_of = torch.arange(n, device=best.device)[:, None].expand_as(best)
            norm_top = norm[heads_of, query_of]
            vn_top = value_norm[b][heads_of, keys_of]
            top["contribution"][b, start:stop, :taken] = torch.where(kept, c_top, nan)
            top["attention"][b, start:stop, :taken] = torch.where(kept, a_top, nan)
            top["relative_norm"][b, start:stop, :taken] = torch.where(kept, vn_top / _nan_at_zero(norm_top), nan)
            # cos = <o_i, v~_j> / (||o_i|| ||v~_j||) = (c_ij / alpha_ij) ||o_i|| / ||v~_j|| (alpha > 0 where kept)
            top["cosine"][b, start:stop, :taken] = torch.where(kept, c_top / a_top * norm_top / _nan_at_zero(vn_top), nan)
            top_head[b, start:stop, :taken] = torch.where(kept, heads_of, -1)
            top_key[b, start:stop, :taken] = torch.where(kept, keys_of, -1)
            if real is not None:
                for r, position in enumerate(row_positions):
                    if start <= position < stop and not bool(real[position - start]):
                        for name in ROW_FIELDS:
                            rows[name][b, :, r] = float("nan")
                for r, position in enumerate(token_positions):
                    if start <= position < stop and not bool(real[position - start]):
                        token_rows["contribution"][b, r] = float("nan")
                        token_rows["attention"][b, r] = float("nan")
            del side, mixed
    if adopt and session.verify:
        scale = output.abs().max().clamp_min(torch.finfo(dtype).tiny)
        error = float((probe_error / scale).nan_to_num(float("inf")))
        session.refuse_own_output(block, error, own.dtype, f", measured along {probes.shape[1]} random directions")
    summary = LayerSummary(
        block.layer, block.name, session.kind, contribution_received, attention_received,
        TopTerms(top_head, top_key, top["contribution"], top["attention"], top["relative_norm"], top["cosine"]),
        row_positions, rows, token_positions, token_rows, value_norm, head_output_norm, output_norm,
        None if bias is None else bias.detach().to(dtype))
    return output, summary, rebuilt, adopt


def _warn_padded_rows(inputs: dict, positions: Sequence[int]) -> None:
    """Warn when a chosen row is a padded query of some sequence (its row is NaN), as a right-padded batch makes
    the default ``rows=-1`` of every sequence shorter than the longest; an encoder-decoder's two masks apart."""
    decoder = "decoder_input_ids" in inputs or "decoder_inputs_embeds" in inputs
    found, right_padded = [], False
    stacks = (("attention_mask", "input_ids", "inputs_embeds", " of the encoder" if decoder else ""),
              ("decoder_attention_mask", "decoder_input_ids", "decoder_inputs_embeds", " of the decoder"))
    for name, ids_name, embeds_name, stack in stacks:
        mask = inputs.get(name)
        queries = inputs.get(ids_name, inputs.get(embeds_name))
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not positions:
            continue
        length = queries.shape[1] if isinstance(queries, torch.Tensor) else mask.shape[1]
        chosen = sorted({p + length if p < 0 else p for p in positions if -length <= p < length})
        if not chosen:
            continue
        # with a key/value cache the mask covers the cached tokens too: the queries are its last columns
        offset = mask.shape[1] - length
        if offset < 0 or chosen[-1] + offset >= mask.shape[1]:
            continue
        padded = mask[:, [p + offset for p in chosen]] == 0  # [batch, chosen]
        found += [f"position {p} in sequences {padded[:, i].nonzero().flatten().tolist()}{stack}"
                  for i, p in enumerate(chosen) if bool(padded[:, i].any())]
        right_padded |= bool((padded.any(1) & (mask[:, -1] == 0)).any())
    if not found:
        return
    hint = ("; with right padding a sequence's last token is at attention_mask.sum(1) - 1: pad on the left "
            "(tokenizer.padding_side = 'left') to make rows=-1 every sequence's last token") if right_padded else ""
    warnings.warn(f"cwcore.summarize: chosen rows are padding ({'; '.join(found)}), so their rows are NaN{hint}",
                  stacklevel=3)


def summarize(
    model: nn.Module | None = None,
    layers: int | Iterable[int] | None = None,
    /,
    *,
    top_k: int = 8,
    rows: int | Sequence[int] | None = (-1,),
    token_rows: int | Sequence[int] | None = None,
    kind: str = "inter",
    absolute: bool = False,
    compute_dtype: torch.dtype | str | None = None,
    truncate: bool = False,
    progress: bool | None = None,
    **inputs,
) -> Summary:
    """Contribution summaries of every requested layer, without a ``[head, query, key]`` tensor of the input.

    The summary mode of :func:`cwcore.decompose` for long documents: the same inputs, ``layers``,
    ``compute_dtype`` and ``truncate``, and the same checks and refusals; instead of the maps it keeps, per
    layer (:class:`LayerSummary`), what each key receives over all queries, the ``top_k`` (head, key) terms
    of every query (ranked by c, or by |c| with ``absolute``), the full ``[head, key]`` rows of the query
    positions ``rows`` among each layer's own queries (an encoder-decoder's decoder and cross-attention layers:
    the decoder's tokens; negative positions count from the end: -1 is the last token; a position that is padding
    in some sequence gives that sequence a NaN row, with a warning) and the head-aggregated rows of
    ``token_rows`` (default: the same positions). ``kind``: ``"inter"`` (c against the combined
    output o_i) or ``"intra"`` (against the head's own o^h_i). Every summary equals the reduction of
    :func:`cwcore.decompose`'s tensors to float32 rounding. Memory: the model's forward plus, per layer,
    O(query * top_k + head * key * rows), and one block of ``[head, block, key]`` while a layer runs. Time: a
    model configured for SDPA keeps its own attention output and the summary adds the scores and the inner
    products <o_i, v~_j> of every allowed pair (two attention-sized products a layer); configured ``eager``, the
    summary computes alpha V itself instead of the SDPA call (SmolLM2 135M at 8,192 tokens, one thread: 2.6x the
    SDPA forward's time configured SDPA, 2.1x configured eager; sliding layers cost only their window).
    ``progress``: a bar over the layers on stderr (None: only for inputs of at least :data:`PROGRESS_TOKENS`
    tokens, batch times sequence).
    """
    if kind not in ("inter", "intra"):
        raise InputError(f"kind must be 'inter' or 'intra', got {kind!r}")
    if not isinstance(absolute, bool):
        raise InputError(f"absolute must be True or False, got {absolute!r}")
    if progress is not None and not isinstance(progress, bool):
        raise InputError(f"progress must be True, False or None, got {progress!r}")
    top_k = check_count(top_k, "top_k")
    model, layers, inputs = positional_inputs(model, layers, inputs, "summarize", own_options(summarize))
    model, blocks, wanted, undecomposable = select_layers(model, layers, "summarize", "summarised")
    num_layers = len(blocks)
    compute_dtype = default_compute_dtype(model) if compute_dtype is None else check_compute_dtype(compute_dtype)
    inputs = prepare_inputs(model, check_inputs(model, inputs, caller="summarize", truncate=truncate,
                                               options=own_options(summarize)))
    reference = inputs.get("input_ids", inputs.get("inputs_embeds"))  # None for pixels or audio features
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    # positions as given: each layer reads them against its own queries (a decoder's are not input_ids'); checked
    # here against the input where every layer's queries are its tokens
    row_positions = query_positions_as_given(rows, "rows")
    token_positions = row_positions if token_rows is None else query_positions_as_given(token_rows, "token_rows")
    if reference is not None and not encoder_decoder:
        query_positions(row_positions, reference.shape[1], "rows")
        query_positions(token_positions, reference.shape[1], "token_rows")
    _warn_padded_rows(inputs, row_positions + token_positions)
    session = SummarySession(model, wanted, top_k=top_k, rows=row_positions, token_rows=token_positions, kind=kind,
                             absolute=absolute, compute_dtype=compute_dtype)
    decoder_mask = inputs.get("decoder_attention_mask")  # the padding of an encoder-decoder's cross-attention queries
    if isinstance(decoder_mask, torch.Tensor) and decoder_mask.dim() == 2:
        session.decoder_query_valid = decoder_mask.bool()
    tokens = None if reference is None else reference.shape[0] * reference.shape[1]
    if progress or (progress is None and tokens is not None and tokens >= PROGRESS_TOKENS):
        from tqdm.auto import tqdm

        session.bar = tqdm(total=len(wanted), desc="summarize" + (f" ({tokens} tokens)" if tokens else ""),
                           unit="layer", leave=False)
    try:
        with torch.inference_mode(), cwcore_attention(model, session):
            outputs = model(**inputs)
    finally:
        if session.bar is not None:
            session.bar.close()
    undecomposable = {**undecomposable,
                      **layers_not_run(blocks, wanted, session.summaries, layers, "summarize", "summarised")}
    return Summary(session.summaries, outputs, inputs.get("attention_mask"), num_blocks=num_layers,
                   undecomposable=undecomposable)


# -- the same summaries from a dense decomposition (the reference the tests and the benchmark compare with) --
def dense_summary(layer, attention_mask=None, *, top_k: int = 8, rows=(-1,), token_rows=None, kind: str = "inter",
                  absolute: bool = False) -> LayerSummary:
    """The :class:`LayerSummary` that :func:`summarize` would give, reduced from a dense
    :class:`~cwcore.core.decomposition.LayerDecomposition` ``layer`` (``attention_mask`` ``[batch, query]`` of
    its input, or None). Holds ``[batch, head, query, key]`` tensors: for inputs the dense path can hold."""
    c = layer.contribution(kind)  # [batch, head, query, key], padded query rows NaN
    alpha = layer.attention
    batch, heads, q_len, k_len = c.shape
    real = (torch.ones(batch, q_len, dtype=torch.bool, device=c.device) if attention_mask is None
            else attention_mask.bool().to(c.device))
    keep = real[:, None, :, None]
    contribution_received = torch.where(keep, c, 0.0).sum(2)
    attention_received = torch.where(keep, alpha, 0.0).sum(2)
    ranking = (c.abs() if absolute else c.clone()).masked_fill((alpha == 0) | c.isnan(), float("-inf"))
    ranking = ranking.permute(0, 2, 1, 3).reshape(batch, q_len, heads * k_len)
    taken = min(top_k, heads * k_len)
    best, index = ranking.topk(taken, dim=-1)
    order = _canonical_order(best, index // k_len, index % k_len)
    best, index = best.gather(-1, order), index.gather(-1, order)
    head_of, key_of = index // k_len, index % k_len
    kept = (best != float("-inf")) & real[..., None]
    relative, cosine = layer.relative_norm(kind), layer.cosine(kind)
    b_of = torch.arange(batch)[:, None, None]
    q_of = torch.arange(q_len)[None, :, None]
    nan = torch.tensor(float("nan"), dtype=c.dtype)

    def gathered(values):
        out = torch.full((batch, q_len, top_k), float("nan"), dtype=c.dtype)
        out[..., :taken] = torch.where(kept, values[b_of, head_of, q_of, key_of], nan)
        return out

    def indices(values):
        out = torch.full((batch, q_len, top_k), -1, dtype=torch.long)
        out[..., :taken] = torch.where(kept, values, -1)
        return out

    top = TopTerms(indices(head_of), indices(key_of), gathered(c), gathered(alpha), gathered(relative), gathered(cosine))
    row_positions = query_positions(rows, q_len, "rows")
    token_positions = row_positions if token_rows is None else query_positions(token_rows, q_len, "token_rows")
    full = {"contribution": c, "attention": alpha, "relative_norm": relative, "cosine": cosine}
    row_values = {name: values[:, :, list(row_positions)] for name, values in full.items()}
    for name in ROW_FIELDS:  # padded query rows are NaN throughout, as in the summary
        row_values[name] = row_values[name].masked_fill(~real[:, None, list(row_positions), None], float("nan"))
    token = {"contribution": c[:, :, list(token_positions)].sum(1),
             "attention": alpha[:, :, list(token_positions)].mean(1)}
    norm = layer.output_norm.masked_fill(~real, float("nan"))
    head_norm = layer.head_output_norm.masked_fill(~real[:, None], float("nan"))
    return LayerSummary(layer.layer, layer.block_name, kind, contribution_received, attention_received, top,
                        row_positions, row_values, token_positions, token, layer.value_norm, head_norm, norm,
                        layer.output_bias)


def summary_fields(summary: LayerSummary) -> dict[str, torch.Tensor]:
    """Every tensor of a :class:`LayerSummary` by name (``top.<field>``, ``rows.<name>``, ``token_rows.<name>``)."""
    out = {"contribution_received": summary.contribution_received, "attention_received": summary.attention_received,
           "value_norm": summary.value_norm, "head_output_norm": summary.head_output_norm,
           "output_norm": summary.output_norm}
    out.update({f"top.{name}": getattr(summary.top, name) for name in ("head", "key", *ROW_FIELDS)})
    out.update({f"rows.{name}": values for name, values in summary.rows.items()})
    out.update({f"token_rows.{name}": values for name, values in summary.token_rows.items()})
    return out


def dense_terms(layer, top: TopTerms, kind: str = "inter") -> TopTerms:
    """The dense decomposition's c, alpha, relative norm and cosine of the (head, key) terms ``top`` names
    (NaN where it names none): the values of the terms a summary chose, read from the dense tensors."""
    heads, keys = top.head, top.key
    batch, queries, _ = heads.shape
    named = heads >= 0
    b_of = torch.arange(batch)[:, None, None].expand_as(heads)
    q_of = torch.arange(queries)[None, :, None].expand_as(heads)
    h_of, k_of = heads.clamp_min(0), keys.clamp_min(0)
    values = {"contribution": layer.contribution(kind), "attention": layer.attention,
              "relative_norm": layer.relative_norm(kind), "cosine": layer.cosine(kind)}
    read = {name: torch.where(named, v[b_of, h_of, q_of, k_of], torch.tensor(float("nan"), dtype=v.dtype))
            for name, v in values.items()}
    return TopTerms(heads, keys, **read)


def relative_differences(summary: LayerSummary, reference: LayerSummary, dense=None) -> dict[str, float]:
    """Per tensor, max |summary - reference| / max |reference| over the entries finite in both (the absolute
    difference where the reference is all zero); ``inf`` where the NaN patterns differ. For the indices
    ``top.head`` and ``top.key``: the share of entries that differ.

    With ``dense`` (the :class:`~cwcore.core.decomposition.LayerDecomposition` ``reference`` was reduced from),
    two terms whose c agree to rounding may be ranked in either order, so the top terms are compared as
    ``top.contribution`` (the k largest values, rank by rank, against the reference's) and ``top.<field>``
    against the dense values of the terms the summary chose (:func:`dense_terms`)."""
    out = {}
    mine, theirs = summary_fields(summary), summary_fields(reference)
    if dense is not None:
        chosen = dense_terms(dense, summary.top, summary.kind)
        for name in ROW_FIELDS:
            theirs[f"top.{name}"] = getattr(chosen, name)
        theirs["top.rank_values"], mine["top.rank_values"] = reference.top.contribution, summary.top.contribution
    for name, expected in theirs.items():
        got = mine[name].to(expected.device)
        if got.shape != expected.shape:
            out[name] = float("inf")
        elif not expected.is_floating_point():
            out[name] = float((got != expected).double().mean()) if expected.numel() else 0.0
        elif not torch.equal(torch.isnan(got), torch.isnan(expected)):
            out[name] = float("inf")
        else:
            finite = torch.isfinite(expected) & torch.isfinite(got)
            scale = expected[finite].abs().max() if bool(finite.any()) else torch.tensor(0.0)
            difference = (got[finite] - expected[finite]).abs().max() if bool(finite.any()) else torch.tensor(0.0)
            out[name] = float(difference / scale) if float(scale) > 0 else float(difference)
    return out
