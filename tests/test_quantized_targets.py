"""Quantized targets on hf-spec's group-quantized kernel: GGUF blocks repacked bit for bit as gguf de-quantizes
them, the kernel against its torch twin (rows 1-64 and a prefill's, odd widths, float32 and bfloat16 x, float and int8
activations, each row's bits the same alone and among others), int8 / int4 made at load, a tiny GGUF written here,
and speculative greedy output equal to the quantized model's own `generate`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from hf_spec import SpeculativeDecoder
from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels import group_quant as gq
from hf_spec.kernels.group_quant import CodeLayout, GroupQuantWeight
from hf_spec.models.gguf_blocks import SUPPORTED, repack
from hf_spec.models.quant_modules import QuantizedEmbedding, QuantizedLinear
from hf_spec.models.quantize import (
    gguf_of_folder,
    quantization_report,
    quantize_gguf,
    quantize_int4,
    quantize_int8,
    quantize_target,
)
from tests.conftest import STORIES, make_tiny_model
from tests.test_methods import decoder_for

_MANUAL = (Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf-py de-quantizes these but does not quantize: random valid blocks


def _blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks `(rows, bytes a row)` of a `(rows, cols)` weight: gguf's own quantization of a random weight, or
    random bytes with small finite float16 scales for the K formats."""
    rng = np.random.default_rng(seed)
    if qtype not in _MANUAL:
        return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.1, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    n = raw.shape[0]

    def f16() -> np.ndarray:
        return rng.uniform(-2e-4, 2e-4, n).astype(np.float16).view(np.uint8).reshape(n, 2)

    if qtype == Q.Q6_K:
        raw[:, 208:210] = f16()
    else:
        raw[:, 0:2], raw[:, 2:4] = f16(), f16()
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_repacked_blocks_dequantize_as_gguf_does(qtype):
    rows, cols = 5, 512
    raw = _blocks(qtype, rows, cols)
    reference = quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float32)
    packed = repack(raw, qtype, (rows, cols))
    assert packed.nbytes < rows * cols * 2  # fewer bytes than bfloat16
    # equal values: Q4_0 / Q5_0 write a zero weight as d * q + (-8 d) = +0 where gguf's d * (q - 8) may give -0
    assert np.array_equal(packed.dequantize().numpy(), reference)
    nonzero = reference != 0
    assert np.array_equal(
        packed.dequantize().numpy()[nonzero].view(np.uint32), reference[nonzero].view(np.uint32)
    )
    assert torch.equal(packed.dequantize(torch.tensor([3, 1])), packed.dequantize()[[3, 1]])


def test_repack_refuses_what_it_cannot_read():
    with pytest.raises(NotImplementedError, match="Q2_K"):
        repack(np.zeros((1, 84), np.uint8), Q.Q2_K, (1, 256))
    with pytest.raises(ValueError, match="does not hold"):
        repack(np.zeros((2, 34), np.uint8), Q.Q8_0, (1, 32))


