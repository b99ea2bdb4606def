"""Causal LMs beyond Llama and Qwen2 through hf-spec: tiny random models of many architectures, greedy output
equal to their own `generate` with real trees (siblings, non-prefix acceptance) for a single sequence and a
padded batch; sliding-window models (uniform and mixed with full layers) past their window; clear errors where a
method cannot run."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers import DynamicCache

from hf_spec import SpeculativeDecoder
from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.engine.target.windows import attention_windows, sequence_mask, target_cache, windowed_mask
from hf_spec.methods.hispec.config import HiSpecConfig
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids
from tests.conftest import CACHE, assert_equal_up_to_ties, prompt_ids, tiny_fields

V, WINDOW = 96, 8
COMMON = tiny_fields(V, layers=4)
GPT = dict(n_embd=32, n_layer=4, n_head=4, n_positions=512)
# name -> (config class, extra fields, attention implementation)
ARCHITECTURES = {
    "llama": (T.LlamaConfig, {}, "sdpa"),
    "mistral": (T.MistralConfig, {"sliding_window": None}, "sdpa"),
    "phi3": (T.Phi3Config, {}, "sdpa"),
    "phi": (T.PhiConfig, {}, "sdpa"),
    "gemma": (T.GemmaConfig, {"head_dim": 8}, "sdpa"),
    "olmo2": (T.Olmo2Config, {}, "sdpa"),
    "stablelm": (T.StableLmConfig, {}, "sdpa"),
    "cohere": (T.CohereConfig, {}, "sdpa"),
    "gpt2": (T.GPT2Config, GPT, "sdpa"),
    "gpt_bigcode": (T.GPTBigCodeConfig, GPT, "sdpa"),
    "gpt_neox": (T.GPTNeoXConfig, {}, "sdpa"),
    "opt": (T.OPTConfig, {"ffn_dim": 64, "word_embed_proj_dim": 32}, "sdpa"),
    "falcon": (T.FalconConfig, {"new_decoder_architecture": True, "num_kv_heads": 2}, "sdpa"),
    "mixtral": (
        T.MixtralConfig,
        {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
        "sdpa",
    ),
}
# models whose forward scales embeddings, residuals or logits outside the modules layer-wise methods run
MULTIPLIERS = {
    "granite": (T.GraniteConfig, {"embedding_multiplier": 3.0, "logits_scaling": 4.0}, "sdpa"),
    "gemma2-softcap": (
        T.Gemma2Config,
        {"head_dim": 8, "sliding_window": 512, "final_logit_softcapping": 5.0},
        "eager",
    ),
}
SLIDING = {
    "mistral-window": (T.MistralConfig, {"sliding_window": WINDOW}, "sdpa"),  # every layer slides
    "gemma3-window": (
        T.Gemma3TextConfig,
        {"head_dim": 8, "sliding_window": WINDOW, "sliding_window_pattern": 2},
        "sdpa",
    ),  # sliding and full layers alternate
    "qwen2-window": (
        T.Qwen2Config,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2},
        "sdpa",
    ),
    "gemma2-window": (T.Gemma2Config, {"head_dim": 8, "sliding_window": WINDOW}, "eager"),
}


def build(name: str):
    cls, extra, attention = {**ARCHITECTURES, **SLIDING, **MULTIPLIERS}[name]
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra}), attn_implementation=attention)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # peaked logits: few near-ties
    return model.eval()


class GreedyTreeDrafter(Drafter):
    """Knows the target's greedy continuation and hides it in a tree: at each of 3 levels a wrong first child,
    then the right one, so acceptance takes non-first branches (the cache keeps non-prefix slots) and goes deep."""

    batchable = True

    def __init__(self, target) -> None:
        super().__init__(MethodConfig(), target)

    def for_another_row(self) -> GreedyTreeDrafter:
        return self

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        ids = state.input_ids
        tokens, parents, parent = [], [], -1
        for _ in range(min(3, max_depth)):
            with torch.no_grad():
                right = int(self.model(input_ids=ids).logits[0, -1].argmax())
            wrong = (right + 1) % V
            tokens += [wrong, right]
            parents += [parent, parent]
            parent = len(tokens) - 1
            ids = torch.cat([ids, torch.tensor([[right]])], dim=1)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def long_prompt() -> torch.Tensor:
    body = prompt_ids(12, V)[:, 1:]
    return torch.cat([torch.ones(1, 1, dtype=torch.long), body, body[:, :6]], dim=1)  # 18 tokens, a repeat


def check_single_and_batch(model, new: int = 36) -> None:
    ids = long_prompt()
    for prompt in (ids, ids[:, 3:]):
        ref = model.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
        for drafter in (GreedyTreeDrafter(model), "pld", "oracle:3"):  # trees, both, chains
            dec = SpeculativeDecoder(drafter)
            out = model.generate(
                prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, custom_generate=dec
            )
            assert_equal_up_to_ties(model, prompt, out, ref)
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:, 3:]], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    kwargs = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    ref = model.generate(batch, **kwargs)
    for mode in ("batched", "rows"):
        out = model.generate(
            batch, **kwargs, custom_generate=SpeculativeDecoder(GreedyTreeDrafter(model), batches=mode)
        )
        for r, n_pad in enumerate((0, 3)):
            prompt = batch[r : r + 1, n_pad:]
            assert_equal_up_to_ties(model, prompt, out[r : r + 1, n_pad:], ref[r : r + 1, n_pad:])


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_trees_equal_generate_on_many_architectures(name):
    check_single_and_batch(build(name))


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_window_models_past_their_window(name):
    """54 tokens through a window of 8: hf-spec keeps every key and masks what the window drops."""
    model = build(name)
    assert any(w == WINDOW for w in attention_windows(model))
    check_single_and_batch(model)


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-window"])
def test_windowed_tree_mask_gives_the_models_sliding_logits(name):
    """A 6-token block verified after 20 cached tokens with hf-spec's full cache and windowed mask gives the logits
    of the model's own forward (its own sliding masks); without the window it would not."""
    model = build(name)
    ids = torch.randint(3, V, (1, 26), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(input_ids=ids).logits[0, 20:]
        tree = DraftTree.chain(ids[0, 21:].tolist())
        positions = tree_position_ids(tree, 20)
        plain = tree_attention_mask(tree, 20)
        outs = []
        for mask in (sequence_mask(model, plain, positions), plain):
            cache = target_cache(model)
            model(input_ids=ids[:, :20], **{CACHE: cache}, use_cache=True)
            out = model(input_ids=ids[:, 20:], position_ids=positions, attention_mask=mask, **{CACHE: cache})
            outs.append(out.logits[0])
    windowed, unwindowed = outs
    torch.testing.assert_close(windowed, want, atol=1e-4, rtol=1e-4)
    assert (unwindowed - want).abs().max() > 1e-2


def test_windowed_mask_hides_keys_a_window_back():
    model = build("gemma3-window")
    mask = torch.zeros(1, 1, 2, 12)
    masks = windowed_mask(model, mask, torch.tensor([[10, 11]]), torch.arange(12)[None])
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["full_attention"], mask)
    hidden = masks["sliding_attention"][0, 0] < 0
    assert hidden[0].tolist() == [True] * 3 + [False] * 9  # query at 10 sees keys 3..11 (10 - key < 8)
    assert hidden[1].tolist() == [True] * 4 + [False] * 8


