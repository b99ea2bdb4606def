"""Group-quantized weights: `W[n, k] = scale[n, g] * code[n, k] (+ min[n, g])`, `g = k // group_size`, the one
layout every weight-only scheme hf-spec runs on a target is packed into (`GroupQuantWeight`), with its checks,
packing and torch de-quantization. Their linear (hf-spec's kernel, the torch twin, the operator) is
`hf_spec.kernels.group_quant`.

GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: `hf_spec.models.gguf_blocks` repacks them)
and the int8 / int4 weights hf-spec makes at load all land here. Codes are int8 (`CodeLayout.I8`), or unsigned
4-bit (`U4`) / 5-bit (`U5`: 4-bit plus a bit plane) packed two a byte. Where a weight has mins, `scale * code` is
exact in float32 (the packers see to it), so the kernel's fused multiply-add and `dequantize` give the same weight
bits. The int8-input kernel reads its weights tiled (`tiled()`: `I8X16`, `U4X16`, `U5X16`), the same codes with 16
rows interleaved, so that one vector load gives 4 inputs of 16 rows. A format whose min is a fixed multiple of its
scale (GGUF's Q4_0 and Q5_0: `d * (q - 8)`, `d * (q - 16)`) keeps that multiple as `zero_point` instead of a stored
min: a quarter fewer bytes for Q5_0. Scales that are float16 values (GGUF's Q8_0, Q4_0 and Q5_0 `d`) may be kept as
float16, exactly, where the groups are 32 inputs and no min is stored: the int8-input kernel reads them as they are
(another 2 bytes less a group).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

RUN = 32  # codes per packed run (U4 / U5)
ACTIVATION_RUN = 32  # inputs per int8 scale of x with `int8_activations`
INT4_GROUP = 32  # inputs per scale and min of the int4 weights `quantize_int4` makes
DEQUANTIZE_ROWS = 4096  # rows of a weight de-quantized at a time
# the zero points the kernels take: none (0) and powers of two, so that a made min `-z * scale` is exact
ZERO_POINTS = frozenset({0} | {1 << i for i in range(8)})
TILE_ROWS = 16  # rows of w a tiled layout interleaves


class CodeLayout(enum.IntEnum):
    """How codes are stored (the values are the C++ `CodeLayout`)."""

    I8 = 0  # int8, one a weight
    U4 = 1  # unsigned 4-bit, two a byte: in each run of 32 codes byte i holds code i (low) and code i + 16 (high)
    U5 = 2  # U4 plus an int32 a run whose bit i is bit 4 of code i
    # the same codes tiled for the int8-input kernel: rows in blocks of 16 (`hf_spec/csrc/gemm_group_quant_x16.cpp`
    # gives the byte order), the scales and mins `[rows / 16, groups, 16]` (kept in `(rows, groups)` tensors)
    I8X16 = 3  # uint8 code + 128, [rows / 16][inputs / 4][16][4]
    U4X16 = 4  # [rows / 16][inputs / 8][16][4]: low nibble code 8j + i, high nibble code 8j + 4 + i
    U5X16 = 5  # U4X16 plus high bits [rows / 16][inputs / 8][2] (uint64: bit 4r + i is bit 4 of row r's code)

    @property
    def is_tiled(self) -> bool:
        return self.value >= CodeLayout.I8X16

    @property
    def rows(self) -> CodeLayout:
        """The row-major layout this one tiles (itself where it is row-major)."""
        return CodeLayout(self.value - CodeLayout.I8X16) if self.is_tiled else self


@dataclass
class GroupQuantWeight:
    """A group-quantized `(out_features, in_features)` weight, on CPU.

    `codes`: int8 `(out_features, in_features)` (I8) or uint8 `(out_features, in_features // 2)` (U4, U5);
    `scale`, `min`: float32 `(out_features, in_features // group_size)` (`min` None where the format has none;
    `scale` float16 where `group_size` is 32 and there is no stored min);
    `high`: int32 `(out_features, in_features // 32)` (U5 only).
    Tiled layouts (`tiled()`) hold the same numbers of bytes in the same shapes (I8X16 codes uint8), reordered;
    `out_features` a multiple of 16 and `in_features` of 32.

    `int8_activations`: products with this weight quantize x first, each run of 32 inputs of a row to int8
    (`quantize_activations`), and multiply integers (as llama.cpp computes its GGUF weights); `in_features` a
    multiple of 32. Otherwise x is used as given, in float32.

    `zero_point`: 0, or a power of two z with `min` None: the weight's min is `-z * scale` (exact in float32), not
    stored (`mins()` makes it)."""

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None
    high: torch.Tensor | None
    layout: CodeLayout
    group_size: int
    in_features: int
    int8_activations: bool = False
    zero_point: int = 0
    # `int(layout)`, what the compiled operator is given: a plain int, which dynamo guards by value in C++, where
    # the one enum member shared by every weight costs a Python identity guard per linear on each compiled call
    layout_code: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.layout = CodeLayout(self.layout)
        self.layout_code = int(self.layout)
        n, k, g = self.scale.shape[0], self.in_features, self.group_size
        rows = self.layout.rows
        step = 16 if rows is CodeLayout.I8 else RUN
        if g < 1 or g % step or k % g:
            raise ValueError(f"{self.layout.name} group size {g} must be a multiple of {step} dividing {k}")
        if self.layout.is_tiled and (n % TILE_ROWS or k % RUN):
            raise ValueError(
                f"{self.layout.name} needs out_features divisible by {TILE_ROWS} and in_features by {RUN}, "
                f"got {n} x {k}"
            )
        width = k if rows is CodeLayout.I8 else k // 2
        dtype = torch.int8 if self.layout is CodeLayout.I8 else torch.uint8
        if self.codes.shape != (n, width) or self.codes.dtype != dtype:
            raise ValueError(
                f"codes must be {dtype} {(n, width)}, got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        for name, t in (("scale", self.scale), ("min", self.min)):
            if t is not None and (t.shape != (n, k // g) or t.dtype != torch.float32):
                if t is self.scale and t.shape == (n, k // g) and t.dtype == torch.float16:
                    if g == RUN and self.min is None:
                        continue
                    raise ValueError("float16 scales need groups of 32 inputs and no stored min")
                raise ValueError(f"{name} must be float32 {(n, k // g)}, got {t.dtype} {tuple(t.shape)}")
        if (self.high is not None) != (rows is CodeLayout.U5):
            raise ValueError("high bits are given for U5 weights, and only for them")
        if self.high is not None and (self.high.shape != (n, k // RUN) or self.high.dtype != torch.int32):
            raise ValueError(
                f"high must be int32 {(n, k // RUN)}, got {self.high.dtype} {tuple(self.high.shape)}"
            )
        z = self.zero_point
        if z not in ZERO_POINTS or (z and self.min is not None):
            raise ValueError(
                f"zero_point must be 0 or a power of two up to 128, with no stored min; got {z!r}"
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

    def mins(self) -> torch.Tensor | None:
        """The min float32 `(out_features, groups)`: the stored one, `-zero_point * scale`, or None."""
        return self.min if not self.zero_point else self.scale.float() * -float(self.zero_point)

    def kernel_plan(self) -> tuple:
        """What a kernel call reads, worked out once: `(codes, high or 0, scale, min or 0)` addresses, then
        `out_features, in_features, layout, group_size, int8_activations, zero_point, scale_f16` (made again where
        the codes, the scales or `int8_activations` were replaced: a weight's other fields come with its codes).
        The float kernel reads stored float32 mins and scales only: for it a zero point's mins and float16 scales
        are made once and kept with the plan."""
        cached = self.__dict__.get("_plan")
        key = cached[0] if cached is not None else None
        if (
            key is None
            or key[0] is not self.codes
            or key[1] is not self.scale
            or key[2] is not self.int8_activations
        ):
            zero_point, mins, scale = self.zero_point, self.min, self.scale
            if not self.int8_activations:
                zero_point, mins, scale = 0, self.mins(), scale.float()
            scale_f16 = scale.dtype == torch.float16
            key = (
                self.codes,
                self.scale,
                self.int8_activations,
                mins,
                scale,
            )  # (made tensors kept alive here)
            ptrs = tuple(0 if t is None else t.data_ptr() for t in (self.codes, self.high, scale, mins))
            plan = (*ptrs, self.out_features, self.in_features, self.layout_code, self.group_size,
                    self.int8_activations, zero_point, scale_f16)  # fmt: skip
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
        zero_point: int = 0,
    ) -> GroupQuantWeight:
        """The weight of tensors a checked `GroupQuantWeight` already holds (the custom op's arguments), with the
        shape checks the kernel's memory reads rely on but not the full ones: a compiled graph calls the op once a
        linear a step. Tensors that do not fit go through the full checks (which raise)."""
        n, k = scale.shape[0] if scale.dim() == 2 else -1, in_features
        kind = CodeLayout(layout)
        fits = (
            codes.dim() == 2
            and codes.shape[0] == n
            and codes.shape[1] == (k if kind.rows is CodeLayout.I8 else k // 2)
            and codes.dtype is (torch.int8 if layout == CodeLayout.I8 else torch.uint8)
            and codes.is_contiguous()
            and (not kind.is_tiled or n % TILE_ROWS == 0)
            and (
                scale.dtype is torch.float32
                or (scale.dtype is torch.float16 and group_size == RUN and min is None)
            )
            and scale.is_contiguous()
            and group_size > 0
            and scale.shape[1] * group_size == k
            and (
                min is None
                or (min.shape == scale.shape and min.dtype is torch.float32 and min.is_contiguous())
            )
            and (high is None) == (kind.rows is CodeLayout.U5)
            and (high is None or (high.shape == (n, k // RUN) and high.is_contiguous()))
            and zero_point in ZERO_POINTS
            and (min is None or not zero_point)
        )
        if not fits:
            return cls(codes, scale, min, high, layout, group_size, in_features, int8_activations, zero_point)
        weight = object.__new__(cls)
        weight.__dict__.update(
            codes=codes, scale=scale, min=min, high=high, layout=layout, group_size=group_size,
            in_features=in_features, int8_activations=int8_activations, zero_point=zero_point,
            layout_code=int(layout),
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
        zero_point: int = 0,
    ) -> GroupQuantWeight:
        """Pack integer `codes` `(out_features, in_features)` (I8: -128..127; U4: 0..15; U5: 0..31)."""
        layout = CodeLayout(layout)
        n, k = codes.shape
        if layout is CodeLayout.I8:
            return cls(codes.to(torch.int8), scale, min, None, layout, group_size, k, zero_point=zero_point)
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
        return cls(packed, scale, min, high, layout, group_size, k, zero_point=zero_point)

    def unpacked_codes(self, rows: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The integer codes of `rows`, int32 `(rows, in_features)`."""
        if self.layout.is_tiled:
            return self._tiled_codes(self._row_index(rows))
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

    def _row_index(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """`rows` as int64 indices."""
        if isinstance(rows, slice):
            return torch.arange(self.out_features, dtype=torch.int64)[rows]
        return torch.as_tensor(rows, dtype=torch.int64).reshape(-1)

    def _tiled_codes(self, index: torch.Tensor) -> torch.Tensor:
        """The codes of rows `index` of a tiled weight, int32 `(rows, in_features)`."""
        k, blocks = self.in_features, self.out_features // TILE_ROWS
        block, r = index // TILE_ROWS, index % TILE_ROWS
        if self.layout is CodeLayout.I8X16:
            picked = self.codes.view(blocks, k // 4, TILE_ROWS, 4)[block, :, r, :]  # (rows, k / 4, 4)
            return picked.reshape(-1, k).to(torch.int32) - 128
        # (rows, k / 8, 4)
        picked = self.codes.view(blocks, k // 8, TILE_ROWS, 4)[block, :, r, :].to(torch.int32)
        c = torch.stack([picked & 15, picked >> 4], dim=2)  # (rows, k / 8, 2, 4): inputs 8j + 4h + i
        if self.layout is CodeLayout.U5X16:
            words = self.high.view(-1).view(torch.int64).view(blocks, k // 8, 2)[block]  # (rows, k / 8, 2)
            shift = (4 * r)[:, None, None, None] + torch.arange(4, dtype=torch.int64)
            c = c | (((words[..., None] >> shift) & 1).to(torch.int32) << 4)
        return c.reshape(-1, k)

    def _table_rows(self, table: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        """Rows of a `(out_features, groups)` table (scale or min) in the row order, tiled or not."""
        if not self.layout.is_tiled:
            return table[rows]
        index = self._row_index(rows)
        groups = table.shape[1]
        return table.view(self.out_features // TILE_ROWS, groups, TILE_ROWS)[
            index // TILE_ROWS, :, index % TILE_ROWS
        ]

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
        scale = self._table_rows(self.scale, rows).float()
        w = codes.view(n, groups, self.group_size) * scale[..., None]
        if self.min is not None:
            w = w + self._table_rows(self.min, rows)[..., None]
        elif self.zero_point:  # -z * scale exact: the same bits as a stored min
            w = w + (scale * -float(self.zero_point))[..., None]
        return w.view(n, self.in_features)

    def tiled(self) -> GroupQuantWeight:
        """This weight in its tiled layout (itself if tiled): what the int8-input kernel reads fastest, several
        rows of x at a time. Needs `out_features` divisible by 16 and `in_features` by 32."""
        if self.layout.is_tiled:
            return self
        n, k, blocks = self.out_features, self.in_features, self.out_features // TILE_ROWS
        if n % TILE_ROWS or k % RUN:
            raise ValueError(
                f"tiled layouts need out_features divisible by {TILE_ROWS} and in_features by {RUN}, got {n} x {k}"
            )
        high = None
        if self.layout is CodeLayout.I8:
            stored = (self.codes.to(torch.int16) + 128).to(torch.uint8)
            codes = stored.view(blocks, TILE_ROWS, k // 4, 4).transpose(1, 2)
        else:
            c = self.unpacked_codes().view(blocks, TILE_ROWS, k // 8, 2, 4)
            codes = ((c[..., 0, :] & 15) | ((c[..., 1, :] & 15) << 4)).to(torch.uint8).transpose(1, 2)
            if self.layout is CodeLayout.U5:
                bits = ((c >> 4) & 1).to(torch.int64).permute(0, 2, 3, 1, 4).reshape(blocks, k // 8, 2, 64)
                # distinct bits: their sum is their or
                words = (bits << torch.arange(64, dtype=torch.int64)).sum(-1)
                high = words.contiguous().view(torch.int32).view(n, k // RUN)
        codes = codes.contiguous().view(n, -1)

        def table(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.view(blocks, TILE_ROWS, -1).transpose(1, 2).contiguous().view(n, -1)

        layout = CodeLayout(self.layout.value + CodeLayout.I8X16)
        return GroupQuantWeight(codes, table(self.scale), table(self.min), high, layout, self.group_size, k,
                                self.int8_activations, self.zero_point)  # fmt: skip

    def untiled(self) -> GroupQuantWeight:
        """This weight in its row-major layout (itself if row-major)."""
        if not self.layout.is_tiled:
            return self
        index = self._row_index(slice(None))
        scale = self._table_rows(self.scale, index).contiguous()
        low = None if self.min is None else self._table_rows(self.min, index).contiguous()
        weight = GroupQuantWeight.from_codes(
            self.unpacked_codes(), scale, low, self.layout.rows, self.group_size, self.zero_point
        )
        weight.int8_activations = self.int8_activations
        return weight

    def select_rows(self, index: torch.Tensor) -> GroupQuantWeight:
        """The weight made of rows `index` (int64 `(rows,)`), in that order (row-major)."""
        if self.layout.is_tiled:
            return self.untiled().select_rows(index)

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
            self.zero_point,
        )


def quantize_int8(weight: torch.Tensor) -> GroupQuantWeight:
    """Per-output-channel symmetric int8 of `weight` `(out, in)`: `scale = max |w| / 127` a row, codes in -127..127."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (w / scale).round().clamp(-127, 127).to(torch.int8)
    return GroupQuantWeight.from_codes(codes, scale.contiguous(), None, CodeLayout.I8, w.shape[1])


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP) -> GroupQuantWeight:
    """Grouped asymmetric int4 of `weight` `(out, in)`: per group of `group_size` inputs `min = low`, `scale = (high -
    low) / 15` rounded to bfloat16 (so `scale * code` is exact in float32), codes in 0..15."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    groups = w.view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    scale = torch.where(
        scale > 0, scale, torch.ones_like(scale)
    )  # a constant group: codes 0, w = min exactly
    codes = (
        ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).view(out_features, in_features)
    )
    return GroupQuantWeight.from_codes(codes, scale, low.contiguous(), CodeLayout.U4, group_size)


__all__ = [
    "ACTIVATION_RUN",
    "DEQUANTIZE_ROWS",
    "INT4_GROUP",
    "RUN",
    "TILE_ROWS",
    "ZERO_POINTS",
    "CodeLayout",
    "GroupQuantWeight",
    "quantize_int4",
    "quantize_int8",
]
