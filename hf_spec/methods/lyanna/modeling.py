"""Lyanna hidden-state auto-regressive draft head ("Make Every Draft Count").

    h_1     = Layer(fc([h_0; E(t_1)]))      # h_0: the target's feature before the bonus token t_1
    h_{i+1} = Layer(h_i)                    # no token input: the chain h_1..h_k is drafted once per round
    l_i     = LMHead(Norm(h_i))             # ONE batched LM-head call for l_1..l_k
    l'_{i+1} = l_{i+1} + RMSNorm(E'(t_i)),  E'(t) = onehot(t) W_E W_1 W_2   (token-info logit bias)

W_E is the target's frozen embedding; W_1 (hidden x rank) and W_2 (rank x draft vocab) are trained. After
training E' can be collapsed to a lookup table (`token_info_table`), rows for the hot (most frequent) tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_spec.heads.base import DraftHeadConfig, DraftHeadModel


class LyannaHeadConfig(DraftHeadConfig):
    """`DraftHeadConfig` plus: `token_info_rank` (d of W_1/W_2; 0 = no token info) and `first_token_fusion`
    (False: h_1 = Layer(h_0), the bonus token enters through token info only; an ablation)."""

    model_type = "hf_spec_lyanna"

    def __init__(self, token_info_rank: int = 64, first_token_fusion: bool = True, **kwargs) -> None:
        self.token_info_rank = token_info_rank
        self.first_token_fusion = first_token_fusion
        super().__init__(**kwargs)


class LyannaHeadModel(DraftHeadModel):
    config_class = LyannaHeadConfig

    def __init__(self, config: LyannaHeadConfig) -> None:
        super().__init__(config)
        rank, vocab = config.token_info_rank, config.draft_vocab_size
        if rank:
            self.token_info_down = nn.Linear(config.hidden_size, rank, bias=False)  # W_1
            self.token_info_up = nn.Linear(rank, vocab, bias=False)  # W_2
            self.token_info_scale = nn.Parameter(torch.full((vocab,), 0.1))  # RMSNorm weight
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if module is self and hasattr(self, "token_info_scale"):
            nn.init.constant_(self.token_info_scale, 0.1)

    def first_step(self, features, input_ids, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """`features` `(B, q, H)` = h_0 (the target's unit-RMS features), `input_ids` `(B, q)` = t_1 -> h_1."""
        if self.config.first_token_fusion:
            embeds = self.parts.embed_tokens(input_ids).to(features.dtype)
            hidden = self.fc(torch.cat([features, embeds], dim=-1))
        else:
            hidden = features
        return self.run_layer(hidden, position_ids, attention_mask, cache)

    def next_step(self, hidden, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """h_i `(B, q, H)` -> h_{i+1}: no token input."""
        return self.run_layer(hidden, position_ids, attention_mask, cache)

    def token_info(self, target_ids: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
        """RMSNorm(E'(t)) for target ids `(...)` -> `(..., draft_vocab_size)`; zeros without token info."""
        if not self.config.token_info_rank:
            return torch.zeros(*target_ids.shape, self.config.draft_vocab_size, device=target_ids.device)
        low = self.token_info_down(self.parts.embed_tokens(target_ids).to(self.token_info_down.weight.dtype))
        bias = self.token_info_up(low)
        bias = bias * torch.rsqrt(bias.pow(2).mean(-1, keepdim=True) + eps)
        return bias * self.token_info_scale

    @torch.no_grad()
    def token_info_table(self, source_ids: torch.Tensor) -> torch.Tensor:
        """The collapsed table: row r = RMSNorm(E'(source_ids[r])), `(len(source_ids), draft_vocab_size)`."""
        return torch.cat([self.token_info(chunk) for chunk in source_ids.split(1024)])
