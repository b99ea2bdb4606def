"""CPU kernels against their torch reference twins, their fallbacks, and the `fast_linears` switch."""

from __future__ import annotations

import logging
import time
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_spec.kernels import cpu_skinny_gemm as csg
from hf_spec.kernels import skinny_linear as skinny_linear_module
from hf_spec.kernels.skinny_linear import fast_linears, skinny_linear
from tests.conftest import make_tiny_model, prompt_ids, run_in_bfloat16


@pytest.fixture(scope="module")
def kernel():
    """The compiled module; the tests that need it skip where it cannot be built here."""
    mod = csg.load_kernel()
    if mod is None:
        pytest.skip(
            "C++ skinny-GEMM kernel could not be built here (no C++ compiler / ninja, not x86-64, or "
            "HF_SPEC_NO_CPP_KERNELS set); the F.linear fallback is tested separately"
        )
    return mod


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 sums of K products in another order: error grows with the size of the terms, not of the result
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()))


def _case(m: int, k: int, n: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + m * 100 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n", [1, 7, 128, 4864])
@pytest.mark.parametrize("k", [64, 896, 1000])
def test_kernel_matches_reference(kernel, k, n, bias):
    for m in (1, 2, 3, 5, 8, 9, 16, 17, 32):
        x, w, b = _case(m, k, n, bias)
        y = csg.kernel_linear(x, w, b)
        assert y is not None, "the kernel should take fp32 contiguous CPU inputs with 1..32 rows"
        assert y.shape == (m, n) and y.dtype == torch.float32
        _close(y, csg.reference_skinny_gemm(x, w, b))
        _close(csg.skinny_gemm(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("isa", [csg.ISA_SCALAR, csg.ISA_AVX2, csg.ISA_AVX512])
@pytest.mark.parametrize("k", [16, 20, 1003])  # K % 16 in {0, 4, 11}, K % 8 in {0, 4, 3}: every masked tail
def test_every_code_path_matches_reference(kernel, isa, k):
    """Paths the CPU lacks are capped to the best it has, so this passes (less thoroughly) on older CPUs."""
    for m in (1, 2, 3, 6, 7, 13, 32):
        for n in (1, 5, 9, 130):
            x, w, b = _case(m, k, n, bias=n % 2 == 1, seed=isa + 2)
            _close(csg.skinny_gemm(x, w, b, isa=isa), F.linear(x, w, b))


@pytest.mark.parametrize("isa", [csg.ISA_SCALAR, csg.ISA_AVX2, csg.ISA_AVX512])
def test_a_row_of_w_gets_the_same_bits_in_any_tile(kernel, isa):
    """A row of w summed in a tail tile (fewer than 4 rows) equals, bit for bit, the same row in a full tile: the
    screened LM head rescores a subset of rows and relies on it."""
    x, w, _ = _case(5, 1003, 9, bias=False, seed=3)
    full = csg.kernel_linear(x, w, isa=isa)
    for rows in (slice(0, 3), slice(1, 3), slice(2, 3), slice(4, 9)):
        assert torch.equal(csg.kernel_linear(x, w[rows].contiguous(), isa=isa), full[:, rows])


def test_cpu_without_avx2_keeps_f_linear(kernel, monkeypatch):
    x, w, b = _case(9, 100, 7, bias=True)
    monkeypatch.setattr(csg, "_best_isa", csg.ISA_SCALAR)
    assert csg.kernel_linear(x, w, b) is None  # MKL beats the plain C++ loop
    _close(csg.kernel_linear(x, w, b, isa=csg.ISA_SCALAR), F.linear(x, w, b))


def test_leading_dims_threads_and_views(kernel):
    x, w, b = _case(9, 896, 4864, bias=True)
    ref = F.linear(x, w, b)
    y = csg.kernel_linear(x.view(1, 9, 896), w, b)
    assert y is not None and y.shape == (1, 9, 4864)
    _close(y[0], ref)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _close(csg.skinny_gemm(x, w, b), ref)
    finally:
        torch.set_num_threads(threads)
    # contiguous views with a storage offset are fine
    big = torch.randn(20, 896)
    _close(csg.skinny_gemm(big[3:12], w, b), F.linear(big[3:12], w, b))


def _fallback_cases():
    x, w, b = _case(9, 96, 40, bias=True)
    return {
        "x transposed view": (torch.randn(96, 9).t(), w, b),
        "x strided rows": (torch.randn(9, 192)[:, ::2], w, b),
        "weight transposed view": (x, torch.randn(96, 40).t(), b),
        "bias strided": (x, w, torch.randn(80)[::2]),
        "float64": (x.double(), w.double(), b.double()),
        "bfloat16": (x.bfloat16(), w.bfloat16(), b.bfloat16()),
        "33 rows": (torch.randn(33, 96), w, b),
        "no rows": (torch.randn(0, 96), w, b),
        "3-d, 40 rows": (torch.randn(2, 20, 96), w, b),
    }


@pytest.mark.parametrize("name", list(_fallback_cases()))
def test_unsupported_inputs_fall_back_to_f_linear(name):
    x, w, b = _fallback_cases()[name]
    assert csg.kernel_linear(x, w, b) is None
    ref = F.linear(x, w, b)
    torch.testing.assert_close(csg.skinny_gemm(x, w, b), ref)
    torch.testing.assert_close(
        skinny_linear(x, w, b),
        ref,
        rtol=1e-2 if x.dtype == torch.bfloat16 else 1e-4,
        atol=1e-2 if x.dtype == torch.bfloat16 else 1e-4,
    )


def test_autograd_falls_back():
    x, w, b = _case(5, 64, 7, bias=True)
    w.requires_grad_(True)
    assert csg.kernel_linear(x, w, b) is None
    csg.skinny_gemm(x, w, b).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(7, 64))


def test_env_var_disables_kernel(monkeypatch):
    x, w, b = _case(9, 896, 128, bias=True)
    monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
    assert csg.kernels_disabled() and csg.load_kernel() is None
    assert csg.kernel_linear(x, w, b) is None
    _close(csg.skinny_gemm(x, w, b), F.linear(x, w, b))
    _close(skinny_linear(x, w, b), F.linear(x, w, b))  # the (W @ x.T).T fallback
    monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "0")
    assert not csg.kernels_disabled()


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog):
    def broken():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv("HF_SPEC_NO_CPP_KERNELS", raising=False)
    monkeypatch.setattr(csg, "_compile", broken)
    csg._reset_for_tests()
    try:
        x, w, b = _case(9, 64, 7, bias=True)
        with caplog.at_level(logging.WARNING, logger=csg.__name__):
            assert csg.load_kernel() is None
            _close(csg.skinny_gemm(x, w, b), F.linear(x, w, b))
            _close(skinny_linear(x, w, b), F.linear(x, w, b))
        warnings = [r for r in caplog.records if "kernel unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "Ninja" in warnings[0].getMessage()
    finally:
        csg._reset_for_tests()  # the next load_kernel builds (or loads from cache) for real


@pytest.mark.parametrize("one_row", ["0", "1"])
def test_skinny_linear_uses_kernel_between_2_and_32_rows(kernel, monkeypatch, one_row):
    """One row goes to the kernel only where it pays (`HF_SPEC_ONE_ROW_KERNEL` forces the measured answer)."""
    monkeypatch.setenv("HF_SPEC_ONE_ROW_KERNEL", one_row)
    calls = []
    real = csg.kernel_linear
    monkeypatch.setattr(csg, "kernel_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    w = torch.randn(40, 96)
    for rows in (1, 2, 9, 32, 33):
        x = torch.randn(1, rows, 96)
        _close(skinny_linear(x, w), F.linear(x, w))
    assert calls == [(1, 1, 96)] * (one_row == "1") + [(1, 2, 96), (1, 9, 96), (1, 32, 96)]


def test_one_row_kernel_is_used_where_measured_faster(kernel, monkeypatch):
    def slow(fn):
        def run(*args):
            time.sleep(0.02)  # far above either matmul, even on a loaded machine
            return fn(*args)

        return run

    monkeypatch.setattr(csg, "kernel_linear", slow(csg.kernel_linear))
    assert not skinny_linear_module._measure_one_row(repeats=1)
    monkeypatch.undo()
    monkeypatch.setattr(skinny_linear_module, "F", types.SimpleNamespace(linear=slow(F.linear)))
    assert skinny_linear_module._measure_one_row(repeats=1)
    # measured once per thread count, then remembered
    monkeypatch.delenv("HF_SPEC_ONE_ROW_KERNEL", raising=False)
    monkeypatch.setattr(skinny_linear_module, "_one_row", {})
    calls = []
    monkeypatch.setattr(skinny_linear_module, "_measure_one_row", lambda: calls.append(1) or True)
    assert skinny_linear_module.one_row_kernel_pays() and skinny_linear_module.one_row_kernel_pays()
    assert calls == [1]


@pytest.mark.parametrize("flag", ["0", "1"])
def test_mm_trick_only_where_it_pays(monkeypatch, flag):
    """Outside the kernel (bfloat16 here), 2..32 rows go through `(W @ x.T).T` only where it is measured faster
    (`HF_SPEC_MM_TRICK` forces the measured answer); the values are F.linear's either way."""
    monkeypatch.setenv("HF_SPEC_MM_TRICK", flag)
    monkeypatch.setenv("HF_SPEC_BF16_KERNEL", "0")
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(skinny_linear_module.torch, "mm", lambda *a: calls.append(1) or real_mm(*a))
    w = torch.randn(40, 96, dtype=torch.bfloat16)
    for rows in (1, 7, 9, 32, 33):
        x = torch.randn(1, rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=0.05, rtol=0.02)
    assert len(calls) == 3 * (flag == "1")  # 7, 9 and 32 rows


def test_mm_trick_is_measured_once_per_dtype(monkeypatch):
    def slow(fn):
        def run(*args):
            time.sleep(0.002)  # far above either matmul of this tiny measurement
            return fn(*args)

        return run

    monkeypatch.setattr(skinny_linear_module.torch, "mm", slow(torch.mm))
    assert not skinny_linear_module._measure_mm_trick(torch.bfloat16, repeats=1)
    monkeypatch.undo()
    monkeypatch.setattr(skinny_linear_module, "F", types.SimpleNamespace(linear=slow(F.linear)))
    assert skinny_linear_module._measure_mm_trick(torch.bfloat16, repeats=1)
    monkeypatch.undo()
    monkeypatch.delenv("HF_SPEC_MM_TRICK", raising=False)
    monkeypatch.setattr(skinny_linear_module, "_mm_trick", {})
    calls = []
    monkeypatch.setattr(
        skinny_linear_module, "_measure_mm_trick", lambda dtype, rows: calls.append((dtype, rows)) or True
    )
    for dtype, rows in ((torch.bfloat16, 9), (torch.bfloat16, 32), (torch.float16, 9), (torch.bfloat16, 2)):
        assert skinny_linear_module.mm_trick_pays(dtype, rows)
    assert skinny_linear_module.mm_trick_pays(torch.bfloat16, 7)  # 2..7 rows: one class, measured on 4
    assert calls == [(torch.bfloat16, 9), (torch.float16, 9), (torch.bfloat16, 4)]


def _bf16_isas() -> list[int]:
    return [csg.ISA_SCALAR] + ([csg.ISA_AUTO] if csg.has_bf16() else [])


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 32])
@pytest.mark.parametrize("k", [32, 37, 896, 1023])  # K % 32 in {0, 5, 0, 31}: every masked tail
def test_bf16_kernel_sums_bf16_products_in_fp32(kernel, rows, k):
    """bfloat16 x and W: the exact products summed in fp32 and rounded once to bfloat16, on the AVX512-BF16 path
    (where the CPU has it) and the plain C++ one; torch's bf16 GEMM rounds the same sums, in another order."""
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(67, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(67, generator=g).bfloat16()
    for bias in (None, b):
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        for isa in _bf16_isas():
            y = csg.kernel_linear_bf16(x, w, bias, isa=isa)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 67)
            torch.testing.assert_close(y.double(), exact, rtol=1 / 128, atol=1e-2)  # one bf16 rounding
            assert (y == F.linear(x, w, bias)).float().mean() > 0.98  # ties of the rounding aside