def test_the_cache_is_full_attention_for_sliding_models():
    assert type(target_cache(build("mistral-window"))) is DynamicCache
    model = build("mistral-window")
    cache = target_cache(model)
    model(input_ids=long_prompt(), **{CACHE: cache}, use_cache=True)
    assert cache.layers[0].keys.shape[-2] == long_prompt().shape[1]  # nothing dropped


def test_layer_wise_methods_refuse_sequences_past_the_window():
    model = build("mistral-window")
    with pytest.raises(
        ValueError, match="only within the window: this sequence may reach 22 tokens, the window is 8"
    ):
        model.generate(long_prompt(), max_new_tokens=4, custom_generate=SpeculativeDecoder("early-exit:2"))
    hispec = HiSpecConfig(draft_layer=1, verify_layer=2)
    with pytest.raises(ValueError, match="hispec support sliding-window attention only within the window"):
        model.generate(long_prompt(), max_new_tokens=4, custom_generate=SpeculativeDecoder(hispec))


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-window"])
def test_layer_wise_methods_within_the_window(name):
    """Early exit and HiSpec run the stock layers with masks that carry no window: exact while the whole sequence
    fits in it (18 + 30 tokens, window 64)."""
    model = build(name)
    for config in (model.config, getattr(model.config, "text_config", model.config)):
        config.sliding_window = 64
    model.__dict__.pop("_hf_spec_windows", None)
    ids = long_prompt()
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    for method in ("early-exit:2", HiSpecConfig(draft_layer=1, verify_layer=2)):
        out = model.generate(
            ids,
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=None,
            custom_generate=SpeculativeDecoder(method),
        )
        assert_equal_up_to_ties(model, ids, out, ref)


