"""hf-spec's C++ CPU kernels as torch custom operators (`torch.ops.hf_spec.*`), so compiled graphs call them.

Each operator is pure: it allocates its output, runs one kernel of `hf_spec/csrc/` on its inputs' memory and returns
the output; its fake implementation gives the same shape and dtype without running anything, so `torch.compile`
(fullgraph) and `torch.export` trace through a call as one node. Whether a kernel applies (row counts, dtypes,
contiguity, the CPU's ISA, `HF_SPEC_NO_CPP_KERNELS`) is decided before the call, by the `kernel_*` functions of
`hf_spec.kernels.cpu_skinny_gemm`, on properties that are static under compilation; an operator called where its
kernel is not loaded raises `RuntimeError`.

| operator | inputs | output |
|---|---|---|
| `skinny_gemm(x, weight, bias, isa)` | fp32 x `(..., K)`, weight `(N, K)`, bias `(N,)` or None | fp32 `(..., N)` |
| `skinny_gemm_bf16(x, weight, bias, isa)` | bf16 x `(..., K)`, weight `(N, K)`, bias `(N,)` or None | bf16 `(..., N)` |
| `skinny_gemm_int8(x, q, scale, isa)` | fp32 x `(..., K)`, int8 q `(N, K)`, fp32 scale `(N,)` | fp32 `(..., N)` |
| `skinny_gemm_u8s8(xu, xs, q, qsum, scale)` | uint8 xu `(M, K)`, fp32 xs `(M,)`, q, int32 qsum, scale | fp32 `(M, N)` |
| `skinny_gemm_w8a8(x, q, qsum, scale)` | fp32 x `(..., K)`, q, qsum, scale | fp32 `(..., N)` |
| `select_within(approx, floor, err_w, err_q, coef, qnorm)` | fp32 `(M, N)`, four `(M,)`... `(N,)` | bool `(N,)` |

Rows are every leading dimension of x together (1..32 for the kernels); tensors are contiguous CPU tensors. The
module's functions of these names call the operators (`.op`) inside a traced graph and the kernels directly in eager
code.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

_F32 = torch.float32


# the function that builds or loads the C++ module (`cpu_skinny_gemm.load_kernel`, which imports this module and
# hands it over on import: the operators need it, and this module cannot import that one back)
_loader: Callable[[], ModuleType | None] | None = None


def set_loader(loader: Callable[[], ModuleType | None]) -> None:
    """Use `loader()` for the C++ module the operators run (called by `hf_spec.kernels.cpu_skinny_gemm`)."""
    global _loader
    _loader = loader


def _kernel() -> ModuleType:
    """The loaded C++ module; RuntimeError where it is not (the caller should have asked `kernel_*` first)."""
    mod = _loader() if _loader is not None else None
    if mod is None:
        raise RuntimeError(
            "hf-spec's C++ kernels are not loaded (disabled by HF_SPEC_NO_CPP_KERNELS, not buildable here, or "
            "hf_spec.kernels.cpu_skinny_gemm not imported); call hf_spec.kernels.cpu_skinny_gemm.kernel_*, which "
            "fall back to torch"
        )
    return mod


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _out(x: torch.Tensor, n: int, dtype: torch.dtype = _F32) -> torch.Tensor:
    """An empty `(..., n)` output for x `(..., K)`."""
    return x.new_empty((*x.shape[:-1], n), dtype=dtype)


def _skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, fp32: x `(..., K)`, weight `(N, K)`, bias `(N,)` -> `(..., N)`."""
    y = _out(x, weight.shape[0])
    b = 0 if bias is None else bias.data_ptr()
    _kernel().gemm(
        x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), _rows(x), weight.shape[0], x.shape[-1], isa
    )
    return y


def _skinny_gemm_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: int
) -> torch.Tensor:
    return _out(x, weight.shape[0])


