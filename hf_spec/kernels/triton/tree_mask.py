"""The tree attention mask and position ids of a verification, built on the device from the parent array.

For `[root] + tree` after `past` cached tokens (as `hf_spec.tree.masks.tree_attention_mask` and
`tree_position_ids` build them on the host): query row i (0 = the root, i = node i - 1) sees every cached key, the
root and its own ancestors and itself; it sits at position `past + depth`. One program a row walks up the parent
array, so only `parents` (num_nodes integers) crosses to the device instead of the mask.

Example (parents [-1, 0, -1], past 2; 0 = visible, m = masked)::

    root: 0 0 | 0 m m m      position 2
    a:    0 0 | 0 0 m m      position 3
    b:    0 0 | 0 0 0 m      position 4
    c:    0 0 | 0 m m 0      position 3

The launch runs as the custom operator `torch.ops.hf_spec.tree_inputs` (`hf_spec.kernels.triton.op`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_spec.kernels.triton.op import kernel_op, wrap_triton
from hf_spec.tree import DraftTree
from hf_spec.tree.masks import tree_attention_mask, tree_position_ids

BLOCK = 1024  # cached-key columns a program writes at once


@triton.jit
def _tree_mask(
    parents_ptr,
    num_nodes,
    past,
    mask_ptr,
    positions_ptr,
    min_value,
    BLOCK: tl.constexpr,
    NODES_BLOCK: tl.constexpr,
):
    """Program i: row i of the mask `(num_nodes + 1, past + num_nodes + 1)` and position i."""
    i = tl.program_id(0)
    width = past + num_nodes + 1
    row_ptr = mask_ptr + tl.cast(i, tl.int64) * width
    offs = tl.arange(0, BLOCK)
    for start in range(0, past, BLOCK):
        cols = start + offs
        tl.store(
            row_ptr + cols, tl.zeros([BLOCK], tl.float32).to(mask_ptr.dtype.element_ty), mask=cols < past
        )
    slots = tl.arange(0, NODES_BLOCK)
    seen = (slots == 0) | (slots == i)  # the root, and the query itself
    node = i - 1
    depth = 0
    while node >= 0:
        node = tl.load(parents_ptr + node).to(tl.int32)
        seen = seen | (slots == node + 1)
        depth += 1
    values = tl.where(seen, 0.0, min_value).to(mask_ptr.dtype.element_ty)
    tl.store(row_ptr + past + slots, values, mask=slots < num_nodes + 1)
    tl.store(positions_ptr + i, tl.cast(past + depth, tl.int64))


def tree_inputs(parents: torch.Tensor, past: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids and additive mask of `[root] + tree` after `past` cached tokens, on `parents`' device.

    Args:
        parents: `torch.LongTensor` of shape `(num_nodes,)`, as `DraftTree.parents`.

    Returns:
        `position_ids` `torch.LongTensor` of shape `(1, num_nodes + 1)` and the mask, `dtype` of shape
        `(1, 1, num_nodes + 1, past + num_nodes + 1)`: 0 where visible, `torch.finfo(dtype).min` elsewhere.
    """
    return _tree_inputs(parents, past, dtype)


def _inputs_like(parents: torch.Tensor, past: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty `(position_ids (1, n + 1), mask (1, 1, n + 1, past + n + 1))` (the fake)."""
    n = parents.shape[0]
    positions = parents.new_empty((1, n + 1), dtype=torch.long)
    return positions, parents.new_empty((1, 1, n + 1, past + n + 1), dtype=dtype)


@kernel_op("tree_inputs", (_tree_mask,), _inputs_like)
def _tree_inputs(parents: torch.Tensor, past: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    num_nodes = parents.shape[0]
    positions, mask = _inputs_like(parents, past, dtype)
    if num_nodes == 0:
        parents = torch.zeros(1, dtype=torch.long, device=parents.device)
    wrap_triton(_tree_mask)[(num_nodes + 1,)](
        parents,
        num_nodes,
        past,
        mask,
        positions,
        torch.finfo(dtype).min,
        BLOCK=BLOCK,
        NODES_BLOCK=triton.next_power_of_2(num_nodes + 1),
    )
    return positions, mask


def tree_inputs_reference(
    parents: torch.Tensor, past: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch twin of `tree_inputs`: `tree_position_ids` and `tree_attention_mask`, built on the host."""
    tree = DraftTree(torch.zeros(parents.shape[0], dtype=torch.long), parents.cpu())
    positions = tree_position_ids(tree, past, parents.device)
    return positions, tree_attention_mask(tree, past, dtype, parents.device)
