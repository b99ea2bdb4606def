"""The linear of group-quantized weights (`hf_spec.kernels.group_quant_weight.GroupQuantWeight`):
`y = x @ W.T (+ bias)`, the weights de-quantized in registers by hf-spec's C++ kernel (`gemm_group_quant.cpp`).

The kernel takes float32 x (bfloat16 x is widened first, exactly), `MAX_ROWS` rows a call, sums in float32 and
gives each row the same bits whatever the number of rows beside it: a verification's rows, and a prefill's, equal
one-row decoding's. A weight with `int8_activations` has the kernel quantize each run of 32 inputs of x to int8
first and multiply integers (`gemm_group_quant_q8.cpp`; `quantize_activations` is that rounding in torch), as
llama.cpp computes a GGUF's quantized weights: several times fewer instructions a weight on CPUs without native
bfloat16 products. Without a kernel (`HF_SPEC_NO_CPP_KERNELS=1`, no compiler, not x86) the torch twin runs:
`F.linear(x.float(), dequantize())` (x through `quantize_activations` first where the weight asks), the same
function up to the order of float32 sums. `group_quant_linear` is the torch operator `hf_spec::group_quant_linear`
(`hf_spec.kernels.ops.define_cpu_op`), so `torch.compile` calls it without a graph break.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.cpu_skinny_gemm import ISA_AUTO, ISA_AVX2
from hf_spec.kernels.group_quant_weight import (  # the weight format, re-exported: callers import it from here too
    ACTIVATION_RUN,
    DEQUANTIZE_ROWS,
    ZERO_POINTS,
    CodeLayout,
    GroupQuantWeight,
)
from hf_spec.kernels.ops import define_cpu_op

MAX_ROWS = 64  # rows of x a kernel call takes; more are split into calls of this many


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x `(..., K)` as the int8-activation kernel sees it, float32 `(..., K)`: each run of 32 inputs of a row
    quantized to `q = round(x / d)` (to nearest, ties to even) with `d = max |x| / 127` (q = 0 where d = 0), and
    given back as `d * q`."""
    x = x.float()
    runs = x.reshape(*x.shape[:-1], x.shape[-1] // ACTIVATION_RUN, ACTIVATION_RUN)
    d = runs.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return ((runs * inv).round() * d).reshape(x.shape)


_best_isa: int | None = None


def _kernel_for(isa: int):
    global _best_isa
    mod = cpu_skinny_gemm.load_kernel()
    if mod is None:
        return None
    if _best_isa is None:
        _best_isa = int(mod.best_isa())
    if isa == ISA_AUTO and _best_isa < ISA_AVX2:
        return None  # the plain C++ path is for tests: without AVX2 the torch twin is faster
    return mod


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # x and y dtypes the kernel reads and writes itself


def kernel_group_linear(
    x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`F.linear(x, weight.dequantize(), bias)` by the kernel, `(..., out_features)` in x's dtype, for float32 or
    bfloat16 x `(..., in_features)`, contiguous on CPU, and float32 `bias` `(out_features,)`; None where it does
    not apply (other dtypes, autograd, no kernel). bfloat16 x is widened to float32 exactly and y is rounded to
    bfloat16 once, as `F.linear(x.float(), ...).to(torch.bfloat16)` would. Rows go to the kernel `MAX_ROWS` at a
    time (their x stays in the cache while a tile of the weight meets it); each row's bits do not depend on the
    rows beside it. A decoding step calls this once a linear, so it checks no more than the kernel's reads need."""
    plan = weight.kernel_plan()
    k, n = plan[5], plan[4]
    if not _takes(x) or x.shape[-1] != k or not _kernel_takes_layout(plan[6], plan[8]):
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        return None
    mod = _kernel_for(isa)
    if mod is None:
        return None
    return _launch(mod, x, plan[:4], n, plan[6], plan[7], plan[8], bias, isa, plan[9], plan[10])


def _kernel_takes_layout(layout: int, int8_activations: bool) -> bool:
    """Whether a kernel reads this layout: tiled ones are the int8-input kernel's only."""
    return int8_activations or layout < CodeLayout.I8X16


def _takes(x: torch.Tensor) -> bool:
    """Whether the kernel reads x itself: float32 or bfloat16, contiguous, on the CPU, at least one row, no
    autograd."""
    return (
        x.dtype in _KERNEL_DTYPES
        and x.is_cpu
        and x.dim() > 0
        and x.numel() > 0
        and x.is_contiguous()
        and not (x.requires_grad and torch.is_grad_enabled())
    )


def _launch(
    mod, x: torch.Tensor, ptrs: tuple, n: int, layout: int, group_size: int, int8_activations: bool,
    bias: torch.Tensor | None, isa: int, zero_point: int = 0, scale_f16: bool = False,
) -> torch.Tensor:  # fmt: skip
    """One kernel call: x `(..., K)` as `_takes` allows, the weight's `(codes, high, scale, min)` addresses (0 for
    none), zero point and float16 scales (the int8-input kernel's only), float32 bias `(n,)` or None -> `(..., n)`
    in x's dtype."""
    k = x.shape[-1]
    y = x.new_empty((*x.shape[:-1], n))
    bf16 = x.dtype is torch.bfloat16
    (mod.gemm_gq_q8 if int8_activations else mod.gemm_gq)(
        x.data_ptr(), *ptrs, 0 if bias is None else bias.data_ptr(), y.data_ptr(), x.numel() // k, n, k, layout,
        group_size, isa, bf16, bf16, zero_point, scale_f16,
    )  # fmt: skip
    return y


def prepared_kernel_linear(
    weight: GroupQuantWeight, bias: torch.Tensor | None = None
) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """`kernel_group_linear(x, weight, bias)` as a function of x alone, with everything else worked out once (the
    loaded kernel, the weight's plan, a float32 copy of the bias): what an eager decoding step pays once a linear
    comes down to the checks on x and the call. None where no kernel is loaded; the function returns None where the
    kernel does not take x. It holds what it read: the caller prepares again when the weight or the bias changes
    (`QuantizedLinear` does)."""
    mod = _kernel_for(ISA_AUTO)
    if mod is None:
        return None
    plan = weight.kernel_plan()
    ptrs, n, k, layout, group, int8_activations, zero_point, scale_f16 = plan[:4], *plan[4:]
    if not _kernel_takes_layout(layout, int8_activations):
        return None
    b32 = None if bias is None else bias.detach().to(torch.float32).contiguous()

    def call(x: torch.Tensor) -> torch.Tensor | None:
        if not _takes(x) or x.shape[-1] != k:
            return None
        return _launch(mod, x, ptrs, n, layout, group, int8_activations, b32, ISA_AUTO, zero_point, scale_f16)

    call.holds = (weight, plan, b32)  # what the addresses point into, kept alive with the function
    return call


def reference_group_linear(
    x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch twin: `F.linear(x.float(), weight.dequantize(), bias)` (x through `quantize_activations` for a
    weight with `int8_activations`), float32 `(..., out_features)`, over `DEQUANTIZE_ROWS` output features at a time
    (a large LM head is never de-quantized whole)."""
    x, bias = x.float(), None if bias is None else bias.float()
    if weight.int8_activations:
        x = quantize_activations(x)
    n = weight.out_features
    if n <= DEQUANTIZE_ROWS:
        return F.linear(x, weight.dequantize(), bias)
    parts = []
    for start in range(0, n, DEQUANTIZE_ROWS):
        part = slice(start, min(start + DEQUANTIZE_ROWS, n))
        parts.append(F.linear(x, weight.dequantize(part), None if bias is None else bias[part]))
    return torch.cat(parts, dim=-1)


def group_linear(x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` `(..., out_features)` in x's dtype, summed in float32: by the kernel where it applies,
    else by the torch twin."""
    b32 = bias if bias is None or bias.dtype is torch.float32 else bias.float()
    if b32 is not None and not b32.is_contiguous():
        b32 = b32.contiguous()
    y = None
    if x.is_cpu:
        xk = x if x.dtype in _KERNEL_DTYPES else x.float()  # e.g. float16: the kernel takes it widened
        y = kernel_group_linear(xk if xk.is_contiguous() else xk.contiguous(), weight, b32)
    if y is None:
        y = reference_group_linear(x, weight, b32)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def _group_quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    min: torch.Tensor | None,
    high: torch.Tensor | None,
    bias: torch.Tensor | None,
    layout: int,
    group_size: int,
    int8_activations: bool = False,
    zero_point: int = 0,
) -> torch.Tensor:
    """`group_linear` as a torch op: x `(..., in_features)`, the weight's tensors as `GroupQuantWeight` holds them;
    returns `(..., out_features)` in x's dtype."""
    # the common case straight to the kernel (a compiled decoding step calls this once a linear)
    y = _kernel_call(x, codes, scale, min, high, bias, layout, group_size, int8_activations, zero_point)
    if y is not None:
        return y
    weight = GroupQuantWeight.unchecked(
        codes, scale, min, high, CodeLayout(layout), group_size, x.shape[-1], int8_activations, zero_point
    )
    return group_linear(x, weight, bias)


def _kernel_call(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    min: torch.Tensor | None,
    high: torch.Tensor | None,
    bias: torch.Tensor | None,
    layout: int,
    group_size: int,
    int8_activations: bool,
    zero_point: int,
) -> torch.Tensor | None:
    """`kernel_group_linear` on the weight's tensors as given, without building a `GroupQuantWeight` and its plan
    for the call; None where the kernel does not take x or the weight (a zero point or float16 scales without int8
    inputs: the float kernel reads stored float32 ones), for the caller's slower path."""
    if not _takes(x) or (int8_activations and x.shape[-1] % ACTIVATION_RUN):
        return None
    if not _kernel_takes_layout(layout, int8_activations):
        return None
    if zero_point and not (int8_activations and zero_point in ZERO_POINTS and min is None):
        return None
    scale_f16 = scale.dtype is torch.float16
    if scale_f16 and not (int8_activations and group_size == 32 and min is None):
        return None
    n = scale.shape[0]
    if bias is not None:
        if bias.shape != (n,):
            return None
        if bias.dtype is not torch.float32 or not bias.is_contiguous():
            bias = bias.float().contiguous()  # added in float32, as `group_linear` adds it
    mod = _kernel_for(ISA_AUTO)
    if mod is None:
        return None
    ptrs = tuple(0 if t is None else t.data_ptr() for t in (codes, high, scale, min))
    return _launch(
        mod, x, ptrs, n, layout, group_size, int8_activations, bias, ISA_AUTO, zero_point, scale_f16
    )


def _group_quant_linear_fake(
    x, codes, scale, min, high, bias, layout, group_size, int8_activations=False, zero_point=0
):
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


# the operator compiled graphs call: for int8-input weights its CPU kernel is C++ (`op_group_quant.cpp`, registered
# when the kernel module loads), which hands what it does not take to `group_quant_linear_py`, this same function
group_quant_linear = define_cpu_op(
    "group_quant_linear", _group_quant_linear, _group_quant_linear_fake, "CompositeExplicitAutograd"
)
group_quant_linear_py = define_cpu_op("group_quant_linear_py", _group_quant_linear, _group_quant_linear_fake)


def quantized_linear(
    x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`group_linear`, through the custom op while `torch.compile` traces (a plain call otherwise: the op's
    dispatch costs microseconds a call, which a decoding step pays once a linear)."""
    if torch.compiler.is_compiling():
        return group_quant_linear(
            x,
            weight.codes,
            weight.scale,
            weight.min,
            weight.high,
            bias,
            weight.layout_code,
            weight.group_size,
            weight.int8_activations,
            weight.zero_point,
        )
    return group_linear(x, weight, bias)


__all__ = [
    "MAX_ROWS",
    "CodeLayout",
    "GroupQuantWeight",
    "group_linear",
    "group_quant_linear",
    "kernel_group_linear",
    "prepared_kernel_linear",
    "quantize_activations",
    "quantized_linear",
    "reference_group_linear",
]
