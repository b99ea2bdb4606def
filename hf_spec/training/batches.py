"""Token-budget batches of captured conversations, in a seeded order that a resumed run can replay."""

from __future__ import annotations

import math
import random

import torch


def draft_vocabulary(
    sequences: list[dict[str, torch.Tensor]], size: int, vocab_size: int, keep: list[int]
) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `keep`, e.g. EOS), most frequent first: the `d2t` map (so
    `d2t[:n]` are the n hottest tokens)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = seq["input_ids"].long()[seq["response_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    counts[torch.tensor(keep, dtype=torch.long)] = counts.max() + 1
    # ties (above all: tokens never seen in the data) go to lower ids, which BPE vocabularies give to their most
    # frequent merges, so the unseen rest of the draft vocabulary is filled by the tokenizer's own frequency order
    order = torch.argsort(
        counts.double() * vocab_size - torch.arange(vocab_size, dtype=torch.double), descending=True
    )
    return order[: min(size, vocab_size)]


def vocabulary_coverage(
    sequences: list[dict[str, torch.Tensor]], d2t: torch.Tensor, vocab_size: int
) -> float:
    """Share of response tokens inside the draft vocabulary."""
    inside = torch.zeros(vocab_size, dtype=torch.bool)
    inside[d2t.cpu()] = True
    total = hit = 0
    for seq in sequences:
        ids = seq["input_ids"].long()[seq["response_mask"].bool()]
        total += len(ids)
        hit += int(inside[ids].sum())
    return hit / max(total, 1)


def epoch_batches(lengths: list[int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices grouped into batches whose padded size (batch x longest) stays within `max_tokens`; shuffled by
    (seed, epoch), with similar lengths together so little is padding."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), 256):  # sort within windows: shuffled, yet similar lengths together
        window = sorted(order[start : start + 256], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in window:
            longest = max([lengths[j] for j in batch] + [min(lengths[i], max_tokens)])
            if batch and longest * (len(batch) + 1) > max_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def training_schedule(lengths: list[int], max_tokens: int, seed: int, epochs: float) -> list[list[int]]:
    """Every step's batch: whole epochs of `epoch_batches` (reshuffled each epoch, so their batch counts differ a
    little), then the first fraction of one more when `epochs` is fractional."""
    schedule: list[list[int]] = []
    for epoch in range(math.ceil(epochs)):
        batches = epoch_batches(lengths, max_tokens, seed, epoch)
        share = min(1.0, epochs - epoch)
        schedule += batches[: math.ceil(share * len(batches))]
    return schedule


def collate(sequences: list[dict[str, torch.Tensor]], max_len: int) -> dict[str, torch.Tensor]:
    """Right-padded `(batch, T)` tensors (features `(batch, T, hidden)` float32), cut to `max_len`."""
    length = min(max(len(s["input_ids"]) for s in sequences), max_len)
    out: dict[str, torch.Tensor] = {}
    for key in sequences[0]:
        first = sequences[0][key]
        shape = (len(sequences), length, *first.shape[1:])
        dtype = torch.float32 if key == "features" else first.dtype
        buf = torch.zeros(shape, dtype=dtype)
        for row, seq in enumerate(sequences):
            n = min(len(seq[key]), length)
            buf[row, :n] = seq[key][:n].to(dtype)
        out[key] = buf
    valid = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        valid[row, : min(len(seq["input_ids"]), length)] = True
    out["valid"] = valid
    return out
