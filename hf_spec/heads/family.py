"""The decoder-layer class of a target's own family (Llama, Qwen2, Mistral, ...), taken from transformers so a
head reuses the stock layer instead of a fork."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn
from transformers import AutoConfig, PretrainedConfig

# target config keys a one-layer head needs; the rest (vocab, embeddings, tokens) stays with the target
LAYER_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "attention_bias",
    "mlp_bias",
    "attention_dropout",
    "use_sliding_window",
    "sliding_window",
)


def layer_config_dict(target_config: PretrainedConfig) -> dict[str, Any]:
    data = target_config.to_dict()
    return {key: data[key] for key in LAYER_CONFIG_KEYS if key in data}


def build_layer_config(layer_config: dict[str, Any]) -> PretrainedConfig:
    data = dict(layer_config)
    model_type = data.pop("model_type")
    config = AutoConfig.for_model(model_type, num_hidden_layers=1, **data)
    config._attn_implementation = "sdpa"
    return config


def family_classes(model_type: str) -> tuple[type[nn.Module], type[nn.Module]]:
    """`(DecoderLayer, RotaryEmbedding)` classes of `transformers.models.<model_type>`."""
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        raise ValueError(f"transformers has no modeling module for model_type {model_type!r}") from None
    layer = [getattr(module, n) for n in dir(module) if n.endswith("DecoderLayer")]
    rotary = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding")]
    if len(layer) != 1 or len(rotary) != 1:
        raise ValueError(f"cannot find one decoder layer and one rotary embedding class for {model_type!r}")
    return layer[0], rotary[0]
