"""The loop on a real GPU: skipped where torch sees no CUDA device (CI), run on a GPU machine with

    pytest -m gpu tests/test_cuda.py

Greedy output of every method equal to plain `generate` on CUDA with both backends (the Triton kernels, hf-spec's
default there, and plain torch), padded batches, the real stories260K model, bfloat16 kernels changing no token,
one device read per greedy round, and the loop's sampling chi-square with the sampling kernel."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from hf_spec import SpeculativeDecoder  # noqa: E402
from hf_spec.engine.backend import TorchBackend, TritonBackend, triton_available  # noqa: E402
from hf_spec.engine.target.profile import target_profile  # noqa: E402
from tests.conftest import assert_equal_up_to_ties, make_tiny_model, prompt_ids  # noqa: E402
from tests.test_methods import METHOD_SPECS, decoder_for  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BACKENDS = ["triton", "torch"] if triton_available() else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    monkeypatch.setenv("HF_SPEC_BACKEND", request.param)
    return request.param


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def cuda_model(request):
    return make_tiny_model(request.param).to(CUDA)


def check_backend(model, backend: str) -> None:
    expected = TritonBackend if backend == "triton" else TorchBackend
    assert type(target_profile(model).backend) is expected


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_every_method_greedy_equals_generate_on_cuda(cuda_model, backend, spec):
    for seed in (1, 2):
        ids = prompt_ids(14, seed=seed).to(CUDA)
        ref = cuda_model.generate(ids, max_new_tokens=40, do_sample=False)
        dec = decoder_for(spec, cuda_model)
        out = cuda_model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
        assert out.device.type == "cuda"
        assert_equal_up_to_ties(cuda_model, ids, out, ref)  # float32 on a GPU: cuBLAS may round by row count
    check_backend(cuda_model, backend)


@pytest.mark.parametrize("spec", ["pld:3", "eagle3"])
def test_compiled_rounds_equal_generate_on_cuda(spec):
    """`compile=True` on CUDA (CUDA graphs): the padded verification masks (-inf past the block) and, for EAGLE-3,
    the compiled head steps give plain `generate`'s tokens, every round compiled."""
    from transformers import CompileConfig

    model = make_tiny_model("llama").to(CUDA)
    ids = prompt_ids(14, seed=1).to(CUDA)
    ref = model.generate(ids, max_new_tokens=24, do_sample=False)
    dec = decoder_for(spec, model)
    dec.compile = True
    out = model.generate(
        ids,
        max_new_tokens=24,
        do_sample=False,
        custom_generate=dec,
        compile_config=CompileConfig(fullgraph=True),
    )
    assert_equal_up_to_ties(model, ids, out, ref)
    assert dec.last_stats.compiled_rounds == dec.last_stats.target_forwards > 0


def test_triton_is_the_default_backend_on_cuda(monkeypatch):
    monkeypatch.delenv("HF_SPEC_BACKEND", raising=False)
    model = make_tiny_model("llama").to(CUDA)
    model.generate(prompt_ids(8).to(CUDA), max_new_tokens=4, custom_generate=SpeculativeDecoder("pld"))
    check_backend(model, "triton" if triton_available() else "torch")


@pytest.mark.parametrize("spec", ["pld", "retrieval", "oracle:8", "early-exit:2"])
def test_padded_batch_equals_batched_generate_on_cuda(cuda_model, backend, spec):
    from tests.test_rows import PAD, batch_of_three

    ids, mask = (t.to(CUDA) for t in batch_of_three())
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    ref = cuda_model.generate(ids, **kwargs)
    out = cuda_model.generate(ids, **kwargs, custom_generate=SpeculativeDecoder(spec, batches="auto"))
    assert torch.equal(out, ref)


def test_stories_greedy_equals_generate_on_cuda(stories, backend):
    model, tok = stories
    model = model.to(CUDA)
    try:
        ids = tok("Once upon a time, there was a little girl named Lily", return_tensors="pt").input_ids.to(
            CUDA
        )
        ref = model.generate(ids, max_new_tokens=48, do_sample=False)
        for spec in ("pld", "retrieval", "early-exit:2", "oracle:8", "hispec"):
            out = model.generate(
                ids, max_new_tokens=48, do_sample=False, custom_generate=SpeculativeDecoder(spec)
            )
            assert_equal_up_to_ties(model, ids, out, ref)
        check_backend(model, backend)
    finally:
        model.to("cpu")  # the session fixture stays on the CPU for other tests


def test_bfloat16_kernels_change_no_token(monkeypatch):
    """In bfloat16 a tree forward rounds differently from a one-token forward, so the triton backend is compared
    with the torch backend running the same trees."""
    if not triton_available():
        pytest.skip("triton is not installed")
    target = make_tiny_model("llama").to(CUDA, torch.bfloat16)
    outs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_SPEC_BACKEND", name)
        outs[name] = []
        for spec in ("pld", "eagle", "eagle3", "lyanna"):
            ids = prompt_ids(14, seed=3).to(CUDA)
            dec = decoder_for(spec, target)
            outs[name].append(target.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec))
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert torch.equal(a, b)


def test_greedy_round_reads_the_device_once_on_cuda(backend):
    from tests.test_round_engine import FixedTreeDrafter, counting_host_reads

    model = make_tiny_model("llama").to(CUDA)
    ids = torch.tensor([[1, 5, 9, 14, 5, 9]], device=CUDA)
    reference = model.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist()
    counts: list[int] = []
    drafter = FixedTreeDrafter(model, reference, 24, depth=3)
    with counting_host_reads(counts):
        out = model.generate(
            ids, max_new_tokens=16, do_sample=False, custom_generate=SpeculativeDecoder(drafter)
        )
    assert out[0].tolist() == reference
    assert max(counts[1:-1]) <= 8, counts


@pytest.mark.parametrize(("loop", "n"), [("hf-spec", 600), ("batched", 1500)])
def test_loop_sampling_keeps_the_target_distribution_on_cuda(backend, loop, n):
    """`tests/test_sampling.py`'s chi-square through the whole loop on CUDA (the sampling kernel accepts with the
    triton backend)."""
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import SampledTreeDrafter, V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0).to(CUDA)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0).to(CUDA)
    decoder = SpeculativeDecoder(SampledTreeDrafter(target, draft, 2))
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: decoder, loop, n=n, seed=2024)
    assert accepted > n * 0.3
    assert min(pvalues) > 1e-3, pvalues
