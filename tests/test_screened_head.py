"""The int8-screened LM head: kernel against its reference, the error bound, exact argmax, and when the loop uses it."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_spec import SpeculativeDecoder
from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter
from hf_spec.kernels import cpu_skinny_gemm as csg
from hf_spec.kernels import screened_head as sh
from hf_spec.kernels import skinny_linear as sl
from hf_spec.kernels.screened_head import Int8Screen, screened_lm_head, screening_applies
from hf_spec.tree.draft_tree import DraftTree
from tests.conftest import make_tiny_model, prompt_ids


@pytest.fixture(scope="module")
def kernel():
    if csg.load_kernel() is None:
        pytest.skip("C++ kernel not buildable here: screening is off without it (tested below)")


def _quantized(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return w, q, scale


@pytest.mark.parametrize("isa", [csg.ISA_SCALAR, csg.ISA_AVX2])
@pytest.mark.parametrize("k", [16, 20, 1003])  # every tail of the 8-wide loop
@pytest.mark.parametrize("n", [1, 7, 130])  # tiles of 1..4 rows of q
def test_int8_kernel_matches_reference(kernel, isa, k, n):
    _, q, scale = _quantized(n, k, seed=k + n)
    for m in (1, 2, 3, 4, 5, 7, 32):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = csg.kernel_linear_int8(x, q, scale, isa=isa)
        ref = (x.double() @ q.double().T) * scale.double()
        assert y is not None and y.shape == (m, n)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()))


def test_int8_kernel_declines_what_it_cannot_take(kernel):
    _, q, scale = _quantized(8, 16)
    assert csg.kernel_linear_int8(torch.randn(33, 16), q, scale) is None  # too many rows
    assert csg.kernel_linear_int8(torch.randn(2, 16, dtype=torch.float64), q, scale) is None
    assert csg.kernel_linear_int8(torch.randn(2, 16), q.float(), scale) is None
    assert csg.kernel_linear_int8(torch.randn(2, 15), q, scale) is None


@pytest.fixture(params=["fp32-x", "int8-x"])
def x_path(request, monkeypatch):
    """The screen's two scorings: fp32 x against int8 weights, or (AVX512-VNNI, 3+ rows) int8 x too."""
    if request.param == "fp32-x":
        monkeypatch.setattr(csg, "has_vnni", lambda: False)
    elif not csg.has_vnni():
        pytest.skip("no AVX512-VNNI on this CPU: x is never quantized here")
    monkeypatch.setattr(sh, "INT8_X_MIN_WEIGHTS", 0)  # the tests' heads are small
    return request.param


def test_small_heads_keep_x_in_fp32(monkeypatch):
    """x is quantized only for heads large enough that reading them costs more than quantizing (not SmolLM2's)."""
    monkeypatch.setattr(csg, "has_vnni", lambda: True)
    assert not sh.int8_x_applies(49152 * 576) and sh.max_screened_rows(49152 * 576) == sh.MAX_ROWS
    assert sh.int8_x_applies(151936 * 896) and sh.max_screened_rows(151936 * 896) == sh.MAX_ROWS_VNNI
    monkeypatch.setenv("HF_SPEC_SCREEN_INT8_X", "0")
    assert not sh.int8_x_applies(151936 * 896)
    monkeypatch.setattr(csg, "has_vnni", lambda: False)
    monkeypatch.delenv("HF_SPEC_SCREEN_INT8_X")
    assert not sh.int8_x_applies(151936 * 896)


@pytest.fixture(scope="module")
def vnni(kernel):
    if not csg.has_vnni():
        pytest.skip("no AVX512-VNNI on this CPU")


@pytest.mark.parametrize("k", [16, 64, 65, 130, 1003])  # every tail of the 64-byte loop
@pytest.mark.parametrize("n", [1, 7, 130])  # tiles of 1..4 rows of q
def test_u8s8_kernel_is_exact(vnni, k, n):
    """Integer products summed exactly, then one rounding each for the int32 -> fp32, scale products."""
    g = torch.Generator().manual_seed(k + n)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scale = torch.rand(n, generator=g) + 0.5
    for m in (1, 2, 5, 6, 7, 13, 32):
        qx = torch.randint(-127, 128, (m, k), dtype=torch.int32, generator=g)
        xs = torch.rand(m, generator=g) + 0.5
        y = csg.kernel_linear_u8s8((qx + 128).to(torch.uint8), xs, q, q.int().sum(1).int(), scale)
        ref = (qx.long() @ q.long().T).float() * (scale[None] * xs[:, None])
        assert y is not None and torch.equal(y, ref)


