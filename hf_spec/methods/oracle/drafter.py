from __future__ import annotations

import torch

from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.methods.oracle.config import OracleConfig
from hf_spec.tree.draft_tree import DraftTree


class OracleDrafter(Drafter):
    """Replays a reference sequence. Give it one with `set_reference` (e.g. plain `generate`'s output);
    otherwise `begin` computes it with plain greedy `generate` (not counted as draft time)."""

    config: OracleConfig

    def __init__(self, config: OracleConfig, model, tokenizer=None) -> None:
        super().__init__(config, model, tokenizer)
        self.reference: list[int] | None = None
        self._given = False

    def for_another_row(self) -> OracleDrafter:
        """A drafter replaying the same given reference (where the prompt matches it)."""
        twin = type(self)(self.config, self.model, self.tokenizer)
        twin.reference, twin._given = self.reference, self._given
        return twin

    def set_reference(self, sequence: torch.Tensor | list[int]) -> None:
        """`sequence`: prompt + continuation, `(1, length)` or a flat list."""
        self.reference = torch.as_tensor(sequence).reshape(-1).tolist()
        self._given = True

    def begin(self, state: SpecState) -> None:
        prompt = state.input_ids[0].tolist()
        if self._given and self.reference[: len(prompt)] == prompt:
            return
        ref = self.model.generate(
            state.input_ids, do_sample=False, max_length=state.generation_config.max_length, use_cache=True
        )
        self.reference = ref[0].tolist()

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        n = state.seq_len
        ref = self.reference or []
        if ref[:n] != state.input_ids[0].tolist():  # diverged (e.g. sampling): nothing to replay
            return DraftTree.empty()
        return DraftTree.chain(ref[n : n + min(self.config.num_draft_tokens, max_depth)])
