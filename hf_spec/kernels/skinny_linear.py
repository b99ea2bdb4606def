"""Faster CPU matmuls for the few-token inputs of verification (and the one-token steps of drafting).

On x86 CPUs (MKL), `F.linear(x, W)` with 4..32 rows runs 2-3x below memory bandwidth. Inside `fast_linears`,
fp32 CPU inputs with 2..32 rows go to a C++ kernel that reads each row of W once (`cpu_skinny_gemm`); without
that kernel (no compiler, `HF_SPEC_NO_CPP_KERNELS=1`, other dtypes), 8..32 rows are computed as `(W @ x.T).T`
where that is measured faster (`mm_trick_pays`: MKL runs it closer to bandwidth on an Intel Xeon). More than 32
rows stay `F.linear`; so does one row unless the kernel is measured faster on this machine
(`one_row_kernel_pays`: MKL's GEMV is on an Intel Xeon, not on an AMD EPYC, where the kernel takes the 151,936-row
LM head from 34 to 19 ms). hf-spec's loop never uses this for its own
one-token steps (plain decoding stays `generate`'s), only drafters do.

Measured on a 2-core Intel Xeon (torch 2.13, MKL, 2 threads, weights streamed from DRAM; F.linear's times on one
row in parentheses): Qwen2.5-0.5B MLP weight (4864, 896), 9 rows:
F.linear 1.56 ms, (W @ x.T).T 1.33 ms, kernel 0.67 ms (1 row: 0.59 ms); 151,936-row LM head, 9 rows: 62 / 38 /
21 ms (1 row: 18 ms). Whole forward of 9 new tokens after 200 cached: 212 ms stock, 184 ms mm-trick, 102 ms
kernel (1 token: 83 ms). Same values up to float rounding; nothing changes outside `fast_linears`.

bfloat16 inputs with 1..20 rows go to the kernel's AVX512-BF16 path where it is measured faster than torch's
(`bf16_kernel_pays`): on a 2-core AMD EPYC Zen 5 a Qwen2.5-0.5B forward of 1-17 tokens after 200 cached takes
0.73-0.85 of stock's time (`benchmarks/verify_cost.py --dtypes bfloat16`). The sums are the same fp32 sums in
another order, rounded once to bfloat16, as torch's are.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hf_spec.kernels import cpu_skinny_gemm

KERNEL_MIN_ROWS, KERNEL_MAX_ROWS = 2, 32  # C++ kernel (when it builds)
MIN_ROWS, MAX_ROWS = 8, 32  # mm-trick fallback without the kernel
# bfloat16 kernel (AVX512-BF16; Zen 5, Qwen forwards after 200 cached tokens): 1-13 tokens at 0.82 of torch's time,
# 17 at 0.73-0.85 (torch's bf16 GEMM slows down past 16 rows), 25 at 0.89-1.03: level from ~20
BF16_MAX_ROWS = 20


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the C++ kernel or as `(weight @ x.T).T` for the row counts where those win."""
    if x.dim() and x.shape[-1]:
        rows = x.numel() // x.shape[-1]
        if x.dtype is torch.bfloat16 and rows <= BF16_MAX_ROWS and bf16_kernel_pays():
            y = cpu_skinny_gemm.kernel_linear_bf16(x, weight, bias)
            if y is not None:
                return y
        if KERNEL_MIN_ROWS <= rows <= KERNEL_MAX_ROWS or (rows == 1 and one_row_kernel_pays()):
            y = cpu_skinny_gemm.kernel_linear(x, weight, bias)
            if y is not None:
                return y
        if MIN_ROWS <= rows <= MAX_ROWS and x.is_cpu and mm_trick_pays(x.dtype):
            y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


_bf16: dict[int, bool] = {}  # torch thread count -> the bf16 kernel beat F.linear on 9 rows
_one_row: dict[int, bool] = {}  # torch thread count -> the kernel beat F.linear on one row
_mm_trick: dict[tuple[int, torch.dtype], bool] = {}  # (threads, dtype) -> (W @ x.T).T beat F.linear on 9 rows
_measure_lock = threading.Lock()


def one_row_kernel_pays() -> bool:
    """Whether the kernel beats `F.linear` on one row of x here: measured once per torch thread count (~0.5 s, on
    256 MiB of weights so they stream from DRAM as a model's do); `HF_SPEC_ONE_ROW_KERNEL=1` / `0` forces it."""
    forced = _forced("HF_SPEC_ONE_ROW_KERNEL")
    if forced is not None:
        return forced
    return _remembered(_one_row, torch.get_num_threads(), _measure_one_row)


def bf16_kernel_pays() -> bool:
    """Whether the bfloat16 kernel (AVX512-BF16 CPUs) beats `F.linear` on 9 bf16 rows here: measured once per torch
    thread count (~0.5 s, 256 MiB of weights); `HF_SPEC_BF16_KERNEL=1` / `0` forces it. On an AMD EPYC Zen 5 it
    reads the weights at ~35 GB/s against torch's ~29 (Qwen2.5-0.5B's layers, 1-13 rows: 0.80-0.84 of the time)."""
    forced = _forced("HF_SPEC_BF16_KERNEL")
    if forced is not None:
        return forced
    return _remembered(_bf16, torch.get_num_threads(), _measure_bf16)


