"""The `triton` backend in the loop, under Triton's interpreter on CPU tensors (`HF_SPEC_BACKEND=triton`): greedy
output identical to the torch backend's on every method, sampling keeps the target distribution, one device read
per greedy round, head folders loaded through `custom_generate` (a local folder and a fake Hub cache), the choice
of backend, and that the CPU path never imports triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # conftest.py sets it where torch sees no GPU
    pytest.skip(
        "the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1)",
        allow_module_level=True,
    )

from hf_spec import SpeculativeDecoder  # noqa: E402
from hf_spec.engine import backend as backend_module  # noqa: E402
from hf_spec.engine.backend import CpuBackend, TorchBackend, TritonBackend, backend_for  # noqa: E402
from hf_spec.engine.target.profile import target_profile  # noqa: E402
from tests.conftest import make_tiny_model, prompt_ids  # noqa: E402
from tests.test_methods import METHOD_SPECS, decoder_for  # noqa: E402
from tests.test_round_engine import FixedTreeDrafter, counting_host_reads  # noqa: E402

# what CI runs: a chain, a head's dynamic tree (draft top-k, compaction of a branching tree), token-info trees
CI_SPECS = ["oracle:6", "eagle", "lyanna"]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("HF_SPEC_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Calls of the triton backend's round work during the test, by method name."""
    calls: dict[str, int] = {}
    for name in ("accept", "compact_cache", "tree_inputs", "draft_topk", "token_info_topk"):
        real = getattr(TritonBackend, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(TritonBackend, name, spy)
    return calls


def greedy_pair(model, spec: str, seed: int, new: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    ids = prompt_ids(14, seed=seed)
    ref = model.generate(ids, max_new_tokens=new, do_sample=False)
    out = model.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=decoder_for(spec, model))
    return out, ref


@pytest.mark.parametrize("spec", CI_SPECS)
def test_greedy_with_the_triton_backend_equals_generate(triton_backend, kernel_calls, tiny_llama, spec):
    out, ref = greedy_pair(tiny_llama, spec, seed=1, new=16)
    assert torch.equal(out, ref)
    assert isinstance(target_profile(tiny_llama).backend, TritonBackend)
    assert kernel_calls["accept"] > 0
    if spec != "oracle:6":  # chains are cropped, not compacted, and need no tree mask
        assert kernel_calls["compact_cache"] > 0 and kernel_calls["tree_inputs"] > 0
    if spec == "eagle":
        assert kernel_calls["draft_topk"] > 0
    if spec == "lyanna":
        assert kernel_calls["token_info_topk"] > 0


def test_static_cache_with_the_triton_backend_compacts_in_place(triton_backend, kernel_calls, tiny_llama):
    """The compaction kernel moves the accepted path inside a static cache's buffers (no reallocation)."""
    ids = prompt_ids(14, seed=2)
    ref = tiny_llama.generate(ids, max_new_tokens=16, do_sample=False)
    out = tiny_llama.generate(
        ids, max_new_tokens=16, do_sample=False, cache_implementation="static",
        custom_generate=decoder_for("eagle", tiny_llama),
    )  # fmt: skip
    assert torch.equal(out, ref)
    assert kernel_calls["compact_cache"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", METHOD_SPECS)
@pytest.mark.parametrize("seed", [1, 2])
def test_every_method_with_the_triton_backend_equals_generate(triton_backend, tiny_model, spec, seed):
    out, ref = greedy_pair(tiny_model, spec, seed)
    assert torch.equal(out, ref)


@pytest.mark.slow
def test_stories_with_the_triton_backend_equals_generate(triton_backend, stories):
    model, tok = stories
    ids = tok("Once upon a time, there was a little girl named Lily", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    for spec in ("pld", "early-exit:2", "oracle:8"):
        out = model.generate(
            ids, max_new_tokens=32, do_sample=False, custom_generate=SpeculativeDecoder(spec)
        )
        assert torch.equal(out, ref), spec
    assert isinstance(target_profile(model).backend, TritonBackend)


@pytest.mark.slow
def test_bfloat16_with_the_triton_backend_matches_the_torch_backend(monkeypatch, tiny_llama):
    """In bfloat16 a tree forward and a one-token forward round differently, so the comparison is with the torch
    backend running the same trees: the kernels change no committed token."""
    target = make_tiny_model("llama").to(torch.bfloat16)
    outs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("HF_SPEC_BACKEND", name)
        outs[name] = [greedy_pair(target, spec, seed=3)[0] for spec in ("pld", "eagle", "lyanna")]
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert torch.equal(a, b)


def test_eos_inside_the_tree_stops_where_generate_stops(triton_backend, tiny_llama):
    """The oracle's chain runs through the EOS token: the round commits up to it and no further."""
    ids = prompt_ids(14, seed=2)
    full = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    eos = int(full[0, ids.shape[1] + 7])  # the 8th new token
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    dec = SpeculativeDecoder("oracle:12")
    out = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, custom_generate=dec)
    assert torch.equal(out, ref) and int(out[0, -1]) == eos


def test_greedy_round_reads_the_device_once(triton_backend, tiny_llama):
    """Host reads per round do not grow with the tree (as with the torch backend, `tests/test_round_engine.py`),
    and acceptance is one of them."""
    ids = torch.tensor([[1, 5, 9, 14, 5, 9]])
    reference = tiny_llama.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist()
    per_size = {}
    for size in (4, 24):
        counts: list[int] = []
        drafter = FixedTreeDrafter(tiny_llama, reference, size, depth=3)
        with counting_host_reads(counts):
            out = tiny_llama.generate(
                ids, max_new_tokens=16, do_sample=False, custom_generate=SpeculativeDecoder(drafter)
            )
        assert out[0].tolist() == reference
        per_size[size] = counts[1:-1]
    assert max(c for counts in per_size.values() for c in counts) <= 8, per_size
    assert max(per_size[4]) == max(per_size[24]), per_size


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 2])
def test_loop_sampling_with_the_triton_backend_matches_plain_sampling(triton_backend, width):
    """`tests/test_sampling.py`'s chi-square through the whole loop, accepted by the sampling kernel (temperature
    and top-p are row-wise: every row is processed at once)."""
    from tests.stats import sampled_marginals_pvalues
    from tests.test_sampling import SampledTreeDrafter, V

    target = make_tiny_model("llama", seed=11, vocab_size=V, layers=2, temperature=2.0)
    draft = make_tiny_model("llama", seed=12, vocab_size=V, layers=1, temperature=2.0)
    decoder = SpeculativeDecoder(SampledTreeDrafter(target, draft, width))
    pvalues, accepted = sampled_marginals_pvalues(target, lambda: decoder, "hf-spec", n=1500, seed=2024)
    assert accepted > 1500 * 0.3
    assert min(pvalues) > 1e-3, pvalues


