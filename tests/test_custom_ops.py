"""hf-spec's kernels as torch custom operators: `torch.library.opcheck` (schema, fake against real), and compiled
graphs (`fullgraph=True`) that call them through their public entry points with no graph break and the eager result.

The C++ operators need the kernel to build here (skipped where it cannot); the Triton ones run under Triton's
interpreter on CPU tensors (skipped without triton), where they are opaque custom operators with the same fakes as
the `triton_op`s CUDA compiles; `test_triton_ops_compile_with_inductor_on_cuda` checks those on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from hf_spec.kernels import cpu_skinny_gemm as csg
from hf_spec.kernels import ops
from hf_spec.kernels.skinny_linear import skinny_linear


@pytest.fixture
def kernel():
    if csg.load_kernel() is None:
        pytest.skip("the C++ kernel does not build here")


def compiled(fn, graphs: list | None = None, backend: str = "aot_eager"):
    """`torch.compile(fn, fullgraph=True)` on a fresh dynamo; `graphs` (if given) collects dynamo's FX graphs."""
    torch._dynamo.reset()
    counters.clear()
    if graphs is None:
        return torch.compile(fn, fullgraph=True, backend=backend)

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(fn, fullgraph=True, backend=record)


def called_ops(graphs: list) -> set[str]:
    """Names of the `hf_spec` operators the graphs call."""
    return {str(n.target) for g in graphs for n in g.graph.nodes if str(n.target).startswith("hf_spec.")}


def no_graph_breaks() -> bool:
    return not counters["graph_break"]


def _cases() -> dict:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    q = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
    scale = torch.rand(24, generator=g) / 100
    approx = torch.randn(3, 24, generator=g)
    return dict(x=x, w=w, b=b, q=q, scale=scale, approx=approx)


def test_cpp_ops_pass_opcheck(kernel):
    c = _cases()
    bf = c["x"].bfloat16(), c["w"].bfloat16()
    floor = c["approx"].max(dim=1).values - 1.0
    within = (c["approx"], floor, torch.rand(3), torch.rand(3), torch.rand(24), torch.rand(24))
    cases = [
        (ops.skinny_gemm, (c["x"], c["w"], c["b"], csg.ISA_AUTO)),
        (ops.skinny_gemm, (c["x"].view(1, 5, 64), c["w"], None, csg.ISA_SCALAR)),
        (ops.skinny_gemm_bf16, (*bf, c["b"], csg.ISA_SCALAR)),
        (ops.skinny_gemm_int8, (c["x"], c["q"], c["scale"], csg.ISA_AUTO)),
        (ops.select_within, within),
    ]
    if csg.has_vnni():
        xu = torch.randint(0, 256, (5, 64), dtype=torch.uint8)
        qsum = c["q"].sum(dim=1, dtype=torch.int32)
        cases += [
            (ops.skinny_gemm_u8s8, (xu, torch.rand(5), c["q"], qsum, c["scale"])),
            (ops.skinny_gemm_w8a8, (c["x"], c["q"], qsum, c["scale"])),
        ]
    for op, args in cases:
        torch.library.opcheck(op.op, args)
    assert len(cases) >= 5


