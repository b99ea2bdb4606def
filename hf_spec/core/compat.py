"""Shims for the transformers versions hf-spec supports (5.x), in one place.

- The KV cache's name: transformers 5.24 renamed the decoding-method argument, the forward argument and the output
  field `past_key_values` to `cache` (the old names stay deprecated until 5.40 for forwards and 6.0 for
  `generate`). hf-spec reads a cache under either name and passes it by the name the installed version and the
  called forward take.
- Output capturing: transformers' hooks that collect layer outputs read a context variable, which `torch.compile`
  cannot trace; a compiled call of a model's layers (not of the model) switches them off as a compiled model
  forward does (`call_without_output_capture`).
- Arguments `generate` drops: transformers 5.x does not hand `streamer` (nor `assistant_model`, nor the
  `custom_generate` value itself) to a callable `custom_generate`; hf-spec reads them back from the calling
  `generate` frame.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from transformers import Cache
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

try:  # transformers 5.x
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # a version without output-capturing hooks
    _OUTPUT_COLLECTOR = None

# the key under which `generate` hands a decoding method the KV cache in `model_kwargs` (5.24+: "cache")
GENERATE_CACHE_KEY = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)
# the field of `generate`'s output dataclasses that holds the KV cache (5.24+: "cache")
OUTPUT_CACHE_FIELD = (
    "cache"
    if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    else "past_key_values"
)


_CACHE_NAMES: dict[type, str] = {}


def forward_cache_name(cls: type) -> str:
    """The name under which `cls.forward` takes the KV cache (`cache` or `past_key_values`), looked up once a class
    (a plain dict, not `functools.cache`: compiled drafter steps trace this lookup, and dynamo warns on a cached
    function's wrapper)."""
    name = _CACHE_NAMES.get(cls)
    if name is None:
        name = _CACHE_NAMES[cls] = _forward_cache_name(cls)
    return name


def _forward_cache_name(cls: type) -> str:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        params = {}
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return GENERATE_CACHE_KEY  # `*args, **kwargs` forwards (wrappers): the installed transformers' name


def cache_kwargs(module: torch.nn.Module, cache) -> dict:
    """`{name: cache}` for a forward of `module` (a model or a decoder layer), by the name its forward takes."""
    return {forward_cache_name(type(module)): cache}


def call_without_output_capture(fn, *args):
    """`fn(*args)` with transformers' output-capturing hooks inactive: what a model forward does while no output is
    asked for, done the way dynamo traces (inside `torch.compile` the collector is a plain attribute), for calls
    of a model's layers outside its forward."""
    if _OUTPUT_COLLECTOR is None:
        return fn(*args)
    token = _OUTPUT_COLLECTOR.set(None)
    try:
        return fn(*args)
    finally:
        _OUTPUT_COLLECTOR.reset(token)


def passed_cache(model_kwargs: dict, pop: bool = False) -> Cache | None:
    """The KV cache `generate` put in `model_kwargs` (either name); `pop` removes it."""
    get = model_kwargs.pop if pop else model_kwargs.get
    found = [get(name, None) for name in ("cache", "past_key_values")]
    return next((c for c in found if c is not None), None)


def generate_frame_local(name: str, max_hops: int = 6):
    """A local variable of the nearest enclosing transformers `generate` call (None outside one)."""
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


def streamer_from_generate_frame():
    """The `streamer` given to the calling `generate` (5.x drops it before a callable `custom_generate`)."""
    return generate_frame_local("streamer")


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Each decoder layer's attention type and cache-layer keyword arguments (`sliding_window`, ...), from
    transformers' `get_layer_types_and_kwargs`, which returns one dict per layer from 5.24 and one dict for every
    layer before."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):
        kwargs = [kwargs] * len(types)
    return list(types), list(kwargs)
