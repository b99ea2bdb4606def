"""EAGLE feature-level draft head (EAGLE-1/2 layout; trained with or without HASS).

h_t = Layer(fc([f_{t-1}; E(x_t)]))          # f: the target's unit-RMS last-layer state, or the head's own h
p(x_{t+1}) = softmax(LMHead(Norm(h_t)))     # the target's frozen final norm and LM-head rows
"""

from __future__ import annotations

import torch

from hf_spec.heads.base import DraftHeadConfig, DraftHeadModel


class EagleHeadConfig(DraftHeadConfig):
    model_type = "hf_spec_eagle"


class EagleHeadModel(DraftHeadModel):
    config_class = EagleHeadConfig

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Args:
            features: `(batch, q_len, hidden_size)`, f_{t-1} for each query position t.
            input_ids: `torch.LongTensor` of shape `(batch, q_len)`, x_t.
            position_ids: `(batch, q_len)`, t.
            attention_mask: additive `(batch, 1, q_len, kv_len)`.
        Returns:
            h: `(batch, q_len, hidden_size)`.
        """
        embeds = self.parts.embed_tokens(input_ids).to(features.dtype)
        fused = self.fc(torch.cat([features, embeds], dim=-1))
        return self.run_layer(fused, position_ids, attention_mask, cache)
