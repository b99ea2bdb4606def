"""`DraftTree`: the one type every drafter proposes and the loop verifies.

A draft tree hangs below the *root*: the last committed token, which is not yet in the target's
KV cache. Node `i` holds token `tokens[i]` and points at `parents[i]` (`-1` for the root); parents
always come before their children (`parents[i] < i`). Siblings are listed in the order they were
proposed, which is the order stochastic verification examines them.

The verification input is `[root] + tokens`: row 0 of the target's logits predicts the root's
children, row `i + 1` predicts node `i`'s children (masks and positions: `hf_spec.tree.masks`).

Example (root r, two branches "a b" and "c")::

    tokens  = [a, b, c]
    parents = [-1, 0, -1]
    depth   = [1, 2, 1]            # root has depth 0
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hf_spec.tree.trie import TokenTrie, node_depths


@dataclass
class DraftTree:
    """A proposal to verify.

    Args:
        tokens: `torch.LongTensor` of shape `(num_nodes,)`, the draft tokens.
        parents: `torch.LongTensor` of shape `(num_nodes,)`, index of each node's parent, `-1` = root.
        draft_probs: optional `torch.FloatTensor` of shape `(num_nodes, vocab_size)`: row `i` is the exact
            distribution node `i`'s token was sampled from, given its earlier siblings. An all-zero row
            (or `None` for the whole tree) marks a deterministic proposal (a point mass).
    """

    tokens: torch.Tensor  # [num_nodes]
    parents: torch.Tensor  # [num_nodes]
    draft_probs: torch.Tensor | None = None  # [num_nodes, vocab_size]
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).reshape(-1)
        if self.tokens.shape != self.parents.shape:
            raise ValueError(
                f"tokens {tuple(self.tokens.shape)} and parents {tuple(self.parents.shape)} differ"
            )
        idx = torch.arange(len(self.parents))
        if bool((self.parents >= idx).any()) or bool((self.parents < -1).any()):
            raise ValueError("every parent must come before its child (parents[i] < i, -1 for the root)")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError("draft_probs needs one row per node")

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))

    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None) -> DraftTree:
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        return cls(tokens, torch.arange(len(tokens)) - 1, draft_probs)

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], max_nodes: int | None = None) -> DraftTree:
        """Merge token sequences into a trie (shared prefixes become one node), in the order given.

        Sequences earlier in the list win when `max_nodes` cuts the tree; every kept node's parent is kept.
        """
        trie = TokenTrie(max_nodes)
        for seq in sequences:
            trie.insert(seq)
        return cls.from_lists(trie.tokens, trie.parents)

    @classmethod
    def from_lists(
        cls, tokens: list[int], parents: list[int], draft_probs: torch.Tensor | None = None
    ) -> DraftTree:
        """A tree from plain lists of tokens and parent indices."""
        return cls(
            torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), draft_probs
        )

    @classmethod
    def chain_with_siblings(cls, chain: list[int], siblings: list[list[int]] | None = None) -> DraftTree:
        """A chain plus extra leaves: `siblings[d]` are alternatives to `chain[d]` (same parent), verified for
        free in the same forward; an alternative equal to `chain[d]` is skipped. Deterministic proposals.

        Example: chain [a, b], siblings [[x], [b, y]] -> tokens [a, x, b, y], parents [-1, -1, 0, 0].
        """
        tokens: list[int] = []
        parents: list[int] = []
        prev = -1
        for d, tok in enumerate(chain):
            main = len(tokens)
            tokens.append(tok)
            parents.append(prev)
            for alt in siblings[d] if siblings and d < len(siblings) else []:
                if alt != tok:
                    tokens.append(alt)
                    parents.append(prev)
            prev = main
        return cls.from_lists(tokens, parents)

    @classmethod
    def chain_with_branches(cls, tokens: list[int], branches: list[list[int]]) -> DraftTree:
        """The tree below `tokens[0]`: `tokens[1:]` a chain, every branch a path hanging from the last of
        `tokens` (each branch on its own, never merged with another).

        Example: tokens = [r, a], branches = [[x, y], [z]] -> nodes [a, x, y, z], parents [-1, 0, 1, 0].
        """
        nodes = list(tokens[1:])
        parents = list(range(-1, len(nodes) - 1))
        last = len(nodes) - 1
        for branch in branches:
            prev = last
            for tok in branch:
                nodes.append(int(tok))
                parents.append(prev)
                prev = len(nodes) - 1
        return cls.from_lists(nodes, parents)

    # ---- derived structure (cached) -------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_chain(self) -> bool:
        if "is_chain" not in self._cache:
            self._cache["is_chain"] = bool(torch.equal(self.parents, torch.arange(len(self)) - 1))
        return self._cache["is_chain"]

    @property
    def depth(self) -> torch.Tensor:
        """`torch.LongTensor` of shape `(num_nodes,)`: 1 for the root's children."""
        if "depth" not in self._cache:
            self._cache["depth"] = torch.tensor(node_depths(self.parents.tolist()), dtype=torch.long)
        return self._cache["depth"]

    @property
    def children(self) -> list[list[int]]:
        """`children[p + 1]` lists the children of node `p` (`children[0]`: the root's), in proposal order."""
        if "children" not in self._cache:
            kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
            for i, p in enumerate(self.parents.tolist()):
                kids[p + 1].append(i)
            self._cache["children"] = kids
        return self._cache["children"]

    def ancestor_matrix(self) -> np.ndarray:
        """`bool` array of shape `(num_nodes + 1, num_nodes + 1)` over `[root] + nodes`: `[i, j]` is True when
        position `j` is `i` or one of its ancestors (the root is everyone's ancestor)."""
        if "anc" not in self._cache:
            n = len(self)
            anc = np.zeros((n + 1, n + 1), dtype=bool)
            anc[:, 0] = True
            for i, p in enumerate(self.parents.tolist()):
                anc[i + 1] = anc[p + 1]
                anc[i + 1, i + 1] = True
            self._cache["anc"] = anc
        return self._cache["anc"]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for the root, `node = -1`)."""
        path = []
        parents = self.parents.tolist()
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    # ---- edits ---------------------------------------------------------------------------------
    def select(self, keep: torch.Tensor) -> DraftTree:
        """The sub-tree of the nodes where `keep` (bool, `(num_nodes,)`) is True; a dropped node drops its subtree."""
        keep = keep.clone()
        parents = self.parents.tolist()
        for i, p in enumerate(parents):  # parents come first, so one pass propagates drops
            if p >= 0 and not keep[p]:
                keep[i] = False
        kept = torch.nonzero(keep).flatten()
        remap = torch.full((len(self) + 1,), -1, dtype=torch.long)
        remap[kept + 1] = torch.arange(len(kept))
        new_parents = remap[self.parents[kept] + 1]
        probs = self.draft_probs[kept] if self.draft_probs is not None else None
        return DraftTree(self.tokens[kept], new_parents, probs)

    def truncate_nodes(self, max_nodes: int) -> DraftTree:
        """The first `max_nodes` nodes (parents come first, so they form a tree)."""
        if len(self) <= max_nodes:
            return self
        keep = torch.zeros(len(self), dtype=torch.bool)
        keep[: max(max_nodes, 0)] = True
        return self.select(keep)

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than `max_depth`."""
        if len(self) == 0 or int(self.depth.max()) <= max_depth:
            return self
        return self.select(self.depth <= max_depth)
