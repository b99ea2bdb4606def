"""Stochastic tree acceptance on the device: hf-spec's recursive rejection rule (`accept_sampling`), same `q`
semantics, same random numbers.

At a node, with p the target distribution of its row and children c_1..c_m in index order (proposal order),
each drawn from q_i (a point mass where deterministic):

    accept c_i with probability min(1, p(c_i) / q_i(c_i))          (u[c_i] < that, u: one uniform per node)
    on rejection p <- normalize(max(p - q_i, 0))                   (a point mass: p(c_i) <- 0)
    no child accepted: the bonus token is drawn from p             (`torch.multinomial`, after the uniforms)

The uniforms are `torch.rand(num_nodes, generator=generator)` and the bonus one `torch.multinomial(p, 1,
generator=generator)`, drawn as `accept_sampling` draws them, so a seeded generator gives the same choices.

Three launches: every row's max and sum of exponentials in vocabulary chunks; one program that walks the tree
(point-mass children read one probability each; a residual over the vocabulary is built only below a node with a
sampled child); the final residual written in parallel for the bonus draw. The host reads one packed
`torch.LongTensor` once: `[num_accepted, bonus, path (num_accepted entries)]`.

The launches run as the custom operator `torch.ops.hf_spec.sampling_walk` (`hf_spec.kernels.triton.op`), which
takes the uniforms and returns the walk's state and the final residual; the random numbers are drawn around it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_spec.engine.acceptance import accept_sampling
from hf_spec.kernels.triton.op import kernel_op, wrap_triton
from hf_spec.tree import DraftTree

CHUNK = 2048  # vocabulary entries per program of the softmax statistics and the residual
BLOCK = 512
_STATE = 4  # int slots before the path: count, final row, dense residual, number of rejected tokens
STATE = tl.constexpr(_STATE)


@triton.jit
def _chunk_softmax_stats(
    scores_ptr, stride_row, vocab, max_ptr, sum_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (r, c): max and sum of exp(x - max) over row r's chunk c (an all -inf chunk: -inf and 0)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    row_ptr = scores_ptr + tl.cast(row, tl.int64) * stride_row
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), BLOCK):
        cols = start + offs
        v = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m, v)
        shift = tl.where(new_m == float("-inf"), 0.0, new_m)  # exp(-inf - shift) = 0, never -inf - (-inf)
        s = s * tl.exp(m - shift) + tl.exp(v - shift)
        m = new_m
    top = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), axis=0)
    tl.store(max_ptr + row * num_chunks + chunk, top)
    tl.store(sum_ptr + row * num_chunks + chunk, total)


@triton.jit
def _row_stats(max_ptr, sum_ptr, row, num_chunks, CHUNKS_BLOCK: tl.constexpr):
    """Row `row`'s softmax statistics `(max, sum of exp(x - max))` from its chunks."""
    coffs = tl.arange(0, CHUNKS_BLOCK)
    inside = coffs < num_chunks
    m = tl.load(max_ptr + row * num_chunks + coffs, mask=inside, other=float("-inf"))
    s = tl.load(sum_ptr + row * num_chunks + coffs, mask=inside, other=0.0)
    top = tl.max(m, axis=0)
    return top, tl.sum(s * tl.exp(m - tl.where(top == float("-inf"), 0.0, top)), axis=0)


@triton.jit
def _residual_block(
    scores_ptr, stride_row, row, m, z, cols, vocab, rejected, count, NODES_BLOCK: tl.constexpr
):
    """p(row) at `cols`, with the first `count` of the `rejected` tokens (a `NODES_BLOCK` vector) set to 0."""
    v = tl.load(
        scores_ptr + tl.cast(row, tl.int64) * stride_row + cols, mask=cols < vocab, other=float("-inf")
    )
    p = tl.exp(v.to(tl.float32) - m) / z
    slots = tl.arange(0, NODES_BLOCK)
    hit = (cols[:, None] == rejected[None, :]) & (slots[None, :] < count)
    return tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, 0.0, p)


