"""Group-quantized weights and their linear: `y = x @ W.T (+ bias)` with `W[n, k] = scale[n, g] * code[n, k]
(+ min[n, g])`, `g = k // group_size`, de-quantized in registers by hf-spec's C++ kernel (`gemm_group_quant.cpp`).

One layout serves every weight-only scheme hf-spec runs on a target: GGUF's block formats (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: `hf_spec.models.gguf_blocks` repacks them), and the int8 / int4 weights hf-spec makes
at load. Codes are int8 (`CodeLayout.I8`), or unsigned 4-bit (`U4`) / 5-bit (`U5`: 4-bit plus a bit plane) packed
two a byte. Where a weight has mins, `scale * code` is exact in float32 (the packers see to it), so the kernel's
fused multiply-add and this module's `dequantize` give the same weight bits.

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

import enum
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.cpu_skinny_gemm import ISA_AUTO, ISA_AVX2
from hf_spec.kernels.ops import define_cpu_op

MAX_ROWS = 64  # rows of x a kernel call takes; more are split into calls of this many
RUN = 32  # codes per packed run (U4 / U5)
ACTIVATION_RUN = 32  # inputs per int8 scale of x with `int8_activations`
DEQUANTIZE_ROWS = 4096  # rows of a weight de-quantized at a time


class CodeLayout(enum.IntEnum):
    """How codes are stored (the values are the C++ `CodeLayout`)."""

    I8 = 0  # int8, one a weight
    U4 = 1  # unsigned 4-bit, two a byte: in each run of 32 codes byte i holds code i (low) and code i + 16 (high)
    U5 = 2  # U4 plus an int32 a run whose bit i is bit 4 of code i


@dataclass
class GroupQuantWeight:
    """A group-quantized `(out_features, in_features)` weight, on CPU.

    `codes`: int8 `(out_features, in_features)` (I8) or uint8 `(out_features, in_features // 2)` (U4, U5);
    `scale`, `min`: float32 `(out_features, in_features // group_size)` (`min` None where the format has none);
    `high`: int32 `(out_features, in_features // 32)` (U5 only).

    `int8_activations`: products with this weight quantize x first, each run of 32 inputs of a row to int8
    (`quantize_activations`), and multiply integers (as llama.cpp computes its GGUF weights); `in_features` a
    multiple of 32. Otherwise x is used as given, in float32."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    high: torch.Tensor | None
    layout: CodeLayout
    group_size: int
    in_features: int
    int8_activations: bool = False
    # `int(layout)`, what the compiled operator is given: a plain int, which dynamo guards by value in C++, where
    # the one enum member shared by every weight costs a Python identity guard per linear on each compiled call
    layout_code: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.layout = CodeLayout(self.layout)
        self.layout_code = int(self.layout)
        n, k, g = self.scale.shape[0], self.in_features, self.group_size
        step = 16 if self.layout is CodeLayout.I8 else RUN
        if g < 1 or g % step or k % g:
            raise ValueError(f"{self.layout.name} group size {g} must be a multiple of {step} dividing {k}")
        width = k if self.layout is CodeLayout.I8 else k // 2
        dtype = torch.int8 if self.layout is CodeLayout.I8 else torch.uint8
        if self.codes.shape != (n, width) or self.codes.dtype != dtype:
            raise ValueError(
                f"codes must be {dtype} {(n, width)}, got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        for name, t in (("scale", self.scale), ("min", self.min)):
            if t is not None and (t.shape != (n, k // g) or t.dtype != torch.float32):
                raise ValueError(f"{name} must be float32 {(n, k // g)}, got {t.dtype} {tuple(t.shape)}")
        if (self.high is not None) != (self.layout is CodeLayout.U5):
            raise ValueError("high bits are given for U5 weights, and only for them")
        if self.high is not None and (self.high.shape != (n, k // RUN) or self.high.dtype != torch.int32):
            raise ValueError(
                f"high must be int32 {(n, k // RUN)}, got {self.high.dtype} {tuple(self.high.shape)}"
            )
        if self.int8_activations and k % ACTIVATION_RUN:
            raise ValueError(f"int8 activations need in_features divisible by {ACTIVATION_RUN}, got {k}")
        for name in ("codes", "scale", "min", "high"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.contiguous())

    @property
    def out_features(self) -> int:
        return int(self.scale.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for one product."""
        return sum(
            t.numel() * t.element_size()
            for t in (self.codes, self.scale, self.min, self.high)
            if t is not None
        )

    def kernel_plan(self) -> tuple:
        """What a kernel call reads, worked out once: `(codes, high or 0, scale, min or 0)` addresses, then
        `out_features, in_features, layout, group_size, int8_activations` (made again where the codes, the scales
        or `int8_activations` were replaced: a weight's other fields come with its codes)."""
        cached = self.__dict__.get("_plan")
        key = cached[0] if cached is not None else None
        if (
            key is None
            or key[0] is not self.codes
            or key[1] is not self.scale
            or key[2] is not self.int8_activations
        ):
            key = (self.codes, self.scale, self.int8_activations)
            ptrs = tuple(
                0 if t is None else t.data_ptr() for t in (self.codes, self.high, self.scale, self.min)
            )
            plan = (*ptrs, self.out_features, self.in_features, int(self.layout), self.group_size,
                    self.int8_activations)  # fmt: skip
            cached = self.__dict__["_plan"] = (key, plan)
        return cached[1]

    @classmethod
    def unchecked(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        min: torch.Tensor | None,
        high: torch.Tensor | None,
        layout: CodeLayout,
        group_size: int,
        in_features: int,
        int8_activations: bool,
    ) -> GroupQuantWeight:
        """The weight of tensors a checked `GroupQuantWeight` already holds (the custom op's arguments), with the
        shape checks the kernel's memory reads rely on but not the full ones: a compiled graph calls the op once a
        linear a step. Tensors that do not fit go through the full checks (which raise)."""
        n, k = scale.shape[0] if scale.dim() == 2 else -1, in_features
        fits = (
            codes.dim() == 2
            and codes.shape[0] == n
            and codes.shape[1] == (k if layout == CodeLayout.I8 else k // 2)
            and codes.is_contiguous()
            and scale.dtype is torch.float32
            and scale.is_contiguous()
            and group_size > 0
            and scale.shape[1] * group_size == k
            and (
                min is None
                or (min.shape == scale.shape and min.dtype is torch.float32 and min.is_contiguous())
            )
            and (high is None) == (layout == CodeLayout.U5)
            and (high is None or (high.shape == (n, k // RUN) and high.is_contiguous()))
        )
        if not fits:
            return cls(codes, scale, min, high, layout, group_size, in_features, int8_activations)
        weight = object.__new__(cls)
        weight.__dict__.update(
            codes=codes, scale=scale, min=min, high=high, layout=layout, group_size=group_size,
            in_features=in_features, int8_activations=int8_activations, layout_code=int(layout),
        )  # fmt: skip
        return weight

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scale: torch.Tensor,
        min: torch.Tensor | None,
        layout: CodeLayout,
        group_size: int,
    ) -> GroupQuantWeight:
        """Pack integer `codes` `(out_features, in_features)` (I8: -128..127; U4: 0..15; U5: 0..31)."""
        layout = CodeLayout(layout)
        n, k = codes.shape
        if layout is CodeLayout.I8:
            return cls(codes.to(torch.int8), scale, min, None, layout, group_size, k)
        if k % RUN:
            raise ValueError(f"packed codes need in_features divisible by {RUN}, got {k}")
        c = codes.to(torch.int32).view(n, k // RUN, RUN)
        top = 15 if layout is CodeLayout.U4 else 31
        if int(c.min()) < 0 or int(c.max()) > top:
            raise ValueError(f"{layout.name} codes must lie in 0..{top}")
        low = c & 15
        packed = (low[..., :16] | (low[..., 16:] << 4)).to(torch.uint8).view(n, k // 2)
        high = None
        if layout is CodeLayout.U5:
            word = ((c >> 4).to(torch.int64) << torch.arange(RUN, dtype=torch.int64)).sum(
                -1
            )  # bit i: code i's bit 4
            high = torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)  # the uint32's bits
        return cls(packed, scale, min, high, layout, group_size, k)

    def unpacked_codes(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The integer codes of `rows`, int32 `(rows, in_features)`."""
        codes = self.codes[rows]
        if self.layout is CodeLayout.I8:
            return codes.to(torch.int32)
        n, k = codes.shape[0], self.in_features
        b = codes.to(torch.int32).view(n, k // RUN, 16)
        c = torch.cat([b & 15, b >> 4], dim=-1)
        if self.layout is CodeLayout.U5:
            h = self.high[rows].to(torch.int64)[..., None] >> torch.arange(RUN, dtype=torch.int64)
            c = c | ((h & 1).to(torch.int32) << 4)
        return c.reshape(n, k)

    def dequantize(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The weight's `rows` (all: None), float32 `(rows, in_features)`: `scale * code (+ min)`, bit for bit the
        kernel's. The whole weight is made `DEQUANTIZE_ROWS` rows at a time (a bounded transient)."""
        if rows is None:
            out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
            for start in range(0, self.out_features, DEQUANTIZE_ROWS):
                part = slice(start, min(start + DEQUANTIZE_ROWS, self.out_features))
                out[part] = self.dequantize(part)
            return out
        codes = self.unpacked_codes(rows).to(torch.float32)
        n, groups = codes.shape[0], self.in_features // self.group_size
        w = codes.view(n, groups, self.group_size) * self.scale[rows][..., None]
        if self.min is not None:
            w = w + self.min[rows][..., None]
        return w.view(n, self.in_features)

    def select_rows(self, index: torch.Tensor) -> GroupQuantWeight:
        """The weight made of rows `index` (int64 `(rows,)`), in that order."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)

        return GroupQuantWeight(
            pick(self.codes),
            pick(self.scale),
            pick(self.min),
            pick(self.high),
            self.layout,
            self.group_size,
            self.in_features,
            self.int8_activations,
        )


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
    if not _takes(x) or x.shape[-1] != k:
        return None
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        return None
    mod = _kernel_for(isa)
    if mod is None:
        return None
    return _launch(mod, x, plan[:4], n, plan[6], plan[7], plan[8], bias, isa)


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
    bias: torch.Tensor | None, isa: int,
) -> torch.Tensor:  # fmt: skip
    """One kernel call: x `(..., K)` as `_takes` allows, the weight's `(codes, high, scale, min)` addresses (0 for
    none), float32 bias `(n,)` or None -> `(..., n)` in x's dtype."""
    k = x.shape[-1]
    y = x.new_empty((*x.shape[:-1], n))
    bf16 = x.dtype is torch.bfloat16
    (mod.gemm_gq_q8 if int8_activations else mod.gemm_gq)(
        x.data_ptr(), *ptrs, 0 if bias is None else bias.data_ptr(), y.data_ptr(), x.numel() // k, n, k, layout,
        group_size, isa, bf16, bf16,
    )  # fmt: skip
    return y


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
) -> torch.Tensor:
    """`group_linear` as a torch op: x `(..., in_features)`, the weight's tensors as `GroupQuantWeight` holds them;
    returns `(..., out_features)` in x's dtype."""
    # the common case straight to the kernel (a compiled decoding step calls this once a linear)
    y = _kernel_call(x, codes, scale, min, high, bias, layout, group_size, int8_activations)
    if y is not None:
        return y
    weight = GroupQuantWeight.unchecked(
        codes, scale, min, high, CodeLayout(layout), group_size, x.shape[-1], int8_activations
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
) -> torch.Tensor | None:
    """`kernel_group_linear` on the weight's tensors as given, without building a `GroupQuantWeight` and its plan
    for the call; None where the kernel does not take x, for the caller's slower path."""
    if not _takes(x) or (int8_activations and x.shape[-1] % ACTIVATION_RUN):
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
    return _launch(mod, x, ptrs, n, layout, group_size, int8_activations, bias, ISA_AUTO)


def _group_quant_linear_fake(x, codes, scale, min, high, bias, layout, group_size, int8_activations=False):
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


group_quant_linear = define_cpu_op("group_quant_linear", _group_quant_linear, _group_quant_linear_fake)


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
        )
    return group_linear(x, weight, bias)


__all__ = [
    "MAX_ROWS",
    "CodeLayout",
    "GroupQuantWeight",
    "group_linear",
    "group_quant_linear",
    "kernel_group_linear",
    "quantize_activations",
    "quantized_linear",
    "reference_group_linear",
]
