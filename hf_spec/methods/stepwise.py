"""Optional step-wise drafting: a wrapper (e.g. Post-use & Pre-cut) drives a drafter one forward at a time.

    draft_start(state)                      # below the root state.input_ids[0, -1]
    step = draft_step([root], branches)     # feed the root; branches hang behind it, each seeing only itself
    draft_keep(b, n)                        # optional: branch b's first n tokens join the chain (KV kept)
    step = draft_step([next_token])         # leftover branch positions are dropped first
    ...
    draft_stop(state)                       # roll the drafter's own state back as the drafter needs

A drafter opts in by mixing in `StepwiseDrafter` and implementing its four hooks (`_step_prepare`,
`_step_forward`, `_step_compact`, `_step_finish`); the bookkeeping of fed/kept/provisional positions
lives here once (a step's ids, positions and mask: `hf_spec.tree.masks.step_inputs`). Feature heads, whose input
at a position is their own output at the one before, cannot feed a block in one forward and override the four
entry points instead (`hf_spec.methods.eagle.stepper`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_spec.tree.masks import step_inputs

if TYPE_CHECKING:
    from hf_spec.core.drafter import SpecState


@dataclass
class DraftStep:
    """Logits of one step-wise draft forward.

    Args:
        chain: `torch.FloatTensor` of shape `(vocab_size,)`: the drafter's logits for the token after the
            last fed chain token.
        branches: per branch, `torch.FloatTensor` of shape `(len(branch), vocab_size)`: row `j` holds the
            logits for the token after branch token `j` (the branch seen as following the fed chain).
    """

    chain: torch.Tensor  # [vocab_size]
    branches: list[torch.Tensor]  # [len(branch), vocab_size] each


class StepwiseDrafter:
    """Mixin for drafters that can be driven one forward at a time (see the module docstring).

    Hooks a drafter implements:
        `_step_prepare(state) -> (past, prefix) | None`: positions already in the drafter's cache and the
            committed tokens (before the root) still to feed; `None` when it cannot draft now.
        `_step_forward(ids, position_ids, mask) -> logits (q, vocab_size)`: one forward that appends to the
            drafter's cache.
        `_step_compact(past, keep)`: keep cache positions `past + keep[i]` (increasing), drop the rest after
            `past` (`keep = []` crops to `past`).
        `_step_finish(state, start, kept)`: drafting is over; `kept` are the tokens now at cache positions
            `start, start + 1, ...` (prefix, root and the chain tokens fed); branch positions are gone.
    """

    def draft_start(self, state: SpecState) -> bool:
        """Begin drafting below the root; False when the drafter cannot draft now (nothing is changed)."""
        prepared = self._step_prepare(state)
        if prepared is None:
            return False
        self._step_start, prefix = prepared
        self._step_fed = self._step_start  # cache positions that stay (committed + fed chain)
        self._step_prefix = [int(t) for t in prefix]
        self._step_kept: list[int] = []
        self._step_branch_at: list[tuple[int, int]] = []  # (offset after _step_fed, length) per branch
        return True

    @torch.no_grad()
    def draft_step(self, tokens: list[int], branches: list[list[int]] | tuple = ()) -> DraftStep:
        """Feed `tokens` (the chain continues with them; the first call feeds `[root]`) and, in the same
        forward, `branches` behind the last of them."""
        if not tokens:
            raise ValueError("draft_step needs at least one chain token to feed")
        self._step_drop_branches()
        tokens = self._step_prefix + [int(t) for t in tokens]
        self._step_prefix = []
        branches = [[int(t) for t in b] for b in branches]
        if not all(branches):
            raise ValueError("draft_step branches must not be empty")
        ids, position_ids, mask = step_inputs(tokens, branches, self._step_fed, *self._step_where())
        logits = self._step_forward(ids, position_ids, mask)  # [q, vocab_size]
        self._step_fed += len(tokens)
        self._step_kept += tokens
        out, offset = [], 0
        for b in branches:
            self._step_branch_at.append((offset, len(b)))
            out.append(logits[len(tokens) + offset : len(tokens) + offset + len(b)])
            offset += len(b)
        return DraftStep(logits[len(tokens) - 1], out)

    def draft_keep(self, branch: int, length: int, tokens: list[int]) -> None:
        """Branch `branch`'s first `length` tokens (`tokens`, for bookkeeping) join the chain."""
        offset, size = self._step_branch_at[branch]
        if not 0 < length <= size or len(tokens) != length:
            raise ValueError(f"cannot keep {length} tokens of a {size}-token branch")
        self._step_compact(self._step_fed, list(range(offset, offset + length)))
        self._step_fed += length
        self._step_kept += [int(t) for t in tokens]
        self._step_branch_at = []

    def draft_stop(self, state: SpecState) -> None:
        """Drafting is over: drop provisional positions and let the drafter settle its state."""
        self._step_drop_branches()
        self._step_finish(state, self._step_start, self._step_kept)

    def _step_drop_branches(self) -> None:
        if self._step_branch_at:
            self._step_compact(self._step_fed, [])
            self._step_branch_at = []

    def _step_where(self) -> tuple[torch.dtype, torch.device]:
        from hf_spec.engine.target.placement import input_device

        # the target's (where its forward takes inputs: an offloaded weight is a `meta` placeholder); drafters
        # override when they differ
        return next(self.model.parameters()).dtype, input_device(self.model)
