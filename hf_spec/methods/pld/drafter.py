from __future__ import annotations

from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.methods.pld.config import PLDConfig
from hf_spec.methods.pld.ngram_matcher import find_continuations
from hf_spec.tree.draft_tree import DraftTree


class PLDDrafter(Drafter):
    """Proposes continuations of earlier occurrences of the last n-gram (prompt and generated text)."""

    config: PLDConfig
    batchable = True

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        depth = min(cfg.num_draft_tokens, max_depth)
        if depth <= 0:
            return DraftTree.empty()
        tokens = state.input_ids[0].cpu().numpy()
        conts, ngram = find_continuations(tokens, cfg.max_ngram, cfg.min_ngram, depth, cfg.max_candidates)
        if not conts:
            return DraftTree.empty()
        budget = cfg.max_nodes if ngram >= cfg.strong_ngram else cfg.weak_nodes
        return DraftTree.from_sequences(conts, max_nodes=budget)


__all__ = ["PLDDrafter"]
