"""Retrieval trees: candidate continuations with frequencies -> a trie with cumulative frequencies, pruned to
a node budget (Talon / REST style).

Example: sequences `[a b c]` x3, `[a d]` x1, `[e]` x1 ->
    a(4) -> b(3) -> c(3)
         -> d(1)
    e(1)
    pruned to 3 nodes: a(4), b(3), c(3) (the lowest-frequency subtrees go first).
"""

from __future__ import annotations

import itertools

import numpy as np

from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.trie import TokenTrie, node_depths


def weighted_trie(sequences, weights) -> tuple[list[int], list[int], list[float]]:
    """Insert sequences into a trie; a node's frequency is the summed weight of the sequences through it.

    Args:
        sequences: iterable of token sequences (a negative token ends a sequence early).
        weights: one weight (count) per sequence.

    Returns:
        `(tokens, parents, freq)` lists over the nodes in insertion order (parents first, `-1` = root).
    """
    trie = TokenTrie()
    freq: list[float] = []
    for seq, w in zip(sequences, weights, strict=True):
        path = trie.insert(itertools.takewhile(lambda tok: tok >= 0, map(int, seq)))
        freq.extend([0.0] * (len(trie) - len(freq)))
        for node in path:
            freq[node] += float(w)
    return trie.tokens, trie.parents, freq


def prune_by_frequency(parents: list[int], freq: list[float], max_nodes: int) -> np.ndarray:
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
    depth = np.asarray(node_depths(parents), dtype=np.int64)
    order = np.lexsort((np.arange(n), depth, -np.asarray(freq, dtype=np.float64)))
    keep[order[:max_nodes]] = True
    return keep


def retrieval_tree(sequences, weights, max_nodes: int) -> tuple[DraftTree, list[float]]:
    """A deterministic draft tree from weighted continuations: trie, pruned to `max_nodes`, laid out breadth-first
    with siblings in decreasing frequency (the order verification tries them).

    Returns:
        the tree and the frequency of each of its nodes.
    """
    tokens, parents, freq = weighted_trie(sequences, weights)
    keep = prune_by_frequency(parents, freq, max_nodes)
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
    return DraftTree.from_lists(out_tokens, out_parents), out_freq
