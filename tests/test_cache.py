"""KV-cache compaction leaves exactly the cache of the accepted path."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_spec.tree.buffers import DraftTree, tree_attention_mask, tree_position_ids
from hf_spec.verify.cache import compact_cache, crop_cache


@pytest.mark.parametrize("accepted", [[], [0], [0, 1], [3, 4], [0, 2]])
def test_compaction_equals_prefilling_the_accepted_path(tiny_model, accepted):
    torch.manual_seed(1)
    prompt = torch.randint(3, 96, (1, 7))
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), torch.tensor([-1, 0, 0, -1, 3]))
    past = prompt.shape[1] - 1
    cache = DynamicCache(config=tiny_model.config)
    with torch.no_grad():
        tiny_model(input_ids=prompt[:, :-1], past_key_values=cache, use_cache=True)
        ids = torch.cat([prompt[:, -1:], tree.tokens[None]], dim=1)
        tiny_model(
            input_ids=ids,
            position_ids=tree_position_ids(tree, past),
            attention_mask=tree_attention_mask(tree, past),
            past_key_values=cache,
            use_cache=True,
        )
        compact_cache(cache, past, [0] + [i + 1 for i in accepted])
        ref = DynamicCache(config=tiny_model.config)
        tiny_model(
            input_ids=torch.cat([prompt[0], tree.tokens[accepted]])[None], past_key_values=ref, use_cache=True
        )
    assert cache.get_seq_length() == ref.get_seq_length()
    for got, want in zip(cache.layers, ref.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def test_crop_selected_layers_only(tiny_llama):
    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(input_ids=torch.randint(3, 96, (1, 10)), past_key_values=cache, use_cache=True)
    crop_cache(cache, 6, range(2))
    assert [layer.keys.shape[-2] for layer in cache.layers] == [6, 6, 10, 10]