def test_u8s8_kernel_declines_what_it_cannot_take(vnni):
    q = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    qsum, scale, xs = q.int().sum(1).int(), torch.ones(8), torch.ones(2)
    xu = torch.full((2, 16), 128, dtype=torch.uint8)
    assert csg.kernel_linear_u8s8(xu, xs, q, qsum, scale) is not None
    assert (
        csg.kernel_linear_u8s8(torch.full((33, 16), 128, dtype=torch.uint8), torch.ones(33), q, qsum, scale)
        is None
    )
    assert csg.kernel_linear_u8s8(xu.to(torch.int8), xs, q, qsum, scale) is None
    assert csg.kernel_linear_u8s8(xu, xs, q, qsum.long(), scale) is None
    assert csg.kernel_linear_u8s8(xu, torch.ones(3), q, qsum, scale) is None
    assert csg.kernel_linear_u8s8(xu[:, :15].contiguous(), xs, q, qsum, scale) is None


@pytest.mark.parametrize("seed", range(3))
def test_error_bound_with_int8_x_holds_for_every_token(vnni, seed):
    """After each int8 level of x: |a_j - t_j| <= |x| c_j + err_l |s_j q_j|, with outlier rows and channels."""
    w, _, _ = _quantized(4099, 96, seed)
    w[::97] *= 40
    screen = Int8Screen.from_weight(w)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(7, 96, generator=g) * 30
    x[:, 3] = 400
    x[2] *= 1e-3  # a small row: small scales
    x[4] = 0.0  # a zero row
    exact = x.double() @ w.double().T
    xn = x.double().norm(dim=1, keepdim=True) * (1 + 1e-4)
    (xu1, s1, err1), (xu2, s2, err2) = sh.int8_levels(x)
    first = csg.kernel_linear_u8s8(xu1, s1, screen.q, screen.qsum, screen.scale)
    both = first + csg.kernel_linear_u8s8(xu2, s2, screen.q, screen.qsum, screen.scale)
    for approx, err in ((first, err1), (both, err2)):
        bound = xn * screen.coef.double()[None] + err.double()[:, None] * screen.qnorm.double()[None]
        assert ((approx.double() - exact).abs() <= bound).all()
    assert (err2 <= err1 / 100).all()  # the second level tightens the bound ~250-fold


