"""The Triton kernels as torch custom operators (`torch.ops.hf_spec.*`), so compiled graphs call them.

`kernel_op` defines an operator from a function that allocates its outputs with torch and launches its kernels
through `torch.library.wrap_triton`, and a fake implementation (`fake`) that gives the outputs' shapes and dtypes.
Where triton compiles the kernels (CUDA) the operator is a `torch.library.triton_op`: `torch.compile` sees the
kernels themselves and its CUDA graphs capture their launches. Under Triton's interpreter (`TRITON_INTERPRET=1`,
kernels on CPU tensors, as the tests run them) a kernel cannot be traced, and the operator is an opaque
`torch.library.custom_op` with the same schema: compiled graphs still call it as one node, and run the interpreted
kernels when they run (so it is too with a torch that has no `triton_op`). Both use `fake` while tracing, so the tests check the fake that CUDA graphs use too.

A function handed to `kernel_op` must run on fake tensors: shapes, dtypes, strides and allocations only, nothing
that reads a tensor's values or address on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# launches a kernel so that a traced graph records it (torch < 2.6 has none: the kernel is launched as it is, and
# `kernel_op` defines an opaque operator)
wrap_triton = getattr(torch.library, "wrap_triton", lambda kernel: kernel)


def interpreted(kernel: object) -> bool:
    """Whether `kernel` (a `@triton.jit` function) runs under Triton's interpreter."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a triton without an interpreter
        return False
    return isinstance(kernel, InterpretedFunction)


def kernel_op(
    name: str, kernels: Iterable[object], fake: Callable, mutates_args: Iterable[str] = ()
) -> Callable[[Callable], torch.library.CustomOpDef]:
    """Decorator: the function as the operator `hf_spec::<name>`, a `triton_op` where `kernels` compile, else a
    `custom_op`; `fake` is its fake implementation (the same arguments; empty outputs of the right shapes and
    dtypes; None for an operator that returns nothing)."""
    mutates = tuple(mutates_args)

    def define(fn: Callable) -> torch.library.CustomOpDef:
        if any(interpreted(k) for k in kernels) or not hasattr(torch.library, "triton_op"):
            op = torch.library.custom_op(f"hf_spec::{name}", fn, mutates_args=mutates)
        else:
            op = torch.library.triton_op(f"hf_spec::{name}", fn, mutates_args=mutates)
        op.register_fake(fake)  # a triton_op's own fake runs `fn` on fake tensors; this one is the tested one
        return op

    return define
