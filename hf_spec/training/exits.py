"""Training exit heads by distillation from the target's last layer.

data     : training prompts with the target's own responses, never eval prompts (`data.py`)
features : one target forward per sequence -> the hidden states after each exit layer at the response
           positions, and the teacher's top-K next-token distribution (full LM head, last layer) (`features.py`)
loss     : soft cross-entropy of the exit's distribution against the teacher's top-K, both over a shared
           candidate set per batch (the batch's teacher top-K tokens + random negatives), so a large LM head is
           never run in full while training (this module)
measure  : on held-out training sequences, how often each exit's argmax over the FULL vocabulary equals the
           last layer's argmax, before (stock logit lens) and after training (this module; `card.py` writes it up)
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from transformers import PreTrainedModel

from hf_spec.methods.early_exit.card import model_card
from hf_spec.methods.early_exit.exit_heads import ExitHeads
from hf_spec.models.layers import decoder_parts
from hf_spec.training.distributed import current_processes
from hf_spec.training.exit_data import frequent_tokens, load_training_rows, tokenize_rows, vocabulary_texts
from hf_spec.training.exit_features import Features, Progress, extract_cached, extract_features
from hf_spec.training.loop import load_checkpoint, save_checkpoint
from hf_spec.training.trainer import check_resumable


def candidate_set(
    top_ids: torch.Tensor, vocab_size: int, negatives: int, generator: torch.Generator
) -> torch.Tensor:
    """Sorted unique token ids: the batch's teacher top-K plus `negatives` uniform random tokens."""
    extra = torch.randint(0, vocab_size, (negatives,), generator=generator)
    return torch.unique(torch.cat([top_ids.flatten(), extra]))


def distill_loss(
    model: PreTrainedModel,
    heads: ExitHeads | None,
    layer: int,
    hidden: torch.Tensor,
    top_ids: torch.Tensor,
    top_probs: torch.Tensor,
    candidates: torch.Tensor,
) -> torch.Tensor:
    """Soft cross-entropy `-sum_t p(t) log q(t)` over `candidates`, averaged over positions.

    Args:
        hidden: `(batch, hidden_size)` after `layer` layers.
        top_ids / top_probs: `(batch, K)` teacher top-K; p is their probabilities renormalised to sum to 1.
        candidates: `(C,)` sorted unique ids containing every `top_ids`; q is the exit's softmax over them.
        heads: `None` scores the stock exit (final norm + LM head on the raw hidden state).
    """
    parts = decoder_parts(model)
    device = parts.lm_head.weight.device  # features live on the CPU, the target (and heads) maybe not
    hidden, top_ids, top_probs, candidates = (t.to(device) for t in (hidden, top_ids, top_probs, candidates))
    h = heads(layer, hidden) if heads is not None else hidden
    weight = parts.lm_head.weight[candidates]  # [C, hidden_size]
    logits = parts.norm(h) @ weight.T  # [batch, C]
    if getattr(parts.lm_head, "bias", None) is not None:
        logits = logits + parts.lm_head.bias[candidates]
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = top_probs / top_probs.sum(-1, keepdim=True)
    cols = torch.searchsorted(candidates, top_ids)  # [batch, K]
    return -(p * logq.gather(1, cols)).sum(-1).mean()


