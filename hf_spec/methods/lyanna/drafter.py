"""Lyanna drafting: one hidden-state chain per round, one LM-head call, trees by token-info sampling,
re-sampling of rejected branches from the same chain, fused into the next verification."""

from __future__ import annotations

import torch

from hf_spec.core.drafter import RoundResult, SpecState
from hf_spec.engine.target.cache import cache_length, crop_cache
from hf_spec.methods.head_drafter import HeadDrafter, load_draft_head
from hf_spec.methods.lyanna.config import LyannaConfig
from hf_spec.methods.lyanna.modeling import LyannaHeadModel
from hf_spec.methods.lyanna.token_tree import LowRankTokenInfo, token_info_tree
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.scored import ScoredTree, fuse_scored, prune_scored


def load_lyanna_head(path: str, target) -> LyannaHeadModel:
    return load_draft_head(LyannaHeadModel, path, target, "lyanna")


class LyannaDrafter(HeadDrafter):
    config: LyannaConfig
    batchable = True
    head_cls = LyannaHeadModel

    def __init__(
        self, config: LyannaConfig, model, tokenizer=None, head: LyannaHeadModel | None = None
    ) -> None:
        super().__init__(config, model, tokenizer, head)
        self.token_info = self._token_info_fn()
        self.chain_logits: torch.Tensor | None = None  # [k, V_draft] raw logits of this round's chain
        self.resampled: ScoredTree | None = None  # waiting to be verified next round
        self.resample_count = 0

    def _token_info_fn(self):
        head, cfg = self.head, self.config
        if cfg.token_info == "off" or not head.config.token_info_rank:
            return None
        vocab = head.parts.embed_tokens.weight.shape[0]
        cols = self.lm_weight.shape[0]  # the draft vocabulary, or its first vocab_limit rows
        hot = head.d2t if cfg.hot_tokens <= 0 else head.d2t[: cfg.hot_tokens]
        row_of = torch.full((vocab,), -1, dtype=torch.long, device=hot.device)
        row_of[hot] = torch.arange(len(hot), device=hot.device)
        if cfg.token_info == "table":  # collapsed: one row read per node
            table = head.token_info_table(hot)[:, :cols].contiguous()  # [hot, V_draft]

            def lookup(ids: torch.Tensor) -> torch.Tensor:
                rows = row_of[ids]
                return table[rows.clamp(min=0)] * (rows >= 0).unsqueeze(-1)

            return lookup

        return LowRankTokenInfo(head, cols, row_of)

    def head_steps(self) -> dict:
        """Lyanna's head has two forwards: the first step reads target features, the next ones its own state."""
        return {"first_step": self.head.first_step, "next_step": self.head.next_step}

    # ---- committed positions (as in EAGLE: the head's cache is teacher-forced with target features) --------
    def begin(self, state: SpecState) -> None:
        super().begin(state)
        self.chain_logits, self.resampled, self.resample_count = None, None, 0

    def observe(self, state: SpecState, result: RoundResult) -> None:
        super().observe(state, result)
        self.resampled = None
        if self.config.resample == "off" or self.chain_logits is None:
            return
        accepted_depth = len(result.accepted)  # the bonus token sits at depth accepted_depth + 1
        remaining = self.chain_logits[accepted_depth + 1 :]  # levels after the bonus token
        if (
            remaining.shape[0] > self.config.resample_min_steps
            and len(result.new_tokens) == accepted_depth + 1
        ):
            bonus = result.new_tokens[-1]
            tree = token_info_tree(
                remaining, self.token_info, self.head.d2t, self.config.topk, bonus, self.backend
            )
            self.resampled = prune_scored(tree, self.config.resample_budget)
            self.resample_count += 1

    def skip_round(self) -> None:
        self.chain_logits, self.resampled = None, None  # nothing of the last chain is verified this round

    def end(self, state: SpecState) -> None:
        super().end(state)
        self.chain_logits, self.resampled = None, None

    # ---- drafting ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        if self.resampled is not None and cfg.resample == "separate":  # verify the re-sampled subtree alone
            tree, self.resampled, self.chain_logits = self.resampled, None, None
            return tree.to_draft_tree().truncate_depth(max_depth)
        if not self.can_draft():
            return DraftTree.empty()
        with self.fast_head():
            h_root = self.catch_up(state, self.first_step)
            depth = min(cfg.depth, max_depth)
            if depth <= 0:
                return DraftTree.empty()
            chain = self._chain(h_root, state.seq_len - 1, depth)  # [depth, H]
            # ONE LM-head call for the whole chain: [depth, V_draft]
            self.chain_logits = self.lm_logits(self.head.parts.norm(chain))
        level_tree = token_info_tree(
            self.chain_logits, self.token_info, self.head.d2t, cfg.topk, None, self.backend
        )
        tree = prune_scored(level_tree, cfg.budget)
        if self.resampled is not None:  # verification fusion
            tree = fuse_scored(tree, self.resampled)
            self.resampled = None
        return tree.to_draft_tree().truncate_depth(max_depth)

    def _chain(self, h_root: torch.Tensor, root_pos: int, depth: int) -> torch.Tensor:
        """h_1..h_depth: each step one token through the layer, no token input; cropped after."""
        committed = cache_length(self.cache)
        states = [h_root]
        try:
            for step in range(1, depth):
                position = torch.tensor([[root_pos + step]], device=self.device)
                states.append(self.next_step(states[-1].view(1, 1, -1), position, None, self.cache)[0, 0])
        finally:
            crop_cache(self.cache, committed)
        return torch.stack(states)