def test_bf16_kernel_declines_what_it_cannot_take(kernel):
    w = torch.randn(8, 32).bfloat16()
    for isa in _bf16_isas():
        assert csg.kernel_linear_bf16(torch.randn(33, 32).bfloat16(), w, isa=isa) is None  # > 32 rows
        assert csg.kernel_linear_bf16(torch.randn(2, 32), w, isa=isa) is None  # float32 x
        assert csg.kernel_linear_bf16(torch.randn(2, 32).bfloat16(), w.float(), isa=isa) is None
        assert csg.kernel_linear_bf16(torch.randn(2, 64).bfloat16()[:, ::2], w, isa=isa) is None  # a view
        assert csg.kernel_linear_bf16(torch.randn(2, 32).bfloat16(), w, torch.ones(7), isa=isa) is None
        x = torch.randn(2, 32).bfloat16().requires_grad_()
        assert csg.kernel_linear_bf16(x, w, isa=isa) is None


@pytest.mark.parametrize("flag", ["0", "1"])
def test_skinny_linear_routes_1_to_20_bf16_rows_to_the_kernel(kernel, monkeypatch, flag):
    monkeypatch.setenv("HF_SPEC_BF16_KERNEL", flag)
    monkeypatch.setenv("HF_SPEC_MM_TRICK", "0")
    calls = []
    real = csg.kernel_linear_bf16
    monkeypatch.setattr(csg, "kernel_linear_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(40, 96, dtype=torch.bfloat16)
    for rows in (1, 20, 21):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(skinny_linear(x, w), F.linear(x, w), atol=0.05, rtol=0.02)
    assert calls == ([1, 20] if flag == "1" else [])


def test_bf16_kernel_is_measured_once_per_thread_count(monkeypatch):
    monkeypatch.delenv("HF_SPEC_BF16_KERNEL", raising=False)
    monkeypatch.setattr(skinny_linear_module, "_bf16", {})
    calls = []
    monkeypatch.setattr(skinny_linear_module, "_measure_bf16", lambda: calls.append(1) or 2)
    assert skinny_linear_module.bf16_kernel_rows() == skinny_linear_module.bf16_kernel_rows() == 2
    assert calls == [1]


@pytest.mark.parametrize("wins_up_to", [0, 1, 4, 20])
def test_bf16_kernel_rows_stop_where_the_kernel_loses(kernel, monkeypatch, wins_up_to):
    """The kernel is timed against torch's best path (the mm trick where it pays) at growing row counts until it
    loses; the rows it takes are those up to the last sample it won, and skinny_linear routes by them."""
    if not csg.has_bf16():
        pytest.skip("no AVX512-BF16 here")
    monkeypatch.setattr(
        skinny_linear_module, "_streamed_weights", lambda dtype: [torch.zeros(8, 1024, dtype=dtype)]
    )
    monkeypatch.setenv("HF_SPEC_MM_TRICK", "1")
    rivals = []

    def ratio(fn, x, weights, repeats, rival=None):
        rivals.append((x.shape[0], rival))
        return 0.5 if x.shape[0] <= wins_up_to else 1.0

    monkeypatch.setattr(skinny_linear_module, "_time_ratio", ratio)
    rows = skinny_linear_module._measure_bf16(repeats=1)
    assert rows == wins_up_to
    timed = [r for r, _ in rivals]
    assert timed == [r for r in skinny_linear_module.BF16_SAMPLE_ROWS if r <= wins_up_to] + (
        [next(r for r in skinny_linear_module.BF16_SAMPLE_ROWS if r > wins_up_to)] if wins_up_to < 20 else []
    )
    assert all(
        (rival is None) == (r == 1) for r, rival in rivals
    )  # one row against F.linear, more against mm
    monkeypatch.setattr(skinny_linear_module, "_bf16", {torch.get_num_threads(): rows})
    monkeypatch.delenv("HF_SPEC_BF16_KERNEL", raising=False)
    calls = []
    real = csg.kernel_linear_bf16
    monkeypatch.setattr(csg, "kernel_linear_bf16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(40, 96, dtype=torch.bfloat16)
    for n in (1, 2, 4, 5, 20):
        skinny_linear(torch.randn(n, 96, dtype=torch.bfloat16), w)
    assert calls == [n for n in (1, 2, 4, 5, 20) if n <= rows]


def test_bf16_target_greedy_through_the_kernel(monkeypatch):
    """A bfloat16 target verifies on the kernel: outputs equal plain `generate`'s up to bfloat16 ties."""
    monkeypatch.setenv("HF_SPEC_BF16_KERNEL", "1")
    calls = []
    real = csg.kernel_linear_bf16
    monkeypatch.setattr(csg, "kernel_linear_bf16", lambda *a: calls.append(1) or real(*a))
    run_in_bfloat16(make_tiny_model("qwen2"), "pld")
    assert calls or csg.load_kernel() is None or not csg.has_bf16()


def test_fast_linears_matches_and_restores_forwards():
    model = make_tiny_model("qwen2")
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears
    ids = prompt_ids(length=9)
    with torch.no_grad():
        ref = model(ids).logits
        with fast_linears(model):
            assert all("forward" in m.__dict__ for m in linears)
            fast = model(ids).logits
        assert not any("forward" in m.__dict__ for m in linears)
        _close(fast, ref)
        with pytest.raises(RuntimeError, match="boom"), fast_linears(model):
            raise RuntimeError("boom")
        assert not any("forward" in m.__dict__ for m in linears)
        with fast_linears(model, enabled=False):
            assert not any("forward" in m.__dict__ for m in linears)
        torch.testing.assert_close(model(ids).logits, ref)
