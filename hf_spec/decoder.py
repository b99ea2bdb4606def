"""`SpeculativeDecoder`: what users hand to `model.generate(custom_generate=...)`."""

from __future__ import annotations

import functools
import weakref
from typing import Literal

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList, StopStringCriteria
from transformers.utils import logging

from hf_spec.config import MethodConfig
from hf_spec.generate import (
    SpecDecodeOutput,
    SpecStats,
    _streamer_from_generate_frame,
    generate_frame_local,
    speculative_generate,
)
from hf_spec.methods.base import Drafter
from hf_spec.registry import get_method, parse_method
from hf_spec.rows import combine_stats, generate_rows

logger = logging.get_logger(__name__)


class SpeculativeDecoder:
    """A speculative decoding recipe usable as `custom_generate`.

    Example:
        >>> decoder = SpeculativeDecoder("pld")                    # or "early-exit:6", a config, a Drafter
        >>> out = model.generate(**inputs, max_new_tokens=64, custom_generate=decoder)
        >>> decoder.last_stats.tau

    A batch (left-padded, as transformers wants for decoder-only models) is decoded one row at a time with the
    same drafter and written back as transformers lays out a batch (see `hf_spec.rows.generate_rows`).

    Args:
        method: a registry spec (`"name"` or `"name:arg"`), a `MethodConfig`, or a ready `Drafter`.
        tokenizer: passed to drafters that need one.
        seed: seeds the acceptance sampler (only used with `do_sample=True`).
        batches: `"rows"` (default) decodes a batch row by row with speculation; `"plain"` hands a batch to
            transformers' own decoding unchanged (no speculation, `last_stats` None), which is faster where a
            batched step costs much less per row than a single one (small models, larger batches).
    """

    def __init__(
        self,
        method: str | MethodConfig | Drafter = "pld",
        tokenizer=None,
        seed: int | None = None,
        batches: Literal["rows", "plain"] = "rows",
    ):
        if batches not in ("rows", "plain"):
            raise ValueError(f"batches must be 'rows' or 'plain', got {batches!r}")
        self.batches = batches
        self._drafter = method if isinstance(method, Drafter) else None
        self.config = method.config if isinstance(method, Drafter) else parse_method(method)
        self.tokenizer = tokenizer
        self.seed = seed
        self._drafters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
        streamer = model_kwargs.pop("streamer", None) or _streamer_from_generate_frame()
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
            # (num_return_sequences copies are rows too): one row at a time, or transformers' own loop
            if self.batches == "plain":
                self.last_stats = None
                return type(model)._sample(
                    model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
                    **model_kwargs,
                )  # fmt: skip
            if input_ids.shape[0] > 1:
                logger.warning_once(
                    "hf-spec decodes a batch one row at a time; with small models or larger batches plain batched "
                    "decoding can be faster (SpeculativeDecoder(..., batches='plain'))"
                )
            out, row_stats = generate_rows(
                model,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                decode,
                streamer,
                **model_kwargs,
            )
            self.last_stats = combine_stats(row_stats)
            return out
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

    def __repr__(self) -> str:
        return f"SpeculativeDecoder({self.config!r})"
