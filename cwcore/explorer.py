"""The explorer: one self-contained, offline HTML page of a text's contribution maps.

:func:`write_explorer` writes a page where the reader picks the layer, the head (or the token view)
and the quantity (attention, intra- and inter-head contribution weights, relative norm, cosine,
value-weighted attention, and signed direct logit attribution for models with an LM head); hovering
a cell shows the token pair and its factors.

The page needs no network (its own JavaScript; a Content-Security-Policy forbids every request). It
stores per (layer, head, query, key) alpha and the DLA in float16 (relative error <= 2^-11; absolute <= 2^-25
below float16's normal range, 2^-14) and the
cosines as round(127 cos) in int8 (absolute error <= 1/254), norms in float32; every other quantity
is a product of these computed in the page, with the error :func:`tolerance` states. The arrays are
zlib-compressed and base64-encoded (float16 split into byte planes), inflated by ``DecompressionStream``."""

from __future__ import annotations

import base64
import html
import json
import re
import zlib
from pathlib import Path

import numpy as np
import torch

__all__ = ["QUANTITIES", "explorer_data", "explorer_html", "write_explorer", "read_payload", "iframe", "tolerance",
           "long_explorer_data", "long_explorer_html", "write_long_explorer"]

#: The quantities a reader can pick: (key, label, signed, per head only).
QUANTITIES = (
    ("attention", "attention α", False, False),
    ("intra", "intra-head c (own head's output)", True, True),
    ("inter", "inter-head c", True, False),
    ("relative_norm", "relative norm ‖ṽⱼ‖/‖oᵢ‖", False, True),
    ("cosine", "cosine cos(oᵢ, ṽⱼ)", True, True),
    ("value_weighted", "value-weighted α‖ṽⱼ‖", False, False),
    ("dla", "direct logit attribution", True, False),
)

_F16 = ("attention", "dla", "top_contribution", "top_attention", "top_relative_norm")
_I8 = ("cos_inter", "cos_intra", "top_cosine")  # cosines in [-1, 1] as round(127 cos); -128 stands for NaN


def _target_label(tokenizer, token: int) -> str:
    text = tokenizer.decode([int(token)])
    return text if "\ufffd" not in text else str(tokenizer.convert_ids_to_tokens(int(token)))


