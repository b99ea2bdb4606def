"""Small helpers shared by chain drafters."""

from __future__ import annotations

import torch

from hf_spec.tree.buffers import DraftTree


def chain_with_siblings(chain: list[int], siblings: list[list[int]] | None = None) -> DraftTree:
    """A chain plus extra leaves: `siblings[d]` are alternatives to `chain[d]` (same parent), verified for free
    in the same forward. Deterministic proposals (no `draft_probs`)."""
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
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
