"""Weight-only int8 / int4 matmuls for a draft head's few-row inputs on CPU.

On CPU a draft head's cost is the bytes of its weights: after each target forward the head's layer and draft LM
head come from DRAM again, several times per drafting round. Per-output-channel int8 halves those bytes (against
bfloat16), int4 (groups of `group_size` inputs, an asymmetric scale and zero each) quarters them. torch's CPU
kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) compute in bfloat16 (float32 inputs are cast: their
float32 path is many times slower). For float32 or bfloat16 x, int8 runs hf-spec's own kernels instead, where
they build: below `W8A8_MIN_ROWS` rows `kernel_linear_int8` (the int8 weights widened in registers, x and the sums
in float32), from there on AVX512-VNNI `kernel_linear_w8a8` (each row of x quantized to int8 as well, the integer
products summed exactly). int4, where hf-spec's kernel builds, is made as a quantized target's int4 is (groups of
32 inputs, `hf_spec.kernels.group_quant_weight.quantize_int4`) and runs the int8-input kernel of GGUF targets
(each run of 32 inputs of x rounded to int8, the tiled layout): 0.5-0.7x the time of torch's int4 kernel for one
to eight rows of a head's shapes (`lab/quantized_cpu/draft_int4_ab.py`); elsewhere torch's int4 kernel (groups of
`int4_group_size`).

Drafts only: verification always runs the target's own weights, so output stays exact; quantization can only
change which tokens are drafted. Inputs with more than `max_rows` rows (a head's prompt catch-up) use the
original weight, where the packed kernels are slower than the stock matmul.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.group_quant import quantized_linear
from hf_spec.kernels.group_quant_weight import INT4_GROUP, RUN, TILE_ROWS, GroupQuantWeight, quantize_int4
from hf_spec.kernels.skinny_linear import fast_linears, patched_forwards, skinny_linear

SCHEMES = ("int8", "int4")
# from this many rows int8 weights meet x quantized to int8 too (AVX512-VNNI): the float32-x kernel, which widens
# every weight to float32, is compute-bound there
W8A8_MIN_ROWS = 3


@dataclass
class QuantizedWeight:
    """A `(out, in)` weight kept twice: packed for few-row inputs, original for the rest."""

    scheme: str
    weight: torch.Tensor  # (out, in), original
    # int8 (out, in) or torch's int4 kernel's packed layout (None: `tiles` instead)
    packed: torch.Tensor | None
    scales: torch.Tensor | None  # int8: (out,); int4: (in / group_size, out, 2) scale and zero
    group_size: int = 0
    max_rows: int = 8
    qsum: torch.Tensor | None = None  # int8: int32 row sums of `packed` (the VNNI kernel's offset term)
    scales_f32: torch.Tensor | None = None  # int8: `scales` in float32, for hf-spec's kernels
    tiles: GroupQuantWeight | None = None  # int4 for hf-spec's int8-input kernel, where it builds

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, scheme: str, group_size: int = 0, max_rows: int = 8
    ) -> QuantizedWeight:
        """Pack `weight` `(out, in)`; int4 groups `group_size` inputs (0: the first of 64, 128, 32, 256 that
        divides `in`)."""
        if scheme not in SCHEMES:
            raise ValueError(f"unknown weight quantization {scheme!r}: use one of {', '.join(SCHEMES)}")
        if weight.device.type != "cpu":
            raise ValueError(f"{scheme} draft weights run on CPU only, this weight is on {weight.device}")
        w = weight.detach().float()
        out_features, in_features = w.shape
        if scheme == "int8":
            scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8)
            packed = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
            qsum = packed.sum(dim=1, dtype=torch.int32)
            return cls(
                scheme, weight, packed, scales.to(weight.dtype), 0, max_rows, qsum, scales.contiguous()
            )
        if not group_size and in_features % RUN == 0 and out_features % TILE_ROWS == 0 and tiles_run():
            tiles = quantize_int4(w, INT4_GROUP)
            tiles.int8_activations = True
            return cls(scheme, weight, None, None, INT4_GROUP, max_rows, tiles=tiles.tiled())
        group_size = group_size or int4_group_size(in_features)
        if not group_size or in_features % group_size or out_features % 16:
            raise ValueError(
                f"int4 needs in_features divisible by a group size of 32..256 and out_features by 16, "
                f"got {tuple(w.shape)}"
            )
        groups = w.view(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # (out, G)
        scale = ((high - low) / 15).clamp(min=1e-8)
        q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(out_features, in_features), 2)
        zero = low + 8 * scale  # the kernel computes (q - 8) * scale + zero
        scales = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(weight.dtype)
        return cls(scheme, weight, packed, scales, group_size, max_rows)

    def dequantize(self) -> torch.Tensor:
        """The weight the packed kernel computes with `(out, in)`, float32."""
        if self.tiles is not None:
            return self.tiles.dequantize()
        eye = torch.eye(self.weight.shape[1], dtype=torch.float32)
        return self._packed_mm(eye, fast=False).t().contiguous()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`F.linear(x, weight, bias)` with the packed weight for up to `max_rows` rows."""
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 1 <= rows <= self.max_rows or x.device.type != "cpu":
            return F.linear(x, self.weight, bias)
        if self.scheme == "int8" and x.dtype in (torch.float32, torch.bfloat16):
            x32 = x.float().contiguous()  # bfloat16 x: widened (a few rows), the result narrowed back
            y = None
            if rows >= W8A8_MIN_ROWS:  # x quantized too: VNNI, 4 products an instruction (None without it)
                y = cpu_skinny_gemm.kernel_linear_w8a8(x32, self.packed, self.qsum, self.scales_f32)
            if y is None:
                y = cpu_skinny_gemm.kernel_linear_int8(x32, self.packed, self.scales_f32)
            if y is not None:
                y = y.to(x.dtype)
                return y + bias if bias is not None else y
        if self.tiles is not None:
            return quantized_linear(x, self.tiles, bias)
        y = self._packed_mm(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], self.weight.shape[0])
        return y + bias if bias is not None else y

    def _packed_mm(self, x2d: torch.Tensor, fast: bool = True) -> torch.Tensor:
        # the kernels' float32 path is many times slower than their bfloat16 one: `fast` computes in bfloat16
        out_dtype = x2d.dtype
        x2d = x2d.to(torch.bfloat16 if fast and out_dtype == torch.float32 else out_dtype).contiguous()
        if self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2d, self.packed, self.scales.to(x2d.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2d, self.packed, self.group_size, self.scales.to(x2d.dtype)
            )
        return y.to(out_dtype)


