"""The round engine: device-to-host reads per round, the token buffer, host-side stopping, backends, profiles."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ClassVar

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_spec import SpeculativeDecoder
from hf_spec.core.config import MethodConfig
from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.engine.backend import CpuBackend, TorchBackend, backend_for
from hf_spec.engine.commit import StopCheck, TokenBuffer
from hf_spec.engine.round import RoundEngine
from hf_spec.engine.target.profile import target_profile
from hf_spec.tree import DraftTree

# what reads a tensor's value on the host: on an accelerator each one waits for the stream
HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__")


class _FixedTreeConfig(MethodConfig):
    method = "fixed-tree-test"


class FixedTreeDrafter(Drafter):
    """Proposes a tree of `size` nodes: a chain of the reference continuation as long as `depth`, the rest as
    wrong siblings below the root, so every round verifies exactly `size` nodes (when there is room)."""

    def __init__(self, model, reference: list[int], size: int, depth: int) -> None:
        super().__init__(_FixedTreeConfig(), model)
        self.reference, self.size, self.depth = reference, size, depth

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        n = state.seq_len
        chain = self.reference[n : n + min(self.depth, max_depth, self.size)]
        tokens = list(chain)
        parents = list(range(-1, len(chain) - 1))
        vocab = self.model.config.vocab_size
        while len(tokens) < self.size and max_depth > 0:
            tokens.append((self.reference[n] + 1 + len(tokens)) % vocab if n < len(self.reference) else 3)
            parents.append(-1)
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@contextlib.contextmanager
def counting_host_reads(counts: list[int]):
    """Count every host read of a tensor's value inside the block, except while a drafter proposes (the drafter's
    own business): each round appends an entry to `counts` and counts into it; what runs after the last round
    (output assembly) counts into the last entry."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    paused = [False]

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            if counts and not paused[0]:  # inside a round (set-up before the first round is not counted)
                counts[-1] += 1
            return original(self, *args, **kwargs)

        return read

    step, propose = RoundEngine.step, RoundEngine.propose

    def step_counted(self, rows, draft=True):
        counts.append(0)
        return step(self, rows, draft)

    def propose_paused(row):
        paused[0] = True
        try:
            return propose(row)
        finally:
            paused[0] = False

    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, counted(name))
        RoundEngine.step = step_counted
        RoundEngine.propose = staticmethod(propose_paused)
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        RoundEngine.step, RoundEngine.propose = step, staticmethod(propose)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_host_reads_per_round_do_not_grow_with_the_tree(tiny_llama, monkeypatch, backend):
    monkeypatch.setenv("HF_SPEC_BACKEND", backend)
    monkeypatch.setenv("HF_SPEC_SCREENED_HEAD", "0")
    ids = torch.tensor([[1, 5, 9, 14, 5, 9]])
    reference = tiny_llama.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
    per_size = {}
    for size in (1, 4, 16, 48):
        drafter = FixedTreeDrafter(tiny_llama, reference, size, depth=3)
        counts: list[int] = []
        with counting_host_reads(counts):
            out = tiny_llama.generate(
                ids, max_new_tokens=24, do_sample=False, custom_generate=SpeculativeDecoder(drafter)
            )
        assert out[0].tolist() == reference
        per_size[size] = counts[1:-1]  # whole rounds (the first may build cached tree structure once)
    rounds = [c for counts in per_size.values() for c in counts]
    assert max(rounds) <= 8, per_size
    # a 1-node tree is a chain (no tree mask to build); every branching tree reads as much at 4 as at 48 nodes
    assert len({max(per_size[size]) for size in (4, 16, 48)}) == 1, per_size


def test_token_buffer_views_stay_valid_and_grow():
    buf = TokenBuffer(torch.tensor([[7, 8]]), capacity=3)
    first = buf.view()
    buf.write([1, 2, 3, 4, 5])  # past the capacity: the buffer grows
    buf.commit(4)
    assert buf.view().tolist() == [[7, 8, 1, 2, 3, 4]]
    assert first.tolist() == [[7, 8]] and buf.last == 4
    buf.write([9])
    buf.commit(0)
    assert buf.length == 6 and buf.last == 4


class _StopAfter(StoppingCriteria):
    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stop_check_on_host_and_by_calling_the_criteria_agree(tiny_llama):
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    host = StopCheck(StoppingCriteriaList([MaxLengthCriteria(9), EosTokenCriteria(torch.tensor([5, 6]))]))
    called = StopCheck(StoppingCriteriaList([MaxLengthCriteria(9), _StopAfter(5), _StopAfter(6)]))
    assert host.on_host and not called.on_host
    for new in ([1, 2, 3], [1, 6, 2], [5], [1, 2, 3, 4, 5]):
        answers = []
        for check in (host, called):
            buf = TokenBuffer(torch.tensor([[1, 2, 3, 4]]), capacity=16)
            buf.write(new)
            answers.append(check.first_stop(buf, new, None, []))
        assert answers[0] == answers[1], (new, answers)


def test_backend_is_chosen_by_device_and_can_be_forced(tiny_llama, monkeypatch):
    assert isinstance(backend_for("cpu"), CpuBackend)
    assert type(backend_for("cuda")) is TorchBackend
    assert type(backend_for("cpu", "torch")) is TorchBackend
    with pytest.raises(ValueError, match="HF_SPEC_BACKEND"):
        backend_for("cpu", "tpu")
    assert target_profile(tiny_llama).backend.name == "cpu"
    monkeypatch.setenv("HF_SPEC_BACKEND", "torch")
    assert target_profile(tiny_llama).backend.name == "torch"  # the profile follows the setting


def test_profile_is_computed_once_per_model(tiny_llama, monkeypatch):
    first = target_profile(tiny_llama)
    assert target_profile(tiny_llama) is first
    assert first.cache_name in ("cache", "past_key_values")
    assert first.windows == (None,) * tiny_llama.config.num_hidden_layers and not first.sliding


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_every_backend_gives_the_same_greedy_tokens(tiny_llama, monkeypatch, backend):
    monkeypatch.setenv("HF_SPEC_BACKEND", backend)
    ids = torch.tensor([[1, 5, 9, 14, 5, 9, 14, 5]])
    ref = tiny_llama.generate(ids, max_new_tokens=30, do_sample=False)
    for method in ("pld", "oracle:6", "early-exit:2"):
        out = tiny_llama.generate(
            ids, max_new_tokens=30, do_sample=False, custom_generate=SpeculativeDecoder(method)
        )
        assert torch.equal(out, ref), method


@dataclass
class RepeatConfig(MethodConfig):
    """The worked example of docs/design.md: draft the last token repeated `k` times."""

    method: ClassVar[str] = "repeat-test"
    main_arg: ClassVar[str] = "k"
    k: int = field(default=3, metadata={"help": "draft length"})


class RepeatDrafter(Drafter):
    batchable = True

    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        return DraftTree.chain([int(state.input_ids[0, -1])] * min(self.config.k, max_depth))


def test_a_method_added_from_outside_the_package_runs_by_name(tiny_llama):
    """A config, a drafter and one `register_method` call, nothing else, make a method usable by name."""
    from hf_spec.core import registry

    registry.register_method("repeat-test", RepeatConfig, RepeatDrafter)
    try:
        ids = torch.tensor([[1, 5, 5, 5, 9], [1, 7, 7, 7, 7]])
        ref = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False)
        decoder = SpeculativeDecoder("repeat-test:4")
        assert decoder.config.k == 4
        out = tiny_llama.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=decoder)
        assert torch.equal(out, ref)
    finally:
        registry._METHODS.pop("repeat-test")