@pytest.mark.parametrize("seed", range(3))
def test_error_bound_holds_for_every_token(kernel, seed):
    """|a_j - t_j| <= |x| c_j, the bound the candidate set rests on, with outlier rows and large activations."""
    w, _, _ = _quantized(4099, 96, seed)
    w[::97] *= 40  # rows with large weights: large scales
    screen = Int8Screen.from_weight(w)
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(5, 96, generator=g) * 30
    x[:, 3] = 400  # an outlier channel, as final norms have
    approx = csg.kernel_linear_int8(x, screen.q, screen.scale)
    exact = x.double() @ w.double().T
    bound = x.double().norm(dim=1, keepdim=True) * screen.coef.double()[None]
    assert ((approx.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [3, 13])
def test_top1_logits_keep_the_argmax_at_near_ties(kernel, x_path, rows):
    """Rows built to tie within the int8 error: the screened argmax is the fp32 head's, and candidates are exact."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2000, 64, generator=g) / 8
    w[1:50] = w[0] + 1e-4 * torch.randn(49, 64, generator=g)  # 50 rows within int8 rounding of each other
    screen = Int8Screen.from_weight(w)
    rows = min(rows, sh.max_screened_rows())  # 6 where x stays fp32
    for trial in range(40):
        x = torch.randn(rows, 64, generator=g)
        x[-1, 7] = 30  # an outlier channel
        x[0] = w[trial % 50] * 20  # the near-tied rows are the top ones
        full = csg.kernel_linear(x.contiguous(), w)
        top = screen.top1_logits(x)
        assert torch.equal(top.argmax(-1), full.argmax(-1))
        kept = torch.isfinite(top)
        assert kept.sum(-1).max() < 2000  # it did screen
        assert torch.equal(top[kept], full[kept])  # same kernel, same sums: bit-identical


@pytest.fixture
def bf16_kernel(kernel, monkeypatch):
    if not csg.has_bf16():
        pytest.skip("no AVX512-BF16 here: bfloat16 heads are not screened")
    monkeypatch.setenv("HF_SPEC_BF16_KERNEL", "1")


@pytest.mark.parametrize("rows", [1, 3, 13])
def test_bfloat16_top1_logits_keep_the_argmax_at_ties(bf16_kernel, x_path, rows):
    """bfloat16 head: the argmax of the full head's bfloat16 logits (on the kernel), first id at a tie, also where
    rows are equal or tie only after rounding; the kept logits are the full head's bits."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3000, 64, generator=g) / 8
    w[1:40] = w[0] + 3e-3 * torch.randn(39, 64, generator=g)  # within bfloat16 rounding of each other
    w[41:45] = w[40]  # exact ties: the lowest id must win
    w = w.bfloat16()
    screen = Int8Screen.from_weight(w)
    rows = min(rows, sh.max_screened_rows(dtype=torch.bfloat16))
    for trial in range(40):
        x = torch.randn(rows, 64, generator=g)
        x[-1, 5] = 30  # an outlier channel
        x[0] = w[trial % 45].float() * 20  # the near-tied rows are the top ones
        x = x.bfloat16()
        full = csg.kernel_linear_bf16(x.contiguous(), w)
        top = screen.top1_logits(x)
        assert top.dtype == torch.bfloat16
        assert torch.equal(top.argmax(-1), full.argmax(-1))
        kept = torch.isfinite(top)
        assert kept.sum(-1).max() < 3000  # it did screen
        assert torch.equal(top[kept], full[kept])


@pytest.mark.parametrize("rows", [1, 3])
def test_bfloat16_tie_made_by_rounding_goes_to_the_lowest_id(bf16_kernel, x_path, rows):
    """Two logits an exact int8 screen tells apart (15.859375 < 15.875, both exact in int8 with step 1/8) round to
    the same bfloat16 value, so the full head's argmax is the lower id, the smaller logit: the screen must keep it."""
    w = torch.zeros(200, 64)
    w[:, 2] = 127 / 8  # every row's int8 step is 1/8: the int8 copy is exact, the error bound tiny
    w[5, :2] = torch.tensor([15.75, 1.75])  # with x below: 15.75 + 1.75 / 16 = 15.859375
    w[9, :2] = torch.tensor([15.875, 0.0])  # 15.875
    w[10:, :2] = (
        torch.randn(190, 2, generator=torch.Generator().manual_seed(0)).clamp(-8, 8).mul(8).round() / 8
    )
    w = w.bfloat16()
    x = torch.zeros(rows, 64)
    x[:, 0], x[:, 1] = 1.0, 1 / 16
    x = x.bfloat16()
    full = csg.kernel_linear_bf16(x, w)
    assert full[0, 5] == full[0, 9] and full.argmax(-1).tolist() == [5] * rows  # the tie, as built
    top = Int8Screen.from_weight(w).top1_logits(x)
    assert top.argmax(-1).tolist() == [5] * rows
    assert torch.isinf(top).any()  # it did screen


def test_bfloat16_greedy_generation_identical_with_and_without_screening(bf16_kernel, monkeypatch):
    """In bfloat16 the screen changes no token: the same run with the full head gives the same output."""
    model = make_tiny_model("llama", layers=4).to(torch.bfloat16)
    ids = prompt_ids(12, model.config.vocab_size)
    calls = []
    real = Int8Screen.top1_logits
    monkeypatch.setattr(Int8Screen, "top1_logits", lambda self, x: calls.append(1) or real(self, x))
    kw = dict(max_new_tokens=40, do_sample=False)
    screened = model.generate(ids, custom_generate=SpeculativeDecoder("pld"), **kw)
    assert calls
    monkeypatch.setenv("HF_SPEC_SCREENED_HEAD", "0")
    assert torch.equal(model.generate(ids, custom_generate=SpeculativeDecoder("pld"), **kw), screened)


def test_screen_rebuilds_when_the_weight_changes(kernel):
    head = torch.nn.Linear(32, 50, bias=False)
    first = sh.screen_for(head)
    assert sh.screen_for(head) is first
    with torch.no_grad():
        head.weight.mul_(2)
    assert sh.screen_for(head) is not first


def test_screening_applies_only_where_the_argmax_is_all_that_is_read(kernel, monkeypatch):
    model = make_tiny_model("llama")
    assert screening_applies(model, False, False, False)
    assert not screening_applies(model, True, False, False)  # sampling reads the distribution
    assert not screening_applies(model, False, True, False)  # logits processors
    assert not screening_applies(model, False, False, True)  # output_scores / output_logits
    half = make_tiny_model("llama").to(
        torch.bfloat16
    )  # screened where the bf16 kernel rescores the candidates
    for flag in ("0", "1"):  # whichever path runs the full head
        monkeypatch.setenv("HF_SPEC_BF16_KERNEL", flag)
        assert screening_applies(half, False, False, False) == csg.has_bf16()
    monkeypatch.setattr(csg, "has_bf16", lambda: False)
    assert not screening_applies(half, False, False, False)
    monkeypatch.undo()
    assert not screening_applies(make_tiny_model("llama").to(torch.float16), False, False, False)
    monkeypatch.setenv("HF_SPEC_SCREENED_HEAD", "0")
    assert not screening_applies(model, False, False, False)


def test_screened_head_only_answers_its_own_thread(kernel):
    model = make_tiny_model("qwen2")
    head = model.get_output_embeddings()
    x = torch.randn(1, 3, 32)
    seen = {}
    with torch.no_grad(), screened_lm_head(model):
        seen["own"] = head(x)
        worker = threading.Thread(target=lambda: seen.__setitem__("other", head(x)))
        worker.start()
        worker.join()
    assert torch.isinf(seen["own"]).any()  # screened: -inf off the candidates
    assert torch.isfinite(seen["other"]).all()  # another thread (an async drafter) gets the full head
    assert "forward" not in head.__dict__


@pytest.mark.parametrize("method", ["oracle:5", "oracle:12", "pld", "early-exit:2"])
def test_greedy_generation_identical_with_and_without_screening(kernel, monkeypatch, method):
    model = make_tiny_model("llama", layers=4)
    ids = prompt_ids(12, model.config.vocab_size)
    calls = []
    real = Int8Screen.top1_logits

    def counted(self, x):
        out = real(self, x)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(Int8Screen, "top1_logits", counted)
    monkeypatch.setattr(sh, "INT8_X_MIN_WEIGHTS", 0)  # x in int8 too where the CPU can (a tiny head)
    kw = dict(max_new_tokens=40, do_sample=False)
    ref = model.generate(ids, **kw)
    screened = model.generate(ids, custom_generate=SpeculativeDecoder(method), **kw)
    assert any(calls), "the loop should have screened some verification"
    monkeypatch.setenv("HF_SPEC_SCREENED_HEAD", "0")
    calls.clear()
    full = model.generate(ids, custom_generate=SpeculativeDecoder(method), **kw)
    assert not calls
    assert torch.equal(screened, ref) and torch.equal(full, ref)


class _NoDrafts(Drafter):
    """Proposes nothing: every round is a plain one-row step of the loop."""

    def propose(self, state, max_depth: int) -> DraftTree:
        return DraftTree.empty()


def test_rounds_without_a_draft_use_the_kernels_and_the_screen(kernel, monkeypatch):
    """A round whose tree is empty (pld or retrieval without a match) is a one-row step: it ran on the stock
    float32 linears until session 22 (~2x a kernel step on an AMD EPYC)."""
    model = make_tiny_model("llama", layers=2)
    ids = prompt_ids(12, model.config.vocab_size)
    rows = {"kernel": [], "screen": []}
    real_linear, real_top1 = sl.skinny_linear, Int8Screen.top1_logits
    monkeypatch.setattr(
        sl, "skinny_linear", lambda x, w, b=None: rows["kernel"].append(x.shape[-2]) or real_linear(x, w, b)
    )
    monkeypatch.setattr(
        Int8Screen, "top1_logits", lambda self, x: rows["screen"].append(x.shape[-2]) or real_top1(self, x)
    )
    kw = dict(max_new_tokens=6, do_sample=False)
    out = model.generate(ids, custom_generate=SpeculativeDecoder(_NoDrafts(MethodConfig(), model)), **kw)
    assert torch.equal(out, model.generate(ids, **kw))
    assert rows["screen"] == [1] * 6  # one screened row a round
    assert rows["kernel"].count(1) >= 6 * 2 * 7  # every linear of both layers, every round


def test_non_finite_rows_fall_back_to_the_full_head(kernel):
    w, _, _ = _quantized(300, 32)
    screen = Int8Screen.from_weight(w)
    x = torch.randn(2, 32)
    x[1, 5] = float("nan")
    assert screen.top1_logits(x) is None
    assert screen.top1_logits(torch.randn(sh.max_screened_rows() + 1, 32)) is None  # more rows than pay
