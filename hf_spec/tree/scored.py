"""Draft trees with a joint (cumulative) log-probability per node, pruned to a verification budget and merged
(pure functions shared by the head drafters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_spec.tree.buffers import DraftTree


@dataclass
class ScoredTree:
    """A tree below an implicit root: parallel lists; parents index earlier nodes (-1 = root)."""

    tokens: list[int]
    parents: list[int]
    joint: list[float]  # cumulative log-probability from the root
    depths: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = []
        for i, parent in enumerate(self.parents):
            out.append((out[parent] if parent >= 0 else ()) + (self.tokens[i],))
        return out


def prune(tree: ScoredTree, budget: int) -> ScoredTree:
    """Keep the `budget` nodes of highest joint probability (ancestors always kept, shallower first on ties),
    ordered by depth then joint probability."""
    order = sorted(range(len(tree)), key=lambda i: (-tree.joint[i], tree.depths[i]))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        node = i
        while node >= 0 and node not in keep:
            keep.add(node)
            node = tree.parents[node]
    kept = sorted(keep, key=lambda i: (tree.depths[i], -tree.joint[i]))
    index = {old: new for new, old in enumerate(kept)}
    return ScoredTree(
        [tree.tokens[i] for i in kept],
        [index[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in kept],
        [tree.joint[i] for i in kept],
        [tree.depths[i] for i in kept],
    )


def fuse(a: ScoredTree, b: ScoredTree) -> ScoredTree:
    """Verification fusion: one tree holding every path of `a` and `b` (shared prefixes once, the higher joint
    probability kept), ordered by depth then joint probability."""
    best: dict[tuple[int, ...], float] = {}
    for tree in (a, b):
        for path, joint in zip(tree.paths(), tree.joint, strict=True):
            best[path] = max(joint, best.get(path, -float("inf")))
    paths = sorted(best, key=lambda p: (len(p), -best[p]))
    index = {path: i for i, path in enumerate(paths)}
    return ScoredTree(
        [p[-1] for p in paths],
        [index[p[:-1]] if len(p) > 1 else -1 for p in paths],
        [best[p] for p in paths],
        [len(p) for p in paths],
    )


def to_draft_tree(tree: ScoredTree) -> DraftTree:
    return DraftTree(
        torch.tensor(tree.tokens, dtype=torch.long), torch.tensor(tree.parents, dtype=torch.long)
    )
