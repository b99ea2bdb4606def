"""The RMSNorm of Llama-family models, `weight * to_dtype(x * rsqrt(mean(x**2) + eps))` over the last dimension, in
one call of hf-spec's C++ kernel (`module.cpp`'s `rms_norm`) instead of transformers' eight torch ops.

A decoding step of a small quantized CPU target spends more time dispatching tiny torch ops than computing them:
`Qwen2RMSNorm.forward` on one row of 896 takes ~90 us in bfloat16 on a 2-core CPU, 49 times a step. The kernel does
the same arithmetic in one call: float32 x (bfloat16 widened exactly), the mean of squares summed in float32 (over 8
lanes, then the lanes in pairs: the order differs from torch's reduction, so a result can differ from transformers'
by the last bit of the mean), `x * rsqrt` rounded to the model's dtype, then the product with the weight rounded
again, as torch's bfloat16 product is. Each row's result depends on that row only.

`rms_norm` runs the kernel where it applies (x and weight both bfloat16 or both float32, contiguous, on CPU, no
gradient wanted) and transformers' formula otherwise; under `torch.compile` it is the operator `hf_spec::rms_norm`.
"""

from __future__ import annotations

import torch

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.ops import define_cpu_op

_DTYPES = (torch.float32, torch.bfloat16)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm.forward`: x `(..., hidden)` -> `(..., hidden)`."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def kernel_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The kernel's result `(..., hidden)` for x `(..., hidden)` and weight `(hidden,)`, or None where it does not
    apply (dtypes, layout, device, autograd, no kernel)."""
    hidden = weight.numel()
    if (
        x.dtype not in _DTYPES
        or weight.dtype is not x.dtype
        or not x.is_cpu
        or not weight.is_cpu
        or x.dim() == 0
        or x.shape[-1] != hidden
        or weight.dim() != 1
        or not x.is_contiguous()
        or not weight.is_contiguous()
        or x.numel() == 0
    ):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    mod = cpu_skinny_gemm.load_kernel()
    if mod is None:
        return None
    y = torch.empty_like(x)
    mod.rms_norm(
        x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // hidden, hidden, float(eps),
        x.dtype is torch.bfloat16,
    )  # fmt: skip
    return y


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel where it applies, else transformers' formula: x `(..., hidden)` -> `(..., hidden)`."""
    y = kernel_rms_norm(x, weight, eps)
    return y if y is not None else reference_rms_norm(x, weight, eps)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


# the operator: this function for CompositeExplicitAutograd, overridden by a C++ CPU kernel (`op_norm_attention.cpp`)
# once the kernel module loads, which hands what it does not take to `rms_norm_py`, this same function
rms_norm_op = define_cpu_op("rms_norm", _rms_norm, _rms_norm_fake, "CompositeExplicitAutograd")
rms_norm_py = define_cpu_op("rms_norm_py", _rms_norm, _rms_norm_fake)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * to_dtype(x * rsqrt(mean(x**2) + eps))` `(..., hidden)`: the kernel, the operator while
    `torch.compile` traces (CPU tensors), transformers' formula elsewhere."""
    if torch.compiler.is_compiling():
        return rms_norm_op(x, weight, eps) if x.is_cpu else reference_rms_norm(x, weight, eps)
    return _rms_norm(x, weight, eps)


__all__ = ["kernel_rms_norm", "reference_rms_norm", "rms_norm"]
