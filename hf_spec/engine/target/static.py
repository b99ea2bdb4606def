"""Static KV caches (`cache_implementation="static"`, a passed `StaticCache`) in a loop that rewinds them.

A transformers `StaticLayer` owns buffers `(batch, kv_heads, max_cache_len, head_dim)` allocated once; `update`
writes the new keys at `cumulative_length` (a 0-d tensor, so a compiled step does not recompile as it grows) and
returns the whole buffer, which the model's masks cover up to `max_cache_len`.

For the time of a speculative generation hf-spec turns each one into a `RewindableStaticLayer` (the same object
and buffers; its class is switched back afterwards) that also tracks its length on the host:

- **eager forwards** (`sliced`): keys and values are written after the committed length and the layer returns the
  filled slots `[:length]` only, as a `DynamicLayer` does, so every mask hf-spec builds (trees, windows, drafters
  running the target's layers) is the one it builds for a dynamic cache, and attention reads no empty slots;
- **compiled forwards** (`hf_spec.engine.target.compiled`): the stock `StaticLayer.update`, whole buffers, masks
  padded to `max_cache_len`, shapes fixed whatever the length.

Rewinding never frees or moves a buffer: a crop sets the length (stale slots are overwritten by the next write and
masked until then), a compaction copies the kept block slots to the front of the block in place.

A sliding-window `StaticSlidingWindowLayer` is a ring of `sliding_window` slots, which cannot hold a tree's
rejected nodes beside the window: an EMPTY static cache's sliding layers are replaced by full-length static layers
(windowed masks then hide what the window drops, as for a dynamic cache); a filled one is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import Cache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

# slots a static cache gets beyond `max_length` where hf-spec allocates it: the largest verification block (a
# compiled round pads trees to 64 rows) written after the last committed token, and drafters' provisional writes
HEADROOM = 64
# a static cache hf-spec sizes gets a multiple of this many slots, so calls of slightly different lengths reuse it
# (and what was compiled over it)
SIZE_STEP = 256


def static_size(max_length: int) -> int:
    """Slots of a static cache hf-spec allocates for sequences of up to `max_length` tokens."""
    return -(-(max_length + HEADROOM) // SIZE_STEP) * SIZE_STEP


class RewindableStaticLayer(StaticLayer):
    """A `StaticLayer` whose length hf-spec keeps on the host (`length`) and can rewind.

    `sliced` (default): `update` writes after `length` and returns the filled slots; else the stock full-buffer
    update (a compiled forward), after which the caller advances `length` itself (`advance`).
    """

    length: int
    sliced: bool

    @classmethod
    def adopt(cls, layer: StaticLayer) -> RewindableStaticLayer:
        """Turn `layer` (a stock `StaticLayer`, possibly filled) into this class, in place."""
        layer.__class__ = cls
        layer.length = int(layer.cumulative_length) if layer.is_initialized else 0
        layer.sliced = True
        return layer

    def release(self) -> None:
        """Back to a stock `StaticLayer` whose `cumulative_length` says how much it holds."""
        if self.is_initialized:
            self.cumulative_length.fill_(self.length)
        del self.length, self.sliced
        self.__class__ = StaticLayer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.sliced:
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.max_cache_len:
            raise ValueError(
                f"the static cache holds {self.max_cache_len} tokens and this forward would need {end}: build it "
                "with a larger max_cache_len (for `generate`, max_length covers prompt + new tokens)"
            )
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if not self.sliced:
            return super().get_mask_sizes(query_length)
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def crop_to(self, length: int) -> None:
        """Keep the first `length` slots (a host-side length: nothing is copied)."""
        self.length = min(self.length, length)

    def advance(self, written: int) -> None:
        """After a full-buffer (compiled) forward wrote `written` slots at `length`."""
        self.length += written

    def sync_device_length(self) -> None:
        """Set `cumulative_length` (what a compiled forward writes at) to the host length."""
        if self.is_initialized:
            self.cumulative_length.fill_(self.length)

    def keep_block(self, past: int, index: torch.Tensor) -> None:
        """Move block slots `index` (absolute, increasing, `index[j] >= past + j`) to `[past, past + len(index))`
        in place and keep `past + len(index)` slots."""
        if self.is_initialized:
            index = index.to(self.keys.device)
            end = past + index.numel()
            self.keys[:, :, past:end] = self.keys.index_select(2, index)
            self.values[:, :, past:end] = self.values.index_select(2, index)
        self.length = past + index.numel()


def is_static(cache: Cache | None) -> bool:
    """Whether `cache` has static (fixed-buffer) layers."""
    return any(isinstance(layer, StaticLayer) for layer in getattr(cache, "layers", None) or ())


def static_capacity(cache: Cache) -> int:
    """The fewest slots any of `cache`'s static layers holds."""
    return min(layer.max_cache_len for layer in cache.layers if isinstance(layer, StaticLayer))


def check_static_cache(cache: Cache) -> None:
    """Raise `TypeError` for a static cache hf-spec cannot rewind: offloaded, with layers other than full or
    sliding-window static ones, or a filled sliding-window one."""
    layers = cache.layers
    if getattr(cache, "offloading", False):
        raise TypeError("hf-spec cannot rewind an offloaded static cache: pass one with offloading=False")
    kinds = (StaticLayer, StaticSlidingWindowLayer)
    others = sorted({type(layer).__name__ for layer in layers if type(layer) not in kinds})
    if others:
        raise TypeError(
            f"hf-spec can rewind full-attention static layers (StaticLayer), not {', '.join(others)}"
        )
    sliding = any(isinstance(layer, StaticSlidingWindowLayer) for layer in layers)
    if sliding and any(layer.is_initialized and int(layer.get_seq_length()) for layer in layers):
        raise TypeError(
            "hf-spec cannot continue a filled sliding-window static cache (its layers keep only the window, "
            "so a rejected draft cannot be taken back): pass an empty cache or none"
        )


@contextlib.contextmanager
def rewindable_static_cache(cache: Cache, max_length: int) -> Iterator[Cache]:
    """Inside the block `cache`'s static layers are `RewindableStaticLayer`s; afterwards stock `StaticLayer`s
    holding what the generation left (so the cache goes on working with `generate` and compiled forwards).

    Layers not allocated yet (a cache `generate` built) get `static_size(max_length)` slots; sliding-window
    static layers of an empty cache become full static layers for good; those of a filled cache raise `TypeError`.
    """
    check_static_cache(cache)
    layers = cache.layers
    sliding = [i for i, layer in enumerate(layers) if isinstance(layer, StaticSlidingWindowLayer)]
    if sliding:  # an empty cache (checked): full layers as long as the others, windowed masks do the rest
        full = [layer.max_cache_len for layer in layers if not isinstance(layer, StaticSlidingWindowLayer)]
        capacity = max([max_length, *full])
        for i in sliding:
            layers[i] = StaticLayer(max_cache_len=capacity)
    # not allocated yet: room for the last round's tree and a drafter's provisional writes
    for layer in layers:
        if not layer.is_initialized:
            layer.max_cache_len = max(layer.max_cache_len, static_size(max_length))
    adopted = [RewindableStaticLayer.adopt(layer) for layer in layers]
    try:
        yield cache
    finally:
        for layer in adopted:
            layer.release()
