"""GGUF's quantized blocks repacked, without de-quantizing, into `GroupQuantWeight`s.

Every block format here de-quantizes as `w = scale_g * q + min_g` over groups of 16 or 32 inputs with small integer
codes q; the scales and mins are computed in float32 exactly as gguf's reference de-quantization
(`gguf.quants.dequantize`) computes them, so the packed weight's `dequantize()` equals the reference bit for bit
(but for the sign of a zero weight: Q4_0 / Q5_0's `d * q + (-8 d)` gives +0 where `d * (q - 8)` may give -0):

| format | codes           | group | scale          | min            |
|--------|-----------------|-------|----------------|----------------|
| Q8_0   | int8 q          | 32    | d              | none           |
| Q4_0   | 4-bit q         | 32    | d              | -8 d           |
| Q4_1   | 4-bit q         | 32    | d              | m              |
| Q5_0   | 5-bit q         | 32    | d              | -16 d          |
| Q5_1   | 5-bit q         | 32    | d              | m              |
| Q4_K   | 4-bit q         | 32    | d * sc         | -(dmin * m)    |
| Q5_K   | 5-bit q         | 32    | d * sc         | -(dmin * m)    |
| Q6_K   | int8 q - 32     | 16    | d * sc         | none           |

(d, dmin, m: the block's float16 values widened; sc, m of the K formats: their 6-bit / int8 sub-block values.)
Q4_0's and Q5_0's mins are not stored: the weight's `zero_point` (8, 16) stands for them.
Wherever a min is added, `scale * q` is exact in float32 (at most 22 significant bits), so one rounding happens,
as in the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from hf_spec.kernels.group_quant_weight import CodeLayout, GroupQuantWeight

Q = GGMLQuantizationType
QK_K = 256
SUPPORTED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes `(blocks, 2)` as float32 `(blocks, 1)`."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes `(blocks, 16)` of a 32-code run (low nibbles codes 0-15, high 16-31) as codes `(blocks, 32)`."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """4 bytes `(blocks, 4)` as bits `(blocks, 32)`, bit i of the little-endian uint32."""
    v = np.ascontiguousarray(qh).view(np.uint32)
    return ((v >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit sub-block scales and mins `(blocks, 8)` of Q4_K / Q5_K's 12 packed bytes `(blocks, 12)`."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _decode(b: np.ndarray, qtype: GGMLQuantizationType):
    """Blocks `(blocks, bytes)` -> codes `(blocks, block_size)`, scale and min `(blocks, groups)` (min None),
    layout, group size, zero point (Q4_0 / Q5_0: their min `-z d` is not stored)."""
    n = b.shape[0]
    if qtype == Q.Q8_0:
        return b[:, 2:].view(np.int8), _f16(b[:, :2]), None, CodeLayout.I8, 32, 0
    if qtype in (Q.Q4_0, Q.Q4_1):
        d = _f16(b[:, :2])
        m, z = (None, 8) if qtype == Q.Q4_0 else (_f16(b[:, 2:4]), 0)
        return _nibbles(b[:, -16:]), d, m, CodeLayout.U4, 32, z
    if qtype in (Q.Q5_0, Q.Q5_1):
        d = _f16(b[:, :2])
        m, z, qh = (None, 16, b[:, 2:6]) if qtype == Q.Q5_0 else (_f16(b[:, 2:4]), 0, b[:, 4:8])
        return _nibbles(b[:, -16:]) | (_bits(qh) << 4), d, m, CodeLayout.U5, 32, z
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
        sc, mn = _k_scale_min(b[:, 4:16])
        qs = b[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        codes = (qs & 15).reshape(n, 8, 32)
        layout = CodeLayout.U4
        if qtype == Q.Q5_K:
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            codes = codes | ((qh & 1) << 4)
            layout = CodeLayout.U5
        return (
            codes.reshape(n, QK_K),
            d * sc.astype(np.float32),
            -(dmin * mn.astype(np.float32)),
            layout,
            32,
            0,
        )
    if qtype == Q.Q6_K:
        ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((ql & 15).reshape(n, 8, 32) | ((qh & 3).reshape(n, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
        return q.reshape(n, QK_K), scale, None, CodeLayout.I8, 16, 0
    raise NotImplementedError(f"GGUF {qtype.name} blocks are not supported (supported: {supported_names()})")


def supported_names() -> str:
    return ", ".join(t.name for t in SUPPORTED)


def repack(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> GroupQuantWeight:
    """A GGUF tensor's raw blocks `data` (uint8, any shape holding `out * in / block_size` blocks) of a weight of
    `shape` `(out_features, in_features)` (torch order) as a `GroupQuantWeight`."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED:
        raise NotImplementedError(
            f"GGUF {qtype.name} blocks are not supported (supported: {supported_names()})"
        )
    out_features, in_features = shape
    block, size = GGML_QUANT_SIZES[qtype]
    if in_features % block or data.size != out_features * in_features // block * size:
        raise ValueError(f"{qtype.name} data of {data.size} bytes does not hold a {shape} weight")
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1, size)
    codes, scale, mins, layout, group, zero_point = _decode(blocks, qtype)
    groups = in_features // group

    def rows(a: np.ndarray | None, dtype=np.float32) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).view(-1, groups)

    # a d that is one float16 a block (Q8_0, Q4_0, Q5_0) stays float16, exactly: half the scale bytes
    scale_dtype = np.float16 if qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0) else np.float32

    codes_t = torch.from_numpy(np.ascontiguousarray(codes)).view(out_features, in_features)
    return GroupQuantWeight.from_codes(
        codes_t, rows(scale, scale_dtype), rows(mins), layout, group, zero_point
    )


__all__ = ["SUPPORTED", "repack", "supported_names"]
