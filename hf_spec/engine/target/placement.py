"""Targets as users load them: quantized (bitsandbytes, torchao, HQQ, quanto) or dispatched by accelerate
(`device_map`, offloaded weights).

`target_placement(model)` says, once per model, how its weights are stored and where they run; the profile picks
the kernel backend from it: hf-spec's CPU kernels read `nn.Linear` weights directly, so they run only where every
weight is a plain tensor resident on the CPU (an offloaded weight is a `meta` placeholder that accelerate's hooks
fill in for each forward; a torchao weight is a tensor subclass). An LLM.int8 target whose rows share outlier
columns gets its linears computed row by row inside the backend's contexts (`Int8RowsBackend`,
`hf_spec.engine.target.int8_rows`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from hf_spec.engine.backend import Backend
from hf_spec.engine.target.int8_rows import outlier_layers, row_local_int8

_PLACEMENT_KEY = "_hf_spec_placement"


@dataclass(frozen=True)
class TargetPlacement:
    """How a target's weights are stored and where they run.

    Args:
        quantization: a name of the target's quantization (`"bitsandbytes 8-bit"`, `"torchao"`, ...), None if none.
        offloaded: some weights live off any device until a forward needs them (accelerate's CPU or disk offload).
        devices: the devices the weights (or, offloaded, their forwards) run on.
        int8_rows: bitsandbytes LLM.int8 layers pick outlier columns over all rows of a forward.
        plain_linears: every `nn.Linear` weight is a plain tensor (no quantized tensor subclass).
        rounded_inputs: some linears round their inputs to int8 (LLM.int8, hf-spec's GGUF linears), so float noise
            between forwards of different shape can cross a rounding step and move a row's logits visibly.
    """

    quantization: str | None
    offloaded: bool
    devices: tuple[str, ...]
    int8_rows: bool
    plain_linears: bool
    rounded_inputs: bool = False

    @property
    def cpu_kernels_apply(self) -> bool:
        """hf-spec's CPU kernels may run this target: all weights plain and resident on the CPU."""
        return self.devices == ("cpu",) and not self.offloaded and self.plain_linears

    def describe(self) -> str:
        """`"bitsandbytes 8-bit"`, `"offloaded (device_map)"`, ... or `"plain"`."""
        parts = [self.quantization] if self.quantization else []
        parts += ["offloaded (device_map)"] if self.offloaded else []
        parts += [f"spread over {', '.join(self.devices)}"] if len(self.devices) > 1 else []
        return ", ".join(parts) or "plain"


def quantization_name(model: nn.Module) -> str | None:
    """The target's quantization as transformers recorded it (`config.quantization_config`), e.g.
    `"bitsandbytes 8-bit"`, `"bitsandbytes 4-bit nf4"`, `"torchao"`; None for an unquantized model."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    fields = config if isinstance(config, dict) else config.to_dict()
    method = str(getattr(fields.get("quant_method"), "value", fields.get("quant_method")))
    if method == "bitsandbytes":
        if fields.get("load_in_4bit"):
            return f"bitsandbytes 4-bit {fields.get('bnb_4bit_quant_type', 'fp4')}"
        return "bitsandbytes 8-bit"
    return method


def _execution_device(module: nn.Module) -> torch.device | None:
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    return torch.device(device) if device is not None else None


def target_placement(model: nn.Module) -> TargetPlacement:
    """The model's `TargetPlacement`, worked out at the first call and again when the model was moved, cast,
    quantized or dispatched since."""
    first = next(model.parameters())
    key = (
        getattr(model, "hf_device_map", None) is not None,
        id(getattr(model, "hf_quantizer", None)),
        first.device,
        first.dtype,
    )
    cached = model.__dict__.get(_PLACEMENT_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    offloaded, devices = False, set()
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if any(p.device.type == "meta" for p in own):
            offloaded = True
        hooked = _execution_device(module)
        devices.update(
            str(hooked if hooked is not None and p.device.type == "meta" else p.device) for p in own
        )
    devices.discard("meta")
    plain = all(
        type(m.weight.data) is torch.Tensor
        for m in model.modules()
        if type(m) is nn.Linear and m.weight is not None
    )
    outliers = bool(outlier_layers(model))
    placement = TargetPlacement(
        quantization=quantization_name(model),
        offloaded=offloaded,
        devices=tuple(sorted(devices)),
        int8_rows=outliers,
        plain_linears=plain,
        rounded_inputs=outliers or any(_rounds_inputs(m) for m in model.modules()),
    )
    model.__dict__[_PLACEMENT_KEY] = (key, placement)
    return placement


def _rounds_inputs(module: nn.Module) -> bool:
    """A quantized linear of hf-spec's (`hf_spec.models.quant_modules.QuantizedLinear`) whose weight has
    `int8_activations` (read by attribute: the target's code does not import the model loaders)."""
    return bool(getattr(getattr(module, "packed", None), "int8_activations", False))


def input_device(model: nn.Module) -> torch.device:
    """Where the model's forward wants its inputs: its embedding's device, or the device accelerate's hook runs the
    embedding on when its weight is offloaded."""
    try:
        embed = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):  # no accessor: where the first parameter is
        return next(model.parameters()).device
    weight = embed.weight
    if weight.device.type == "meta":
        return _execution_device(embed) or _execution_device(model) or torch.device("cpu")
    return weight.device


def resident_weight(module: nn.Module, what: str) -> torch.Tensor:
    """`module.weight`, or a clear error when accelerate offloaded it (a `meta` placeholder between forwards):
    `what` names the reader (e.g. "an EAGLE head borrows the target's LM head")."""
    weight = module.weight
    if weight.device.type == "meta":
        raise ValueError(
            f"{what}, whose weight is offloaded by the device_map (accelerate keeps it on disk or in CPU memory and "
            "loads it only inside its forward): keep that module on a device, e.g. device_map entries "
            "'model.embed_tokens' and 'lm_head' on 'cpu' or a GPU, or load the target without offloading"
        )
    return weight


class Int8RowsBackend(Backend):
    """Another backend's kernels, with the target's LLM.int8 layers computed row by row in the verification and
    drafting forwards (`hf_spec.engine.target.int8_rows`); plain decoding stays bitsandbytes' own, as in `generate`."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = f"{inner.name}+int8-rows"  # type: ignore[misc]  # an instance's name, not a class constant

    @contextlib.contextmanager
    def verification(self, model: nn.Module, screen: bool = False) -> Iterator[None]:
        with self.inner.verification(model, screen), row_local_int8(model):
            yield

    @contextlib.contextmanager
    def drafting(self, module: nn.Module, linears: bool = False) -> Iterator[None]:
        with self.inner.drafting(module, linears), row_local_int8(module):
            yield

    def plain_decoding(self, model: nn.Module):
        return self.inner.plain_decoding(model)

    def attention(self, config):
        return self.inner.attention(config)

    def packed_linears(self, module: nn.Module, weights: Mapping):
        return self.inner.packed_linears(module, weights)

    def linear(self, x, weight, bias=None):
        return self.inner.linear(x, weight, bias)

    def can_screen(self, model: nn.Module) -> bool:
        return self.inner.can_screen(model)

    def __repr__(self) -> str:
        return f"Int8RowsBackend({self.inner!r})"
