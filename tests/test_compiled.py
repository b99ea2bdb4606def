"""Compiled verification (`SpeculativeDecoder(..., compile=True)`): the same tokens as eager decoding, each width
compiled once and nothing compiled again as trees and the sequence change.

Most tests compile with dynamo's `aot_eager` backend (the same graphs and guards, no code generation: fast on two
cores); one slow test runs inductor."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_spec import SpeculativeDecoder
from hf_spec.engine.compiled_step import CompiledStep, rewindable_cache
from hf_spec.engine.target.compiled import WIDTHS, bucket
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import causal_mask, padded_block_mask, padded_tree_mask
from tests.conftest import make_tiny_model, prompt_ids
from tests.test_methods import METHOD_SPECS, decoder_for

FAST = CompileConfig(backend="aot_eager", fullgraph=True)


def compiled(spec: str, model) -> SpeculativeDecoder:
    decoder = decoder_for(spec, model)
    decoder.compile = True
    return decoder


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_bucket_widths():
    assert [bucket(n) for n in (1, 2, 3, 5, 9, 33, 64, 65)] == [1, 2, 4, 8, 16, 64, 64, None]
    assert WIDTHS[-1] == 64


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_every_method_compiled_equals_generate(tiny_llama, spec):
    ids = prompt_ids(14, seed=1)
    ref = tiny_llama.generate(ids, max_new_tokens=40, do_sample=False)
    dec = compiled(spec, tiny_llama)
    out = tiny_llama.generate(
        ids, max_new_tokens=40, do_sample=False, compile_config=FAST, custom_generate=dec
    )
    assert torch.equal(out, ref)
    stats = dec.last_stats
    assert stats.new_tokens == 40
    if spec.split(":")[0] not in ("hispec", "talon"):  # those verify by continuing their own forward: eager
        assert stats.compiled_rounds == stats.target_forwards > 0
    steps = drafter_steps(dec.drafter_for(tiny_llama))
    if spec.split(":")[0] in MODEL_STEP_METHODS:  # drafters whose steps are model forwards draft compiled too
        assert steps and all(step.failed is None for step in steps.values()), steps
        assert sum(step.compiled_calls for step in steps.values()) > 0


def test_compiled_head_steps_trace_no_cached_lookup(tiny_llama):
    """The head's cache keyword is looked up when the head is built, not in its traced step (dynamo warns about
    tracing through a `functools.cache`d function)."""
    import warnings

    ids = prompt_ids(10, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tiny_llama.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            compile_config=FAST,
            custom_generate=compiled("eagle3", tiny_llama),
        )
    assert not [w for w in caught if "lru_cache" in str(w.message)]


# methods whose drafter runs model forwards of its own (a head, or the target's first layers)
MODEL_STEP_METHODS = {"early-exit", "eagle", "eagle3", "lyanna", "hispec"}


def drafter_steps(drafter) -> dict[str, CompiledStep]:
    """The compiled steps a drafter kept (`hf_spec.engine.compiled_step.draft_steps`)."""
    layers = drafter.__dict__.get("_hf_spec_draft_steps")
    return layers[2] if layers is not None else {}


@pytest.mark.parametrize("spec", ["eagle3", "lyanna", "hispec", "early-exit:2"])
def test_drafter_steps_compile_nothing_in_a_later_generation(tiny_llama, spec):
    """A drafter's steps compile every width in the first round that meets each kind of call; a later generation
    (another prompt, other acceptance) compiles no new graph and keeps the output exact."""
    dec = compiled(spec, tiny_llama)
    ids = prompt_ids(14, seed=1)
    tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, compile_config=FAST, custom_generate=dec)
    before = unique_graphs()
    ids = prompt_ids(19, seed=6)
    ref = tiny_llama.generate(ids, max_new_tokens=64, do_sample=False)
    out = tiny_llama.generate(
        ids, max_new_tokens=64, do_sample=False, compile_config=FAST, custom_generate=dec
    )
    assert torch.equal(out, ref)
    assert unique_graphs() == before
    steps = drafter_steps(dec.drafter_for(tiny_llama))
    assert sum(step.compiled_calls for step in steps.values()) > 0


def test_padded_block_mask_keeps_the_rows_and_isolates_the_fillers():
    mask = causal_mask(2, 3)  # two rows after three cached slots
    padded = padded_block_mask(mask, 3, 4, 10)
    assert padded.shape == (1, 1, 4, 10)
    seen = padded[0, 0] == 0
    assert torch.equal(seen[:2, :5], mask[0, 0] == 0)
    assert not seen[:2, 5:].any()
    assert seen[2].nonzero().flatten().tolist() == [5] and seen[3].nonzero().flatten().tolist() == [6]
    # past the block the slots are -inf (hf-spec's CPU attention skips those keys); inside it the mask's own values
    assert torch.isneginf(padded[0, 0, :, 7:]).all()
    assert torch.equal(padded[0, 0, :2, :5], mask[0, 0])
    with pytest.raises(ValueError, match="does not fit"):
        padded_block_mask(mask, 3, 4, 6)


def test_padded_tree_mask_hides_with_minus_infinity_and_every_row_sees_a_slot():
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]))  # root -> a -> (b, c)
    mask = padded_tree_mask(tree, 3, 8, 16, torch.bfloat16)
    assert mask.shape == (1, 1, 8, 16) and mask.dtype == torch.bfloat16
    values = mask[0, 0]
    assert ((values == 0) | torch.isneginf(values)).all()
    seen = values == 0
    assert seen.any(dim=1).all(), "a row that sees no slot would make attention's softmax undefined"
    assert seen[:4, :3].all() and not seen[:, 11:].any()
    assert seen[3, 3:7].tolist() == [True, True, False, True]  # c sees the root, a and itself, not b
    assert seen[4:].nonzero()[:, 1].tolist() == [7, 8, 9, 10]  # fillers: their own slot only


def test_a_compiled_step_computes_the_eager_step():
    """An EAGLE head fed rows of 2, 1, 3 and 2 tokens: compiled over a static cache (padded widths, whole-cache
    masks) it gives the eager head's states over a dynamic cache; the first call, which allocates the buffers, runs
    eagerly."""
    from transformers import DynamicCache

    from hf_spec.engine.target.compiled import CompileSettings
    from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel

    model = make_tiny_model("llama", seed=3)
    torch.manual_seed(0)
    head = EagleHeadModel(EagleHeadConfig.for_target(model, 64)).eval().attach_target(model)
    static = rewindable_cache(64)
    step = CompiledStep(head, static, CompileSettings(backend="aot_eager"), max_width=4)
    dynamic = DynamicCache()
    hidden = model.config.hidden_size
    past = 0
    for n in (2, 1, 3, 2):
        features = torch.randn(1, n, hidden)
        ids = torch.randint(0, model.config.vocab_size, (1, n))
        positions = torch.arange(past + 1, past + n + 1)[None]
        mask = causal_mask(n, past)
        with torch.no_grad():
            want = head(features, ids, positions, mask, dynamic)
            got = step(features, ids, positions, mask, static)
        torch.testing.assert_close(got, want)
        past += n
    assert static.layers[0].length == past and step.compiled_calls == 3 and step.eager_calls == 1
    assert step.widths == (1, 2, 4)


def test_no_recompiles_over_a_long_generation_with_varying_trees():
    """128 tokens with trees of every size: after the widths the generation met were compiled (a first
    generation), a second generation over other trees compiles nothing."""
    model = make_tiny_model("llama", seed=3)
    ids = prompt_ids(10, seed=3)
    warm = ["pld"] + [f"oracle:{width - 1}" for width in WIDTHS[1:]]  # pld: plain steps (width 1) too
    for spec in warm:  # warm-up: every width (chains of `width - 1` right tokens)
        dec = SpeculativeDecoder(spec, compile=True)
        model.generate(ids, max_new_tokens=128, do_sample=False, compile_config=FAST, custom_generate=dec)
    assert {w for _, w, _ in model.__dict__["_hf_spec_compiled_verifier"].widths_compiled} == set(WIDTHS)
    before = unique_graphs()
    ids = prompt_ids(12, seed=5)
    ref = model.generate(ids, max_new_tokens=128, do_sample=False)
    for spec in ("oracle:40", "pld", "oracle:3"):  # trees of 1..40 nodes
        dec = SpeculativeDecoder(spec, compile=True)
        out = model.generate(
            ids, max_new_tokens=128, do_sample=False, compile_config=FAST, custom_generate=dec
        )
        assert torch.equal(out, ref)
        assert dec.last_stats.compiled_rounds == dec.last_stats.target_forwards
    assert unique_graphs() == before


def test_static_cache_implementation_compiles_with_a_compile_config_for_all_devices(tiny_llama):
    """transformers' rule: a static cache compiles on CPU when the compile config asks for every device."""
    ids = prompt_ids(14, seed=2)
    ref = tiny_llama.generate(ids, max_new_tokens=24, do_sample=False)
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    dec = SpeculativeDecoder("pld")
    out = tiny_llama.generate(
        ids, max_new_tokens=24, do_sample=False, cache_implementation="static", compile_config=config,
        custom_generate=dec,
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert dec.last_stats.compiled_rounds > 0
    eager = SpeculativeDecoder("pld")  # no compile config on CPU: eager over the static cache
    out = tiny_llama.generate(
        ids, max_new_tokens=24, do_sample=False, cache_implementation="static", custom_generate=eager
    )
    assert torch.equal(out, ref) and eager.last_stats.compiled_rounds == 0
    off = SpeculativeDecoder("pld", compile=False)
    tiny_llama.generate(
        ids, max_new_tokens=24, do_sample=False, cache_implementation="static", compile_config=config,
        custom_generate=off,
    )  # fmt: skip
    assert off.last_stats.compiled_rounds == 0


def test_sampling_compiled_keeps_the_distribution():
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import TEMP, TOP_P, SampledTreeDrafter, V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    options = {"temperature": TEMP, "top_p": TOP_P, "compile_config": FAST}
    decoders = []

    def factory():
        decoders.append(SpeculativeDecoder(SampledTreeDrafter(target, draft, 2), compile=True))
        return decoders[-1]

    pvalues, accepted = sampled_marginals_pvalues(target, factory, n=1500, seed=8, sampling=(options, None))
    assert accepted > 1500 * 0.3
    assert decoders[0].last_stats.compiled_rounds > 0
    assert min(pvalues) > 1e-3, pvalues


def test_a_filled_dynamic_cache_with_compile_is_refused(tiny_llama):
    from transformers import DynamicCache

    from tests.conftest import CACHE

    ids = prompt_ids(14, seed=1)
    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(ids[:, :6], **{CACHE: cache})
    with pytest.raises(ValueError, match="compile=True verifies over a static cache"):
        tiny_llama.generate(
            ids, **{CACHE: cache}, max_new_tokens=4, custom_generate=SpeculativeDecoder("pld", compile=True)
        )


@pytest.mark.slow
def test_inductor_compiled_equals_eager(tiny_llama):
    ids = prompt_ids(14, seed=4)
    ref = tiny_llama.generate(ids, max_new_tokens=40, do_sample=False)
    for spec in ("pld", "eagle"):
        dec = compiled(spec, tiny_llama)
        out = tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
        assert torch.equal(out, ref)
        assert dec.last_stats.compiled_rounds > 0


def test_a_head_with_packed_int4_linears_drafts_compiled():
    """`quantize="int4"` runs the head's linears on packed copies (patched forwards): they trace into the compiled
    step, which then drafts compiled, and the output is still plain `generate`'s."""
    from hf_spec.methods.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, Eagle3HeadConfig

    model = make_tiny_model("llama")
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3HeadConfig.for_target(model, 64, hidden_state_indices=(1, 2, 3)))
    drafter = Eagle3Drafter(Eagle3Config(depth=3, topk=2, total_tokens=5, quantize="int4"), model, head=head)
    ids = prompt_ids(14, seed=1)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    dec = SpeculativeDecoder(drafter, compile=True)
    out = model.generate(ids, max_new_tokens=24, do_sample=False, compile_config=FAST, custom_generate=dec)
    assert torch.equal(out, ref)
    step = drafter_steps(drafter)["draft_block"]  # a round's drafting, one compiled call
    assert step.failed is None and step.compiled_calls > 0
