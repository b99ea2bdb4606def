"""`rows_attention`: the attention of hf-spec's quantized CPU targets, each query row computed alone: against
transformers' `sdpa` (float32 and bfloat16), a row's bits alone equal to its bits among others, its masks
(additive, boolean, none = causal or every key), what it hands back to `sdpa`, the compiled operator, and a
bfloat16 quantized target whose speculative output equals its own `generate` token for token."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_spec.kernels import cpu_skinny_gemm
from hf_spec.kernels.rows_attention import ROWS_ATTENTION, _causal, rows_attention_forward
from hf_spec.models.quantize import quantization_report, quantize_target
from tests.conftest import make_tiny_model


@pytest.fixture
def kernel():
    if cpu_skinny_gemm.load_kernel() is None:
        pytest.skip("the C++ kernel does not build here")


def _module() -> nn.Module:
    module = nn.Module()
    module.is_causal = True
    module.num_key_value_groups = 7
    return module


def _inputs(dtype: torch.dtype, rows: int = 5, keys: int = 77, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = (
        torch.randn(1, rows, 14, dim, generator=g).to(dtype).transpose(1, 2)
    )  # (1, heads, rows, dim), as a layer
    k = torch.randn(1, 2, keys, dim, generator=g).to(dtype)
    v = torch.randn(1, 2, keys, dim, generator=g).to(dtype)
    # a verification's mask: the rows are the last `rows` positions of the keys
    sees = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    mask = torch.zeros(1, 1, rows, keys, dtype=dtype).masked_fill(~sees, float("-inf"))
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_attention_is_sdpa_and_each_row_is_its_own(kernel, dtype):
    q, k, v, mask = _inputs(dtype)
    got = rows_attention_forward(_module(), q, k, v, mask, scaling=0.125)[0]
    want = sdpa_attention_forward(_module(), q, k, v, mask, scaling=0.125)[0]
    assert got.shape == want.shape == (1, 5, 14, 64) and got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    alone = [rows_attention_forward(_module(), q[:, :, r : r + 1], k, v, mask[:, :, r : r + 1], scaling=0.125)[0]
             for r in range(5)]  # fmt: skip
    assert torch.equal(torch.cat(alone, dim=1), got), "a row's bits depend on the rows beside it"


def test_masks_boolean_none_and_fully_masked_rows(kernel):
    q, k, v, mask = _inputs(torch.float32)
    ref = rows_attention_forward(_module(), q, k, v, mask, scaling=0.125)[0]
    assert torch.equal(rows_attention_forward(_module(), q, k, v, mask == 0, scaling=0.125)[0], ref)
    _, k5, v5, mask5 = _inputs(torch.float32, keys=5)  # as many keys as rows: both alignments of causal agree
    assert torch.equal(
        rows_attention_forward(_module(), q, k5, v5, None, scaling=0.125)[0],
        rows_attention_forward(_module(), q, k5, v5, mask5, scaling=0.125)[0],
    )
    every = torch.zeros_like(mask)
    assert torch.equal(
        rows_attention_forward(_module(), q, k, v, None, scaling=0.125, is_causal=False)[0],
        rows_attention_forward(_module(), q, k, v, every, scaling=0.125)[0],
    )
    blocked = mask.clone()
    blocked[..., 2, :] = float("-inf")
    out = rows_attention_forward(_module(), q, k, v, blocked, scaling=0.125)[0]
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2])) and torch.isfinite(out).all()
    assert torch.equal(out[:, :2], ref[:, :2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowest_value_and_minus_infinity_masks_give_the_same_bits(kernel, dtype):
    """transformers hides keys with the dtype's lowest value, hf-spec's padded masks with -inf (which the kernel
    skips): in a row that sees some key, both give that key a weight of exactly 0, so the outputs are equal."""
    q, k, v, mask = _inputs(dtype, keys=300)  # most keys hidden, as over a static cache's unfilled slots
    lowest = mask.masked_fill(mask == float("-inf"), torch.finfo(dtype).min)
    got = rows_attention_forward(_module(), q, k, v, mask, scaling=0.125)[0]
    assert torch.equal(rows_attention_forward(_module(), q, k, v, lowest, scaling=0.125)[0], got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_mask_means_what_sdpa_is_causal_means(kernel, dtype):
    """With no mask, several rows and more keys than rows (transformers' prefill into an empty static cache), row r
    sees keys 0..r, as `sdpa`'s `is_causal`, not the last keys."""
    q, k, v, _ = _inputs(dtype, rows=5, keys=40)
    got = rows_attention_forward(_module(), q, k, v, None, scaling=0.125)[0]
    want = sdpa_attention_forward(_module(), q, k, v, None, scaling=0.125)[0]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype is torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    first = torch.zeros(1, 1, 5, 40, dtype=dtype).masked_fill(~_causal(5, 40), float("-inf"))
    assert torch.equal(got, rows_attention_forward(_module(), q, k, v, first, scaling=0.125)[0])


def test_static_cache_prefill_and_generate_equal_the_dynamic_cache(kernel):
    """A quantized target's prefill into a static cache (no mask from transformers, unwritten slots past the
    prompt) gives the logits of a dynamic cache, and `generate` with a static cache the same tokens."""
    from transformers import DynamicCache, StaticCache

    model = quantize_target(make_tiny_model("qwen2").to(torch.bfloat16), "int4")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dynamic = model(ids, past_key_values=DynamicCache(config=model.config)).logits
        static = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=48)).logits
    assert torch.equal(static, dynamic)
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    want = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, cache_implementation="static", **kwargs), want)


