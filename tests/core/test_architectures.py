"""The architecture registry's extension point: a new family is one registered finder."""

import pytest
import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cwcore
from cwcore.core import architectures
from cwcore.core.geometry import naive_geometry, split_output_projection
from tiny_models import VOCAB, tiny_model


class ToyAttention(nn.Module):
    """Self-attention that calls transformers' attention interface and names its W_O ``mix`` (unknown to cwcore)."""

    def __init__(self, config, width=16, heads=2):
        super().__init__()
        self.config, self.heads, self.dim = config, heads, width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.mix = nn.Linear(width, width)
        self.scaling = self.dim**-0.5
        self.is_causal = False

    def forward(self, x):
        b, n, _ = x.shape
        split = lambda t: t.view(b, n, self.heads, self.dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        implementation = self.config._attn_implementation
        if implementation == "eager":
            probs = torch.softmax(q @ k.transpose(2, 3) * self.scaling, -1, dtype=torch.float32)
            out = (probs @ v).transpose(1, 2)
        else:
            out, probs = ALL_ATTENTION_FUNCTIONS[implementation](self, q, k, v, None, scaling=self.scaling)
        return self.mix(out.reshape(b, n, -1)), probs


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.config._attn_implementation = "eager"
        self.embed = nn.Embedding(11, 16)
        self.attn = ToyAttention(self.config)

    def forward(self, input_ids, attention_mask=None):
        return self.attn(self.embed(input_ids))


def _mix_finder(module, parent):
    layer = getattr(module, "mix", None)
    return (layer.weight, layer.bias) if isinstance(layer, nn.Linear) else None


@pytest.fixture
def registered():
    finders = list(architectures._FINDERS)
    cwcore.register_output_projection(_mix_finder)
    yield
    architectures._FINDERS[:] = finders


class MisleadingAttention(ToyAttention):
    """The last linear child (``gate``) is not W_O: it gates the block's input, and ``mix`` is W_O."""

    gate_name = "gate"

    def __init__(self, config, width=16, heads=2):
        super().__init__(config, width, heads)
        setattr(self, self.gate_name, nn.Linear(width, width))

    def forward(self, x):
        return super().forward(getattr(self, self.gate_name)(x))


def test_an_output_projection_under_another_name_is_found_by_structure():
    torch.manual_seed(0)
    _check_exact(ToyModel().eval())  # `mix`, found as the block's last linear child and verified by the run


def test_a_wrong_structural_guess_is_refused_with_the_way_out():
    torch.manual_seed(0)
    model = ToyModel().eval()
    model.attn = MisleadingAttention(model.config).eval()
    with pytest.raises(cwcore.UnsupportedModelError, match=r"`gate`, which cwcore took as its output "
                                                           r"projection .* did not receive the attention output; "
                                                           r"register the module"):
        cwcore.decompose(model, input_ids=torch.tensor([[1, 2, 3]]))


class NamedGateAttention(MisleadingAttention):
    """The same gate of the block's input named ``o_proj`` (a name the registry knows); ``mix`` is W_O."""

    gate_name = "o_proj"


def _gate_finder(module, parent):
    layer = getattr(module, "gate", None)
    return (layer.weight, layer.bias) if isinstance(layer, nn.Linear) else None


@pytest.mark.parametrize("attention,finder,supplied", [
    (NamedGateAttention, None, r"`o_proj`, which cwcore took as its output projection W_O \(by its name, one "
                               r"the registry knows\)"),
    (MisleadingAttention, _gate_finder, r"`gate`, which cwcore took as its output projection W_O \(from the "
                                        r"finder _gate_finder registered with cwcore.register_output_projection\)"),
], ids=["named", "registered"])
def test_a_wrong_guess_says_which_finder_made_it(attention, finder, supplied):
    finders = list(architectures._FINDERS)
    if finder is not None:
        cwcore.register_output_projection(finder)
    try:
        torch.manual_seed(0)
        model = ToyModel().eval()
        model.attn = attention(model.config).eval()
        with pytest.raises(cwcore.UnsupportedModelError, match=supplied + ", did not receive the attention output"):
            cwcore.decompose(model, input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        architectures._FINDERS[:] = finders


class ParameterAttention(nn.Module):
    """Weights held as plain parameters (W_O applied as ``out @ self.w_o.T``): no linear child, so no finder
    locates W_O."""

    def __init__(self, config, width=16, heads=2):
        super().__init__()
        self.config, self.heads, self.dim = config, heads, width // heads
        self.w_qkv = nn.Parameter(torch.randn(3 * width, width) * 0.3)
        self.w_o = nn.Parameter(torch.randn(width, width) * 0.3)
        self.scaling = self.dim**-0.5
        self.is_causal = False

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.dim).transpose(1, 2) for t in (x @ self.w_qkv.T).chunk(3, -1))
        implementation = self.config._attn_implementation
        if implementation == "eager":
            out = (torch.softmax(q @ k.transpose(2, 3) * self.scaling, -1, dtype=torch.float32) @ v).transpose(1, 2)
        else:
            out, _ = ALL_ATTENTION_FUNCTIONS[implementation](self, q, k, v, None, scaling=self.scaling)
        return out.reshape(b, n, -1) @ self.w_o.T


