"""Merging into draft trees by longest-prefix matching (`TokenTrie`): a node whose path from the root already
exists in the merged tree is merged into it, so shared prefixes are verified once. `fuse_trees` merges two draft
trees; `graft` hangs token continuations below chosen nodes of a tree.

Sampling stays exact. Recursive rejection sampling (`verify.acceptance.accept_sampling`) needs each node's
reported `q` to be the distribution its token was drawn from *given its earlier siblings*. After fusion:
- a deterministic node (all-zero row) stays a point mass;
- a sampled node that lands on an earlier sibling's token is merged into it (that slot does not exist), and a
  sampled node that stays is distinct from every earlier sibling, so its row is renormalised with the earlier
  siblings' tokens zeroed -- the exact conditional of a draw that is known to avoid them;
- whether a node exists depends only on the drafts, never on the verifier's random numbers, and each slot is
  one speculative-sampling step against the current residual, so the committed token still follows `p`.
"""

from __future__ import annotations

import torch

from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.trie import TokenTrie


def fuse_trees(first: DraftTree, second: DraftTree) -> tuple[DraftTree, list[int], list[int]]:
    """Merge `second` into `first` (trie union). Siblings keep `first`'s order, then `second`'s new ones.

    Returns:
        the fused tree and, for each node of `first` / `second`, its index in the fused tree.
    """
    trie = TokenTrie()
    origin: list[tuple[int, int]] = []  # (tree 0/1, node) that created each fused node
    maps: list[list[int]] = []
    for t, tree in enumerate((first, second)):
        mapping: list[int] = []
        for i, (tok, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
            node = trie.add(mapping[p] if p >= 0 else -1, tok)
            if node == len(origin):
                origin.append((t, i))
            mapping.append(node)
        maps.append(mapping)
    probs = _fused_probs(first, second, trie.tokens, trie.parents, origin)
    return DraftTree.from_lists(trie.tokens, trie.parents, probs), *maps


def _fused_probs(first: DraftTree, second: DraftTree, tokens, parents, origin) -> torch.Tensor | None:
    rows_of = (first.draft_probs, second.draft_probs)
    if all(r is None for r in rows_of):
        return None
    vocab = next(r.shape[1] for r in rows_of if r is not None)
    dtype = next(r.dtype for r in rows_of if r is not None)
    probs = torch.zeros((len(tokens), vocab), dtype=dtype)
    for node, (t, i) in enumerate(origin):
        if rows_of[t] is not None:
            probs[node] = rows_of[t][i]
    earlier: dict[int, list[int]] = {}  # parent -> tokens of the siblings seen so far
    for node, parent in enumerate(parents):
        seen = earlier.setdefault(parent, [])
        row = probs[node]
        if seen and bool(row.any()):
            row[seen] = 0.0
            total = row.sum()
            if float(total) <= 0:
                raise ValueError("a sampled draft token has zero probability under its reported distribution")
            probs[node] = row / total
        seen.append(tokens[node])
    return probs


def graft(tree: DraftTree, grafts: list[tuple[int, list[int]]], max_nodes: int) -> tuple[DraftTree, int]:
    """Append each continuation of `grafts` (`(anchor node, tokens)`, anchor `-1` = the root) below its
    anchor, sharing nodes with an existing child of the same token, until the tree has `max_nodes` nodes.

    The original nodes keep their indices and order; new nodes come after them, so sampled siblings keep
    their proposal order and `draft_probs` rows (new nodes get all-zero rows: deterministic proposals).

    Example: chain [a, b] (nodes 0, 1), grafts [(0, [b, c]), (-1, [d])] -> tokens [a, b, c, d],
    parents [-1, 0, 1, -1]: `b` is shared, `c` hangs below it, `d` below the root.

    Returns the new tree and the number of nodes added.
    """
    trie = TokenTrie.from_nodes(tree.tokens.tolist(), tree.parents.tolist(), max_nodes)
    for anchor, cont in grafts:
        trie.insert(cont, parent=anchor)
    added = len(trie) - len(tree)
    if not added:
        return tree, 0
    probs = tree.draft_probs
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros(added, probs.shape[1])])
    return DraftTree.from_lists(trie.tokens, trie.parents, probs), added


def fused_path(mapping: list[int], fused_accepted: list[int]) -> list[int]:
    """The accepted fused path, as node indices of one source tree (`mapping` from `fuse_trees`), up to where it
    leaves that tree."""
    back = {f: i for i, f in enumerate(mapping)}
    out: list[int] = []
    for f in fused_accepted:
        if f not in back:
            break
        out.append(back[f])
    return out


def matched_depth(tree: DraftTree, tokens: list[int]) -> int:
    """How many of `tokens` a root-to-node path of `tree` spells from the start: what greedy verification would
    accept of `tree` when the target's choices are `tokens`."""
    children, tree_tokens = tree.children, tree.tokens.tolist()
    node, depth = -1, 0
    for tok in tokens:
        node = next((c for c in children[node + 1] if tree_tokens[c] == tok), None)
        if node is None:
            break
        depth += 1
    return depth
