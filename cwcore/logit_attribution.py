"""Signed direct logit attribution per (layer, head, query, source token), computed in head space.

The term alpha_ij v~_j (v~_j = W_O^h v_j) moves the logit of token t along the direct path by

    DLA^h_ij(t) = alpha_ij <W_U[t], L_i(v~_j)> = alpha_ij (W_O^h^T e_i(t)) . v_j,
    e_i(t) = P (g * W_U[t]) / s_i      (P the centring projection; P = I for an RMSNorm)

where L_i is the linear part of the final norm (and of a sandwich model's post-attention norm) with
its scale **frozen at the clean run's value** (the standard convention; biases belong to no term).
One pull-back per (head, query), no model-sized tensor per (query, key). :func:`logit_attribution`
checks that the frozen linearisation reproduces the model's logits (softcapping does not) and raises
:class:`~cwcore.core.architectures.UnsupportedModelError` where it does not. The default target of
query i is the next token, at the last position the model's top prediction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from .core.architectures import (UnsupportedModelError, execution_device, final_norm, has_cross_attention,
                                 materialised, post_attention_norms, residual_multiplier, text_config)
from .core.decomposition import Decomposition, decompose
from .core.attention import default_compute_dtype
from .core.inputs import InputError, InputTypeError, check_compute_dtype, check_inputs, check_targets

__all__ = ["FrozenNorm", "LogitAttribution", "logit_attribution", "direct_logit_attribution", "frozen_norm",
           "frozen_norm_on", "norm_at_float32", "naive_logit_attribution"]


@dataclass
class FrozenNorm:
    """The linear part of a norm at fixed statistics: ``y = gain * P(x) / scale[b, q] + bias``."""

    gain: torch.Tensor  # [model]
    centred: bool  # P is the centring projection (LayerNorm) rather than the identity (RMSNorm)
    scale: torch.Tensor  # [batch, query]: the clean run's s_i
    bias: torch.Tensor  # [model]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True) if self.centred else x

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen linear part applied to model-space vectors ``[batch, query, ..., model]`` (no bias)."""
        scale = self.scale.reshape(*self.scale.shape, *([1] * (x.dim() - 3)), 1)
        return self.gain * self.project(x) / scale

    def pull_back(self, direction: torch.Tensor) -> torch.Tensor:
        """The adjoint: ``<direction, apply(x)> = <pull_back(direction), x>`` for ``direction [batch, query, model]``."""
        return self.project(self.gain * direction) / self.scale[..., None]


def norm_at_float32(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``norm(x)`` at float32 precision at least where the module takes such input whatever its weights' dtype
    (RMSNorms do: a bf16 output would round it), else in the norm's own dtype (a half-precision LayerNorm takes
    no other); in the dtype it was computed in."""
    own = next(norm.parameters(), x).dtype
    try:
        return norm(x.to(torch.promote_types(own, torch.float32)))
    except RuntimeError:
        return norm(x.to(own))


def frozen_norm(norm: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor, dtype=torch.float64,
                tolerance: float | None = None) -> FrozenNorm:
    """A norm ``g * P(x) / s(x) + b`` (RMSNorm with ``weight`` or ``1 + weight``, LayerNorm) read by probing,
    its scales fitted on the clean run's ``inputs``/``outputs [batch, query, model]``; else :class:`UnsupportedModelError`."""
    width = inputs.shape[-1]
    if width % 2:
        raise UnsupportedModelError(f"direct logit attribution: model width {width} is odd, the norm probe needs it even")
    param = next(norm.parameters(), inputs)
    with torch.no_grad():  # on the device the norm runs on (an offloaded norm's weights are on the meta device)
        probe = torch.zeros(2, width, dtype=param.dtype, device=execution_device(norm) or param.device)
        probe[1] = 1.0
        probe[1, 1::2] = -1.0  # alternating +-1: mean zero, mean square one, so P z = z either way
        bias, response = norm_at_float32(norm, probe[None]).to(dtype)[0]  # a bf16 output would round the gain
    sign = probe[1].to(dtype)
    gain = (response - bias) * sign  # g / sqrt(1 + eps); the fitted scales absorb the sqrt(1 + eps)
    x, y = inputs.to(dtype), outputs.to(dtype) - bias
    best = None
    for centred in (False, True):
        u = gain * (x - x.mean(-1, keepdim=True) if centred else x)
        scale = (u * u).sum(-1) / (u * y).sum(-1)  # least squares for y = u / s
        error = ((y - u / scale[..., None]).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30)).max().item()
        if best is None or error < best[0]:
            best = (error, FrozenNorm(gain, centred, scale, bias))
    if tolerance is None:
        tolerance = 1e-3 if param.dtype in (torch.float32, torch.float64) else 5e-2
    if not best[0] <= tolerance:
        raise UnsupportedModelError(
            f"direct logit attribution: {type(norm).__name__} is not of the form g * P(x) / s + b "
            f"(relative error {best[0]:.2g} > {tolerance:g})")
    return best[1]


