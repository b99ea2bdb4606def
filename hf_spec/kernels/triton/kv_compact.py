"""KV-cache compaction on the device: keep the root's and the accepted nodes' slots, in place, every tensor of a
layer group in one launch.

After a verification the block `[past, past + num_nodes + 1)` of every layer's keys and values holds `[root] +
tree`; the kept slots `keep` (relative, increasing: the root and the accepted path) move to `[past, past +
len(keep))`:

    t[..., past + j, :] = t[..., past + keep[j], :]        j = 0 .. len(keep) - 1, in order

Moving in order is safe in place because `keep[j] >= j`: a slot is read before any move writes it. A program
owns one (tensor, batch row, head) and moves its kept slots in order; tensors of the same dtype, shape and
strides (usually every layer's keys and values) form one group and one launch, their addresses passed as a table.
The caller then crops each tensor to `past + len(keep)` slots (a view).

Under `torch.compile`, or with `keep` given as a device tensor, the move runs as the custom operator
`torch.ops.hf_spec.kv_compact_` (`hf_spec.kernels.triton.op`; it mutates the tensors): one launch per tensor, since a
traced graph has no addresses to put in a table (inside a CUDA graph a launch costs little).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import triton
import triton.language as tl

from hf_spec.kernels.triton.op import kernel_op, wrap_triton

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _move_slots(row, keep_ptr, num_keep, past, stride_s, dim, BLOCK_D: tl.constexpr):
    """Move the kept slots of one (batch row, head) `row`, in order: slot past + j <- slot past + keep[j]."""
    offs = tl.arange(0, BLOCK_D)
    for j in range(0, num_keep):
        src = tl.cast(past + tl.load(keep_ptr + j), tl.int64) * stride_s
        dst = tl.cast(past + j, tl.int64) * stride_s
        for d in range(0, dim, BLOCK_D):
            inside = d + offs < dim
            v = tl.load(row + src + d + offs, mask=inside)
            tl.store(row + dst + d + offs, v, mask=inside)


@triton.jit
def _compact(
    table_ptr,
    num_tensors,
    num_keep,
    past,
    heads,
    stride_b,
    stride_h,
    stride_s,
    dim,
    DTYPE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (t, bh): tensor t of the group (its address at `table[t]`), batch row bh // heads, head bh % heads.
    `table[num_tensors:]` holds `keep`."""
    t = tl.program_id(0)
    bh = tl.program_id(1)
    base = tl.load(table_ptr + t).to(tl.pointer_type(DTYPE))
    row = base + tl.cast(bh // heads, tl.int64) * stride_b + tl.cast(bh % heads, tl.int64) * stride_h
    _move_slots(row, table_ptr + num_tensors, num_keep, past, stride_s, dim, BLOCK_D)


@triton.jit
def _compact_one(
    t_ptr, keep_ptr, num_keep, past, heads, stride_b, stride_h, stride_s, dim, BLOCK_D: tl.constexpr
):
    """Program bh: batch row bh // heads, head bh % heads of one tensor."""
    bh = tl.program_id(0)
    row = t_ptr + tl.cast(bh // heads, tl.int64) * stride_b + tl.cast(bh % heads, tl.int64) * stride_h
    _move_slots(row, keep_ptr, num_keep, past, stride_s, dim, BLOCK_D)


def group_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys share a launch."""
    return (t.dtype, t.device, tuple(t.shape), t.stride())


def kv_compact(tensors: list[torch.Tensor], past: int, keep: list[int] | torch.Tensor) -> None:
    """Move the `keep` slots (relative to `past`) of every `(batch, heads, slots, dim)` tensor to `[past, past +
    len(keep))`, in place; one launch per group of tensors with the same dtype, shape and strides (compiled, or
    `keep` a tensor: one launch per tensor, by `torch.ops.hf_spec.kv_compact_`).

    Args:
        tensors: the layers' keys and values, last dim contiguous; a tensor listed twice is moved once (compiled:
            the same tensor object; other overlapping tensors are not allowed there).
        keep: increasing relative slots, `keep[0] == 0` (the root): a list, or an int64 tensor `(len(keep),)` on
            the tensors' device.
    """
    for t in tensors:
        if t.dtype not in _TL_DTYPES or t.stride(-1) != 1:
            raise TypeError(
                f"kv_compact takes float16/bfloat16/float32 tensors, last dim contiguous; got {t.dtype}"
            )
    if torch.compiler.is_compiling() or isinstance(keep, torch.Tensor):
        unique: list[torch.Tensor] = []
        for t in tensors:
            if not any(t is u for u in unique):
                unique.append(t)
        if unique:
            if not isinstance(keep, torch.Tensor):
                keep = torch.tensor(keep, dtype=torch.long, device=unique[0].device)
            _kv_compact_op(unique, keep, past)
        return
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    seen: set[tuple] = set()
    for t in tensors:
        if (t.data_ptr(), t.shape, t.stride()) in seen:  # a tensor two layers share is moved once
            continue
        seen.add((t.data_ptr(), t.shape, t.stride()))
        groups[group_key(t)].append(t)
    for (dtype, device, shape, stride), group in groups.items():
        b, h, _, d = shape
        # one host-to-device copy: the tensors' addresses, then `keep`
        table = torch.tensor([t.data_ptr() for t in group] + list(keep), dtype=torch.int64).to(device)
        _compact[(len(group), b * h)](
            table,
            len(group),
            len(keep),
            past,
            h,
            stride[0],
            stride[1],
            stride[2],
            d,
            DTYPE=_TL_DTYPES[dtype],
            BLOCK_D=triton.next_power_of_2(d),
        )


def _moved_in_place(tensors: list[torch.Tensor], keep: torch.Tensor, past: int) -> None:
    """The fake: the tensors change in place, nothing is returned."""


@kernel_op("kv_compact_", (_compact_one,), _moved_in_place, mutates_args=("tensors",))
def _kv_compact_op(tensors: list[torch.Tensor], keep: torch.Tensor, past: int) -> None:
    num_keep = keep.shape[0]
    for t in tensors:
        b, h, _, d = t.shape
        wrap_triton(_compact_one)[(b * h,)](
            t,
            keep,
            num_keep,
            past,
            h,
            t.stride(0),
            t.stride(1),
            t.stride(2),
            d,
            BLOCK_D=triton.next_power_of_2(d),
        )


def kv_compact_reference(tensors: list[torch.Tensor], past: int, keep: list[int] | torch.Tensor) -> None:
    """The torch twin of `kv_compact` (same result, in place): one `index_select` per tensor."""
    for t in {(t.data_ptr(), t.shape, t.stride()): t for t in tensors}.values():
        index = torch.as_tensor(keep, dtype=torch.long, device=t.device) + past
        t[..., past : past + len(keep), :] = t.index_select(-2, index)
