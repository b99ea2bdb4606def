"""Retrieval trees: candidate continuations with frequencies -> a trie with cumulative frequencies, pruned to
a node budget (Talon / REST style).

Example: sequences `[a b c]` x3, `[a d]` x1, `[e]` x1 ->
    a(4) -> b(3) -> c(3)
         -> d(1)
    e(1)
    pruned to 3 nodes: a(4), b(3), c(3) (the lowest-frequency subtrees go first).
"""

from __future__ import annotations

import numpy as np
import torch

from hf_spec.tree.buffers import DraftTree


def build_trie(sequences, weights) -> tuple[list[int], list[int], list[float]]:
    """Insert sequences into a trie; a node's frequency is the summed weight of the sequences through it.

    Args:
        sequences: iterable of token sequences (a negative token ends a sequence early).
        weights: one weight (count) per sequence.

    Returns:
        `(tokens, parents, freq)` lists over the nodes in insertion order (parents first, `-1` = root).
    """
    tokens: list[int] = []
    parents: list[int] = []
    freq: list[float] = []
    child_of: dict[tuple[int, int], int] = {}
    for seq, w in zip(sequences, weights, strict=True):
        parent = -1
        for tok in seq:
            tok = int(tok)
            if tok < 0:
                break
            node = child_of.get((parent, tok))
            if node is None:
                node = len(tokens)
                child_of[(parent, tok)] = node
                tokens.append(tok)
                parents.append(parent)
                freq.append(0.0)
            freq[node] += float(w)
            parent = node
    return tokens, parents, freq


def prune_trie(parents: list[int], freq: list[float], max_nodes: int) -> np.ndarray:
    """Nodes kept after pruning the lowest-frequency subtrees until at most `max_nodes` remain.

    Cumulative frequencies never grow from parent to child, so this is the `max_nodes` most frequent nodes,
    ties broken by depth (shallower first) then insertion order: every kept node's parent is kept.

    Returns:
        `bool` array of shape `(num_nodes,)`.
    """
    n = len(parents)
    keep = np.zeros(n, dtype=bool)
    if max_nodes <= 0 or n == 0:
        return keep
    depth = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    order = np.lexsort((np.arange(n), depth, -np.asarray(freq, dtype=np.float64)))
    keep[order[:max_nodes]] = True
    return keep


def retrieval_tree(sequences, weights, max_nodes: int) -> tuple[DraftTree, list[float]]:
    """A deterministic draft tree from weighted continuations: trie, pruned to `max_nodes`, laid out breadth-first
    with siblings in decreasing frequency (the order verification tries them).

    Returns:
        the tree and the frequency of each of its nodes.
    """
    tokens, parents, freq = build_trie(sequences, weights)
    keep = prune_trie(parents, freq, max_nodes)
    kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
    for i, p in enumerate(parents):
        if keep[i]:
            kids[p + 1].append(i)
    out_tokens: list[int] = []
    out_parents: list[int] = []
    out_freq: list[float] = []
    queue = [(-1, -1)]  # (old node, new index)
    while queue:
        old, new = queue.pop(0)
        for c in sorted(kids[old + 1], key=lambda c: -freq[c]):
            queue.append((c, len(out_tokens)))
            out_tokens.append(tokens[c])
            out_parents.append(new)
            out_freq.append(freq[c])
    tree = DraftTree(torch.tensor(out_tokens, dtype=torch.long), torch.tensor(out_parents, dtype=torch.long))
    return tree, out_freq