def frozen_norm_on(real: torch.Tensor | None, norm: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                   dtype=torch.float64) -> FrozenNorm:
    """:func:`frozen_norm` fitted on the ``real [batch, query]`` tokens only (a padding row may be NaN, as SDPA
    gives a query that sees no key), its scale NaN on the others."""
    if real is None or bool(real.all()):
        return frozen_norm(norm, inputs, outputs, dtype=dtype)
    fitted = frozen_norm(norm, inputs[real][None], outputs[real][None], dtype=dtype)
    scale = torch.full(real.shape, float("nan"), dtype=fitted.scale.dtype, device=fitted.scale.device)
    scale[real] = fitted.scale[0]
    return FrozenNorm(fitted.gain, fitted.centred, scale, fitted.bias)


def _final_norm(model: nn.Module) -> nn.Module:
    try:
        return final_norm(model)
    except UnsupportedModelError as error:
        raise UnsupportedModelError(f"direct logit attribution: {error}") from None


def _unembedding(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise UnsupportedModelError(
            f"direct logit attribution needs an unembedding: {type(model).__name__} has no language-model head")
    return head


@dataclass
class LogitAttribution:
    """Direct logit attribution of one forward pass: ``by_layer[l]`` ``[batch, head, query, key]`` toward
    ``targets[b, i]``, the pass's ``decomposition``, the frozen ``final_norm`` and ``post_norms``."""

    by_layer: dict[int, torch.Tensor]
    targets: torch.Tensor  # [batch, query]
    decomposition: Decomposition
    final_norm: FrozenNorm
    post_norms: dict[int, FrozenNorm]
    unembedding: torch.Tensor  # [vocab, model]
    residual_multiplier: float = 1.0  # the factor on the attention output's way into the residual stream

    def __getitem__(self, layer: int) -> torch.Tensor:
        """``[batch, head, query, key]`` of ``layer`` (negative numbers count from the model's last block)."""
        return self.by_layer[self.decomposition[layer].layer]

    def token_level(self, layer: int) -> torch.Tensor:
        """``[batch, query, key]``: summed over heads."""
        return self[layer].sum(1)


def direct_logit_attribution(layer, directions: torch.Tensor, post_norm: FrozenNorm | None = None,
                             multiplier: float = 1.0) -> torch.Tensor:
    """Head-space DLA ``[batch, head, query, key]`` = m alpha_ij (W_O^h^T e_i) . v_j of one layer decomposition;
    ``directions [batch, query, model]``: e_i; ``multiplier`` m: the residual multiplier (Granite's)."""
    geometry = layer.geometry
    e = directions.to(geometry.values.dtype) * multiplier
    if post_norm is not None:
        e = post_norm.pull_back(e.to(post_norm.gain.dtype)).to(e.dtype)
    pulled = torch.einsum("bqm,hmd->bhqd", e, geometry.w_o)  # W_O^h^T e_i
    return geometry.attention * (pulled @ geometry.values.transpose(-1, -2))


def _default_targets(input_ids: torch.Tensor, logits: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """``[batch, query]``: the next token, and the top prediction at each sequence's last real token (``real``
    ``[batch, query]`` bool or None: the last column; right padding puts it earlier)."""
    targets = input_ids.roll(-1, dims=1)  # the last column's is replaced below, or a padding row's (NaN rows)
    length = input_ids.shape[1]
    last = (torch.full((input_ids.shape[0],), length - 1, device=input_ids.device) if real is None
            else length - 1 - real.to(input_ids.device).flip(-1).int().argmax(-1))
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    targets[rows, last] = logits.to(input_ids.device)[rows, last].argmax(-1)
    return targets


def logit_attribution(model: nn.Module, targets: int | torch.Tensor | None = None,
                      layers: int | Iterable[int] | None = None, compute_dtype: torch.dtype | None = None,
                      **inputs) -> LogitAttribution:
    """Decompose a forward pass and attribute the target logits to every (layer, head, query, key).
    ``targets``: None (next token; the top prediction at each sequence's last real token), one id, or
    ``[batch, query]`` ids. With an
    ``attention_mask``, the norms are fitted and the logits checked on the real tokens; a padding token's
    query row is NaN. ``compute_dtype``: float32 or float64 (None: the model's own for a float64 model, else
    float32, as :func:`~cwcore.decompose`); ``truncate=True`` keeps the first tokens of an input longer than the
    model's context (refused otherwise)."""
    if isinstance(targets, Mapping):  # logit_attribution(model, tokenizer(text)): the inputs given as targets
        raise InputError("logit_attribution(model, inputs): the second positional argument is targets; pass the "
                         "tokenizer's output as keywords, logit_attribution(model, **inputs)")
    if inputs.get("input_ids") is None:
        raise InputError("logit_attribution needs input_ids (the targets are token ids at their positions; "
                         "inputs_embeds alone are not enough)")
    for keyword, why in (("return_dict", "the logits are read from the model's output by name, to check the "
                          "attribution against them"),
                         ("logits_to_keep", "every position's logits are attributed and checked")):
        if keyword in inputs:
            raise InputError(f"logit_attribution: leave {keyword} out ({why})")
    if has_cross_attention(model):  # the norms are probed and the targets built over one stack's input_ids
        raise UnsupportedModelError(f"direct logit attribution: {type(model).__name__} has cross-attention (an "
                                    "encoder-decoder): the decoder's logits are not over input_ids")
    softcap = getattr(text_config(model), "final_logit_softcapping", None)
    if softcap:  # tanh is no linear map: the check below catches it only where the logits are large
        raise UnsupportedModelError(f"direct logit attribution: {type(model).__name__} softcaps its logits "
                                    f"(final_logit_softcapping={softcap}), which is not linear in the residual")
    head = _unembedding(model)
    truncate = inputs.pop("truncate", False)
    if not isinstance(truncate, bool):  # "no" is truthy: it cut the input
        raise InputTypeError(f"logit_attribution: truncate must be True or False, not {truncate!r}")
    # here, not in decompose: it would cut the ids the targets and the mask are read from (and name itself)
    inputs = check_inputs(model, inputs, caller="logit_attribution", truncate=truncate)
    compute_dtype = default_compute_dtype(model) if compute_dtype is None else check_compute_dtype(compute_dtype)
    if targets is not None:  # checked before the forward: one id per position, inside the vocabulary
        targets = check_targets(targets, inputs["input_ids"].shape, head.weight.shape[0])
    final = _final_norm(model)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(name):
        def hook(module, args, output):
            captured[name] = (args[0].detach(), output.detach())
        return hook

    post = {layer: n for layer, n in post_attention_norms(model).items() if n is not None}
    handles = [final.register_forward_hook(capture("final"))]
    handles += [n.register_forward_hook(capture(f"post{layer}")) for layer, n in post.items()]
    try:
        d = decompose(model, layers=layers, compute_dtype=compute_dtype, **inputs)
    finally:
        for handle in handles:
            handle.remove()
    input_ids = inputs["input_ids"]  # [batch, query]: check_inputs promoted one sequence to a batch
    mask = inputs.get("attention_mask")  # the real tokens: the norms are fitted and the logits checked on them
    real = None if mask is None else torch.as_tensor(mask).reshape(input_ids.shape[0], -1)[:, -input_ids.shape[1]:]
    real = None if real is None else real.to(captured["final"][0].device).bool()
    frozen = frozen_norm_on(real, final, *captured["final"])
    logits = getattr(d.outputs, "logits", None)
    w_u = materialised(head, "weight").detach().to(torch.float64)  # the values, where accelerate offloads it
    # the frozen linearisation must give the model's own logits (catches softcapping and logit scales)
    x, _ = captured["final"]
    if x.shape[-1] != w_u.shape[-1]:  # OPT's project_out: a linear map between the final norm and the head
        raise UnsupportedModelError(f"direct logit attribution: {type(model).__name__}'s final norm gives width "
                                    f"{x.shape[-1]}, its unembedding reads {w_u.shape[-1]}: a map between them "
                                    "is not supported")
    lin = frozen.apply(x.to(torch.float64)) + frozen.bias
    expected = lin @ w_u.T + (0 if head.bias is None else materialised(head, "bias").detach().to(torch.float64))
    if logits is not None:
        got = logits.detach().to(torch.float64)
        if real is not None:
            got, expected = got[real.to(got.device)], expected[real.to(expected.device)]
        # per position: a scale or cap that bends only the large logits is not averaged away by the small ones
        error = ((got - expected).norm(dim=-1) / got.norm(dim=-1).clamp_min(1e-30)).max().item()
        tolerance = 1e-3 if head.weight.dtype in (torch.float32, torch.float64) else 5e-2
        if not error <= tolerance:
            raise UnsupportedModelError(
                f"direct logit attribution: {type(model).__name__}'s logits are not the unembedding of the final "
                f"norm's output (relative error {error:.2g}); softcapped or scaled logits are not supported")
    if targets is None:
        targets = _default_targets(input_ids, logits, real)
    targets = targets.to(input_ids.device)
    directions = frozen.pull_back(w_u[targets.to(w_u.device)])  # [batch, query, model]
    post_frozen = {layer: frozen_norm_on(None if real is None else real.to(captured[f"post{layer}"][0].device),
                                     post[layer], *captured[f"post{layer}"]) for layer in d.layers if layer in post}
    multiplier = residual_multiplier(model)
    by_layer = {}
    for layer in d.layers:
        ld = d[layer]
        if ld.changed_output is not None:  # the terms add up to the projection's output, not to what enters h
            raise UnsupportedModelError(f"direct logit attribution: {ld.changed_output}")
        e = directions.to(ld.geometry.values.device)
        by_layer[layer] = direct_logit_attribution(ld, e.to(compute_dtype), post_frozen.get(layer), multiplier)
    return LogitAttribution(by_layer, targets, d, frozen, post_frozen, materialised(head, "weight").detach(),
                            multiplier)


def naive_logit_attribution(attribution: LogitAttribution, layer: int) -> torch.Tensor:
    """Reference: materialise every term alpha_ij v~_j in model space ``[batch, head, query, key, model]``,
    apply the frozen norms' linear parts and the unembedding. For tests and small inputs only."""
    geometry = attribution.decomposition[layer].geometry
    dtype = torch.float64
    projected = torch.einsum("bhkd,hmd->bhkm", geometry.values.to(dtype), geometry.w_o.to(dtype))  # v~_j
    terms = geometry.attention.to(dtype)[..., None] * projected[:, :, None]  # [b, h, q, k, m]
    terms = terms.permute(0, 2, 1, 3, 4)  # [b, q, h, k, m] so the norms' [b, q] scales broadcast
    if layer in attribution.post_norms:
        terms = attribution.post_norms[layer].apply(terms)
    normed = attribution.final_norm.apply(terms * attribution.residual_multiplier)
    w_u = attribution.unembedding.to(dtype)[attribution.targets]  # [b, q, m]
    logits = torch.einsum("bqhkm,bqm->bqhk", normed, w_u)
    return logits.permute(0, 2, 1, 3)
