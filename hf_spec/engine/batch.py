"""A batch verified in ONE target forward per round: the round engine over a rectangular cache with holes.

    prefill the left-padded prompts but their last tokens (the first roots)
    repeat: engine.step(active rows, draft=switch.draft_now())

Rows accept different numbers of tokens, so the cache stays rectangular with holes: `valid[r, j]` says whether
cache slot j holds one of row r's committed tokens, and row r's next position is its count of valid slots. When
holes fill a quarter of the cache it is squeezed; a row that stops leaves the batch (its cache rows are dropped).
Only drafters that keep their state to themselves and never touch the target's cache (`Drafter.batchable`) run
here; the others decode a batch row by row (`hf_spec.engine.rows`).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from hf_spec.core.compat import cache_kwargs, passed_cache
from hf_spec.core.drafter import Drafter, SpecState, target_forward
from hf_spec.engine.commit import Committed
from hf_spec.engine.draft_switch import DraftSwitch
from hf_spec.engine.outputs import SpecDecodeOutput, SpecStats
from hf_spec.engine.round import RoundEngine, Row
from hf_spec.engine.rows import batch_output, row_inputs
from hf_spec.engine.target.cache import cache_layers
from hf_spec.engine.target.hidden import select_hidden_states
from hf_spec.engine.target.profile import TargetProfile, target_profile
from hf_spec.engine.target.windows import target_cache, windowed_mask
from hf_spec.tree import DraftTree
from hf_spec.tree.masks import block_mask, prefill_mask

# squeeze the cache when more than this share of it (and MIN_HOLES slots) is masked in its fullest row
HOLE_SHARE = 0.25
MIN_HOLES = 16


def keep_slots(cache: DynamicCache, past: int, keep: list[list[int]]) -> int:
    """Replace each row's block `[past, ...)` by its `keep[r]` slots (relative), padded to the longest by
    repeating the last one; return that length."""
    longest = max(len(k) for k in keep)
    index = torch.tensor([k + [k[-1]] * (longest - len(k)) for k in keep], dtype=torch.long) + past
    for layer in _filled_layers(cache):
        keys, values = _slots(layer.keys, index), _slots(layer.values, index)  # only the block is copied
        layer.keys, layer.values = layer.keys[:, :, : past + longest], layer.values[:, :, : past + longest]
        layer.keys[:, :, past:], layer.values[:, :, past:] = keys, values
    return longest


def _filled_layers(cache: DynamicCache) -> list:
    return [layer for layer in cache_layers(cache) if layer.keys is not None and layer.keys.numel()]


def _slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t` `(rows, heads, slots, dim)` at each row's own slots `index` `(rows, n)` -> `(rows, heads, n, dim)`."""
    b, h, _, d = t.shape
    return t.gather(2, index.to(t.device)[:, None, :, None].expand(b, h, index.shape[1], d))


def squeeze_holes(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Move each row's valid cache slots, in order, to the right end and drop the columns no row needs; return the
    new `valid`. Attention does not depend on where a key sits (its position was applied when it was written)."""
    rows, _ = valid.shape
    longest = int(valid.sum(1).max())
    index = torch.zeros(rows, longest, dtype=torch.long)
    squeezed = torch.zeros(rows, longest, dtype=torch.bool)
    for r in range(rows):
        slots = valid[r].nonzero().flatten()
        n = len(slots)
        index[r, longest - n :], squeezed[r, longest - n :] = slots, True
        index[r, : longest - n] = slots[0] if n else 0
    for layer in _filled_layers(cache):
        layer.keys, layer.values = _slots(layer.keys, index), _slots(layer.values, index)
    return squeezed


class BatchLayout:
    """Rows side by side in one cache: `valid` `(rows, slots)` marks each row's committed slots (a CPU tensor)."""

    def __init__(self, model: PreTrainedModel, profile: TargetProfile, cache, valid: torch.Tensor) -> None:
        self.model, self.profile, self.cache = model, profile, cache
        self.valid = valid  # [rows, slots]
        self.past = valid.shape[1]

    def verify(self, rows: list[Row], trees: list[DraftTree], output_hidden_states: bool):
        width = 1 + max(len(t) for t in trees)
        self.past = self.valid.shape[1]
        # [rows, width]: the root, the tree, then fillers (the root again) that only ever see themselves
        block = torch.tensor([[row.tokens.last] for row in rows], dtype=torch.long).repeat(1, width)
        pos = torch.zeros(len(rows), width, dtype=torch.long)  # [rows, width]
        counts = self.valid.sum(1).tolist()
        for i, tree in enumerate(trees):
            block[i, 1 : 1 + len(tree)] = tree.tokens
            depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth.long()])
            pos[i, : len(tree) + 1] = depth + counts[i]
        mask = block_mask(self.valid, trees, width, self.profile.dtype).to(self.profile.device)
        if self.profile.sliding:  # each cache slot's position: its row's count of valid slots up to it
            slot_positions = torch.cat([self.valid.long().cumsum(1) - 1, pos], dim=1)
            mask = windowed_mask(self.model, mask, pos, slot_positions)
        device = self.profile.device
        return target_forward(
            self.model, self.cache, block.to(device), pos.to(device), mask, output_hidden_states
        )

    def compact(self, rows: list[Row], committed: list[Committed]) -> None:
        keep = [c.keep for c in committed]
        longest = keep_slots(self.cache, self.past, keep)
        grown = torch.zeros(len(rows), longest, dtype=torch.bool)
        for i, kept in enumerate(keep):
            grown[i, : len(kept)] = True
        self.valid = torch.cat([self.valid, grown], dim=1)
        holes = self.valid.shape[1] - int(self.valid.sum(1).max())
        if holes > max(MIN_HOLES, self.valid.shape[1] * HOLE_SHARE):
            self.valid = squeeze_holes(self.cache, self.valid)
        finished = [c.finished for c in committed]
        if any(finished):  # finished rows leave the batch
            stay = [i for i, done in enumerate(finished) if not done]
            if stay:
                self.cache.batch_select_indices(torch.tensor(stay, device=self.profile.device))
            self.valid = self.valid[stay]


