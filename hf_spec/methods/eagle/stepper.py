"""Step-wise drafting with an EAGLE/HASS head (the `StepwiseDrafter` protocol, for Post-use & Pre-cut).

A feature head's input at position t is (its own state at t-1, token t), so a fed block cannot be computed in
one forward the way a layer stack computes it: each branch token needs the state its predecessor produced.
Branches are therefore fed level by level: one head forward per branch depth, all branches' j-th tokens
together under a tree mask (each sees the committed and chain positions and its own earlier tokens), and one
LM-head call for every row of the step. The chain is the head's top-1 path; a round starts from the state
`catch_up` leaves at the root, as `propose` does.
"""

from __future__ import annotations

import torch

from hf_spec.core.drafter import SpecState
from hf_spec.engine.target.cache import cache_length, compact_cache, crop_cache
from hf_spec.methods.stepwise import DraftStep, StepwiseDrafter
from hf_spec.tree.masks import causal_mask, level_mask


class EagleStepper(StepwiseDrafter):
    """Overrides the `StepwiseDrafter` entry points for a head drafter (`HeadDrafter` with `self.head`,
    `self.cache`, `self.lm_weight`)."""

    def draft_start(self, state: SpecState) -> bool:
        if not self.can_draft():
            return False
        with self.fast_head():
            self._h_chain = self.catch_up(state, self.head_step)  # [H]: state after the last chain token
        self._committed = cache_length(self.cache)  # committed positions + the root
        self._chain_len = self._committed  # cache positions of committed + fed chain tokens
        self._fresh = True  # the root is fed already: the first call's token is the root
        self._branch_slots: list[list[int]] = []  # cache slot of each fed branch token
        self._branch_states: list[list[torch.Tensor]] = []
        return True

    @torch.no_grad()
    def draft_step(self, tokens: list[int], branches: list[list[int]] | tuple = ()) -> DraftStep:
        if not tokens:
            raise ValueError("draft_step needs at least one chain token to feed")
        branches = [[int(t) for t in b] for b in branches]
        if not all(branches):
            raise ValueError("draft_step branches must not be empty")
        crop_cache(self.cache, self._chain_len)  # provisional branch positions of the last step
        tokens = [int(t) for t in tokens][1:] if self._fresh else [int(t) for t in tokens]
        self._fresh = False
        with self.fast_head():
            for token in tokens:
                self._h_chain = self._feed_one(self._h_chain, token)
            rows = [self._h_chain] + self._feed_branches(branches)
            logits = self._full_logits(torch.stack(rows))  # one LM-head call for the whole step
        out, start = [], 1
        for b in branches:
            out.append(logits[start : start + len(b)])
            start += len(b)
        return DraftStep(logits[0], out)

    def draft_keep(self, branch: int, length: int, tokens: list[int]) -> None:
        slots = self._branch_slots[branch]
        if not 0 < length <= len(slots) or len(tokens) != length:
            raise ValueError(f"cannot keep {length} tokens of a {len(slots)}-token branch")
        compact_cache(self.cache, self._chain_len, [s - self._chain_len for s in slots[:length]])
        self._chain_len += length
        self._h_chain = self._branch_states[branch][length - 1]
        self._branch_slots, self._branch_states = [], []

    def draft_stop(self, state: SpecState) -> None:
        crop_cache(self.cache, self._committed)  # the head keeps committed positions only
        self._branch_slots, self._branch_states, self._h_chain = [], [], None

    # ---- internals ------------------------------------------------------------------------------------
    def _feed_one(self, h_prev: torch.Tensor, token: int) -> torch.Tensor:
        """Append chain token `token` at the next position; returns its head state `(H,)`."""
        past = self._chain_len  # the next slot holds position skipped + slot + 1 (position 0 has no feature)
        ids = torch.tensor([[token]], device=self.device)
        pos = torch.tensor([[self.skipped + past + 1]], device=self.device)
        mask = causal_mask(1, past, self.dtype, self.device)
        h = self.head_step(h_prev.view(1, 1, -1), ids, pos, mask, self.cache)[0, -1]
        self._chain_len += 1
        return h

    def _feed_branches(self, branches: list[list[int]]) -> list[torch.Tensor]:
        """Feed every branch behind the chain, level by level; returns the head state of each branch token in
        branch order (`sum(len(b))` states of shape `(H,)`)."""
        self._branch_slots = [[] for _ in branches]
        self._branch_states = [[] for _ in branches]
        for level in range(max((len(b) for b in branches), default=0)):
            rows = [b for b, branch in enumerate(branches) if len(branch) > level]
            past = cache_length(self.cache)
            slots = [self._branch_slots[b] for b in rows]  # each row sees its own branch's earlier tokens
            mask = level_mask(past, self._chain_len, slots, self.dtype).to(self.device)
            features = torch.stack([self._branch_states[b][-1] if level else self._h_chain for b in rows])[
                None
            ]
            ids = torch.tensor([[branches[b][level] for b in rows]], device=self.device)
            position = self.skipped + self._chain_len + 1 + level
            positions = torch.full((1, len(rows)), position, device=self.device)
            states = self.head_step(features, ids, positions, mask, self.cache)[0]
            for r, b in enumerate(rows):
                self._branch_slots[b].append(past + r)
                self._branch_states[b].append(states[r])
        return [h for states in self._branch_states for h in states]

    def _full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Head states `(n, H)` -> logits over the target vocabulary `(n, vocab_size)`: the drafted rows
        (`lm_weight`, mapped by `d2t`) carry the head's logits, every other token -inf."""
        draft = self.lm_logits(self.head.parts.norm(h)).float()  # [n, V_draft]
        vocab = self.model.get_output_embeddings().weight.shape[0]
        full = torch.full((h.shape[0], vocab), float("-inf"), device=draft.device)
        full[:, self.head.d2t[: draft.shape[1]]] = draft
        return full
