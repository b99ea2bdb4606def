"""`hf-spec train eagle`: EAGLE heads, optionally the HASS way (top-K distillation + context alignment)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_spec.heads.eagle.losses import alignment_mask, feature_loss, soft_cross_entropy, topk_loss
from hf_spec.heads.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.training.trainer import HeadTrainConfig, train_head


@dataclass
class EagleTrainConfig(HeadTrainConfig):
    """`HeadTrainConfig` plus HASS harmonized objective distillation: `topk` K (0 = off) and its weight."""

    topk: int = 0
    topk_weight: float = 1.0


def head_step(
    head: EagleHeadModel, batch: dict[str, torch.Tensor], cfg: EagleTrainConfig, t2d: torch.Tensor
) -> tuple[torch.Tensor, list[float], dict[str, float]]:
    """One forward of all alignment steps on a batch: `(loss, accuracy per step, loss parts)`.

    Position t (index i = t - 1) takes (f_{t-1}, x_t) and predicts u_t and the target's next-token distribution at
    t; step j > 1 feeds the head's own step j-1 output at t-1 as f_{t-1} (HASS)."""
    u = batch["features"]  # [B, T, H]
    x = batch["input_ids"].long()
    B, T = x.shape
    n = T - 1
    ok = batch["valid"] & batch["response_mask"].bool()
    mask = torch.zeros(B, n)
    mask[:, : n - 1] = ok[:, 2:].float()  # predicting x_{t+1} of the answer, t+1 < T
    f_in, ids, u_tgt = u[:, :-1], x[:, 1:], u[:, 1:]
    position_ids = torch.arange(1, T).expand(B, n)
    with torch.no_grad():
        target_logits = head.draft_logits(
            u_tgt
        )  # [B, n, V_draft]: the target's logits on the draft vocabulary
        topk_ids = t2d[batch["topk_ids"][:, 1:].long()]  # [B, n, K0]
        topk_logq = batch["topk_logp"][:, 1:].float()
        target_top1 = topk_ids[..., 0]
    cache = DynamicCache()
    f = f_in
    loss = torch.zeros(())
    accs, parts = [], {"feature": 0.0, "ce": 0.0, "topk": 0.0}
    for j in range(1, cfg.align_steps + 1):
        attn = alignment_mask(n, j)[None, None]
        h = head(f, ids, position_ids, attn, cache)
        logp = torch.log_softmax(head.draft_logits(h).float(), dim=-1)
        m = mask.clone()
        m[:, : j - 1] = 0  # positions with fewer than j-1 predecessors cannot stand for depth j
        l_feat = feature_loss(h, u_tgt, m)
        l_ce = soft_cross_entropy(logp, target_logits, m)
        step_loss = cfg.feature_weight * l_feat + cfg.ce_weight * l_ce
        parts["feature"] += l_feat.item() / cfg.align_steps
        parts["ce"] += l_ce.item() / cfg.align_steps
        if cfg.topk:
            l_top = topk_loss(logp, topk_ids, topk_logq, m, cfg.topk)
            step_loss = step_loss + cfg.topk_weight * l_top
            parts["topk"] += l_top.item() / cfg.align_steps
        loss = loss + step_loss / cfg.align_steps
        with torch.no_grad():
            accs.append(float(((logp.argmax(-1) == target_top1) * m).sum() / m.sum().clamp(min=1)))
        f = torch.cat([f_in[:, :1], h[:, :-1]], dim=1)
    return loss, accs, parts


def train_eagle(target, sequences: list[dict], out: str | Path, cfg: EagleTrainConfig, progress: bool = True):
    """Train (or resume) an EAGLE/HASS head for `target`; returns `(head, report)`."""
    head = EagleHeadModel(EagleHeadConfig.for_target(target, cfg.draft_vocab))
    return train_head(target, head, sequences, out, cfg, head_step, progress)