def _weights(out_features: int, in_features: int) -> dict[str, GroupQuantWeight]:
    """One weight of each layout and min kind, `(out_features, in_features)`."""
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(1)) * 0.1
    codes = torch.randint(0, 32, (out_features, in_features), generator=torch.Generator().manual_seed(2))
    scale = torch.rand(out_features, in_features // 32, generator=torch.Generator().manual_seed(3)) * 0.01
    return {
        "i8-channel": quantize_int8(w),
        "i8-16-min": GroupQuantWeight.from_codes(
            codes - 16, scale.repeat_interleave(2, 1), -scale.repeat_interleave(2, 1), CodeLayout.I8, 16
        ),
        "i8-32": GroupQuantWeight.from_codes(codes - 16, scale, None, CodeLayout.I8, 32),  # Q8_0's shape
        "u4-min": quantize_int4(w),
        "u5-min": GroupQuantWeight.from_codes(codes, scale, -16 * scale, CodeLayout.U5, 32),
        # Q4_0's and Q5_0's shapes: the min -8 d / -16 d as a zero point, not stored
        "u4-zp": GroupQuantWeight.from_codes(codes & 15, scale, None, CodeLayout.U4, 32, zero_point=8),
        "u5-zp": GroupQuantWeight.from_codes(codes, scale, None, CodeLayout.U5, 32, zero_point=16),
        # float16 scales (GGUF's d of Q8_0, Q4_0, Q5_0), read as they are
        "i8-32-f16": GroupQuantWeight.from_codes(codes - 16, scale.half(), None, CodeLayout.I8, 32),
        "u5-zp-f16": GroupQuantWeight.from_codes(codes, scale.half(), None, CodeLayout.U5, 32, zero_point=16),
        "u4-zp-f16": GroupQuantWeight.from_codes(
            codes & 15, scale.half(), None, CodeLayout.U4, 32, zero_point=8
        ),
    } | (
        {
            "u4-64": GroupQuantWeight.from_codes(
                codes & 15, scale[:, ::2].contiguous(), None, CodeLayout.U4, 64
            )
        }
        if in_features % 64 == 0
        else {}
    )


def _with_int8_activations(weight: GroupQuantWeight) -> GroupQuantWeight:
    return GroupQuantWeight(
        weight.codes,
        weight.scale,
        weight.min,
        weight.high,
        weight.layout,
        weight.group_size,
        weight.in_features,
        int8_activations=True,
        zero_point=weight.zero_point,
    )


def _all_weights(out_features: int, in_features: int) -> dict[str, GroupQuantWeight]:
    """`_weights`, each also with int8 activations (`name+q8`)."""
    weights = _weights(out_features, in_features)
    return weights | {f"{name}+q8": _with_int8_activations(w) for name, w in weights.items()}


def _kernel_or_skip(isa: int = cpu_skinny_gemm.ISA_AUTO):
    if gq._kernel_for(isa) is None:
        pytest.skip("hf-spec's C++ kernel is not built here (or this CPU has no AVX2)")


@pytest.mark.parametrize(
    "isa", [cpu_skinny_gemm.ISA_AUTO, cpu_skinny_gemm.ISA_SCALAR], ids=["best", "scalar"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernel_matches_its_torch_twin_and_gives_each_row_its_own_bits(isa, dtype):
    _kernel_or_skip(isa)
    bias = torch.randn(13)
    # 13 outputs: tiles of 4 rows and a tail of 1; 128 / 160 inputs: an even / odd number of 32-input runs
    weights = _all_weights(13, 128) | {f"{k} 160": w for k, w in _all_weights(13, 160).items() if "q8" in k}
    for name, weight in weights.items():
        in_features = weight.in_features
        for rows in (1, 2, 3, 5, 17, 64, 130):
            x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
            y = gq.kernel_group_linear(x.float(), weight, bias, isa=isa)
            reference = gq.reference_group_linear(x, weight, bias)
            torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5, msg=f"{name} {rows} rows")
            alone = torch.cat(
                [gq.kernel_group_linear(x[i : i + 1].float(), weight, bias, isa=isa) for i in range(rows)]
            )
            assert torch.equal(alone, y), f"{name}: a row's bits depend on the rows beside it"
            assert gq.group_linear(x, weight, bias).dtype == dtype
            # bfloat16 in and out inside the kernel: widened exactly, the float32 result rounded once
            xb = x.to(torch.bfloat16)
            yb = gq.kernel_group_linear(xb, weight, bias, isa=isa)
            assert yb.dtype == torch.bfloat16
            assert torch.equal(
                yb, gq.kernel_group_linear(xb.float(), weight, bias, isa=isa).to(torch.bfloat16)
            )


@pytest.mark.parametrize(
    "isa", [cpu_skinny_gemm.ISA_AUTO, cpu_skinny_gemm.ISA_SCALAR], ids=["best", "scalar"]
)
def test_a_zero_point_gives_the_bits_of_its_stored_min(isa):
    """Q5_0's `d * (q - 16)` kept as a zero point instead of a stored min `-16 d`: the same weight and, on both
    kernels (int8 inputs read the zero point, float inputs a min made once), the same outputs, in fewer bytes."""
    _kernel_or_skip(isa)
    weights = _weights(13, 160)
    stored, zero_point = weights["u5-min"], weights["u5-zp"]
    assert torch.equal(zero_point.dequantize(), stored.dequantize())
    assert zero_point.nbytes < stored.nbytes
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(5))
    for make in (lambda w: w, _with_int8_activations):
        a, b = make(stored), make(zero_point)
        assert torch.equal(gq.kernel_group_linear(x, b, isa=isa), gq.kernel_group_linear(x, a, isa=isa))
        assert torch.equal(gq.reference_group_linear(x, b), gq.reference_group_linear(x, a))
    with pytest.raises(ValueError, match="zero_point"):
        GroupQuantWeight.from_codes(
            torch.zeros(2, 64), torch.ones(2, 2), None, CodeLayout.U4, 32, zero_point=3
        )
    with pytest.raises(ValueError, match="zero_point"):
        GroupQuantWeight.from_codes(
            torch.zeros(2, 64), torch.ones(2, 2), torch.ones(2, 2), CodeLayout.U4, 32, 8
        )


@pytest.mark.parametrize(
    "isa", [cpu_skinny_gemm.ISA_AUTO, cpu_skinny_gemm.ISA_SCALAR], ids=["best", "scalar"]
)
def test_float16_scales_give_the_bits_of_their_float32_values(isa):
    """GGUF's float16 d kept as float16 scales (half the scale bytes): the same weight and the same outputs as the
    same values widened to float32, on both kernels (int8 inputs read them, float inputs get widened ones)."""
    _kernel_or_skip(isa)
    weights = _weights(13, 160)
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(5))
    for name in ("i8-32-f16", "u5-zp-f16", "u4-zp-f16"):
        half = weights[name]
        wide = GroupQuantWeight(
            half.codes, half.scale.float(), None, half.high, half.layout, 32, 160, zero_point=half.zero_point
        )
        assert torch.equal(half.dequantize(), wide.dequantize()), name
        assert half.nbytes < wide.nbytes
        for make in (lambda w: w, _with_int8_activations):
            a, b = make(wide), make(half)
            assert torch.equal(
                gq.kernel_group_linear(x, b, isa=isa), gq.kernel_group_linear(x, a, isa=isa)
            ), name
    with pytest.raises(ValueError, match="float16 scales"):
        GroupQuantWeight.from_codes(torch.zeros(2, 64), torch.ones(2, 1).half(), None, CodeLayout.U4, 64)
    with pytest.raises(ValueError, match="float16 scales"):
        GroupQuantWeight.from_codes(
            torch.zeros(2, 64), torch.ones(2, 2).half(), torch.ones(2, 2), CodeLayout.U4, 32
        )