def _lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    return 0.5 * lr * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def train_heads(
    model: PreTrainedModel,
    heads: ExitHeads,
    features: Features,
    steps: int = 600,
    batch_size: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
    negatives: int = 1024,
    checkpoint: str | os.PathLike | None = None,
    save_every: int = 100,
    progress: Progress = None,
) -> list[float]:
    """Adam on every head at once (one shared batch and candidate set per step); returns the mean loss over heads
    per step. Resumes from `checkpoint` when it exists and saves it every `save_every` steps; batches depend only
    on `(seed, step)`, so a resumed run draws the same batches as an uninterrupted one. Under `accelerate launch`
    each process takes its share of every batch's positions (`hf_spec.training.distributed`); the main process
    alone saves the checkpoint and shows progress."""
    processes = current_processes()
    model.requires_grad_(False)
    heads.to(decoder_parts(model).lm_head.weight.device).train()
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    history: list[float] = []
    start = 0
    ckpt = Path(checkpoint) if checkpoint else None
    c = heads.config
    settings = {
        "training": dict(
            layers=c.layers,
            rank=c.rank,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            negatives=negatives,
            positions=len(features),
        )
    }
    if ckpt is not None and ckpt.is_file():
        state = load_checkpoint(ckpt, ("settings", "heads", "optim", "step", "history"))
        check_resumable(state.get("settings"), settings, ckpt.parent)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["optim"])
        start, history = state["step"], state["history"]
    vocab = decoder_parts(model).lm_head.weight.shape[0]
    n = len(features)
    show = progress if processes.is_main else None
    bar = show(total=steps, initial=start, desc="exit heads", unit="step") if show else None
    processes.barrier()  # every process has read the checkpoint before the main one writes the next
    for step in range(start, steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        batch = torch.randint(0, n, (min(batch_size, n),), generator=g)
        # the candidates of the whole batch, the same on every process
        cand = candidate_set(features.top_ids[batch], vocab, negatives, g)
        mine, counts = processes.shard(batch.tolist())
        idx = torch.tensor(mine)
        # the loss is a mean over positions: this process's share of them (1 with one process)
        weight = (len(mine) / len(batch) if counts else 0.0) if processes.world > 1 else 1.0
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup=min(20, steps // 10 + 1))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k in heads.config.layers:
            loss = distill_loss(
                model,
                heads,
                k,
                features.hidden[k][idx].float(),
                features.top_ids[idx],
                features.top_probs[idx],
                cand,
            )
            (loss * weight if processes.world > 1 else loss).backward()
            total += loss.item() * weight
        processes.sum_gradients(params)
        opt.step()
        history.append(processes.total(total) / len(heads.config.layers))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{history[-1]:.3f}")
        if processes.is_main and ckpt is not None and ((step + 1) % save_every == 0 or step + 1 == steps):
            state = {
                "step": step + 1,
                "heads": heads.state_dict(),
                "optim": opt.state_dict(),
                "history": history,
                "settings": settings,
            }
            save_checkpoint(state, ckpt)
    if bar is not None:
        bar.close()
    processes.barrier()  # the last checkpoint is written before any process goes on
    heads.eval()
    return history


@torch.no_grad()
def evaluate_heads(
    model: PreTrainedModel,
    heads: ExitHeads,
    features: Features,
    chunk: int = 256,
    seed: int = 0,
    max_positions: int = 2048,
) -> dict[int, dict[str, float]]:
    """Per exit layer on `features`: `agreement` (exit argmax over the full vocabulary == teacher argmax) and
    `loss` (the training loss with 1024 negatives), for the trained heads and the stock logit lens, over the first
    `max_positions` positions (each costs a full LM-head row per layer and variant)."""
    parts = decoder_parts(model)
    n_pos = min(len(features), max_positions)
    vocab = parts.lm_head.weight.shape[0]
    result: dict[int, dict[str, float]] = {}
    for k in heads.config.layers:
        hits = {"trained": 0, "stock": 0}
        losses = {"trained": 0.0, "stock": 0.0}
        for s in range(0, n_pos, chunk):
            e = min(s + chunk, n_pos)
            h = features.hidden[k][s:e].to(parts.lm_head.weight.device, torch.float32)
            teacher = features.top_ids[s:e, 0].to(h.device)
            g = torch.Generator().manual_seed(seed + s)
            cand = candidate_set(features.top_ids[s:e], vocab, 1024, g)
            for name, hd in (("trained", heads), ("stock", None)):
                hh = hd(k, h) if hd is not None else h
                hits[name] += int((parts.lm_head(parts.norm(hh)).argmax(-1) == teacher).sum())
                loss = distill_loss(model, hd, k, h, features.top_ids[s:e], features.top_probs[s:e], cand)
                losses[name] += float(loss) * h.shape[0]
        n = max(n_pos, 1)
        result[k] = {
            "agreement": hits["trained"] / n,
            "stock_agreement": hits["stock"] / n,
            "loss": losses["trained"] / n,
            "stock_loss": losses["stock"] / n,
        }
    return result


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0


__all__ = [  # the trainer, and the names of its parts that callers import from here
    "Features",
    "candidate_set",
    "distill_loss",
    "evaluate_heads",
    "extract_cached",
    "extract_features",
    "frequent_tokens",
    "load_training_rows",
    "model_card",
    "timed",
    "tokenize_rows",
    "train_heads",
    "vocabulary_texts",
]
