"""Attention masks and position ids for feeding new tokens after a KV cache: the one place they are built.

Every mask here is *additive*: 0 where a query may attend to a key, the dtype's minimum elsewhere, of shape
`(batch, 1, q_len, kv_len)` as transformers' eager and SDPA attention take it. Keys are the `past` cached
positions followed by the `q_len` new ones. Each builder makes a boolean "may attend" matrix and hands it to
`additive_mask`.

- `causal_mask`: a chain of new tokens.
- `tree_attention_mask` / `tree_position_ids`: `[root] + tree` of a `DraftTree` (verification, step-wise
  drafting); `step_inputs` bundles the ids, positions and mask of a step-wise drafting forward.
- `level_mask`: one level of a tree grown by a feature head, fed in one forward.
- `block_mask`: every row's `[root] + tree` padded to one width, over a cache shared by the rows.
- `prefill_mask`: the causal mask of left-padded prompts.
"""

from __future__ import annotations

import torch

from hf_spec.tree.draft_tree import DraftTree


def additive_mask(
    allowed: torch.Tensor, dtype: torch.dtype = torch.float32, hidden: float | None = None
) -> torch.Tensor:
    """Boolean "may attend" -> additive mask with a head axis.

    Args:
        allowed: `torch.BoolTensor` of shape `(q_len, kv_len)` or `(batch, q_len, kv_len)`.
        hidden: the value of a hidden slot (None: the dtype's lowest value, transformers' convention; -inf where
            every row sees some slot, which hf-spec's CPU attention skips).

    Returns:
        `torch.FloatTensor` of shape `(1, 1, q_len, kv_len)` or `(batch, 1, q_len, kv_len)` on `allowed`'s device:
        0 where allowed, `hidden` (default `torch.finfo(dtype).min`) elsewhere.

    Example: `[[True, False]]` -> `[[[[0, min]]]]`.
    """
    fill = torch.finfo(dtype).min if hidden is None else hidden
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, fill)
    return mask[None, None] if allowed.dim() == 2 else mask[:, None]


