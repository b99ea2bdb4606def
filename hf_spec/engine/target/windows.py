"""Sliding-window attention (Mistral, Gemma 3, Phi-3, Starcoder2, ...) in a cache that can be rewound.

transformers' sliding-window cache layers drop keys older than the window as they go, so a rejected draft
cannot be taken back out of them. hf-spec instead keeps every layer's keys and values (`target_cache`) and gives
each sliding layer a mask that hides what its window would have dropped (`windowed_mask`): the same keys, so the
same attention output up to float rounding. Memory grows with the sequence as for a full-attention model.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_spec.core.compat import layer_types_and_kwargs

SUPPORTED = ("full_attention", "sliding_attention")
# the config fields transformers derives layer types and windows from
CONFIG_FIELDS = (
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "attention_chunk_size",
)


def attention_windows(model: PreTrainedModel) -> list[int | None]:
    """Each decoder layer's sliding window (`None`: full attention). Raises for layer types hf-spec cannot
    verify a tree with (chunked, linear or recurrent attention, shared KV). Kept on the model while the config
    fields it comes from stay the same (reading them per layer costs ~0.4 ms; this runs every round)."""
    config = model.config.get_text_config(decoder=True)
    key = (config, *(getattr(config, name, None) for name in CONFIG_FIELDS))
    cached = model.__dict__.get("_hf_spec_windows")
    if cached is not None and cached[0] == key:
        return cached[1]
    types, kwargs = layer_types_and_kwargs(config)
    unsupported = sorted({t for t in types if t not in SUPPORTED})
    if unsupported:
        raise ValueError(
            f"{type(model).__name__} has {', '.join(unsupported)} layers; hf-spec supports full and "
            "sliding-window attention only"
        )
    windows = [
        kw.get("sliding_window") if t == "sliding_attention" else None
        for t, kw in zip(types, kwargs, strict=True)
    ]
    model.__dict__["_hf_spec_windows"] = (key, windows)
    return windows


def has_sliding_layers(model: PreTrainedModel) -> bool:
    return any(w is not None for w in attention_windows(model))


def target_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache hf-spec can rewind: the model's own layout, or full-attention layers everywhere for a model
    with sliding windows (their masks then come from `windowed_mask`)."""
    if has_sliding_layers(model):
        return DynamicCache()  # lazily built `DynamicLayer`s: every key kept
    return DynamicCache(config=model.config)


def windowed_mask(
    model: PreTrainedModel,
    mask: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D mask a model's forward takes, sliding windows applied.

    Args:
        mask: additive `(batch or 1, 1, q_len, kv_len)`: 0 where a query may attend.
        query_positions: `torch.LongTensor` of shape `(batch or 1, q_len)`, each query's position.
        key_positions: `torch.LongTensor` of shape `(batch or 1, kv_len)`, each cache slot's position (any value
            where `mask` already hides the slot).

    Returns:
        `mask` for a full-attention model; for a model whose layers all share one window, `mask` with the keys a
        query's window excludes (`query - key >= window`) hidden; for a mixed model, the dict
        `{"full_attention": mask, "sliding_attention": windowed}` its forward accepts.
    """
    windows = set(attention_windows(model))
    sliding = windows - {None}
    if not sliding:
        return mask
    if len(sliding) > 1:
        raise ValueError(
            f"{type(model).__name__} has several sliding windows {sorted(sliding)}; not supported"
        )
    window = sliding.pop()
    gap = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    windowed = mask.masked_fill(gap.to(mask.device) >= window, torch.finfo(mask.dtype).min)
    if None not in windows:
        return windowed
    return {"full_attention": mask, "sliding_attention": windowed}


def sequence_mask(
    model: PreTrainedModel, mask: torch.Tensor | None, position_ids: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """`windowed_mask` for one sequence whose cache slot `i` holds position `i` and whose new queries sit at
    `position_ids` `(1, q_len)` behind it; `None` (a causal chain: the model builds its own masks) stays `None`."""
    if mask is None or not has_sliding_layers(model):
        return mask
    past = mask.shape[-1] - position_ids.shape[1]
    keys = torch.cat([torch.arange(past, device=position_ids.device)[None], position_ids], dim=1)
    return windowed_mask(model, mask, position_ids, keys)


def rewindable_cache(model: PreTrainedModel, cache):
    """`cache`, or for the empty sliding-window `DynamicCache` that `generate` builds for such a model,
    `target_cache(model)` in its place (a filled one cannot be converted: `hf_spec.engine.target.cache` refuses it)."""
    layers = getattr(cache, "layers", None)
    if (
        isinstance(cache, DynamicCache)
        and layers
        and any(getattr(layer, "is_sliding", False) for layer in layers)
        and cache.get_seq_length() == 0
    ):
        return target_cache(model)
    return cache
