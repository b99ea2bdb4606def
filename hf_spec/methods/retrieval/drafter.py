from __future__ import annotations

from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.retrieval.retriever import Retriever
from hf_spec.tree.draft_tree import DraftTree


class RetrievalDrafter(Drafter):
    """Deterministic retrieval trees from a token datastore and the context (see `RetrievalConfig`)."""

    config: RetrievalConfig
    batchable = True

    def __init__(self, config: RetrievalConfig, model, tokenizer=None) -> None:
        super().__init__(config, model, tokenizer)
        self.retriever = Retriever(config, model, tokenizer)

    def begin(self, state: SpecState) -> None:
        self.retriever.fit_budget(self, state)

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        tree, _ = self.retriever.propose(state.input_ids[0].cpu().numpy(), max_depth)
        return tree

    def end(self, state: SpecState) -> None:
        self.retriever.finish(state.input_ids[0].cpu().numpy())


__all__ = ["RetrievalDrafter"]
