"""The one decoding loop behind every hf-spec method.

    prefill the prompt but its last token (the first root)
    repeat:
        tree   = drafter.propose(state)                      # draft
        logits = target([root] + tree, 4D tree mask, cache)  # ONE target forward (drafter.verify_forward)
        path, bonus = accept(tree, logits)                   # greedy or recursive rejection sampling
        commit path + bonus (cut at EOS / stop criteria / max length), stream them
        compact the KV cache to root + path                  # bonus becomes the next root
        drafter.observe(result)

`speculative_generate` has the signature of a transformers decoding method, so it runs as
`model.generate(..., custom_generate=SpeculativeDecoder(...))` after transformers has prepared the
generation config, logits processors and stopping criteria exactly as for plain decoding.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers import __version__ as transformers_version
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_spec.kernels.grouped_attention import grouped_attention
from hf_spec.kernels.screened_head import screened_lm_head, screening_applies
from hf_spec.methods.base import Drafter, RoundResult, SpecState
from hf_spec.tree.buffers import DraftTree
from hf_spec.verify.acceptance import Acceptance, accept_greedy, accept_sampling
from hf_spec.verify.cache import (
    OUTPUT_CACHE_FIELD,
    cache_kwargs,
    cache_length,
    check_rewindable,
    compact_cache,
    crop_cache,
    passed_cache,
)
from hf_spec.verify.compat import check_tree_verification
from hf_spec.verify.forward import verification_inputs
from hf_spec.verify.windows import attention_windows, rewindable_cache


@dataclass
class SpecStats:
    """Counters of one generation. `tau` = committed tokens per target forward (plain decoding = 1.0)."""

    new_tokens: int = 0
    target_forwards: int = 0
    draft_tokens: int = 0  # proposed nodes, summed over rounds
    accepted_tokens: int = 0  # accepted draft nodes
    plain_rounds: int = 0  # batch rounds that took a plain step: drafting did not pay (`DraftSwitch`)
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    time_prefill: float = 0.0
    # [d-1]: rounds whose draft reached depth d with the first d-1 accepted / of those, rounds accepting depth d
    depth_tries: list[int] = field(default_factory=list)
    depth_hits: list[int] = field(default_factory=list)

    def record_round(self, draft_depth: int, accepted: int) -> None:
        """Count a round for the conditional acceptance rate by draft depth (HASS Fig. 5, Lyanna Table 1)."""
        grow = draft_depth - len(self.depth_tries)
        if grow > 0:
            self.depth_tries.extend([0] * grow)
            self.depth_hits.extend([0] * grow)
        for d in range(min(accepted + 1, draft_depth)):
            self.depth_tries[d] += 1
            self.depth_hits[d] += int(accepted > d)

    @property
    def tau(self) -> float:
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def draft_utilization(self) -> float:
        return self.accepted_tokens / max(self.draft_tokens, 1)

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": self.tau,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_utilization": self.draft_utilization,
            "plain_rounds": self.plain_rounds,
            "time_prefill": self.time_prefill,
            "time_draft": self.time_draft,
            "time_verify": self.time_verify,
            "time_other": self.time_other,
            "depth_tries": list(self.depth_tries),
            "depth_hits": list(self.depth_hits),
        }


@dataclass
class SpecDecodeOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `spec_stats` (see `SpecStats.to_dict`)."""

    spec_stats: dict | None = None


