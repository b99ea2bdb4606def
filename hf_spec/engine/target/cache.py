"""Keeping a transformers KV cache in step with the committed tokens: crop and compact after a verification.

Dynamic layers (`DynamicLayer`) are cropped by slicing and compacted by rebuilding the block; static layers, while
hf-spec decodes (`hf_spec.engine.target.static.RewindableStaticLayer`), keep their buffers: a crop sets their
length and a compaction copies the kept slots in place.
"""

from __future__ import annotations

import torch
from transformers import Cache

from hf_spec.engine.target.static import RewindableStaticLayer

REWINDABLE = ("DynamicLayer", "RewindableStaticLayer")


def cache_layers(cache: Cache):
    """The cache's layers, each one hf-spec can crop and reorder (else `TypeError`)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"hf-spec needs a transformers `Cache` with `.layers`; got {type(cache).__name__}")
    for layer in layers:
        if type(layer).__name__ not in REWINDABLE:
            raise TypeError(
                f"hf-spec can only rewind full-attention dynamic or static cache layers; got {type(layer).__name__} "
                "(pass no cache, an empty DynamicCache or a StaticCache: hf-spec gives sliding-window models "
                "full layers; offloaded and quantized caches are not supported)"
            )
    return layers


def check_rewindable(cache: Cache) -> None:
    """Raise `TypeError` naming the first cache layer hf-spec cannot crop and reorder."""
    cache_layers(cache)


def cache_length(cache: Cache, layer: int = 0) -> int:
    return int(cache.get_seq_length(layer))


def crop_cache(cache: Cache, length: int, layers: range | None = None) -> None:
    """Keep the first `length` positions of the given layers (all by default)."""
    all_layers = cache_layers(cache)
    for i in layers if layers is not None else range(len(all_layers)):
        layer = all_layers[i]
        if isinstance(layer, RewindableStaticLayer):
            layer.crop_to(length)
        elif layer.keys is not None and layer.keys.numel() and layer.keys.shape[-2] > length:
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
    all_layers = cache_layers(cache)
    for i in layers if layers is not None else range(len(all_layers)):
        layer = all_layers[i]
        if isinstance(layer, RewindableStaticLayer):
            layer.keep_block(past_length, index)
            continue
        if layer.keys is None or not layer.keys.numel():
            continue
        idx = index.to(layer.keys.device)
        layer.keys = torch.cat([layer.keys[..., :past_length, :], layer.keys.index_select(-2, idx)], dim=-2)
        layer.values = torch.cat(
            [layer.values[..., :past_length, :], layer.values.index_select(-2, idx)], dim=-2
        )
