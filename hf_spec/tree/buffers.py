"""Token trees and the tensors needed to verify them in one forward pass.

A draft tree hangs below the *root*: the last committed token, which is not yet in the target's
KV cache. Node `i` holds token `tokens[i]` and points at `parents[i]` (`-1` for the root); parents
always come before their children (`parents[i] < i`). Siblings are listed in the order they were
proposed, which is the order stochastic verification examines them.

The verification input is `[root] + tokens`: row 0 of the target's logits predicts the root's
children, row `i + 1` predicts node `i`'s children.

Example (root r, two branches "a b" and "c")::

    tokens  = [a, b, c]
    parents = [-1, 0, -1]
    depth   = [1, 2, 1]            # root has depth 0
    visible (row = query, col = key, both over [r, a, b, c]):
        r: r
        a: r a
        b: r a b
        c: r       c
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


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
        tokens: list[int] = []
        parents: list[int] = []
        child_of: dict[tuple[int, int], int] = {}
        for seq in sequences:
            parent = -1
            for tok in seq:
                key = (parent, int(tok))
                node = child_of.get(key)
                if node is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    node = len(tokens)
                    child_of[key] = node
                    tokens.append(int(tok))
                    parents.append(parent)
                parent = node
        return cls(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

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
            parents = self.parents.tolist()
            depth: list[int] = []
            for p in parents:
                depth.append(1 if p < 0 else depth[p] + 1)
            self._cache["depth"] = torch.tensor(depth, dtype=torch.long)
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

    def truncate_depth(self, max_depth: int) -> DraftTree:
        """Drop nodes deeper than `max_depth`."""
        if len(self) == 0 or int(self.depth.max()) <= max_depth:
            return self
        return self.select(self.depth <= max_depth)


def tree_attention_mask(
    tree: DraftTree, past_length: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive 4D mask for verifying `[root] + tree.tokens` after `past_length` cached tokens.

    Returns:
        `torch.FloatTensor` of shape `(1, 1, num_nodes + 1, past_length + num_nodes + 1)`: 0 where a query may
        attend, the dtype's minimum elsewhere. Every query sees the whole committed past.
    """
    n = len(tree) + 1
    visible = torch.from_numpy(tree.ancestor_matrix())
    mask = torch.zeros((n, past_length + n), dtype=dtype)
    mask[:, past_length:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.view(1, 1, n, past_length + n).to(device)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean `(q_len, kv_len)` "may attend" -> additive 4D `(1, 1, q_len, kv_len)`: 0 or the dtype's minimum."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def tree_position_ids(tree: DraftTree, past_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.LongTensor` of shape `(1, num_nodes + 1)`: the root sits at `past_length`, a node at `past_length +
    depth`."""
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    return (depth + past_length).view(1, -1).to(device)


def causal_mask(
    q_len: int, past_length: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive causal 4D mask `(1, 1, q_len, past_length + q_len)` for `q_len` new tokens after `past_length`
    cached ones (a chain is a tree: its root plus `q_len - 1` nodes)."""
    return tree_attention_mask(DraftTree.chain(range(q_len - 1)), past_length, dtype, device)
