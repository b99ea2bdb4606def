"""Compiled rounds without dynamo's per-call guards on the modules they run.

Before every call of a compiled function dynamo checks its guards: for a target's verification forward thousands of
them (each parameter's size, strides and aliasing, every module attribute the trace read), host time that a CPU
round pays on every call. Nearly all of them guard the modules, which do not change while a generation runs.

So on CPU, where `torch.compile` can filter guards (`guard_filter_fn`) and give each compile call its own compiled
entries (`isolate_recompiles`), hf-spec's compiled functions drop the guards whose source lies in an `nn.Module`
(`torch.compiler.skip_guard_on_all_nn_modules_unsafe`) and keep every other one (the call's tensors, globals).
What those guards checked is checked once per generation instead: `structure_token` summarizes the modules a
function runs (their classes and tree, training flags, hooks, instance attributes and replaced forwards, the
metadata of every parameter, buffer and tensor they hold, their configs' values), and `GuardedCompile` keeps one
isolated compiled function per token. A module changed between generations (weights of another shape, a hook, a
patched forward, `set_attn_implementation`) gives another token, which compiles anew, as dynamo's guards would
have. Parameters are read from their modules at every call, so weights changed in place or replaced by tensors
of the same metadata need no new compilation either way. (vLLM goes further and skips dynamo's guards
altogether.)

On CUDA, with older torch builds, or where a caller names no modules, nothing changes: dynamo keeps all its guards.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from collections import OrderedDict
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn
from transformers import PretrainedConfig

from hf_spec.core import envs

logger = logging.getLogger(__name__)

# compiled functions kept per `GuardedCompile` (one per token); an older one is dropped past this
MAX_TOKENS = 4
_SIMPLE = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)
_MAX_ITEMS = 64  # a container summarized item by item up to this many items, by its length and type beyond
_MAX_DEPTH = 4  # objects followed from a module's attributes (a weight wrapper, a config, a closure's cell)


def cpu_wrapper_options() -> dict:
    """Inductor options for hf-spec's compiled CPU rounds: the C++ wrapper (`cpp_wrapper`), built apart from the
    kernels (`cpp_wrapper_build_separate`), so a forward's few hundred kernel and operator calls are made from
    compiled code rather than from Python, at about the same compile time (`lab/quantized_cpu/cpp_wrapper_ab.py`).
    Empty off Linux (where it has not been tried), where this torch lacks either option, or with
    `HF_SPEC_CPP_WRAPPER=0`; a caller's `compile_config.options` override them."""
    import torch._inductor.config as inductor_config

    if not envs.HF_SPEC_CPP_WRAPPER or not sys.platform.startswith("linux"):
        return {}
    names = ("cpp_wrapper", "cpp_wrapper_build_separate")
    if not all(hasattr(inductor_config, name) for name in names):
        return {}
    return dict.fromkeys(names, True)


def can_skip_module_guards() -> bool:
    """Whether this torch can filter a compile call's guards and isolate its compiled entries."""
    return "isolate_recompiles" in inspect.signature(torch.compile).parameters


def _tensor_key(t: torch.Tensor) -> tuple:
    try:
        layout = (tuple(t.shape), t.stride(), t.storage_offset())
    except (RuntimeError, NotImplementedError):  # sparse and other layouts without strides
        layout = (tuple(t.shape), str(t.layout))
    return (type(t).__qualname__, layout, t.dtype, t.device, t.requires_grad)


