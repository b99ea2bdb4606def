"""Talon's cost-aware switch: the model drafts only where its measured extra tokens pay for its draft time."""

from __future__ import annotations

from hf_spec.methods.talon.switch import CostAwareSwitch


def test_model_is_skipped_only_where_retrieval_alone_gets_long_runs():
    switch = CostAwareSwitch(explore_every=0, cost_ratio=0.1)
    assert switch.use_model(5) and switch.use_model(0)  # nothing known: the model runs
    for _ in range(
        20
    ):  # the model adds 0.5 tokens a round; retrieval gets 6 on matches of 5, 0.5 on matches of 1
        switch.record(5, used_model=True, retrieval_accepted=6, accepted=6)
        switch.record(5, used_model=True, retrieval_accepted=6, accepted=7)
        switch.record(1, used_model=True, retrieval_accepted=0, accepted=0)
        switch.record(1, used_model=True, retrieval_accepted=1, accepted=2)
    # match 5: 0.5 < (6 + 1) * 0.1 -> skip; match 1: 0.5 > (0.5 + 1) * 0.1 -> draft; unseen match 3: R = 0 -> draft
    assert not switch.use_model(5)
    assert switch.use_model(1) and switch.use_model(3)
    assert switch.bucket(50) == switch.bucket(8) == 8


def test_skipping_explores_and_recovers():
    switch = CostAwareSwitch(explore_every=3, cost_ratio=0.2)
    switch.record(4, used_model=True, retrieval_accepted=3, accepted=3)  # the model added nothing
    assert [switch.use_model(4) for _ in range(6)] == [False, False, True, False, False, True]
    for _ in range(10):  # the explored rounds show it adding 3 tokens: from then on it drafts
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
    switch.new_generation()  # timing restarts, the means stay
    assert switch._round_start is None and switch.model_seconds.count == 1


def test_model_cost_includes_verifying_its_nodes():
    """Rounds of 1 ms + 0.5 ms per verified node: the fitted slope prices the model's 10 extra nodes at 5 ms."""
    switch = CostAwareSwitch()
    switch.start_round()
    for i in range(40):
        nodes = 6 + (i % 3) * 6  # 6, 12, 18 verified nodes
        switch.model_drafted(0.002)
        switch.record(1, used_model=True, retrieval_accepted=0, accepted=1, nodes=nodes, model_nodes=10)
        switch._round_start -= 0.002 + 0.001 + 0.0005 * nodes  # this round took that long
        switch.start_round()
    assert abs(switch.node_seconds() - 0.0005) < 5e-5
    # c = 2 ms drafting + 10 nodes * 0.5 ms; T = the mean rest of a round (1 ms + 0.5 ms * 12 nodes)
    assert abs(switch.ratio() - 0.007 / 0.007) < 0.05