@pytest.mark.parametrize("spec", ["pld:3", "oracle:4"])
def test_compiled_rounds_of_a_quantized_target_equal_its_generate(kernel, spec):
    """Compiled verification over a static cache of 3x the tokens: the padded mask hides the unfilled slots with
    -inf, which the kernel skips; the tokens are the target's own `generate`'s, and every round ran compiled."""
    from transformers import CompileConfig

    from hf_spec import SpeculativeDecoder

    model = quantize_target(make_tiny_model("qwen2").to(torch.bfloat16), "int4")
    ids = torch.randint(3, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    want = model.generate(ids, **kwargs)
    decoder = SpeculativeDecoder(spec, compile=True)
    if spec.startswith("oracle"):
        decoder.drafter_for(model).set_reference(want[0])
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    got = model.generate(ids, custom_generate=decoder, compile_config=config, max_cache_len=108, **kwargs)
    assert torch.equal(got, want)
    assert decoder.last_stats.compiled_rounds == decoder.last_stats.target_forwards > 0


def test_what_the_kernel_does_not_take_goes_to_sdpa(kernel, monkeypatch):
    calls = []

    def sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr("hf_spec.kernels.rows_attention.sdpa_attention_forward", sdpa)
    q, k, v, mask = _inputs(torch.float32, rows=65, keys=80)  # a prefill wider than 64 rows
    rows_attention_forward(_module(), q, k, v, mask, scaling=0.125)
    q, k, v, mask = _inputs(torch.float32)
    rows_attention_forward(_module(), q.half(), k.half(), v.half(), mask.half(), scaling=0.125)
    rows_attention_forward(_module(), q, k, v, mask, dropout=0.1, scaling=0.125)
    rows_attention_forward(_module(), q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                           mask, scaling=0.125)  # fmt: skip
    with pytest.raises(ValueError, match="softcap"):  # sdpa's own error, not a silent answer
        rows_attention_forward(_module(), q, k, v, mask, scaling=0.125, softcap=30.0)
    assert len(calls) == 5
    rows_attention_forward(_module(), q, k, v, mask, scaling=0.125)
    assert len(calls) == 5


def test_compiled_graph_calls_one_operator(kernel):
    q, k, v, mask = _inputs(torch.bfloat16, rows=3, keys=20)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def attend(q, k, v, mask):
        return rows_attention_forward(_module(), q, k, v, mask, scaling=0.125)[0]

    compiled = torch.compile(attend, fullgraph=True, backend=record)
    assert torch.equal(compiled(q, k, v, mask), attend(q, k, v, mask))
    assert any(str(n.target) == "hf_spec.rows_attention.default" for g in graphs for n in g.graph.nodes)
    torch.library.opcheck(torch.ops.hf_spec.rows_attention.default, (q, k, v, mask[0, 0], 0.125, True))


def test_the_operator_runs_in_cpp_and_hands_on_what_it_does_not_take(kernel, monkeypatch):
    """Once the kernel module loads, `hf_spec::rows_attention` has a C++ CPU kernel (a compiled step calls it once a
    layer) that takes any mask layout; float16 and a switched-off kernel go to the same function in Python
    (`rows_attention_py`), which refuses float16 by name and otherwise gives the same bits."""
    from hf_spec.kernels.rows_attention import _rows_attention

    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_spec::rows_attention", "CPU")
    op = torch.ops.hf_spec.rows_attention
    module, handed = cpu_skinny_gemm.load_kernel(), []

    def loaded():  # the loaded module, past the switch: the Python function counts its calls
        handed.append(1)
        return module

    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, mask = _inputs(dtype, rows=4, keys=30)
        for m, causal in ((mask[0, 0], True), (mask[0, 0] == 0, True), (None, True), (None, False)):
            expected = _rows_attention(q, k, v, m, 0.125, causal)
            assert torch.equal(op(q, k, v, m, 0.125, causal), expected), (dtype, causal)
        strided = torch.cat([mask[0, 0], mask[0, 0]], dim=1)[:, ::2]  # a mask that is not contiguous
        assert torch.equal(
            op(q, k, v, strided, 0.125, True), _rows_attention(q, k, v, strided.contiguous(), 0.125, True)
        )
        with pytest.raises((ValueError, RuntimeError), match="float32 or bfloat16"):
            op(q.half(), k.half(), v.half(), None, 0.125, True)
        expected = _rows_attention(q, k, v, mask[0, 0], 0.125, True)
        with monkeypatch.context() as patch:
            patch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
            patch.setattr(cpu_skinny_gemm, "load_kernel", loaded)
            handed.clear()
            assert torch.equal(op(q, k, v, mask[0, 0], 0.125, True), expected)
            assert handed, "a switched-off kernel should hand the call to Python"


@pytest.mark.parametrize("spec", ["pld", "draft-model"])
def test_bfloat16_quantized_target_decodes_as_its_own_generate(kernel, spec):
    """Linears, norms and attention all give a verification row the bits of one-row decoding, so in bfloat16
    too the speculative output is the quantized model's own greedy output, token for token."""
    from tests.test_quantized_targets import _assert_decodes_as_generate

    model = quantize_target(make_tiny_model("qwen2").to(torch.bfloat16), "int4")
    assert model.config._attn_implementation == ROWS_ATTENTION
    assert "attention on hf-spec's row kernel" in quantization_report(model)
    _assert_decodes_as_generate(model, spec, new=40)
