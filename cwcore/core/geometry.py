"""The geometry of one attention block: projected value vectors and the weights built on them.

Everything here works in *head space*: with W_O^h the head's slice of the output projection
(``[model, head_dim]``) and its Gram matrix G_h = W_O^h^T W_O^h, every inner product between projected
value vectors v~_j = W_O^h v_j and outputs o_i can be computed without materialising
``[query, key, model]`` tensors:

    <o^h_i, v~^h_j> = z^h_i^T G_h v^h_j        (z^h_i = sum_j alpha_ij v^h_j, the head's mixed value)
    <o_i,   v~^h_j> = (W_O^h^T o_i)^T v^h_j    (o_i = sum_h W_O^h z^h_i, the block output without bias)

so the extra cost is a few attention-sized matrix products. :func:`naive_geometry` materialises the
terms alpha_ij v~_j and serves as the independent reference in the tests.
"""

from __future__ import annotations

import torch

__all__ = ["HeadSpaceGeometry", "head_space_geometry", "naive_geometry", "split_output_projection"]


def split_output_projection(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-head slices of an output projection.

    ``weight``: ``[model, head * head_dim]`` (``nn.Linear`` layout, y = W x).
    Returns ``[head, model, head_dim]``.
    """
    model_dim, inner = weight.shape
    if inner % num_heads:
        raise ValueError(f"output projection width {inner} is not divisible by {num_heads} heads")
    return weight.reshape(model_dim, num_heads, inner // num_heads).permute(1, 0, 2)


class HeadSpaceGeometry:
    """The geometry of one layer, from which every metric is derived.

    Stored: ``attention`` ``[batch, head, query, key]``, ``value_norm`` ||v~_j|| ``[batch, head, key]``,
    ``head_output_norm`` ||o^h_i|| ``[batch, head, query]``, ``output_norm`` ||o_i|| ``[batch, query]``,
    ``output`` o_i ``[batch, query, model]`` (combined over heads, no bias) and, when built by
    :func:`head_space_geometry`, the head-space ``values`` ``[batch, head, key, head_dim]``, mixed values
    ``mixed`` z^h_i ``[batch, head, query, head_dim]`` and per-head ``w_o`` ``[head, model, head_dim]``.

    The attention-sized inner products ``intra_dot`` = <o^h_i, v~^h_j> and ``inter_dot`` = <o_i, v~^h_j>
    (``[batch, head, query, key]``) are computed when read (:meth:`scaled_dot`), never stored, so a
    decomposition keeps one attention-sized tensor per layer (``attention``) and reading a weight adds one.
    """

    def __init__(self, attention, value_norm=None, head_output_norm=None, output_norm=None, intra_dot=None,
                 inter_dot=None, output=None, *, values=None, mixed=None, w_o=None, key_spans=None):
        self.attention = attention
        self.values, self.mixed, self.w_o = values, mixed, w_o
        #: per batch row, the query blocks ``(start, stop, first, limit)`` outside whose keys ``first:limit``
        #: alpha is exactly 0 (from the blockwise softmax; None: unknown), so weights multiplied by alpha
        #: skip those keys
        self.key_spans = key_spans
        # o_i and the norms left None are computed from values/mixed/w_o when first read (a forward that
        # records every layer pays for them only where they are used); assigning one replaces it
        self._output = output
        self._value_norm, self._head_output_norm, self._output_norm = value_norm, head_output_norm, output_norm
        self._intra_dot, self._inter_dot = intra_dot, inter_dot
        self._gram = None

    @property
    def output(self) -> torch.Tensor | None:
        """o_i ``[batch, query, model]`` (no bias): given, adopted from the model's own output projection by
        the self-check (which verifies it equals sum_h W_O^h z^h_i), or computed here when first read."""
        if self._output is None and self.mixed is not None and self.w_o is not None:
            batch, heads, queries, head_dim = self.mixed.shape
            # the output projection's own product ([query, head * head_dim] x W_O^T)
            flat = self.mixed.transpose(1, 2).reshape(batch, queries, heads * head_dim)
            self._output = flat @ self.flat_w_o().T
        return self._output

    @output.setter
    def output(self, value: torch.Tensor) -> None:
        self._output = value

    @property
    def output_pending(self) -> bool:
        """Whether o_i is still to be computed (nobody read or assigned it yet)."""
        return self._output is None and self.mixed is not None and self.w_o is not None

    def flat_w_o(self) -> torch.Tensor:
        """W_O ``[model, head * head_dim]`` (``nn.Linear`` layout), a view of ``w_o``."""
        heads, model_dim, head_dim = self.w_o.shape
        return self.w_o.permute(1, 0, 2).reshape(model_dim, heads * head_dim)

    @property
    def gram(self) -> torch.Tensor:
        """G_h = W_O^h^T W_O^h ``[head, head_dim, head_dim]``."""
        if self._gram is None:
            self._gram = self.w_o.transpose(1, 2) @ self.w_o
        return self._gram

    @staticmethod
    def _gram_norm(vectors: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
        """||W_O^h x|| = sqrt(x^T G_h x) for head-space vectors ``[batch, head, n, head_dim]``."""
        return ((vectors @ gram) * vectors).sum(-1).clamp_min(0).sqrt()

    @property
    def value_norm(self) -> torch.Tensor:
        """||v~_j|| ``[batch, head, key]``."""
        if self._value_norm is None:
            self._value_norm = self._gram_norm(self.values, self.gram)
        return self._value_norm

    @value_norm.setter
    def value_norm(self, value: torch.Tensor) -> None:
        self._value_norm = value

    @property
    def head_output_norm(self) -> torch.Tensor:
        """||o^h_i|| ``[batch, head, query]``."""
        if self._head_output_norm is None:
            self._head_output_norm = self._gram_norm(self.mixed, self.gram)
        return self._head_output_norm

    @head_output_norm.setter
    def head_output_norm(self, value: torch.Tensor) -> None:
        self._head_output_norm = value

    @property
    def output_norm(self) -> torch.Tensor:
        """||o_i|| ``[batch, query]``."""
        if self._output_norm is None:
            self._output_norm = self.output.norm(dim=-1)
        return self._output_norm

    @output_norm.setter
    def output_norm(self, value: torch.Tensor) -> None:
        self._output_norm = value

    @property
    def intra_dot(self) -> torch.Tensor:
        """<o^h_i, v~^h_j> ``[batch, head, query, key]`` (a new tensor unless given at construction)."""
        if self._intra_dot is not None:
            return self._intra_dot
        return self.scaled_dot("intra")

    @property
    def inter_dot(self) -> torch.Tensor:
        """<o_i, v~^h_j> ``[batch, head, query, key]`` (a new tensor unless given at construction)."""
        if self._inter_dot is not None:
            return self._inter_dot
        return self.scaled_dot("inter")

    def pulled_back(self) -> torch.Tensor:
        """W_O^h^T o_i ``[batch, head, query, head_dim]``: the combined output seen from each head's space."""
        batch, queries, _ = self.output.shape
        heads, _, head_dim = self.w_o.shape
        # one [query, model] x [model, head * head_dim] product (the output projection's size), not a
        # batched einsum that first copies W_O into head-major order
        flat = self.output @ self.flat_w_o()
        return flat.view(batch, queries, heads, head_dim).transpose(1, 2)

    def _sides(self, kind: str, divisor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(query side ``[batch, head, query, head_dim]`` divided by ``divisor``, key side ``[batch, head, key,
        head_dim]``) whose product is the inner product of ``kind``."""
        if kind == "intra":
            side, keys = self.mixed, self.values @ self.gram  # z^T G v (G symmetric)
            if divisor is not None:
                side = side / divisor[..., None]
        else:
            side, keys = self.pulled_back(), self.values
            if divisor is not None:
                side.div_(divisor[:, None, :, None])  # a fresh tensor: divided in place
        return side, keys

    def _check_kind(self, kind: str) -> torch.Tensor | None:
        if kind not in ("intra", "inter"):
            raise ValueError(f"kind must be 'intra' or 'inter', not {kind!r}")
        return self._intra_dot if kind == "intra" else self._inter_dot

    def scaled_dot(self, kind: str, divisor: torch.Tensor | None = None) -> torch.Tensor:
        """<o_i, v~^h_j> / divisor (``kind="inter"``) or <o^h_i, v~^h_j> / divisor (``"intra"``), a new
        ``[batch, head, query, key]`` tensor.

        ``divisor`` (one number per query: ``[batch, query]`` for inter, ``[batch, head, query]`` for
        intra) divides the query side before the product, so the result is the only attention-sized
        tensor this allocates (no quotient of a second one).
        """
        given = self._check_kind(kind)
        if given is not None:  # built with explicit inner products (naive_geometry)
            if divisor is None:
                return given.clone()
            return given / (divisor[:, None, :, None] if kind == "inter" else divisor[..., None])
        side, keys = self._sides(kind, divisor)
        return side @ keys.transpose(-1, -2)

    def weighted_dot(self, kind: str, divisor: torch.Tensor | None = None) -> torch.Tensor:
        """alpha_ij times :meth:`scaled_dot`, a new ``[batch, head, query, key]`` tensor (the only
        attention-sized one allocated).

        Where ``key_spans`` says alpha is exactly 0 (keys a causal mask hides from a block of queries) the
        inner products are not computed: those weights are 0, as alpha times a finite number is; if either
        side holds a non-finite number, everything is computed (NaN times 0 stays NaN).
        """
        given = self._check_kind(kind)
        if given is not None or self.key_spans is None:
            return self.scaled_dot(kind, divisor).mul_(self.attention)
        side, keys = self._sides(kind, divisor)
        if not (all_finite(side) and all_finite(keys)):
            return (side @ keys.transpose(-1, -2)).mul_(self.attention)
        out = torch.empty(self.attention.shape, dtype=side.dtype, device=side.device)
        keys_t = keys.transpose(-1, -2)
        for b, blocks in enumerate(self.key_spans):
            for start, stop, first, limit in blocks:
                target = out[b, :, start:stop]  # [head, block, key]
                # the product into a fresh block, then alpha times it into the strided target in one pass: a
                # product written straight into a strided view ran at a third of the speed, then was copied
                product = torch.matmul(side[b, :, start:stop], keys_t[b, :, :, first:limit])
                torch.mul(product, self.attention[b, :, start:stop, first:limit], out=target[..., first:limit])
                target[..., :first] = 0.0
                target[..., limit:] = 0.0
        return out

    def to(self, *args, **kwargs) -> "HeadSpaceGeometry":
        """A copy with every tensor moved/cast (``.to("cpu")``, ``.to(torch.float64)``)."""
        def move(t):
            return None if t is None else t.to(*args, **kwargs)

        return HeadSpaceGeometry(
            move(self.attention), move(self._value_norm), move(self._head_output_norm), move(self._output_norm),
            move(self._intra_dot), move(self._inter_dot), move(self._output),
            values=move(self.values), mixed=move(self.mixed), w_o=move(self.w_o), key_spans=self.key_spans,
        )


def head_space_geometry(
    attention: torch.Tensor,
    values: torch.Tensor,
    w_o: torch.Tensor,
    mixed: torch.Tensor | None = None,
    key_spans=None,
) -> HeadSpaceGeometry:
    """The geometry of one layer, computed in head space.

    attention: ``[batch, head, query, key]``; values: ``[batch, head, key, head_dim]`` (already
    repeated for grouped-query attention, bias included); w_o: ``[head, model, head_dim]``.
    All inputs must share one floating dtype (float32 or float64). ``mixed``: ``attention @ values``
    ``[batch, head, query, head_dim]`` when already computed (the layer's own output); ``key_spans``:
    where alpha is exactly 0, see :class:`HeadSpaceGeometry`.
    """
    if mixed is None:
        mixed = attention @ values  # z^h_i: [b, h, q, d]
    # o_i and the norms ||v~_j||, ||o^h_i||, ||o_i|| are computed when first read
    return HeadSpaceGeometry(attention, values=values, mixed=mixed, w_o=w_o, key_spans=key_spans)


def naive_geometry(attention: torch.Tensor, values: torch.Tensor, w_o: torch.Tensor) -> HeadSpaceGeometry:
    """Reference implementation: materialises every term alpha_ij v~_j in model space.

    Memory ``[batch, head, query, key, model]``: for tests and small inputs only.
    """
    projected = torch.einsum("bhkd,hmd->bhkm", values, w_o)  # v~^h_j
    terms = attention[..., None] * projected[:, :, None]  # [b, h, q, k, m]
    head_outputs = terms.sum(3)  # o^h_i: [b, h, q, m]
    output = head_outputs.sum(1)  # o_i: [b, q, m]
    return HeadSpaceGeometry(
        attention=attention,
        value_norm=projected.norm(dim=-1),
        head_output_norm=head_outputs.norm(dim=-1),
        output_norm=output.norm(dim=-1),
        intra_dot=torch.einsum("bhqm,bhkm->bhqk", head_outputs, projected),
        inter_dot=torch.einsum("bqm,bhkm->bhqk", output, projected),
        output=output,
    )


#: Random directions of the projected self-check (:func:`projected_check`, and the summary's check of alpha), fixed for reproducibility.
PROBES = 8
_PROBE_CACHE: dict = {}


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, in one reduction without a temporary: a NaN or an infinity makes
    the sum NaN or infinite. A sum of finite entries that overflows reads as False, the safe side (the
    callers then take their slower path, exact either way)."""
    return bool(torch.isfinite(tensor.sum()))


def probe_directions(dim: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[dim, PROBES]`` standard normal directions, the same in every process (seed 0)."""
    key = (dim, dtype, str(device))
    if key not in _PROBE_CACHE:
        _PROBE_CACHE[key] = torch.randn(dim, PROBES, generator=torch.Generator().manual_seed(0),
                                        dtype=torch.float64).to(dtype=dtype, device=device)
    return _PROBE_CACHE[key]


def projected_check(geometry: HeadSpaceGeometry, output: torch.Tensor, bias: torch.Tensor | None):
    """The self-check on ``PROBES`` random directions r (Freivalds' test): compares the projection's output
    y_i with sum_h W_O^h z^h_i + b, the terms' sum, along each r: y_i r against z_i (W_O^T r) + b r.

    Returns (max |difference| / max |y|, whether every row is finite, o_i = y - b ``[batch, query, model]``).
    A difference e_i != 0 shows along a standard normal r as e_i r ~ N(0, ||e_i||^2), at least its largest
    entry in size with high probability over 8 directions and every query: as strict as comparing entries,
    at the cost of 8 columns instead of a [query, head * head_dim] x W_O^T product.
    """
    mixed, w_o = geometry.mixed, geometry.w_o
    batch, heads, queries, head_dim = mixed.shape
    actual = output.detach().reshape(batch * queries, -1)  # [n, model]
    probes = probe_directions(actual.shape[-1], actual.dtype, actual.device)
    # per head, without copying z or W_O into [query, head * head_dim] order: z^h (W_O^h^T r), summed
    rebuilt = (mixed @ (w_o.transpose(1, 2) @ probes)).sum(1).reshape(batch * queries, -1)  # [n, probes]
    if bias is not None:
        bias = bias.detach().to(actual.dtype)
        rebuilt += bias @ probes
    projected = actual @ probes
    # max |y| (NaN propagates); linalg's inf-norm took about five times as long on a [512, 576] output
    scale = actual.abs().amax().clamp_min(torch.finfo(actual.dtype).tiny)
    error = float(((projected - rebuilt).abs().max() / scale).nan_to_num(float("inf")))
    finite = all_finite(projected) and all_finite(rebuilt)
    adopted = actual.clone() if bias is None else actual - bias
    return error, finite, adopted.view(batch, queries, -1)


def output_difference(computed: torch.Tensor, own: torch.Tensor, rows_valid: torch.Tensor | None) -> float:
    """max |computed - own| / max |own| over the query rows that see a key (``rows_valid`` ``[batch, query]``,
    None: every row), both ``[batch, query, ...]``: a row that sees no key (padding) is no token, and the two
    implementations fill it differently. NaN or inf where a compared entry is not finite."""
    dtype = torch.promote_types(own.dtype, torch.float32)  # a float64 model's differences are below float32's rounding
    computed, own = computed.detach().to(dtype), own.detach().to(dtype)
    if rows_valid is not None:
        shape = rows_valid.shape + (1,) * (own.dim() - 2)
        keep = rows_valid.to(own.device).reshape(shape)
        computed, own = torch.where(keep, computed, 0.0), torch.where(keep, own, 0.0)
    return relative_error(computed, own)


def relative_error(computed: torch.Tensor, reference: torch.Tensor) -> float:
    """max |computed - reference| / max |reference| (inf where not finite): the one measure of both checks."""
    scale = reference.abs().max().clamp_min(torch.finfo(reference.dtype).tiny)
    return float(((computed - reference).abs().max() / scale).nan_to_num(float("inf")))


def full_check(call, geometry: HeadSpaceGeometry, output: torch.Tensor,
               bias: torch.Tensor | None) -> tuple[float, bool]:
    """The entrywise self-check of a layer call (a :class:`~cwcore.core.layer_call.LayerCall`): (max |o_i + b -
    projection's output| / max |output|, whether every real token's row is finite)."""
    rebuilt = geometry.output if bias is None else geometry.output + bias.detach().to(geometry.output.dtype)
    return rebuilt_error(rebuilt, output, call.valid_queries())


def rebuilt_error(rebuilt: torch.Tensor, output: torch.Tensor, valid: torch.Tensor | None) -> tuple[float, bool]:
    """(max |rebuilt - output| / max |output| over the real rows, whether every real row of ``rebuilt`` is
    finite): ``rebuilt`` ``[batch, query, model]`` is sum_h W_O^h z^h_i plus the bias, ``output`` the output
    projection's result, ``valid`` ``[batch, query]`` the real queries (None: all). Padded rows are NaN by
    design and no token: compared as zeros (the model may leave them NaN: float64 eager, left padding)."""
    actual = output.detach().to(rebuilt.dtype).reshape(rebuilt.shape)
    rows = torch.isfinite(rebuilt).all(-1)
    if valid is not None:
        rows = rows | ~valid  # ...but a NaN in a real token's row is an error
        rebuilt, actual = torch.where(valid[..., None], rebuilt, 0.0), torch.where(valid[..., None], actual, 0.0)
    return relative_error(rebuilt, actual), bool(rows.all())