def test_sampling_with_a_prefix_dependent_processor_keeps_the_host_rule(
    triton_backend, kernel_calls, tiny_llama
):
    """A repetition penalty sees each path's own prefix: the backend declines and the host rule runs (the same
    tokens as the torch backend from the same seed)."""
    ids = prompt_ids(10, seed=4)
    kw = dict(max_new_tokens=20, do_sample=True, repetition_penalty=1.3, top_k=0)
    torch.manual_seed(5)
    out = tiny_llama.generate(ids, custom_generate=SpeculativeDecoder("pld"), **kw)
    os.environ["HF_SPEC_BACKEND"] = "torch"
    torch.manual_seed(5)
    ref = tiny_llama.generate(ids, custom_generate=SpeculativeDecoder("pld"), **kw)
    assert torch.equal(out, ref) and kernel_calls["accept"] > 0


# ---- choosing the backend ---------------------------------------------------------------------------------
def test_backend_choice(monkeypatch):
    assert isinstance(backend_for("cpu"), CpuBackend)
    assert type(backend_for("cuda")) is TorchBackend  # no CUDA device here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert isinstance(backend_for("cuda"), TritonBackend)  # a GPU, and triton is installed
    assert isinstance(backend_for("mps"), TorchBackend)
    assert isinstance(backend_for("cpu", "triton"), TritonBackend)  # under the interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        backend_for("cpu", "triton")
    monkeypatch.setattr(backend_module, "triton_available", lambda: False)
    assert isinstance(backend_for("cuda"), TorchBackend)
    with pytest.raises(ValueError, match=r"needs the triton package"):
        backend_for("cuda", "triton")
    with pytest.raises(ValueError, match="HF_SPEC_BACKEND must be one of"):
        backend_for("cuda", "cuda-graphs")


def test_cpu_path_never_imports_triton():
    """A fresh process in which triton cannot be imported decodes with a tree, a head and sampling on the CPU,
    and no module of `hf_spec.kernels.triton` is loaded. (triton itself may be imported by other packages where it
    is installed: transformers imports torchao's quantizer, which imports triton.)"""
    code = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError; find_spec finds nothing
from tests.conftest import make_tiny_model, prompt_ids
from tests.test_methods import decoder_for
model = make_tiny_model("llama")
for spec in ("pld", "lyanna"):
    model.generate(prompt_ids(12), max_new_tokens=8, do_sample=False, custom_generate=decoder_for(spec, model))
