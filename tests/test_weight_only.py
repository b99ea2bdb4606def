"""Weight-only int8 / int4 draft weights: the packed kernels compute with the dequantized weight, many-row inputs
use the original, and the module is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_spec.kernels.group_quant import reference_group_linear
from hf_spec.kernels.weight_only import QuantizedWeight, quantize_linears, quantized_linears, tiles_run


@pytest.mark.parametrize("scheme,tolerance", [("int8", 0.01), ("int4", 0.15)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_matmul_is_the_dequantized_weight(scheme, tolerance, dtype):
    torch.manual_seed(0)
    weight = torch.randn(48, 128, dtype=dtype)
    q = QuantizedWeight.from_weight(weight, scheme)
    deq = q.dequantize()
    assert (deq - weight.float()).norm() / weight.float().norm() < tolerance  # a faithful approximation
    x = torch.randn(2, 1, 128, dtype=dtype)  # 2 rows: from 3, float32 x meets int8 as int8 (tested below)
    bias = torch.randn(48, dtype=dtype)
    y = q.linear(x, bias)
    assert y.shape == (2, 1, 48) and y.dtype == dtype
    if q.tiles is not None:  # int4 on hf-spec's int8-input kernel: x rounded to int8 per run of 32 first
        ref = reference_group_linear(x, q.tiles, bias)
        assert torch.allclose(y.float(), ref, rtol=0.01, atol=0.02)
    else:
        ref = x.float() @ deq.t() + bias.float()
        assert torch.allclose(y.float(), ref, rtol=0.02, atol=0.1)  # float32 inputs are computed in bfloat16
    many = torch.randn(q.max_rows + 1, 128, dtype=dtype)  # past max_rows: the original weight, exactly
    assert torch.equal(q.linear(many), nn.functional.linear(many, weight))


def test_float32_int8_runs_hf_specs_kernels():
    """float32 x against int8 weights: 1-2 rows sum in float32 (tight; torch's int8 kernel works in bfloat16), from
    `W8A8_MIN_ROWS` rows on AVX512-VNNI each row of x is quantized to int8 too (exact integer sums of the quantized
    values), else float32 again."""
    from hf_spec.kernels import cpu_skinny_gemm as csg
    from hf_spec.kernels.weight_only import W8A8_MIN_ROWS

    if csg.load_kernel() is None:
        pytest.skip("C++ kernel not buildable here: torch's int8 kernel is used (tested above)")
    torch.manual_seed(3)
    q = QuantizedWeight.from_weight(torch.randn(40, 96), "int8", max_rows=32)
    assert torch.equal(q.qsum, q.packed.sum(dim=1, dtype=torch.int32))
    deq = q.dequantize()
    for x in (torch.randn(1, 96), torch.randn(1, 2, 96), torch.randn(1, 5, 96), torch.randn(32, 96)):
        rows = x.numel() // 96
        if rows >= W8A8_MIN_ROWS and csg.has_vnni():
            x2 = x.reshape(rows, 96)
            step = x2.abs().amax(dim=1, keepdim=True) / 127
            x = ((x2 / step).round().clamp(-127, 127) * step).view(x.shape)  # what the kernel multiplies
            assert not torch.allclose(x, x2.view(x.shape), atol=1e-6)  # (quantizing did change x)
        assert torch.allclose(q.linear(x), x @ deq.t(), rtol=1e-5, atol=1e-4)  # not bfloat16's ~1e-2
    w8a8 = csg.kernel_linear_w8a8
    assert w8a8(torch.randn(33, 96), q.packed, q.qsum, q.scales) is None  # more rows than the kernel takes
    assert w8a8(torch.randn(4, 96, dtype=torch.float64), q.packed, q.qsum, q.scales) is None
    assert w8a8(torch.randn(4, 96), q.packed, q.qsum[:-1], q.scales) is None
    assert w8a8(torch.randn(4, 95), q.packed, q.qsum, q.scales) is None


def test_bfloat16_int8_runs_hf_specs_kernels(monkeypatch):
    """bfloat16 x against int8 weights goes through the same float32-sum kernels (x widened, y narrowed)."""
    from hf_spec.kernels import cpu_skinny_gemm as csg
    from hf_spec.kernels.weight_only import W8A8_MIN_ROWS

    if csg.load_kernel() is None:
        pytest.skip("C++ kernel not buildable here: torch's int8 kernel is used (tested above)")
    calls = []
    for name in ("kernel_linear_int8", "kernel_linear_w8a8"):
        real = getattr(csg, name)
        monkeypatch.setattr(csg, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    torch.manual_seed(4)
    weight = torch.randn(40, 96, dtype=torch.bfloat16)
    q = QuantizedWeight.from_weight(weight, "int8", max_rows=32)
    deq = q.packed.float() * q.scales_f32[:, None]
    bias = torch.randn(40, dtype=torch.bfloat16)
    for rows in (1, 5):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        y = q.linear(x, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
        x32 = x.float()
        if rows >= W8A8_MIN_ROWS and csg.has_vnni():  # what the kernel multiplies
            step = x32.abs().amax(dim=1, keepdim=True) / 127
            x32 = (x32 / step).round().clamp(-127, 127) * step
        ref = x32 @ deq.t() + bias.float()
        assert torch.allclose(y.float(), ref, rtol=0.01, atol=0.05)  # bfloat16 roundings of y and y + bias
    assert calls[0] == "kernel_linear_int8" and len(calls) >= 2


@pytest.mark.parametrize("group_size", [0, 64])
def test_int4_reference_dequantization(group_size):
    """Per group of inputs (32 on hf-spec's int8-input kernel, else 64 on torch's int4 kernel; 64 asked for: torch's
    kernel): 16 levels from the group's min to its max (plain loop reference; hf-spec's scales are bfloat16)."""
    torch.manual_seed(1)
    weight = torch.randn(16, 128)
    q = QuantizedWeight.from_weight(weight, "int4", group_size=group_size)
    assert (q.tiles is not None) == (group_size == 0 and tiles_run())
    g_size, deq = q.group_size, q.dequantize()
    assert g_size == (32 if q.tiles is not None else 64)
    for row in range(16):
        for g in range(128 // g_size):
            w = weight[row, g_size * g : g_size * (g + 1)]
            step = (w.max() - w.min()) / 15
            if q.tiles is not None:
                step = step.to(torch.bfloat16).float()
            want = w.min() + ((w - w.min()) / step).round() * step
            assert torch.allclose(deq[row, g_size * g : g_size * (g + 1)], want, atol=1e-4)


def test_int4_drafts_run_the_int8_input_kernel():
    """Where hf-spec's kernel builds, int4 draft weights are tiled int4 for its int8-input kernel, compiled through
    the group-quant operator, and equal to that kernel's torch twin."""
    if not tiles_run():
        pytest.skip("hf-spec's kernel does not build here: torch's int4 kernel is used (tested above)")
    torch.manual_seed(4)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    q = QuantizedWeight.from_weight(weight, "int4")
    assert q.packed is None and q.tiles.layout.is_tiled and q.tiles.int8_activations
    for rows in (1, 3, 8):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        want = reference_group_linear(x, q.tiles)
        assert torch.allclose(q.linear(x).float(), want, rtol=0.01, atol=0.02)
        compiled = torch.compile(q.linear, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), q.linear(x))


def test_quantized_linears_patch_only_inside_the_block():
    torch.manual_seed(2)
    mlp = nn.Sequential(nn.Linear(64, 32), nn.SiLU(), nn.Linear(32, 32), nn.Linear(32, 5))
    packed = quantize_linears(mlp, "int4")
    assert set(packed) == {mlp[0], mlp[2]}  # int4 leaves out (5, 32): 5 outputs are no multiple of 16
    x = torch.randn(3, 64)
    plain = mlp(x)
    with quantized_linears(packed):
        y = mlp(x)
    assert not torch.equal(y, plain) and torch.allclose(y, plain, atol=0.3)
    assert torch.equal(mlp(x), plain)  # restored
    assert all("forward" not in m.__dict__ for m in mlp)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown weight quantization 'int3'"):
        QuantizedWeight.from_weight(torch.randn(8, 64), "int3")
    with pytest.raises(ValueError, match="int4 needs"):
        QuantizedWeight.from_weight(torch.randn(8, 24), "int4")
