"""Speculative decoding of one sequence: the round engine over a single row and the target's own cache.

    prefill the prompt but its last token (the first root)
    repeat: engine.step([row])     # propose -> one target forward -> accept -> commit -> compact -> observe

`speculative_generate` has the signature of a transformers decoding method, so it runs as
`model.generate(..., custom_generate=SpeculativeDecoder(...))` after transformers has prepared the generation
config, logits processors and stopping criteria exactly as for plain decoding.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers import __version__ as transformers_version

from hf_spec.core.compat import OUTPUT_CACHE_FIELD, cache_kwargs, passed_cache
from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.engine.commit import Committed
from hf_spec.engine.outputs import SpecDecodeOutput, SpecStats
from hf_spec.engine.round import RoundEngine, Row
from hf_spec.engine.target.cache import cache_length, check_rewindable, crop_cache
from hf_spec.engine.target.check import check_tree_verification
from hf_spec.engine.target.compiled import (
    CompiledVerifier,
    compile_settings,
    compiled_verifier,
    owned_static_cache,
)
from hf_spec.engine.target.forward import verification_inputs
from hf_spec.engine.target.hidden import select_hidden_states
from hf_spec.engine.target.int8_rows import prompt_forward
from hf_spec.engine.target.profile import TargetProfile, target_profile
from hf_spec.engine.target.static import check_static_cache, is_static, rewindable_static_cache
from hf_spec.engine.target.windows import rewindable_cache
from hf_spec.tree import DraftTree


class SequenceLayout:
    """One row whose cache slot `i` holds position `i`: the verification block goes after the committed tokens and
    is compacted in place; the drafter's `verify_forward` runs the forward (HiSpec and Talon continue one they
    began while drafting), or with `compiled`, the compiled forward where the drafter verifies with the stock one
    and the block fits a compiled width."""

    def __init__(
        self, model: PreTrainedModel, profile: TargetProfile, cache, compiled: CompiledVerifier | None = None
    ) -> None:
        self.model, self.profile, self.cache, self.compiled = model, profile, cache, compiled
        self.past = 0

    def compiled_width(self, rows: list[Row], trees: list[DraftTree]) -> int | None:
        """The compiled width this round verifies at, or None (eager)."""
        (row,), (tree,) = rows, trees
        if self.compiled is None or type(row.drafter).verify_forward is not Drafter.verify_forward:
            return None
        return self.compiled.width_for(tree, row.state.seq_len - 1)

    def verify(self, rows: list[Row], trees: list[DraftTree], output_hidden_states: bool):
        (row,), (tree,) = rows, trees
        self.past = row.state.seq_len - 1
        root = row.state.input_ids[:, -1:]
        width = self.compiled_width(rows, trees)
        if width is not None:
            row.stats.compiled_rounds += 1
            return self.compiled(root, tree, self.past, width, output_hidden_states)
        ids, positions, mask = verification_inputs(self.model, root, tree, self.past, self.profile.backend)
        return row.drafter.verify_forward(row.state, tree, ids, positions, mask, output_hidden_states)

    def compact(self, rows: list[Row], committed: list[Committed]) -> None:
        self.profile.backend.compact_cache(self.cache, self.past, committed[0].keep)


def check_supported(
    model: PreTrainedModel, input_ids: torch.Tensor, generation_config, model_kwargs: dict
) -> None:
    """Raise a clear error for settings the speculative loop cannot honour."""
    if model.config.is_encoder_decoder:
        raise ValueError("hf-spec supports decoder-only models; encoder-decoder models are not supported")
    target_profile(model)  # raises for layer types a tree cannot be verified with
    if (generation_config.num_beams or 1) > 1:
        raise ValueError("hf-spec does not support beam search (num_beams > 1)")
    if (generation_config.num_return_sequences or 1) > 1:
        raise ValueError("hf-spec returns one sequence; num_return_sequences must be 1")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative_generate decodes one sequence; got batch size {input_ids.shape[0]} "
            "(SpeculativeDecoder decodes a batch)"
        )
    if input_ids.shape[1] == 0 and model_kwargs.get("inputs_embeds") is None:
        raise ValueError(
            "the prompt is empty (input_ids holds 0 tokens): hf-spec continues a prompt of at least one token "
            "(e.g. the tokenizer's BOS token)"
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


def _rewindable_passed_cache(model: PreTrainedModel, model_kwargs: dict):
    cache = passed_cache(model_kwargs)
    if cache is None:
        if not model_kwargs.get("use_cache", True):
            raise ValueError("hf-spec needs the KV cache (use_cache=True)")
        raise ValueError(
            f"hf-spec found no KV cache among the model_kwargs `generate` passed ({sorted(model_kwargs)}); "
            f"transformers {transformers_version} may hand it over under a new name that this hf-spec "
            "does not know"
        )
    return rewindable_cache(model, cache)


def _prefill(
    model: PreTrainedModel,
    cache,
    input_ids: torch.Tensor,
    state: SpecState,
    hidden_layers: tuple[int, ...] | None,
) -> None:
    """Feed the prompt but its last token (the first root) into `cache`, after what it already holds; with
    `hidden_layers` (`Drafter.hidden_state_layers`), put those layers' states in `state.hidden_states`."""
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
        # an LLM.int8 target's rows share outlier columns: it takes the whole prompt in one forward, as `generate`
        # does, and its last token leaves the cache again (it is the first root; `hf_spec.engine.target.int8_rows`)
        whole = target_profile(model).int8_rows
        end = input_ids.shape[1] - (not whole)
        with prompt_forward(model, input_ids.shape[1], record=whole):
            out = model(
                input_ids=input_ids[:, past:end],
                position_ids=torch.arange(past, end, device=input_ids.device).unsqueeze(0),
                **cache_kwargs(model, cache),
                use_cache=True,
                output_hidden_states=hidden_layers is not None,
                logits_to_keep=1,
            )
        if whole:
            crop_cache(cache, input_ids.shape[1] - 1)
        if hidden_layers is not None:
            hidden = select_hidden_states(out.hidden_states, hidden_layers)
            state.hidden_states = hidden[:, : input_ids.shape[1] - 1 - past]


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
    compile: bool | None = None,
    **model_kwargs,
) -> torch.Tensor | SpecDecodeOutput:
    """Speculative decoding of one sequence.

    Args:
        input_ids: `torch.LongTensor` of shape `(1, prompt_length)`.
        logits_processor / stopping_criteria / generation_config: as prepared by `model.generate`.
        drafter: proposes the trees.
        streamer: receives the committed tokens in order, once each (the prompt is put by `generate`).
        stats: filled with this generation's counters (a fresh `SpecStats` is used when omitted).
        compile: verify with the compiled forward over a static cache (`hf_spec.engine.target.compiled`); None:
            as transformers decides for `generate` (a static cache on an accelerator, or `compile_config`).

    Returns:
        `torch.LongTensor` of shape `(1, total_length)`, or `SpecDecodeOutput` with
        `return_dict_in_generate=True`.
    """
    cache = _rewindable_passed_cache(model, model_kwargs)
    if is_static(cache):
        check_static_cache(cache)  # before any forward
    check_supported(model, input_ids, generation_config, model_kwargs)
    settings = compile_settings(model, cache, generation_config, compile)
    # a static cache hf-spec sizes holds `max_length` tokens, or `max_cache_len` where that is larger (transformers'
    # ceiling across calls, so later calls reuse the cache and what was compiled over it)
    longest = max(generation_config.max_length, getattr(generation_config, "max_cache_len", None) or 0)
    if settings is not None and not is_static(cache):
        cache = owned_static_cache(model, cache, longest)
    static = rewindable_static_cache(cache, longest) if is_static(cache) else contextlib.nullcontext(cache)
    with static:
        check_rewindable(cache)  # before any forward, not at the first round's rewind
        compiled = compiled_verifier(model, cache, settings) if settings is not None else None
        return _generate(
            model, cache, input_ids, logits_processor, stopping_criteria, generation_config, drafter, streamer,
            generator, stats, compiled,
        )  # fmt: skip


