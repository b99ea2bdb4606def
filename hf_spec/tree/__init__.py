"""Pure tensor code for draft trees."""

from hf_spec.tree.buffers import DraftTree, tree_attention_mask, tree_position_ids

__all__ = ["DraftTree", "tree_attention_mask", "tree_position_ids"]
