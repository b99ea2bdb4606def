"""One shared tester over every registered method and two tiny architectures: greedy output must equal plain
`generate` token for token."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, WatermarkingConfig
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_spec import SpeculativeDecoder, list_methods
from hf_spec.core.registry import get_method
from hf_spec.core.specs import parse_method
from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.draft_model.drafter import DraftModelDrafter
from hf_spec.methods.eagle import EagleConfig, EagleDrafter
from hf_spec.methods.eagle.modeling import EagleHeadConfig, EagleHeadModel
from hf_spec.methods.lyanna import LyannaConfig, LyannaDrafter
from hf_spec.methods.lyanna.modeling import LyannaHeadConfig, LyannaHeadModel
from hf_spec.methods.pld.ngram_matcher import find_continuations, first_continuation
from tests.conftest import CACHE, make_tiny_model, prompt_ids

METHOD_SPECS = [
    "pld",
    "pld:3",
    "early-exit:1",
    "early-exit:3",
    "oracle:6",
    "draft-model",
    "eagle",
    "eagle3",
    "lyanna",
    "retrieval",
    "talon",
    "hispec",
    "postuse:early-exit:2",
]


def decoder_for(spec: str, model) -> SpeculativeDecoder:
    if spec == "draft-model":
        draft = make_tiny_model("llama", seed=5, layers=2).to(model.device)
        return SpeculativeDecoder(
            DraftModelDrafter(DraftModelConfig(num_draft_tokens=4, siblings=2), model, draft_model=draft)
        )
    if spec == "eagle":  # an untrained head: drafts are poor, the output must still be exact
        torch.manual_seed(0)
        head = EagleHeadModel(EagleHeadConfig.for_target(model, 64))
        head.init_layer_from(model)
        return SpeculativeDecoder(
            EagleDrafter(EagleConfig(depth=3, topk=3, total_tokens=8), model, head=head)
        )
    if spec == "eagle3":  # an untrained EAGLE-3 head reading the states entering layers 1, 2 and 3
        from hf_spec.methods.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, Eagle3HeadConfig

        torch.manual_seed(0)
        head = Eagle3Head(Eagle3HeadConfig.for_target(model, 64, hidden_state_indices=(1, 2, 3)))
        return SpeculativeDecoder(
            Eagle3Drafter(Eagle3Config(depth=3, topk=3, total_tokens=8), model, head=head)
        )
    if spec == "lyanna":  # an untrained head, re-sampling fused
        torch.manual_seed(0)
        head = LyannaHeadModel(LyannaHeadConfig.for_target(model, 64, token_info_rank=8))
        return SpeculativeDecoder(LyannaDrafter(LyannaConfig(depth=4, topk=3, budget=8), model, head=head))
    return SpeculativeDecoder(spec)


def test_every_registered_method_is_covered():
    assert {s.split(":")[0] for s in METHOD_SPECS} == set(list_methods())


@pytest.mark.parametrize("spec", METHOD_SPECS)
@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_equals_generate(tiny_model, spec, seed):
    ids = prompt_ids(14, seed=seed)
    ref = tiny_model.generate(ids, max_new_tokens=40, do_sample=False)
    dec = decoder_for(spec, tiny_model)
    out = tiny_model.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert torch.equal(out, ref)
    assert dec.last_stats.new_tokens == ref.shape[1] - ids.shape[1]


@pytest.mark.parametrize("spec", METHOD_SPECS)
def test_passed_in_cache_of_a_prefix_or_the_whole_prompt(tiny_llama, spec):
    """`past_key_values` holding a prefix (prompt caching) or the whole prompt continues as transformers does;
    head drafters start at the first position the call prefills."""
    ids = prompt_ids(14, seed=1)
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)
    for cached in (6, 14):
        cache = DynamicCache(config=tiny_llama.config)
        with torch.no_grad():
            tiny_llama(ids[:, :cached], **{CACHE: cache})
        dec = decoder_for(spec, tiny_llama)
        out = tiny_llama.generate(
            ids, **{CACHE: cache}, max_new_tokens=30, do_sample=False, custom_generate=dec
        )
        assert torch.equal(out, ref), cached
        assert dec.last_stats.new_tokens == 30


def test_cache_longer_than_the_prompt_is_refused(tiny_llama):
    ids = prompt_ids(14, seed=1)
    cache = DynamicCache(config=tiny_llama.config)
    with torch.no_grad():
        tiny_llama(ids, **{CACHE: cache})
    with pytest.raises(ValueError, match="the cache holds 14 tokens but the prompt only 10"):
        tiny_llama.generate(
            ids[:, :10], **{CACHE: cache}, max_new_tokens=5, custom_generate=SpeculativeDecoder("pld")
        )


@pytest.mark.parametrize("spec", ["pld", "early-exit:2", "oracle:5"])
def test_greedy_with_logits_processors_equals_generate(tiny_llama, spec):
    """Repetition penalty and no-repeat n-grams depend on the prefix: applied per tree path."""
    ids = prompt_ids(10, seed=3)
    kw = dict(max_new_tokens=40, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=3)
    ref = tiny_llama.generate(ids, **kw)
    assert torch.equal(tiny_llama.generate(ids, custom_generate=SpeculativeDecoder(spec), **kw), ref)


GENERATION_OPTIONS = {
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8], [11, 12, 13]]),
    "suppress_tokens": dict(suppress_tokens=[3, 4, 9]),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[3, 4, 9]),
    "sequence_bias": dict(sequence_bias={(5,): -10.0, (7, 8): 5.0}),
    "forced_bos_token_id": dict(forced_bos_token_id=4),
    "forced_eos_token_id": dict(forced_eos_token_id=2, max_new_tokens=25),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(5, 1.5), eos_token_id=2),
    "min_new_tokens": dict(min_new_tokens=30, eos_token_id=2),
    "renormalize_logits": dict(renormalize_logits=True, repetition_penalty=1.2),
    "eos_token_id list": dict(eos_token_id=[2, 17, 23]),
    "watermarking_config": dict(watermarking_config=WatermarkingConfig(bias=2.5, seeding_scheme="lefthash")),
}


@pytest.mark.parametrize("spec", ["pld", "oracle:5"])
@pytest.mark.parametrize("option", list(GENERATION_OPTIONS))
def test_greedy_with_generation_options_equals_generate(tiny_llama, spec, option):
    """Every logits processor `generate` builds from its options sees each tree path's own prefix and length."""
    ids = prompt_ids(10, seed=3)
    kw = {"max_new_tokens": 40, "do_sample": False, **GENERATION_OPTIONS[option]}
    ref = tiny_llama.generate(ids, **kw)
    out = tiny_llama.generate(ids, custom_generate=SpeculativeDecoder(spec), **kw)
    assert torch.equal(out, ref)
    if option == "forced_eos_token_id":
        assert out.shape[1] == ids.shape[1] + 25 and int(out[0, -1]) == 2