def check_supported(
    model: PreTrainedModel, input_ids: torch.Tensor, generation_config, model_kwargs: dict
) -> None:
    """Raise a clear error for settings the speculative loop cannot honour."""
    if model.config.is_encoder_decoder:
        raise ValueError("hf-spec supports decoder-only models; encoder-decoder models are not supported")
    attention_windows(model)  # raises for layer types a tree cannot be verified with
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("hf-spec does not support beam search (num_beams > 1)")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError("hf-spec returns one sequence; num_return_sequences must be 1")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative_generate decodes one sequence; got batch size {input_ids.shape[0]} "
            "(SpeculativeDecoder decodes a batch row by row)"
        )
    if model_kwargs.get("inputs_embeds") is not None or input_ids.shape[1] == 0:
        raise ValueError(
            "hf-spec needs the prompt as input_ids (a prompt given only as inputs_embeds is not supported)"
        )
    for name in ("prompt_lookup_num_tokens", "assistant_early_exit"):
        if getattr(generation_config, name, None) is not None:
            raise ValueError(
                f"hf-spec already speculates: drop `{name}` (transformers' own assisted decoding)"
            )
    if generation_config.return_dict_in_generate:
        for name in ("output_attentions", "output_hidden_states"):
            if getattr(generation_config, name, False):
                raise ValueError(f"hf-spec does not return attentions or hidden states: drop `{name}`")
    for name in ("penalty_alpha", "dola_layers"):
        if getattr(generation_config, name, None) is not None:
            raise ValueError(f"hf-spec cannot combine speculation with `{name}`")
    if not model_kwargs.get("use_cache", True):
        raise ValueError("hf-spec needs the KV cache (use_cache=True)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("hf-spec does not support padded inputs: pass the unpadded prompt (batch size 1)")
    check_tree_verification(model)  # once per model: a small tree against plain forwards


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    drafter: Drafter,
    streamer=None,
    generator: torch.Generator | None = None,
    stats: SpecStats | None = None,
    **model_kwargs,
) -> torch.Tensor | SpecDecodeOutput:
    """Speculative decoding of one sequence.

    Args:
        input_ids: `torch.LongTensor` of shape `(1, prompt_length)`.
        logits_processor / stopping_criteria / generation_config: as prepared by `model.generate`.
        drafter: proposes the trees.
        streamer: receives the committed tokens in order, once each (the prompt is put by `generate`).
        stats: filled with this generation's counters (a fresh `SpecStats` is used when omitted).

    Returns:
        `torch.LongTensor` of shape `(1, total_length)`, or `SpecDecodeOutput` with
        `return_dict_in_generate=True`.
    """
    cache = passed_cache(model_kwargs)
    if cache is None:
        if not model_kwargs.get("use_cache", True):
            raise ValueError("hf-spec needs the KV cache (use_cache=True)")
        raise ValueError(
            f"hf-spec found no KV cache among the model_kwargs `generate` passed ({sorted(model_kwargs)}); "
            f"transformers {transformers_version} may hand it over under a new name that this hf-spec "
            "does not know"
        )
    cache = rewindable_cache(model, cache)
    check_rewindable(cache)  # before any forward, not at the first round's rewind
    check_supported(model, input_ids, generation_config, model_kwargs)
    stats = stats if stats is not None else SpecStats()
    want_hidden = drafter.requires_hidden_states
    do_sample = bool(generation_config.do_sample)
    out_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    out_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores_out: list[torch.Tensor] = []
    logits_out: list[torch.Tensor] = []
    device = input_ids.device
    # greedy rounds that read nothing but each row's argmax verify with the int8-screened LM head
    screen = screening_applies(model, do_sample, bool(logits_processor), out_scores or out_logits)

    # prefill everything but the last prompt token: it is the first root
    t0 = time.perf_counter()
    state = SpecState(model, cache, input_ids, generation_config)
    past = cache_length(cache)
    if past > input_ids.shape[1]:
        raise ValueError(
            f"the cache holds {past} tokens but the prompt only {input_ids.shape[1]}: pass the whole sequence "
            "the cache was built from, followed by the new tokens"
        )
    if (
        past == input_ids.shape[1]
    ):  # the whole prompt is cached: its last token is fed again as the first root
        past -= 1
        crop_cache(cache, past)
    if input_ids.shape[1] - 1 > past:
        out = model(
            input_ids=input_ids[:, past:-1],
            position_ids=torch.arange(past, input_ids.shape[1] - 1, device=device).unsqueeze(0),
            **cache_kwargs(model, cache),
            use_cache=True,
            output_hidden_states=want_hidden,
            logits_to_keep=1,
        )
        if want_hidden:
            state.hidden_states = out.hidden_states[-1]
    stats.time_prefill = time.perf_counter() - t0

    # few-row attention without repeat_kv copies (prefill and one-row steps keep sdpa)
    with grouped_attention(model):
        drafter.begin(state)
        finished = False
        try:
            while not finished:
                t0 = time.perf_counter()
                room = generation_config.max_length - state.seq_len  # tokens we may still commit
                tree = drafter.propose(state, max_depth=max(room - 1, 0)).truncate_depth(max(room - 1, 0))
                t1 = time.perf_counter()

                past = state.seq_len - 1
                verify_ids, position_ids, mask = verification_inputs(model, input_ids[:, -1:], tree, past)
                # the stock full target forward, unless the drafter continues one it began (HiSpec)
                with screened_lm_head(model, enabled=screen):
                    out = drafter.verify_forward(state, tree, verify_ids, position_ids, mask, want_hidden)
                logits = out.logits[0].float()  # [num_nodes + 1, vocab_size]
                t2 = time.perf_counter()

                done = commit_round(
                    tree, logits, input_ids, logits_processor, stopping_criteria, do_sample, generator,
                    scores_out if out_scores else None, logits_out if out_logits else None, stats,
                )  # fmt: skip
                input_ids, new_tokens, keep, finished = (
                    done.input_ids,
                    done.new_tokens,
                    done.keep,
                    done.finished,
                )
                state.input_ids = input_ids
                compact_cache(cache, past, keep)
                if streamer is not None:
                    streamer.put(torch.tensor(new_tokens))
                if not finished:
                    hidden = out.hidden_states[-1][:, keep] if want_hidden else None
                    state.hidden_states = hidden
                    preds = logits.argmax(-1) if drafter.requires_target_predictions else None
                    drafter.observe(state, RoundResult(tree, done.accepted, new_tokens, hidden, preds))
                t3 = time.perf_counter()
                stats.time_draft += t1 - t0
                stats.time_verify += t2 - t1
                stats.time_other += t3 - t2
        finally:
            drafter.end(state)
            if streamer is not None:
                streamer.end()

    if generation_config.return_dict_in_generate:
        return SpecDecodeOutput(
            sequences=input_ids,
            scores=tuple(scores_out) if out_scores else None,
            logits=tuple(logits_out) if out_logits else None,
            **{OUTPUT_CACHE_FIELD: cache if generation_config.use_cache else None},
            spec_stats=stats.to_dict(),
        )
    return input_ids


