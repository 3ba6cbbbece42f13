"""Bad input at the core's boundary fails at once, in one sentence that names the argument."""

import re

import pytest
import torch

import cwcore
from tiny_models import VOCAB, tiny_model

IDS = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_a_misspelled_keyword_is_a_type_error_with_a_suggestion(model):
    with pytest.raises(TypeError, match=r"'attention_maks' \(did you mean 'attention_mask'\?\)"):
        cwcore.decompose(model, input_ids=IDS, attention_maks=torch.ones_like(IDS))


@pytest.mark.parametrize("call, typo, meant", [
    ("summarize", "row", "rows"), ("summarize", "topk", "top_k"), ("decompose", "layer", "layers"),
    ("decompose", "compute_type", "compute_dtype"), ("attribute", "metod", "method"), ("attribute", "kinds", "kind"),
    ("attribute", "input", "input_ids"),  # a model input, not attribute's inputs mapping
])
def test_a_misspelled_option_of_cwcores_own_is_suggested_too(model, call, typo, meant):
    # before: "summarize() got unexpected keyword argument(s) 'row'; LlamaForCausalLM accepts ...", no suggestion,
    # since only the model's inputs were candidates
    with pytest.raises(TypeError, match=rf"^{call}\(\) got unexpected keyword argument\(s\) '{typo}' \(did you mean "
                                        rf"'{meant}'\?\)"):
        getattr(cwcore, call)(model, input_ids=IDS, **{typo: 1})


@pytest.mark.parametrize("call", ["decompose", "summarize", "attribute"])
def test_a_tokenizers_extra_outputs_are_named_as_such(model, call):
    # before: "got unexpected keyword argument(s) 'length' (did you mean 'max_length_q'?), 'offset_mapping', ...":
    # tokenizer(text, return_offsets_mapping=True, return_length=True) outputs, which the model's **kwargs swallow
    extras = {"offset_mapping": torch.zeros(2, 6, 2, dtype=torch.long), "length": torch.tensor([6, 6])}
    with pytest.raises(TypeError, match=rf"^{call}\(\): 'length', 'offset_mapping' are the tokenizer's own outputs, not "
                                        rf"model inputs: leave them out, e.g. {call}\(model, input_ids=enc\['input_ids'\]"):
        getattr(cwcore, call)(model, input_ids=IDS, **extras)
    with pytest.raises(TypeError, match=r"'special_tokens_mask' is the tokenizer's own output, not a model input"):
        cwcore.decompose(model, input_ids=IDS, special_tokens_mask=torch.zeros_like(IDS))
    # a misspelling is never answered with the flash-attention kernel's packing keywords
    with pytest.raises(TypeError, match=r"^decompose\(\) got unexpected keyword argument\(s\) 'max_lenght';"):
        cwcore.decompose(model, input_ids=IDS, max_lenght=3)


@pytest.mark.parametrize("ids, error, match", [
    (IDS.float(), TypeError, "integer token ids"),
    (IDS[:0], ValueError, "empty"),
    (IDS + VOCAB, ValueError, rf"\[0, {VOCAB}\)"),
    (IDS[None], ValueError, r"\[batch, sequence\]"),
])
def test_bad_ids(model, ids, error, match):
    with pytest.raises(error, match=match):
        cwcore.decompose(model, input_ids=ids)


@pytest.mark.parametrize("call", ["decompose", "summarize", "attribute"])
@pytest.mark.parametrize("ids, shape", [([], (1, 0)), ([[]], (1, 0))])
def test_empty_ids_are_said_to_be_empty(model, call, ids, shape):
    # before: "input_ids must be integer token ids, got torch.float32" (torch makes [] float32)
    with pytest.raises(ValueError, match=rf"^{call}: input_ids is empty \(shape {re.escape(str(shape))}\): "
                                         "give at least one token$"):
        getattr(cwcore, call)(model, input_ids=ids)


def test_one_sequence_is_a_batch_of_one(model):
    one = cwcore.decompose(model, layers=0, input_ids=IDS[0])
    two = cwcore.decompose(model, layers=0, input_ids=IDS[:1])
    assert torch.equal(one.inter[0], two.inter[0])


def test_a_mask_of_another_shape_is_refused(model):
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\) but the inputs are \(2, 6\)"):
        cwcore.decompose(model, input_ids=IDS, attention_mask=torch.ones(2, 5, dtype=torch.long))


def test_an_input_longer_than_the_context_is_refused(model):
    long = torch.zeros(1, 65, dtype=torch.long)
    with pytest.raises(ValueError, match="built for at most 64"):
        cwcore.decompose(model, input_ids=long)


@pytest.mark.parametrize("layers, error", [("3", TypeError), (7, IndexError), ([0, 1.0], TypeError), (True, TypeError)])
def test_layers_argument(model, layers, error):
    with pytest.raises(error, match="layer"):
        cwcore.decompose(model, layers=layers, input_ids=IDS)


