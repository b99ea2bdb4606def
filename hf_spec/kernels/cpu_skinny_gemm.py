"""Python side of hf-spec's C++ CPU kernels (`hf_spec/csrc/`): `x @ W.T (+ bias)` for the few rows of x (1..32) that
speculative verification and drafting feed, where torch's CPU GEMM runs well below memory bandwidth.

The kernels read each row of W from memory once: a tile of 4 rows of W meets up to 6 rows of x held in registers
(AVX-512; AVX2: 3), vectorised over K, while the next tile of W is prefetched, and the tiles are split over torch's
intra-op threads. The ISA is picked at run time (AVX-512, AVX2+FMA, or plain C++), so one build serves any x86-64
CPU; the weight is used as it is (no copy, no transpose). Besides fp32 (`kernel_linear`): bfloat16 x and W on CPUs
with AVX512-BF16 (`kernel_linear_bf16`), int8 weights with fp32 x (`kernel_linear_int8`), u8 x s8 products on
AVX512-VNNI (`kernel_linear_u8s8`, `kernel_linear_w8a8`) and the screened LM head's candidate test
(`kernel_select_within`). Each `kernel_*` function returns None where it does not apply; callers then use torch.

Built on first use with `torch.utils.cpp_extension.load` (a C++ compiler and ninja; a few seconds) into a folder
under `HF_SPEC_KERNEL_CACHE` named after a hash of the sources and flags, so an edited source builds afresh and an
unchanged one is loaded. Any failure to build or load logs one warning and the kernels stay off for the process;
`HF_SPEC_NO_CPP_KERNELS=1` turns them off.

The kernels run as torch custom operators (`hf_spec.kernels.ops`, `torch.ops.hf_spec.*`), so `torch.compile` graphs
call them as single nodes. Whether one applies is decided here, before the call, on what is static in a compiled
graph: shapes, dtypes, contiguity and the kernel's state (`kernel_state`, which a compiled graph reads once, when it
is traced: a graph keeps the decision it was compiled with).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from hf_spec.core import envs
from hf_spec.kernels import ops

logger = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 1, 32  # rows of x the kernel accepts
ISA_AUTO, ISA_SCALAR, ISA_AVX2, ISA_AVX512 = -1, 0, 1, 2
CSRC = Path(__file__).resolve().parent.parent / "csrc"  # the C++ sources, shipped as package data

_CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno"]  # ISA via per-function target attributes, not -march
_LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded, so torch.set_num_threads applies
_STALE_LOCK_S = 600  # torch waits forever on a build lock left by a killed build; older locks are removed

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
_best_isa = ISA_SCALAR  # best code path of this CPU, set by load_kernel
_vnni = _bf16 = False  # AVX512-VNNI / AVX512-BF16 paths of this CPU, set by load_kernel
compile_seconds: float | None = None  # wall time of this process's build-or-load, for reports
_F32, _STRIDED = torch.float32, torch.strided


def kernels_disabled() -> bool:
    """`HF_SPEC_NO_CPP_KERNELS=1` (read on every call, so it can be flipped; unset, the common case, is a dict
    lookup: every kernel call asks)."""
    return envs.is_set("HF_SPEC_NO_CPP_KERNELS") and envs.HF_SPEC_NO_CPP_KERNELS


def source_files() -> list[Path]:
    """The kernel's C++ sources and headers in `CSRC`, sorted by name; RuntimeError where they are missing."""
    files = sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")])
    if not any(f.suffix == ".cpp" for f in files):
        raise RuntimeError(f"the kernel's C++ sources are missing from {CSRC}")
    return files


def kernel_name() -> str:
    """Module name, unique per source and flags, so an edited kernel builds into a fresh directory."""
    digest = hashlib.sha1()
    for part in (*_CFLAGS, *_LDFLAGS):
        digest.update(part.encode() + b"\0")
    for path in source_files():
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"hf_spec_skinny_gemm_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    """`$HF_SPEC_KERNEL_CACHE/<python and torch version>/<kernel_name()>`."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.split('+')[0]}"
    return envs.HF_SPEC_KERNEL_CACHE / tag / kernel_name()


def _compile() -> ModuleType:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"the kernel is for x86-64 CPUs, this one is {platform.machine()}")
    from torch.utils.cpp_extension import is_ninja_available, load

    cxx = os.environ.get("CXX") or "c++"  # what torch's builder runs
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found; set CXX or install g++)")
    if not is_ninja_available():
        # the `ninja` wheel installs into this environment's scripts folder, which is not on PATH when the
        # environment's python runs without being activated
        scripts = sysconfig.get_path("scripts")
        if scripts and shutil.which("ninja", path=scripts):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    if not is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    lock = build_dir / "lock"
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    return load(
        name=kernel_name(),
        sources=[str(p) for p in source_files() if p.suffix == ".cpp"],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        verbose=False,
    )


