"""Shared fixtures: tiny random targets of two architectures and the real stories260K model."""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernels' tests run them on CPU tensors under Triton's interpreter, chosen when triton is first
    # imported, and transformers may import it (through torchao) below
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config  # noqa: E402

from hf_spec.core.compat import GENERATE_CACHE_KEY, OUTPUT_CACHE_FIELD

# the KV cache's keyword and output field in the installed transformers (`cache` from 5.24, `past_key_values` before)
CACHE, OUTPUT_CACHE = GENERATE_CACHE_KEY, OUTPUT_CACHE_FIELD

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))

FIXTURES = Path(__file__).parent / "fixtures"
STORIES = FIXTURES / "stories260K"


def tiny_fields(vocab_size: int = 96, layers: int = 4) -> dict:
    """Config fields of a tiny random model, shared by every architecture the tests build."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def tiny_config(arch: str, vocab_size: int = 96, layers: int = 4):
    common = tiny_fields(vocab_size, layers)
    return LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)


def make_tiny_model(
    arch: str, seed: int = 0, vocab_size: int = 96, layers: int = 4, temperature: float = 4.0
):
    """A random model whose logits are spread enough to make sampling tests informative but peaked enough that
    greedy paths repeat (so n-gram drafters get matches)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(arch, vocab_size, layers), attn_implementation="sdpa"
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(temperature)
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model(request):
    return make_tiny_model(request.param)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_model("llama")


@pytest.fixture
def attention_calls(monkeypatch) -> list[tuple[torch.nn.Module, int]]:
    """`(attention module, query rows)` of every call to hf-spec's attention functions (grouped attention, and the
    rows kernel's, which draft heads run where it builds) during the test."""
    from hf_spec.kernels import grouped_attention as ga
    from hf_spec.kernels import rows_attention as ra

    calls = []

    def spy_of(real):
        def spy(module, query, *args, **kwargs):
            calls.append((module, query.shape[2]))
            return real(module, query, *args, **kwargs)

        return spy

    monkeypatch.setitem(ga.AttentionInterface._global_mapping, ga.NAME, spy_of(ga.grouped_attention_forward))
    monkeypatch.setitem(
        ga.AttentionInterface._global_mapping, ra.ROWS_ATTENTION, spy_of(ra.rows_attention_forward)
    )
    return calls


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that sets it (the CLIs' `--threads`)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty `$HF_HOME/hub` that the Hub client uses, offline (what HF_HOME and HF_HUB_OFFLINE=1 set when the
    client is imported)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="session")
def stories():
    tok = AutoTokenizer.from_pretrained(STORIES)
    model = AutoModelForCausalLM.from_pretrained(STORIES).eval()
    return model, tok


def prompt_ids(length: int = 12, vocab_size: int = 96, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(3, vocab_size, (1, length - 1), generator=g)
    return torch.cat([torch.ones(1, 1, dtype=torch.long), body], dim=1)


def assert_equal_up_to_ties(model, ids: torch.Tensor, out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Greedy `out` equals `ref` (the model's own greedy generate), or first departs from it where the two
    choices' logits are within the model dtype's numeric noise (`near_tie_threshold`). Returns whether equal."""
    from hf_spec.bench.runner import compare_greedy

    new, want = out[0, ids.shape[1] :].tolist(), ref[0, ids.shape[1] :].tolist()
    verdict = compare_greedy(model, ids, want, new)
    if verdict["lossless"]:
        return True
    at = verdict["diverged_at"]
    assert at < min(len(new), len(want)), "lengths differ without a differing token"
    assert verdict["near_tie"], f"diverged at {at} with a logit gap of {verdict['choice_gap']:.4f}"
    return False


def run_in_bfloat16(model, spec: str, seeds=(1, 2), new: int = 32):
    """A bfloat16 copy of `model` generates greedily with method `spec` and without; the outputs must agree up to
    bfloat16 ties. Returns `(bfloat16 target, decoder)`."""
    from hf_spec import SpeculativeDecoder

    target = copy.deepcopy(model).to(torch.bfloat16)
    dec = SpeculativeDecoder(spec)
    for seed in seeds:
        ids = prompt_ids(12, seed=seed)
        ref = target.generate(ids, max_new_tokens=new, do_sample=False)
        out = target.generate(ids, max_new_tokens=new, do_sample=False, custom_generate=dec)
        assert_equal_up_to_ties(target, ids, out, ref)
    return target, dec


def load_script(name: str):
    """A module of the repository's scripts/ folder (`scripts/<name>.py`), imported from its file."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