def test_max_time_stops_generation(tiny_llama):
    """`max_time` (transformers' MaxTimeCriteria) ends a generation that would otherwise run far longer."""
    ids = prompt_ids(10, seed=3)
    start = time.perf_counter()
    out = tiny_llama.generate(
        ids, max_new_tokens=100_000, max_time=0.2, do_sample=False, custom_generate=SpeculativeDecoder("pld")
    )
    assert time.perf_counter() - start < 30
    assert 0 < out.shape[1] - ids.shape[1] < 100_000


def test_real_stories_model_all_methods(stories):
    model, tok = stories
    ids = tok("Once upon a time, there was a little girl named Lily", return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=64, do_sample=False)
    for spec in ["pld", "early-exit:2", "oracle:8"]:
        dec = SpeculativeDecoder(spec)
        assert torch.equal(
            model.generate(ids, max_new_tokens=64, do_sample=False, custom_generate=dec), ref
        ), spec
    assert dec.last_stats.tau > 4  # the oracle accepts everything


def test_oracle_accepts_everything_greedy(tiny_llama):
    ids = prompt_ids(10, seed=4)
    dec = SpeculativeDecoder("oracle:4")
    tiny_llama.generate(ids, max_new_tokens=40, do_sample=False, custom_generate=dec)
    assert dec.last_stats.accepted_tokens == dec.last_stats.draft_tokens
    assert dec.last_stats.tau == pytest.approx(5.0, abs=0.2)


def brute_continuations(tokens, max_ngram, min_ngram, length, max_candidates):
    tokens = list(tokens)
    found = []
    for n in range(max_ngram, min_ngram - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                cont = tokens[start + n : start + n + length]
                if cont not in found:
                    found.append(cont)
                if len(found) == max_candidates:
                    return found
    return found


@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=40),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(1, 5),
)
@settings(max_examples=300, deadline=None)
def test_ngram_matcher_against_brute_force(tokens, max_ngram, min_ngram, length, max_candidates):
    min_ngram = min(min_ngram, max_ngram)
    got, _ = find_continuations(np.array(tokens), max_ngram, min_ngram, length, max_candidates)
    assert got == brute_continuations(tokens, max_ngram, min_ngram, length, max_candidates)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 4), st.integers(1, 6))
@settings(max_examples=300, deadline=None)
def test_first_continuation_equals_transformers_prompt_lookup(tokens, max_ngram, length):
    """The candidate `prompt_lookup_num_tokens` would draft (transformers' own generator is the reference)."""
    ids = torch.tensor([tokens])
    generator = PromptLookupCandidateGenerator(
        num_output_tokens=length, max_matching_ngram_size=max_ngram, max_length=10**6
    )
    candidate, _ = generator.get_candidates(ids)
    assert first_continuation(np.array(tokens), max_ngram, length) == candidate[0, len(tokens) :].tolist()


def test_early_exit_default_layer_is_three_quarters_of_depth(tiny_llama):
    drafter = SpeculativeDecoder("early-exit").drafter_for(tiny_llama)
    assert drafter.exit_layer == 3  # 4 layers
    assert SpeculativeDecoder("early-exit:1").drafter_for(tiny_llama).exit_layer == 1


CONFIGS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"


def _check_files(data: dict, where: str) -> None:
    for key in ("head", "exit_heads", "q_table"):
        if data.get(key):
            assert Path(data[key]).exists(), (where, key, data[key])


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS_DIR.glob("*.json") if "qtable" not in p.name))
def test_committed_bench_configs_parse(name, monkeypatch):
    """Every config behind a figure is a valid method config, and the files it names (heads, exit heads,
    Q-tables, a wrapped drafter's config) exist."""
    monkeypatch.chdir(CONFIGS_DIR)  # paths in the configs are relative to their folder
    data = json.loads((CONFIGS_DIR / name).read_text())
    assert parse_method(str(CONFIGS_DIR / name)).method == data["method"]
    _check_files(data, name)
    inner = data.get("drafter")
    if isinstance(inner, dict):  # postuse around a drafter given inline
        get_method(inner["method"]).config_cls.from_dict(inner)
        _check_files(inner, f"{name}: drafter")
    elif isinstance(inner, str) and inner.endswith(".json"):  # talon/postuse around a drafter config file
        _check_files(json.loads(Path(inner.partition(":")[2]).read_text()), f"{name}: drafter")
        parse_method(inner)