def tiles_run() -> bool:
    """Whether int4 draft weights run hf-spec's int8-input kernel here (it builds, with AVX2 or better)."""
    loaded, isa, _, _ = cpu_skinny_gemm.kernel_state()
    return loaded and isa >= cpu_skinny_gemm.ISA_AVX2


def int4_group_size(in_features: int) -> int:
    return next((g for g in (64, 128, 32, 256) if in_features % g == 0), 0)


def quantize_linears(
    module: nn.Module, scheme: str, skip: torch.Tensor | None = None, **kwargs
) -> dict[nn.Linear, QuantizedWeight]:
    """Packed copies of the `nn.Linear` weights in `module` (the module itself is left unchanged); int4 leaves
    out the shapes its kernel cannot take, and weights it cannot read (quantized tensor subclasses such as
    torchao's, offloaded `meta` placeholders: those layers draft with their own weights). `skip`: a weight packed
    elsewhere (a head's LM head, read through its own packed copy); a layer holding it is left out."""
    return {
        m: QuantizedWeight.from_weight(m.weight, scheme, **kwargs)
        for m in module.modules()
        if type(m) is nn.Linear
        and (skip is None or m.weight.data_ptr() != skip.data_ptr())
        and type(m.weight.data) is torch.Tensor
        and m.weight.device.type != "meta"
        and (scheme != "int4" or (int4_group_size(m.in_features) and m.out_features % 16 == 0))
    }


@contextlib.contextmanager
def quantized_linears(weights: Mapping[nn.Linear, QuantizedWeight]) -> Iterator[None]:
    """Inside the block, the given `nn.Linear` layers compute with their packed weights, for calls from this
    thread only: a target forward on another thread (Talon's verification beside an asynchronous drafter) that
    meets a patched layer gets its own weights (by `skinny_linear`). A compiled drafter step traced inside the
    block is the owner's (dynamo cannot trace the thread check)."""
    owner = threading.get_ident()

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or threading.get_ident() == owner:
            return weights[self].linear(x, self.bias)
        return skinny_linear(x, self.weight, self.bias)

    with patched_forwards(weights, forward):
        yield


@contextlib.contextmanager
def draft_linears(model: nn.Module, weights: Mapping[nn.Linear, QuantizedWeight]) -> Iterator[None]:
    """Inside the block, `model`'s linears run their packed copies where `weights` has them and hf-spec's float32
    kernels elsewhere (the packed ones are patched first: `fast_linears` leaves patched modules alone)."""
    with quantized_linears(weights), fast_linears(model):
        yield


__all__ = [
    "SCHEMES",
    "QuantizedWeight",
    "draft_linears",
    "int4_group_size",
    "quantize_linears",
    "quantized_linears",
    "tiles_run",
]
