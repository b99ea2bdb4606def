"""Faster CPU matmuls for the few-token inputs of verification.

On x86 CPUs (MKL), `F.linear(x, W)` with 4..32 rows runs 2-3x below memory bandwidth. Inside `fast_linears`,
fp32 CPU inputs with 2..32 rows go to a C++ kernel that reads each row of W once (`cpu_skinny_gemm`); without
that kernel (no compiler, `HF_SPEC_NO_CPP_KERNELS=1`, other dtypes), 8..32 rows are computed as `(W @ x.T).T`,
which MKL runs closer to bandwidth. One row, and more than 32, stay `F.linear`.

Measured (torch 2.13, MKL, 2 threads, weights streamed from DRAM): Qwen2.5-0.5B MLP weight (4864, 896), 9 rows:
F.linear 1.56 ms, (W @ x.T).T 1.33 ms, kernel 0.67 ms (1 row: 0.59 ms); 151,936-row LM head, 9 rows: 62 / 38 /
21 ms (1 row: 18 ms). Whole forward of 9 new tokens after 200 cached: 212 ms stock, 184 ms mm-trick, 102 ms
kernel (1 token: 83 ms). Same values up to float rounding; nothing changes outside `fast_linears`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hf_spec.kernels import cpu_skinny_gemm

KERNEL_MIN_ROWS, KERNEL_MAX_ROWS = 2, 32  # C++ kernel (when it builds)
MIN_ROWS, MAX_ROWS = 8, 32  # mm-trick fallback without the kernel


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the C++ kernel or as `(weight @ x.T).T` for the row counts where those win."""
    if x.dim() and x.shape[-1]:
        rows = x.numel() // x.shape[-1]
        if KERNEL_MIN_ROWS <= rows <= KERNEL_MAX_ROWS:
            y = cpu_skinny_gemm.kernel_linear(x, weight, bias)
            if y is not None:
                return y
        if MIN_ROWS <= rows <= MAX_ROWS and x.is_cpu:
            y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, self.weight, self.bias)


@contextlib.contextmanager
def fast_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Route the model's `nn.Linear` layers through `skinny_linear` inside the block (CPU only)."""
    if not enabled or next(model.parameters()).device.type != "cpu":
        yield
        return
    with patched_forwards([m for m in model.modules() if type(m) is nn.Linear], _forward):
        yield


@contextlib.contextmanager
def patched_forwards(modules: Iterable[nn.Module], forward: Callable) -> Iterator[None]:
    """Inside the block `forward(module, x)` replaces the forward of each module not patched already."""
    patched = [m for m in modules if "forward" not in m.__dict__]
    for m in patched:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