def test_cpp_entry_points_compile_to_the_ops(kernel):
    """`kernel_linear`, `skinny_linear`, `kernel_linear_int8`, the bf16 kernel and `kernel_select_within` in one
    compiled function: one graph, each kernel one node, the eager values."""
    c = _cases()
    x, w, b = c["x"], c["w"], c["b"]

    def f(x, w, b, q, scale, approx):
        y = csg.kernel_linear(x, w, b)
        z = skinny_linear(x.view(1, 5, 64), w, b)  # 5 fp32 rows: the kernel
        s = csg.kernel_linear_int8(x, q, scale)
        h = csg.kernel_linear_bf16(x.bfloat16(), w.bfloat16(), isa=csg.ISA_SCALAR)
        keep = csg.kernel_select_within(approx, approx.amax(dim=1) - 1.0, b[:3], b[3:6], scale, scale)
        return y, z, s, h, keep

    with torch.no_grad():
        want = f(**c)
        graphs: list = []
        got = compiled(f, graphs)(**c)
    assert no_graph_breaks() and len(graphs) == 1
    assert called_ops(graphs) == {
        "hf_spec.skinny_gemm.default",
        "hf_spec.skinny_gemm_int8.default",
        "hf_spec.skinny_gemm_bf16.default",
        "hf_spec.select_within.default",
    }
    for a, e in zip(got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e)
    torch.testing.assert_close(got[0], F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_disabled_kernel_is_decided_when_the_graph_is_traced(kernel, monkeypatch):
    """With `HF_SPEC_NO_CPP_KERNELS=1` the traced graph holds torch's linear, not the operator."""
    monkeypatch.setenv("HF_SPEC_NO_CPP_KERNELS", "1")
    monkeypatch.setenv("HF_SPEC_MM_TRICK", "0")
    c = _cases()
    graphs: list = []
    with torch.no_grad():
        got = compiled(lambda x, w, b: skinny_linear(x, w, b), graphs)(c["x"], c["w"], c["b"])
    assert no_graph_breaks() and not called_ops(graphs)
    torch.testing.assert_close(got, F.linear(c["x"], c["w"], c["b"]))


def test_weight_only_linear_compiles_to_the_int8_op(kernel):
    """A packed int8 draft linear (`QuantizedWeight.linear`) compiles to the int8 operator (below the VNNI rows)."""
    from hf_spec.kernels.weight_only import QuantizedWeight

    c = _cases()
    packed = QuantizedWeight.from_weight(c["w"], "int8")
    x = c["x"][:2]
    graphs: list = []
    with torch.no_grad():
        want = packed.linear(x, c["b"])
        got = compiled(lambda x, b: packed.linear(x, b), graphs)(x, c["b"])
    assert no_graph_breaks() and "hf_spec.skinny_gemm_int8.default" in called_ops(graphs)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_skinny_linear_compiles_with_inductor(kernel):
    c = _cases()
    with torch.no_grad():
        got = compiled(lambda x, w, b: torch.relu(skinny_linear(x, w, b)), backend="inductor")(
            c["x"], c["w"], c["b"]
        )
    assert no_graph_breaks()
    torch.testing.assert_close(got, torch.relu(F.linear(c["x"], c["w"], c["b"])), rtol=1e-5, atol=1e-5)


# ---- Triton operators ---------------------------------------------------------------------------------------------


@pytest.fixture
def triton_kernels():
    """The kernel modules, with the interpreter on where there is no GPU (the conftest sets it before triton loads)."""
    pytest.importorskip("triton")
    from hf_spec.kernels.triton import (
        draft_topk,
        greedy_accept,
        kv_compact,
        sampling_accept,
        token_info_topk,
        tree_mask,
    )
    from hf_spec.kernels.triton.op import interpreted

    if not torch.cuda.is_available() and not interpreted(greedy_accept._walk):
        pytest.skip("no GPU, and triton was imported without TRITON_INTERPRET=1")

    return dict(
        ga=greedy_accept, sa=sampling_accept, kc=kv_compact, tm=tree_mask, dt=draft_topk, ti=token_info_topk
    )


def _tree(device: str = "cpu"):
    """A 6-node tree whose every node is its parent's argmax in `logits` `(7, 40)`: a long accepted path."""
    parents = torch.tensor([-1, 0, 0, 1, 3, -1], device=device)
    tokens = torch.tensor([5, 9, 11, 3, 7, 2], device=device)
    logits = torch.randn(7, 40, generator=torch.Generator().manual_seed(1)).to(device)
    logits[parents + 1, tokens] = 9.0
    return logits, parents, tokens


def test_triton_ops_pass_opcheck(triton_kernels):
    m = triton_kernels
    logits, parents, tokens = _tree()
    tensors = [torch.randn(1, 2, 12, 8) for _ in range(2)]
    low, w2, scale = torch.randn(3, 4), torch.randn(30, 4), torch.rand(30)
    valid = torch.tensor([1.0, 0.0, 1.0])
    cases = [
        (m["ga"]._greedy_accept, (logits, parents, tokens)),
        (m["ga"]._greedy_accept, (logits[:1], parents[:0], tokens[:0])),
        (m["sa"]._sampling_walk, (logits, parents, tokens, None, torch.rand(6))),
        (m["sa"]._sampling_walk, (logits, parents, tokens, torch.softmax(logits[1:], -1), torch.rand(6))),
        (m["kc"]._kv_compact_op, (tensors, torch.tensor([0, 2, 3]), 4)),
        (m["tm"]._tree_inputs, (parents, 5, torch.float32)),
        (m["dt"]._draft_topk_op, (logits, 3)),
        (m["ti"]._token_info_topk_op, (torch.randn(25), 4, 3, valid, None, low, w2, scale, 1e-12)),
        (
            m["ti"]._token_info_topk_op,
            (torch.randn(25), 4, 3, valid, torch.randn(3, 30), None, None, None, 1e-12),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_triton_entry_points_compile_to_the_ops(triton_kernels):
    """Acceptance, tree inputs and the two top-k kernels through their public functions in one compiled graph:
    each kernel one node, the eager values (and the torch twins')."""
    m = triton_kernels
    logits, parents, tokens = _tree()
    low, w2, scale = torch.randn(3, 4), torch.randn(30, 4), torch.rand(30)
    valid, raw = torch.tensor([1.0, 0.0, 1.0]), torch.randn(25)

    def f(logits, parents, tokens, raw, valid, low, w2, scale):
        packed = m["ga"].greedy_accept(logits, parents, tokens)
        positions, mask = m["tm"].tree_inputs(parents, 5, torch.float32)
        values, indices = m["dt"].draft_topk(logits, 3)
        children = m["ti"].token_info_topk(raw, 4, 3, valid, factors=(low, w2, scale))
        return packed, positions, mask, values, indices, *children

    args = (logits, parents, tokens, raw, valid, low, w2, scale)
    want = f(*args)
    graphs: list = []
    got = compiled(f, graphs)(*args)
    assert no_graph_breaks() and len(graphs) == 1
    assert called_ops(graphs) == {
        "hf_spec.greedy_accept.default",
        "hf_spec.tree_inputs.default",
        "hf_spec.draft_topk.default",
        "hf_spec.token_info_topk.default",
    }
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert torch.equal(got[0], m["ga"].greedy_accept_reference(logits, parents, tokens))
    ref_positions, ref_mask = m["tm"].tree_inputs_reference(parents, 5, torch.float32)
    assert torch.equal(got[1], ref_positions) and torch.equal(got[2], ref_mask)


def test_sampling_accept_compiles_with_the_same_random_numbers(triton_kernels):
    """The uniforms and the bonus draw stay torch ops around the walk operator: a compiled call with the same seed
    takes the same path and bonus as the eager one."""
    sa = triton_kernels["sa"]
    logits, parents, tokens = _tree()
    q = torch.softmax(torch.randn(6, 40, generator=torch.Generator().manual_seed(2)), -1)
    graphs: list = []
    fn = compiled(lambda s, p, t, q: sa.sampling_accept(s, p, t, q), graphs)
    for seed in range(3):
        torch.manual_seed(seed)
        want = sa.sampling_accept(logits, parents, tokens, q)
        torch.manual_seed(seed)
        assert torch.equal(fn(logits, parents, tokens, q), want)
    assert no_graph_breaks() and "hf_spec.sampling_walk.default" in called_ops(graphs)


def test_kv_compact_compiles_to_the_mutating_op(triton_kernels):
    """Compiled (keep as a tensor), the slots move in the caller's tensors, a tensor listed twice moves once."""
    kc = triton_kernels["kc"]
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(1, 2, 14, 8, generator=g) for _ in range(3)]
    want = [t.clone() for t in tensors]
    kc.kv_compact_reference(want, 5, [0, 2, 3, 6])
    graphs: list = []
    compiled(lambda ts, keep: kc.kv_compact(ts, 5, keep), graphs)(
        [*tensors, tensors[0]], torch.tensor([0, 2, 3, 6])
    )
    assert no_graph_breaks() and "hf_spec.kv_compact_.default" in called_ops(graphs)
    for a, e in zip(tensors, want, strict=True):
        assert torch.equal(a, e)
    eager = [t.clone() for t in want]
    kc.kv_compact(eager, 5, torch.tensor([0, 1]))  # eager with a tensor: the operator too
    assert all(torch.equal(a, e) for a, e in zip(eager, want, strict=True))


@pytest.mark.gpu
def test_triton_ops_compile_with_inductor_on_cuda(triton_kernels):
    """On CUDA the operators are `triton_op`s: inductor compiles their kernels into its graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    m = triton_kernels
    logits, parents, tokens = _tree("cuda")
    tensors = [torch.randn(1, 2, 14, 8, device="cuda") for _ in range(2)]
    want_kv = [t.clone() for t in tensors]
    m["kc"].kv_compact_reference(want_kv, 5, [0, 2, 3])

    def f(logits, parents, tokens, tensors, keep):
        m["kc"].kv_compact(tensors, 5, keep)
        return m["ga"].greedy_accept(logits, parents, tokens), *m["tm"].tree_inputs(
            parents, 5, torch.bfloat16
        )

    keep = torch.tensor([0, 2, 3], device="cuda")
    got = compiled(f, backend="inductor")(logits, parents, tokens, tensors, keep)
    assert no_graph_breaks()
    want = (m["ga"].greedy_accept_reference(logits, parents, tokens),
            *m["tm"].tree_inputs_reference(parents, 5, torch.bfloat16))  # fmt: skip
    assert all(torch.equal(a, e) for a, e in zip(got, want, strict=True))
    assert all(torch.equal(a, e) for a, e in zip(tensors, want_kv, strict=True))
