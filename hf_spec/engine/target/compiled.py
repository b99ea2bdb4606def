"""The verification forward compiled: the target at a few fixed widths over a static cache.

A tree's size changes every round; a compiled forward recompiles for every new input shape. So the block
`[root] + tree` is padded to the next width in `WIDTHS` (filler rows repeat the root, sit at its position and see
only their own slot; their logits are dropped and their slots lie past the kept ones, overwritten later), the
mask covers the whole static cache (`hf_spec.tree.masks.padded_tree_mask`), and the cache's own tensor length
says where keys go. Every shape is then fixed per width: each width compiles once (`fullgraph=True`; on CUDA
`mode="reduce-overhead"`, CUDA graphs) and nothing recompiles as the sequence grows.

`CompiledVerifier` is kept on the model per static cache object (`compiled_verifier`), as transformers keeps its
compiled decoding step, so later `generate` calls reuse what earlier ones compiled.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from transformers import PreTrainedModel, StaticCache

from hf_spec.core.compat import GENERATE_CACHE_KEY, cache_kwargs
from hf_spec.engine.target.module_guards import GuardedCompile, cpu_wrapper_options
from hf_spec.engine.target.static import RewindableStaticLayer, is_static, static_capacity, static_size
from hf_spec.engine.target.windows import has_sliding_layers, windowed_mask
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.masks import padded_tree_mask, tree_position_ids

logger = logging.getLogger(__name__)

WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # verification block widths, each compiled once
RECOMPILE_LIMIT = 8 * len(
    WIDTHS
)  # graphs of the verification forward dynamo may keep (widths x hidden states)


@dataclass(frozen=True)
class CompileSettings:
    """How the verification forward is compiled (`torch.compile`'s arguments; `fullgraph` is always on).

    Args:
        backend: `torch.compile` backend.
        mode: `torch.compile` mode; None: `"reduce-overhead"` (CUDA graphs) on CUDA, inductor's default elsewhere.
        options: backend options.
    """

    backend: str = "inductor"
    mode: str | None = None
    options: dict | None = field(default=None, hash=False, compare=False)

    @classmethod
    def from_compile_config(cls, config) -> CompileSettings:
        """From transformers' `CompileConfig` (`generation_config.compile_config`), or the defaults for None."""
        if config is None:
            return cls()
        return cls(backend=config.backend, mode=config.mode, options=config.options)

    def mode_for(self, device: torch.device) -> str | None:
        if self.mode is not None:
            return None if self.mode == "default" else self.mode
        return "reduce-overhead" if device.type == "cuda" else None

    def options_for(self, device: torch.device) -> dict:
        """The backend options on `device`: the caller's, over inductor's C++ wrapper (`cpu_wrapper_options`) where
        inductor compiles for the CPU without a mode."""
        options = dict(self.options or {})
        if device.type == "cpu" and self.mode_for(device) is None and self.backend == "inductor":
            options = {**cpu_wrapper_options(), **options}  # the caller's own choice wins
        return options


def bucket(rows: int) -> int | None:
    """The smallest width in `WIDTHS` holding `rows` query rows (None: wider than the widest)."""
    return next((w for w in WIDTHS if w >= rows), None)


class CompiledVerifier:
    """The target's verification forward over one static cache, compiled per width.

    Args:
        model: the target.
        cache: a static cache whose layers are `RewindableStaticLayer`s while hf-spec decodes.
        settings: how to compile.
    """

    def __init__(self, model: PreTrainedModel, cache, settings: CompileSettings) -> None:
        self.model, self.cache, self.settings = model, cache, settings
        self.capacity = static_capacity(cache)
        self.sliding = has_sliding_layers(model)
        self._cache_kwargs = cache_kwargs(model, cache)  # looked up here: not traced
        self.widths_compiled: set[tuple[int, int, bool]] = set()  # (modules' token, width, hidden states)
        self.compiled_calls = 0
        device = model.device
        self._forward = GuardedCompile(self._step, settings, device, modules=(model,))
        self._cuda_graphs = device.type == "cuda" and settings.mode_for(device) == "reduce-overhead"

    def _step(self, input_ids, position_ids, mask, output_hidden_states: bool):
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            **self._cache_kwargs,
            use_cache=True,
            output_hidden_states=output_hidden_states,
        )
        return out.logits, out.hidden_states

    def width_for(self, tree: DraftTree, past: int) -> int | None:
        """The compiled width for `[root] + tree` after `past` cached slots, or None (too wide, or too close to
        the cache's end: the round runs eagerly)."""
        width = bucket(len(tree) + 1)
        if width is None or past + width > self.capacity:
            return None
        return width

    @torch.no_grad()
    def __call__(
        self, root: torch.Tensor, tree: DraftTree, past: int, width: int, output_hidden_states: bool
    ):
        """Verify `[root] + tree` after `past` slots at `width` rows. Returns an object with `.logits`
        `(1, num_nodes + 1, vocab)` and `.hidden_states` (each `(1, num_nodes + 1, hidden)`, or None).

        Args:
            root: `torch.LongTensor` of shape `(1, 1)`, the last committed token.
        """
        n, device = len(tree) + 1, root.device
        ids = root.repeat(1, width)
        ids[0, 1:n] = tree.tokens.to(device)
        positions = torch.full((1, width), past, dtype=torch.long, device=device)
        positions[:, :n] = tree_position_ids(tree, past, device)
        mask = padded_tree_mask(tree, past, width, self.capacity, self.model.dtype, device)
        if self.sliding:  # slot i holds position i before the block; block slots their rows' positions
            keys = torch.arange(self.capacity, device=device)[None].clone()
            keys[:, past : past + width] = positions
            mask = windowed_mask(self.model, mask, positions, keys)
        forward = self._forward.current()
        key = (self._forward.token, width, output_hidden_states)
        if key not in self.widths_compiled:
            logger.info("compiling the verification forward for %d rows", width)
            self.widths_compiled.add(key)
        # one graph per width, more than dynamo's default recompile limit for one function; a guard on global state
        # (a model class used for the first time) recompiles them all once more
        logits, hidden = whole_buffer_call(
            forward, self.cache.layers, past, width, self._cuda_graphs, RECOMPILE_LIMIT,
            ids, positions, mask, output_hidden_states,
        )  # fmt: skip
        self.compiled_calls += 1
        hidden = tuple(h[:, :n] for h in hidden) if hidden is not None else None
        return SimpleNamespace(logits=logits[:, :n], hidden_states=hidden)

    def new_generation(self) -> None:
        """A generation begins: the modules are summarized again at its first compiled call
        (`hf_spec.engine.target.module_guards`)."""
        self._forward.new_generation()

    def warm_up(self, root: torch.Tensor, past: int, output_hidden_states: bool) -> None:
        """Compile every width not compiled yet (that fits after `past` slots) before the first round, so none
        compiles during a generation; the cache is left holding its `past` slots."""
        self._forward.current()
        for width in WIDTHS:
            key = (self._forward.token, width, output_hidden_states)
            if key in self.widths_compiled or past + width > self.capacity:
                continue
            tree = DraftTree.chain([int(root[0, 0])] * (width - 1))
            self(root, tree, past, width, output_hidden_states)
        for layer in self.cache.layers:
            layer.crop_to(past)


