"""EAGLE and HASS training objectives and the HASS context-alignment attention mask (pure functions).

Symbols: u the target's unit-RMS features, h the head's, q the target distribution, p the draft distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def feature_loss(h: torch.Tensor, u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """EAGLE feature regression: SmoothL1(h, u) averaged over masked positions. h, u `(B, T, H)`, mask `(B, T)`."""
    per_pos = F.smooth_l1_loss(h, u, reduction="none").mean(-1)
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


def soft_cross_entropy(
    draft_logp: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """EAGLE classification loss -sum_x q(x) log p(x), q = softmax(target logits) over the draft vocabulary."""
    q = torch.softmax(target_logits.float(), dim=-1)
    per_pos = -(q * draft_logp).sum(-1)
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


def topk_loss(
    draft_logp: torch.Tensor,
    topk_draft_ids: torch.Tensor,
    topk_logq: torch.Tensor,
    mask: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """HASS harmonized objective distillation: L = -sum_{x in top-K of q} q(x) log p(x).

    Args:
        draft_logp: `(B, T, V_draft)` log p.
        topk_draft_ids: `(B, T, K0)` draft ids of the target's top tokens in descending q (-1: not in the draft
            vocabulary); the first `k` columns are used.
        topk_logq: `(B, T, K0)` log q of those tokens (full-vocabulary probabilities).
        mask: `(B, T)`.
    """
    ids, logq = topk_draft_ids[..., :k], topk_logq[..., :k].float()
    inside = ids >= 0
    logp = draft_logp.gather(-1, ids.clamp(min=0))
    per_pos = -(logq.exp() * logp * inside).sum(-1)
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


def alignment_mask(length: int, step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """HASS context alignment: the additive mask `(length, step * length)` of alignment step `step` (1-based).

    Keys are the K/V of steps 1..step, concatenated (block m holds step m's keys at positions 0..length-1).
    A query at position i of step j stands for drafting depth j after the last verified position i - j: it sees
    step-1 keys (computed from the target's own features) up to i - j + 1, and one key per later step m, at
    i - j + m (the head's own features from depth m) -- never a target feature of an unverified position.
    Step 1 is plain causal attention (EAGLE training).
    """
    i = torch.arange(length).view(-1, 1)
    k = torch.arange(length).view(1, -1)
    blocks = [k <= i - step + 1] + [k == i - step + m for m in range(2, step + 1)]
    allowed = torch.cat(blocks, dim=1)
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