def test_int8_activation_tiles_give_the_same_bits_on_every_instruction_set():
    """The integer products are exact, so AVX512-VNNI's fused byte products (chosen where the CPU has them) and
    AVX2's two-step ones give the same bits: a model's tokens do not depend on which tile ran. 13, 14 and 15
    outputs end in tiles of 1, 2 and 3 rows of w (AVX-512 puts two rows in one register); rows of 2,080 inputs
    (65 runs) take tiles of 2."""
    _kernel_or_skip(cpu_skinny_gemm.ISA_AVX2)
    shapes = ((13, 160), (14, 160), (15, 128), (6, 2080))
    weights = {
        f"{name} {n}x{k}": w for n, k in shapes for name, w in _all_weights(n, k).items() if "q8" in name
    }
    for name, weight in weights.items():
        for rows in (1, 4, 7, 64):
            x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows)) * 4
            best = gq.kernel_group_linear(x, weight, isa=cpu_skinny_gemm.ISA_AUTO)
            avx2 = gq.kernel_group_linear(x, weight, isa=cpu_skinny_gemm.ISA_AVX2)
            assert torch.equal(best, avx2), f"{name} {rows} rows"


def _tiled_weights(out_features: int, in_features: int) -> dict[str, GroupQuantWeight]:
    """Each weight of `_weights` with int8 activations, tiled (`name+x16`)."""
    weights = _weights(out_features, in_features)
    return {f"{name}+x16": _with_int8_activations(w).tiled() for name, w in weights.items()}


