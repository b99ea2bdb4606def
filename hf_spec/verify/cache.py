"""Keeping a transformers KV cache in step with the committed tokens, and passing it by the name the installed
transformers uses (`cache` from 5.24, `past_key_values` before)."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
from transformers import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

# the key under which `generate` hands a decoding method the KV cache in `model_kwargs`
GENERATE_CACHE_KEY = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
# the field of `generate`'s output dataclasses that holds the KV cache
OUTPUT_CACHE_FIELD = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    else "past_key_values"
)


@functools.cache
def _forward_cache_name(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return GENERATE_CACHE_KEY  # `*args, **kwargs` forwards (wrappers): the installed transformers' name


def cache_kwargs(module: torch.nn.Module, cache) -> dict:
    """`{name: cache}` for a forward of `module` (a model or a decoder layer), by the name its forward takes."""
    return {_forward_cache_name(type(module)): cache}


def passed_cache(model_kwargs: dict, pop: bool = False) -> Cache | None:
    """The KV cache `generate` put in `model_kwargs` (either name); `pop` removes it."""
    get = model_kwargs.pop if pop else model_kwargs.get
    found = [get(name, None) for name in ("cache", "past_key_values")]
    return next((c for c in found if c is not None), None)


def _layers(cache: Cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"hf-spec needs a transformers `Cache` with `.layers`; got {type(cache).__name__}")
    for layer in layers:
        if type(layer).__name__ != "DynamicLayer":
            raise TypeError(
                f"hf-spec can only rewind full-attention dynamic cache layers; got {type(layer).__name__} "
                "(drop `cache_implementation` and pass no cache or an empty DynamicCache: hf-spec builds one with "
                "full layers for sliding-window models; static, offloaded and quantized caches are not supported)"
            )
    return layers


def check_rewindable(cache: Cache) -> None:
    """Raise `TypeError` naming the first cache layer hf-spec cannot crop and reorder."""
    _layers(cache)


def cache_length(cache: Cache, layer: int = 0) -> int:
    return int(cache.get_seq_length(layer))


def crop_cache(cache: Cache, length: int, layers: range | None = None) -> None:
    """Keep the first `length` positions of the given layers (all by default)."""
    all_layers = _layers(cache)
    for i in layers if layers is not None else range(len(all_layers)):
        layer = all_layers[i]
        if layer.keys is not None and layer.keys.numel() and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def compact_cache(cache: Cache, past_length: int, keep: list[int], layers: range | None = None) -> None:
    """After verifying a block written at `[past_length, past_length + block)`, keep only the block positions
    listed in `keep` (relative; the kept block is rebuilt in `keep`'s order) and drop the rest.

    Example: block = [root, a, b, c] with path root -> c accepted: `keep = [0, 3]`.
    A prefix (`keep == [0, 1, ..., k-1]`) is a plain crop, with no copy.
    """
    if keep == list(range(len(keep))):
        crop_cache(cache, past_length + len(keep), layers)
        return
    index = torch.tensor(keep, dtype=torch.long) + past_length
    all_layers = _layers(cache)
    for i in layers if layers is not None else range(len(all_layers)):
        layer = all_layers[i]
        if layer.keys is None or not layer.keys.numel():
            continue
        idx = index.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :past_length, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat(
            [layer.values[..., :past_length, :], layer.values.index_select(-2, idx)], dim=-2
        )
