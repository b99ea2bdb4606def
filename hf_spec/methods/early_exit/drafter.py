from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import nn

from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.engine.compiled_step import draft_steps
from hf_spec.engine.target.cache import cache_length, compact_cache, crop_cache
from hf_spec.kernels.weight_only import QuantizedWeight, quantize_linears
from hf_spec.methods.early_exit.config import EarlyExitConfig
from hf_spec.methods.early_exit.exit_heads import ExitLM, load_exit_lm
from hf_spec.methods.stepwise import StepwiseDrafter
from hf_spec.models.layers import DecoderParts, decoder_parts, run_layers
from hf_spec.tree.draft_tree import DraftTree


def quantize_draft_layers(
    parts: DecoderParts, exit_layer: int, scheme: str, exits: ExitLM | None = None
) -> dict[nn.Linear, QuantizedWeight]:
    """Packed `scheme` copies of the linears of layers `[0, exit_layer)` (and an int8 copy of the exit's LM-head
    rows in `exits`) for drafting; `{}` when `scheme` is empty."""
    quantized: dict[nn.Linear, QuantizedWeight] = {}
    if scheme:
        for layer in parts.layers[:exit_layer]:
            quantized.update(quantize_linears(layer, scheme, max_rows=32))
        if exits is not None:
            exits.quantize_head()
    return quantized


class ExitDraftParts(NamedTuple):
    layer: int
    exits: ExitLM
    quantized: dict[nn.Linear, QuantizedWeight]


def exit_draft_parts(config: EarlyExitConfig, model) -> ExitDraftParts:
    """What an `early-exit` config drafts with: its exit layer (default 3/4 of the depth, checked), the exit LM
    (trained heads or the stock ones, checked to cover that layer) and the packed draft weights it asks for."""
    parts = decoder_parts(model)
    layer = config.exit_layer or max(1, round(0.75 * parts.num_layers))
    if not 0 < layer < parts.num_layers:
        raise ValueError(f"exit_layer must be in [1, {parts.num_layers - 1}], got {config.exit_layer}")
    exits = load_exit_lm(model, config.exit_heads or None, config.draft_vocab)
    exits.check_layers(layer)
    return ExitDraftParts(layer, exits, quantize_draft_layers(parts, layer, config.quantize, exits))


class EarlyExitDrafter(Drafter, StepwiseDrafter):
    """Drafts with the target's first `exit_layer` layers, reusing (then rolling back) their KV cache."""

    config: EarlyExitConfig

    def __init__(self, config: EarlyExitConfig, model, tokenizer=None) -> None:
        super().__init__(config, model, tokenizer)
        self.parts = decoder_parts(model)
        self.exit_layer, self.exits, self.quantized = exit_draft_parts(config, model)
        self.draft_layers = self._run_draft_layers  # compiled at one row in a compiled generation (`begin`)

    def for_another_row(self) -> EarlyExitDrafter:
        """A drafter sharing this one's exit LM and packed weights; its step-wise state is its own."""
        twin = copy.copy(self)
        twin.__dict__ = {k: v for k, v in self.__dict__.items() if not k.startswith("_step")}
        return twin

    def begin(self, state: SpecState) -> None:
        self.parts.check_window(state.generation_config.max_length, "early exit")
        self.backend = state.backend
        self.exits.use_backend(state.backend)
        # one token per step (`propose`); Post-use's several-token feeds run eagerly
        steps = {"draft": (self._run_draft_layers, 1, range(self.exit_layer))}
        drafted = draft_steps(self, state.cache, state.compile_settings, steps, modules=(self.model,))
        self.draft_layers = drafted["draft"]

    def _run_draft_layers(self, hidden, position_ids, mask, cache) -> torch.Tensor:
        """The target's layers `[0, exit_layer)` over its cache: `(1, n, hidden_size)` in and out."""
        return run_layers(self.parts, hidden, position_ids, cache, 0, self.exit_layer, mask)

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
            # the same weights as the step-wise path (`_step_forward`)
            with state.backend.packed_linears(self.model, self.quantized):
                for step in range(depth):
                    position_ids = torch.tensor([[past + step]], device=token.device)
                    hidden = self.draft_layers(parts.embed_tokens(token), position_ids, None, state.cache)
                    logits = self.exits.logits(self.exit_layer, hidden)[0, -1].float()
                    # argmax: ~20x faster than topk(k=1) over a 151,936-token vocabulary
                    best = (
                        torch.topk(logits, cfg.siblings + 1).indices
                        if cfg.siblings
                        else logits.argmax().view(1)
                    )
                    chain.append(int(best[0]))
                    siblings.append(best[1:].tolist())
                    if cfg.min_confidence > 0:
                        prob = torch.softmax(logits, dim=-1)[best[0]]
                        if float(prob) < cfg.min_confidence:
                            break
                    token = best[:1].view(1, 1)
        finally:
            crop_cache(state.cache, past, range(self.exit_layer))
        return DraftTree.chain_with_siblings(chain, siblings if cfg.siblings else None)

    # ---- step-wise drafting (StepwiseDrafter hooks): same forward as `propose`, several tokens at once ----
    def _step_prepare(self, state: SpecState):
        past = state.seq_len - 1
        return (past, []) if cache_length(state.cache) == past else None

    def _step_forward(self, ids, position_ids, mask) -> torch.Tensor:
        parts, cache = self.parts, self._step_cache
        with self.backend.packed_linears(self.model, self.quantized):
            hidden = self.draft_layers(parts.embed_tokens(ids), position_ids, mask, cache)
            return self.exits.logits(self.exit_layer, hidden)[0].float()

    def _step_compact(self, past: int, keep: list[int]) -> None:
        compact_cache(self._step_cache, past, keep, range(self.exit_layer))

    def _step_finish(self, state: SpecState, start: int, kept: list[int]) -> None:
        crop_cache(state.cache, start, range(self.exit_layer))

    def draft_start(self, state: SpecState) -> bool:
        self._step_cache = state.cache
        return super().draft_start(state)
