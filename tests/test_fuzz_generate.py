"""Fuzzed greedy generation: drawn generation settings (logits processors, EOS lists, bad words, a padded batch,
prompt lengths) and methods, on tiny models of several architectures; hf-spec's output must be plain `generate`'s
(up to near-ties). Bounded for CI: a fixed, derandomised set of examples."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_spec import SpeculativeDecoder
from tests.conftest import assert_equal_up_to_ties, prompt_ids
from tests.test_architectures import V, build

# architectures the fuzzer draws from; layer-wise drafters (early exit) need the Llama-family layout
ARCHITECTURES = ("llama", "gpt2", "gpt_neox", "phi", "mistral-window")
LLAMA_LAYOUT = {"llama"}  # and no sliding window, which layer-wise drafting may not outgrow
METHODS = ("pld", "oracle:3", "early-exit:2", "pld-rows", "pld-plain")


@functools.cache
def model_of(name: str):
    return build(name)


@functools.cache
def decoder_of(method: str) -> SpeculativeDecoder:
    """One decoder per method for the whole run (as a user keeps one): state carried between calls must not leak
    into the output."""
    spec, _, batches = method.partition("-")
    return SpeculativeDecoder(spec, batches=batches or "auto")


@st.composite
def generations(draw) -> dict:
    arch = draw(st.sampled_from(ARCHITECTURES))
    method = draw(st.sampled_from([m for m in METHODS if arch in LLAMA_LAYOUT or not m.startswith("early")]))
    lengths = draw(st.lists(st.integers(1, 14), min_size=1, max_size=2))
    kwargs: dict = {"max_new_tokens": draw(st.integers(1, 24)), "do_sample": False, "pad_token_id": 0}
    eos = draw(st.sampled_from([None, 2, [2, 17], [5, 9, 33]]))
    kwargs["eos_token_id"] = eos
    if draw(st.booleans()):
        kwargs["repetition_penalty"] = draw(st.sampled_from([1.2, 1.5]))
    if draw(st.booleans()):
        kwargs["no_repeat_ngram_size"] = draw(st.integers(2, 4))
    if draw(st.booleans()):
        kwargs["bad_words_ids"] = draw(st.sampled_from([[[7]], [[11], [40, 41]], [[3, 4, 5]]]))
    if draw(st.booleans()) and eos is not None:
        kwargs["min_new_tokens"] = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 50))
    return {"arch": arch, "method": method, "lengths": lengths, "kwargs": kwargs, "seed": seed}


def batch_of(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (pad id 0) of `lengths`, each a repeat-rich random sequence, and their mask."""
    longest = max(lengths)
    rows, masks = [], []
    for r, n in enumerate(lengths):
        body = prompt_ids(max(n, 2), V, seed=seed + r)[:, :n]
        body = torch.where(torch.arange(n) % 5 == 4, body.roll(3, dims=1), body)  # n-grams that recur
        rows.append(torch.cat([torch.zeros(1, longest - n, dtype=torch.long), body], dim=1))
        masks.append(
            torch.cat([torch.zeros(1, longest - n, dtype=torch.long), torch.ones(1, n, dtype=torch.long)], 1)
        )
    return torch.cat(rows), torch.cat(masks)


@pytest.mark.filterwarnings("ignore")
@given(generations())
@settings(
    max_examples=24,
    deadline=None,  # one example is a few generations: timings vary with the machine, not the code
    derandomize=True,  # the same examples on every run (CI)
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
def test_fuzzed_greedy_generation_equals_plain_generate(case):
    model = model_of(case["arch"])
    ids, mask = batch_of(case["lengths"], case["seed"])
    kwargs = case["kwargs"]
    want = model.generate(ids, attention_mask=mask, **kwargs)
    got = model.generate(ids, attention_mask=mask, **kwargs, custom_generate=decoder_of(case["method"]))
    assert got.shape[0] == want.shape[0]
    for r, n in enumerate(case["lengths"]):
        pad = ids.shape[1] - n
        prompt = ids[r : r + 1, pad:]
        assert_equal_up_to_ties(model, prompt, _strip(got[r : r + 1, pad:]), _strip(want[r : r + 1, pad:]))


def _strip(row: torch.Tensor) -> torch.Tensor:
    """A row without the padding (id 0) transformers writes after a row that stopped before the batch did."""
    keep = row.shape[1]
    while keep > 1 and int(row[0, keep - 1]) == 0:
        keep -= 1
    return row[:, :keep]
