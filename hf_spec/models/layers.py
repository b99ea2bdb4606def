"""Running a stock decoder-only model's own layers piecewise (LayerSkip's `forward_early` idea), without
forking its modeling file. Works for the Llama family layout (Llama, Qwen2, Mistral, ...):
`model.model.{embed_tokens, layers, norm, rotary_emb}` and `model.lm_head`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import Cache, PreTrainedModel

from hf_spec.verify.windows import attention_windows


@dataclass
class DecoderParts:
    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module
    lm_head: nn.Module

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def decoder_parts(model: PreTrainedModel) -> DecoderParts:
    base = getattr(model, "model", None)
    names = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in names) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"{type(model).__name__} does not have the Llama-family layout (model.model.embed_tokens/layers/norm/"
            "rotary_emb, model.lm_head) that layer-wise methods need"
        )
    windows = {w for w in attention_windows(model) if w is not None}
    if windows:
        raise ValueError(
            f"{type(model).__name__} has sliding-window attention (window {min(windows)}); layer-wise methods "
            "(early exit, HiSpec, exit-layer drafting) support full attention only"
        )
    return DecoderParts(base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.lm_head)


def run_layers(
    parts: DecoderParts,
    hidden_states: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache | None,
    start: int,
    end: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run layers `[start, end)` on `hidden_states` `(1, q_len, hidden_size)`, appending their keys/values to
    `cache`. `attention_mask` is an additive 4D mask `(1, 1, q_len, kv_len)`; `None` is only valid for
    `q_len == 1` (the new token sees the whole cache)."""
    if attention_mask is None and hidden_states.shape[1] > 1:
        raise ValueError("run_layers needs an explicit 4D mask for more than one query token")
    position_embeddings = parts.rotary_emb(hidden_states, position_ids=position_ids)
    for layer in parts.layers[start:end]:
        hidden_states = layer(
            hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        if isinstance(hidden_states, tuple):  # older layer classes return a tuple
            hidden_states = hidden_states[0]
    return hidden_states