@triton.jit
def _walk(
    scores_ptr,
    stride_row,
    vocab,
    max_ptr,
    sum_ptr,
    num_chunks,
    parents_ptr,
    tokens_ptr,
    sampled_ptr,
    q_ptr,
    stride_q,
    u_ptr,
    num_nodes,
    resid_ptr,
    stats_ptr,
    out_ptr,
    CHUNKS_BLOCK: tl.constexpr,
    NODES_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program walks the tree. The residual at the current node is p(row) with `rejected` tokens zeroed and
    mass `mass` while no sampled child was rejected there; after one, it lives densely in `resid` (`dense`)."""
    slots = tl.arange(0, NODES_BLOCK)
    offs = tl.arange(0, BLOCK)
    node = -1
    row = 0
    count = 0
    going = 1
    dense = 0
    n_rej = 0
    rejected = tl.full([NODES_BLOCK], -1, tl.int64)
    mass = 1.0
    m, z = _row_stats(max_ptr, sum_ptr, 0, num_chunks, CHUNKS_BLOCK)
    while going > 0:
        accepted = -1
        for c in range(0, num_nodes):
            parent = tl.load(parents_ptr + c).to(tl.int32)
            if (parent == node) & (accepted < 0):
                tok = tl.load(tokens_ptr + c).to(tl.int64)
                u = tl.load(u_ptr + c)
                sampled = tl.load(sampled_ptr + c).to(tl.int32)
                # a sampled child: the residual over the vocabulary from here on
                if (sampled > 0) & (dense == 0):
                    for start in range(0, vocab, BLOCK):
                        cols = start + offs
                        p = _residual_block(
                            scores_ptr, stride_row, row, m, z, cols, vocab, rejected, n_rej, NODES_BLOCK
                        )
                        tl.store(resid_ptr + cols, p, mask=cols < vocab)
                    tl.debug_barrier()
                    dense = 1
                if dense > 0:
                    p_tok = tl.load(resid_ptr + tok)
                else:
                    s = tl.load(scores_ptr + tl.cast(row, tl.int64) * stride_row + tok).to(tl.float32)
                    seen = tl.max(((rejected == tok) & (slots < n_rej)).to(tl.int32), axis=0)
                    p_tok = tl.where(seen > 0, 0.0, tl.exp(s - m) / z)
                ratio = p_tok / mass
                if sampled > 0:
                    q_tok = tl.load(q_ptr + tl.cast(c, tl.int64) * stride_q + tok).to(tl.float32)
                    ratio = ratio / q_tok
                if u < tl.minimum(ratio, 1.0):
                    accepted = c
                elif sampled > 0:
                    # p <- normalize(max(p - q, 0)), unless that is empty (a rejection of chance 0)
                    q_row = q_ptr + tl.cast(c, tl.int64) * stride_q
                    total = tl.zeros([BLOCK], tl.float32)
                    for start in range(0, vocab, BLOCK):
                        cols = start + offs
                        inside = cols < vocab
                        r = tl.load(resid_ptr + cols, mask=inside, other=0.0) / mass
                        q = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32)
                        total += tl.maximum(r - q, 0.0)
                    left = tl.sum(total, axis=0)
                    if left > 0.0:
                        for start in range(0, vocab, BLOCK):
                            cols = start + offs
                            inside = cols < vocab
                            r = tl.load(resid_ptr + cols, mask=inside, other=0.0) / mass
                            q = tl.load(q_row + cols, mask=inside, other=0.0).to(tl.float32)
                            tl.store(resid_ptr + cols, tl.maximum(r - q, 0.0) / left, mask=inside)
                        tl.debug_barrier()
                        mass = 1.0
                elif mass - p_tok > 0.0:  # a point mass: p(tok) <- 0
                    if dense > 0:
                        tl.store(resid_ptr + tok, 0.0)
                        tl.debug_barrier()
                    else:
                        rejected = tl.where(slots == n_rej, tok, rejected)
                        n_rej += 1
                    mass = mass - p_tok
        if accepted >= 0:
            tl.store(out_ptr + STATE + count, tl.cast(accepted, tl.int64))
            count += 1
            node = accepted
            row = accepted + 1
            dense = 0
            n_rej = 0
            mass = 1.0
            m, z = _row_stats(max_ptr, sum_ptr, row, num_chunks, CHUNKS_BLOCK)
        else:
            going = 0
    tl.store(out_ptr, tl.cast(count, tl.int64))
    tl.store(out_ptr + 1, tl.cast(row, tl.int64))
    tl.store(out_ptr + 2, tl.cast(dense, tl.int64))
    tl.store(out_ptr + 3, tl.cast(n_rej, tl.int64))
    tl.store(out_ptr + STATE + num_nodes + slots, rejected, mask=slots < n_rej)
    tl.store(stats_ptr, m)
    tl.store(stats_ptr + 1, z)


@triton.jit
def _final_residual(
    scores_ptr,
    stride_row,
    vocab,
    resid_ptr,
    stats_ptr,
    out_ptr,
    num_nodes,
    NODES_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program b writes block b of the final residual, unless the walk left it dense in `resid` already."""
    dense = tl.load(out_ptr + 2)
    if dense == 0:
        row = tl.load(out_ptr + 1).to(tl.int32)
        n_rej = tl.load(out_ptr + 3).to(tl.int32)
        slots = tl.arange(0, NODES_BLOCK)
        rejected = tl.load(out_ptr + STATE + num_nodes + slots, mask=slots < n_rej, other=-1)
        m = tl.load(stats_ptr)
        z = tl.load(stats_ptr + 1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        p = _residual_block(scores_ptr, stride_row, row, m, z, cols, vocab, rejected, n_rej, NODES_BLOCK)
        tl.store(resid_ptr + cols, p, mask=cols < vocab)


def sampling_accept(
    scores: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Recursive rejection sampling of a tree on `scores`' device.

    Args:
        scores: `(num_nodes + 1, vocab_size)` processed target scores (row 0 = the root; softmax = p).
        parents / tokens: `torch.LongTensor` of shape `(num_nodes,)` on the same device.
        draft_probs: `(num_nodes, vocab_size)` or None, as `DraftTree.draft_probs` (an all-zero row or None: a
            point mass).
        generator: the sampler's random numbers.

    Returns:
        `torch.LongTensor` of shape `(2 + num_accepted,)`: `[num_accepted, bonus, path...]`, on the device.
    """
    num_nodes = scores.shape[0] - 1
    device = scores.device
    uniforms = (
        torch.rand(num_nodes, generator=generator, device=device)
        if num_nodes
        else torch.zeros(1, device=device)
    )
    q = None if draft_probs is None else draft_probs.to(device)
    out, resid = _sampling_walk(scores, parents, tokens, q, uniforms)
    bonus = torch.multinomial(resid, 1, generator=generator)
    return torch.cat([out[:1], bonus, out[_STATE : _STATE + num_nodes]])


def _walk_like(
    scores: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty `(state (4 + 2 * max(num_nodes, 1),) int64, residual (vocab,) float32)` (the fake)."""
    rows, vocab = scores.shape
    out = scores.new_empty((_STATE + 2 * max(rows - 1, 1),), dtype=torch.long)
    return out, scores.new_empty((vocab,), dtype=torch.float32)


@kernel_op("sampling_walk", (_chunk_softmax_stats, _walk, _final_residual), _walk_like)
def _sampling_walk(
    scores: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk with the uniforms `(max(num_nodes, 1),)` given: `(state, residual)`, where `state[0]` is the number
    accepted, `state[4 : 4 + num_nodes]` the path, and the bonus token is drawn from the residual `(vocab,)`."""
    rows, vocab = scores.shape
    num_nodes = rows - 1
    device = scores.device
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if draft_probs is None:
        sampled = torch.zeros(max(num_nodes, 1), dtype=torch.int8, device=device)
        q = torch.zeros(1, 1, device=device)
    else:
        q = draft_probs.contiguous()
        sampled = q.any(dim=-1).to(torch.int8)
    if num_nodes == 0:
        parents = tokens = torch.zeros(1, dtype=torch.long, device=device)
    chunks = triton.cdiv(vocab, CHUNK)
    maxes = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    sums = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    stats = torch.empty(2, dtype=torch.float32, device=device)
    out, resid = _walk_like(scores, parents, tokens, draft_probs, uniforms)
    out.fill_(-1)  # path slots after the accepted ones: -1, as the twin's
    nodes_block = triton.next_power_of_2(max(num_nodes, 1))
    wrap_triton(_chunk_softmax_stats)[(rows, chunks)](
        scores, scores.stride(0), vocab, maxes, sums, chunks, CHUNK=CHUNK, BLOCK=BLOCK
    )
    wrap_triton(_walk)[(1,)](
        scores,
        scores.stride(0),
        vocab,
        maxes,
        sums,
        chunks,
        parents,
        tokens,
        sampled,
        q,
        q.stride(0),
        uniforms,
        num_nodes,
        resid,
        stats,
        out,
        CHUNKS_BLOCK=triton.next_power_of_2(chunks),
        NODES_BLOCK=nodes_block,
        BLOCK=BLOCK,
    )
    wrap_triton(_final_residual)[(triton.cdiv(vocab, BLOCK),)](
        scores, scores.stride(0), vocab, resid, stats, out, num_nodes, NODES_BLOCK=nodes_block, BLOCK=BLOCK
    )
    return out, resid


def sampling_accept_reference(
    scores: torch.Tensor,
    parents: torch.Tensor,
    tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The torch twin of `sampling_accept` (same output layout): hf-spec's `accept_sampling` on the host."""
    tree = DraftTree(
        tokens.cpu(), parents.cpu(), None if draft_probs is None else draft_probs.to(scores.device)
    )
    acc = accept_sampling(tree, lambda row, path: scores[row], generator)
    packed = [len(acc.accepted), acc.bonus, *acc.accepted, *([-1] * (len(tree) - len(acc.accepted)))]
    return torch.tensor(packed, dtype=torch.long, device=scores.device)


def unpack_sampling(packed: list[int]) -> tuple[list[int], int]:
    """`(accepted path, bonus)` from the packed output read on the host."""
    return packed[2 : 2 + packed[0]], packed[1]
