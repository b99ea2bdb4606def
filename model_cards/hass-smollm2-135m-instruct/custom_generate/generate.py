"""hf-spec decoding with the draft head of this folder, loaded by
`target.generate(..., custom_generate=<this folder>, trust_remote_code=True)`. Requires `pip install hf-spec`."""

from hf_spec.integrations import generate_with_recipe

RECIPE = '{"method": "eagle", "head": ".", "depth": 5, "topk": 4, "total_tokens": 16, "vocab_limit": 0}'


def generate(model, **kwargs):
    return generate_with_recipe(model, RECIPE, **kwargs)