def test_a_tiled_weight_holds_the_same_weight_in_the_same_bytes():
    """Tiling reorders the codes, high bits, scales and mins of 16 rows at a time: the weight it de-quantizes to
    (all rows, or any rows in any order, as an embedding looks them up), the bytes it reads and the row-major weight
    it gives back are the same."""
    for name, row_major in _weights(48, 160).items():
        weight = _with_int8_activations(row_major)
        tiled = weight.tiled()
        assert tiled.layout.is_tiled and tiled.layout.rows is weight.layout, name
        assert tiled.tiled() is tiled and tiled.nbytes == weight.nbytes
        assert torch.equal(tiled.dequantize(), weight.dequantize()), name
        rows = torch.tensor([47, 0, 17, 17, 31])
        assert torch.equal(tiled.dequantize(rows), weight.dequantize(rows)), name
        back = tiled.untiled()
        for field in ("codes", "scale", "min", "high"):
            a, b = getattr(back, field), getattr(weight, field)
            assert (a is None and b is None) or torch.equal(a, b), f"{name} {field}"
        assert back.int8_activations and back.zero_point == weight.zero_point
        assert torch.equal(tiled.select_rows(rows).dequantize(), weight.dequantize(rows))
    with pytest.raises(ValueError, match="divisible by 16"):
        _weights(13, 128)["u4-min"].tiled()


@pytest.mark.parametrize(
    "isa",
    [cpu_skinny_gemm.ISA_AUTO, cpu_skinny_gemm.ISA_AVX2, cpu_skinny_gemm.ISA_SCALAR],
    ids=["best", "avx2", "scalar"],
)
def test_tiled_kernel_matches_its_torch_twin_and_gives_each_row_its_own_bits(isa):
    """Tiled weights (every layout, min kind, group size and scale type) on the int8-input kernel: close to the
    torch twin, each row's bits the same alone and among others (decoding, verification and prefill rows), with a
    float32 bias; 48 outputs end in a tile of one block of 16 rows (tiles take 2 or 4)."""
    _kernel_or_skip(isa)
    bias = torch.randn(48)
    weights = _tiled_weights(48, 128) | {f"{k} 160": w for k, w in _tiled_weights(48, 160).items()}
    for name, weight in weights.items():
        for rows in (1, 2, 3, 5, 17, 64, 130):
            x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
            y = gq.kernel_group_linear(x, weight, bias, isa=isa)
            torch.testing.assert_close(
                y, gq.reference_group_linear(x, weight, bias), rtol=1e-5, atol=1e-5, msg=f"{name} {rows} rows"
            )
            alone = torch.cat(
                [gq.kernel_group_linear(x[i : i + 1], weight, bias, isa=isa) for i in range(rows)]
            )
            assert torch.equal(alone, y), f"{name}: a row's bits depend on the rows beside it"


def test_tiled_kernel_gives_the_same_bits_on_every_instruction_set():
    """Exact integer sums and one float order: AVX512-VNNI, AVX2 and plain C++ give a tiled weight the same bits
    (rows of 2,080 inputs: 65 runs; 64 outputs: tiles of 4 blocks when decoding)."""
    _kernel_or_skip(cpu_skinny_gemm.ISA_AVX2)
    weights = _tiled_weights(64, 2080) | _tiled_weights(32, 96)
    for name, weight in weights.items():
        for rows in (1, 4, 7):
            x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows)) * 4
            best = gq.kernel_group_linear(x, weight, isa=cpu_skinny_gemm.ISA_AUTO)
            for isa in (cpu_skinny_gemm.ISA_AVX2, cpu_skinny_gemm.ISA_SCALAR):
                assert torch.equal(best, gq.kernel_group_linear(x, weight, isa=isa)), (
                    f"{name} {rows} rows isa {isa}"
                )


def test_a_tiled_weight_without_int8_activations_runs_on_the_torch_twin():
    """Tiled layouts are the int8-input kernel's: with float inputs the kernel declines and the twin runs."""
    weight = _with_int8_activations(_weights(16, 64)["u5-zp"]).tiled()
    weight.int8_activations = False
    x = torch.randn(2, 64)
    assert gq.kernel_group_linear(x, weight) is None
    assert torch.equal(gq.group_linear(x, weight), gq.reference_group_linear(x, weight))


def test_kernel_declines_what_it_does_not_take():
    weight = _weights(8, 64)["u4-min"]
    assert gq.kernel_group_linear(torch.randn(2, 64, dtype=torch.float16), weight) is None
    assert gq.kernel_group_linear(torch.randn(2, 32), weight) is None
    with pytest.raises(ValueError, match="divisible by 32"):
        _with_int8_activations(quantize_int8(torch.randn(8, 48)))


def test_a_nan_input_gives_nan_outputs_with_int8_activations():
    _kernel_or_skip()
    for weight in (
        _with_int8_activations(_weights(8, 64)["u5-min"]),
        _with_int8_activations(_weights(16, 64)["u5-zp"]).tiled(),
    ):
        x = torch.randn(2, 64)
        x[1, 40] = float("nan")
        y = gq.kernel_group_linear(x, weight)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
        assert torch.isnan(gq.reference_group_linear(x, weight)[1]).all()


