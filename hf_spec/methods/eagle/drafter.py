"""EAGLE-2 dynamic draft trees from an EAGLE/HASS feature head.

Per round: the head catches up on the committed positions it has not seen (their target features are known
now), then grows the tree level by level: the `topk` best nodes of the last level (by cumulative log-probability)
are fed to the head together, in one forward with a tree mask, and each gets its `topk` best children. After
`depth` levels all nodes are reranked and the best `total_tokens` are verified. The head's KV cache keeps the
committed positions only; draft positions are cropped after each round.
"""

from __future__ import annotations

import torch

from hf_spec.core.drafter import SpecState
from hf_spec.engine.target.cache import cache_length, crop_cache
from hf_spec.methods.eagle.config import EagleConfig
from hf_spec.methods.eagle.modeling import EagleHeadModel
from hf_spec.methods.eagle.stepper import EagleStepper
from hf_spec.methods.head_drafter import HeadDrafter, load_draft_head
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import level_mask
from hf_spec.tree.scored import ScoredTree, prune_scored


def load_head(path: str, target) -> EagleHeadModel:
    return load_draft_head(EagleHeadModel, path, target, "eagle")


class EagleDrafter(HeadDrafter, EagleStepper):
    """EAGLE-2 dynamic trees (`propose`); also a step-wise top-1 chain drafter (`EagleStepper`) for Post-use."""

    config: EagleConfig
    batchable = True
    head_cls = EagleHeadModel

    # ---- drafting ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        if not self.can_draft():
            return DraftTree.empty()
        with self.fast_head():
            h_root = self.catch_up(state, self.head_step)
            depth = min(cfg.depth, max_depth)
            if depth <= 0:
                return DraftTree.empty()
            tree = self._grow(h_root, state.seq_len - 1, depth)
        return tree

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        """Head states `(n, H)` -> log-probabilities over the draft vocabulary `(n, V_draft)`."""
        return torch.log_softmax(self.lm_logits(self.head.parts.norm(h)).float(), dim=-1)

    def _top(self, h: torch.Tensor) -> tuple[list[list[float]], list[list[int]]]:
        """Head states `(n, H)` -> each row's `topk` best children: log-probabilities over the draft vocabulary and
        their target token ids (the backend's top-k; one read of each)."""
        values, indices = self.backend.draft_topk(self.lm_logits(self.head.parts.norm(h)), self.config.topk)
        return values.tolist(), self.head.d2t[indices].tolist()

    def _grow(self, h_root: torch.Tensor, root_pos: int, depth: int) -> DraftTree:
        cfg = self.config
        committed = cache_length(self.cache)
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        slot_of: dict[int, int] = {}  # node -> head-cache slot (fed nodes only)
        source_h: list[torch.Tensor] = []  # the head state each node was predicted from

        def add_children(
            parent: int, h: torch.Tensor, logps: list[float], ids: list[int], base: float, level: int
        ) -> None:
            for lp, token in zip(logps, ids, strict=True):
                tokens.append(token)
                parents.append(parent)
                scores.append(base + lp)
                depths.append(level)
                source_h.append(h)

        logps, ids = self._top(h_root[None])
        add_children(-1, h_root, logps[0], ids[0], 0.0, 1)
        level_nodes = list(range(len(tokens)))
        try:
            for level in range(2, depth + 1):
                beam = sorted(level_nodes, key=lambda i: -scores[i])[: cfg.topk]
                h = self._feed(beam, tokens, parents, source_h, slot_of, committed, root_pos + level - 1)
                logps, ids = self._top(h)
                level_nodes = []
                for row, node in enumerate(beam):
                    start = len(tokens)
                    add_children(node, h[row], logps[row], ids[row], scores[node], level)
                    level_nodes.extend(range(start, len(tokens)))
        finally:
            crop_cache(self.cache, committed)
        return prune_scored(ScoredTree(tokens, parents, scores, depths), cfg.total_tokens).to_draft_tree()

    def _feed(self, beam, tokens, parents, source_h, slot_of, committed: int, position: int) -> torch.Tensor:
        """One head forward of the `beam` nodes (same depth) with a tree mask; returns their head states."""
        past = cache_length(self.cache)
        n = len(beam)
        ancestor_slots = []
        for row, node in enumerate(beam):
            slots, anc = [], parents[node]
            while anc >= 0:
                slots.append(slot_of[anc])
                anc = parents[anc]
            ancestor_slots.append(slots)
            slot_of[node] = past + row
        mask = level_mask(past, committed, ancestor_slots, self.dtype).to(self.device)
        features = torch.stack([source_h[i] for i in beam])[None]
        ids = torch.tensor([[tokens[i] for i in beam]], device=self.device)
        positions = torch.full((1, n), position, device=self.device)
        return self.head_step(features, ids, positions, mask, self.cache)[0]
