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

bfloat16 inputs go to the kernel's AVX512-BF16 path for 1..`bf16_kernel_rows()` rows: the most rows (of 1, 2, 4,
8, 13, 17, 20) up to which it is measured faster than torch's best path here. On a 2-core AMD EPYC Zen 5 it wins to
~17 rows (a Qwen2.5-0.5B forward of 1-17 tokens after 200 cached takes 0.73-0.85 of stock's time,
`benchmarks/verify_cost.py --dtypes bfloat16`); on a 2-core Intel Xeon with AMX only on 1-2 rows, where torch's
`(W @ x.T).T` runs on AMX tiles of 16 rows: Qwen2.5-0.5B's 24 layers' linears (ms, 2 threads)

    rows            1     2     4     6     8    12    16    17    24
    F.linear       47    47    47    48    46    47    47    49    47
    (W @ x.T).T    48    35    35    35    35    34    35    39    39
    bf16 kernel    30    31    35    39    49    58    72    75   101

so `(W @ x.T).T` takes bfloat16's 2..32 rows where it is measured faster (at 4 rows for 2..7, at 9 for 8..32).
Before, one 9-row measurement decided both for all of 1..20 rows: the Xeon ran 2-7 rows on F.linear and, in the
processes where the kernel measured faster than F.linear at 9 rows (it flipped between processes), 8-20 rows on
the kernel. The sums are the same fp32 sums in another order, rounded once to bfloat16, as torch's are.
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
MIN_ROWS, MAX_ROWS = 8, 32  # mm-trick fallback without the kernel (bfloat16: from FEW_ROWS where measured)
FEW_ROWS = 2
# bfloat16 kernel (AVX512-BF16; Zen 5, Qwen forwards after 200 cached tokens): 1-13 tokens at 0.82 of torch's time,
# 17 at 0.73-0.85 (torch's bf16 GEMM slows down past 16 rows), 25 at 0.89-1.03: level from ~20
BF16_MAX_ROWS = 20
# where the kernel is timed against torch, fewest first
BF16_SAMPLE_ROWS = (1, 2, 4, 8, 13, 17, BF16_MAX_ROWS)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the C++ kernel or as `(weight @ x.T).T` for the row counts where those win."""
    if x.dim() and x.shape[-1]:
        rows = x.numel() // x.shape[-1]
        bf16 = x.dtype is torch.bfloat16
        if bf16 and rows <= bf16_kernel_rows():
            y = cpu_skinny_gemm.kernel_linear_bf16(x, weight, bias)
            if y is not None:
                return y
        if not bf16 and (KERNEL_MIN_ROWS <= rows <= KERNEL_MAX_ROWS or (rows == 1 and one_row_kernel_pays())):
            y = cpu_skinny_gemm.kernel_linear(x, weight, bias)
            if y is not None:
                return y
        if (FEW_ROWS if bf16 else MIN_ROWS) <= rows <= MAX_ROWS and x.is_cpu and mm_trick_pays(x.dtype, rows):
            y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


_bf16: dict[int, int] = {}  # torch thread count -> rows up to which the bf16 kernel beat torch
_one_row: dict[int, bool] = {}  # torch thread count -> the kernel beat F.linear on one row
# (threads, dtype, at least MIN_ROWS) -> (W @ x.T).T beat F.linear on 9 rows (4 rows: the fewer-rows class)
_mm_trick: dict[tuple[int, torch.dtype, bool], bool] = {}
_measure_lock = threading.RLock()  # a measurement may ask for another one (the bf16 kernel's rival)


def one_row_kernel_pays() -> bool:
    """Whether the kernel beats `F.linear` on one row of x here: measured once per torch thread count (~0.5 s, on
    256 MiB of weights so they stream from DRAM as a model's do); `HF_SPEC_ONE_ROW_KERNEL=1` / `0` forces it."""
    forced = _forced("HF_SPEC_ONE_ROW_KERNEL")
    if forced is not None:
        return forced
    return _remembered(_one_row, torch.get_num_threads(), _measure_one_row)


def bf16_kernel_rows() -> int:
    """Rows of bfloat16 x up to which the kernel (AVX512-BF16 CPUs) beats torch's best path here (0: no rows):
    timed at `BF16_SAMPLE_ROWS`, fewest first, until it loses; measured once per torch thread count (~0.3 s a
    sample, 256 MiB of weights); `HF_SPEC_BF16_KERNEL=1` / `0` forces all of 1..`BF16_MAX_ROWS` / none. On an AMD
    EPYC Zen 5 it reads the weights at ~35 GB/s against torch's ~29 (Qwen2.5-0.5B's layers, 1-13 rows: 0.80-0.84
    of the time); an Intel Xeon's AMX tiles win from 4 rows."""
    forced = _forced("HF_SPEC_BF16_KERNEL")
    if forced is not None:
        return BF16_MAX_ROWS if forced else 0
    return _remembered(_bf16, torch.get_num_threads(), _measure_bf16)


def one_row_kernel_decision() -> bool | None:
    """The remembered `one_row_kernel_pays()` for this thread count, None before it was measured (no measuring)."""
    return _one_row.get(torch.get_num_threads())


def bf16_kernel_decision() -> int | None:
    """The remembered `bf16_kernel_rows()` for this thread count, None before it was measured (no measuring)."""
    return _bf16.get(torch.get_num_threads())


def mm_trick_pays(dtype: torch.dtype, rows: int = MIN_ROWS) -> bool:
    """Whether `(W @ x.T).T` beats `F.linear` on `rows` rows of `dtype` here: measured once per torch thread count,
    dtype and row class (9 rows for `MIN_ROWS`..`MAX_ROWS`, 4 for fewer; ~0.5 s, 256 MiB of weights);
    `HF_SPEC_MM_TRICK=1` / `0` forces it. It pays on an Intel Xeon in float32 and in bfloat16 with AMX (89 -> 77 ms
    for a 13-row Qwen forward; 2-7 rows too) but not on an AMD EPYC Zen 5 in bfloat16 (63 -> 79 ms)."""
    forced = _forced("HF_SPEC_MM_TRICK")
    if forced is not None:
        return forced
    many = rows >= MIN_ROWS
    key = (torch.get_num_threads(), dtype, many)
    return _remembered(_mm_trick, key, lambda: _measure_mm_trick(dtype, 9 if many else 4))


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
def _measure_bf16(repeats: int = 5) -> int:
    weights = _streamed_weights(torch.bfloat16)
    if (
        cpu_skinny_gemm.kernel_linear_bf16(torch.full((1, 1024), 0.5, dtype=torch.bfloat16), weights[0])
        is None
    ):
        return 0
    best = 0
    for rows in BF16_SAMPLE_ROWS:  # the kernel's share of the time grows with the rows: stop where it loses
        x = torch.full((rows, 1024), 0.5, dtype=torch.bfloat16)
        rival = _mm if rows >= FEW_ROWS and mm_trick_pays(torch.bfloat16, rows) else None
        if _time_ratio(cpu_skinny_gemm.kernel_linear_bf16, x, weights, repeats, rival) >= 0.95:
            break
        best = rows
    return best


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()


@torch.no_grad()
def _measure_mm_trick(dtype: torch.dtype, rows: int = 9, repeats: int = 5) -> bool:
    x = torch.full((rows, 1024), 0.5, dtype=dtype)
    return _time_ratio(_mm, x, _streamed_weights(dtype), repeats) < 0.9


def _streamed_weights(dtype: torch.dtype) -> list[torch.Tensor]:
    # 256 MiB of weights: with 64 MiB a large L3 (AMD EPYC) kept part of them cached and the one-row ratio flapped
    # around its threshold between processes (0.70-0.85); at this size it is 0.65-0.71 there, run to run
    count = (256 << 20) // (2048 * 1024 * torch.empty((), dtype=dtype).element_size())
    return [torch.full((2048, 1024), 0.01, dtype=dtype) for _ in range(count)]


def _time_ratio(
    fn: Callable, x: torch.Tensor, weights: list[torch.Tensor], repeats: int, rival: Callable | None = None
) -> float:
    """Median over `repeats` of (time of `fn(x, w)` / time of `rival(x, w)`, default `F.linear`) over all
    `weights`, after a warm-up."""
    rival = rival or F.linear

    def seconds(f: Callable) -> float:
        start = time.perf_counter()
        for w in weights:
            f(x, w)
        return time.perf_counter() - start

    seconds(fn), seconds(rival)  # warm-up pair
    return statistics.median(seconds(fn) / seconds(rival) for _ in range(repeats))


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
