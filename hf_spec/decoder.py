"""`SpeculativeDecoder`: what users hand to `model.generate(custom_generate=...)`."""

from __future__ import annotations

import weakref

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList, StopStringCriteria

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


class SpeculativeDecoder:
    """A speculative decoding recipe usable as `custom_generate`.

    Example:
        >>> decoder = SpeculativeDecoder("pld")                    # or "early-exit:6", a config, a Drafter
        >>> out = model.generate(**inputs, max_new_tokens=64, custom_generate=decoder)
        >>> decoder.last_stats.tau

    Args:
        method: a registry spec (`"name"` or `"name:arg"`), a `MethodConfig`, or a ready `Drafter`.
        tokenizer: passed to drafters that need one.
        seed: seeds the acceptance sampler (only used with `do_sample=True`).
    """

    def __init__(self, method: str | MethodConfig | Drafter = "pld", tokenizer=None, seed: int | None = None):
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
        self.last_stats = SpecStats()
        return speculative_generate(
            model,
            input_ids,
            logits_processor,
            stopping_criteria,
            generation_config,
            drafter=self.drafter_for(model),
            streamer=streamer,
            generator=generator,
            stats=self.last_stats,
            **model_kwargs,
        )

    def __repr__(self) -> str:
        return f"SpeculativeDecoder({self.config!r})"
