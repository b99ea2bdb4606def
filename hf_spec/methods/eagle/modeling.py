"""EAGLE feature-level draft head (EAGLE-1/2; trained with or without HASS), in one of two layouts.

`layout="hf-spec"` (the default):

    h_t = Layer(fc([f_{t-1}; E(x_t)]))          # f: the target's unit-RMS last-layer state, or the head's own h
    p(x_{t+1}) = softmax(LMHead(Norm(h_t)))     # the target's frozen final norm and LM-head rows

`layout="eagle1"`: the published EAGLE-1 layer (`hf_spec.methods.eagle.eagle1`), which vLLM's and SGLang's EAGLE-1
loaders read (`hf-spec export --format eagle`) and which hf-spec runs for the EAGLE authors' heads too:

    h_t = Layer'(fc([E(x_t); y_{t-1}]))         # y: the target's last hidden state after its final norm (or h);
                                                # Layer' has no input norm; rotary position t - 1
    p(x_{t+1}) = softmax(LMHead(h_t))           # the whole target vocabulary, no norm before the LM head
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.heads.base import DraftHeadConfig, DraftHeadModel
from hf_spec.methods.eagle.eagle1 import (
    EAGLE1,
    LAYOUTS,
    HeadLayout,
    PublishedParts,
    layer_config,
    published_config,
)
from hf_spec.models.fingerprint import check_fingerprint

logger = logging.getLogger(__name__)


class EagleHeadConfig(DraftHeadConfig):
    """`DraftHeadConfig` plus the head's layout.

    Args:
        layout: `"hf-spec"` (the layer normalises its input, reads unit-RMS target features, drafts through the
            target's final norm) or `"eagle1"` (the published EAGLE-1 layer: no input norm, reads the target's
            post-norm states, drafts over the whole vocabulary with no norm before the LM head; exportable with
            `hf-spec export --format eagle`).
    """

    model_type = "hf_spec_eagle"
    # a class default: the config (and a training run's identity) of a default head names no layout
    layout: HeadLayout = "hf-spec"

    def __init__(self, layout: HeadLayout = "hf-spec", **kwargs) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown EAGLE head layout {layout!r}: one of {', '.join(LAYOUTS)}")
        if layout != "hf-spec":
            self.layout = layout
        super().__init__(**kwargs)

    @classmethod
    def for_target(
        cls,
        target: PreTrainedModel,
        draft_vocab_size: int | None = None,
        layout: HeadLayout = "hf-spec",
        **kwargs,
    ) -> EagleHeadConfig:
        """A head config for `target`. An `eagle1` head drafts over the whole target vocabulary (the published
        layout has no draft-vocabulary map: `draft_vocab_size` does not apply) with the layer the published
        config of `target` describes."""
        if layout != EAGLE1:
            return super().for_target(target, draft_vocab_size, layout=layout, **kwargs)
        vocab = int(target.get_output_embeddings().weight.shape[0])
        if draft_vocab_size and draft_vocab_size < vocab:
            logger.info("eagle1 heads draft over the whole vocabulary (%d tokens): draft_vocab_size %d unused",
                        vocab, draft_vocab_size)  # fmt: skip
        config = super().for_target(target, vocab, layout=layout, **kwargs)
        config.layer_config = layer_config(published_config(target.config, vocab))
        return config


class EagleHeadModel(DraftHeadModel):
    config_class = EagleHeadConfig

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__(config)
        if self.layout == EAGLE1:
            self.layer.input_layernorm = nn.Identity()  # EAGLE-1's layer 0 has no input norm

    @property
    def layout(self) -> str:
        return getattr(self.config, "layout", "hf-spec")  # a plain DraftHeadConfig has none

    @property
    def reads_post_norm_states(self) -> bool:
        """Whether the head reads the target's post-norm states (`eagle1`) instead of its unit features."""
        return self.layout == EAGLE1

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Args:
            features: `(batch, q_len, hidden_size)`, f_{t-1} (`eagle1`: y_{t-1}) for each query position t.
            input_ids: `torch.LongTensor` of shape `(batch, q_len)`, x_t.
            position_ids: `(batch, q_len)`, t (`eagle1`'s rotary position is t - 1).
            attention_mask: additive `(batch, 1, q_len, kv_len)`.
        Returns:
            h: `(batch, q_len, hidden_size)`.
        """
        embeds = self.parts.embed_tokens(input_ids).to(features.dtype)
        if self.layout == EAGLE1:
            fused = self.fc(torch.cat([embeds, features], dim=-1))
            return self.run_layer(fused, position_ids - 1, attention_mask, cache)
        fused = self.fc(torch.cat([features, embeds], dim=-1))
        return self.run_layer(fused, position_ids, attention_mask, cache)

    def attach_target(self, target: PreTrainedModel) -> EagleHeadModel:
        """Check `target` is the model this head was trained for, move the head to the device of the target's LM
        head and borrow its frozen parts (`eagle1`: the embedding and the whole LM head, read without a norm)."""
        if self.layout != EAGLE1:
            return super().attach_target(target)
        check_fingerprint(self.config.target, target, f"this {type(self).__name__}")
        return self.attach_published_parts(target)

    def attach_published_parts(self, target: PreTrainedModel) -> EagleHeadModel:
        """Borrow the target's parts as the published EAGLE-1 layout reads them; draft ids are token ids."""
        lm_weight = target.get_output_embeddings().weight
        self.to(lm_weight.device)
        with torch.no_grad():  # the whole vocabulary in token-id order, as the published layout drafts
            self.d2t.copy_(torch.arange(self.d2t.numel(), device=self.d2t.device))
        self.target_parts = PublishedParts(
            target.get_input_embeddings(), nn.Identity(), lm_weight.detach(), target.model.norm
        )
        return self

    def training_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A training batch with the features this head reads: the stored unit-RMS features `(B, T, H)` for the
        default layout; the target's post-norm states `u * w` (w: its final norm's weight) for `eagle1`, so its
        feature regression, inputs and target logits (`LMHead(y)`) are the published head's."""
        if self.layout != EAGLE1:
            return batch
        u = batch["features"]
        w = self.parts.final_norm.weight.detach().to(u.device, torch.float32)
        return batch | {"features": (u.float() * w).to(u.dtype)}

    def init_layer_from(self, target: PreTrainedModel, index: int = -1) -> None:
        """Start the layer from one of the target's (`eagle1`: all but its input norm, which the layer lacks)."""
        if self.layout != EAGLE1:
            return super().init_layer_from(target, index)
        state = {
            k: v
            for k, v in target.model.layers[index].state_dict().items()
            if not k.startswith("input_layernorm.")
        }
        try:
            self.layer.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(
                f"init_from_last_layer: the target's layer {index} does not fit the eagle1 head's layer (a Llama or "
                f"Qwen2 layer with head_dim = hidden / heads, unquantized): {str(err).splitlines()[0]}"
            ) from None
        return None
