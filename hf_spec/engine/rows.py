"""A batch seen as rows: splitting a left-padded batch into its rows, and writing the rows back as transformers
lays out a batch.

Both batch paths use it: the batch verified in one forward (`hf_spec.engine.batch`) and the row-by-row fallback
(`generate_rows`, for drafters that share the target's cache), which strips each row's left padding, decodes it
with a cache of its own and writes the rows back as `generate` would have: the padded prompt, the new tokens,
`pad_token_id` after a row that stopped early. Logits processors and stopping criteria see every row with its
padding in front, so length-based ones (`min_new_tokens`, `max_length`, forced EOS, `suppress_tokens_at_begin`)
count exactly as in the batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import NamedTuple

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from hf_spec.core.compat import GENERATE_CACHE_KEY, passed_cache
from hf_spec.engine.outputs import SpecDecodeOutput, SpecStats, combine_stats
from hf_spec.engine.target.cache import cache_length
from hf_spec.engine.target.windows import target_cache


class _PaddedProcessors(LogitsProcessorList):
    """The batch's processors seen from one row: its left padding goes back in front of its prefix."""

    def __init__(self, processors, pad_ids: torch.Tensor) -> None:
        super().__init__(processors)
        self.pad_ids = pad_ids  # [1, num_pad]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return super().__call__(torch.cat([self.pad_ids, input_ids], dim=1), scores, **kwargs)


class _PaddedCriteria(StoppingCriteriaList):
    """The batch's stopping criteria seen from one row (see `_PaddedProcessors`)."""

    def __init__(self, criteria, pad_ids: torch.Tensor) -> None:
        super().__init__(criteria)
        self.pad_ids = pad_ids  # [1, num_pad]

    @property
    def pad_length(self) -> int:
        """Positions in front of the row that the criteria count (its left padding)."""
        return self.pad_ids.shape[1]

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.BoolTensor:
        return super().__call__(torch.cat([self.pad_ids, input_ids], dim=1), scores, **kwargs)


def left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[int]:
    """Number of left-padding positions of each row of `input_ids` `(batch, length)`; other padding raises."""
    batch, length = input_ids.shape
    if attention_mask is None:
        return [0] * batch
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids {tuple(input_ids.shape)}"
        )
    pads = []
    for r, row in enumerate(attention_mask.bool()):
        n_pad = length - int(row.sum())
        if n_pad == length:
            raise ValueError(f"row {r} of the batch is all padding (its attention_mask is all zeros)")
        if row[:n_pad].any() or not row[n_pad:].all():
            raise ValueError(
                f"row {r} of the batch is not left-padded: hf-spec needs the "
                "padding on the left (tokenizer.padding_side = 'left'), as transformers does for decoder-only models"
            )
        pads.append(n_pad)
    return pads


def row_config(generation_config, n_pad: int):
    """The generation config of a row with `n_pad` left-padding positions, decoded without them."""
    config = copy.deepcopy(generation_config)
    config.max_length, config.num_return_sequences = generation_config.max_length - n_pad, 1
    return config


def _row_processors(
    processors: LogitsProcessorList, row: int, batch: int, pad_ids: torch.Tensor
) -> LogitsProcessorList:
    """One row's copies of the batch's processors: state kept per batch is cut to the row, or refused."""
    out = []
    for p in processors:
        if isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            raise ValueError(
                "guidance_scale (classifier-free guidance) keeps one unconditional cache for the whole batch: "
                "with hf-spec, pass one prompt per generate call"
            )
        p = copy.copy(p)  # a fresh per-row state for processors that set theirs up at the first call
        if isinstance(p, PrefixConstrainedLogitsProcessor):
            p._prefix_allowed_tokens_fn = _for_row(p._prefix_allowed_tokens_fn, row)
        elif isinstance(p, RepetitionPenaltyLogitsProcessor) and isinstance(
            p.prompt_ignore_length, torch.Tensor
        ):
            p.prompt_ignore_length = p.prompt_ignore_length[row : row + 1]
        elif isinstance(p, EncoderRepetitionPenaltyLogitsProcessor):
            source = row // (batch // p.encoder_input_ids.shape[0])  # rows repeated by num_return_sequences
            p.encoder_input_ids = p.encoder_input_ids[source : source + 1]
        elif isinstance(p, EncoderNoRepeatNGramLogitsProcessor):
            source = row // (batch // p.batch_size)
            p.generated_ngrams, p.batch_size = [p.generated_ngrams[source]], 1
        out.append(p)
    return _PaddedProcessors(out, pad_ids) if pad_ids.shape[1] else LogitsProcessorList(out)


def _for_row(fn: Callable, row: int) -> Callable:
    """`prefix_allowed_tokens_fn` with the row's own batch index (a lone row would otherwise be batch 0)."""
    return lambda _batch_id, sent: fn(row, sent)