model.generate(prompt_ids(12), max_new_tokens=8, do_sample=True, custom_generate=decoder_for("pld", model))
loaded = sorted(m for m in sys.modules if m.startswith("hf_spec.kernels.triton"))
assert not loaded, loaded
"""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_SPEC_BACKEND", "TRITON_INTERPRET")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# ---- head folders carry what runs them --------------------------------------------------------------------
@pytest.fixture
def head_folder(tmp_path):
    """`(target, folder)`: an EAGLE head folder whose own recipe names the head "." (as published heads do)."""
    from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
    from hf_spec.heads.hub import save_head_folder
    from hf_spec.methods.eagle import EagleConfig
    from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel

    target = make_tiny_model("qwen2", temperature=16.0)
    torch.manual_seed(0)
    head = EagleHeadModel(EagleHeadConfig.for_target(target, 64)).attach_target(target)
    head.init_layer_from(target)
    recipe = EagleConfig(head=HEAD_IN_THIS_FOLDER, depth=3, topk=2)
    return target, save_head_folder(head, tmp_path / "head", recipe, "card")


def test_head_folder_requirements_name_hf_spec_and_triton(head_folder, tmp_path):
    import shutil

    from transformers.dynamic_module_utils import check_python_requirements

    from hf_spec.integrations import save_custom_generate

    recipe = save_custom_generate(tmp_path / "recipe", "pld")
    for folder in (head_folder[1], recipe):
        requirements = folder / "custom_generate" / "requirements.txt"
        lines = requirements.read_text().splitlines()
        assert lines[0].startswith("hf-spec")  # what transformers checks; the rest are comments
        assert all(line.startswith("#") for line in lines[1:]) and "triton" in "".join(lines[1:])
        # transformers' own check, as `generate(custom_generate=...)` runs it: met where hf-spec is installed ...
        check_python_requirements(str(folder), requirements_file="custom_generate/requirements.txt")
    unmet = shutil.copytree(recipe, tmp_path / "unmet")  # ... and read: a version not installed is refused
    (unmet / "custom_generate" / "requirements.txt").write_text("hf-spec>=999\n")
    with pytest.raises(ImportError, match="hf-spec>=999"):
        check_python_requirements(str(unmet), requirements_file="custom_generate/requirements.txt")


@pytest.mark.parametrize("where", ["folder", "hub"])
def test_head_folder_runs_the_triton_kernels_and_the_cpu_backend(
    head_folder, hub_cache, monkeypatch, kernel_calls, where
):
    """`generate(custom_generate=<folder or Hub id>, trust_remote_code=True)` runs the folder's remote code: with the
    triton backend (CUDA's default; forced here under the interpreter) its kernels accept and compact; without it
    the same folder runs the CPU backend. Both give plain `generate`'s tokens."""
    from tests.fake_hub import cache_repo

    target, folder = head_folder
    source = str(folder)
    if where == "hub":
        cache_repo(hub_cache, "org/gpu-head", folder)
        source = "org/gpu-head"
    ids = prompt_ids(12, seed=3)
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    kw = dict(max_new_tokens=10, do_sample=False, custom_generate=source, trust_remote_code=True)
    assert torch.equal(target.generate(ids, **kw), ref)
    assert isinstance(target_profile(target).backend, CpuBackend) and not kernel_calls
    monkeypatch.setenv("HF_SPEC_BACKEND", "triton")
    assert torch.equal(target.generate(ids, **kw), ref)
    assert isinstance(target_profile(target).backend, TritonBackend)
    assert kernel_calls["accept"] > 0 and kernel_calls["draft_topk"] > 0


def test_head_folder_on_a_cuda_target_runs_the_triton_kernels_by_default(
    head_folder, hub_cache, monkeypatch, kernel_calls
):
    """No HF_SPEC_BACKEND: a target whose weights sit on CUDA (its placement says so here; the tensors stay on the
    CPU, under the interpreter) runs a Hub id's remote code with the triton backend, hf-spec's default there."""
    import dataclasses

    from hf_spec.engine.target import profile
    from tests.fake_hub import cache_repo

    target, folder = head_folder
    cache_repo(hub_cache, "org/gpu-head", folder)
    ids = prompt_ids(12, seed=5)
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    real = profile.target_placement
    monkeypatch.delenv("HF_SPEC_BACKEND", raising=False)
    monkeypatch.setattr(
        profile, "target_placement", lambda m: dataclasses.replace(real(m), devices=("cuda:0",))
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kw = dict(max_new_tokens=10, do_sample=False, custom_generate="org/gpu-head", trust_remote_code=True)
    assert torch.equal(target.generate(ids, **kw), ref)
    assert isinstance(target_profile(target).backend, TritonBackend)
    assert kernel_calls["accept"] > 0 and kernel_calls["draft_topk"] > 0