def load_kernel() -> ModuleType | None:
    """The compiled module (built or loaded on the first call in a process), or None when it is disabled
    (`HF_SPEC_NO_CPP_KERNELS=1`) or cannot be built (then one warning is logged and callers use torch)."""
    global _module, _tried, _best_isa, _vnni, _bf16, compile_seconds
    if kernels_disabled():
        return None
    if _tried:
        return _module
    with _lock:
        if not _tried:
            t0 = time.perf_counter()
            try:
                _module = _compile()
                _best_isa = _module.best_isa()
                _vnni, _bf16 = bool(_module.has_vnni()), bool(_module.has_bf16())
            except Exception as e:  # no compiler, no ninja, not x86, bad flags: all mean "use F.linear"
                lines = str(e).strip().splitlines()
                logger.warning(
                    "hf-spec: C++ skinny-GEMM kernel unavailable, verification uses F.linear (%s: %s)",
                    type(e).__name__,
                    lines[-1][:300] if lines else "",
                )
                _module = None
            compile_seconds = time.perf_counter() - t0
            _tried = True
    return _module


ops.set_loader(lambda: load_kernel())  # looked up at each call: a patched `load_kernel` applies


def _reset_for_tests() -> None:
    """Forget the load attempt, so the next `load_kernel` tries again."""
    global _module, _tried
    with _lock:
        _module, _tried = None, False


def _plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """A contiguous strided CPU tensor of `dtype`: what the kernel reads through a raw pointer."""
    return t.dtype is dtype and t.device.type == "cpu" and t.layout is _STRIDED and t.is_contiguous()


def _rows(x: torch.Tensor) -> int:
    """Rows of `x (..., K)` where the kernel takes it (fp32, plain, 1..32 rows), else 0."""
    if x.dim() == 0 or not x.shape[-1] or not _plain(x, _F32):
        return 0
    rows = x.numel() // x.shape[-1]
    return rows if MIN_ROWS <= rows <= MAX_ROWS else 0


@torch.compiler.assume_constant_result
def kernel_state() -> tuple[bool, int, bool, bool]:
    """`(loaded, best ISA, AVX512-VNNI, AVX512-BF16)` of the kernel in this process (loading it on the first call;
    not loaded where `HF_SPEC_NO_CPP_KERNELS=1` or it cannot be built). Eager callers read it afresh on every call;
    `torch.compile` reads it once, when it traces a graph, and keeps the answer in that graph."""
    if load_kernel() is None:
        return False, ISA_SCALAR, False, False
    return True, _best_isa, _vnni, _bf16


def _usable(isa: int) -> bool:
    """The kernel is loaded and worth running at `isa` (ISA_AUTO: only where the CPU has AVX2 or better; the plain
    C++ path is for tests: on a CPU without AVX2, MKL's F.linear is faster)."""
    loaded, best, _, _ = kernel_state()
    return loaded and (isa != ISA_AUTO or best >= ISA_AVX2)


def _no_grad_needed(*tensors: torch.Tensor | None) -> bool:
    """No autograd graph is wanted through the kernel (the custom operators have no backward)."""
    return not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in tensors)