@pytest.mark.parametrize("tiled", [False, True], ids=["rows", "x16"])
@pytest.mark.parametrize("layout", [CodeLayout.I8, CodeLayout.U4, CodeLayout.U5])
def test_the_kernels_int8_rounding_is_the_torch_twins(layout, tiled):
    """A weight whose row n has code 1 at input n and 0 elsewhere (scale 1, min 0) gives y = x' exactly: the
    kernel's rounded inputs, bit for bit `quantize_activations`' (runs paired or not, the odd last run, ties)."""
    _kernel_or_skip()
    k = 96  # three runs: a pair and an odd last run for the packed layouts
    codes = torch.eye(k, dtype=torch.int32)
    scale, low = torch.ones(k, k // 32), torch.zeros(k, k // 32)
    weight = GroupQuantWeight.from_codes(codes, scale, None if layout is CodeLayout.I8 else low, layout, 32)
    weight = _with_int8_activations(weight)
    if tiled:
        weight = weight.tiled()
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4)) * 3
    x[1, :32] = torch.arange(32) * (127 / 31) / 2 - 0.5 * (torch.arange(32) % 2)  # halves: round-to-even ties
    x[2, 32:64] = 0.0  # a run of zeros: d = 0
    x[3] = x[3].to(torch.bfloat16).float()  # bfloat16 values
    for isa in (cpu_skinny_gemm.ISA_SCALAR, cpu_skinny_gemm.ISA_AUTO):
        y = gq.kernel_group_linear(x, weight, isa=isa)
        assert torch.equal(y, gq.quantize_activations(x)), f"{layout.name} isa {isa}"


def test_int8_activations_are_rounded_per_run_of_32():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.linspace(-1, 2, 32)  # d = 2 / 127; the second run is all zero: d = 0, q = 0
    x[1, 32:] = 0.5
    q = gq.quantize_activations(x)
    d = 2 / 127
    torch.testing.assert_close(q[0, :32], torch.round(x[0, :32] / d) * d)
    assert torch.equal(q[0, 32:], torch.zeros(32)) and torch.equal(q[1, :32], torch.zeros(32))
    torch.testing.assert_close(q[1, 32:], torch.full((32,), 0.5))
    assert float((q - x).abs().amax()) <= d / 2 + 1e-7


def test_without_kernels_or_without_avx2_the_torch_twin_runs(monkeypatch):
    x = torch.randn(3, 64)
    for weight in (_weights(8, 64)["u5-min"], _with_int8_activations(_weights(8, 64)["u5-min"])):
        monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
        assert torch.equal(gq.group_linear(x, weight), gq.reference_group_linear(x, weight))
        monkeypatch.delenv("HF_SPEC_NO_CPP_KERNELS")
        monkeypatch.setattr(gq, "_best_isa", cpu_skinny_gemm.ISA_SCALAR)  # a CPU without AVX2
        if cpu_skinny_gemm.load_kernel() is not None:
            assert gq._kernel_for(cpu_skinny_gemm.ISA_AUTO) is None
            assert torch.equal(gq.group_linear(x, weight), gq.reference_group_linear(x, weight))
        monkeypatch.undo()


def test_custom_op_traces_without_graph_breaks():
    weight = _weights(8, 64)["u4-min"]
    module = QuantizedLinear(weight, torch.randn(8), "int4", torch.float32)
    x = torch.randn(2, 64)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), module(x))
    direct = torch.ops.hf_spec.group_quant_linear(
        x, weight.codes, weight.scale, weight.min, None, None, int(weight.layout), weight.group_size
    )
    assert torch.equal(direct, gq.group_linear(x, weight))
    q8 = QuantizedLinear(_with_int8_activations(weight), None, "int4", torch.float32)
    assert torch.equal(torch.compile(q8, backend="eager", fullgraph=True)(x), q8(x))
    plain = QuantizedLinear(weight, None, "int4", torch.float32)
    assert not torch.equal(q8(x), plain(x))  # the inputs were rounded


