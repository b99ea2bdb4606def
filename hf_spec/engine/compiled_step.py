"""A drafter's own forward compiled at a few fixed widths, over a static KV cache of its own.

A head drafter (EAGLE/HASS, EAGLE-3, Lyanna) feeds a different number of rows to its head from call to call: the
positions a round accepted (catch-up), a tree level's beam, a chain step. Compiled as it is, every new row count
would compile again. `CompiledStep` pads one call's rows to the next width in `WIDTHS` (filler rows repeat the last
row and see only their own slot), pads the mask over the whole static cache (`hf_spec.tree.masks.padded_block_mask`)
and lets the cache's device length say where keys go, so every shape is fixed per width. The widths up to
`max_width` compile together the first time a kind of call (its rows' trailing shapes) is met; nothing compiles
after that. Calls wider than `max_width`, or too close to the cache's end, run eagerly over the same cache (its
layers are `RewindableStaticLayer`s: eager forwards see the filled slots, as over a dynamic cache).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import Cache
from transformers.cache_utils import StaticLayer

from hf_spec.core.compat import call_without_output_capture
from hf_spec.engine.target.compiled import RECOMPILE_LIMIT, WIDTHS, CompileSettings, bucket, whole_buffer_call
from hf_spec.engine.target.module_guards import GuardedCompile
from hf_spec.engine.target.static import RewindableStaticLayer
from hf_spec.tree.masks import causal_mask, padded_block_mask

logger = logging.getLogger(__name__)

# graphs dynamo may keep for one step function: its code object is shared by every `CompiledStep` (every drafter,
# every kind of call, every width), and the set each one compiles is bounded by construction
STEP_RECOMPILE_LIMIT = 4 * RECOMPILE_LIMIT


def rewindable_cache(capacity: int, layers: int = 1) -> Cache:
    """An empty static cache of `layers` full-attention layers of `capacity` slots, rewindable for good."""
    return Cache(
        layers=[RewindableStaticLayer.adopt(StaticLayer(max_cache_len=capacity)) for _ in range(layers)]
    )


def pad_rows(rows: torch.Tensor, width: int) -> torch.Tensor:
    """`(1, n, ...)` -> `(1, width, ...)`: the last row repeated into the filler rows; always a new tensor with
    contiguous strides (a view of a longer sequence has other strides, and a compiled graph guards on them)."""
    n = rows.shape[1]
    if n == width:
        return rows.clone(memory_format=torch.contiguous_format)
    return torch.cat([rows, rows[:, -1:].expand(rows.shape[0], width - n, *rows.shape[2:])], dim=1)


@dataclass(frozen=True)
class StepSpec:
    """A drafter step to compile (`draft_steps`): `step(*rows, mask, cache)` and how `CompiledStep` runs it.

    Args:
        step: the eager step.
        max_width: the widest call compiled (wider ones run eagerly).
        layers: the cache layers `step` writes (None: all).
        extra_slots: slots `step` writes after its rows' (a tree's provisional levels); dropped after each call.
        row_outputs: True: `step` returns `(1, n, hidden)`, one row per input row; False: a tuple of tensors whose
            shapes do not depend on the rows (a whole draft tree), returned as they are.
    """

    step: Callable
    max_width: int
    layers: range | None = None
    extra_slots: int = 0
    row_outputs: bool = True


class CompiledStep:
    """`step(*rows, mask, cache)` compiled per width over `cache`; called exactly as `step` is.

    Args:
        step: the eager forward `step(*rows, mask, cache)` returning `(1, n, hidden)`: every tensor in `rows` holds
            the call's `n` rows on dim 1 (features, token ids, positions), `mask` is additive
            `(1, 1, n, past + n)` over the cache's `past` filled slots and the rows (None: causal). With
            `row_outputs` False it returns a tuple of tensors of fixed shapes instead, and may write
            `extra_slots` more slots after the rows' (the cache keeps the rows' only).
        cache: the cache `step` writes into, its layers `RewindableStaticLayer`s (`rewindable_cache`).
        settings: how to compile (`hf_spec.engine.target.compiled.CompileSettings`).
        max_width: the widest call compiled (rounded up to a width in `WIDTHS`); wider ones run eagerly.
        layers: the cache layers `step` writes (default all): a drafter running the target's first layers writes
            those only.
        modules: the modules `step` runs, summarized once a generation in place of dynamo's guards on them
            (`hf_spec.engine.target.module_guards`); empty: dynamo keeps those guards.
        extra_slots, row_outputs: as in `StepSpec`.
    """

    def __init__(
        self,
        step: Callable,
        cache: Cache,
        settings: CompileSettings,
        max_width: int,
        layers: range | None = None,
        modules: tuple[nn.Module, ...] = (),
        extra_slots: int = 0,
        row_outputs: bool = True,
    ) -> None:
        self.layers = [cache.layers[i] for i in (layers if layers is not None else range(len(cache.layers)))]
        if not all(isinstance(layer, RewindableStaticLayer) for layer in self.layers):
            raise TypeError("a compiled drafter step needs a rewindable static cache (rewindable_cache)")
        self.step, self.cache, self.settings, self.modules = step, cache, settings, modules
        self.extra_slots, self.row_outputs = extra_slots, row_outputs
        self.capacity = min(layer.max_cache_len for layer in self.layers)
        self.widths = tuple(w for w in WIDTHS if w <= (bucket(max_width) or WIDTHS[-1]))
        # (modules' token, rows' trailing shapes and dtypes) of the calls compiled for
        self.kinds: set[tuple] = set()
        self.compiled_calls = self.eager_calls = 0
        self.failed: str | None = None  # why this step could not be compiled (it then runs eagerly)
        self._forward: GuardedCompile | None = None
        self._device: torch.device | None = None

    def _full(self, *rows_and_mask):
        *rows, mask = rows_and_mask
        return call_without_output_capture(self.step, *rows, mask, self.cache)

    def _compiled(self, device: torch.device) -> GuardedCompile:
        if self._forward is None:
            self._device = device
            self._forward = GuardedCompile(self._full, self.settings, device, self.modules)
        return self._forward

    def new_generation(self) -> None:
        """A generation begins: the modules are summarized again at its first compiled call."""
        if self._forward is not None:
            self._forward.new_generation()

    @property
    def past(self) -> int:
        return self.layers[0].length

    def __call__(self, *args) -> torch.Tensor:
        *rows, mask, cache = args
        if cache is not self.cache:
            raise ValueError("a compiled drafter step writes into the cache it was built over")
        n, past = rows[0].shape[1], self.past
        width = bucket(n)
        # eagerly: too wide, too close to the cache's end, or buffers not allocated yet (the first call allocates
        # them outside any graph, at the shapes its keys have)
        fits = (
            width is not None
            and width <= self.widths[-1]
            and past + width + self.extra_slots <= self.capacity
        )
        if self.failed or not fits or not all(layer.is_initialized for layer in self.layers):
            self.eager_calls += 1
            return self.step(*rows, mask, cache)
        if mask is None:  # causal over the cache, as the eager step reads None
            dtype = next(r.dtype for r in rows if r.is_floating_point())
            mask = causal_mask(n, past, dtype, rows[0].device)
        guarded = self._compiled(mask.device)
        guarded.current()  # a generation's first call summarizes the modules (`guarded.token`)
        kind = (guarded.token, *((tuple(r.shape[2:]), r.dtype) for r in rows))
        try:
            if kind not in self.kinds:  # every width of this kind now, so none compiles in a later round
                self.kinds.add(kind)
                self._warm_up(rows, past, mask.dtype)
            out = self._run(rows, padded_block_mask(mask, past, width, self.capacity), past, n, width)
        except torch._dynamo.exc.TorchDynamoException as err:
            # drafting only proposes: eager drafts give the same output
            self.failed = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            logger.warning("the drafter step cannot be compiled (%s); it runs eagerly", self.failed)
            logger.debug("why the drafter step cannot be compiled", exc_info=True)
            for layer in self.layers:
                layer.crop_to(past)
            self.eager_calls += 1
            return self.step(*rows, mask, cache)
        self.compiled_calls += 1
        return out

    def _run(self, rows, mask: torch.Tensor, past: int, n: int, width: int) -> torch.Tensor:
        forward = self._compiled(mask.device).current()
        cuda_graphs = (
            self._device.type == "cuda" and self.settings.mode_for(self._device) == "reduce-overhead"
        )
        padded = [pad_rows(r, width) for r in rows]
        out = whole_buffer_call(
            forward, self.layers, past, width, cuda_graphs, STEP_RECOMPILE_LIMIT, *padded, mask
        )
        for layer in self.layers:  # the rows' slots stay, the fillers' are dropped
            layer.crop_to(past + n)
        # drafters keep states across calls, and a CUDA graph's outputs are overwritten by its next replay
        return out[:, :n].clone() if self.row_outputs else tuple(t.clone() for t in out)

    def _warm_up(self, rows, past: int, dtype: torch.dtype) -> None:
        """Compile every width for calls like `rows`: one row repeated, the cache left at `past` slots."""
        one = [r[:, :1] for r in rows]
        mask = causal_mask(1, past, dtype, rows[0].device)
        for width in self.widths:
            if past + width + self.extra_slots > self.capacity:
                break
            logger.info("compiling the drafter step for %d rows", width)
            self._run(one, padded_block_mask(mask, past, width, self.capacity), past, 1, width)
            for layer in self.layers:
                layer.crop_to(past)


def draft_steps(
    owner: object,
    cache: Cache,
    settings: CompileSettings | None,
    steps: dict[str, StepSpec | tuple[Callable, int, range | None]],
    modules: tuple[nn.Module, ...] = (),
) -> dict[str, Callable]:
    """A drafter's steps as it calls them in this generation. `steps` maps a name to a `StepSpec` (or its first
    fields, `(step, max_width, layers)`): in an eager generation (`settings` None) the step itself, else a
    `CompiledStep` of it over `cache` running `modules`. The compiled ones are kept on `owner` and given again while
    the settings and the cache object are the same, so a later generation compiles nothing."""
    specs = {name: spec if isinstance(spec, StepSpec) else StepSpec(*spec) for name, spec in steps.items()}
    if settings is None:
        return {name: spec.step for name, spec in specs.items()}
    kept = owner.__dict__.get("_hf_spec_draft_steps")
    if kept is not None and kept[0] == settings and kept[1]() is cache:
        for step in kept[2].values():
            step.new_generation()
        return kept[2]
    compiled = {
        name: CompiledStep(
            spec.step,
            cache,
            settings,
            spec.max_width,
            spec.layers,
            modules,
            spec.extra_slots,
            spec.row_outputs,
        )
        for name, spec in specs.items()
    }
    owner.__dict__["_hf_spec_draft_steps"] = (settings, weakref.ref(cache), compiled)
    return compiled
