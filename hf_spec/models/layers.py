"""Running a stock decoder-only model's own layers piecewise (LayerSkip's `forward_early` idea), without
forking its modeling file. Works for the Llama family layout (Llama, Qwen2, Mistral, ...):
`model.model.{embed_tokens, layers, norm, rotary_emb}` and `model.lm_head`."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Cache, PreTrainedModel

from hf_spec.core.compat import cache_kwargs
from hf_spec.engine.target.windows import attention_windows


@dataclass
class DecoderParts:
    embed_tokens: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module
    lm_head: nn.Module
    window: int | None = None  # the smallest sliding window of the model's layers
    layer_types: list[str] | None = None  # when the rotary embedding depends on the layer type (Gemma 3)

    def check_window(self, length: int, what: str = "layer-wise methods") -> None:
        """Raise unless a sequence of `length` tokens fits every sliding window: `run_layers` runs the stock layers
        with hf-spec's own masks, which carry no window, so a sliding layer is exact only while nothing has slid
        out of it."""
        if self.window is not None and length > self.window:
            raise ValueError(
                f"{what} support sliding-window attention only within the window: this sequence may reach {length} "
                f"tokens, the window is {self.window} (lower max_new_tokens, or use a method that does not run "
                "the target layer by layer: pld, retrieval, eagle, lyanna)"
            )

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
    windows = [w for w in attention_windows(model) if w is not None]
    window = min(windows) if windows else None
    layer_types = None
    if "layer_type" in inspect.signature(base.rotary_emb.forward).parameters:
        layer_types = list(model.config.get_text_config(decoder=True).layer_types)
    return DecoderParts(
        base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.lm_head, window, layer_types
    )


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
    if parts.window is not None:
        parts.check_window(int(position_ids.max()) + 1)
    kinds = parts.layer_types or [None] * parts.num_layers
    embeddings = {}  # per layer type where the rotary embedding has several (one entry otherwise)
    for kind in set(kinds[start:end]):
        extra = {} if kind is None else {"layer_type": kind}
        embeddings[kind] = parts.rotary_emb(hidden_states, position_ids=position_ids, **extra)
    for kind, layer in zip(kinds[start:end], parts.layers[start:end], strict=True):
        hidden_states = layer(
            hidden_states,
            attention_mask=attention_mask,
            position_embeddings=embeddings[kind],
            position_ids=position_ids,
            **cache_kwargs(layer, cache),
            use_cache=cache is not None,
        )
        if isinstance(hidden_states, tuple):  # older layer classes return a tuple
            hidden_states = hidden_states[0]
    return hidden_states


@torch.no_grad()
def check_layerwise_forward(model: PreTrainedModel, parts: DecoderParts, method: str) -> None:
    """Raise unless the model's layers run one by one, then its final norm and LM head, give its own logits (four
    tokens, up to float rounding). A method whose *target* logits come from `run_layers` (HiSpec's last stage)
    would otherwise change the output of a model that scales its embeddings, residuals or logits outside those
    modules (Granite's multipliers, Gemma 2's logit soft-capping, ...)."""
    from hf_spec.engine.target.placement import input_device
    from hf_spec.tree.masks import causal_mask

    device = input_device(model)  # an offloaded embedding's weight is a `meta` placeholder
    ids = torch.arange(1, 5, device=device).view(1, -1) % parts.embed_tokens.weight.shape[0]
    positions = torch.arange(ids.shape[1], device=device).view(1, -1)
    mask = causal_mask(ids.shape[1], 0, model.dtype, device)
    hidden = run_layers(parts, parts.embed_tokens(ids), positions, None, 0, parts.num_layers, mask)
    mine = parts.lm_head(parts.norm(hidden)).float()
    theirs = model(input_ids=ids, position_ids=positions).logits.float()
    if (mine - theirs).abs().max() > 0.02 * theirs.abs().max() + 1e-4:
        raise ValueError(
            f"{method} runs {type(model).__name__} layer by layer, and its own forward computes something else "
            "(embedding, residual or logit multipliers, logit soft-capping, ...): not supported for this model"
        )