def test_compute_dtype_accepts_its_name(model):
    d = cwcore.decompose(model, layers=0, compute_dtype="float64", input_ids=IDS)
    assert d[0].attention.dtype == torch.float64
    with pytest.raises(ValueError, match="compute_dtype"):
        cwcore.decompose(model, compute_dtype=torch.float16, input_ids=IDS)


def test_intervention_masks_must_be_boolean_and_of_the_layer_shape(model):
    with pytest.raises(TypeError, match=r"masks\[1\] must be boolean"):
        with cwcore.intervene(model, {1: torch.full((1, 4, 6, 6), 0.5)}):
            model(input_ids=IDS)
    with pytest.raises(ValueError, match=r"masks\[0\] has shape \(3, 6\).*\[2, 4, 6, 6\]"):
        with cwcore.intervene(model, {0: torch.zeros(3, 6, dtype=torch.bool)}):
            model(input_ids=IDS)
    ints = torch.zeros(1, 4, 6, 6, dtype=torch.long)
    ints[..., 2] = 1
    with torch.no_grad(), cwcore.intervene(model, {0: ints}):
        by_int = model(input_ids=IDS).logits
    with torch.no_grad(), cwcore.intervene(model, {0: ints.bool()}):
        by_bool = model(input_ids=IDS).logits
    assert torch.equal(by_int, by_bool)


@pytest.mark.parametrize("entry", [cwcore.decompose, cwcore.summarize])
def test_text_where_layers_go_says_to_tokenize_it(model, entry):
    # decompose(model, "The cat sat"): the text lands in ``layers``; the error says what to pass instead
    with pytest.raises(TypeError, match=r"^layers must be .* got 'The cat sat'; text is tokenized first: "
                                        r"cwcore\.\w+\(model, \*\*tokenizer\(text, return_tensors='pt'\)\)$"):
        entry(model, "The cat sat")


@pytest.mark.parametrize("entry", [cwcore.decompose, cwcore.summarize, cwcore.attribute])
def test_an_empty_list_of_layers_is_bad_input_not_an_unsupported_model(model, entry):
    # the model is decomposable; it is the request that holds no layer
    with pytest.raises(ValueError, match=r"^layers is empty: give at least one layer number \(0\.\.1\), or None for all$"):
        entry(model, layers=[], input_ids=IDS)


@pytest.mark.parametrize("entry", [cwcore.decompose, cwcore.summarize, cwcore.attribute])
def test_no_inputs_at_all_is_one_sentence_before_the_model_runs(model, entry):
    name = entry.__name__
    with pytest.raises(ValueError, match=rf"^{name}: no inputs: give the model's inputs as keywords, e.g. "
                                         rf"{name}\(model, \*\*tokenizer\(text, return_tensors='pt'\)\)$"):
        entry(model)


def test_ragged_token_lists_say_to_pad_them(model):
    # tokenizer(["The cat sat", "Hi"]) without padding: before, "input_ids must be a tensor of token ids, got
    # list", though rectangular lists are accepted
    with pytest.raises(ValueError, match=r"^decompose: input_ids holds sequences of unequal lengths \(2 to 3 tokens\); "
                                         r"pad them: tokenizer\(texts, padding=True, return_tensors='pt'\)$"):
        cwcore.decompose(model, input_ids=[[5, 6, 7], [8, 9]])
    rectangular = cwcore.decompose(model, layers=0, input_ids=[[5, 6, 7], [8, 9, 10]])
    assert torch.equal(rectangular.attention[0], cwcore.decompose(model, layers=0, input_ids=torch.tensor(
        [[5, 6, 7], [8, 9, 10]])).attention[0])


@pytest.mark.parametrize("entry", [cwcore.decompose, cwcore.summarize, cwcore.attribute])
def test_ids_and_embeddings_together_are_one_sentence(model, entry):
    # before: transformers' "You must specify exactly one of input_ids or inputs_embeds", many frames deep
    embeds = model.get_input_embeddings()(IDS)
    with pytest.raises(ValueError, match=rf"^{entry.__name__}: give input_ids or inputs_embeds, not both$"):
        entry(model, input_ids=IDS, inputs_embeds=embeds)
    # the control: either alone is taken, and they decompose alike
    torch.testing.assert_close(cwcore.decompose(model, layers=0, inputs_embeds=embeds).attention[0],
                               cwcore.decompose(model, layers=0, input_ids=IDS).attention[0])


def test_to_frame_takes_a_numpy_layer_number(model):
    import numpy as np

    d = cwcore.decompose(model, input_ids=IDS)
    # before: list(np.int64(1)) raised "'numpy.int64' object is not iterable"
    assert d.to_frame(layers=np.int64(1)).equals(d.to_frame(layers=1))
    assert d.to_frame(layers=[np.int64(0), 1]).equals(d.to_frame(layers=[0, 1]))
    assert set(d.to_frame(layers=1)["layer"]) == {1}
    # a negative number counts from the end, as d[-1] does: before, its rows were labelled -1, and [1, -1] gave
    # layer 1's terms twice
    assert d.to_frame(layers=-1).equals(d.to_frame(layers=1))
    assert d.to_frame(layers=[1, -1]).equals(d.to_frame(layers=1))