def test_a_quantized_linear_prepares_its_kernel_call_again_when_its_weight_or_bias_changes():
    """The module keeps its kernel call prepared (plan, float32 bias) between calls: a bias changed in place, a new
    bias or a new packed weight must reach the next call, not the prepared one."""
    _kernel_or_skip()
    weights = _weights(8, 64)
    module = QuantizedLinear(
        _with_int8_activations(weights["u5-zp"]), torch.randn(8), "gguf Q5_0", torch.bfloat16
    )
    x = torch.randn(2, 64).to(torch.bfloat16)

    def expected() -> torch.Tensor:
        return gq.group_linear(x, module.packed, module.bias)

    assert torch.equal(module(x), expected())
    with torch.no_grad():
        module.bias.add_(1.0)
    assert torch.equal(module(x), expected())
    module.bias = torch.nn.Parameter(torch.randn(8), requires_grad=False)
    assert torch.equal(module(x), expected())
    module.packed = _with_int8_activations(weights["u4-zp"])
    assert torch.equal(module(x), expected())
    module.packed.int8_activations = False
    assert torch.equal(module(x), expected())
    empty = module(x[:0])  # no row: the general path
    assert empty.shape == (0, 8) and empty.dtype == torch.bfloat16


def test_the_operator_gives_group_linear_on_every_path(monkeypatch):
    _kernel_or_skip()
    weight = _with_int8_activations(_weights(8, 64)["u5-min"])
    bias = torch.randn(8).to(torch.bfloat16)

    def op(x, b):
        return torch.ops.hf_spec.group_quant_linear(
            x,
            weight.codes,
            weight.scale,
            weight.min,
            weight.high,
            b,
            int(weight.layout),
            weight.group_size,
            True,
        )

    x = torch.randn(3, 64).to(torch.bfloat16)
    expected = {id(b): gq.group_linear(x, weight, b) for b in (None, bias)}
    with monkeypatch.context() as m:  # the kernel straight away: no weight is built for the call
        m.setattr(gq.GroupQuantWeight, "unchecked", None)
        for b in (None, bias):  # a bfloat16 bias is added in float32
            assert torch.equal(op(x, b), expected[id(b)])
    wide = torch.randn(3, 128).to(torch.bfloat16)[
        :, ::2
    ]  # not contiguous, float16, and no row: the slow path
    for other in (wide, x.half(), x[:0]):
        assert torch.equal(op(other, bias), gq.group_linear(other, weight, bias))


def test_the_operator_runs_in_cpp_once_the_kernel_loads_and_hands_on_what_it_does_not_take(monkeypatch):
    """Once the kernel module loads, `hf_spec::group_quant_linear` has a C++ CPU kernel for int8-input weights (a
    compiled step calls it once a linear); float inputs, other dtypes and a switched-off kernel go to the same
    function in Python (`group_quant_linear_py`): every path gives `group_linear`'s result."""
    _kernel_or_skip()
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_spec::group_quant_linear", "CPU")
    weights = _weights(16, 64)
    x = torch.randn(3, 64).to(torch.bfloat16)
    bias = torch.randn(16).to(torch.bfloat16)
    for name in ("u5-zp-f16", "u5-min", "i8-32-f16", "u4-min"):
        q8 = _with_int8_activations(weights[name])
        for weight in (weights[name], q8, q8.tiled()):
            args = (weight.codes, weight.scale, weight.min, weight.high, bias, weight.layout_code)
            rest = (weight.group_size, weight.int8_activations, weight.zero_point)
            expected = gq.group_linear(x, weight, bias)
            assert torch.equal(torch.ops.hf_spec.group_quant_linear(x, *args, *rest), expected), name
            assert torch.equal(
                torch.ops.hf_spec.group_quant_linear(x.half(), *args, *rest),
                gq.group_linear(x.half(), weight, bias),
            )
            with monkeypatch.context() as m:
                m.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
                torch.testing.assert_close(
                    torch.ops.hf_spec.group_quant_linear(x, *args, *rest), expected, rtol=1e-2, atol=1e-2
                )


