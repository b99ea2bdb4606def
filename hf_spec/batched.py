"""Batched verification: every row's draft tree verified in ONE target forward per round.

    prefill the left-padded prompts but their last tokens (the first roots)
    repeat:
        tree_r = drafter_r.propose(row r)                           # one drafter per row
        logits = target([root_r] + tree_r padded to the widest tree,  # ONE forward for the batch
                        per-row 4D mask over the shared cache, per-row positions)
        accept / commit / stop each row as the single-sequence loop does
        keep root_r + accepted_r in the cache; slots a row does not fill are masked for good

Rows accept different numbers of tokens, so the cache stays rectangular with holes: `valid[r, j]` says whether
cache slot j holds one of row r's committed tokens, and row r's next position is its count of valid slots. When
holes fill a quarter of the cache it is squeezed; a row that stops leaves the batch (its cache rows are dropped). Only drafters that keep their state to themselves and
never touch the target's cache (`Drafter.batchable`) run here; the others decode a batch row by row
(`hf_spec.rows`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from hf_spec.draft_switch import DraftSwitch
from hf_spec.generate import SpecDecodeOutput, SpecStats, commit_round
from hf_spec.kernels.grouped_attention import grouped_attention
from hf_spec.kernels.screened_head import screened_lm_head, screening_applies
from hf_spec.kernels.skinny_linear import fast_linears
from hf_spec.methods.base import Drafter, RoundResult, SpecState
from hf_spec.rows import batch_output, row_inputs
from hf_spec.tree.buffers import DraftTree
from hf_spec.verify.cache import _layers, cache_kwargs, passed_cache
from hf_spec.verify.windows import has_sliding_layers, target_cache, windowed_mask


@dataclass
class _Row:
    """One row's side of the batch: its drafter, committed tokens and counters."""

    drafter: Drafter
    state: SpecState
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    stats: SpecStats = field(default_factory=SpecStats)
    new_tokens: list[int] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def block_mask(valid: torch.Tensor, trees: list[DraftTree], width: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive `(rows, 1, width, cache_len + width)` mask: row r's queries `[root] + tree_r` see its valid cache
    slots and their tree ancestors; filler queries past a row's tree see only themselves."""
    rows, past = valid.shape
    allowed = torch.zeros(rows, width, past + width, dtype=torch.bool)
    allowed[:, :, :past] = valid[:, None, :]
    allowed[:, :, past:] = torch.eye(width, dtype=torch.bool)  # fillers (and every query) see themselves
    for r, tree in enumerate(trees):
        n = len(tree) + 1
        allowed[r, :n, past : past + n] = torch.from_numpy(tree.ancestor_matrix())
        allowed[r, n:, :past] = False
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def prefill_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive `(rows, 1, n, n)` causal mask over left-padded prompts `valid` `(rows, n)`; a padding query sees
    only itself (its output is never used, and no query row may be fully masked)."""
    n = valid.shape[1]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))[None] & valid[:, None, :]
    allowed |= torch.eye(n, dtype=torch.bool)[None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


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
    return [layer for layer in _layers(cache) if layer.keys is not None and layer.keys.numel()]


def _slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`t` `(rows, heads, slots, dim)` at each row's own slots `index` `(rows, n)` -> `(rows, heads, n, dim)`."""
    b, h, _, d = t.shape
    return t.gather(2, index.to(t.device)[:, None, :, None].expand(b, h, index.shape[1], d))


# squeeze the cache when more than this share of it (and MIN_HOLES slots) is masked in its fullest row
HOLE_SHARE = 0.25
MIN_HOLES = 16


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
        as `hf_spec.rows.generate_rows`: the batch laid out as transformers does, and each row's `SpecStats`.
    """
    inputs = row_inputs(
        input_ids, model_kwargs.get("attention_mask"), logits_processor, stopping_criteria, generation_config,
        streamer, passed_cache(model_kwargs),
    )  # fmt: skip
    batch, length = input_ids.shape
    pads = [length - row.input_ids.shape[1] for row in inputs]
    do_sample = bool(generation_config.do_sample)
    out_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    out_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    want_hidden = drafters[0].requires_hidden_states
    device, dtype = input_ids.device, model.dtype
    screen = screening_applies(model, do_sample, bool(logits_processor), out_scores or out_logits)

    # prefill every row but its last token (its first root); pad slots are invalid for good
    t0 = time.perf_counter()
    cache = target_cache(model)
    sliding = has_sliding_layers(model)
    valid = torch.ones(batch, length - 1, dtype=torch.bool)
    for r, n_pad in enumerate(pads):
        valid[r, :n_pad] = False
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    hidden = None
    if length > 1:
        mask = windowed_mask(model, prefill_mask(valid, dtype).to(device), positions, positions)
        out = model(
            input_ids=input_ids[:, :-1],
            position_ids=positions.to(device),
            attention_mask=mask,
            **cache_kwargs(model, cache),
            use_cache=True,
            output_hidden_states=want_hidden,
            logits_to_keep=1,
        )
        hidden = out.hidden_states[-1] if want_hidden else None
    prefill_time = time.perf_counter() - t0

    rows: list[_Row] = []
    for r, (ids, processors, criteria, config) in enumerate(inputs):
        # batchable drafters never touch the target's cache
        state = SpecState(model, None, ids, config)
        if hidden is not None:
            state.hidden_states = hidden[r : r + 1, pads[r] :]
        rows.append(_Row(drafters[r], state, processors, criteria))
        rows[-1].stats.time_prefill = prefill_time / batch
        drafters[r].begin(state)

    active = list(range(batch))  # rows still decoding, in the cache's batch order
    try:
        while active:
            t0 = time.perf_counter()
            in_round = list(active)
            drafting = switch is None or switch.draft_now()
            trees = []
            for r in active:
                row = rows[r]
                if not drafting:  # a plain step: one row per sequence
                    row.drafter.skip_round()
                    row.stats.plain_rounds += 1
                    trees.append(DraftTree.empty())
                    continue
                room = max(row.state.generation_config.max_length - row.state.seq_len - 1, 0)
                trees.append(row.drafter.propose(row.state, max_depth=room).truncate_depth(room))
            t1 = time.perf_counter()

            width = 1 + max(len(t) for t in trees)
            past = valid.shape[1]
            block = torch.full((len(active), width), int(input_ids[0, -1]), dtype=torch.long)
            pos = torch.zeros(len(active), width, dtype=torch.long)
            for i, (r, tree) in enumerate(zip(active, trees, strict=True)):
                block[i, 0] = int(rows[r].state.input_ids[0, -1])
                block[i, 1 : 1 + len(tree)] = tree.tokens
                depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth.long()])
                pos[i, : len(tree) + 1] = depth + int(valid[i].sum())
            mask = block_mask(valid, trees, width, dtype).to(device)
            if sliding:  # each cache slot's position: its row's count of valid slots up to it
                mask = windowed_mask(model, mask, pos, torch.cat([valid.long().cumsum(1) - 1, pos], dim=1))
            # the screened head first: `fast_linears` leaves modules it finds patched alone
            with screened_lm_head(model, enabled=screen), fast_linears(model), grouped_attention(model):
                out = model(
                    input_ids=block.to(device),
                    position_ids=pos.to(device),
                    attention_mask=mask,
                    **cache_kwargs(model, cache),
                    use_cache=True,
                    output_hidden_states=want_hidden,
                )
            logits = out.logits.float()  # [rows, width, vocab]
            t2 = time.perf_counter()

            keep, finished, committed = [], [], 0
            for i, (r, tree) in enumerate(zip(active, trees, strict=True)):
                row = rows[r]
                done = commit_round(
                    tree, logits[i], row.state.input_ids, row.processors, row.criteria, do_sample, generator,
                    row.scores if out_scores else None, row.logits if out_logits else None, row.stats,
                )  # fmt: skip
                row.state.input_ids = done.input_ids
                row.new_tokens.extend(done.new_tokens)
                committed += len(done.new_tokens)
                keep.append(done.keep)
                finished.append(done.finished)
                if not done.finished:
                    h = out.hidden_states[-1][i : i + 1, done.keep] if want_hidden else None
                    row.state.hidden_states = h
                    row.drafter.observe(row.state, RoundResult(tree, done.accepted, done.new_tokens, h))
            longest = keep_slots(cache, past, keep)
            grown = torch.zeros(len(active), longest, dtype=torch.bool)
            for i, kept in enumerate(keep):
                grown[i, : len(kept)] = True
            valid = torch.cat([valid, grown], dim=1)
            holes = valid.shape[1] - int(valid.sum(1).max())
            if holes > max(MIN_HOLES, valid.shape[1] * HOLE_SHARE):
                valid = squeeze_holes(cache, valid)
            if any(finished):  # finished rows leave the batch
                stay = [i for i, done in enumerate(finished) if not done]
                if stay:
                    cache.batch_select_indices(torch.tensor(stay, device=device))
                valid = valid[stay]
                active = [active[i] for i in stay]
            t3 = time.perf_counter()
            if switch is not None:
                switch.record(drafting, committed, t3 - t0)
            for r in in_round:  # each row of the round gets an even share of its times
                rows[r].stats.time_draft += (t1 - t0) / len(in_round)
                rows[r].stats.time_verify += (t2 - t1) / len(in_round)
                rows[r].stats.time_other += (t3 - t2) / len(in_round)
    finally:
        for row in rows:
            row.drafter.end(row.state)

    new = [torch.tensor(row.new_tokens, dtype=input_ids.dtype) for row in rows]
    scores = [tuple(row.scores) if out_scores else None for row in rows]
    step_logits = [tuple(row.logits) if out_logits else None for row in rows]
    stats = [row.stats for row in rows]
    return batch_output(input_ids, new, scores, step_logits, stats, generation_config), stats
