"""The one token-trie builder: token paths merged so that a shared prefix is one node.

Every tree made by merging token paths is built here: PLD's continuations (`DraftTree.from_sequences`),
retrieval tries (`tree.retrieval`), the union of two draft trees and cached phrases grafted onto a tree
(`tree.fusion`), the union of two scored trees (`tree.scored`). A node is keyed by `(parent, token)`, so walking
a path reuses the nodes that spell it and creates only the missing tail. Nodes are plain lists in creation
order: a parent always comes before its children (`-1` is the root).

Example (insert "a b c", then "a d", then "e")::

    tokens  = [a, b, c, d, e]
    parents = [-1, 0, 1, 0, -1]
"""

from __future__ import annotations

from collections.abc import Iterable


class TokenTrie:
    """A growing token trie.

    Args:
        max_nodes: the most nodes it may hold (`None`: no limit); a path that needs a new node beyond it stops
            there, so every node's parent is in the trie.
    """

    def __init__(self, max_nodes: int | None = None) -> None:
        self.max_nodes = max_nodes
        self.tokens: list[int] = []  # [num_nodes]
        self.parents: list[int] = []  # [num_nodes], -1 = the root
        self._child: dict[tuple[int, int], int] = {}  # (parent, token) -> node

    @classmethod
    def from_nodes(cls, tokens: list[int], parents: list[int], max_nodes: int | None = None) -> TokenTrie:
        """A trie that starts with existing nodes kept as they are (indices and order); where two siblings
        spell the same token, new paths walk through the first."""
        trie = cls(max_nodes)
        trie.tokens, trie.parents = list(tokens), list(parents)
        for node, key in enumerate(zip(trie.parents, trie.tokens, strict=True)):
            trie._child.setdefault(key, node)
        return trie

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int | None:
        """The child of `parent` (`-1`: the root) that spells `token`, created when missing; `None` when it is
        missing and the trie is full."""
        key = (parent, token)
        node = self._child.get(key)
        if node is None:
            if self.max_nodes is not None and len(self.tokens) >= self.max_nodes:
                return None
            node = len(self.tokens)
            self._child[key] = node
            self.tokens.append(token)
            self.parents.append(parent)
        return node

    def insert(self, tokens: Iterable[int], parent: int = -1) -> list[int]:
        """Walk the path spelling `tokens` below `parent`, creating the nodes it lacks; stops where the trie is
        full. Returns the nodes of the path, in order."""
        path: list[int] = []
        for tok in tokens:
            node = self.add(parent, int(tok))
            if node is None:
                break
            path.append(node)
            parent = node
        return path


def node_depths(parents: list[int]) -> list[int]:
    """Each node's depth, 1 for the root's children, from parent indices that come before their children.

    Example: parents `[-1, 0, 1, 0, -1]` -> `[1, 2, 3, 2, 1]`.
    """
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth
