"""Fusing draft trees by longest-prefix matching: a node whose path from the root already exists in the fused
tree is merged into it, so shared prefixes are verified once.

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

from hf_spec.tree.buffers import DraftTree


def fuse_trees(first: DraftTree, second: DraftTree) -> tuple[DraftTree, list[int], list[int]]:
    """Merge `second` into `first` (trie union). Siblings keep `first`'s order, then `second`'s new ones.

    Returns:
        the fused tree and, for each node of `first` / `second`, its index in the fused tree.
    """
    tokens: list[int] = []
    parents: list[int] = []
    origin: list[tuple[int, int]] = []  # (tree 0/1, node) that created each fused node
    child_of: dict[tuple[int, int], int] = {}
    maps: list[list[int]] = []
    for t, tree in enumerate((first, second)):
        mapping: list[int] = []
        for i, (tok, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
            parent = mapping[p] if p >= 0 else -1
            key = (parent, tok)
            node = child_of.get(key)
            if node is None:
                node = len(tokens)
                child_of[key] = node
                tokens.append(tok)
                parents.append(parent)
                origin.append((t, i))
            mapping.append(node)
        maps.append(mapping)
    probs = _fused_probs(first, second, tokens, parents, origin)
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), probs
    ), *maps


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
