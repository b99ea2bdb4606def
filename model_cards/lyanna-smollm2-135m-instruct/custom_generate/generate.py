"""hf-spec decoding with the draft head of this folder, loaded by
`target.generate(..., custom_generate=<this folder>, trust_remote_code=True)`. Requires `pip install hf-spec`."""

from hf_spec.integrations import generate_with_recipe

RECIPE = '{"method": "lyanna", "head": ".", "depth": 6, "topk": 4, "budget": 16, "resample": "fused", "resample_min_steps": 1, "resample_budget": 6, "token_info": "lowrank", "hot_tokens": 0, "vocab_limit": 0}'


def generate(model, **kwargs):
    return generate_with_recipe(model, RECIPE, **kwargs)