def _filler(like: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """A finished row's score at a later step: log-probability 0 for padding, -inf elsewhere."""
    fill = torch.full_like(like, float("-inf"))
    if pad_token_id is not None:
        fill[:, pad_token_id] = 0.0
    return fill


class RowInputs(NamedTuple):
    """One row of a left-padded batch as the single-sequence loop takes it."""

    input_ids: torch.Tensor  # `(1, length - num_pad)`, the row without its padding
    processors: LogitsProcessorList
    criteria: StoppingCriteriaList
    generation_config: GenerationConfig


def row_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    streamer=None,
    cache=None,
) -> list[RowInputs]:
    """Split a left-padded batch into its rows; refuse what a batch cannot have (a streamer, a filled cache)."""
    if streamer is not None:
        raise ValueError(
            "a streamer takes one sequence: with batch size > 1 (or num_return_sequences > 1) drop `streamer`"
        )
    if cache is not None and cache_length(cache) > 0:
        raise ValueError("hf-spec cannot continue a batched, pre-filled cache")
    pads = left_padding(input_ids, attention_mask)
    rows = []
    for r, n_pad in enumerate(pads):
        pad_ids = input_ids[r : r + 1, :n_pad]
        rows.append(
            RowInputs(
                input_ids[r : r + 1, n_pad:],
                _row_processors(logits_processor, r, len(pads), pad_ids),
                _PaddedCriteria(stopping_criteria, pad_ids) if n_pad else stopping_criteria,
                row_config(generation_config, n_pad),
            )
        )
    return rows


def batch_output(
    input_ids: torch.Tensor,
    new_tokens: list[torch.Tensor],
    scores: list[tuple | None],
    logits: list[tuple | None],
    stats: list[SpecStats],
    generation_config: GenerationConfig,
) -> torch.Tensor | SpecDecodeOutput:
    """The rows' new tokens (and per-step scores / logits) laid out as transformers lays out a batch."""
    pad_token_id = generation_config.pad_token_id
    if isinstance(pad_token_id, list):
        pad_token_id = pad_token_id[0]
    sequences = assemble_rows(input_ids, new_tokens, pad_token_id)
    if not generation_config.return_dict_in_generate:
        return sequences
    steps = sequences.shape[1] - input_ids.shape[1]
    return SpecDecodeOutput(
        sequences=sequences,
        scores=stack_steps(scores, steps, pad_token_id),
        logits=stack_steps(logits, steps, pad_token_id),
        spec_stats=combine_stats(stats).to_dict(),
    )


def generate_rows(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    decode_row: Callable[..., torch.Tensor | SpecDecodeOutput],
    streamer=None,
    **model_kwargs,
) -> tuple[torch.Tensor | SpecDecodeOutput, list[SpecStats]]:
    """Decode a batch row by row with `decode_row` (the speculative loop for one sequence).

    Args:
        input_ids: `torch.LongTensor` of shape `(batch_size, prompt_length)`, left-padded as the
            `attention_mask` in `model_kwargs` says (rows repeated by `num_return_sequences` included).
        decode_row: called as `decode_row(model, row_ids, processors, criteria, row_config, stats=..., **kwargs)`.

    Returns:
        (`torch.LongTensor` of shape `(batch_size, prompt_length + longest_new)`, or `SpecDecodeOutput`
        with `return_dict_in_generate=True`; the rows' `SpecStats`). Rows that stop early are filled with
        `pad_token_id`; their `scores` / `logits` at later steps give padding log-probability 0 and every
        other token -inf. The batch's KV cache is not returned: each row had its own.
    """
    rows = row_inputs(
        input_ids, model_kwargs.pop("attention_mask", None), logits_processor, stopping_criteria,
        generation_config, streamer, passed_cache(model_kwargs, pop=True),
    )  # fmt: skip
    model_kwargs.pop("position_ids", None)  # each row counts its positions from its first real token
    new_tokens, outputs, stats = [], [], []
    for row in rows:
        stats.append(SpecStats())
        out = decode_row(
            model, *row, stats=stats[-1], **{GENERATE_CACHE_KEY: target_cache(model)}, **model_kwargs
        )
        sequence = out.sequences if isinstance(out, SpecDecodeOutput) else out
        new_tokens.append(sequence[0, row.input_ids.shape[1] :])
        outputs.append(out if isinstance(out, SpecDecodeOutput) else None)
    scores = [o.scores if o is not None else None for o in outputs]
    logits = [o.logits if o is not None else None for o in outputs]
    return batch_output(input_ids, new_tokens, scores, logits, stats, generation_config), stats


def assemble_rows(input_ids: torch.Tensor, new: list[torch.Tensor], pad_token_id: int | None) -> torch.Tensor:
    """The padded prompts `(batch, length)` and each row's new tokens -> `(batch, length + longest)`, rows that
    stopped early filled with `pad_token_id`."""
    length, longest = input_ids.shape[1], max(len(t) for t in new)
    if pad_token_id is None and any(len(t) < longest for t in new):
        raise ValueError(
            "rows of the batch stopped at different lengths and there is no pad_token_id to fill them"
        )
    fill = pad_token_id if pad_token_id is not None else 0
    sequences = torch.full((len(new), length + longest), fill, dtype=input_ids.dtype, device=input_ids.device)
    sequences[:, :length] = input_ids
    for r, tokens in enumerate(new):
        sequences[r, length : length + len(tokens)] = tokens.to(input_ids.device)
    return sequences


def stack_steps(per_row: list, steps: int, pad_token_id: int | None) -> tuple[torch.Tensor, ...] | None:
    """Per-row tuples of `(1, vocab)` step tensors -> a tuple of `(batch, vocab)`, finished rows filled."""
    if per_row[0] is None:
        return None
    fill = _filler(next(row[0] for row in per_row if row), pad_token_id)
    return tuple(
        torch.cat([row[t] if t < len(row) else fill for row in per_row], dim=0) for t in range(steps)
    )