def test_truncate_keeps_the_first_tokens_of_every_per_token_input_labels_included():
    """truncate=True cuts input_ids, the mask and a causal LM's labels alike. Before, labels kept their length
    and the model's loss failed with a shape error; nothing tested truncate at all."""
    gpt2 = tiny_model("gpt2")  # built for 64 positions
    ids = torch.randint(0, VOCAB, (1, 70), generator=torch.Generator().manual_seed(1))
    got = cwcore.decompose(gpt2, input_ids=ids, labels=ids, truncate=True)
    expected = cwcore.decompose(gpt2, input_ids=ids[:, :64])
    torch.testing.assert_close(got[1].contribution("inter"), expected[1].contribution("inter"), rtol=0, atol=0)
    with pytest.raises(cwcore.core.inputs.InputError, match="70 tokens but GPT2LMHeadModel was built for at most 64"):
        cwcore.decompose(gpt2, input_ids=ids)
    # "no" is truthy: decompose, summarize and logit_attribution kept 64 of the 70 tokens without a word
    from cwcore.core.summary import summarize
    from cwcore.logit_attribution import logit_attribution

    for call in (cwcore.decompose, summarize, logit_attribution):
        for given in ("no", "False", 1):
            with pytest.raises(TypeError, match=r"truncate must be True or False, not "):
                call(gpt2, input_ids=ids, truncate=given)
    with pytest.raises(cwcore.core.inputs.InputError, match="^logit_attribution: .*70 tokens"):  # it named decompose
        logit_attribution(gpt2, input_ids=ids)


def test_cached_and_new_tokens_beyond_the_context_are_refused_in_one_sentence():
    """60 cached + 10 new tokens on a 64-position GPT-2 failed inside the position embedding; the same 70 tokens
    without a cache were refused."""
    from transformers import DynamicCache

    model = tiny_model("gpt2")
    limit = model.config.n_positions
    ids = torch.randint(0, VOCAB, (1, limit - 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True).past_key_values
    new = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=f"{limit - 4} cached and 10 new tokens make {limit + 6}, but GPT2LMHeadModel "
                                         f"was built for at most {limit}"):
        cwcore.decompose(model, input_ids=new, past_key_values=cache)


def test_a_wrapper_passing_keywords_on_is_decomposed_and_the_wrapped_models_error_speaks():
    """A wrapper whose forward takes only ``**kwargs`` (PeftModel, DataParallel) was refused: "unexpected keyword
    argument 'input_ids'; ... accepts " and an empty list. The wrapped model is decomposed exactly."""
    from torch import nn
    from tiny_models import VOCAB, tiny_model

    class PassingOn(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    model = tiny_model("llama")
    wrapped = PassingOn(model).eval()
    d, alone = cwcore.decompose(wrapped, input_ids=ids), cwcore.decompose(model, input_ids=ids)
    torch.testing.assert_close(d[1].inter, alone[1].inter, rtol=0, atol=0)
    with pytest.raises(ValueError, match="input_ids"):  # the wrapped model's own error (cwcore cannot tell here)
        cwcore.decompose(wrapped, input_idz=ids)


def test_the_inputs_as_one_mapping_take_layers_by_keyword(model):
    """decompose(model, enc) is decompose(model, **enc), but decompose(model, enc, layers=[1]) failed with Python's
    "got multiple values for argument 'layers'" (the mapping sits in the layers slot): the layers could not be chosen
    in that form. The reference: the keyword form's layer."""
    from cwcore.core.inputs import InputError

    enc = {"input_ids": IDS, "attention_mask": torch.ones_like(IDS)}
    want = cwcore.decompose(model, layers=[1], **enc)
    for got in (cwcore.decompose(model, enc, layers=[1]), cwcore.decompose(model, [1], **enc)):
        assert got.layers == [1]
        torch.testing.assert_close(got[1].contribution("inter"), want[1].contribution("inter"))
    assert cwcore.decompose(model, enc).layers == [0, 1]  # the control: the mapping alone takes every layer
    summary = cwcore.summarize(model, enc, layers=0, top_k=2)
    assert summary.layers == [0]
    torch.testing.assert_close(summary[0].top.head, cwcore.summarize(model, layers=0, top_k=2, **enc)[0].top.head)
    with pytest.raises(InputError, match=r"^decompose: layers given twice, as the second positional argument \(\[0\]\) "
                                         r"and as layers=\[1\]; give one$"):
        cwcore.decompose(model, [0], layers=[1], **enc)
    # the model by keyword, and the mapping by the layers' keyword, as before the slot was positional-only
    by_keyword = cwcore.decompose(model=model, layers=[1], **enc)
    torch.testing.assert_close(by_keyword[1].contribution("inter"), want[1].contribution("inter"))
    assert cwcore.decompose(model, layers=enc).layers == [0, 1]
    assert cwcore.summarize(model=model, layers=0, top_k=2, **enc).layers == [0]