class TwoBlockModel(nn.Module):
    """Block 0's W_O is a plain parameter, block 1's a linear layer (``mix``, found by structure)."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig()
        self.config._attn_implementation = "eager"
        self.embed = nn.Embedding(11, 16)
        self.first = ParameterAttention(self.config)
        self.attn = ToyAttention(self.config)

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        return self.attn(x + self.first(x))


def test_a_block_whose_output_projection_is_not_found_keeps_its_number_and_is_refused():
    torch.manual_seed(0)
    model = TwoBlockModel().eval()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    blocks = architectures.attention_blocks(model)
    assert [(b.layer, b.name) for b in blocks] == [(0, "first"), (1, "attn")]  # never dropped, never renumbered
    assert architectures.decomposable_layers(model) == [1]
    reason = (r"attention block 0 \('first', ParameterAttention\) cannot be decomposed: no output projection W_O "
              r"found \(the block has no linear child.*if W_O is a plain parameter.*register that module with "
              r"cwcore\.register_output_projection$")
    for asked in (0, -2, [0, 1]):
        with pytest.raises(cwcore.UnsupportedModelError, match=reason):
            cwcore.decompose(model, layers=asked, input_ids=ids)
    with pytest.raises(cwcore.UnsupportedModelError, match=reason):
        cwcore.intervene(model, {0: torch.zeros((), dtype=torch.bool)}).__enter__()
    with pytest.warns(UserWarning, match=r"layer 0 \('first', ParameterAttention\) is not decomposed: no output "
                                         r"projection W_O found"):
        d = cwcore.decompose(model, input_ids=ids)
    assert d.layers == [1] and list(d.undecomposable) == [0]
    with pytest.raises(KeyError, match=r"^layer 0 cannot be decomposed: no output projection W_O found"):
        d.inter[0]
    with torch.no_grad():
        expected, probs = model(ids)
    assert torch.equal(d.outputs[0], expected)
    torch.testing.assert_close(d.attention[1], probs, rtol=0, atol=1e-7)


def test_a_registered_finder_makes_the_family_exact(registered):
    torch.manual_seed(0)
    _check_exact(ToyModel().eval())


def _check_exact(model):
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected_output, expected_probs = model(ids)
    d = cwcore.decompose(model, input_ids=ids)
    assert d.layers == [0]
    out, probs = d.outputs
    assert torch.equal(out, expected_output)  # the model computes what it always computes
    torch.testing.assert_close(d.attention[0], expected_probs, rtol=0, atol=1e-7)
    # every field against a naive model-space computation from the module's own weights
    with torch.no_grad():
        values = model.attn.v(model.embed(ids)).view(1, 5, 2, 8).transpose(1, 2)
    w_o = split_output_projection(model.attn.mix.weight.detach(), 2)
    naive = naive_geometry(expected_probs, values, w_o)
    torch.testing.assert_close(d.output_norm[0], naive.output_norm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d[0].geometry.inter_dot, naive.inter_dot, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d.output_bias[0], model.attn.mix.bias.detach())
    # o_i + b_O is what the output projection returned
    torch.testing.assert_close(d[0].geometry.output + d.output_bias[0], expected_output, rtol=1e-5, atol=1e-6)


# -- model facts: one home, one rule each ---------------------------------------------------------------
def test_sliding_windows_and_layer_types_follow_one_rule_read_by_every_package():
    from cwcore.faithfulness.ranking import layer_windows
    from cwcore.sinks.engine import layer_types
    from zoo_models import zoo_model

    expected = {"mistral": [4, 4], "gemma3": [4, None], "gpt_oss": [4, None], "llama": [None, None],
                "qwen2": [None, None], "jamba": [None, None], "starcoder2": [4, 4]}
    for name, windows in expected.items():
        model = zoo_model(name)
        assert list(architectures.sliding_windows(model).values()) == windows, name
        # the faithfulness sweep and the sink analyses read the same rule
        assert layer_windows(model, len(windows)) == windows, name
        assert list(layer_types(model).values()) == ["sliding" if w else "global" for w in windows], name


def test_the_post_attention_norm_is_found_by_observation_even_inside_a_session():
    from cwcore.core.attention import AttentionSession, cwcore_attention, every_layer
    from zoo_models import ZOO

    gemma = ZOO["gemma3"].build()  # a fresh model: nothing cached
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        clean = gemma(input_ids=ids).logits
    found = {}
    session = AttentionSession(gemma, observers=every_layer(
        gemma, lambda call: found.setdefault(call.layer, architectures.post_attention_norms(gemma)[call.layer])))
    with torch.no_grad(), cwcore_attention(gemma, session):
        logits = gemma(input_ids=ids).logits  # the probe pass runs inside layer 0's observer, unseen by the session
    assert torch.equal(logits, clean)
    assert [found[layer] for layer in (0, 1)] == [gemma.model.layers[i].post_attention_layernorm for i in (0, 1)]
    llama = ZOO["llama"].build()  # Llama's post_attention_layernorm is the MLP's pre-norm, not one
    assert set(architectures.post_attention_norms(llama).values()) == {None}


def test_model_facts_are_defined_only_in_architectures():
    import ast
    import pathlib

    package = pathlib.Path(cwcore.__file__).parent
    facts = {"_text_config", "text_config", "_layer_type_of", "_post_attention_norm", "post_attention_norms",
             "_final_norm_module", "final_norm", "sliding_window", "_candidate_norms"}
    homes = {}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in facts:
                homes.setdefault(node.name, []).append(path.relative_to(package).as_posix())
    assert homes and all(where == ["core/architectures.py"] for where in homes.values()), homes


def test_cwcore_writes_nothing_on_the_users_model():
    """Facts about a model (blocks, post-attention norms, own positions) are kept beside it, keyed weakly
    by the model object: no ``_cwcore_*`` attribute on the model or its modules, and a deep copy of the
    model gets blocks of its own modules, not the original's."""
    import copy
    import gc
    import weakref

    import cwcore
    from cwcore.core import architectures

    model = tiny_model("gemma3")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    d = cwcore.decompose(model, input_ids=ids)
    architectures.post_attention_norms(model)
    written = [(name, attribute) for name, module in model.named_modules() for attribute in vars(module)
               if attribute.startswith("_cwcore")]
    assert written == []
    twin = copy.deepcopy(model)
    blocks, twin_blocks = architectures.attention_blocks(model), architectures.attention_blocks(twin)
    assert [b.name for b in blocks] == [b.name for b in twin_blocks]
    assert all(t.module is not b.module and any(t.module is m for m in twin.modules())
               for b, t in zip(blocks, twin_blocks))
    torch.testing.assert_close(cwcore.decompose(twin, input_ids=ids)[1].contribution(), d[1].contribution())
    gone = weakref.ref(twin)
    del twin, twin_blocks
    gc.collect()
    assert gone() is None  # the facts do not keep a model alive