def kernel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` by the kernel, or None where the kernel does not apply: not fp32 / CPU /
    contiguous, rows of x outside 1..32, autograd needed, kernel disabled or not buildable."""
    rows = _rows(x)
    if not rows or weight.dim() != 2:
        return None
    k, n = x.shape[-1], weight.shape[0]
    if not n or weight.shape[1] != k or not _plain(weight, _F32):
        return None
    if bias is not None and (not _plain(bias, _F32) or bias.shape != (n,)):
        return None
    if not _no_grad_needed(x, weight, bias) or not _usable(isa):
        return None
    return ops.skinny_gemm(x, weight, bias, isa)


def kernel_linear_int8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`(x @ q.T) * scale` in fp32 arithmetic for fp32 x `(..., K)` with 1..32 rows, int8 q `(N, K)` and fp32 scale
    `(N,)`, all contiguous on CPU; None where the kernel does not apply (as `kernel_linear`)."""
    rows = _rows(x)
    if not rows or q.dim() != 2:
        return None
    k, n = x.shape[-1], q.shape[0]
    if not n or q.shape[1] != k or not _plain(q, torch.int8):
        return None
    if not _plain(scale, _F32) or scale.shape != (n,) or not _no_grad_needed(x) or not _usable(isa):
        return None
    return ops.skinny_gemm_int8(x, q, scale, isa)


def has_vnni() -> bool:
    """Whether this CPU runs `kernel_linear_u8s8` (AVX-512 F, BW and VNNI) and the kernel is loaded."""
    _, best, vnni, _ = kernel_state()
    return _usable(ISA_AUTO) and best >= ISA_AVX512 and vnni


def kernel_linear_u8s8(
    xu: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor | None:
    """`float((xu - 128) @ q.T) * (xs[:, None] * scale)` `(M, N)`: uint8 xu `(M, K)` (an int8 x plus 128), fp32 row
    scales xs `(M,)`, int8 q `(N, K)`, int32 qsum `(N,)` = q's row sums, fp32 scale `(N,)`; the integer products
    are summed exactly. None without AVX512-VNNI or where the inputs do not fit (1..32 rows, contiguous CPU)."""
    if xu.dim() != 2 or q.dim() != 2 or not MIN_ROWS <= xu.shape[0] <= MAX_ROWS or not has_vnni():
        return None
    (m, k), n = xu.shape, q.shape[0]
    if not n or q.shape[1] != k or not _plain(xu, torch.uint8) or not _plain(q, torch.int8):
        return None
    if not (_plain(xs, _F32) and xs.shape == (m,) and _plain(scale, _F32) and scale.shape == (n,)):
        return None
    if not _plain(qsum, torch.int32) or qsum.shape != (n,):
        return None
    return ops.skinny_gemm_u8s8(xu, xs, q, qsum, scale)


def kernel_linear_w8a8(
    x: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor | None:
    """`x @ (q * scale[:, None]).T` `(..., N)` with each row of fp32 x `(..., K)` (1..32 rows) first quantized to int8
    (step amax / 127), by the VNNI kernel: an approximation, for drafts. int8 q `(N, K)`, int32 qsum `(N,)` = q's row
    sums, fp32 scale `(N,)`; None without AVX512-VNNI or where the inputs do not fit."""
    rows = _rows(x)
    if not rows or q.dim() != 2 or not has_vnni():
        return None
    k, n = x.shape[-1], q.shape[0]
    if (
        not n
        or q.shape[1] != k
        or not _plain(q, torch.int8)
        or not _plain(scale, _F32)
        or scale.shape != (n,)
    ):
        return None
    if not _plain(qsum, torch.int32) or qsum.shape != (n,) or not _no_grad_needed(x):
        return None
    return ops.skinny_gemm_w8a8(x, q, qsum, scale)


def has_bf16() -> bool:
    """Whether this CPU runs `kernel_linear_bf16` on its AVX512-BF16 path and the kernel is loaded."""
    _, best, _, bf16 = kernel_state()
    return _usable(ISA_AUTO) and best >= ISA_AVX512 and bf16


def kernel_linear_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: int = ISA_AUTO
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` for bfloat16 x `(..., K)` (1..32 rows) and weight `(N, K)`: fp32 products and
    sums, one rounding to bfloat16 at the end (torch's bf16 GEMM rounds once too, summing in another order). None
    where it does not apply (as `kernel_linear`) or without AVX512-BF16, unless `isa` forces the plain C++ path."""
    if x.dim() == 0 or not x.shape[-1] or not _plain(x, torch.bfloat16) or weight.dim() != 2:
        return None
    rows = x.numel() // x.shape[-1]
    k, n = x.shape[-1], weight.shape[0]
    if (
        not MIN_ROWS <= rows <= MAX_ROWS
        or not n
        or weight.shape[1] != k
        or not _plain(weight, torch.bfloat16)
    ):
        return None
    if bias is not None and (bias.shape != (n,) or bias.device.type != "cpu"):
        return None
    if not _no_grad_needed(x, weight, bias) or (isa == ISA_AUTO and not has_bf16()) or not _usable(isa):
        return None
    return ops.skinny_gemm_bf16(x, weight, bias, isa)


def kernel_select_within(
    approx: torch.Tensor,
    floor: torch.Tensor,
    err_w: torch.Tensor,
    err_q: torch.Tensor,
    coef: torch.Tensor,
    qnorm: torch.Tensor,
) -> torch.Tensor | None:
    """Bool `(N,)`: columns j of `approx (M, N)` with `approx[m, j] + err_w[m] coef[j] + err_q[m] qnorm[j] >=
    floor[m]` in some row m (fp32, contiguous CPU); None without the kernel."""
    tensors = (approx, floor, err_w, err_q, coef, qnorm)
    if approx.dim() != 2 or not all(_plain(t, _F32) for t in tensors):
        return None
    m, n = approx.shape
    if (
        not m
        or not n
        or any(t.shape != (m,) for t in tensors[1:4])
        or any(t.shape != (n,) for t in tensors[4:])
    ):
        return None
    if not _usable(ISA_AUTO):
        return None
    return ops.select_within(*tensors)


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, isa: int = ISA_AUTO
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: by the C++ kernel for fp32 CPU contiguous x with 1..32 rows (any leading shape),
    else by `F.linear`. `isa` forces a code path (ISA_SCALAR / ISA_AVX2 / ISA_AVX512, capped at what the CPU has)."""
    y = kernel_linear(x, weight, bias, isa)
    return F.linear(x, weight, bias) if y is None else y


def reference_skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference twin of `skinny_gemm`."""
    return F.linear(x, weight, bias)
