"""Pure tensor and list code for draft trees (no model calls).

- `draft_tree`: `DraftTree`, the type drafters propose and the loop verifies.
- `trie`: `TokenTrie`, the one builder of trees from token paths (shared prefixes become one node).
- `masks`: the attention masks and position ids for feeding new tokens after a KV cache.
- `scored`: `ScoredTree`, a tree with a joint log-probability per node while a head drafter grows it
  (`ScoredTree.to_draft_tree()` is its one conversion).
- `retrieval`: frequency tries pruned to a node budget (REST / Talon retrieval trees).
- `fusion`: merging draft trees and grafting phrases onto them; mapping accepted paths back.
"""

from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import causal_mask, tree_attention_mask, tree_position_ids
from hf_spec.tree.scored import ScoredTree
from hf_spec.tree.trie import TokenTrie

__all__ = ["DraftTree", "ScoredTree", "TokenTrie", "causal_mask", "tree_attention_mask", "tree_position_ids"]
