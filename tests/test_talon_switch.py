"""Talon's cost-aware switch: the model drafts only where its measured extra tokens pay for its draft time."""

from __future__ import annotations

from hf_spec.methods.talon.switch import CostAwareSwitch


def test_untried_buckets_run_the_model_then_follow_the_pay_rule():
    switch = CostAwareSwitch(explore_every=0, cost_ratio=0.2)
    assert switch.use_model(5) and switch.use_model(0)  # optimistic start
    # strong matches: retrieval alone gets 4 accepted, the model adds 0.5: 0.5 < (4 + 1) * 0.2 -> skip
    for _ in range(4):
        switch.record(5, used_model=True, retrieval_accepted=4, accepted=4)
        switch.record(5, used_model=True, retrieval_accepted=4, accepted=5)
    assert not switch.use_model(5)
    # no match: retrieval gets nothing, the model adds 0.5 > (0 + 1) * 0.2 -> draft
    for _ in range(4):
        switch.record(0, used_model=True, retrieval_accepted=0, accepted=1)
        switch.record(0, used_model=True, retrieval_accepted=0, accepted=0)
    assert switch.use_model(0)
    # a match length never seen is still optimistic; lengths past max_bucket share the last bucket
    assert switch.use_model(2)
    assert switch.bucket(50) == switch.bucket(8) == 8


def test_skipped_bucket_explores_and_recovers():
    switch = CostAwareSwitch(explore_every=3, cost_ratio=0.2)
    switch.record(4, used_model=True, retrieval_accepted=3, accepted=3)
    decisions = [switch.use_model(4) for _ in range(6)]
    assert decisions == [False, False, True, False, False, True]
    # the explored rounds show the model adding 3 tokens: from then on it drafts
    for _ in range(10):
        switch.record(4, used_model=True, retrieval_accepted=0, accepted=3)
    assert switch.use_model(4)


def test_measured_cost_ratio_is_model_time_over_the_rest_of_the_round():
    switch = CostAwareSwitch()
    assert switch.ratio() == 0.0  # nothing measured: the model is never ruled out
    switch.start_round()
    switch.model_drafted(0.25)
    switch._round_start -= 1.25  # the round took 1.25 s, 0.25 s of it drafting with the model
    switch.start_round()
    assert abs(switch.ratio() - 0.25) < 0.01
