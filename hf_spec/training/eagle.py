"""`hf-spec train eagle`: EAGLE heads, optionally the HASS way (top-K distillation + context alignment)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_spec.methods.eagle.eagle1 import HeadLayout
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.training.losses import alignment_mask, feature_loss
from hf_spec.training.trainer import HeadTrainConfig, Unroll, train_head
from hf_spec.training.warm_start import train_on_from


@dataclass
class EagleTrainConfig(HeadTrainConfig):
    """`HeadTrainConfig` plus HASS harmonized objective distillation: `topk` K (0 = off) and its weight, and the
    head's `architecture` (`EagleHeadConfig.layout`: "hf-spec", or "eagle1", the published EAGLE-1 layer)."""

    topk: int = 0
    topk_weight: float = 1.0
    architecture: HeadLayout = "hf-spec"


def head_step(
    head: EagleHeadModel, batch: dict[str, torch.Tensor], cfg: EagleTrainConfig, t2d: torch.Tensor
) -> tuple[torch.Tensor, list[float], dict[str, float]]:
    """One forward of all alignment steps on a batch: `(loss, accuracy per step, loss parts)`.

    Position t (index i = t - 1) takes (f_{t-1}, x_t) and predicts u_t and the target's next-token distribution at
    t; step j > 1 feeds the head's own step j-1 output at t-1 as f_{t-1} (HASS)."""
    d = Unroll.of(head, head.training_batch(batch), t2d)  # eagle1 heads read post-norm states
    f_in, ids, u_tgt, position_ids = d.f_in, d.ids, d.u_tgt, d.position_ids
    n = ids.shape[1]
    cache = DynamicCache()
    f = f_in
    loss = torch.zeros((), device=ids.device)
    accs, parts = [], {"feature": 0.0, "ce": 0.0, "topk": 0.0}
    for j in range(1, cfg.align_steps + 1):
        attn = alignment_mask(n, j)[None, None].to(ids.device)
        h = head(f, ids, position_ids, attn, cache)
        logp = torch.log_softmax(head.draft_logits(h[d.trained]).float(), dim=-1)  # [N, V_draft] trained rows
        l_feat = feature_loss(h, u_tgt, d.depth_mask(j))
        parts["feature"] += l_feat.item() / cfg.align_steps
        l_tokens, agreement = d.token_loss(logp, j, cfg, parts)
        loss = loss + (cfg.feature_weight * l_feat + l_tokens) / cfg.align_steps
        accs.append(agreement)
        f = torch.cat([f_in[:, :1], h[:, :-1]], dim=1)
    return loss, accs, parts


def train_eagle(
    target,
    sequences: list[dict],
    out: str | Path,
    cfg: EagleTrainConfig,
    progress: bool = True,
    groups: list[str] | None = None,
    heldout: list[dict] | None = None,
    init_from: EagleHeadModel | None = None,
):
    """Train (or resume) an EAGLE/HASS head for `target`; returns `(head, report)`. `groups`: the prompt of each
    sequence; `heldout`: a fixed held-out set (see `train_head`); `init_from`: a trained head of ours (for this
    target, loaded) to train on from, keeping its draft vocabulary."""
    torch.manual_seed(cfg.seed)  # the head's initial weights too: one --seed, one head
    config = EagleHeadConfig.for_target(target, cfg.draft_vocab, layout=cfg.architecture)
    if init_from is None:
        head = EagleHeadModel(config)
    else:
        head = train_on_from(init_from, config, ("layout",), "EAGLE head")
    return train_head(target, head, sequences, out, cfg, head_step, progress, groups, heldout)
