"""EAGLE-2 dynamic draft trees from an EAGLE/HASS feature head.

Per round: the head catches up on the committed positions it has not seen (their target features are known
now), then grows the tree level by level: the `topk` best nodes of the last level (by cumulative log-probability)
are fed to the head together, in one forward with a tree mask, and each gets its `topk` best children. After
`depth` levels all nodes are reranked and the best `total_tokens` are verified. The head's KV cache keeps the
committed positions only; draft positions are cropped after each round.

The catch-up and the growth are one function of tensors (`EagleDrafter.draft_block`): every level has `topk`
rows, so its shapes are fixed, and a compiled generation runs a round's drafting as one graph.
"""

from __future__ import annotations

import torch

from hf_spec.core.drafter import SpecState
from hf_spec.engine.compiled_step import StepSpec
from hf_spec.engine.target.cache import cache_length, crop_cache
from hf_spec.methods.eagle.config import EagleConfig
from hf_spec.methods.eagle.modeling import EagleHeadModel
from hf_spec.methods.eagle.stepper import EagleStepper
from hf_spec.methods.head_drafter import HeadDrafter, load_draft_head
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import additive_mask
from hf_spec.tree.scored import ScoredTree, prune_scored


def load_head(path: str, target) -> EagleHeadModel:
    return load_draft_head(EagleHeadModel, path, target, "eagle")


class EagleDrafter(HeadDrafter, EagleStepper):
    """EAGLE-2 dynamic trees (`propose`); also a step-wise top-1 chain drafter (`EagleStepper`) for Post-use."""

    config: EagleConfig
    batchable = True
    head_cls = EagleHeadModel

    def head_steps(self) -> dict:
        """The head's forward (`head_step`: chains, Post-use) and a whole round's drafting (`draft_block`)."""
        cfg = self.config
        block = StepSpec(
            self.draft_block, cfg.depth + 1, extra_slots=cfg.topk * (cfg.depth - 1), row_outputs=False
        )
        return {**super().head_steps(), "draft_block": block}

    # ---- drafting ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        if not self.can_draft():
            return DraftTree.empty()
        depth = min(cfg.depth, max_depth)
        with self.fast_head():
            rows = self.catch_up_rows(state)
            if depth <= 0:
                self.head_step(*rows, self.cache)
                return DraftTree.empty()
            committed = cache_length(self.cache) + rows[0].shape[1]
            try:
                tokens, parents, scores = self.draft_block(*rows, self.cache)
            finally:
                crop_cache(self.cache, committed)
        # the levels down to `depth` (the block always grows `cfg.depth`: one shape for every round)
        count = cfg.topk + (depth - 1) * cfg.topk**2
        depths = [1] * cfg.topk + [d for d in range(2, depth + 1) for _ in range(cfg.topk**2)]
        tree = ScoredTree(tokens[:count].tolist(), parents[:count].tolist(), scores[:count].tolist(), depths)
        return prune_scored(tree, cfg.total_tokens).to_draft_tree()

    def _logp(self, h: torch.Tensor) -> torch.Tensor:
        """Head states `(n, H)` -> log-probabilities over the draft vocabulary `(n, V_draft)`."""
        return torch.log_softmax(self.lm_logits(self.head.parts.norm(h)).float(), dim=-1)

    def _top(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head states `(n, H)` -> each row's `topk` best children `(n, topk)`: log-probabilities over the draft
        vocabulary (float32) and their target token ids (the backend's top-k)."""
        values, indices = self.backend.draft_topk(self.lm_logits(self.head.parts.norm(h)), self.config.topk)
        return values, self.head.d2t[indices]

    def draft_block(
        self, features: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Catch up on committed positions, then grow `depth` levels of `topk` children below the last one (the
        root). Writes the rows' keys and each level's `topk` beam nodes after them into `cache`; the caller drops
        the beam nodes' slots.

        Args:
            features: `(1, n, F)` target features of the committed positions, ids `(1, n)` their tokens,
                positions `(1, n)` theirs, increasing: the last real row is the root (rows after it repeat it).
            mask: additive `(1, 1, n, kv)` over the cache's slots and the rows, as the head's attention takes it.

        Returns:
            tokens `(N,)` (target ids), parents `(N,)` (earlier node indices, -1: the root) and cumulative
            log-probabilities `(N,)` float32 of `N = topk + (depth - 1) * topk**2` nodes, level by level.
        """
        k, depth = self.config.topk, self.config.depth
        h = self.head(features, ids, positions, mask, cache)[0]  # (n, H)
        root = positions[0].argmax(dim=0, keepdim=True)  # (1,): the first of the largest, the last real row
        root_position = positions[0].index_select(0, root)  # (1,)
        h_root = h.index_select(0, root)  # (1, H)
        # slots the root sees (the committed ones), and the slot after the last row's own: where levels go
        seen = mask[0, 0].index_select(0, root) == 0  # (1, kv)
        last_row = mask[0, 0, -1] == 0
        next_slot = torch.arange(last_row.shape[0], device=mask.device).masked_fill(~last_row, -1).max() + 1

        h_level = h_root.expand(k, -1)  # (k, H): the state each node of the level was predicted from
        values, level_tokens = (t[0] for t in self._top(h_root))
        tokens, parents, scores = [level_tokens], [torch.full_like(level_tokens, -1)], [values]
        seen_level = seen.expand(k, -1)  # (k, kv): the slots each node's children see
        level_start = 0
        for level in range(2, depth + 1):
            beam_scores, beam = torch.topk(scores[-1], k)  # (k,): the level's best nodes, fed together
            kv = cache.get_mask_sizes(k, 0)[0]  # keys the next forward attends over (a dynamic cache grows)
            allowed = seen_level[beam]
            if kv > allowed.shape[-1]:
                allowed = torch.cat([allowed, allowed.new_zeros(k, kv - allowed.shape[-1])], dim=-1)
            own = next_slot + torch.arange(k, device=allowed.device)
            allowed = allowed | (torch.arange(kv, device=allowed.device)[None] == own[:, None])
            h_beam = self.head(
                h_level[beam][None],
                tokens[-1][beam][None],
                (root_position + level - 1).expand(k)[None],
                additive_mask(allowed, mask.dtype, hidden=float("-inf")),
                cache,
            )[0]  # (k, H)
            values, children = self._top(h_beam)  # (k, k)
            parents.append((level_start + beam).repeat_interleave(k))
            level_start += scores[-1].shape[0]
            tokens.append(children.flatten())
            scores.append((beam_scores[:, None] + values).flatten())
            h_level, seen_level = h_beam.repeat_interleave(k, 0), allowed.repeat_interleave(k, 0)
            next_slot = next_slot + k
        return torch.cat(tokens), torch.cat(parents), torch.cat(scores)
