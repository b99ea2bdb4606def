"""Faster CPU matmuls for the few-row inputs of verification (and the one-row steps of drafting).

Inside `fast_linears` each `nn.Linear` runs `skinny_linear`, which picks a path per call by the dtype and the rows
of x (all rows of every leading dimension):

- float32, 2..32 rows: the C++ kernel (`cpu_skinny_gemm`), which reads each row of W from memory once; one row
  too where the kernel is measured faster than `F.linear` here (`one_row_kernel_pays`).
- bfloat16, 1..`bf16_kernel_rows()` rows: the kernel's AVX512-BF16 path, up to the most rows (of
  `BF16_SAMPLE_ROWS`) for which it is measured faster than torch's best path here.
- anything else the kernel does not take (no compiler, `HF_SPEC_NO_CPP_KERNELS=1`, other dtypes): `(W @ x.T).T`
  for 8..32 rows (bfloat16: 2..32) where that is measured faster than `F.linear` (`mm_trick_pays`: some BLAS
  libraries run the transposed product closer to memory bandwidth), else `F.linear`, as for more than 32 rows.

Each decision is timed once per torch thread count (and dtype) and remembered for the process; the
`HF_SPEC_ONE_ROW_KERNEL`, `HF_SPEC_BF16_KERNEL` and `HF_SPEC_MM_TRICK` variables force them. Every path gives
`F.linear`'s values up to the order of the fp32 sums (bfloat16: the same fp32 sums rounded once to bfloat16, as
torch's are). hf-spec's loop never uses this for its own one-token steps (plain decoding stays `generate`'s), only
drafters do; nothing changes outside `fast_linears`.

Under `torch.compile` every decision is read once, when a graph is traced (`_decided`; a decision not yet measured
is measured then), and the graph keeps it: the kernels run as custom operators (`hf_spec.kernels.ops`), so a
compiled forward through `skinny_linear` has no graph break.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hf_spec.core import envs
from hf_spec.kernels import cpu_skinny_gemm

KERNEL_MIN_ROWS, KERNEL_MAX_ROWS = 2, 32  # C++ kernel (when it builds)
MIN_ROWS, MAX_ROWS = 8, 32  # mm-trick fallback without the kernel (bfloat16: from FEW_ROWS where measured)
FEW_ROWS = 2
# most bfloat16 rows the kernel is tried on: its compute share grows with the rows and torch's GEMM catches up
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
        if (
            (FEW_ROWS if bf16 else MIN_ROWS) <= rows <= MAX_ROWS
            and x.device.type == "cpu"
            and mm_trick_pays(x.dtype, rows)
        ):
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
    """Whether the kernel beats `F.linear` on one row of x here (BLAS GEMV is fast on some CPUs, not on others):
    measured once per torch thread count (~0.5 s, `_streamed_weights`); `HF_SPEC_ONE_ROW_KERNEL=1` / `0` forces
    it."""
    return _decided("one_row") if torch.compiler.is_compiling() else _one_row_kernel_pays()


def _one_row_kernel_pays() -> bool:
    forced = envs.HF_SPEC_ONE_ROW_KERNEL
    if forced is not None:
        return forced
    return _remembered(_one_row, torch.get_num_threads(), _measure_one_row)


def bf16_kernel_rows() -> int:
    """Rows of bfloat16 x up to which the kernel (AVX512-BF16 CPUs) beats torch's best path here (0: no rows):
    timed at `BF16_SAMPLE_ROWS`, fewest first, until it loses (CPUs with AMX tiles run torch's `(W @ x.T).T` faster
    from a few rows); measured once per torch thread count (~0.3 s a sample, `_streamed_weights`);
    `HF_SPEC_BF16_KERNEL=1` / `0` forces all of 1..`BF16_MAX_ROWS` / none."""
    return _decided("bf16_rows") if torch.compiler.is_compiling() else _bf16_kernel_rows()


def _bf16_kernel_rows() -> int:
    forced = envs.HF_SPEC_BF16_KERNEL
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
    dtype and row class (9 rows for `MIN_ROWS`..`MAX_ROWS`, 4 for fewer; ~0.5 s, `_streamed_weights`);
    `HF_SPEC_MM_TRICK=1` / `0` forces it."""
    many = bool(rows >= MIN_ROWS)  # a plain bool also where rows is symbolic in a compiled graph
    return _decided("mm_trick", dtype, many) if torch.compiler.is_compiling() else _mm_trick_pays(dtype, many)


def _mm_trick_pays(dtype: torch.dtype, many: bool) -> bool:
    forced = envs.HF_SPEC_MM_TRICK
    if forced is not None:
        return forced
    key = (torch.get_num_threads(), dtype, many)
    return _remembered(_mm_trick, key, lambda: _measure_mm_trick(dtype, 9 if many else 4))


@torch.compiler.assume_constant_result
def _decided(name: str, dtype: torch.dtype = torch.float32, many: bool = True) -> bool | int:
    """A decision as eager calls make it (`one_row`, `bf16_rows`, or `mm_trick` for `dtype` and a row class), made
    when `torch.compile` traces a graph and kept in that graph as a constant."""
    if name == "one_row":
        return _one_row_kernel_pays()
    if name == "bf16_rows":
        return _bf16_kernel_rows()
    return _mm_trick_pays(dtype, many)


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
    """256 MiB of `(2048, 1024)` weights: more than a CPU's caches hold, so they stream from DRAM as a model's do (a
    smaller set stays partly cached in a large L3 and makes the timings flip between processes)."""
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