def test_group_quant_weight_checks_its_tensors():
    with pytest.raises(ValueError, match="group size"):
        GroupQuantWeight.from_codes(torch.zeros(2, 64), torch.ones(2, 1), None, CodeLayout.U4, 48)
    with pytest.raises(ValueError, match="0..15"):
        GroupQuantWeight.from_codes(torch.full((2, 32), 16), torch.ones(2, 1), None, CodeLayout.U4, 32)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_made_here_schemes_are_close_to_the_weight(scheme):
    w = torch.randn(24, 96)
    packed = quantize_int8(w) if scheme == "int8" else quantize_int4(w)
    step = w.abs().amax(1, keepdim=True) / 127 if scheme == "int8" else (w.amax(1) - w.amin(1)).amax() / 15
    assert float(((packed.dequantize() - w).abs() - step / 2 * 1.01).amax()) <= 1e-6


def _assert_decodes_as_generate(model, spec: str, new: int = 24) -> None:
    ids = torch.tensor([[1, 40, 30, 70, 40, 30, 70, 22, 40, 30]])
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=decoder_for(spec, model))
    assert out[0].tolist() == ref[0].tolist(), spec


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_tiny_target_made_here_decodes_as_its_own_generate(scheme):
    model = quantize_target(make_tiny_model("llama"), scheme)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert quantization_report(model).startswith(f"yes: {4 * 7 + 1} linears")
    for spec in ("pld", "draft-model") if scheme == "int4" else ("pld",):
        _assert_decodes_as_generate(model, spec)


def test_tiny_target_on_the_torch_twin_decodes_as_its_own_generate(monkeypatch):
    """`HF_SPEC_NO_CPP_KERNELS=1`: every quantized linear runs `F.linear` on its de-quantized weight."""
    monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
    model = quantize_target(make_tiny_model("qwen2"), "int4")
    _assert_decodes_as_generate(model, "pld")


def test_load_model_quantizes_and_check_reports_it():
    from hf_spec.models import load_model
    from hf_spec.models.support import support_report

    model, _ = load_model(str(STORIES), quantize="int8")
    report = support_report(model)["quantized linears"]
    # stories260K's MLP is 172 wide: its down projections (in_features 172) stay nn.Linear
    assert report.startswith("yes:") and "int8" in report and "nn.Linear unquantized" in report, report
    _assert_decodes_as_generate(model, "pld")
    with pytest.raises(ValueError, match="not converted from a GGUF"):
        load_model(str(STORIES), quantize="gguf")
    with pytest.raises(ValueError, match="without load_in"):
        load_model(str(STORIES), quantize="int4", load_in_8bit=True)