def _generate(
    model: PreTrainedModel,
    cache,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    drafter: Drafter,
    streamer,
    generator: torch.Generator | None,
    stats: SpecStats | None,
    compiled: CompiledVerifier | None,
) -> torch.Tensor | SpecDecodeOutput:
    profile = target_profile(model)
    want_hidden = drafter.requires_hidden_states
    do_sample = bool(generation_config.do_sample)
    out_scores = bool(generation_config.return_dict_in_generate and generation_config.output_scores)
    out_logits = bool(generation_config.return_dict_in_generate and generation_config.output_logits)
    # greedy rounds that read nothing but each row's argmax may verify with a screened LM head
    screen = profile.screens(do_sample, bool(logits_processor), out_scores or out_logits)

    t0 = time.perf_counter()
    state = SpecState(
        model, cache, input_ids, generation_config, backend=profile.backend,
        compile_settings=compiled.settings if compiled is not None else None,
    )  # fmt: skip
    _prefill(model, cache, input_ids, state, drafter.hidden_state_layers if want_hidden else None)
    row = Row.start(drafter, state, logits_processor, stopping_criteria, out_scores, out_logits, streamer)
    if stats is not None:
        row.stats = stats
    row.stats.time_prefill = time.perf_counter() - t0
    if compiled is not None and type(drafter).verify_forward is Drafter.verify_forward:
        compiled.warm_up(
            input_ids[:, -1:], input_ids.shape[1] - 1, want_hidden
        )  # no compiling mid-generation

    engine = RoundEngine(
        model,
        profile,
        SequenceLayout(model, profile, cache, compiled),
        do_sample,
        screen,
        want_hidden,
        generator,
    )
    # a compiled verification traces the target's own modules: the backend's patches stay off it
    with contextlib.nullcontext() if compiled is not None else profile.backend.drafting(model):
        drafter.begin(state)
        try:
            while not row.finished:
                engine.step([row])
        finally:
            drafter.end(state)
            if streamer is not None:
                streamer.end()

    sequences = row.tokens.view().clone()
    if generation_config.return_dict_in_generate:
        return SpecDecodeOutput(
            sequences=sequences,
            scores=tuple(row.outputs.scores) if out_scores else None,
            logits=tuple(row.outputs.logits) if out_logits else None,
            **{OUTPUT_CACHE_FIELD: cache if generation_config.use_cache else None},
            spec_stats=row.stats.to_dict(),
        )
    return sequences
