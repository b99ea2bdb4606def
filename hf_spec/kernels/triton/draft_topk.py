"""Log-softmax and top-k of draft-head rows on the device (an EAGLE head's children over its draft vocabulary).

    values[r], indices[r] = topk(log_softmax(logits[r].float()), k)     larger first; among equal values the
                                                                        lower index first

One program a row: one pass for the row's log-sum-exp, then k passes, each taking the largest entry ordered after
the one taken before (value descending, index ascending), so nothing is sorted or stored but the k results. The
launch runs as the custom operator `torch.ops.hf_spec.draft_topk` (`hf_spec.kernels.triton.op`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_spec.kernels.triton.op import kernel_op, wrap_triton

BLOCK = 1024
NO_INDEX = tl.constexpr(2147483647)


@triton.jit
def _log_sum_exp(row_ptr, vocab, BLOCK: tl.constexpr):
    """log(sum(exp(x))) of a row (float32), in one pass."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, v)
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.exp(v - shift)
        m = new_m
    top = tl.max(m, axis=0)
    return top + tl.log(tl.sum(s * tl.exp(m - top), axis=0))


@triton.jit
def _next_largest(v, cols, inside, prev_v, prev_i, best, best_idx):
    """Fold one block into the lanes' best entry ordered after `(prev_v, prev_i)` (value desc, index asc)."""
    after = inside & ((v < prev_v) | ((v == prev_v) & (cols > prev_i)))
    better = after & ((v > best) | (best_idx == NO_INDEX))
    return tl.where(better, v, best), tl.where(better, cols, best_idx)


@triton.jit
def _draft_topk(logits_ptr, stride_row, vocab, values_ptr, indices_ptr, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r's k largest log-probabilities and their indices."""
    row = tl.program_id(0)
    row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_row
    lse = _log_sum_exp(row_ptr, vocab, BLOCK)
    offs = tl.arange(0, BLOCK)
    prev_v = float("inf")
    prev_i = -1
    for j in tl.static_range(K):
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK], NO_INDEX, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            inside = cols < vocab
            v = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
            best, best_idx = _next_largest(v, cols, inside, prev_v, prev_i, best, best_idx)
        top = tl.max(best, axis=0)
        idx = tl.min(tl.where(best == top, best_idx, NO_INDEX), axis=0)
        tl.store(values_ptr + row * K + j, top - lse)
        tl.store(indices_ptr + row * K + j, tl.cast(idx, tl.int64))
        prev_v = top
        prev_i = idx


def draft_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, indices)`, float32 and int64 of shape `(rows, k)`: the top-k of each row's log-softmax.

    Args:
        logits: `(rows, vocab)`, any float dtype; `k <= vocab`.
    """
    vocab = logits.shape[1]
    if not 0 < k <= vocab:
        raise ValueError(f"draft_topk needs 0 < k <= vocab ({vocab}), got k={k}")
    return _draft_topk_op(logits, k)


def _topk_like(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty `(values, indices)` `(rows, k)`, float32 and int64 (the fake)."""
    rows = logits.shape[0]
    return logits.new_empty((rows, k), dtype=torch.float32), logits.new_empty((rows, k), dtype=torch.long)


@kernel_op("draft_topk", (_draft_topk,), _topk_like)
def _draft_topk_op(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    values, indices = _topk_like(logits, k)
    if rows:
        wrap_triton(_draft_topk)[(rows,)](logits, logits.stride(0), vocab, values, indices, K=k, BLOCK=BLOCK)
    return values, indices


def stable_topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk` along the last dim with ties broken by the lower index (as the kernels break them)."""
    values, indices = torch.sort(logp, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def draft_topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `draft_topk`."""
    return stable_topk(torch.log_softmax(logits.float(), dim=-1), k)
