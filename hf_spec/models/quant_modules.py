"""The modules a quantized target runs on: `QuantizedLinear` (an `nn.Linear` replacement whose forward is hf-spec's
group-quantized kernel) and `QuantizedEmbedding` (rows de-quantized on lookup), both holding a `GroupQuantWeight`,
and `FusedRMSNorm` (a Llama-family RMSNorm in one kernel call, `hf_spec.kernels.rms_norm`).

The packed tensors are plain attributes, not parameters or buffers: `model.to(torch.bfloat16)` leaves the float32
scales as they are (they define the weight), and moving the model off the CPU raises. A tied LM head and embedding
share one `GroupQuantWeight`. `.weight` (read by drafters that borrow the LM head, and by fingerprints) is the
de-quantized weight in the model's dtype, made on first read and kept.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from hf_spec.kernels.group_quant import prepared_kernel_linear, quantized_linear
from hf_spec.kernels.group_quant_weight import GroupQuantWeight
from hf_spec.kernels.rms_norm import rms_norm

# set, the kernels may be switched off (`HF_SPEC_NO_CPP_KERNELS`): every call then asks, through the general path
KERNELS_SWITCH = "HF_SPEC_NO_CPP_KERNELS"


class _Packed(nn.Module):
    """What both modules share: the packed weight, its scheme's name and the model's dtype for `.weight`."""

    def __init__(self, packed: GroupQuantWeight, scheme: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.packed = packed
        self.scheme = scheme  # e.g. "int8", "int4", "gguf Q5_0"
        self.dense_dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        """The de-quantized weight `(rows, columns)` in the model's dtype (made once, then kept)."""
        cache = self.packed.__dict__.setdefault("_dense", {})
        if self.dense_dtype not in cache:
            cache[self.dense_dtype] = self.packed.dequantize().to(self.dense_dtype)
        return cache[self.dense_dtype]

    def _apply(self, fn, recurse: bool = True):
        probes = [fn(torch.zeros(1, dtype=dtype)) for dtype in (torch.float32, torch.float16)]
        if probes[0].device.type != "cpu":
            raise ValueError(
                f"{type(self).__name__} ({self.scheme}) runs on the CPU only, not on {probes[0].device}"
            )
        if probes[0].dtype == probes[1].dtype and probes[0].is_floating_point():
            self.dense_dtype = probes[
                0
            ].dtype  # `.weight` follows a cast of the model; the packed weight does not
        return super()._apply(fn, recurse)


class QuantizedLinear(_Packed):
    """`y = x @ W.T (+ bias)` `(..., out_features)` for x `(..., in_features)` with W group-quantized: float32 sums,
    y in x's dtype, by hf-spec's kernel for 1..64 rows (each row's bits independent of the others) and by its torch
    twin otherwise (`hf_spec.kernels.group_quant`)."""

    def __init__(
        self, packed: GroupQuantWeight, bias: torch.Tensor | None, scheme: str, dtype: torch.dtype
    ) -> None:
        super().__init__(packed, scheme, dtype)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() and KERNELS_SWITCH not in os.environ:
            call = self._prepared()
            y = None if call is None else call(x)
            if y is not None:
                return y
        return quantized_linear(x, self.packed, self.bias)

    def _prepared(self):
        """The kernel call for this weight and bias, prepared once (`prepared_kernel_linear`) and again where the
        packed weight, its codes or scales, its int8-activation setting or the bias (object or contents) changed."""
        packed, bias = self.packed, self.bias
        version = None if bias is None else bias._version
        held = self.__dict__.get("_call")
        if (
            held is None
            or held[0] is not packed
            or held[1] is not packed.codes
            or held[2] is not packed.scale
            or held[3] != packed.int8_activations
            or held[4] is not bias
            or held[5] != version
        ):
            call = prepared_kernel_linear(packed, bias)
            held = (packed, packed.codes, packed.scale, packed.int8_activations, bias, version, call)
            self.__dict__["_call"] = held
        return held[6]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"scheme={self.scheme}, group_size={self.packed.group_size}"
        )


class QuantizedEmbedding(_Packed):
    """An `nn.Embedding` whose rows are de-quantized on lookup: ids `(...)` -> `(..., embedding_dim)` in the
    model's dtype, the float32 weight rows rounded once (as an embedding de-quantized at load holds them)."""

    def __init__(
        self, packed: GroupQuantWeight, scheme: str, dtype: torch.dtype, padding_idx: int | None = None
    ) -> None:
        super().__init__(packed, scheme, dtype)
        self.num_embeddings, self.embedding_dim = packed.out_features, packed.in_features
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.packed.dequantize(ids.reshape(-1))
        return rows.to(self.dense_dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme}"


# transformers' RMSNorm classes whose forward is `weight * to_dtype(x * rsqrt(mean(x**2) + eps))` (others, such as
# Gemma's `1 + weight` or OLMo-2's cast after the product, are left as they are)
FUSABLE_RMS_NORMS = frozenset(
    {
        "GraniteRMSNorm",
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "Phi3RMSNorm",
        "Qwen2RMSNorm",
        "Qwen3RMSNorm",
        "SmolLM3RMSNorm",
    }
)


class FusedRMSNorm(nn.Module):
    """A Llama-family RMSNorm `(..., hidden)` -> `(..., hidden)` in one call of hf-spec's kernel
    (`hf_spec.kernels.rms_norm`): the same weight parameter (same state-dict key) and epsilon."""

    def __init__(self, weight: nn.Parameter, eps: float, replaces: str) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.replaces = replaces  # the transformers class it stands for

    @classmethod
    def fusable(cls, module: nn.Module) -> bool:
        """Whether `module` is a transformers RMSNorm of the formula this computes."""
        return (
            type(module).__name__ in FUSABLE_RMS_NORMS
            and isinstance(getattr(module, "weight", None), nn.Parameter)
            and module.weight.dim() == 1
            and isinstance(getattr(module, "variance_epsilon", None), float)
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, replaces={self.replaces}"


def fuse_rms_norms(model: nn.Module) -> int:
    """Replace `model`'s fusable RMSNorms (`FUSABLE_RMS_NORMS`) by `FusedRMSNorm`s in place; returns how many."""
    targets = [(name, m) for name, m in model.named_modules() if FusedRMSNorm.fusable(m)]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fused = FusedRMSNorm(module.weight, module.variance_epsilon, type(module).__name__)
        setattr(parent, child, fused.train(module.training))
    return len(targets)


__all__ = ["FUSABLE_RMS_NORMS", "FusedRMSNorm", "QuantizedEmbedding", "QuantizedLinear", "fuse_rms_norms"]