def causal_mask(
    q_len: int, past: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive `(1, 1, q_len, past + q_len)`: each of `q_len` new tokens sees the `past` cached ones and the new
    ones up to itself.

    Example (`q_len = 2`, `past = 1`; 0 = visible, m = masked)::

        [[0, 0, m],
         [0, 0, 0]]
    """
    allowed = torch.ones(q_len, past + q_len, dtype=torch.bool).tril(diagonal=past)
    return additive_mask(allowed, dtype).to(device)


def tree_attention_mask(
    tree: DraftTree, past_length: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Additive 4D mask for `[root] + tree.tokens` after `past_length` cached tokens: every query sees the whole
    committed past, the root and its own ancestors.

    Returns:
        `torch.FloatTensor` of shape `(1, 1, num_nodes + 1, past_length + num_nodes + 1)`.

    Example (tokens `[a, b, c]`, parents `[-1, 0, -1]`; rows and columns over `[r, a, b, c]` after the past)::

        r: r
        a: r a
        b: r a b
        c: r     c
    """
    n = len(tree) + 1
    allowed = torch.ones(n, past_length + n, dtype=torch.bool)
    allowed[:, past_length:] = torch.from_numpy(tree.ancestor_matrix())
    return additive_mask(allowed, dtype).to(device)


def tree_position_ids(tree: DraftTree, past_length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.LongTensor` of shape `(1, num_nodes + 1)`: the root sits at `past_length`, a node at
    `past_length + depth`.

    Example (parents `[-1, 0, -1]`, `past_length = 5`): `[[5, 6, 7, 6]]`.
    """
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
    return (depth + past_length).view(1, -1).to(device)


def step_inputs(
    tokens: list[int], branches: list[list[int]], past: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Inputs for feeding `tokens` (a chain) and, behind its last token, `branches` after `past` cached positions
    (`DraftTree.chain_with_branches` below `tokens[0]`).

    Returns:
        `input_ids` and `position_ids`, `torch.LongTensor` of shape `(1, q)`, and the additive mask of shape
        `(1, 1, q, past + q)` (`None` for a single token), `q = len(tokens) + sum(len(b) for b in branches)`.

    Example: tokens `[r, a]`, branches `[[x, y], [z]]`, past 5 -> ids `[[r, a, x, y, z]]`, positions
    `[[5, 6, 7, 8, 7]]`.
    """
    flat = list(tokens) + [int(t) for b in branches for t in b]
    ids = torch.tensor([flat], dtype=torch.long, device=device)
    if len(flat) == 1:
        return ids, torch.tensor([[past]], device=device), None
    tree = DraftTree.chain_with_branches(list(tokens), branches)
    return ids, tree_position_ids(tree, past, device), tree_attention_mask(tree, past, dtype, device)


def level_mask(
    past: int, prefix: int, ancestor_slots: list[list[int]], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive mask for one level of a tree fed in one forward: `n = len(ancestor_slots)` nodes of the same depth,
    appended after `past` cache slots. Node `r` sees the first `prefix` slots (committed and chain positions),
    the slots of its own ancestors (`ancestor_slots[r]`) and itself (slot `past + r`).

    Returns:
        `torch.FloatTensor` of shape `(1, 1, n, past + n)`.

    Example (`past = 4`, `prefix = 2`, `ancestor_slots = [[2], [3]]`)::

        [[0, 0, 0, m, 0, m],
         [0, 0, m, 0, m, 0]]
    """
    n = len(ancestor_slots)
    allowed = torch.zeros(n, past + n, dtype=torch.bool)
    allowed[:, :prefix] = True
    for r, slots in enumerate(ancestor_slots):
        allowed[r, slots] = True
        allowed[r, past + r] = True
    return additive_mask(allowed, dtype)


def block_mask(
    valid: torch.Tensor, trees: list[DraftTree], width: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive mask for verifying every row's `[root] + tree` in one forward over a cache the rows share.

    Args:
        valid: `torch.BoolTensor` of shape `(rows, cache_len)`: which cache slots hold row r's committed tokens.
        trees: one tree per row; row r's queries are `[root] + trees[r]`, padded with fillers to `width`.
        width: the query block's length (at least the largest tree + 1).

    Returns:
        `torch.FloatTensor` of shape `(rows, 1, width, cache_len + width)`: row r's tree queries see its valid
        cache slots and their own tree ancestors; a filler query sees only itself (no query row is fully masked).

    Example (one row, `valid = [[True, False]]`, a one-node tree, `width = 3`; columns: 2 cache slots, 3 queries)::

        root:   [0, m, 0, m, m]
        node:   [0, m, 0, 0, m]
        filler: [m, m, m, m, 0]
    """
    rows, past = valid.shape
    allowed = torch.zeros(rows, width, past + width, dtype=torch.bool)
    allowed[:, :, :past] = valid[:, None, :]
    allowed[:, :, past:] = torch.eye(width, dtype=torch.bool)  # fillers (and every query) see themselves
    for r, tree in enumerate(trees):
        n = len(tree) + 1
        allowed[r, :n, past : past + n] = torch.from_numpy(tree.ancestor_matrix())
        allowed[r, n:, :past] = False
    return additive_mask(allowed, dtype)


def prefill_mask(valid: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive causal mask over left-padded prompts.

    Args:
        valid: `torch.BoolTensor` of shape `(rows, n)`: False at padding.

    Returns:
        `torch.FloatTensor` of shape `(rows, 1, n, n)`: a token sees the real tokens up to itself; a padding query
        sees only itself (its output is never used, and no query row may be fully masked).

    Example (`valid = [[False, True, True]]`)::

        [[0, m, m],
         [m, 0, m],
         [m, 0, 0]]
    """
    n = valid.shape[1]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None] & valid[:, None, :]
    allowed |= torch.eye(n, dtype=torch.bool)[None]
    return additive_mask(allowed, dtype)


def padded_tree_mask(
    tree: DraftTree,
    past_length: int,
    width: int,
    kv_len: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """`tree_attention_mask` of `[root] + tree` padded to `width` query rows and `kv_len` key slots (a static
    cache's length), for a forward of fixed shape: filler rows after the tree see only their own slot, and no query
    sees a slot from `past_length + width` on.

    Returns:
        `torch.FloatTensor` of shape `(1, 1, width, kv_len)`: 0 where a query may attend, -inf elsewhere.

    Example (tokens `[a, b]`, parents `[-1, 0]`, past 2, width 4, kv_len 8; `x` a slot seen)::

        r: x x r . . . . .
        a: x x r a . . . .
        b: x x r a b . . .
        -: . . . . . - . .
    """
    n = len(tree) + 1
    if n > width or past_length + width > kv_len:
        raise ValueError(
            f"{n} tree rows after {past_length} slots do not fit width {width} and {kv_len} slots"
        )
    allowed = torch.zeros(width, kv_len, dtype=torch.bool)
    allowed[:n, :past_length] = True
    allowed[:n, past_length : past_length + n] = torch.from_numpy(tree.ancestor_matrix())
    fillers = torch.arange(n, width)
    allowed[fillers, past_length + fillers] = True
    # -inf, not the dtype's lowest value: every row sees at least its own slot, and hf-spec's CPU attention skips
    # -inf keys (they add exact zeros) where it computes a lowest-value key's zero weight: over a static cache's
    # unfilled slots that is most of the work
    return additive_mask(allowed, dtype, hidden=float("-inf")).to(device)


def padded_block_mask(mask: torch.Tensor, past_length: int, width: int, kv_len: int) -> torch.Tensor:
    """An additive block mask over the `past_length` cached slots and the block's own, padded to `width` query rows
    and `kv_len` key slots (a static cache's length), for a forward of fixed shape: the block's rows keep what
    they saw, filler rows see only their own slot, and no query sees a slot from `past_length + rows` on.

    Args:
        mask: `torch.FloatTensor` of shape `(1, 1, rows, past_length + rows)` (`causal_mask`, `level_mask`, ...).

    Returns:
        `torch.FloatTensor` of shape `(1, 1, width, kv_len)`, in `mask`'s dtype and on its device.
    """
    rows = mask.shape[-2]
    if mask.shape[-1] != past_length + rows or rows > width or past_length + width > kv_len:
        raise ValueError(
            f"a {tuple(mask.shape)} mask after {past_length} slots does not fit width {width} and {kv_len} slots"
        )
    # -inf past the block (every row sees its own slot): hf-spec's CPU attention skips those keys
    out = torch.full((1, 1, width, kv_len), float("-inf"), dtype=mask.dtype, device=mask.device)
    out[..., :rows, : past_length + rows] = mask
    fillers = torch.arange(rows, width, device=mask.device)
    out[0, 0, fillers, past_length + fillers] = 0
    return out
