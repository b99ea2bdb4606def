"""Lyanna's token-info sampling step on the device: one level's raw logits plus each frontier node's token-info
bias -> the top-k children of every node.

For frontier row f with token t (`hf_spec.methods.lyanna.modeling.LyannaHeadModel.token_info`):

    bias_f   = RMSNorm(E'(t)) = b / sqrt(mean(b^2) + eps) * scale,    b = low_f @ W_2^T   (low_f = (E(t) W_1))
    row_f    = raw + valid_f * bias_f[:cols]                          (the mean runs over the full draft vocab)
    children = topk(log_softmax(row_f), k)                            larger first, lower index among equals

The bias never exists as a `(frontier, vocab)` tensor: the kernel takes the rank-r factors `low` `(frontier, r)`
and `W_2` `(vocab, r)` and recomputes b block by block (one pass for the mean, one for the log-sum-exp, k for the
top-k). A dense bias (a collapsed token-info table, or none at all) is the same kernel without the factors. The
launch runs as the custom operator `torch.ops.hf_spec.token_info_topk` (`hf_spec.kernels.triton.op`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_spec.kernels.triton.draft_topk import NO_INDEX, _next_largest, stable_topk
from hf_spec.kernels.triton.op import kernel_op, wrap_triton

BLOCK = 256
NONE, DENSE, LOW_RANK = 0, 1, 2  # the bias kinds (`MODE`)


@triton.jit
def _bias_block(
    f, cols, inside, bias_ptr, stride_bias, low, w2_ptr, stride_w2, ranks, rank, MODE: tl.constexpr
):
    """Row f's unnormalised bias at `cols` (LOW_RANK: low_f @ W_2[cols]^T; DENSE: the bias row)."""
    if MODE == 2:
        w = tl.load(
            w2_ptr + cols[:, None].to(tl.int64) * stride_w2 + ranks[None, :],
            mask=inside[:, None] & (ranks[None, :] < rank),
            other=0.0,
        ).to(tl.float32)
        return tl.sum(w * low[None, :], axis=1)
    else:
        return tl.load(bias_ptr + tl.cast(f, tl.int64) * stride_bias + cols, mask=inside, other=0.0).to(
            tl.float32
        )


