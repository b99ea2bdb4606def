"""`SpeculativeDecoder`: what users hand to `model.generate(custom_generate=...)`."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterator
from typing import Literal

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList, StopStringCriteria
from transformers.utils import logging

from hf_spec.core.compat import generate_frame_local, streamer_from_generate_frame
from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter
from hf_spec.core.registry import get_method
from hf_spec.core.specs import parse_method, resolved_config
from hf_spec.engine.batch import batched_generate
from hf_spec.engine.draft_switch import DraftSwitch
from hf_spec.engine.outputs import SpecDecodeOutput, SpecStats, combine_stats
from hf_spec.engine.rows import generate_rows, row_config
from hf_spec.engine.sequence import check_supported, speculative_generate
from hf_spec.engine.target.profile import target_profile

logger = logging.get_logger(__name__)

# building drafters loads weights (transformers' `from_pretrained` initialises on the meta device, which is not
# safe in two threads at once), fills shared caches (loaded datastores) and measures kernels: one build at a time
BUILD_LOCK = threading.RLock()


_POOLS = "_hf_spec_drafter_pools"  # a model's attribute: `_PoolsOfDecoders`
_POOLS_LOCK = threading.Lock()


class _DrafterPool:
    """One decoder's drafters for one model: the first built, and those not lent to a call now."""

    def __init__(self, first: Drafter | None = None, free: list[Drafter] | None = None) -> None:
        self.first = first
        self.free: list[Drafter] = free or []


