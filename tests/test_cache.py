"""KV-cache compaction leaves exactly the cache of the accepted path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_spec.engine.target.cache import compact_cache, crop_cache
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids
from tests.conftest import CACHE


@pytest.mark.parametrize("accepted", [[], [0], [0, 1], [3, 4], [0, 2]])
def test_compaction_equals_prefilling_the_accepted_path(tiny_model, accepted):
    torch.manual_seed(1)
    prompt = torch.randint(3, 96, (1, 7))
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, -1, 3]))
    past = prompt.shape[1] - 1
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(input_ids=prompt[:, :-1], **{CACHE: cache}, use_cache=True)
        ids = torch.cat([prompt[:, -1:], tree.tokens[None]], dim=1)
        tiny_model(
            input_ids=ids,
            position_ids=tree_position_ids(tree, past),
            attention_mask=tree_attention_mask(tree, past),
            **{CACHE: cache},
            use_cache=True,
        )
        compact_cache(cache, past, [0] + [i + 1 for i in accepted])
        ref = DynamicCache(config=tiny_model.config)
        tiny_model(
            input_ids=torch.cat([prompt[0], tree.tokens[accepted]])[None], **{CACHE: ref}, use_cache=True
        )
    assert cache.get_seq_length() == ref.get_seq_length()
    for got, want in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_crop_selected_layers_only(tiny_llama):
    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(input_ids=torch.randint(3, 96, (1, 10)), **{CACHE: cache}, use_cache=True)
    crop_cache(cache, 6, range(2))
    assert [layer.keys.shape[-2] for layer in cache.layers] == [6, 6, 10, 10]


def test_the_cache_goes_by_the_name_the_installed_transformers_uses(tiny_llama):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name is deprecated): hf-spec passes the cache
    by the name each forward takes, reads it from `generate`'s model_kwargs under either name, and returns it in
    the output field of the installed version."""
    import dataclasses

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from hf_spec import SpeculativeDecoder
    from hf_spec.core.compat import GENERATE_CACHE_KEY, OUTPUT_CACHE_FIELD, cache_kwargs, passed_cache

    cache = DynamicCache()
    layer = tiny_llama.model.layers[0]
    assert set(cache_kwargs(tiny_llama, cache)) == set(cache_kwargs(layer, cache)) == {GENERATE_CACHE_KEY}

    class Wrapper(torch.nn.Module):  # `*args, **kwargs`: the installed version's name
        def forward(self, *args, **kwargs):
            return kwargs

    assert cache_kwargs(Wrapper(), cache) == {GENERATE_CACHE_KEY: cache}
    assert OUTPUT_CACHE_FIELD in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    for name in ("cache", "past_key_values"):
        kwargs = {name: cache, "attention_mask": None}
        assert passed_cache(kwargs) is cache and name in kwargs
        assert passed_cache(kwargs, pop=True) is cache and set(kwargs) == {"attention_mask"}
    assert passed_cache({}) is None
    ids = torch.tensor([[1, 5, 7, 3]])
    out = tiny_llama.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        custom_generate=SpeculativeDecoder("pld"),
    )
    assert getattr(out, OUTPUT_CACHE_FIELD) is not None  # the cache the generation filled comes back