def explorer_data(model, tokenizer, text: str, *, targets=None, model_name: str | None = None) -> dict:
    """Run ``text`` through ``model`` and gather what the page shows: ``{"meta", "arrays"}`` with
    ``attention``, ``cos_inter``, ``cos_intra`` and ``dla`` ``[layer, head, query, key]`` (unseen keys
    NaN; ``dla`` absent without an LM head, ``meta["dla_note"]`` says why), ``value_norm [layer, head,
    key]``, ``output_norm [layer, query]`` and ``head_output_norm [layer, head, query]``."""
    from .core.architectures import UnsupportedModelError, input_device
    from .core.decomposition import decompose
    from .tokens import token_labels
    from .logit_attribution import logit_attribution

    if not text.strip():
        raise ValueError("the text is empty")
    encoded = tokenizer(text, return_tensors="pt")
    device = input_device(model)
    inputs = {k: v.to(device) for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    dla_note = None
    try:
        attribution = logit_attribution(model, targets=targets, **inputs)
        d = attribution.decomposition
    except UnsupportedModelError as error:
        attribution, dla_note = None, str(error)
        d = decompose(model, **inputs)
    rows = {name: [] for name in ("attention", "cos_inter", "cos_intra", "dla", "value_norm", "output_norm",
                                  "head_output_norm")}
    for layer in d.layers:
        ld = d[layer]
        alpha = ld.attention[0].detach().float().cpu()
        hidden = (alpha.sum(0) == 0)[None]  # keys no head of this query sees (causal mask, window, padding)
        rows["attention"].append(alpha.masked_fill(hidden, float("nan")))
        rows["cos_inter"].append(ld.cosine("inter")[0].float().cpu().masked_fill(hidden, float("nan")))
        rows["cos_intra"].append(ld.cosine("intra")[0].float().cpu().masked_fill(hidden, float("nan")))
        if attribution is not None:
            rows["dla"].append(attribution[layer][0].float().cpu().masked_fill(hidden, float("nan")))
        rows["value_norm"].append(ld.value_norm[0].float().cpu())
        rows["output_norm"].append(ld.output_norm[0].float().cpu())
        rows["head_output_norm"].append(ld.head_output_norm[0].float().cpu())
    arrays = {name: torch.stack(values).numpy() for name, values in rows.items() if values}
    ids = inputs["input_ids"][0].tolist()
    labels = token_labels(tokenizer, text)
    if len(labels) != len(ids):  # a tokenizer whose offsets disagree with its ids: label the ids themselves
        labels = token_labels(tokenizer, ids)
    name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    meta = {
        "model": str(name),
        "text": text,
        "tokens": labels,
        "layers": len(d.layers),  # the page's layer axis: positions; their numbers, as everywhere in cwcore:
        "layer_numbers": list(d.layers),
        "num_blocks": d.num_blocks,
        "undecomposable": {str(layer): why for layer, why in d.undecomposable.items()},
        "heads": int(arrays["attention"].shape[1]),
        "dla_note": dla_note,
        "targets_given": targets is not None,  # the note names the default target (next token) only without them
        "targets": None if attribution is None else [_target_label(tokenizer, t)
                                                     for t in attribution.targets[0].tolist()],
    }
    return {"meta": meta, "arrays": arrays}


def _page_layer(meta: dict, layer, entry: str) -> int:
    """The position on the page's layer axis of the layer numbered ``layer`` (negative: from the model's last
    attention layer, as everywhere in cwcore); a layer the page lacks is refused with the reason."""
    from .core.decomposition import LayerNotDecomposedError, layer_by_number

    numbers = meta["layer_numbers"]
    undecomposable = {int(number): why for number, why in (meta.get("undecomposable") or {}).items()}
    try:
        return layer_by_number({number: i for i, number in enumerate(numbers)}, layer, meta.get("num_blocks"),
                               undecomposable, entry)
    except LayerNotDecomposedError as error:
        raise ValueError(str(error)) from None


# Packing the numbers
def _pack(arrays: dict) -> tuple[list[dict], str]:
    chunks, layout, offset = [], [], 0
    for name, array in arrays.items():
        if name in _F16:
            half = np.ascontiguousarray(array, dtype=np.float16).view(np.uint8).reshape(-1, 2)
            raw = np.concatenate([half[:, 1], half[:, 0]]).tobytes()  # high bytes, then low bytes
            dtype = "f16"
        elif name in _I8:
            codes = np.round(np.clip(array, -1, 1) * 127)
            raw = np.where(np.isnan(array), -128, codes).astype(np.int8).tobytes()
            dtype = "i8"
        elif np.issubdtype(np.asarray(array).dtype, np.integer):  # indices (the long page's top terms)
            raw = np.ascontiguousarray(array, dtype="<i4").tobytes()
            dtype = "i32"
        else:
            raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
            dtype = "f32"
        layout.append({"name": name, "dtype": dtype, "shape": list(array.shape), "offset": offset, "bytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    return layout, base64.b64encode(zlib.compress(b"".join(chunks), 9)).decode("ascii")


def read_payload(page: str | Path) -> dict:
    """Decode the numbers an explorer page carries (the page's own decoding, in Python): ``{"meta", "arrays"}``."""
    text = page if isinstance(page, str) and page.startswith("<!DOCTYPE") else Path(page).read_text(encoding="utf-8")
    meta = json.loads(_between(text, '<script id="cw-meta" type="application/json">', "</script>"))
    raw = zlib.decompress(base64.b64decode(_between(text, '<script id="cw-data" type="application/octet-stream">',
                                                    "</script>")))
    arrays = {}
    for entry in meta.pop("layout"):
        chunk = np.frombuffer(raw, np.uint8, entry["bytes"], entry["offset"])
        if entry["dtype"] == "f16":
            n = entry["bytes"] // 2
            both = np.empty((n, 2), np.uint8)
            both[:, 1], both[:, 0] = chunk[:n], chunk[n:]
            values = both.reshape(-1).view(np.float16).astype(np.float32)
        elif entry["dtype"] == "i8":
            codes = chunk.view(np.int8).astype(np.float32)
            values = np.where(codes == -128, np.nan, codes / 127).astype(np.float32)
        elif entry["dtype"] == "i32":
            values = chunk.view("<i4")
        else:
            values = chunk.view("<f4")
        arrays[entry["name"]] = values.reshape(entry["shape"])
    return {"meta": meta, "arrays": arrays}


def tolerance(arrays: dict, quantity: str, layer: int, head: int, query: int, key: int) -> float:
    """The largest error the page's number for one cell can have, from the stored precision."""
    a = abs(float(arrays["attention"][layer, head, query, key]))
    vn = float(arrays["value_norm"][layer, head, key])
    norm = float(arrays["head_output_norm"][layer, head, query] if quantity == "intra"
                 else arrays["output_norm"][layer, query])
    f16, i8 = 2.0 ** -11, 1 / 254
    tiny = 2.0 ** -25  # float16's spacing is absolute below its normal range (2^-14): a tiny alpha's error
    if quantity in ("attention", "value_weighted"):
        return 2 * (f16 * a + tiny) * (vn if quantity == "value_weighted" else 1) + 1e-7
    if quantity == "cosine":
        return i8 + 1e-7
    if quantity in ("inter", "intra"):
        return (a * (i8 + 2 * f16) + 2 * tiny) * vn / norm + 1e-7
    if quantity == "dla":
        return 2 * (f16 * abs(float(arrays["dla"][layer, head, query, key])) + tiny) + 1e-7
    return 1e-5 * vn / norm + 1e-7  # relative norm: float32


def _between(text: str, start: str, end: str) -> str:
    a = text.index(start) + len(start)
    return text[a:text.index(end, a)]


def _colour_scales() -> dict:
    import matplotlib.colors as mcolors

    from .plotting import BAD_COLOUR, diverging_cmap

    cmap = diverging_cmap()
    diverging = [mcolors.to_hex(cmap(x / 255)) for x in range(256)]
    sequential = [mcolors.to_hex(cmap(0.5 + x / 510)) for x in range(256)]  # the red half: white at zero
    return {"diverging": diverging, "sequential": sequential, "bad": BAD_COLOUR}


#: characters that could end or open a script context inside <script> (</script>, <!--, -->, <script)
#: or end a line of JavaScript (U+2028/2029), written as JSON escapes: the same JSON, inert in HTML
_SCRIPT_TABLE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                               "\u2029": "\\u2029"})


def script_safe_json(value) -> str:
    """``value`` as JSON that can sit inside a ``<script>`` element whatever its strings hold: every
    ``<``, ``>``, ``&``, U+2028 and U+2029 is a ``\\uXXXX`` escape (``json.loads`` reads it back unchanged)."""
    return json.dumps(value, ensure_ascii=False).translate(_SCRIPT_TABLE)


def explorer_html(data: dict, title: str | None = None, start: dict | None = None) -> str:
    """The page (HTML) for :func:`explorer_data`'s ``data``; ``start``: the first view ``{"layer", "head"
    (None: token level), "quantity"}`` (default the middle layer, token level, inter-head weights)."""
    meta = dict(data["meta"])
    unknown = sorted(set(start or {}) - {"layer", "head", "quantity"})
    if unknown:  # a misspelt key would leave the page at its default view without a word
        raise ValueError(f"start takes the keys layer, head and quantity, not {', '.join(map(repr, unknown))}")
    start = {k: (v if k == "quantity" else int(v)) for k, v in (start or {}).items() if v is not None}
    keys = [q[0] for q in QUANTITIES if q[0] != "dla" or "dla" in data["arrays"]]  # the page's own quantities
    if start.get("quantity", "inter") not in keys:
        absent = (f" (this page has no DLA: {meta.get('dla_note') or 'the model has no language-model head'})"
                  if start["quantity"] == "dla" else "")
        raise ValueError(f"quantity must be one of {', '.join(keys)}, not {start['quantity']!r}{absent}")
    if "layer" in start:
        start["layer"] = _page_layer(meta, start["layer"], "decompose")
    if -meta["heads"] <= start.get("head", 0) < 0:  # and negative heads, as explain() counts them
        start["head"] += meta["heads"]
    if not 0 <= start.get("head", 0) < meta["heads"]:
        raise ValueError(f"head {start['head']} out of range: the layers have heads 0..{meta['heads'] - 1}")
    per_head = {k for k, _, _, each_head in QUANTITIES if each_head}
    if start.get("quantity") in per_head and "head" not in start:  # the page would show another quantity
        raise ValueError(f"quantity {start['quantity']!r} is one head's: give a head (token level shows "
                         f"{', '.join(k for k, *_ in QUANTITIES if k not in per_head)})")
    meta["start"] = start
    layout, payload = _pack(data["arrays"])
    meta["layout"] = layout
    meta["quantities"] = [{"key": k, "label": label, "signed": signed, "per_head": per_head}
                          for k, label, signed, per_head in QUANTITIES if k != "dla" or "dla" in data["arrays"]]
    meta["colours"] = _colour_scales()
    title = title or f"cwcore explorer · {meta['model']}"
    meta_json = script_safe_json(meta)
    fields = {"__TITLE__": html.escape(title), "__META__": meta_json, "__DATA__": payload}
    # one pass: a text that contains "__DATA__" is not replaced inside the data already put in
    return re.sub("__TITLE__|__META__|__DATA__", lambda m: fields[m.group(0)], _PAGE)


def write_explorer(path, model, tokenizer, text: str, *, model_name: str | None = None, targets=None,
                   title: str | None = None, start: dict | None = None) -> Path:
    """Write the explorer page for ``text`` to ``path`` atomically and return it (``targets`` as in
    :func:`cwcore.logit_attribution.logit_attribution`, ``start`` as in :func:`explorer_html`)."""
    from .cache import atomic_write_bytes

    path = Path(path)
    page = explorer_html(explorer_data(model, tokenizer, text, targets=targets, model_name=model_name), title, start)
    atomic_write_bytes(path, page.encode("utf-8"))
    return path


def iframe(page: str, height: int = 900) -> str:
    """The page inside an ``<iframe srcdoc>``: for a notebook output cell (it stays self-contained, and
    its script and styles cannot touch the book's)."""
    return (f'<div class="cwcore-explorer"><iframe title="cwcore explorer" srcdoc="{html.escape(page, quote=True)}" '
            f'style="width:100%;height:{height}px;border:1px solid #ddd"></iframe></div>')


# The data both pages carry: float16 arrays as two byte planes, cosines as int8 codes (-128: none), int32 and
# float32 arrays as raw bytes; the whole deflated and base64-encoded. One decoder for both pages.
_DECODE_JS = r"""var half = (function () {  // float16 bits -> float32, one table
  var t = new Float32Array(65536);
  for (var h = 0; h < 65536; h++) {
    var s = h & 0x8000 ? -1 : 1, e = (h >> 10) & 31, f = h & 1023;
    t[h] = e === 0 ? s * f * Math.pow(2, -24) : e === 31 ? (f ? NaN : s * Infinity) : s * (1 + f / 1024) * Math.pow(2, e - 15);
  }
  return t;
})();
function decode(buf) {
  meta.layout.forEach(function (a) {
    var bytes = new Uint8Array(buf, a.offset, a.bytes);
    if (a.dtype === "f16") {
      var n = a.bytes / 2, out = new Float32Array(n);
      for (var k = 0; k < n; k++) out[k] = half[(bytes[k] << 8) | bytes[n + k]];
      A[a.name] = out;
    } else if (a.dtype === "i8") {
      var codes = new Int8Array(buf, a.offset, a.bytes), cos = new Float32Array(a.bytes);
      for (var m = 0; m < a.bytes; m++) cos[m] = codes[m] === -128 ? NaN : codes[m] / 127;
      A[a.name] = cos;
    } else if (a.dtype === "i32") {
      A[a.name] = new Int32Array(buf.slice(a.offset, a.offset + a.bytes));
    } else {
      A[a.name] = new Float32Array(buf.slice(a.offset, a.offset + a.bytes));
    }
  });
}
function b64bytes(text) {
  var raw = atob(text.trim()), out = new Uint8Array(raw.length);
  for (var i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
  return out;
}
"""


_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Color Emoji",sans-serif;margin:12px;color:#222}
h1{font-size:17px;margin:0 0 4px} .sub{color:#555;margin:0 0 10px;max-width:1100px}
#cw-controls{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:8px}
#cw-controls label{white-space:nowrap} fieldset{border:1px solid #ccc;border-radius:4px;padding:3px 8px;margin:0}
fieldset label{margin-right:8px} input:disabled+span{color:#aaa}
#cw-wrap{position:relative;display:inline-block} canvas{display:block}
#cw-tip{position:absolute;pointer-events:none;background:rgba(255,255,255,.96);border:1px solid #999;border-radius:4px;
  padding:5px 8px;font-size:12.5px;white-space:nowrap;display:none;box-shadow:0 1px 4px rgba(0,0,0,.2);z-index:2}
#cw-tip table{border-collapse:collapse} #cw-tip td{padding:0 4px} #cw-tip td.v{text-align:right;font-variant-numeric:tabular-nums}
#cw-note{color:#555;font-size:12.5px;max-width:1100px} #cw-status{color:#a33}
</style></head><body>
<h1 id="cw-title"></h1><p class="sub" id="cw-text"></p>
<div id="cw-controls">
 <label>layer <input type="range" id="cw-layer" min="0" value="0"> <output id="cw-layer-out"></output></label>
 <label>head <select id="cw-head"></select></label>
 <fieldset id="cw-quantity"><legend>quantity</legend></fieldset>
 <label title="the first token often takes most of the weight (an attention sink); its cells then saturate">
  <input type="checkbox" id="cw-clip"> colour range without key 0</label>
</div>
<div id="cw-status">loading…</div>
<div id="cw-wrap"><canvas id="cw-map"></canvas><div id="cw-tip"></div></div>
<p id="cw-note"></p>
<script id="cw-meta" type="application/json">__META__</script>
<script id="cw-data" type="application/octet-stream">__DATA__</script>
<script>
(function () {
"use strict";
var meta = JSON.parse(document.getElementById("cw-meta").textContent);
var N = meta.tokens.length, L = meta.layers, H = meta.heads;
var A = {}, start = meta.start || {};
var state = {layer: "layer" in start ? start.layer : Math.floor(L / 2), head: "head" in start ? start.head : -1,
             quantity: start.quantity || "inter"};
var Q = {}; meta.quantities.forEach(function (q) { Q[q.key] = q; });
__DECODE_JS__function at(name, l, h, i, j) { return A[name][((l * H + h) * N + i) * N + j]; }
// One cell of one head: every quantity the page shows, from the stored factors.
function headCell(l, h, i, j) {
  var a = at("attention", l, h, i, j), vn = A.value_norm[(l * H + h) * N + j];
  var on = A.output_norm[l * N + i], hon = A.head_output_norm[(l * H + h) * N + i];
  var co = at("cos_inter", l, h, i, j), ci = at("cos_intra", l, h, i, j);
  var r = {attention: a, relative_norm: isNaN(a) ? NaN : vn / on, cosine: co, inter: a * vn / on * co,
           intra: a * vn / hon * ci, value_weighted: a * vn};
  if (A.dla) r.dla = at("dla", l, h, i, j);
  return r;
}
function tokenCell(l, i, j) {  // the head-summed view: attention averaged over heads, the rest summed
  var r = {attention: 0, inter: 0, value_weighted: 0, dla: A.dla ? 0 : undefined};
  for (var h = 0; h < H; h++) {
    var c = headCell(l, h, i, j);
    r.attention += c.attention / H; r.inter += c.inter; r.value_weighted += c.value_weighted;
    if (A.dla) r.dla += c.dla;
  }
  r.relative_norm = r.cosine = r.intra = NaN;
  return r;
}
function cell(i, j) { return state.head < 0 ? tokenCell(state.layer, i, j) : headCell(state.layer, state.head, i, j); }

var canvas = document.getElementById("cw-map"), tip = document.getElementById("cw-tip"), geo = {};
function label(t) { return t.replace(/\n/g, "\\n").replace(/\t/g, "\\t").replace(/^ /, "\u2423"); }
function fmt(x) { return x === undefined ? "–" : isNaN(x) ? "n/a" : Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(3) : x.toPrecision(4); }
function colour(v, vmax, signed) {
  var c = meta.colours;
  if (isNaN(v)) return c.bad;
  var x = vmax > 0 ? v / vmax : 0;
  if (signed) return c.diverging[Math.max(0, Math.min(255, Math.round((x + 1) * 127.5)))];
  return c.sequential[Math.max(0, Math.min(255, Math.round(x * 255)))];
}
function render() {
  var q = Q[state.quantity], values = new Float64Array(N * N), vmax = 0;
  for (var i = 0; i < N; i++) for (var j = 0; j < N; j++) {
    var v = cell(i, j)[state.quantity]; values[i * N + j] = v;
    if (!isNaN(v) && Math.abs(v) > vmax && (!state.clip || j > 0)) vmax = Math.abs(v);
  }
  var ctx = canvas.getContext("2d"), font = "11px system-ui,'Noto Sans','Noto Color Emoji',sans-serif";
  ctx.font = font;
  var wide = 0; meta.tokens.forEach(function (t) { wide = Math.max(wide, ctx.measureText(label(t)).width); });
  wide = Math.min(wide, 140) + 10;
  var size = Math.max(8, Math.min(28, Math.floor(760 / N))), top = wide * 0.82 + 8, left = wide + 36;
  var bar = 70, W = left + N * size + bar, Hh = top + N * size + 30, dpr = window.devicePixelRatio || 1;
  canvas.width = W * dpr; canvas.height = Hh * dpr; canvas.style.width = W + "px"; canvas.style.height = Hh + "px";
  ctx = canvas.getContext("2d"); ctx.setTransform(dpr, 0, 0, dpr, 0, 0); ctx.font = font;
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, W, Hh);
  for (i = 0; i < N; i++) for (j = 0; j < N; j++) {
    ctx.fillStyle = colour(values[i * N + j], vmax, q.signed);
    ctx.fillRect(left + j * size, top + i * size, size, size);
  }
  ctx.fillStyle = "#222"; ctx.textBaseline = "middle";
  var step = Math.max(1, Math.ceil(10 / size));
  for (i = 0; i < N; i += step) { ctx.textAlign = "right"; ctx.fillText(label(meta.tokens[i]), left - 4, top + (i + 0.5) * size, wide); }
  for (j = 0; j < N; j += step) {
    ctx.save(); ctx.translate(left + (j + 0.5) * size, top - 4); ctx.rotate(-Math.PI / 3);
    ctx.textAlign = "left"; ctx.fillText(label(meta.tokens[j]), 0, 0, wide); ctx.restore();
  }
  ctx.save(); ctx.translate(12, top + N * size / 2); ctx.rotate(-Math.PI / 2); ctx.textAlign = "center";
  ctx.fillText("query i", 0, 0); ctx.restore();
  ctx.textAlign = "center"; ctx.fillText("key j", left + N * size / 2, top + N * size + 16);
  // colour bar
  var bx = left + N * size + 18, bh = N * size;
  for (var k = 0; k < bh; k++) {
    var v = q.signed ? vmax * (1 - 2 * k / bh) : vmax * (1 - k / bh);
    ctx.fillStyle = colour(v, vmax, q.signed); ctx.fillRect(bx, top + k, 12, 1);
  }
  ctx.fillStyle = "#222"; ctx.textAlign = "left";
  ctx.fillText(fmt(vmax), bx + 15, top + 5); ctx.fillText(q.signed ? fmt(-vmax) : "0", bx + 15, top + bh - 5);
  if (q.signed) ctx.fillText("0", bx + 15, top + bh / 2);
  geo = {left: left, top: top, size: size};
  canvas.dataset.vmax = vmax;
}
function describe(i, j) {
  var c = cell(i, j), tok = meta.tokens, per = state.head >= 0;
  var rows = [[per ? "α" : "α (mean over heads)", c.attention]];
  if (per) rows.push(["‖ṽⱼ‖ / ‖oᵢ‖", c.relative_norm], ["cos(oᵢ, ṽⱼ)", c.cosine], ["inter-head cᵢⱼ", c.inter],
                     ["intra-head cᵢⱼ", c.intra]);
  else rows.push(["Σₕ inter-head cᵢⱼ", c.inter]);
  rows.push([per ? "α‖ṽⱼ‖" : "Σₕ α‖ṽⱼ‖", c.value_weighted]);
  if (A.dla) rows.push([(per ? "DLA" : "Σₕ DLA") + " → " + JSON.stringify(meta.targets[i]), c.dla]);
  var head = "layer " + meta.layer_numbers[state.layer] + (per ? " · head " + state.head : " · all heads");
  var h = "<b>" + esc(label(tok[i])) + "</b> (query " + i + ") ← <b>" + esc(label(tok[j])) + "</b> (key " + j + ")<br>" + head + "<table>";
  rows.forEach(function (r) { h += "<tr><td>" + esc(r[0]) + "</td><td class='v'>" + fmt(r[1]) + "</td></tr>"; });
  tip.innerHTML = h + "</table>";
  var exact = {}; Object.keys(c).forEach(function (k) { exact[k] = c[k] === undefined || isNaN(c[k]) ? null : c[k]; });
  tip.dataset.values = JSON.stringify({layer: meta.layer_numbers[state.layer], head: state.head, query: i, key: j,
                                      values: exact});
}
function esc(s) { return String(s).replace(/[&<>"]/g, function (m) { return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[m]; }); }
canvas.addEventListener("mousemove", function (ev) {
  var rect = canvas.getBoundingClientRect(), x = ev.clientX - rect.left, y = ev.clientY - rect.top;
  var j = Math.floor((x - geo.left) / geo.size), i = Math.floor((y - geo.top) / geo.size);
  if (i < 0 || j < 0 || i >= N || j >= N) { tip.style.display = "none"; return; }
  describe(i, j);
  tip.style.display = "block";
  tip.style.left = Math.min(x + 14, canvas.clientWidth - tip.offsetWidth - 2) + "px";
  tip.style.top = (y + 14) + "px";
});
canvas.addEventListener("mouseleave", function () { tip.style.display = "none"; });

function controls() {
  document.getElementById("cw-title").textContent = "cwcore explorer · " + meta.model;
  document.getElementById("cw-text").textContent = N + " tokens: " + meta.text;
  var layer = document.getElementById("cw-layer"), out = document.getElementById("cw-layer-out");
  var last = meta.layer_numbers[L - 1];  // the slider runs over the positions of the layers the page holds
  function shown() { out.textContent = meta.layer_numbers[state.layer] + " / " + last; }
  layer.max = L - 1; layer.value = state.layer; shown();
  layer.addEventListener("input", function () { state.layer = +layer.value; shown(); update(); });
  var head = document.getElementById("cw-head");
  head.add(new Option("all heads (token level)", "-1"));
  for (var h = 0; h < H; h++) head.add(new Option("head " + h, String(h)));
  head.value = String(state.head);
  head.addEventListener("change", function () { state.head = +head.value; update(); });
  var clip = document.getElementById("cw-clip");
  clip.addEventListener("change", function () { state.clip = clip.checked; update(); });
  var box = document.getElementById("cw-quantity");
  meta.quantities.forEach(function (q) {
    var l = document.createElement("label"), r = document.createElement("input"), s = document.createElement("span");
    r.type = "radio"; r.name = "cw-q"; r.value = q.key; r.checked = q.key === state.quantity; s.textContent = " " + q.label;
    r.addEventListener("change", function () { state.quantity = q.key; update(); });
    l.appendChild(r); l.appendChild(s); box.appendChild(l);
  });
  var note = "Grey: keys the query cannot see. Signed quantities (c, cosine, DLA) use a diverging scale centred at zero; " +
    "the others run from zero (white). Relative norm, cosine and intra-head weights are per head; the token-level view " +
    "averages attention over heads and sums the rest. o_i is the layer's output without the output projection's bias. ";
  note += A.dla ? "DLA: the logit push of the term α_ij ṽ_j toward " + (meta.targets_given ?
    "the query's target token (given; the tooltip names it)" :
    "the query's next token (the model's top prediction at the last position)") +
    " along the direct path, later layers skipped, final norm's scale frozen at this run's value."
    : "No DLA view: " + (meta.dla_note || "the model has no language-model head") + ".";
  Object.keys(meta.undecomposable || {}).forEach(function (l) {
    note += " Layer " + l + " is not shown: " + meta.undecomposable[l].replace(/\.$/, "") + ".";
  });
  document.getElementById("cw-note").textContent = note;
}
function update() {
  var per = state.head < 0;
  document.querySelectorAll("#cw-quantity input").forEach(function (r) { r.disabled = per && Q[r.value].per_head; });
  if (per && Q[state.quantity].per_head) { state.quantity = "inter"; document.querySelector("#cw-quantity input[value=inter]").checked = true; }
  tip.style.display = "none";
  render();
}
var status = document.getElementById("cw-status");
var stream = new Blob([b64bytes(document.getElementById("cw-data").textContent)]).stream()
  .pipeThrough(new DecompressionStream("deflate"));
new Response(stream).arrayBuffer().then(function (buf) {
  decode(buf); controls(); update();
  status.textContent = ""; document.body.dataset.ready = "1";
  window.cwExplorer = {meta: meta, state: state, cell: cell, geometry: function () { return geo; }};
}).catch(function (e) { status.textContent = "could not read the data: " + e; });
})();
</script></body></html>
"""
_PAGE = _PAGE.replace("__DECODE_JS__", _DECODE_JS)


# Long documents: the summary mode's page (cwcore.summarize), no [query, key] map
def long_explorer_data(model, tokenizer, text: str, *, layers=None, top_k: int = 5, kind: str = "inter",
                       model_name: str | None = None) -> dict:
    """What the long-document page shows, from :func:`cwcore.summarize`: ``received`` and
    ``received_attention [layer, key]`` (c and alpha summed over queries and heads) and each query's
    ``top_k`` terms ``[layer, query, k]``: ``top_head``, ``top_key`` (-1 where fewer), ``top_contribution``,
    ``top_attention``, ``top_relative_norm`` and ``top_cosine``."""
    from .core.architectures import input_device
    from .core.summary import summarize
    from .tokens import token_labels

    if not text.strip():
        raise ValueError("the text is empty")
    encoded = tokenizer(text, return_tensors="pt")
    device = input_device(model)
    inputs = {k: v.to(device) for k, v in encoded.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    extra = {"logits_to_keep": 1} if "logits_to_keep" in _forward_parameters(model) else {}
    s = summarize(model, layers=layers, top_k=top_k, rows=None, kind=kind, **inputs, **extra)
    rows = {name: [] for name in ("received", "received_attention", "top_head", "top_key", "top_contribution",
                                  "top_attention", "top_relative_norm", "top_cosine")}
    for layer in s.layers:
        summary = s[layer]
        rows["received"].append(summary.received("contribution")[0].float().cpu())
        rows["received_attention"].append(summary.received("attention")[0].float().cpu())
        rows["top_head"].append(summary.top.head[0].to(torch.int32).cpu())
        rows["top_key"].append(summary.top.key[0].to(torch.int32).cpu())
        for name in ("contribution", "attention", "relative_norm", "cosine"):
            rows[f"top_{name}"].append(getattr(summary.top, name)[0].float().cpu())
    arrays = {name: torch.stack(values).numpy() for name, values in rows.items()}
    ids = inputs["input_ids"][0].tolist()
    labels = token_labels(tokenizer, text)
    if len(labels) != len(ids):
        labels = token_labels(tokenizer, ids)
    name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
    meta = {"model": str(name), "tokens": labels, "layers": s.layers, "layer_numbers": s.layers, "kind": kind,
            "top_k": top_k, "heads": int(s[s.layers[0]].contribution_received.shape[1]), "num_blocks": s.num_blocks,
            "undecomposable": {str(layer): why for layer, why in s.undecomposable.items()}}
    return {"meta": meta, "arrays": arrays}


def _forward_parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def long_explorer_html(data: dict, title: str | None = None, query: int | None = None, layer: int | None = None) -> str:
    """The long-document page for ``data`` from :func:`long_explorer_data`: each key's total as a heat strip over
    the whole text and as the text's background, and the top contributors of the picked query (click a token;
    ``query`` picks the first, default the last token; ``layer`` the first layer shown, default the middle one;
    negative: from the model's last attention layer, as everywhere in cwcore)."""
    meta = dict(data["meta"])
    n = len(meta["tokens"])
    if query is not None and not -n <= int(query) < n:
        raise ValueError(f"query {query} out of range: the text has tokens 0..{n - 1}")
    meta["start"] = {"query": (int(query) % n) if query is not None else n - 1,
                     "layer": _page_layer(meta, layer, "summarize") if layer is not None else len(meta["layers"]) // 2}
    layout, payload = _pack(data["arrays"])
    meta["layout"] = layout
    meta["colours"] = _colour_scales()
    title = title or f"cwcore long-document explorer · {meta['model']}"
    fields = {"__TITLE__": html.escape(title), "__META__": script_safe_json(meta), "__DATA__": payload}
    return re.sub("__TITLE__|__META__|__DATA__", lambda m: fields[m.group(0)], _LONG_PAGE)


def write_long_explorer(path, model, tokenizer, text: str, *, layers=None, top_k: int = 5, kind: str = "inter",
                        model_name: str | None = None, query: int | None = None, layer: int | None = None) -> Path:
    """Write the long-document page for ``text`` (atomically) and return its path."""
    from .cache import atomic_write_bytes

    path = Path(path)
    data = long_explorer_data(model, tokenizer, text, layers=layers, top_k=top_k, kind=kind, model_name=model_name)
    atomic_write_bytes(path, long_explorer_html(data, query=query, layer=layer).encode("utf-8"))
    return path


_LONG_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"Noto Sans","Noto Color Emoji",sans-serif;margin:12px;color:#222}
h1{font-size:17px;margin:0 0 4px} .sub{color:#555;margin:0 0 8px}
#cw-controls{display:flex;flex-wrap:wrap;gap:14px;align-items:center;margin-bottom:6px}
#cw-strip{display:block;width:100%;height:34px;cursor:pointer;border:1px solid #ccc}
#cw-text{white-space:pre-wrap;font:13px/1.7 ui-monospace,Menlo,Consolas,monospace;max-height:55vh;overflow:auto;
  border:1px solid #ddd;padding:6px;margin-top:6px}
#cw-text span{cursor:pointer} #cw-text span.q{outline:2px solid #000} #cw-text span.t{outline:2px solid #0173b2}
#cw-text sup{color:#0173b2;font-size:9px}
table{border-collapse:collapse;margin-top:8px} td,th{padding:1px 8px;text-align:right} td.tok{text-align:left}
#cw-status{color:#a33}
</style></head><body>
<h1 id="cw-title"></h1><p class="sub" id="cw-sub"></p>
<div id="cw-controls">
 <label>layer <select id="cw-layer"></select></label>
 <label>strip <select id="cw-what"><option value="received">contribution received (Σ over queries and heads)</option>
  <option value="received_attention">attention received (Σ over queries and heads)</option></select></label>
 <label>query <input type="number" id="cw-query" min="0" style="width:7em"></label>
 <label><input type="checkbox" id="cw-clip"> colour range without key 0</label>
</div>
<div id="cw-status">loading…</div>
<canvas id="cw-strip" height="34"></canvas>
<div id="cw-top"></div>
<div id="cw-text"></div>
<script id="cw-meta" type="application/json">__META__</script>
<script id="cw-data" type="application/octet-stream">__DATA__</script>
<script>
(function () {
"use strict";
var meta = JSON.parse(document.getElementById("cw-meta").textContent);
var N = meta.tokens.length, K = meta.top_k, A = {};
var state = {layer: meta.start.layer, query: meta.start.query, what: "received", clip: false};
__DECODE_JS__function fmt(x) { return isNaN(x) ? "n/a" : Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(3) : x.toPrecision(4); }
function colour(v, vmax, signed) {
  var c = meta.colours;
  if (isNaN(v)) return c.bad;
  var x = vmax > 0 ? v / vmax : 0;
  if (signed) return c.diverging[Math.max(0, Math.min(255, Math.round((x + 1) * 127.5)))];
  return c.sequential[Math.max(0, Math.min(255, Math.round(x * 255)))];
}
function label(t) { return t.replace(/\n/g, "\u21b5\n"); }
var spans = [], textBox = document.getElementById("cw-text");
function build() {
  document.getElementById("cw-title").textContent = "cwcore long-document explorer · " + meta.model;
  document.getElementById("cw-sub").textContent = N + " tokens, " + meta.layers.length + " layers, " + meta.heads +
    " heads; " + meta.kind + "-head contribution weights. Click a token (or the strip) to pick the query." +
    Object.keys(meta.undecomposable || {}).map(function (l) {
      return " Layer " + l + " is not shown: " + meta.undecomposable[l].replace(/\.$/, "") + ".";
    }).join("");
  var select = document.getElementById("cw-layer");
  meta.layers.forEach(function (l, i) { var o = document.createElement("option"); o.value = i; o.textContent = l; select.appendChild(o); });
  var frag = document.createDocumentFragment();
  meta.tokens.forEach(function (t, j) {
    var s = document.createElement("span"); s.textContent = label(t); s.dataset.j = j; spans.push(s); frag.appendChild(s);
  });
  textBox.appendChild(frag);
  textBox.addEventListener("click", function (e) { var j = e.target.dataset && e.target.dataset.j; if (j !== undefined) pick(+j); });
  select.addEventListener("change", function () { state.layer = +select.value; update(); });
  document.getElementById("cw-what").addEventListener("change", function (e) { state.what = e.target.value; update(); });
  document.getElementById("cw-clip").addEventListener("change", function (e) { state.clip = e.target.checked; update(); });
  document.getElementById("cw-query").addEventListener("change", function (e) { pick(Math.max(0, Math.min(N - 1, +e.target.value))); });
  document.getElementById("cw-strip").addEventListener("click", function (e) {
    var r = e.target.getBoundingClientRect(); pick(Math.min(N - 1, Math.floor((e.clientX - r.left) / r.width * N)));
  });
}
function pick(j) { state.query = j; update(); spans[j].scrollIntoView({block: "center"}); }
function totals() {
  var all = A[state.what], out = all.subarray(state.layer * N, (state.layer + 1) * N), vmax = 0;
  for (var j = 0; j < N; j++) if (!isNaN(out[j]) && (!state.clip || j > 0)) vmax = Math.max(vmax, Math.abs(out[j]));
  return {values: out, vmax: vmax, signed: state.what === "received"};
}
function drawStrip(t) {
  var canvas = document.getElementById("cw-strip"), width = canvas.clientWidth || 1000;
  canvas.width = width; var ctx = canvas.getContext("2d");
  for (var x = 0; x < width; x++) {  // each column: the largest total (in size) of the tokens it covers
    var a = Math.floor(x * N / width), b = Math.max(a + 1, Math.floor((x + 1) * N / width)), best = NaN;
    for (var j = a; j < b; j++) if (isNaN(best) || Math.abs(t.values[j]) > Math.abs(best)) best = t.values[j];
    ctx.fillStyle = colour(best, t.vmax, t.signed); ctx.fillRect(x, 0, 1, 26);
  }
  ctx.fillStyle = "#000"; ctx.fillRect(Math.floor(state.query / N * width), 26, 2, 8);
}
function update() {
  var t = totals();
  drawStrip(t);
  document.getElementById("cw-query").value = state.query;
  document.getElementById("cw-layer").value = state.layer;
  var base = (state.layer * N + state.query) * K, marks = {};
  for (var r = 0; r < K; r++) { var key = A.top_key[base + r]; if (key >= 0) marks[key] = (marks[key] || []).concat([r + 1]); }
  for (var j = 0; j < N; j++) {
    var s = spans[j];
    s.style.background = colour(t.values[j], t.vmax, t.signed);
    s.className = j === state.query ? "q" : marks[j] ? "t" : "";
    s.title = "token " + j + ": " + (state.what === "received" ? "Σ c = " : "Σ α = ") + fmt(t.values[j]);
    var sup = s.querySelector("sup"); if (sup) s.removeChild(sup);
    if (marks[j]) { sup = document.createElement("sup"); sup.textContent = marks[j].join(","); s.appendChild(sup); }
  }
  // intra-head terms are measured against the head's own output o_i^h, inter-head ones against the layer's o_i
  var o = meta.kind === "intra" ? "oᵢʰ" : "oᵢ";
  var rows = ["<tr><th>rank</th><th>head</th><th>key</th><th class='tok'>token</th><th>c</th><th>α</th><th>‖ṽⱼ‖/‖" + o +
              "‖</th><th>cos(" + o + ", ṽⱼ)</th></tr>"];
  for (var k = 0; k < K; k++) {
    var key2 = A.top_key[base + k]; if (key2 < 0) continue;
    var tok = document.createElement("span"); tok.textContent = JSON.stringify(meta.tokens[key2]);
    rows.push("<tr><td>" + (k + 1) + "</td><td>" + A.top_head[base + k] + "</td><td>" + key2 + "</td><td class='tok'>" +
              tok.innerHTML + "</td><td>" + fmt(A.top_contribution[base + k]) + "</td><td>" + fmt(A.top_attention[base + k]) +
              "</td><td>" + fmt(A.top_relative_norm[base + k]) + "</td><td>" + fmt(A.top_cosine[base + k]) + "</td></tr>");
  }
  var q = document.createElement("span"); q.textContent = JSON.stringify(meta.tokens[state.query]);
  document.getElementById("cw-top").innerHTML = "<p>query " + state.query + " " + q.innerHTML + ", layer " +
    meta.layers[state.layer] + ": its top " + K + " (head, key) terms</p><table>" + rows.join("") + "</table>";
}
var status = document.getElementById("cw-status");
var stream = new Blob([b64bytes(document.getElementById("cw-data").textContent)]).stream()
  .pipeThrough(new DecompressionStream("deflate"));
new Response(stream).arrayBuffer().then(function (buf) {
  decode(buf); build(); update();
  status.textContent = ""; document.body.dataset.ready = "1";
  window.cwLongExplorer = {meta: meta, state: state, arrays: A, pick: pick};
}).catch(function (e) { status.textContent = "could not read the data: " + e; });
})();
</script></body></html>
"""
_LONG_PAGE = _LONG_PAGE.replace("__DECODE_JS__", _DECODE_JS)
