"""Lyanna's draft trees from one hidden-state chain (pure functions).

`level_logits` `(L, V_draft)` are the raw logits l_1..l_L of one chain; `token_info(ids)` returns the token-info
bias RMSNorm(E'(t)) `(len(ids), V_draft)` for target ids.

Algorithm 1 (token-info sampling), level by level: every kept node adds its token's info to the level's raw
logits, takes its top-k children; the k children of highest joint probability are kept; finally the tree is
pruned to the budget by joint probability. Algorithm 2 (re-sampling) is the same walk started at the target's
bonus token over the chain's remaining levels, with the bonus token's info injected into the first of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hf_spec.tree.scored import ScoredTree

if TYPE_CHECKING:
    from hf_spec.engine.backend import Backend

TokenInfo = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class LowRankTokenInfo:
    """The token-info bias from the head's low-rank factors, for the first `cols` draft-vocabulary entries; zero
    for tokens outside the hot set (`row_of[t] < 0`). A `TokenInfo` that also hands over its factors, so a
    backend kernel can add the bias without materializing it."""

    head: nn.Module  # a LyannaHeadModel with token info
    cols: int
    row_of: torch.Tensor  # [vocab] the hot row of each target id, -1 outside

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """`(len(ids), cols)`: RMSNorm(E'(t)) for target ids `ids`."""
        with torch.no_grad():
            return self.head.token_info(ids)[..., : self.cols] * (self.row_of[ids] >= 0).unsqueeze(-1)

    def factors(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(low (n, rank), W_2 (V_draft, rank), RMSNorm weight (V_draft,), known (n,) bool)` for target ids."""
        head = self.head
        with torch.no_grad():
            low = head.token_info_down(head.parts.embed_tokens(ids).to(head.token_info_down.weight.dtype))
        return low, head.token_info_up.weight, head.token_info_scale, self.row_of[ids] >= 0


def token_info_tree(
    level_logits: torch.Tensor,
    token_info: TokenInfo | None,
    d2t: torch.Tensor,
    topk: int,
    root_token: int | None = None,
    backend: Backend | None = None,
) -> ScoredTree:
    """Algorithm 1. `root_token` given: its token info is added to level 1 (re-sampling from a bonus token);
    otherwise level 1 uses the raw logits (the chain already fused the root token). A `backend` with a token-info
    kernel computes each level's top-k children."""
    tree = ScoredTree([], [], [], [])
    frontier: list[int] = [-1]  # node indices; -1 = root
    frontier_tokens = [root_token]
    for level in range(level_logits.shape[0]):
        raw = level_logits[level].float()
        k = min(topk, raw.shape[-1])
        top = backend.token_info_topk(raw, token_info, frontier_tokens, k) if backend is not None else None
        if top is None:
            rows = raw.expand(len(frontier), -1)
            with_info = [i for i, t in enumerate(frontier_tokens) if t is not None]
            if token_info is not None and with_info:
                bias = token_info(torch.tensor([frontier_tokens[i] for i in with_info], device=d2t.device))
                rows = rows.clone()
                rows[with_info] += bias.float()
            logp = torch.log_softmax(rows, dim=-1)  # [frontier, V_draft]
            top = torch.topk(logp, k, dim=-1)
        top_values, top_indices = top  # [frontier, k] each
        base = torch.tensor([tree.joint[n] if n >= 0 else 0.0 for n in frontier], device=raw.device).view(
            -1, 1
        )
        joint = (base + top_values).flatten()
        keep = torch.topk(joint, min(topk, joint.numel())).indices.tolist()
        new_frontier, new_tokens = [], []
        for flat in keep:
            row, col = divmod(flat, top_indices.shape[1])
            token = int(d2t[top_indices[row, col]])
            tree.tokens.append(token)
            tree.parents.append(frontier[row])
            tree.joint.append(float(joint[flat]))
            tree.depths.append(level + 1)
            new_frontier.append(len(tree.tokens) - 1)
            new_tokens.append(token)
        frontier, frontier_tokens = new_frontier, new_tokens
    return tree
