"""hf-spec decoding with the draft head of this folder, loaded by
`target.generate(..., custom_generate=<this folder>, trust_remote_code=True)`. Requires `pip install hf-spec`."""

from hf_spec.integrations import generate_with_recipe

RECIPE = '{"method": "eagle3", "config_version": 2, "head": ".", "depth": 5, "topk": 4, "total_tokens": 16, "vocab_limit": 0, "quantize": null, "max_catch_up": 0}'


def generate(model, **kwargs):
    return generate_with_recipe(model, RECIPE, **kwargs)
