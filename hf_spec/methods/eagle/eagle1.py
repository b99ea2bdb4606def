"""The published EAGLE-1 layer: what an `eagle1`-layout hf-spec head builds and what vLLM and SGLang load.

The EAGLE authors' layout (and so `hf-spec export --format eagle`) is a Llama config with `num_hidden_layers: 1`
plus `"bias"` (of `fc`) and `"qkv_bias"` (q/k/v biases: Qwen2's layer), and weights `fc.*` and `layers.0.*`. The
decoder layer it describes has no input norm and `head_dim = hidden_size / num_attention_heads`. This module maps
between that `config.json` and the layer fields hf-spec builds its layer from (`hf_spec.heads.family`), both ways,
so a head trained here and the same head read back from its export build the same layer.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from transformers import PretrainedConfig

HeadLayout = Literal["hf-spec", "eagle1"]
LAYOUTS: tuple[str, ...] = ("hf-spec", "eagle1")
EAGLE1: HeadLayout = "eagle1"


def layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder-layer fields of a published EAGLE config (EAGLE's layer: Llama's, q/k/v biases with
    `qkv_bias`, which is Qwen2's layer; `head_dim` is hidden / heads)."""
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        fields = {
            "model_type": "qwen2" if config.get("qkv_bias") else "llama",
            "hidden_size": hidden,
            "intermediate_size": int(config["intermediate_size"]),
            "num_attention_heads": heads,
            "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
            "head_dim": hidden // heads,
            "hidden_act": config.get("hidden_act", "silu"),
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "max_position_embeddings": int(config.get("max_position_embeddings", 2048)),
            "rope_theta": float(config.get("rope_theta", 10000.0)),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"config.json lacks or garbles a field of the head's layer ({err!r})") from None
    if config.get("rope_scaling"):
        fields["rope_scaling"] = config["rope_scaling"]
    if fields["model_type"] == "llama":
        fields |= {"attention_bias": False, "mlp_bias": False}
    return fields


def target_rope(target_config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` of a target config, from `rope_parameters` (transformers 5) or the older
    `rope_theta` / `rope_scaling` fields; scaling None for plain rotary embeddings."""
    data = target_config.to_dict()
    params = dict(data.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or data.get("rope_theta") or 10000.0)
    scaling = data.get("rope_scaling") or (
        params if params.get("rope_type", "default") != "default" else None
    )
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return theta, scaling or None


def published_config(
    target_config: PretrainedConfig, vocab_size: int, fc_bias: bool = True
) -> dict[str, Any]:
    """The EAGLE authors' `config.json` of an EAGLE-1 head for a target with `target_config`: the target's sizes,
    rotary embedding and activation; q/k/v biases (`qkv_bias`) for a Qwen2 target, as the EAGLE authors' Qwen2
    heads have them."""
    c = target_config
    theta, scaling = target_rope(c)
    heads = int(c.num_attention_heads)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": int(c.hidden_size),
        "intermediate_size": int(c.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "num_hidden_layers": 1,
        "hidden_act": str(getattr(c, "hidden_act", "silu")),
        "rms_norm_eps": float(getattr(c, "rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(getattr(c, "max_position_embeddings", 2048)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": False,
        "bias": bool(fc_bias),
        "qkv_bias": c.model_type == "qwen2",
    }


def config_of_layer(fields: dict[str, Any], vocab_size: int, fc_bias: bool = True) -> dict[str, Any]:
    """The published `config.json` whose `layer_config` is `fields` (the inverse of `layer_config`), for an
    `eagle1`-layout head's export."""
    qwen2 = fields["model_type"] == "qwen2"
    if fields["model_type"] not in ("llama", "qwen2") or (
        not qwen2 and (fields.get("attention_bias") or fields.get("mlp_bias"))
    ):
        raise ValueError(f"a {fields['model_type']!r} layer with these biases is not the EAGLE-1 layer")
    if int(fields["head_dim"]) * int(fields["num_attention_heads"]) != int(fields["hidden_size"]):
        raise ValueError("the EAGLE-1 layer has head_dim = hidden_size / num_attention_heads")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **{
            k: v
            for k, v in fields.items()
            if k not in ("model_type", "head_dim", "attention_bias", "mlp_bias")
        },
        "rope_scaling": fields.get("rope_scaling"),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": False,
        "bias": bool(fc_bias),
        "qkv_bias": qwen2,
    }


class PublishedParts:
    """The target's frozen pieces a published-layout head computes with: an embedding, the norm before the LM head
    (none for EAGLE-1: `nn.Identity`), the LM-head rows of the draft vocabulary and, for training an `eagle1`
    head, the target's final norm (it turns stored unit features back into post-norm states)."""

    def __init__(
        self,
        embed_tokens: nn.Module,
        norm: nn.Module,
        lm_weight: torch.Tensor,
        final_norm: nn.Module | None = None,
    ) -> None:
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_weight = lm_weight  # [draft_vocab_size, hidden_size]
        self.final_norm = final_norm


__all__ = [
    "EAGLE1",
    "LAYOUTS",
    "HeadLayout",
    "PublishedParts",
    "config_of_layer",
    "layer_config",
    "published_config",
    "target_rope",
]