def one_row_kernel_decision() -> bool | None:
    """The remembered `one_row_kernel_pays()` for this thread count, None before it was measured (no measuring)."""
    return _one_row.get(torch.get_num_threads())


def mm_trick_pays(dtype: torch.dtype) -> bool:
    """Whether `(W @ x.T).T` beats `F.linear` on 9 rows of `dtype` here: measured once per torch thread count and
    dtype (~0.5 s, 256 MiB of weights); `HF_SPEC_MM_TRICK=1` / `0` forces it. It pays on an Intel Xeon in float32
    and in bfloat16 with AMX (89 -> 77 ms for a 13-row Qwen forward) but not on an AMD EPYC Zen 5 in bfloat16
    (63 -> 79 ms)."""
    forced = _forced("HF_SPEC_MM_TRICK")
    if forced is not None:
        return forced
    return _remembered(_mm_trick, (torch.get_num_threads(), dtype), lambda: _measure_mm_trick(dtype))


def _forced(env_var: str) -> bool | None:
    """The decision an environment variable forces (1/0, true/false, yes/no), None where it names none."""
    flag = os.environ.get(env_var, "").strip().lower()
    return flag in ("1", "true", "yes") if flag in ("0", "1", "true", "false", "yes", "no") else None


def _remembered(decisions: dict, key, measure: Callable[[], bool]) -> bool:
    """`decisions[key]`, measured once (under a lock: two threads never measure at the same time)."""
    if key not in decisions:
        with _measure_lock:
            if key not in decisions:
                decisions[key] = measure()
    return decisions[key]


@torch.no_grad()
def _measure_one_row(repeats: int = 5) -> bool:
    weights = _streamed_weights(torch.float32)
    x = torch.full((1, 1024), 0.5)
    if cpu_skinny_gemm.kernel_linear(x, weights[0]) is None:
        return False
    return _time_ratio(cpu_skinny_gemm.kernel_linear, x, weights, repeats) < 0.8


@torch.no_grad()
def _measure_bf16(repeats: int = 5) -> bool:
    weights = _streamed_weights(torch.bfloat16)
    x = torch.full((9, 1024), 0.5, dtype=torch.bfloat16)
    if cpu_skinny_gemm.kernel_linear_bf16(x, weights[0]) is None:
        return False
    return _time_ratio(cpu_skinny_gemm.kernel_linear_bf16, x, weights, repeats) < 0.95


@torch.no_grad()
def _measure_mm_trick(dtype: torch.dtype, repeats: int = 5) -> bool:
    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.mm(w, x.t()).t()

    x = torch.full((9, 1024), 0.5, dtype=dtype)
    return _time_ratio(mm, x, _streamed_weights(dtype), repeats) < 0.9


def _streamed_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    # 256 MiB of weights: with 64 MiB a large L3 (AMD EPYC) kept part of them cached and the one-row ratio flapped
    # around its threshold between processes (0.70-0.85); at this size it is 0.65-0.71 there, run to run
    count = (256 << 20) // (2048 * 1024 * torch.empty((), dtype=dtype).element_size())
    return [torch.full((2048, 1024), 0.01, dtype=dtype) for _ in range(count)]


def _time_ratio(fn: Callable, x: torch.Tensor, weights: list[torch.Tensor], repeats: int) -> float:
    """Median over `repeats` of (time of `fn(x, w)` / time of `F.linear(x, w)`) over all `weights`, after a warm-up."""

    def seconds(f: Callable) -> float:
        start = time.perf_counter()
        for w in weights:
            f(x, w)
        return time.perf_counter() - start

    seconds(fn), seconds(F.linear)  # warm-up pair
    return statistics.median(seconds(fn) / seconds(F.linear) for _ in range(repeats))


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, self.weight, self.bias)


@contextlib.contextmanager
def fast_linears(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Route the model's `nn.Linear` layers through `skinny_linear` inside the block (CPU only)."""
    if not enabled or next(model.parameters()).device.type != "cpu":
        yield
        return
    with patched_forwards(_linears(model), _forward):
        yield


_linears_by_model: weakref.WeakKeyDictionary[nn.Module, list[nn.Linear]] = weakref.WeakKeyDictionary()


def _linears(model: nn.Module) -> list[nn.Linear]:
    """The model's `nn.Linear` layers, found once per model (every draft step and verification patches them)."""
    linears = _linears_by_model.get(model)
    if linears is None:
        linears = _linears_by_model[model] = [m for m in model.modules() if type(m) is nn.Linear]
    return linears


@contextlib.contextmanager
def patched_forwards(modules: Iterable[nn.Module], forward: Callable) -> Iterator[None]:
    """Inside the block `forward(module, x)` replaces the forward of each module not patched already."""
    patched = [m for m in modules if "forward" not in m.__dict__]
    for m in patched:
        # what nn.Module.__setattr__ does for a plain value, without its checks (10x faster; per draft step)
        m.__dict__["forward"] = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