def _prefill(
    model: PreTrainedModel,
    profile: TargetProfile,
    input_ids: torch.Tensor,
    pads: list[int],
    hidden_layers: tuple[int, ...] | None,
):
    """Prefill every row but its last token (its first root); pad slots are invalid for good. Returns `(cache,
    valid, the hidden states of `hidden_layers` or None)`."""
    batch, length = input_ids.shape
    cache = target_cache(model)
    valid = torch.ones(batch, length - 1, dtype=torch.bool)
    for r, n_pad in enumerate(pads):
        valid[r, :n_pad] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    hidden = None
    if length > 1:
        mask = windowed_mask(
            model, prefill_mask(valid, profile.dtype).to(profile.device), positions, positions
        )
        out = model(
            input_ids=input_ids[:, :-1],
            position_ids=positions.to(profile.device),
            attention_mask=mask,
            **cache_kwargs(model, cache),
            use_cache=True,
            output_hidden_states=hidden_layers is not None,
            logits_to_keep=1,
        )
        hidden = select_hidden_states(out.hidden_states, hidden_layers) if hidden_layers is not None else None
    return cache, valid, hidden


def batched_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    drafters: list[Drafter],
    generator: torch.Generator | None = None,
    streamer=None,
    switch: DraftSwitch | None = None,
    **model_kwargs,
) -> tuple[torch.Tensor | SpecDecodeOutput, list[SpecStats]]:
    """Speculative decoding of a left-padded batch with one verification forward per round.

    Args:
        input_ids: `torch.LongTensor` of shape `(batch_size, prompt_length)`; `model_kwargs["attention_mask"]`
            marks the left padding.
        drafters: one per row, each `batchable`.
        switch: decides round by round whether to draft or take a plain step (`None`: always draft).

    Returns:
        as `hf_spec.engine.rows.generate_rows`: the batch laid out as transformers does, and each row's `SpecStats`.
    """
    inputs = row_inputs(
        input_ids, model_kwargs.get("attention_mask"), logits_processor, stopping_criteria, generation_config,
        streamer, passed_cache(model_kwargs),
    )  # fmt: skip
    profile = target_profile(model)
    batch, length = input_ids.shape
    pads = [length - row.input_ids.shape[1] for row in inputs]
    do_sample = bool(generation_config.do_sample)
    out_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    out_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    want_hidden = drafters[0].requires_hidden_states
    screen = profile.screens(do_sample, bool(logits_processor), out_scores or out_logits)

    t0 = time.perf_counter()
    layers = drafters[0].hidden_state_layers if want_hidden else None
    cache, valid, hidden = _prefill(model, profile, input_ids, pads, layers)
    prefill_time = time.perf_counter() - t0

    rows: list[Row] = []
    for r, (ids, processors, criteria, config) in enumerate(inputs):
        state = SpecState(model, None, ids, config, backend=profile.backend)  # batchable: no cache of theirs
        if hidden is not None:
            state.hidden_states = hidden[r : r + 1, pads[r] :]
        rows.append(Row.start(drafters[r], state, processors, criteria, out_scores, out_logits))
        rows[-1].stats.time_prefill = prefill_time / batch
        drafters[r].begin(state)

    layout = BatchLayout(model, profile, cache, valid)
    engine = RoundEngine(model, profile, layout, do_sample, screen, want_hidden, generator)
    active = list(rows)  # rows still decoding, in the cache's batch order
    try:
        with profile.backend.drafting(model):
            while active:
                t0 = time.perf_counter()
                drafting = switch is None or switch.draft_now()
                committed = engine.step(active, draft=drafting)
                active = [row for row in active if not row.finished]
                if switch is not None:
                    switch.record(drafting, committed, time.perf_counter() - t0)
    finally:
        for row in rows:
            row.drafter.end(row.state)

    new = [torch.tensor(row.outputs.new_tokens, dtype=input_ids.dtype) for row in rows]
    scores = [tuple(row.outputs.scores) if out_scores else None for row in rows]
    step_logits = [tuple(row.outputs.logits) if out_logits else None for row in rows]
    stats = [row.stats for row in rows]
    return batch_output(input_ids, new, scores, step_logits, stats, generation_config), stats