def whole_buffer_call(forward, layers, past: int, width: int, cuda_graphs: bool, recompile_limit: int, *args):
    """`forward(*args)`, a compiled forward writing `width` slots after `past` into the static `layers` (each a
    `RewindableStaticLayer`): the block goes after the committed slots whatever a drafter left above them, the
    layers take the stock whole-buffer update during the call, and hold `past + width` slots after it."""
    for layer in layers:
        layer.crop_to(past)
        layer.sync_device_length()
        layer.sliced = False
    try:
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch._dynamo.config.patch(recompile_limit=recompile_limit):
            out = forward(*args)
    finally:
        for layer in layers:
            layer.sliced = True
    for layer in layers:
        layer.advance(width)
    return out


def compiled_verifier(model: PreTrainedModel, cache, settings: CompileSettings) -> CompiledVerifier:
    """The model's `CompiledVerifier` for `cache` (built on first use, kept on the model for later calls with the
    same cache object and settings)."""
    kept = model.__dict__.get("_hf_spec_compiled_verifier")
    if kept is not None and kept.cache is cache and kept.settings == settings:
        kept.new_generation()
        return kept
    if not all(isinstance(layer, RewindableStaticLayer) for layer in cache.layers):
        raise TypeError("a compiled verification needs a static cache (cache_implementation='static')")
    verifier = CompiledVerifier(model, cache, settings)
    model.__dict__["_hf_spec_compiled_verifier"] = verifier
    return verifier


def compile_settings(
    model: PreTrainedModel, cache, generation_config, compile: bool | None
) -> CompileSettings | None:
    """Whether this generation verifies compiled, and how: `compile=True` always, `False` never; None follows
    transformers' rule for `generate`: a static cache on an accelerator, or anywhere with a `compile_config`
    whose `_compile_all_devices` is set; `generation_config.disable_compile` turns it off."""
    if compile is False or (compile is None and getattr(generation_config, "disable_compile", False)):
        return None
    settings = CompileSettings.from_compile_config(getattr(generation_config, "compile_config", None))
    if compile:
        return settings
    if not is_static(cache):
        return None
    return (
        settings
        if model._valid_auto_compile_criteria({GENERATE_CACHE_KEY: cache}, generation_config)
        else None
    )


def owned_static_cache(model: PreTrainedModel, cache, max_length: int):
    """For `compile=True` without a static cache: hf-spec's own `StaticCache`, kept on the model and reused (reset)
    by later calls as `generate` reuses its own, so compiled widths are not compiled again. `cache` (what
    `generate` passed) must be empty."""
    if cache is not None and int(cache.get_seq_length()) > 0:
        raise ValueError(
            "compile=True verifies over a static cache: pass cache_implementation='static' (or a StaticCache) "
            "to continue a filled cache"
        )
    kept = model.__dict__.get("_hf_spec_static_cache")
    if kept is not None and static_capacity(kept) >= static_size(max_length):
        kept.reset()
        return kept
    kept = StaticCache(config=model.config, max_cache_len=static_size(max_length))
    model.__dict__["_hf_spec_static_cache"] = kept
    return kept
