"""`DraftSwitch`: a batch drafts while drafted rounds commit more tokens per second than plain steps, and a round
of either kind leaves the output unchanged."""

from __future__ import annotations

import pytest
import torch

import hf_spec.decoder
from hf_spec import SpeculativeDecoder
from hf_spec.engine.draft_switch import DraftSwitch
from tests.test_rows import PAD, batch_of_three


def run(switch: DraftSwitch, rounds: int, drafted_rate: float, plain_rate: float) -> list[bool]:
    """Decisions over `rounds` rounds where each kind commits at a fixed rate (tokens per second)."""
    decisions = []
    for _ in range(rounds):
        drafted = switch.draft_now()
        decisions.append(drafted)
        switch.record(drafted, tokens=int(drafted_rate if drafted else plain_rate), seconds=1.0)
    return decisions


def test_warmup_then_one_plain_step_then_the_faster_kind():
    switch = DraftSwitch(warmup=3, probe_every=4)
    decisions = run(switch, 30, drafted_rate=10, plain_rate=5)
    assert decisions[:5] == [True, True, True, True, False]  # 1 uncounted + 3 measured drafted, 1 plain
    # plain steps are 2x slower: tried again after 4 * 2 drafted rounds
    assert decisions[5:] == ([True] * 8 + [False]) * 2 + [True] * 7
    assert switch.drafting_pays is True
    assert switch.rate(True) == 10 and switch.rate(False) == 5


def test_plain_steps_win_when_drafting_is_slower():
    switch = DraftSwitch(warmup=2, probe_every=4)
    decisions = run(switch, 20, drafted_rate=4, plain_rate=5)
    assert decisions[:4] == [True, True, True, False]
    assert decisions[4:] == ([False] * 5 + [True]) * 2 + [False] * 4  # 4 * 5/4 rounds between tries
    assert switch.drafting_pays is False


def test_the_choice_follows_a_change_in_rates():
    switch = DraftSwitch(warmup=1, probe_every=2)
    run(switch, 10, drafted_rate=10, plain_rate=5)
    assert switch.drafting_pays
    run(switch, 60, drafted_rate=2, plain_rate=5)  # e.g. acceptance fell: the tries see it, the choice flips
    assert switch.drafting_pays is False


def test_the_first_drafted_round_is_not_counted():
    switch = DraftSwitch()
    switch.record(True, tokens=1, seconds=100.0)  # the prompt fed to the draft heads
    assert switch.totals == {}
    switch.record(True, tokens=4, seconds=1.0)
    switch.record(True, tokens=2, seconds=1.0)
    assert switch.rate(True) == 3.0 and switch.drafting_pays is None


class Alternating(DraftSwitch):
    """Drafts every other round: both kinds of round, whatever the clock says."""

    def draft_now(self) -> bool:
        self.since_probe += 1
        return self.since_probe % 2 == 1


@pytest.mark.parametrize("spec", ["pld", "retrieval"])
def test_plain_steps_between_drafted_rounds_keep_the_output(tiny_model, spec, monkeypatch):
    monkeypatch.setattr(hf_spec.decoder, "DraftSwitch", Alternating)
    ids, mask = batch_of_three()
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=PAD)
    dec = SpeculativeDecoder(spec)
    assert torch.equal(
        tiny_model.generate(ids, **kwargs, custom_generate=dec), tiny_model.generate(ids, **kwargs)
    )
    assert 0 < dec.last_stats.plain_rounds < dec.last_stats.target_forwards


def test_explicit_batched_mode_always_drafts(tiny_llama, monkeypatch):
    monkeypatch.setattr(hf_spec.decoder, "DraftSwitch", Alternating)
    ids, mask = batch_of_three()
    dec = SpeculativeDecoder("pld", batches="batched")
    tiny_llama.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=PAD, custom_generate=dec)
    assert dec.last_stats.plain_rounds == 0
