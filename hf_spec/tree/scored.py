"""`ScoredTree`: a draft tree while a head drafter grows it, with a joint log-probability per node.

Head drafters (EAGLE, Lyanna) grow a tree level by level in plain lists, score every node by the cumulative
log-probability of its path, keep the best nodes (`prune_scored`) and may merge two trees (`fuse_scored`).
`ScoredTree.to_draft_tree()` is the one conversion to the `DraftTree` the loop verifies; the scores stay behind
(the proposals are deterministic: point masses).

Example (a -> b, and c; scores are joint log-probabilities)::

    ScoredTree(tokens=[a, b, c], parents=[-1, 0, -1], joint=[-0.1, -0.4, -1.2], depths=[1, 2, 1])
    prune_scored(tree, 2) -> tokens [a, b], parents [-1, 0]
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.trie import TokenTrie, node_depths


@dataclass
class ScoredTree:
    """A tree below an implicit root, as parallel lists; parents index earlier nodes (`-1` = the root)."""

    tokens: list[int]  # [num_nodes]
    parents: list[int]  # [num_nodes]
    joint: list[float]  # [num_nodes] cumulative log-probability from the root
    depths: list[int]  # [num_nodes] 1 for the root's children

    def __len__(self) -> int:
        return len(self.tokens)

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's token path from the root."""
        out: list[tuple[int, ...]] = []
        for i, parent in enumerate(self.parents):
            out.append((out[parent] if parent >= 0 else ()) + (self.tokens[i],))
        return out

    def reordered(self, order: list[int]) -> ScoredTree:
        """The nodes `order` (each one's parent among them and earlier), renumbered in that order."""
        index = {old: new for new, old in enumerate(order)}
        return ScoredTree(
            [self.tokens[i] for i in order],
            [index[self.parents[i]] if self.parents[i] >= 0 else -1 for i in order],
            [self.joint[i] for i in order],
            [self.depths[i] for i in order],
        )

    def to_draft_tree(self) -> DraftTree:
        """The verification form: tokens and parents, no draft probabilities."""
        return DraftTree.from_lists(self.tokens, self.parents)


def prune_scored(tree: ScoredTree, budget: int) -> ScoredTree:
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
    return tree.reordered(sorted(keep, key=lambda i: (tree.depths[i], -tree.joint[i])))


def fuse_scored(a: ScoredTree, b: ScoredTree) -> ScoredTree:
    """Verification fusion: one tree holding every path of `a` and `b` (a shared path once, with the higher joint
    probability), ordered by depth then joint probability."""
    trie = TokenTrie()
    best: list[float] = []  # [fused nodes]
    for tree in (a, b):
        node_of: list[int] = []  # this tree's node -> fused node
        for token, parent, joint in zip(tree.tokens, tree.parents, tree.joint, strict=True):
            node = trie.add(node_of[parent] if parent >= 0 else -1, token)
            if node == len(best):
                best.append(joint)
            else:
                best[node] = max(joint, best[node])
            node_of.append(node)
    depths = node_depths(trie.parents)
    fused = ScoredTree(trie.tokens, trie.parents, best, depths)
    return fused.reordered(sorted(range(len(fused)), key=lambda i: (depths[i], -best[i])))