@dataclass
class Committed:
    """What one round committed (see `commit_round`)."""

    input_ids: torch.Tensor  # `(1, seq_len)`, the committed tokens with this round's
    new_tokens: list[int]  # accepted + bonus, cut at a stop
    accepted: list[int]  # accepted node indices
    keep: list[int]  # block slots whose keys stay cached: the root (0) and accepted node i at i + 1
    finished: bool  # a stopping criterion fired


def commit_round(
    tree: DraftTree,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    do_sample: bool,
    generator: torch.Generator | None,
    scores_out: list[torch.Tensor] | None,
    logits_out: list[torch.Tensor] | None,
    stats: SpecStats,
) -> Committed:
    """Accept `tree` against its verification logits `(num_nodes + 1, vocab)` and commit token by token until a
    stopping criterion fires; append the returned scores / logits where asked (lists) and count the round."""
    score_row = _scorer(logits, input_ids, tree, logits_processor)
    acc: Acceptance = (
        accept_sampling(tree, score_row, generator) if do_sample else accept_greedy(tree, score_row)
    )
    tokens = tree.tokens.tolist()
    new_tokens: list[int] = []
    finished = False
    for j, tok in enumerate([tokens[i] for i in acc.accepted] + [acc.bonus]):
        input_ids = torch.cat([input_ids, torch.tensor([[tok]], device=input_ids.device)], dim=1)
        new_tokens.append(tok)
        if scores_out is not None:
            scores_out.append(acc.scores[j][None].clone())
        # criteria see what plain decoding shows them: every score so far, or None
        if bool(stopping_criteria(input_ids, tuple(scores_out) if scores_out is not None else None).all()):
            finished = True
            break
    keep = [0] + [i + 1 for i in acc.accepted]
    if logits_out is not None:
        logits_out.extend(logits[k][None].clone() for k in keep[: len(new_tokens)])
    stats.target_forwards += 1
    stats.new_tokens += len(new_tokens)
    stats.draft_tokens += len(tree)
    stats.accepted_tokens += len(acc.accepted)
    stats.record_round(int(tree.depth.max()) if len(tree) else 0, len(acc.accepted))
    return Committed(input_ids, new_tokens, acc.accepted, keep, finished)


def sum_counts(lists) -> list[int]:
    """Element-wise sum of count lists of different lengths."""
    total: list[int] = []
    for counts in lists:
        total.extend([0] * (len(counts) - len(total)))
        for d, c in enumerate(counts):
            total[d] += c
    return total


def _scorer(logits: torch.Tensor, input_ids: torch.Tensor, tree: DraftTree, processors: LogitsProcessorList):
    """Row scores with the logits processors applied to the row's own prefix (committed + accepted path)."""
    if not processors:
        return lambda row, path: logits[row]
    tokens = tree.tokens.to(input_ids.device)

    def score_row(row: int, path: list[int]) -> torch.Tensor:
        prefix = torch.cat([input_ids, tokens[path].view(1, -1)], dim=1) if path else input_ids
        return processors(prefix, logits[row : row + 1].clone())[0]

    return score_row


def _streamer_from_generate_frame():
    """transformers' `generate` drops `streamer` before calling a callable `custom_generate` (5.x); read it
    back from that `generate` frame, the direct caller."""
    return generate_frame_local("streamer")


def generate_frame_local(name: str, max_hops: int = 6):
    """A local variable of the nearest enclosing transformers `generate` call (None outside one)."""
    from transformers.generation.utils import GenerationMixin

    generate_code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    try:
        for _ in range(max_hops):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            if frame.f_code is generate_code:
                return frame.f_locals.get(name)
        return None
    finally:
        del frame