def _skinny_gemm_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: int
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bf16 x `(..., K)` and weight `(N, K)` -> bf16 `(..., N)`: fp32 products and
    sums (the bias added in fp32), one rounding to bf16 at the end."""
    y = _out(x, weight.shape[0])
    b32 = None if bias is None else bias.to(_F32).contiguous()
    b = 0 if b32 is None else b32.data_ptr()
    _kernel().gemm_bf16(
        x.data_ptr(), weight.data_ptr(), b, y.data_ptr(), _rows(x), weight.shape[0], x.shape[-1], isa
    )
    return y.to(torch.bfloat16)


def _skinny_gemm_bf16_fake(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: int
) -> torch.Tensor:
    return _out(x, weight.shape[0], torch.bfloat16)


def _skinny_gemm_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, isa: int) -> torch.Tensor:
    """`(x @ q.T) * scale` in fp32 arithmetic: fp32 x `(..., K)`, int8 q `(N, K)`, fp32 scale `(N,)` -> `(..., N)`."""
    y = _out(x, q.shape[0])
    _kernel().gemm_i8(
        x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), _rows(x), q.shape[0], x.shape[-1], isa
    )
    return y


def _skinny_gemm_int8_fake(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, isa: int) -> torch.Tensor:
    return _out(x, q.shape[0])


def _skinny_gemm_u8s8(
    xu: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """`float((xu - 128) @ q.T) * (xs[:, None] * scale)` `(M, N)` by AVX512-VNNI: uint8 xu `(M, K)`, fp32 xs `(M,)`,
    int8 q `(N, K)`, int32 qsum `(N,)` (q's row sums), fp32 scale `(N,)`."""
    (m, k), n = xu.shape, q.shape[0]
    y = xu.new_empty((m, n), dtype=_F32)
    ptrs = (xu.data_ptr(), xs.data_ptr(), q.data_ptr(), qsum.data_ptr(), scale.data_ptr(), y.data_ptr())
    _kernel().gemm_u8s8(*ptrs, m, n, k)
    return y


def _skinny_gemm_u8s8_fake(
    xu: torch.Tensor, xs: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    return xu.new_empty((xu.shape[0], q.shape[0]), dtype=_F32)


def _skinny_gemm_w8a8(
    x: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """`x @ (q * scale[:, None]).T` `(..., N)` with each row of fp32 x `(..., K)` quantized to int8 first (VNNI)."""
    y = _out(x, q.shape[0])
    ptrs = (x.data_ptr(), q.data_ptr(), qsum.data_ptr(), scale.data_ptr(), y.data_ptr())
    _kernel().gemm_w8a8(*ptrs, _rows(x), q.shape[0], x.shape[-1])
    return y


def _skinny_gemm_w8a8_fake(
    x: torch.Tensor, q: torch.Tensor, qsum: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    return _out(x, q.shape[0])


def _select_within(
    approx: torch.Tensor,
    floor: torch.Tensor,
    err_w: torch.Tensor,
    err_q: torch.Tensor,
    coef: torch.Tensor,
    qnorm: torch.Tensor,
) -> torch.Tensor:
    """Bool `(N,)`: columns j of `approx (M, N)` with `approx[m, j] + err_w[m] coef[j] + err_q[m] qnorm[j] >=
    floor[m]` in some row m (floor, err_w, err_q `(M,)`; coef, qnorm `(N,)`)."""
    m, n = approx.shape
    keep = approx.new_empty((n,), dtype=torch.uint8)
    ptrs = (t.data_ptr() for t in (approx, floor, err_w, err_q, coef, qnorm, keep))
    _kernel().select_within(*ptrs, m, n)
    return keep.bool()


def _select_within_fake(
    approx: torch.Tensor,
    floor: torch.Tensor,
    err_w: torch.Tensor,
    err_q: torch.Tensor,
    coef: torch.Tensor,
    qnorm: torch.Tensor,
) -> torch.Tensor:
    return approx.new_empty((approx.shape[1],), dtype=torch.bool)


# the `hf_spec` operators of this module and of `hf_spec.kernels.group_quant` (one library fragment, kept alive)
_LIBRARY = torch.library.Library("hf_spec", "FRAGMENT")


def define_cpu_op(name: str, impl: Callable, fake: Callable, key: str = "CPU") -> torch._ops.OpOverload:
    """The operator `hf_spec::<name>`: `impl` as its kernel for dispatch key `key` (CPU; CompositeExplicitAutograd
    where a C++ CPU kernel takes over once the kernel module loads), schema from `impl`'s type hints, no mutation,
    `fake` its fake implementation. Defined on a library fragment rather than with `torch.library.custom_op`,
    whose Python wrapper costs tens of microseconds a call: a compiled decoding step calls an operator once a
    linear layer, on both sides of a GGUF target's 169 linears. The operators have no autograd formula; callers
    decide before the call that no gradient is needed."""
    schema = torch.library.infer_schema(impl, mutates_args=())
    _LIBRARY.define(name + schema)
    _LIBRARY.impl(name, impl, key)
    torch.library.register_fake(f"hf_spec::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.hf_spec, name).default


def _define(name: str, impl: Callable, fake: Callable) -> Callable:
    """The operator `hf_spec::<name>` from `impl` and its fake, and the function callers use: the operator where a
    graph is being traced (`torch.compile`, `torch.export`), `impl` itself in eager calls (the same work without the
    dispatcher's few microseconds, paid once per linear layer of a forward). The operator is its `.op`."""
    op = define_cpu_op(name, impl, fake)

    def call(*args):
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    call.__name__, call.__doc__, call.op = name, impl.__doc__, op
    return call


skinny_gemm = _define("skinny_gemm", _skinny_gemm, _skinny_gemm_fake)
skinny_gemm_bf16 = _define("skinny_gemm_bf16", _skinny_gemm_bf16, _skinny_gemm_bf16_fake)
skinny_gemm_int8 = _define("skinny_gemm_int8", _skinny_gemm_int8, _skinny_gemm_int8_fake)
skinny_gemm_u8s8 = _define("skinny_gemm_u8s8", _skinny_gemm_u8s8, _skinny_gemm_u8s8_fake)
skinny_gemm_w8a8 = _define("skinny_gemm_w8a8", _skinny_gemm_w8a8, _skinny_gemm_w8a8_fake)
select_within = _define("select_within", _select_within, _select_within_fake)
OPS = (skinny_gemm, skinny_gemm_bf16, skinny_gemm_int8, skinny_gemm_u8s8, skinny_gemm_w8a8, select_within)