# the tiny GGUF's formats, by linear: every supported one, K formats included (they need 256-wide inputs)
GGUF_TYPES = {
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q5_1,
    "attn_v": Q.Q4_1,
    "attn_output": Q.Q5_0,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q5_K,
    "ffn_down": Q.Q6_K,
}
HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _tiny_gguf_target(tmp_path):
    """A tiny tied Llama whose weights are what transformers makes of a GGUF written here (llama.cpp's q / k row
    permutation included), and that GGUF's path."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    writer = GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    tensors = {"token_embd.weight": (model.model.embed_tokens, Q.Q8_0)}
    for i, layer in enumerate(model.model.layers):
        for key, qtype in GGUF_TYPES.items():
            tensors[f"blk.{i}.{key}.weight"] = (layer.get_submodule(HF_NAMES[key]), qtype)
    with torch.no_grad():
        for name, (module, qtype) in tensors.items():
            rows, cols = module.weight.shape
            raw = _blocks(qtype, rows, cols, seed=len(name))
            stored = quants.dequantize(raw, qtype).reshape(rows, cols)
            probe = processor.process(np.arange(rows, dtype=np.float64)[:, None], name).weights
            module.weight.copy_(torch.from_numpy(stored[probe[:, 0].astype(np.int64)]))
            writer.add_tensor(name, raw, raw_dtype=qtype)
        for name, tensor in (("output_norm.weight", model.model.norm.weight),):
            writer.add_tensor(name, tensor.detach().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model, tmp_path / "tiny.gguf"


def test_tiny_gguf_target_keeps_its_blocks_and_decodes_as_its_own_generate(tmp_path):
    model, path = _tiny_gguf_target(tmp_path)
    x = torch.randint(3, 96, (1, 12))
    with torch.no_grad():
        dense = model(x).logits
    assert quantize_gguf(model, path, int8_activations=False) == 2 * 7 + 2  # linears, embedding, tied LM head
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.packed is model.model.embed_tokens.packed
    assert model.model.layers[1].mlp.down_proj.scheme == "gguf Q6_K"
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, dense, rtol=1e-4, atol=1e-4)  # the same weights
    for spec in ("pld", "draft-model"):
        _assert_decodes_as_generate(model, spec)
    # the default: inputs rounded to int8 as llama.cpp runs a GGUF, close to the float products
    model, path = _tiny_gguf_target(tmp_path)
    quantize_gguf(model, path)
    assert all(m.packed.int8_activations for m in model.modules() if isinstance(m, QuantizedLinear))
    # in the tiled layouts wherever the widths allow: the embedding is looked up in them too
    tiles = [
        m.packed.layout.is_tiled
        for m in model.modules()
        if isinstance(m, QuantizedLinear) and m.out_features % 16 == 0
    ]
    assert tiles and all(tiles)
    assert "int8 inputs" in quantization_report(model)
    from hf_spec.engine.target.profile import target_profile

    # the tree check and the near-tie accounting allow for the rounding
    assert target_profile(model).rounded_inputs
    with torch.no_grad():
        assert float((model(x).logits - dense).abs().amax()) <= 0.05 * float(dense.abs().amax())
    for spec in ("pld", "draft-model"):
        _assert_decodes_as_generate(model, spec)


def test_gguf_blocks_of_another_model_are_refused(tmp_path):
    model, path = _tiny_gguf_target(tmp_path)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(2)
    with pytest.raises(ValueError, match="not converted from this GGUF"):
        quantize_gguf(model, path)


def test_gguf_needs_a_folder_fetched_from_a_gguf(tmp_path):
    with pytest.raises(ValueError, match="not converted from a GGUF"):
        gguf_of_folder(tmp_path)
    folder = tmp_path / "models" / "tiny"
    folder.mkdir(parents=True)
    (folder / "hf_spec_fetch.json").write_text(json.dumps({"gguf_file": "tiny.gguf"}))
    with pytest.raises(ValueError, match="missing"):
        gguf_of_folder(folder)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "tiny.gguf").write_bytes(b"")
    assert gguf_of_folder(folder) == tmp_path / "gguf" / "tiny.gguf"
    with pytest.raises(ValueError, match="unknown quantize"):
        quantize_target(make_tiny_model("llama"), "int5")


def test_quantized_modules_stay_on_the_cpu_and_keep_float32_scales():
    model = quantize_target(make_tiny_model("llama"), "int4")
    model.to(torch.bfloat16)
    head = model.lm_head
    assert head.packed.scale.dtype == torch.float32 and head.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="CPU only"):
        head.to("meta")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_known_gguf_target_decodes_as_its_own_generate(name, dtype):
    """The real GGUFs (fetched once with `hf-spec fetch NAME`): every quantized tensor kept; linears (inputs rounded
    to int8, as llama.cpp), norms and attention give each row of a verification the bits of one-row decoding, so the
    speculative output is the target's own greedy output token for token, in bfloat16 too."""
    from hf_spec.bench.lossless import compare_greedy
    from hf_spec.models import FetchError, load_model, resolve_model

    try:
        resolve_model(name, fetch=False)
    except FetchError:
        pytest.skip(f"{name} is not fetched")
    model, tokenizer = load_model(name, dtype=dtype, quantize="gguf")
    report = quantization_report(model)
    assert report.startswith("yes:") and "unquantized" not in report, report
    for prompt in ("def fibonacci(n):\n    ", "The capital of France is"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1] :].tolist()
        out = model.generate(
            ids, max_new_tokens=32, do_sample=False, custom_generate=SpeculativeDecoder("pld")
        )
        got = out[0, ids.shape[1] :].tolist()
        assert got == ref, compare_greedy(model, ids, ref, got)


def test_a_bfloat16_bias_is_added_in_float32_and_follows_changes():
    weight = _weights(8, 64)["u4-min"]
    bias = torch.randn(8).to(torch.bfloat16)
    module = QuantizedLinear(weight, bias, "int4", torch.bfloat16)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(module(x), gq.group_linear(x, weight, bias.float()))
    with torch.no_grad():
        module.bias.add_(1.0)  # an in-place change is seen by the next call
    assert torch.equal(module(x), gq.group_linear(x, weight, module.bias.float()))
    with torch.inference_mode():  # a module made from inference tensors
        made = QuantizedLinear(weight, bias, "int4", torch.bfloat16)
        assert torch.equal(made(x), gq.group_linear(x, weight, bias.float()))
