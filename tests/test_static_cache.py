"""Static KV caches (`cache_implementation="static"`, a passed `StaticCache`): every method's greedy output equals
plain `generate`'s, the cache keeps its buffers and goes on working after a speculative call."""

from __future__ import annotations

import pytest
import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from hf_spec import SpeculativeDecoder
from tests.conftest import CACHE, assert_equal_up_to_ties, make_tiny_model, prompt_ids
from tests.test_architectures import GreedyTreeDrafter, build, long_prompt
from tests.test_methods import METHOD_SPECS, decoder_for


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_every_method_with_a_static_cache_equals_generate(tiny_llama, spec):
    tiny_model = tiny_llama
    ids = prompt_ids(14, seed=1)
    ref = tiny_model.generate(ids, max_new_tokens=40, do_sample=False)
    dec = decoder_for(spec, tiny_model)
    out = tiny_model.generate(
        ids, max_new_tokens=40, do_sample=False, cache_implementation="static", custom_generate=dec
    )
    assert torch.equal(out, ref)
    assert dec.last_stats.new_tokens == 40


@pytest.mark.parametrize("spec", ["pld", "early-exit:2", "eagle", "hispec", "talon"])
def test_passed_static_cache_with_a_prefix_keeps_its_buffers(tiny_llama, spec):
    """A `StaticCache` holding a prefix continues as transformers does; afterwards it is a stock `StaticCache`
    (same buffers, its length the generated sequence's but the last token) that plain decoding can continue."""
    ids = prompt_ids(14, seed=2)
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)
    cache = StaticCache(config=tiny_llama.config, max_cache_len=64)
    with torch.no_grad():
        tiny_llama(ids[:, :6], **{CACHE: cache})
    buffers = [layer.keys.data_ptr() for layer in cache.layers]
    out = tiny_llama.generate(
        ids,
        **{CACHE: cache},
        max_new_tokens=30,
        do_sample=False,
        custom_generate=decoder_for(spec, tiny_llama),
    )
    assert torch.equal(out, ref)
    assert all(type(layer) is StaticLayer for layer in cache.layers)
    assert [layer.keys.data_ptr() for layer in cache.layers] == buffers
    assert int(cache.get_seq_length()) == out.shape[1] - 1
    with torch.no_grad():  # plain decoding goes on from there
        nxt = tiny_llama(out[:, -1:], **{CACHE: cache}).logits[0, -1].argmax()
    more = tiny_llama.generate(ids, max_new_tokens=31, do_sample=False)
    assert int(nxt) == int(more[0, -1])


def test_trees_shrink_to_the_static_cache_room(tiny_llama):
    """A cache sized exactly to prompt + new tokens: the last rounds' trees are cut to the slots left."""
    ids = prompt_ids(14, seed=3)
    ref = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False)
    cache = StaticCache(config=tiny_llama.config, max_cache_len=ids.shape[1] + 20)
    out = tiny_llama.generate(
        ids,
        **{CACHE: cache},
        max_new_tokens=20,
        do_sample=False,
        custom_generate=SpeculativeDecoder("oracle:8"),
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("name", ["mistral-window", "gemma3-window"])
def test_sliding_window_static_cache(name):
    """An empty sliding-window static cache gets full layers (windowed masks) and goes past its window; a filled
    one is refused."""
    model = build(name)
    ids = long_prompt()
    ref = model.generate(ids, max_new_tokens=36, do_sample=False, eos_token_id=None)
    for drafter in (GreedyTreeDrafter(model), "pld"):
        out = model.generate(
            ids, max_new_tokens=36, do_sample=False, eos_token_id=None, cache_implementation="static",
            custom_generate=SpeculativeDecoder(drafter),
        )  # fmt: skip
        assert_equal_up_to_ties(model, ids, out, ref)
    cache = StaticCache(config=model.config, max_cache_len=64)
    with torch.no_grad():
        model(ids[:, :6], **{CACHE: cache})
    with pytest.raises(TypeError, match="filled sliding-window static cache"):
        model.generate(ids, **{CACHE: cache}, max_new_tokens=5, custom_generate=SpeculativeDecoder("pld"))


def test_static_cache_too_small_is_a_clear_error(tiny_llama):
    """A filled cache keeps its size (an empty one hf-spec allocates gets room for the generation)."""
    ids = prompt_ids(14, seed=1)
    cache = StaticCache(config=tiny_llama.config, max_cache_len=10)
    with torch.no_grad():
        tiny_llama(ids[:, :4], **{CACHE: cache})
    with pytest.raises(ValueError, match="static cache holds 10 tokens"):
        tiny_llama.generate(
            ids, **{CACHE: cache}, max_new_tokens=5, custom_generate=SpeculativeDecoder("pld")
        )


def test_sampling_with_a_static_cache_keeps_the_distribution():
    """do_sample=True over a static cache: per-position marginals equal plain sampling's (chi-square)."""
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import TEMP, TOP_P, SampledTreeDrafter, V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    options = {"temperature": TEMP, "top_p": TOP_P, "cache_implementation": "static"}
    pvalues, accepted = sampled_marginals_pvalues(
        target, lambda: SpeculativeDecoder(SampledTreeDrafter(target, draft, 2)), n=1500, seed=7,
        sampling=(options, None),
    )  # fmt: skip
    assert accepted > 1500 * 0.3
    assert min(pvalues) > 1e-3, pvalues
