"""An EAGLE-3 head seen as the head drafters see a head (`hf_spec.methods.head_drafter.HeadDrafter`)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from hf_spec.methods.eagle.eagle1 import PublishedParts
from hf_spec.methods.eagle3.modeling import Eagle3Head
from hf_spec.methods.eagle3.published import check_head_fits, place_on_target


class Eagle3DecodingHead(nn.Module):
    """An `Eagle3Head` as the head drafters see a head (`hf_spec.methods.head_drafter.HeadDrafter`): `d2t` holds
    target ids, `parts` the norm and LM-head rows drafted from, `layer` the decoder layer, and `forward(features,
    input_ids, position_ids, mask, cache)` takes token positions (EAGLE's rotary position is one less)."""

    def __init__(self, head: Eagle3Head) -> None:
        super().__init__()
        self.eagle3 = head
        self.config = head.config
        self.register_buffer("d2t", head.draft_token_ids(), persistent=False)  # [draft_vocab]
        self.target_parts: PublishedParts | None = None

    @property
    def layer(self) -> nn.Module:
        return self.eagle3.midlayer

    @property
    def parts(self) -> PublishedParts:
        if self.target_parts is None:
            raise RuntimeError("call attach_target(target_model) first")
        return self.target_parts

    def attach_target(self, target: PreTrainedModel) -> Eagle3DecodingHead:
        """Check the head fits `target`, place it on the target's LM-head device and dtype, embed with the
        target's embedding unless the head has its own."""
        check_head_fits("this EAGLE-3 head", self.config, target)
        place_on_target(self.eagle3, target)
        self.d2t = self.eagle3.draft_token_ids()
        own = self.eagle3.embed_tokens
        embed = own if own is not None else target.get_input_embeddings()
        self.target_parts = PublishedParts(embed, self.eagle3.norm, self.eagle3.lm_head.weight.detach())
        return self

    def forward(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache=None,
    ) -> torch.Tensor:
        """Args:
            features: `(batch, q_len, fused_width)` the target's joined states at t - 1, or `(batch, q_len,
                hidden_size)` the head's own state at t - 1, for each query position t.
            input_ids: `torch.LongTensor` of shape `(batch, q_len)`, x_t.
            position_ids: `(batch, q_len)`, t.
            attention_mask: additive `(batch, 1, q_len, kv_len)`.
        Returns:
            h: `(batch, q_len, hidden_size)`.
        """
        return self.eagle3(features, input_ids, position_ids - 1, attention_mask, cache)


__all__ = ["Eagle3DecodingHead"]