class _Summary:
    """One pass over the modules named and everything reachable from their attributes.

    What counts: each module's class and children, parameters' and buffers' metadata, training flag, hooks, a
    forward set on the instance, and its public attributes; of other objects (a packed weight, a closure's cells,
    a container) their tensors' metadata and public values; of configs every value, private ones included
    (`_attn_implementation_internal`). Private attributes of modules and objects are caches and bookkeeping
    (hf-spec's compiled state on the model, a kernel call prepared on first use) that no trace reads."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.modules: list[nn.Module] = []

    def module(self, m: nn.Module) -> tuple:
        d = m.__dict__
        params = tuple(
            (k, None if p is None else _tensor_key(p)) for k, p in d.get("_parameters", {}).items()
        )
        buffers = tuple((k, None if b is None else _tensor_key(b)) for k, b in d.get("_buffers", {}).items())
        children = tuple((k, None if c is None else id(c)) for k, c in d.get("_modules", {}).items())
        for child in d.get("_modules", {}).values():
            self.add(child)
        attrs = tuple((k, self.value(v, 0)) for k, v in d.items() if _module_attribute_counts(k))
        return (type(m).__module__, type(m).__qualname__, params, buffers, children, attrs)

    def add(self, m: nn.Module | None) -> None:
        if m is not None and id(m) not in self.seen:
            self.seen.add(id(m))
            self.modules.append(m)

    def value(self, v, depth: int):
        if isinstance(v, _SIMPLE):
            return v
        if isinstance(v, torch.Tensor):
            return _tensor_key(v)
        if isinstance(v, nn.Module):
            self.add(v)
            return ("module", id(v))
        if depth >= _MAX_DEPTH:
            return (type(v).__qualname__,)
        if isinstance(v, (tuple, list, set, frozenset)):
            items = list(v) if not isinstance(v, (set, frozenset)) else sorted(v, key=repr)
            if len(items) > _MAX_ITEMS:
                return (type(v).__qualname__, len(items))
            return (type(v).__qualname__, tuple(self.value(x, depth + 1) for x in items))
        if isinstance(v, dict):
            if len(v) > _MAX_ITEMS:
                return (type(v).__qualname__, len(v))
            return (
                type(v).__qualname__,
                tuple((self.value(k, depth + 1), self.value(x, depth + 1)) for k, x in v.items()),
            )
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__, depth + 1), self.value(v.__self__, depth + 1))
        if isinstance(v, types.FunctionType):
            cells = tuple(self.value(c.cell_contents, depth + 1) for c in (v.__closure__ or ()) if _filled(c))
            return ("function", id(v.__code__), cells)
        if isinstance(v, partial):
            return ("partial", self.value(v.func, depth + 1), self.value(v.args, depth + 1))
        attrs = getattr(v, "__dict__", None)
        if not isinstance(attrs, dict) or isinstance(v, type):
            return (type(v).__module__, type(v).__qualname__, id(v) if callable(v) else None)
        every = isinstance(v, PretrainedConfig)
        return (
            type(v).__module__,
            type(v).__qualname__,
            tuple((k, self.value(x, depth + 1)) for k, x in attrs.items() if every or not k.startswith("_")),
        )


def _module_attribute_counts(name: str) -> bool:
    """Whether a module's instance attribute `name` enters its summary: public ones (but the generation config,
    which no forward reads), hooks, a forward set on the instance; not parameters, buffers and children (summarized
    apart) nor other private attributes."""
    if name in ("_parameters", "_buffers", "_modules", "generation_config"):
        return False
    return (
        not name.startswith("_")
        or name.startswith(("_forward", "_backward"))
        or name == "_compiled_call_impl"
    )


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def structure_token(modules: Iterable[nn.Module]) -> int:
    """A hash of what dynamo's module guards check in functions running `modules` (and every module reachable from
    their attributes), equal as long as nothing a compiled trace depends on changed."""
    summary = _Summary()
    for m in modules:
        summary.add(m)
    parts = []
    i = 0
    while i < len(summary.modules):  # grows as attributes lead to more modules
        m = summary.modules[i]
        parts.append((id(m), summary.module(m)))
        i += 1
    return hash(tuple(parts))


class GuardedCompile:
    """`fn` compiled as `torch.compile(fn, fullgraph=True, dynamic=False, ...)`, dropping dynamo's module guards
    where `can_skip_module_guards()` on CPU: then one isolated compiled function per `structure_token` of `modules`,
    the token taken at the first call after `new_generation()`.

    Args:
        fn: the function to compile.
        settings: `hf_spec.engine.target.compiled.CompileSettings`.
        device: where it runs.
        modules: the modules `fn` runs; empty: dynamo keeps its module guards.
    """

    def __init__(
        self, fn: Callable, settings, device: torch.device, modules: Iterable[nn.Module] = ()
    ) -> None:
        self.fn, self.settings, self.device = fn, settings, device
        self.modules = tuple(modules)
        self.skips_guards = bool(self.modules) and device.type == "cpu" and can_skip_module_guards()
        self._compiled: OrderedDict[int, Callable] = OrderedDict()
        self.token: int | None = None

    def new_generation(self) -> None:
        """Take the modules' token again at the next call."""
        self.token = None

    def current(self) -> Callable:
        """The compiled function for the modules as they are now (compiled on first use)."""
        if self.token is None:
            self.token = structure_token(self.modules) if self.skips_guards else 0
        fn = self._compiled.get(self.token)
        if fn is None:
            if self._compiled:
                logger.info("the modules of a compiled function changed: it compiles again")
            fn = self._compiled[self.token] = self._compile()
            while len(self._compiled) > MAX_TOKENS:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(self.token)
        return fn

    def _compile(self) -> Callable:
        mode = self.settings.mode_for(self.device)
        options = self.settings.options_for(self.device)
        kwargs = {}
        if self.skips_guards:
            if mode is not None:  # torch.compile takes a mode or options, not both
                from torch._inductor import list_mode_options

                options = {**list_mode_options(mode), **options}
                mode = None
            # keep every guard whose source does not lie in an `nn.Module`
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
            kwargs["isolate_recompiles"] = True
        return torch.compile(
            self.fn,
            fullgraph=True,
            dynamic=False,
            backend=self.settings.backend,
            mode=mode,
            options=options or None,
            **kwargs,
        )


__all__ = ["GuardedCompile", "can_skip_module_guards", "cpu_wrapper_options", "structure_token"]