def test_a_filled_sliding_cache_is_refused():
    model = build("mistral-window")
    ids = long_prompt()
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :10], **{CACHE: cache}, use_cache=True)
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer"):
        model.generate(ids, **{CACHE: cache}, max_new_tokens=4, custom_generate=SpeculativeDecoder("pld"))


def test_unsupported_layer_types_are_named():
    model = build("mistral")
    model.config.layer_types = ["chunked_attention"] * 4
    model.config.attention_chunk_size = 4
    with pytest.raises(ValueError, match="chunked_attention"):
        model.generate(long_prompt(), max_new_tokens=4, custom_generate=SpeculativeDecoder("pld"))


def test_an_offloaded_static_cache_is_refused_before_the_prefill():
    """Static caches work (tests/test_static_cache.py); an offloaded one is refused by name, before any forward."""
    model = build("mistral")
    calls = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(TypeError, match="offloaded static cache"):
            model.generate(
                long_prompt(),
                max_new_tokens=4,
                cache_implementation="offloaded_static",
                custom_generate=SpeculativeDecoder("pld"),
            )
    finally:
        handle.remove()
    assert not calls


def test_a_peft_lora_model_generates_through_hf_spec():
    """`PeftModel.generate` hands `custom_generate` to the base model, whose layers now carry LoRA adapters (and
    hf-spec's kernels run their inner `nn.Linear`s): output equal to the adapted model's own greedy `generate`."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build("mistral"),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
        ),
    ).eval()
    ids = long_prompt()
    ref = model.generate(input_ids=ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    with model.disable_adapter():
        assert not torch.equal(
            model.generate(input_ids=ids, max_new_tokens=30, do_sample=False, eos_token_id=None), ref
        )
    for drafter in ("pld", "early-exit:2", GreedyTreeDrafter(model.get_base_model())):
        dec = SpeculativeDecoder(drafter)
        out = model.generate(
            input_ids=ids, max_new_tokens=30, do_sample=False, eos_token_id=None, custom_generate=dec
        )
        assert_equal_up_to_ties(model.get_base_model(), ids, out, ref)


@pytest.mark.parametrize("name", sorted({**ARCHITECTURES, **MULTIPLIERS}))
def test_early_exit_equals_generate_or_names_what_it_needs(name):
    """Layer-wise drafting runs the model's own layers: exact on the Llama-family layout (also where the forward
    scales embeddings or logits besides: the drafts are only drafts, the target verifies), a clear error
    elsewhere."""
    from hf_spec.models.layers import decoder_parts

    model = build(name)
    ids = long_prompt()
    try:
        decoder_parts(model)
    except ValueError as err:
        assert "Llama-family layout" in str(err)
        with pytest.raises(ValueError, match="Llama-family layout"):
            model.generate(ids, max_new_tokens=4, custom_generate=SpeculativeDecoder("early-exit:2"))
        return
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    dec = SpeculativeDecoder("early-exit:2")
    out = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, custom_generate=dec)
    assert_equal_up_to_ties(model, ids, out, ref)


@pytest.mark.parametrize("name", sorted({**ARCHITECTURES, **MULTIPLIERS}))
def test_hispec_equals_generate_or_refuses_a_model_it_cannot_run_exactly(name):
    """HiSpec's last stage runs the model's layers itself and gives the target's logits: equal to `generate` where
    that is the model's forward, refused where the forward scales embeddings or logits besides (Granite's
    multipliers changed the greedy output before the check; Gemma 2's soft-capping and Cohere's logit scale would
    change sampled output)."""
    from hf_spec.models.layers import decoder_parts

    model = build(name)
    try:
        decoder_parts(model)
    except ValueError:
        return  # not the Llama-family layout: test_early_exit_equals_generate_or_names_what_it_needs
    ids = long_prompt()
    dec = SpeculativeDecoder(HiSpecConfig(draft_layer=1, verify_layer=2))
    if name in ("cohere", *MULTIPLIERS):
        with pytest.raises(ValueError, match="its own forward computes something else"):
            model.generate(ids, max_new_tokens=4, custom_generate=dec)
        return
    ref = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    out = model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None, custom_generate=dec)
    assert_equal_up_to_ties(model, ids, out, ref)


@pytest.mark.parametrize(
    ("cls", "extra"),
    [
        (T.BloomConfig, {"n_layer": 4, "n_head": 4}),
        (T.FalconConfig, {"alibi": True, "new_decoder_architecture": False, "multi_query": True}),
    ],
)
def test_alibi_models_are_refused_by_name(cls, extra):
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cls(**{**COMMON, **extra}), attn_implementation="eager").eval()
    with pytest.raises(ValueError, match="does not verify token trees.*ALiBi"):
        model.generate(long_prompt(), max_new_tokens=4, custom_generate=SpeculativeDecoder("pld"))


def test_the_tree_check_catches_a_model_that_misreads_its_masks(monkeypatch):
    """The self-check behind every generation: Falcon given grouped attention (as before this was scoped to models
    with `_supports_attention_backend`) adds a boolean mask to its scores; the check sees it on four tokens."""
    from hf_spec.engine.target.check import check_tree_verification

    good = build("llama")
    check_tree_verification(good)
    assert good.__dict__["_hf_spec_tree_check"][1] is None  # passed, and kept
    monkeypatch.setattr(T.FalconForCausalLM, "_supports_attention_backend", True)
    with pytest.raises(ValueError, match="differs from a plain forward"):
        check_tree_verification(build("falcon"))


def test_the_tree_check_can_be_skipped(monkeypatch):
    from hf_spec.engine.target.check import check_tree_verification

    monkeypatch.setenv("HF_SPEC_TREE_CHECK", "0")
    model = build("llama")
    check_tree_verification(model)
    assert "_hf_spec_tree_check" not in model.__dict__


def test_support_report_names_what_each_model_can_run(monkeypatch):
    from hf_spec.models.support import support_report

    llama = support_report(build("llama"))
    assert llama["tree verification"].startswith("yes") and llama["hispec"] == "yes"
    head = llama["greedy verification's LM head"]  # a tiny head: x stays in float32, 6 rows
    assert head.startswith("yes: int8-screened LM head for 1-6 rows, x in float32") or head.startswith("no:")
    from hf_spec.kernels import cpu_skinny_gemm as csg

    # bfloat16 heads are screened where hf-spec's bf16 kernel (AVX512-BF16) rescores the candidates, whichever
    # path runs the full head
    for flag in ("0", "1"):
        monkeypatch.setenv("HF_SPEC_BF16_KERNEL", flag)
        bf16 = support_report(build("llama").to(torch.bfloat16))["greedy verification's LM head"]
        if csg.load_kernel() is not None and csg.has_bf16():
            assert bf16.startswith("yes: int8-screened LM head for 1-6 rows")
        else:
            assert bf16.startswith("no:")
    monkeypatch.setattr(csg, "has_bf16", lambda: False)
    bf16 = support_report(build("llama").to(torch.bfloat16))["greedy verification's LM head"]
    assert bf16.startswith(
        "no: the full LM head: torch.bfloat16 weights (screened in float32, and in bfloat16"
    )
    monkeypatch.undo()
    gpt2 = support_report(build("gpt2"))
    assert gpt2["pld, retrieval, draft-model, talon (retrieval part)"] == "yes"
    assert gpt2["early-exit, postuse around it, talon's exit drafter"].startswith(
        "no: GPT2LMHeadModel does not have"
    )
    window = support_report(build("mistral-window"))
    assert window["attention"].startswith("sliding window 8 on 4 of 4 layers")
    assert window["hispec"] == "yes (sequences up to 8 tokens: the sliding window)"
    assert support_report(build("granite"))["hispec"].startswith("no: hispec runs GraniteForCausalLM")
    torch.manual_seed(0)
    bloom = T.AutoModelForCausalLM.from_config(
        T.BloomConfig(**{**COMMON, "n_layer": 4, "n_head": 4}), attn_implementation="eager"
    ).eval()
    report = support_report(bloom)
    assert report["tree verification"].startswith("no: BloomForCausalLM does not verify token trees")
    assert len(report) == 2  # nothing else is claimed


def test_check_command(capsys):
    from hf_spec.cli.main import main
    from tests.conftest import STORIES

    assert main(["check", "--target", str(STORIES)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM (llama)" in out and "tree verification" in out and "hispec" in out


def test_layer_kwargs_of_older_transformers(monkeypatch):
    """Before 5.24 transformers gave one dict of cache-layer arguments for every layer: the windows are the same."""
    from transformers import cache_utils

    from hf_spec.core import compat
    from hf_spec.engine.target.windows import attention_windows

    model = build("mistral-window")
    want = attention_windows(model)
    real = cache_utils.get_layer_types_and_kwargs

    def one_dict(config):
        types, kwargs = real(config)
        return types, kwargs[0] if isinstance(kwargs, list) else kwargs

    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", one_dict)
    assert compat.layer_types_and_kwargs(model.config)[1] == [{"sliding_window": WINDOW}] * len(want)
    model.__dict__.pop("_hf_spec_windows", None)
    assert attention_windows(model) == want == [WINDOW] * len(want)
