"""HiSpec: draft with layers [0, L_d), verify early with [L_d, L_i), verify for good with [L_i, L_f).

One round of the loop (one full verification), with `past` tokens in every layer's cache and the root pending:

    pending = root
    while fewer than N_i tokens are buffered:
        draft:  pending, d_1 .. d_{N_d - 1} through layers [0, L_d), one at a time; the exit at L_d proposes
                d_1 .. d_{N_d}                                                 (KV of [0, L_d) grows)
        check:  their layer-L_d hidden states through [L_d, L_i) in one pass; the exit at L_i predicts
                d_1 .. d_{N_d}; keep the longest matching prefix: its layer-L_i hidden states join the buffer,
                the next pending token is d_{N_d} (all matched) or the L_i exit's own token at the first
                mismatch; the cache of [0, L_i) is cropped to the kept positions
    verify (`verify_forward`): the buffered layer-L_i hidden states of [root] + buffer through [L_i, L_f) in one
            pass -> the final logits; the loop accepts the longest prefix the full model agrees with plus its
            bonus token and compacts every layer's cache, so the rest is flushed everywhere

The pending token is never computed by any layer: when the buffer is full it is simply dropped, since the full
model's bonus token after the last buffered token is its check. Between rounds every layer's cache holds exactly
the committed tokens but the root; during a round, layers [0, L_i) also hold the buffered positions.

Lossless: the tokens the loop commits are decided by the full model's logits alone (greedy argmax, or recursive
rejection sampling against the target distribution); the drafts and the L_i check only choose which chain is
proposed, a deterministic function of the committed prefix (a point-mass proposal), so the committed tokens are
distributed exactly as plain sampling's.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.engine.compiled_step import draft_steps
from hf_spec.engine.target.cache import cache_length, crop_cache
from hf_spec.methods.early_exit.exit_heads import load_exit_lm
from hf_spec.methods.hispec.config import HiSpecConfig
from hf_spec.models.layers import check_layerwise_forward, decoder_parts, run_layers
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import causal_mask


@dataclass
class HiSpecRound:
    """The state of one round before its full verification.

    Args:
        past: committed tokens in every layer's cache (all but the root, which sits at position `past`).
        held: positions in the cache of layers [0, L_i): `past`, or `past + 1 + len(tokens)` once the root ran.
        pending: the next token, not yet run by any layer (the root until the first check).
        tokens: the buffer: tentatively accepted tokens after the root.
        hidden: layer-L_i hidden states of `[root] + tokens`, pieces of shape `(1, n, hidden_size)`.
    """

    past: int
    held: int
    pending: int
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)


class HiSpecDrafter(Drafter):
    """Hierarchical early-exit speculation (see the module docstring); `counts` holds this generation's
    counters (drafted, rejected_early = dropped by the L_i check, buffered, rejected_full = dropped by the full
    model, checks, rounds)."""

    config: HiSpecConfig

    def __init__(self, config: HiSpecConfig, model, tokenizer=None) -> None:
        super().__init__(config, model, tokenizer)
        self.parts = decoder_parts(model)
        check_layerwise_forward(model, self.parts, "hispec")  # its last stage gives the target's logits
        depth = self.parts.num_layers
        self.draft_layer = config.draft_layer or max(1, round(depth / 8))
        self.verify_layer = config.verify_layer or max(self.draft_layer + 1, round(depth / 4))
        if not 0 < self.draft_layer < self.verify_layer < depth:
            raise ValueError(
                f"hispec needs 0 < draft_layer < verify_layer < {depth} (the model's depth), got "
                f"draft_layer={self.draft_layer}, verify_layer={self.verify_layer}"
            )
        self.exits = load_exit_lm(model, config.exit_heads or None, config.draft_vocab)
        self.exits.check_layers(self.draft_layer, self.verify_layer)
        self.counts: Counter = Counter()
        self._round: HiSpecRound | None = None
        self._use_steps(None, None)

    def _use_steps(self, cache, settings) -> None:
        """The three layer ranges as this generation runs them: eager, or compiled at fixed widths over the
        target's static cache (`hf_spec.engine.compiled_step`): drafting one token at a time, the check of
        `num_draft_tokens` rows, the last stage over the buffer (`num_buffer_tokens` + the root)."""
        depth, cfg = self.parts.num_layers, self.config
        ranges = {
            "draft_stage": (0, self.draft_layer, 1),
            "check_stage": (self.draft_layer, self.verify_layer, cfg.num_draft_tokens),
            "final_stage": (self.verify_layer, depth, cfg.num_buffer_tokens + 1),
        }
        steps = {
            name: (self._stage(start, end), width, range(start, end))
            for name, (start, end, width) in ranges.items()
        }
        for name, step in draft_steps(self, cache, settings, steps, modules=(self.model,)).items():
            setattr(self, name, step)

    def _stage(self, start: int, end: int):
        def stage(hidden, position_ids, mask, cache):
            """The target's layers `[start, end)` over its cache: `(1, n, hidden_size)` in and out."""
            return run_layers(self.parts, hidden, position_ids, cache, start, end, mask)

        return stage

    def for_another_row(self) -> HiSpecDrafter:
        """A drafter sharing this one's exit LM, with counters and round state of its own."""
        twin = copy.copy(self)
        twin.counts, twin._round = Counter(), None
        return twin

    def begin(self, state: SpecState) -> None:
        if not state.uses_verify_forward:
            raise ValueError(
                "hispec continues the target's forward from its intermediate layer, so it runs in hf-spec's loop "
                "only (custom_generate= or SpeculativeDecoder), not as transformers' assistant_model"
            )
        self.parts.check_window(state.generation_config.max_length, "hispec")
        self.exits.use_backend(state.backend)
        self.counts = Counter()
        self._round = None
        self._use_steps(state.cache, state.compile_settings)

    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        self._round = None
        past = state.seq_len - 1  # the root is not cached yet
        limit = min(self.config.num_buffer_tokens, max_depth)
        if limit <= 0 or cache_length(state.cache) != past:  # e.g. transformers' first assisted step
            return DraftTree.empty()
        rnd = HiSpecRound(past=past, held=past, pending=int(state.input_ids[0, -1]))
        try:
            while len(rnd.tokens) < limit:  # every check buffers >= 1 token after the first: this ends
                drafts, hidden = self._draft(state, rnd)
                self._check(state, rnd, drafts, hidden)
            if len(rnd.tokens) > max_depth:
                self._cut(state, rnd, max_depth)
        except BaseException:
            crop_cache(state.cache, past)  # leave the cache as the loop gave it
            raise
        self.counts["rounds"] += 1
        self.counts["buffered"] += len(rnd.tokens)
        self._round = rnd
        return DraftTree.chain(rnd.tokens)

    def _draft(self, state: SpecState, rnd: HiSpecRound) -> tuple[list[int], torch.Tensor]:
        """Layers [0, L_d) + the L_d exit, one token at a time from `rnd.pending`.

        Returns:
            the `N_d` drafted tokens, and the layer-L_d hidden states `(1, N_d, hidden_size)` of
            `[pending] + drafts[:-1]` (the last draft is not run).
        """
        parts, device = self.parts, state.input_ids.device
        token, drafts, hidden = rnd.pending, [], []
        with state.backend.drafting(state.model, linears=True):
            for step in range(self.config.num_draft_tokens):
                position_ids = torch.tensor([[rnd.held + step]], device=device)
                h = self.draft_stage(
                    parts.embed_tokens(torch.tensor([[token]], device=device)),
                    position_ids,
                    None,
                    state.cache,
                )
                token = int(self.exits.logits(self.draft_layer, h)[0, -1].argmax())
                drafts.append(token)
                hidden.append(h)
        self.counts["drafted"] += len(drafts)
        return drafts, torch.cat(hidden, dim=1)

    def _check(self, state: SpecState, rnd: HiSpecRound, drafts: list[int], hidden: torch.Tensor) -> None:
        """Intermediate verification: continue `hidden` through [L_d, L_i), keep the prefix of `drafts` the L_i
        exit agrees with, crop layers [0, L_i) to the kept positions."""
        n = len(drafts)
        position_ids = torch.arange(rnd.held, rnd.held + n, device=hidden.device).unsqueeze(0)
        mask = causal_mask(n, rnd.held, hidden.dtype, hidden.device)
        with state.backend.drafting(state.model, linears=True):
            h = self.check_stage(hidden, position_ids, mask, state.cache)
            preds = (
                self.exits.logits(self.verify_layer, h)[0].argmax(-1).tolist()
            )  # preds[j] checks drafts[j]
        matched = next((j for j in range(n) if preds[j] != drafts[j]), n)
        keep = min(matched + 1, n)  # positions [pending] + drafts[: keep - 1] have layer-L_i states now
        if rnd.held > rnd.past:  # the pending token was a real token (not the root): it joins the buffer
            rnd.tokens.append(rnd.pending)
        rnd.tokens += drafts[: keep - 1]
        rnd.hidden.append(h[:, :keep])
        rnd.pending = drafts[-1] if matched == n else preds[matched]
        rnd.held += keep
        crop_cache(state.cache, rnd.held, range(self.verify_layer))
        self.counts["checks"] += 1
        self.counts["rejected_early"] += n - matched

    def _cut(self, state: SpecState, rnd: HiSpecRound, max_depth: int) -> None:
        """Drop buffered tokens past `max_depth` (near `max_length`)."""
        rnd.tokens = rnd.tokens[:max_depth]
        rnd.hidden = [torch.cat(rnd.hidden, dim=1)[:, : max_depth + 1]]
        rnd.held = rnd.past + 1 + max_depth
        crop_cache(state.cache, rnd.held, range(self.verify_layer))

    @torch.no_grad()
    @property
    def continues_verification(self) -> bool:
        return True

    def verify_forward(self, state, tree, input_ids, position_ids, attention_mask, output_hidden_states):
        """Continue the buffered layer-L_i hidden states of `[root] + tree` through [L_i, L_f)."""
        rnd, self._round = self._round, None
        if rnd is None or not rnd.hidden:  # nothing buffered (empty tree): the stock forward
            return super().verify_forward(
                state, tree, input_ids, position_ids, attention_mask, output_hidden_states
            )
        if rnd.past != state.seq_len - 1 or rnd.tokens != tree.tokens.tolist():
            raise RuntimeError("hispec: asked to verify a tree it did not propose")
        hidden = torch.cat(rnd.hidden, dim=1)  # [1, 1 + len(tree), hidden_size]
        mask = causal_mask(hidden.shape[1], rnd.past, hidden.dtype, hidden.device)
        with state.backend.drafting(state.model, linears=True):
            h = self.final_stage(hidden, position_ids, mask, state.cache)
            h = self.parts.norm(h)
            logits = self.parts.lm_head(h)
        return CausalLMOutputWithPast(logits=logits, hidden_states=(h,) if output_hidden_states else None)

    def observe(self, state: SpecState, result: RoundResult) -> None:
        self.counts["rejected_full"] += len(result.tree) - len(result.accepted)
