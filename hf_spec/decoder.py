"""`SpeculativeDecoder`: what users hand to `model.generate(custom_generate=...)`."""

from __future__ import annotations

import functools
import weakref
from typing import Literal

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList, StopStringCriteria
from transformers.utils import logging

from hf_spec.compat import generate_frame_local, streamer_from_generate_frame
from hf_spec.config import MethodConfig
from hf_spec.draft_switch import DraftSwitch
from hf_spec.engine.batch import batched_generate
from hf_spec.engine.profile import target_profile
from hf_spec.engine.rows import generate_rows, row_config
from hf_spec.engine.sequence import check_supported, speculative_generate
from hf_spec.methods.base import Drafter
from hf_spec.outputs import SpecDecodeOutput, SpecStats, combine_stats
from hf_spec.registry import get_method, parse_method

logger = logging.get_logger(__name__)


class SpeculativeDecoder:
    """A speculative decoding recipe usable as `custom_generate`.

    Example:
        >>> decoder = SpeculativeDecoder("pld")                    # or "early-exit:6", a config, a Drafter
        >>> out = model.generate(**inputs, max_new_tokens=64, custom_generate=decoder)
        >>> decoder.last_stats.tau

    A batch (left-padded, as transformers wants for decoder-only models) is verified in one forward per round
    where the drafter allows it, else decoded row by row; either way it is written back as transformers lays out a
    batch (see `batches`).

    Args:
        method: a registry spec (`"name"` or `"name:arg"`), a `MethodConfig`, or a ready `Drafter`.
        tokenizer: passed to drafters that need one.
        seed: seeds the acceptance sampler (only used with `do_sample=True`).
        batches: how a batch (or a padded prompt) is decoded. `"batched"`: every row's tree verified in one
            target forward per round, one drafter copy per row (`hf_spec.engine.batch`; drafters with `batchable`:
            pld, retrieval, eagle, lyanna); `"rows"`: row by row with speculation (any drafter); `"auto"`
            (default): batched where the drafter allows, and there round by round a tree or a plain step,
            whichever commits more tokens per second as measured (`hf_spec.draft_switch`), else rows;
            `"plain"`: transformers' own decoding, no speculation, inside the target's kernel backend (`last_stats` None).
    """

    def __init__(
        self,
        method: str | MethodConfig | Drafter = "pld",
        tokenizer=None,
        seed: int | None = None,
        batches: Literal["auto", "batched", "rows", "plain"] = "auto",
    ):
        if batches not in ("auto", "batched", "rows", "plain"):
            raise ValueError(f"batches must be 'auto', 'batched', 'rows' or 'plain', got {batches!r}")
        self.batches = batches
        self._drafter = method if isinstance(method, Drafter) else None
        self.config = method.config if isinstance(method, Drafter) else parse_method(method)
        self.tokenizer = tokenizer
        self.seed = seed
        self._drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._row_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.last_stats: SpecStats | None = None  # counters of the latest call

    def drafter_for(self, model: PreTrainedModel) -> Drafter:
        if self._drafter is not None:
            if self._drafter.model is not model:
                raise ValueError("this SpeculativeDecoder's drafter was built for another target model")
            return self._drafter
        if model not in self._drafters:
            entry = get_method(self.config.method)
            self._drafters[model] = entry.drafter_cls(self.config, model, self.tokenizer)
        return self._drafters[model]

    def row_drafters(self, model: PreTrainedModel, rows: int) -> list[Drafter]:
        """`rows` drafters of this recipe for `model`, each with per-generation state of its own."""
        pool = self._row_pools.setdefault(model, [self.drafter_for(model)])
        while len(pool) < rows:
            pool.append(pool[0].for_another_row())
        return pool[:rows]

    def __call__(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config,
        stop_strings: str | list[str] | None = None,
        **model_kwargs,
    ) -> torch.Tensor | SpecDecodeOutput:
        # transformers drops `streamer` and `tokenizer` before calling a callable custom_generate; `stop_strings`
        # is declared here so transformers hands it to us, and we build its criterion with our tokenizer
        streamer = model_kwargs.pop("streamer", None) or streamer_from_generate_frame()
        if generate_frame_local("assistant_model") is not None:  # transformers drops it for custom_generate
            raise ValueError(
                "custom_generate=SpeculativeDecoder(...) already speculates: drop assistant_model (to pass an hf-spec "
                "drafter as assistant_model, see hf_spec.integrations.enable_assistant)"
            )
        if stop_strings:
            tokenizer = model_kwargs.pop("tokenizer", None) or self.tokenizer
            if tokenizer is None:
                raise ValueError(
                    "stop_strings needs a tokenizer: build the decoder with SpeculativeDecoder(..., tokenizer=tok) "
                    "(transformers does not pass generate's `tokenizer` to custom_generate callables)"
                )
            stopping_criteria = StoppingCriteriaList(
                [*stopping_criteria, StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)]
            )
        model_kwargs.pop("synced_gpus", None)
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=input_ids.device).manual_seed(self.seed)
        decode = functools.partial(speculative_generate, drafter=self.drafter_for(model), generator=generator)
        mask = model_kwargs.get("attention_mask")
        if input_ids.shape[0] > 1 or (mask is not None and not bool(mask.all())):  # a batch, or padding
            return self._decode_batch(
                model, input_ids, logits_processor, stopping_criteria, generation_config, decode, generator,
                streamer, **model_kwargs,
            )  # fmt: skip
        self.last_stats = SpecStats()
        return decode(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            streamer=streamer,
            stats=self.last_stats,
            **model_kwargs,
        )

    def _decode_batch(
        self, model, input_ids, logits_processor, stopping_criteria, generation_config, decode, generator, streamer,
        **model_kwargs,
    ):  # fmt: skip
        """A batch, `num_return_sequences` copies or a padded prompt, as `self.batches` says."""
        if self.batches == "plain":  # transformers' own loop, its linears and attention on hf-spec's kernels
            self.last_stats = None
            with target_profile(model).backend.plain_decoding(model):
                return type(model)._sample(
                    model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
                    **model_kwargs,
                )  # fmt: skip
        one_row = {k: v for k, v in model_kwargs.items() if k != "attention_mask"}
        check_supported(model, input_ids[:1], row_config(generation_config, 0), one_row)  # settings, once
        drafter = self.drafter_for(model)
        batched = self.batches == "batched" or (self.batches == "auto" and drafter.batchable)
        if batched and not drafter.batchable:
            raise ValueError(
                f"{self.config.method} cannot draft for a batch verified in one forward (batches='batched'): "
                "it shares the target's cache or forward; use batches='rows'"
            )
        if batched:
            out, row_stats = batched_generate(
                model, input_ids, logits_processor, stopping_criteria, generation_config,
                self.row_drafters(model, input_ids.shape[0]), generator, streamer=streamer,
                switch=DraftSwitch() if self.batches == "auto" else None, **model_kwargs,
            )  # fmt: skip
        else:
            if input_ids.shape[0] > 1:
                why = (
                    "batches='rows'"
                    if drafter.batchable
                    else f"{self.config.method} shares the target's cache"
                )
                logger.warning_once(
                    f"hf-spec decodes this batch one row at a time ({why}); with small models or larger batches "
                    "plain batched decoding can be faster (SpeculativeDecoder(..., batches='plain'))"
                )
            out, row_stats = generate_rows(
                model, input_ids, logits_processor, stopping_criteria, generation_config, decode, streamer,
                **model_kwargs,
            )  # fmt: skip
        self.last_stats = combine_stats(row_stats)
        return out

    def __repr__(self) -> str:
        return f"SpeculativeDecoder({self.config!r})"
