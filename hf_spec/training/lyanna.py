"""`hf-spec train lyanna`: L = alpha * MSE(h, H) + beta * CE(softmax(l'), softmax(L_target)), unrolled over the
hidden-state chain: depth j at position t continues the head's own depth j-1 state at t-1 (no token input) and
sees target features only of verified positions (the HASS alignment mask), as at decoding time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_spec.methods.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel
from hf_spec.training.losses import alignment_mask
from hf_spec.training.trainer import HeadTrainConfig, Unroll, train_head
from hf_spec.training.warm_start import train_on_from


@dataclass
class LyannaTrainConfig(HeadTrainConfig):
    """`HeadTrainConfig` (`align_steps` = chain depths unrolled, `feature_weight` = alpha, `ce_weight` = beta) plus
    the head's `token_info_rank` (0: no token info) and `first_token_fusion` (ablations)."""

    align_steps: int = 4
    feature_weight: float = 1.0
    token_info_rank: int = 64
    first_token_fusion: bool = True


def masked_mse(h: torch.Tensor, u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_pos = F.mse_loss(h, u, reduction="none").mean(-1)
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


def lyanna_step(
    head: LyannaHeadModel, batch: dict[str, torch.Tensor], cfg: LyannaTrainConfig, t2d: torch.Tensor
):
    """`(loss, accuracy per depth, loss parts)` of one batch, all chain depths unrolled in parallel."""
    d = Unroll.of(head, batch, t2d)
    f_in, ids, u_tgt, position_ids = d.f_in, d.ids, d.u_tgt, d.position_ids
    n = ids.shape[1]
    cache = DynamicCache()
    loss = torch.zeros((), device=ids.device)
    accs, parts = [], {"feature": 0.0, "ce": 0.0}
    # the LM head and the token loss run on the trained positions only (see Unroll.token_loss)
    rows = d.trained
    h = None
    for j in range(1, cfg.align_steps + 1):
        attn = alignment_mask(n, j)[None, None].to(ids.device)
        if j == 1:
            h = head.first_step(f_in, ids, position_ids, attn, cache)
            logits = head.draft_logits(h[rows])
            if not head.config.first_token_fusion:  # the bonus token enters through its token info only
                logits = logits + head.token_info(ids[rows])
        else:
            prev = torch.cat(
                [h[:, :1], h[:, :-1]], dim=1
            )  # the chain: depth j at t continues depth j-1 at t-1
            h = head.next_step(prev, position_ids, attn, cache)
            logits = head.draft_logits(h[rows]) + head.token_info(ids[rows])  # l' = l + RMSNorm(E'(x_t))
        l_feat = masked_mse(h, u_tgt, d.depth_mask(j))
        l_tokens, agreement = d.token_loss(torch.log_softmax(logits.float(), dim=-1), j, cfg, parts)
        loss = loss + (cfg.feature_weight * l_feat + l_tokens) / cfg.align_steps
        parts["feature"] += l_feat.item() / cfg.align_steps
        accs.append(agreement)
    return loss, accs, parts


def train_lyanna(
    target,
    sequences: list[dict],
    out: str | Path,
    cfg: LyannaTrainConfig,
    progress: bool = True,
    groups: list[str] | None = None,
    heldout: list[dict] | None = None,
    init_from: LyannaHeadModel | None = None,
):
    """Train (or resume) a Lyanna head for `target`; returns `(head, report)`. `groups`: the prompt of each
    sequence; `heldout`: a fixed held-out set (see `train_head`); `init_from`: a trained head of ours (for this
    target, loaded) to train on from, keeping its draft vocabulary."""
    config = LyannaHeadConfig.for_target(
        target,
        cfg.draft_vocab,
        token_info_rank=cfg.token_info_rank,
        first_token_fusion=cfg.first_token_fusion,
    )
    torch.manual_seed(cfg.seed)  # the head's initial weights too: one --seed, one head
    if init_from is None:
        head = LyannaHeadModel(config)
    else:
        head = train_on_from(init_from, config, ("token_info_rank", "first_token_fusion"), "Lyanna head")
    return train_head(target, head, sequences, out, cfg, lyanna_step, progress, groups, heldout)
