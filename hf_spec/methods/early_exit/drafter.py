from __future__ import annotations

import torch

from hf_spec.heads.exits.model import load_exit_lm
from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.methods.base import Drafter, SpecState
from hf_spec.methods.common import chain_with_siblings
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.stepwise import StepwiseDrafter
from hf_spec.models.layers import decoder_parts, run_layers
from hf_spec.tree.buffers import DraftTree
from hf_spec.verify.cache import cache_length, compact_cache, crop_cache


class EarlyExitDrafter(Drafter, StepwiseDrafter):
    """Drafts with the target's first `exit_layer` layers, reusing (then rolling back) their KV cache."""

    config: EarlyExitConfig

    def __init__(self, config: EarlyExitConfig, model, tokenizer=None) -> None:
        super().__init__(config, model, tokenizer)
        self.parts = decoder_parts(model)
        self.exit_layer = config.exit_layer or max(1, round(0.75 * self.parts.num_layers))
        if not 0 < self.exit_layer < self.parts.num_layers:
            raise ValueError(
                f"exit_layer must be in [1, {self.parts.num_layers - 1}], got {config.exit_layer}"
            )
        self.exits = load_exit_lm(model, config.exit_heads or None, config.draft_vocab)
        self.exits.check_layers(self.exit_layer)

    def begin(self, state: SpecState) -> None:
        self.parts.check_window(state.generation_config.max_length, "early exit")

    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg, parts = self.config, self.parts
        depth = min(cfg.num_draft_tokens, max_depth)
        past = state.seq_len - 1  # the root is not cached yet
        if (
            depth <= 0 or cache_length(state.cache) != past
        ):  # e.g. transformers' first assisted step: empty cache
            return DraftTree.empty()
        token = state.input_ids[:, -1:]
        chain: list[int] = []
        siblings: list[list[int]] = []
        try:
            with fast_linears(self.model):  # same kernels as the step-wise path (`_step_forward`)
                for step in range(depth):
                    position_ids = torch.tensor([[past + step]], device=token.device)
                    hidden = run_layers(
                        parts, parts.embed_tokens(token), position_ids, state.cache, 0, self.exit_layer
                    )
                    logits = self.exits.logits(self.exit_layer, hidden)[0, -1].float()
                    top = torch.topk(logits, cfg.siblings + 1)
                    chain.append(int(top.indices[0]))
                    siblings.append(top.indices[1:].tolist())
                    if cfg.min_confidence > 0:
                        prob = torch.softmax(logits, dim=-1)[top.indices[0]]
                        if float(prob) < cfg.min_confidence:
                            break
                    token = top.indices[:1].view(1, 1)
        finally:
            crop_cache(state.cache, past, range(self.exit_layer))
        return chain_with_siblings(chain, siblings if cfg.siblings else None)

    # ---- step-wise drafting (StepwiseDrafter hooks): same forward as `propose`, several tokens at once ----
    def _step_prepare(self, state: SpecState):
        past = state.seq_len - 1
        return (past, []) if cache_length(state.cache) == past else None

    def _step_forward(self, ids, position_ids, mask) -> torch.Tensor:
        parts, cache = self.parts, self._step_cache
        with fast_linears(self.model):
            hidden = run_layers(parts, parts.embed_tokens(ids), position_ids, cache, 0, self.exit_layer, mask)
            return self.exits.logits(self.exit_layer, hidden)[0].float()

    def _step_compact(self, past: int, keep: list[int]) -> None:
        compact_cache(self._step_cache, past, keep, range(self.exit_layer))

    def _step_finish(self, state: SpecState, start: int, kept: list[int]) -> None:
        crop_cache(state.cache, start, range(self.exit_layer))

    def draft_start(self, state: SpecState) -> bool:
        self._step_cache = state.cache
        return super().draft_start(state)