class _PoolsOfDecoders(weakref.WeakKeyDictionary):
    """decoder -> its `_DrafterPool` for the model that holds this mapping (`model.__dict__[_POOLS]`).

    The model keeps its drafters (which hold the model) and the decoder holds neither: a model
    dropped by its user is freed with its drafters (at the next garbage collection, as any reference cycle) however
    long the decoder lives, and a decoder dropped takes its pools with it. Copies and pickles of the model start
    without drafters."""

    def __deepcopy__(self, memo) -> _PoolsOfDecoders:
        return _PoolsOfDecoders()

    def __reduce__(self):
        return (_PoolsOfDecoders, ())


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
        seed: seeds sampling (only used with `do_sample=True`): the acceptance sampler, and with `batches="plain"`
            transformers' own; with a seed, `"auto"` verifies a tree every round rather than choosing by measured
            speed, so a call repeated gives the same tokens in every `batches` mode.
        batches: how a batch (or a padded prompt) is decoded. `"batched"`: every row's tree verified in one
            target forward per round, one drafter copy per row (`hf_spec.engine.batch`; drafters with `batchable`:
            pld, retrieval, eagle, lyanna); `"rows"`: row by row with speculation (any drafter); `"auto"`
            (default): batched where the drafter allows, and there round by round a tree or a plain step,
            whichever commits more tokens per second as measured (`hf_spec.engine.draft_switch`), else rows;
            `"plain"`: transformers' own decoding, no speculation, inside the target's kernel backend (`last_stats` None).
        compile: verify with `torch.compile`d target forwards over a static KV cache, at a few fixed widths
            (`hf_spec.engine.target.compiled`): True always (hf-spec keeps a static cache on the model when
            `generate` passes none), False never, None (default) as transformers decides for `generate`: with
            `cache_implementation="static"` on an accelerator, or anywhere with a `compile_config` whose
            `_compile_all_devices` is set. Rounds a drafter verifies its own way (HiSpec, Talon), batches verified
            in one forward, and trees wider than 63 nodes run eagerly.

    Threads: one decoder may serve concurrent `generate` calls on one model (a server keeping one decoder per
    model). Every call decodes with a drafter of its own: the first one built for the model (`drafter_for`) when it
    is free, else a copy of it (`Drafter.for_another_row`) that shares the loaded, read-only parts (heads, exit
    heads, datastores, a draft model) and keeps its per-generation state to itself. Free drafters are reused by
    later calls. `last_stats` is per thread.
    """

    def __init__(
        self,
        method: str | MethodConfig | Drafter = "pld",
        tokenizer=None,
        seed: int | None = None,
        batches: Literal["auto", "batched", "rows", "plain"] = "auto",
        compile: bool | None = None,
    ):
        if batches not in ("auto", "batched", "rows", "plain"):
            raise ValueError(f"batches must be 'auto', 'batched', 'rows' or 'plain', got {batches!r}")
        if method is None or not isinstance(method, (str, MethodConfig, Drafter)):
            raise TypeError(
                "SpeculativeDecoder takes a method spec (e.g. 'pld' or 'early-exit:6'), a MethodConfig or a Drafter, "
                f"got {type(method).__name__}: {method!r:.60}"
            )
        self.batches = batches
        self.compile = compile
        self._drafter = method if isinstance(method, Drafter) else None
        # a given drafter's pool (it holds its model: the user's choice); built ones are kept by their model
        self._given = _DrafterPool(self._drafter, [self._drafter]) if self._drafter is not None else None
        self.config = method.config if isinstance(method, Drafter) else parse_method(method)
        self.tokenizer = tokenizer
        self.seed = seed
        self._lock = threading.Lock()  # guards the free lists of this decoder's drafter pools
        self._stats = threading.local()  # `last_stats` of each thread
        self._latest_stats: SpecStats | None = None  # of the latest call of any thread

    @property
    def last_stats(self) -> SpecStats | None:
        """Counters of the latest call made from this thread (from any thread if this one made none); None after a
        call decoded with `batches="plain"`."""
        return getattr(self._stats, "value", self._latest_stats)

    @last_stats.setter
    def last_stats(self, stats: SpecStats | None) -> None:
        self._stats.value = self._latest_stats = stats

    def drafter_for(self, model: PreTrainedModel) -> Drafter:
        """The first drafter of this recipe for `model` (built at the first call): the one a call decodes with when
        no other call is using it, e.g. every call of a single thread."""
        if self._drafter is not None:
            if self._drafter.model is not model:
                raise ValueError("this SpeculativeDecoder's drafter was built for another target model")
            return self._drafter
        pool = self._pool(model)
        if pool.first is None:
            with BUILD_LOCK:
                if pool.first is None:  # not built by another thread while this one waited
                    entry = get_method(self.config.method)
                    config = resolved_config(self.config)  # relative paths read from the config file's folder
                    pool.first = entry.drafter_cls(config, model, self.tokenizer)
                    pool.free = [pool.first]
        return pool.first

    def _pool(self, model: PreTrainedModel) -> _DrafterPool:
        """This decoder's drafters for `model`, kept by the model (see `_PoolsOfDecoders`)."""
        with _POOLS_LOCK:  # one lock for every decoder: two may serve one model at once
            pools = model.__dict__.get(_POOLS)
            if pools is None:
                pools = model.__dict__[_POOLS] = _PoolsOfDecoders()
            pool = pools.get(self)
            if pool is None:
                pool = pools[self] = _DrafterPool()
            return pool

    @contextlib.contextmanager
    def lend(self, model: PreTrainedModel, rows: int = 1) -> Iterator[list[Drafter]]:
        """`rows` drafters of this recipe for `model` that no other call uses until the block ends: free ones
        (`drafter_for(model)` first), then new copies of it sharing its loaded parts."""
        first = self.drafter_for(model)
        if self._drafter is not None:
            pool = self._given
        else:
            pool = self._pool(model)
        with self._lock:
            taken, pool.free[:rows] = pool.free[:rows], []
        try:
            if len(taken) < rows:
                with BUILD_LOCK:
                    taken += [first.for_another_row() for _ in range(rows - len(taken))]
            yield taken
        finally:
            with self._lock:
                pool.free.extend(taken)
                pool.free.sort(key=lambda d: d is not first)  # the first drafter is lent first

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
        mask = model_kwargs.get("attention_mask")
        if input_ids.shape[0] > 1 or (mask is not None and not bool(mask.all())):  # a batch, or padding
            return self._decode_batch(
                model, input_ids, logits_processor, stopping_criteria, generation_config, generator, streamer,
                **model_kwargs,
            )  # fmt: skip
        stats = SpecStats()
        with self.lend(model) as (drafter,):
            out = speculative_generate(
                model,
                input_ids,
                logits_processor,
                stopping_criteria,
                generation_config,
                drafter=drafter,
                streamer=streamer,
                generator=generator,
                stats=stats,
                compile=self.compile,
                **model_kwargs,
            )
        self.last_stats = stats
        return out

    def _decode_batch(
        self, model, input_ids, logits_processor, stopping_criteria, generation_config, generator, streamer,
        **model_kwargs,
    ):  # fmt: skip
        """A batch, `num_return_sequences` copies or a padded prompt, as `self.batches` says."""
        if self.batches == "plain":  # transformers' own loop, its linears and attention on hf-spec's kernels
            self.last_stats = None
            with target_profile(model).backend.plain_decoding(model), self._seeded(input_ids.device):
                return type(model)._sample(
                    model, input_ids, logits_processor, stopping_criteria, generation_config, streamer=streamer,
                    **model_kwargs,
                )  # fmt: skip
        if target_profile(
            model
        ).int8_rows:  # rows that share LLM.int8 outlier columns (engine/target/int8_rows.py)
            raise ValueError(
                "this target's bitsandbytes LLM.int8 layers pick outlier columns over all rows of a forward, so "
                "generate's output for a batch or a padded prompt depends on its other rows, which speculation "
                "cannot reproduce: use SpeculativeDecoder(..., batches='plain'), or one unpadded prompt per call"
            )
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
            if self.compile:
                logger.warning_once(
                    "hf-spec verifies a batch in one eager forward over its own cache: compile=True applies to "
                    "single sequences and to batches='rows'"
                )
            with self.lend(model, input_ids.shape[0]) as drafters:
                out, row_stats = batched_generate(
                    model, input_ids, logits_processor, stopping_criteria, generation_config, drafters, generator,
                    streamer=streamer, switch=self._switch(generation_config), **model_kwargs,
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
            with self.lend(model) as (drafter,):  # the rows one after another, with one drafter
                decode = functools.partial(
                    speculative_generate, drafter=drafter, generator=generator, compile=self.compile
                )
                out, row_stats = generate_rows(
                    model, input_ids, logits_processor, stopping_criteria, generation_config, decode, streamer,
                    **model_kwargs,
                )  # fmt: skip
        self.last_stats = combine_stats(row_stats)
        return out

    def _switch(self, generation_config) -> DraftSwitch | None:
        """`batches="auto"`'s round-by-round choice of a tree or a plain step by measured speed; none when sampling
        with a `seed`: timings differ between calls, and so would the random draws the rounds make."""
        if self.batches != "auto" or (self.seed is not None and generation_config.do_sample):
            return None
        return DraftSwitch()

    @contextlib.contextmanager
    def _seeded(self, device: torch.device) -> Iterator[None]:
        """Inside the block torch's random generator (which transformers' own sampling draws from) starts from
        `seed`; the caller's generator state is restored after it. Without a seed, nothing changes."""
        if self.seed is None:
            yield
            return
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            yield

    def __repr__(self) -> str:
        return f"SpeculativeDecoder({self.config!r})"