@triton.jit
def _token_info_topk(
    raw_ptr,
    cols_n,
    bias_ptr,
    stride_bias,
    low_ptr,
    stride_low,
    w2_ptr,
    stride_w2,
    scale_ptr,
    full_vocab,
    rank,
    valid_ptr,
    eps,
    values_ptr,
    indices_ptr,
    K: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    RANK_BLOCK: tl.constexpr,
):
    """Program f: frontier row f's top-k children (log-probabilities and draft-vocabulary indices)."""
    f = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ranks = tl.arange(0, RANK_BLOCK)
    valid = tl.load(valid_ptr + f).to(tl.float32)
    low = tl.zeros([RANK_BLOCK], tl.float32)
    inv_rms = 1.0
    if MODE == 2:
        low = tl.load(low_ptr + tl.cast(f, tl.int64) * stride_low + ranks, mask=ranks < rank, other=0.0).to(
            tl.float32
        )
        squares = tl.zeros([BLOCK], tl.float32)
        for start in range(0, full_vocab, BLOCK):
            cols = start + offs
            inside = cols < full_vocab
            b = _bias_block(f, cols, inside, bias_ptr, stride_bias, low, w2_ptr, stride_w2, ranks, rank, MODE)
            squares += b * b
        inv_rms = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / full_vocab + eps)
    # the log-sum-exp of the biased row
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols_n, BLOCK):
        cols = start + offs
        inside = cols < cols_n
        v = tl.load(raw_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
        if MODE != 0:
            b = _bias_block(f, cols, inside, bias_ptr, stride_bias, low, w2_ptr, stride_w2, ranks, rank, MODE)
            if MODE == 2:
                b = b * inv_rms * tl.load(scale_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            v = v + valid * b
        new_m = tl.maximum(m, v)
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - shift) + tl.exp(v - shift)
        m = new_m
    top_m = tl.max(m, axis=0)
    lse = top_m + tl.log(tl.sum(s * tl.exp(m - top_m), axis=0))
    prev_v = float("inf")
    prev_i = -1
    for j in tl.static_range(K):
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK], NO_INDEX, tl.int32)
        for start in range(0, cols_n, BLOCK):
            cols = start + offs
            inside = cols < cols_n
            v = tl.load(raw_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
            if MODE != 0:
                b = _bias_block(
                    f, cols, inside, bias_ptr, stride_bias, low, w2_ptr, stride_w2, ranks, rank, MODE
                )
                if MODE == 2:
                    b = b * inv_rms * tl.load(scale_ptr + cols, mask=inside, other=0.0).to(tl.float32)
                v = v + valid * b
            best, best_idx = _next_largest(v, cols, inside, prev_v, prev_i, best, best_idx)
        top = tl.max(best, axis=0)
        idx = tl.min(tl.where(best == top, best_idx, NO_INDEX), axis=0)
        tl.store(values_ptr + f * K + j, top - lse)
        tl.store(indices_ptr + f * K + j, tl.cast(idx, tl.int64))
        prev_v = top
        prev_i = idx


def token_info_topk(
    raw: torch.Tensor,
    k: int,
    frontier: int,
    valid: torch.Tensor,
    bias: torch.Tensor | None = None,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k children of `frontier` rows: `(values, indices)`, float32 and int64 of shape `(frontier, k)`.

    Args:
        raw: `(cols,)` the level's raw logits over the first `cols` draft-vocabulary entries.
        valid: `(frontier,)` 1 where the row's token has a token-info bias, 0 where it has none.
        bias: `(frontier, >= cols)` a dense bias (already normalized), or None.
        factors: `(low, w2, scale)`: `low` `(frontier, rank)`, `w2` `(draft_vocab, rank)` (W_2's weight) and the
            RMSNorm weight `scale` `(draft_vocab,)`; the norm's mean runs over all `draft_vocab` entries.
        With neither, every row is `raw`.
    """
    cols = raw.shape[-1]
    if not 0 < k <= cols:
        raise ValueError(f"token_info_topk needs 0 < k <= vocab ({cols}), got k={k}")
    low, w2, scale = (None, None, None) if factors is None else factors
    valid = valid.to(device=raw.device, dtype=torch.float32)
    return _token_info_topk_op(raw, k, frontier, valid, bias, low, w2, scale, eps)


def _children_like(
    raw: torch.Tensor,
    k: int,
    frontier: int,
    valid: torch.Tensor,
    bias: torch.Tensor | None,
    low: torch.Tensor | None,
    w2: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty `(values, indices)` `(frontier, k)`, float32 and int64 (the fake)."""
    return raw.new_empty((frontier, k), dtype=torch.float32), raw.new_empty((frontier, k), dtype=torch.long)


@kernel_op("token_info_topk", (_token_info_topk,), _children_like)
def _token_info_topk_op(
    raw: torch.Tensor,
    k: int,
    frontier: int,
    valid: torch.Tensor,
    bias: torch.Tensor | None,
    low: torch.Tensor | None,
    w2: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_info_topk` with the factors `(low, w2, scale)` passed one by one (all three, or none)."""
    cols = raw.shape[-1]
    device = raw.device
    values, indices = _children_like(raw, k, frontier, valid, bias, low, w2, scale, eps)
    dummy = torch.zeros(1, 1, dtype=torch.float32, device=device)
    mode, rank, full = NONE, 1, cols
    if low is not None and w2 is not None and scale is not None:
        low, w2, scale = low.contiguous(), w2.contiguous(), scale.contiguous()
        mode, rank, full = LOW_RANK, low.shape[1], w2.shape[0]
    else:
        low, w2, scale = dummy, dummy, dummy[0]
    if bias is not None:
        bias = bias.contiguous()
        mode = DENSE if mode == NONE else mode
    else:
        bias = dummy
    wrap_triton(_token_info_topk)[(frontier,)](
        raw.contiguous(),
        cols,
        bias,
        bias.stride(0),
        low,
        low.stride(0),
        w2,
        w2.stride(0),
        scale,
        full,
        rank,
        valid.contiguous(),
        eps,
        values,
        indices,
        K=k,
        MODE=mode,
        BLOCK=BLOCK,
        RANK_BLOCK=triton.next_power_of_2(rank),
    )
    return values, indices


def token_info_topk_reference(
    raw: torch.Tensor,
    k: int,
    frontier: int,
    valid: torch.Tensor,
    bias: torch.Tensor | None = None,
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-12,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `token_info_topk`, in float32."""
    cols = raw.shape[-1]
    rows = raw.float().expand(frontier, -1)
    if factors is not None:
        low, w2, scale = factors
        b = low.float() @ w2.float().T  # [frontier, draft_vocab]
        bias = b * torch.rsqrt(b.pow(2).mean(-1, keepdim=True) + eps) * scale.float()
    if bias is not None:
        rows = rows + valid.float().to(raw.device)[:, None] * bias[:, :cols].float()
    return stable_topk(torch.log_softmax(rows, dim=-1), k)
