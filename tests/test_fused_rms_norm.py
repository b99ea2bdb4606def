"""`FusedRMSNorm`: a Llama-family RMSNorm in one call of hf-spec's C++ kernel, against transformers' own module
(bfloat16 and float32, one row and many, each row's bits independent of the others), where it falls back to
transformers' formula, which classes it replaces, and that quantized targets use it and still decode as their own
`generate`."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.rms_norm import kernel_rms_norm, reference_rms_norm, rms_norm
from hf_spec.models.quant_modules import FUSABLE_RMS_NORMS, FusedRMSNorm, fuse_rms_norms
from hf_spec.models.quantize import quantization_report, quantize_target
from tests.conftest import make_tiny_model


@pytest.fixture
def kernel():
    if cpu_skinny_gemm.load_kernel() is None:
        pytest.skip("the C++ kernel does not build here")


def _norm(dtype: torch.dtype, hidden: int = 896):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    norm = Qwen2RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(1)) * 0.3 + 1)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_is_transformers_norm_and_each_row_is_its_own(kernel, dtype):
    norm = _norm(dtype).requires_grad_(False)
    x = (torch.randn(3, 37, 896, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = kernel_rms_norm(x, norm.weight, norm.variance_epsilon)
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    if dtype is torch.bfloat16:
        # the mean's last float32 bit may differ (another sum order than torch's); bfloat16 rounding hides it
        # but where a value lies within that bit of a rounding boundary
        assert (got != want).float().mean() < 1e-3
    torch.testing.assert_close(got, want, rtol=1e-6 if dtype is torch.float32 else 8e-3, atol=1e-6)
    rows = x.reshape(-1, 896)
    alone = torch.cat([kernel_rms_norm(rows[i : i + 1], norm.weight, 1e-6) for i in range(rows.shape[0])])
    assert torch.equal(alone, got.reshape(-1, 896))


def test_what_the_kernel_does_not_take_runs_transformers_formula(kernel):
    norm = _norm(torch.float32, 64).requires_grad_(False)
    x = torch.randn(4, 64)
    assert kernel_rms_norm(x.bfloat16(), norm.weight, 1e-6) is None  # mixed dtypes
    assert kernel_rms_norm(torch.randn(64, 4).t(), norm.weight, 1e-6) is None  # not contiguous
    assert kernel_rms_norm(x.half(), norm.weight.half(), 1e-6) is None
    assert kernel_rms_norm(x.requires_grad_(), norm.weight, 1e-6) is None  # autograd wants its graph
    y = rms_norm(x, norm.weight, 1e-6)
    assert y.requires_grad and torch.equal(y, reference_rms_norm(x, norm.weight, 1e-6))
    with torch.no_grad():
        half = torch.randn(4, 64).half()
        assert torch.equal(rms_norm(half, norm.weight.half(), 1e-6), norm.half()(half))


def test_without_the_kernel_the_norm_is_transformers(monkeypatch):
    monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
    norm = _norm(torch.bfloat16, 64)
    fused = FusedRMSNorm(norm.weight, norm.variance_epsilon, "Qwen2RMSNorm")
    x = torch.randn(2, 5, 64).bfloat16()
    with torch.no_grad():
        assert torch.equal(fused(x), norm(x))


@pytest.mark.parametrize("name", sorted(FUSABLE_RMS_NORMS))
def test_every_fusable_class_computes_this_formula(name):
    """Each listed class's own forward against the reference formula, float64 inputs so no rounding hides a
    different formula (a `1 + weight` or a cast after the product would show)."""
    module_name = {"Phi3RMSNorm": "phi3", "SmolLM3RMSNorm": "smollm3"}.get(
        name, name.removesuffix("RMSNorm").lower()
    )
    try:
        cls = getattr(
            importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}"), name
        )
    except (ImportError, AttributeError):
        pytest.skip(f"this transformers has no {name}")
    norm = cls(16, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, dtype=torch.float64))
    assert FusedRMSNorm.fusable(norm)
    x = torch.randn(3, 16, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-5))


def test_only_fusable_norms_are_replaced_and_the_weights_stay():
    class GemmaLikeRMSNorm(nn.Module):  # another formula, not listed
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    model = make_tiny_model("qwen2")
    model.extra = GemmaLikeRMSNorm()
    weights = {n: p for n, p in model.named_parameters() if "norm" in n}
    count = fuse_rms_norms(model)
    assert count == sum(1 for n in weights if n.endswith("norm.weight") and not n.startswith("extra"))
    assert isinstance(model.model.norm, FusedRMSNorm) and isinstance(model.extra, GemmaLikeRMSNorm)
    assert {n: p for n, p in model.named_parameters() if "norm" in n}.keys() == weights.keys()
    assert model.model.norm.weight is weights["model.norm.weight"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_targets_run_fused_norms_and_decode_as_their_own_generate(family):
    from tests.test_quantized_targets import _assert_decodes_as_generate

    model = quantize_target(make_tiny_model(family), "int4")
    assert not any(type(m).__name__ in FUSABLE_RMS_NORMS for m in model.modules())
    assert "RMSNorms in one kernel call each" in quantization_report(model)
    _assert_decodes_as_generate(model, "pld")


def test_fused_norm_compiles_as_one_operator(kernel):
    norm = _norm(torch.bfloat16, 64)
    fused = FusedRMSNorm(norm.weight, norm.variance_epsilon, "Qwen2RMSNorm")
    x = torch.randn(2, 64).bfloat16()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        out = torch.compile(fused, fullgraph=True, backend=record)(x)
        assert torch.equal(out, fused(x))
    assert any(str(n.target) == "hf_spec.rms_norm.default" for g in graphs for n in g.graph.nodes)
    torch.library.opcheck(torch.ops.hf_spec.rms_norm.default, (x, norm.weight.detach(), 1e-6))


def test_the_operator_runs_in_cpp_and_hands_on_what_it_does_not_take(kernel, monkeypatch):
    """Once the kernel module loads, `hf_spec::rms_norm` has a C++ CPU kernel (a compiled step calls it once a norm)
    with the Python kernel's bits; mixed dtypes, float16 and a switched-off kernel go to the same function in Python
    (`rms_norm_py`), which gives transformers' formula there."""
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_spec::rms_norm", "CPU")
    op = torch.ops.hf_spec.rms_norm
    for dtype in (torch.float32, torch.bfloat16):
        norm = _norm(dtype, 96)
        w = norm.weight.detach()
        x = torch.randn(3, 5, 96).to(dtype)
        assert torch.equal(op(x, w, 1e-6), kernel_rms_norm(x, w, 1e-6))
        assert torch.equal(op(x.half(), w.half(), 1e-6), reference_rms_norm(x.half(), w.half(), 1e-6))
        mixed = op(x, w.float() if dtype is torch.bfloat16 else w.bfloat16(), 1e-6)
        assert mixed.dtype == torch.float32
        with monkeypatch.context() as patch:
            patch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")  # the Python function then runs transformers' formula
            assert torch.equal(op(x, w, 1e-6), reference_rms_norm(x, w, 1e-6))
