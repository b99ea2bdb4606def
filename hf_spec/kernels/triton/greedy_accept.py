"""Greedy tree acceptance on the device: the argmax of every verification row, then the walk down the tree.

    predictions[r] = argmax(logits[r])     r = 0 (the root) .. num_nodes; the first index among equal maxima
    node = root
    while a child c of node (lowest index first) has tokens[c] == predictions[node + 1]: accept c, node = c
    bonus = predictions[node + 1]

Two launches (the argmax of every row in vocabulary chunks, then one program that reduces the chunks and walks)
and one packed `torch.LongTensor` of shape `(2 + 2 * num_nodes + 1,)` that the host reads once:
`[num_accepted, bonus, path (num_nodes slots, the first num_accepted used, -1 after), predictions (num_nodes + 1)]`.

Example: tokens [a, b, c], parents [-1, 0, -1], predictions [c, x, y, z] -> [1, z, 2, -1, -1, c, x, y, z]
(node 2 accepted; row 3 predicts z, not a child of node 2).

The launches run as the custom operator `torch.ops.hf_spec.greedy_accept` (`hf_spec.kernels.triton.op`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_spec.engine.acceptance import greedy_walk
from hf_spec.kernels.triton.op import kernel_op, wrap_triton

CHUNK = 2048  # vocabulary entries per program of the argmax pass
BLOCK = 512  # entries a program reads at once
NO_INDEX = tl.constexpr(2147483647)  # "no index yet" (larger than any vocabulary index)


@triton.jit
def _chunk_argmax(
    logits_ptr, stride_row, vocab, max_ptr, idx_ptr, num_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr
):
    """Program (r, c): the largest value of row r's chunk c and its first index."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], NO_INDEX, tl.int32)
    row_ptr = logits_ptr + tl.cast(row, tl.int64) * stride_row
    for start in range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), BLOCK):
        cols = start + offs
        inside = cols < vocab
        v = tl.load(row_ptr + cols, mask=inside, other=float("-inf")).to(tl.float32)
        # strictly greater keeps a lane's earliest index among equals; an unset lane takes any value (even -inf)
        better = inside & ((v > best) | (best_idx == NO_INDEX))
        best = tl.where(better, v, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_idx, NO_INDEX), axis=0)
    tl.store(max_ptr + row * num_chunks + chunk, top)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _row_prediction(max_ptr, idx_ptr, row, num_chunks, CHUNKS_BLOCK: tl.constexpr):
    """Reduce row `row`'s chunk maxima: its argmax (int32)."""
    coffs = tl.arange(0, CHUNKS_BLOCK)
    inside = coffs < num_chunks
    m = tl.load(max_ptr + row * num_chunks + coffs, mask=inside, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + coffs, mask=inside, other=NO_INDEX)
    top = tl.max(m, axis=0)
    return tl.min(tl.where(inside & (m == top), i, NO_INDEX), axis=0)


@triton.jit
def _walk(
    max_ptr,
    idx_ptr,
    num_chunks,
    parents_ptr,
    tokens_ptr,
    num_nodes,
    out_ptr,
    CHUNKS_BLOCK: tl.constexpr,
    NODES_BLOCK: tl.constexpr,
):
    """One program: every row's prediction into `out`, then the walk from the root."""
    for r in range(0, num_nodes + 1):
        pred = _row_prediction(max_ptr, idx_ptr, r, num_chunks, CHUNKS_BLOCK)
        tl.store(out_ptr + 2 + num_nodes + r, tl.cast(pred, tl.int64))
    noffs = tl.arange(0, NODES_BLOCK)
    inside = noffs < num_nodes
    parents = tl.load(parents_ptr + noffs, mask=inside, other=-2).to(tl.int32)
    tokens = tl.load(tokens_ptr + noffs, mask=inside, other=-1).to(tl.int64)
    node = -1
    count = 0
    bonus = 0
    going = 1
    while going > 0:
        pred = _row_prediction(max_ptr, idx_ptr, node + 1, num_chunks, CHUNKS_BLOCK)
        match = inside & (parents == node) & (tokens == tl.cast(pred, tl.int64))
        child = tl.min(tl.where(match, noffs, NODES_BLOCK), axis=0)
        found = child < NODES_BLOCK
        tl.store(out_ptr + 2 + count, tl.cast(child, tl.int64), mask=found)
        count = count + found.to(tl.int32)
        bonus = tl.where(found, bonus, pred)
        node = tl.where(found, child, node)
        going = found.to(tl.int32)
    tl.store(out_ptr, tl.cast(count, tl.int64))
    tl.store(out_ptr + 1, tl.cast(bonus, tl.int64))


def greedy_accept(logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of a tree on `logits`' device.

    Args:
        logits: `(num_nodes + 1, vocab_size)` verification rows (row 0 = the root), any float dtype.
        parents / tokens: `torch.LongTensor` of shape `(num_nodes,)` on the same device.

    Returns:
        the packed `torch.LongTensor` of shape `(2 + 2 * num_nodes + 1,)` described in the module docstring.
    """
    return _greedy_accept(logits, parents, tokens)


def _packed_like(logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The empty packed output `(2 + 2 * num_nodes + 1,)` for `logits` `(num_nodes + 1, vocab)` (the fake)."""
    return logits.new_empty((2 * logits.shape[0] + 1,), dtype=torch.long)


@kernel_op("greedy_accept", (_chunk_argmax, _walk), _packed_like)
def _greedy_accept(logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    num_nodes = rows - 1
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    chunks = triton.cdiv(vocab, CHUNK)
    maxes = torch.empty(rows, chunks, dtype=torch.float32, device=device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=device)
    out = torch.full((2 * rows + 1,), -1, dtype=torch.long, device=device)  # unused path slots: -1
    if num_nodes == 0:  # a pointer to nothing is not passed: one unused slot
        parents = tokens = torch.zeros(1, dtype=torch.long, device=device)
    wrap_triton(_chunk_argmax)[(rows, chunks)](
        logits, logits.stride(0), vocab, maxes, index, chunks, CHUNK=CHUNK, BLOCK=BLOCK
    )
    wrap_triton(_walk)[(1,)](
        maxes,
        index,
        chunks,
        parents,
        tokens,
        num_nodes,
        out,
        CHUNKS_BLOCK=triton.next_power_of_2(chunks),
        NODES_BLOCK=triton.next_power_of_2(max(num_nodes, 1)),
    )
    return out


def greedy_accept_reference(
    logits: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """The torch twin of `greedy_accept` (same output): `argmax` of every row, the walk on the host."""
    num_nodes = logits.shape[0] - 1
    predictions = logits.float().argmax(-1).tolist()
    children: list[list[int]] = [[] for _ in range(num_nodes + 1)]
    for i, p in enumerate(parents.tolist()):
        children[p + 1].append(i)
    path, bonus = greedy_walk(children, tokens.tolist(), predictions)
    packed = [len(path), bonus, *path, *([-1] * (num_nodes - len(path))), *predictions]
    return torch.tensor(packed, dtype=torch.long, device=logits.device)


def unpack_greedy(packed: list[int], num_nodes: int) -> tuple[list[int], int, list[int]]:
    """`(accepted path, bonus, predictions)` from the packed output read on the host."""
    count, bonus = packed[0], packed[1]
    return packed[2 : 2 + count], bonus, packed[2 + num_nodes :]
