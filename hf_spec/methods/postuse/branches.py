"""Pure helpers: grafting cached phrases onto a draft tree, and cutting verified phrases out of a round."""

from __future__ import annotations

import torch

from hf_spec.tree.buffers import DraftTree


def graft(tree: DraftTree, grafts: list[tuple[int, list[int]]], max_nodes: int) -> tuple[DraftTree, int]:
    """Append each continuation of `grafts` (`(anchor node, tokens)`, anchor `-1` = the root) below its
    anchor, sharing nodes with an existing child of the same token, until the tree has `max_nodes` nodes.

    The original nodes keep their indices and order; new nodes come after them, so sampled siblings keep
    their proposal order and `draft_probs` rows (new nodes get all-zero rows: deterministic proposals).

    Example: chain [a, b] (nodes 0, 1), grafts [(0, [b, c]), (-1, [d])] -> tokens [a, b, c, d],
    parents [-1, 0, 1, -1]: `b` is shared, `c` hangs below it, `d` below the root.

    Returns the new tree and the number of nodes added.
    """
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    child: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, tokens, strict=True)):
        child.setdefault((p, t), i)
    start = len(tokens)
    for anchor, cont in grafts:
        node = anchor
        for tok in cont:
            tok = int(tok)
            nxt = child.get((node, tok))
            if nxt is None:
                if len(tokens) >= max_nodes:
                    break
                nxt = len(tokens)
                child[(node, tok)] = nxt
                tokens.append(tok)
                parents.append(node)
            node = nxt
    added = len(tokens) - start
    if not added:
        return tree, 0
    probs = tree.draft_probs
    if probs is not None:
        probs = torch.cat([probs, probs.new_zeros(added, probs.shape[1])])
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), probs), added


def agreeing_runs(tokens: list[int], agree: list[bool]) -> list[list[int]]:
    """Phrases of useful tokens (paper Eq. 7) along a drafted chain: each maximal run of positions the target
    agrees with, behind its anchor (the token before the run; `tokens[0]` is the root, never judged).

    Example: tokens [r, a, b, c, d, e], agree [T, F, T, T, F] (for a..e) -> [[r, a], [b, c, d]].
    """
    runs: list[list[int]] = []
    i = 0
    while i < len(agree):
        if not agree[i]:
            i += 1
            continue
        j = i
        while j < len(agree) and agree[j]:
            j += 1
        runs.append(tokens[i : j + 1])  # anchor tokens[i] = the token before position i + 1
        i = j
    return runs


def windows(phrase: list[int], length: int) -> list[list[int]]:
    """Every phrase of up to `length` tokens starting inside `phrase` (at least 2 tokens each)."""
    return [phrase[s : s + length] for s in range(len(phrase) - 1)]
