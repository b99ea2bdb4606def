"""What every draft head shares: a config recording the target it was trained for, one decoder layer of the
target's family, a reduced draft vocabulary, and the target's frozen embedding / final norm / LM head attached at
load time (never stored in the head)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from hf_spec.core.compat import forward_cache_name
from hf_spec.heads.family import build_layer_config, family_classes, layer_config_dict
from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint


class DraftHeadConfig(PretrainedConfig):
    """Args:
    target: the target's fingerprint (`hf_spec.models.fingerprint.target_fingerprint`) plus `name_or_path`.
    layer_config: the target config keys that build the head's decoder layer.
    draft_vocab_size: size of the reduced draft vocabulary (the whole target vocabulary when equal).
    training: how the head was trained (data, steps, losses), for the model card.
    """

    model_type = "hf_spec_draft_head"

    def __init__(
        self,
        target: dict[str, Any] | None = None,
        layer_config: dict[str, Any] | None = None,
        draft_vocab_size: int = 0,
        training: dict[str, Any] | None = None,
        **kwargs,
    ) -> None:
        self.target = target or {}
        self.layer_config = layer_config or {}
        self.draft_vocab_size = draft_vocab_size
        self.training = training or {}
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls, target: PreTrainedModel, draft_vocab_size: int | None = None, **kwargs
    ) -> DraftHeadConfig:
        vocab = target.get_input_embeddings().weight.shape[0]
        fingerprint = target_fingerprint(target) | {"name_or_path": str(target.name_or_path)}
        return cls(
            target=fingerprint,
            layer_config=layer_config_dict(target.config),
            draft_vocab_size=min(draft_vocab_size or vocab, vocab),
            **kwargs,
        )

    @property
    def hidden_size(self) -> int:
        return int(self.layer_config["hidden_size"])


class TargetParts:
    """The target's frozen pieces a head computes with: embedding, final norm, LM-head rows of the draft vocab."""

    def __init__(self, target: PreTrainedModel, d2t: torch.Tensor) -> None:
        self.embed_tokens = target.get_input_embeddings()
        self.norm = target.model.norm
        self.lm_weight = target.get_output_embeddings().weight.detach()[
            d2t
        ]  # [draft_vocab_size, hidden_size]


class DraftHeadModel(PreTrainedModel):
    """Base of the heads: `fc` fuses a feature with a token embedding, `layer` is the target family's decoder layer,
    `d2t` maps draft-vocabulary ids to target ids. Call `attach_target(target)` before use."""

    config_class = DraftHeadConfig
    base_model_prefix = "head"
    supports_gradient_checkpointing = False
    _supports_sdpa = True

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__(config)
        layer_config = build_layer_config(config.layer_config)
        layer_cls, rotary_cls = family_classes(layer_config.model_type)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = layer_cls(layer_config, layer_idx=0)
        # the name the layer's forward takes its cache by, looked up here: a compiled head step traces no lookup
        self._layer_cache_name = forward_cache_name(layer_cls)
        self.rotary_emb = rotary_cls(config=layer_config)
        self.register_buffer("d2t", torch.arange(config.draft_vocab_size), persistent=True)
        self.target_parts: TargetParts | None = None
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # the base class also computes the rotary `inv_freq` buffers: they are not persistent (never in the
        # checkpoint), so `from_pretrained` leaves them uninitialised unless this runs for the rotary module
        super()._init_weights(module)
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def attach_target(self, target: PreTrainedModel) -> DraftHeadModel:
        """Check `target` is the model this head was trained for, move the head to the device of the target's LM
        head and borrow its frozen parts."""
        check_fingerprint(self.config.target, target, f"this {type(self).__name__}")
        self.to(target.get_output_embeddings().weight.device)
        self.target_parts = TargetParts(target, self.d2t)
        return self

    @property
    def parts(self) -> TargetParts:
        if self.target_parts is None:
            raise RuntimeError("call head.attach_target(target_model) first")
        return self.target_parts

    def init_layer_from(self, target: PreTrainedModel, index: int = -1) -> None:
        """Start the head's layer from one of the target's layers (a warm start for small training sets)."""
        from hf_spec.engine.target.placement import target_placement

        placement = target_placement(target)
        if placement.quantization or placement.offloaded:
            raise ValueError(
                f"init_from_last_layer copies a target layer's weights into the head, and this target's are "
                f"{placement.describe()}: train without it, or load the target unquantized and in memory"
            )
        self.layer.load_state_dict(target.model.layers[index].state_dict())

    def run_layer(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """`hidden` `(batch, q_len, hidden_size)` through the decoder layer with rotary positions `position_ids`
        and an additive 4D `attention_mask` `(batch, 1, q_len, kv_len)` (None: causal over the cache + itself
        is NOT implied; pass a mask whenever q_len > 1)."""
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        out = self.layer(
            hidden,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            **{self._layer_cache_name: cache},
            use_cache=cache is not None,
        )
        return out[0] if isinstance(out, tuple) else out

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head states `(..., hidden_size)` -> logits over the draft vocabulary `(..., draft_vocab_size)`, with
        the target's final norm and LM-head rows."""
        return self.parts.norm(hidden) @ self.parts.lm_weight.T
