"""Talon's cost-aware switch: the model drafts only where its measured extra tokens pay for its draft time."""

from __future__ import annotations

import pytest

from hf_spec.methods.talon.switch import CostAwareSwitch

STEP_NODES = 5  # the screened LM head's limit without AVX512-VNNI, passed to the switch where it matters


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


def feed_rounds(
    switch: CostAwareSwitch, a: float, s: float, weak: list[tuple[int, int]], rounds: int = 40
) -> None:
    """Rounds running both halves: a + s * nodes seconds plus 10 ms drafting with the model (12 nodes, 10 of them
    new in the fused tree). Every 4th round retrieval matches 8 tokens and gets 6 accepted (the model 1); the
    others match 2 and cycle through `weak`'s (retrieval, model) accepted pairs. Under greedy verification the
    fused tree gets the longer of the two."""
    switch.start_round()
    weak_rounds = 0
    for i in range(rounds):
        long = i % 4 == 0
        weak_rounds += not long
        match, ret_nodes = (8, 16) if long else (2, 6 + (i % 3) * 5)
        r, m = (6, 1) if long else weak[weak_rounds % len(weak)]
        nodes = ret_nodes + 10
        switch.model_drafted(0.010)
        switch.record(
            match,
            used_model=True,
            retrieval_accepted=r,
            accepted=max(r, m),
            nodes=nodes,
            model_nodes=10,
            model_accepted=m,
            model_size=12,
        )
        switch._round_start -= 0.010 + a + s * nodes
        switch.start_round()


def test_best_switch_picks_the_most_tokens_per_second():
    """Halves that complement each other on weak matches (retrieval 0 or 2 tokens, the model 1 or 0): with dear
    nodes (float32-like, 9 ms each) retrieval alone pays most, with cheap ones (bfloat16-like, 0.5 ms) both do;
    a model that gets more than retrieval wins weak matches when nodes are dear; strong matches go to
    retrieval alone."""
    dear = CostAwareSwitch(explore_every=0)
    assert dear.choose(2, 16) == "both"  # nothing measured yet: run both
    feed_rounds(dear, a=0.100, s=0.009, weak=[(0, 1), (2, 0)])
    assert abs(dear.node_seconds() - 0.009) < 1e-3
    assert dear.choose(2, 16) == "retrieval" and dear.choose(8, 16) == "retrieval"
    cheap = CostAwareSwitch(explore_every=0)
    feed_rounds(cheap, a=0.100, s=0.0005, weak=[(0, 1), (2, 0)])
    assert cheap.choose(2, 16) == "both" and cheap.choose(8, 16) == "retrieval"
    assert cheap.choose(2, 0) != "retrieval"  # no retrieval tree: never retrieval alone
    strong_model = CostAwareSwitch(explore_every=0)
    feed_rounds(strong_model, a=0.100, s=0.009, weak=[(0, 2), (1, 1)])
    assert strong_model.choose(2, 16) == "model" and strong_model.choose(8, 16) == "retrieval"


def test_best_switch_explores_after_rounds_without_the_model():
    switch = CostAwareSwitch(explore_every=2)
    feed_rounds(switch, a=0.100, s=0.009, weak=[(0, 1), (2, 0)])
    assert [switch.choose(8, 16) for _ in range(6)] == [
        "retrieval",
        "retrieval",
        "both",
    ] * 2  # also after model-only rounds
    # a model-only round still measures G: the fused tree would have had max(R, M) accepted
    gain = switch.model_gain.value
    switch.record(2, used_model=True, retrieval_accepted=3, accepted=1, used_retrieval=False)
    assert switch.model_gain.value < gain


def test_a_generations_first_model_draft_does_not_count_as_draft_cost():
    """The model drafter's first draft of a generation also prefills its own state over the prompt."""
    switch = CostAwareSwitch()
    switch.model_drafted(0.01)
    switch.new_generation()
    switch.model_drafted(2.0)  # prompt prefill + draft
    switch.model_drafted(0.01)
    assert switch.model_seconds.count == 2 and abs(switch.model_seconds.value - 0.01) < 1e-9


def test_censored_retrieval_counts_are_not_averaged():
    """A dropped retrieval tree that matched every committed token would have had more accepted: not counted."""
    switch = CostAwareSwitch()
    switch.record(8, used_model=True, retrieval_accepted=6, accepted=6)
    switch.record(
        8, used_model=True, retrieval_accepted=2, accepted=1, used_retrieval=False, retrieval_censored=True
    )
    assert switch.retrieval_accepted[8].value == 6 and switch.model_gain.value == 0


def test_best_switch_measures_unknown_and_censored_buckets_with_both_halves():
    """A match bucket with no R yet, or whose last dropped retrieval tree matched every committed token, runs
    both halves once: a model that looked better must not keep R = 0 there for good."""
    switch = CostAwareSwitch(explore_every=0)
    feed_rounds(switch, a=0.100, s=0.009, weak=[(0, 2), (1, 1)])
    assert switch.choose(2, 16) == "model"
    assert switch.choose(5, 16) == "both"  # bucket 5 never measured
    assert switch.choose(5, 0) == "model"  # no retrieval tree: nothing to measure
    switch.record(5, used_model=True, retrieval_accepted=0, accepted=1, used_retrieval=True)
    assert switch.choose(5, 16) == "model"
    switch.record(
        2, used_model=True, retrieval_accepted=1, accepted=1, used_retrieval=False, retrieval_censored=True
    )
    assert switch.choose(2, 16) == "both"
    switch.record(2, used_model=True, retrieval_accepted=0, accepted=1, used_retrieval=True)
    assert switch.choose(2, 16) == "model"


def test_fit_prices_the_screened_head_step():
    """Rounds of 100 ms + 3 ms per node + 25 ms once a tree leaves the screened LM head (> STEP_NODES nodes): the
    fit recovers both terms, and a 5-node retrieval tree fused with a 2-node model chain (7 nodes) is no longer
    chosen, where the straight line through the same rounds would fuse them."""
    switch = CostAwareSwitch(explore_every=0, step_nodes=STEP_NODES)
    switch.start_round()
    sizes = [2, 3, 4, 5, 7, 9, 12, 16]
    for i in range(64):
        nodes, r = sizes[i % len(sizes)], 2 * (i % 2)  # retrieval gets 0 or 2 accepted, the model 1
        switch.model_drafted(0.010)
        switch.record(
            2, used_model=True, retrieval_accepted=r, accepted=max(r, 1), nodes=nodes, model_nodes=2,
            model_accepted=1, model_size=2,
        )  # fmt: skip
        switch._round_start -= 0.010 + 0.100 + 0.003 * nodes + 0.025 * (nodes > STEP_NODES)
        switch.start_round()
    s, h = switch.fit()
    assert abs(s - 0.003) < 3e-4 and abs(h - 0.025) < 3e-3
    assert abs(switch.intercept() - 0.100) < 3e-3
    assert switch.verify_seconds(7) - switch.verify_seconds(5) == pytest.approx(2 * s + h)
    assert switch.choose(2, 5) != "both"
    # the straight line through the same rounds, as the switch fitted before the step: both halves fused win
    times = [0.100 + 0.003 * n + 0.025 * (n > STEP_NODES) for n in sizes]
    mean_n, mean_t = sum(sizes) / len(sizes), sum(times) / len(times)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, times, strict=True)) / sum(
        (n - mean_n) ** 2 for n in sizes
    )
    line = mean_t - slope * mean_n
    rates = {  # tokens: retrieval 1 + 1, model 1 + 1, both 1.5 + 1
        "retrieval": 2.0 / (line + slope * 5),
        "model": 2.0 / (line + slope * 2 + 0.010),
        "both": 2.5 / (line + slope * 7 + 0.010),
    }
    assert max(rates, key=rates.get) == "both"


def test_fit_without_both_sides_of_the_step_is_a_line():
    switch = CostAwareSwitch()
    switch.start_round()
    for i in range(40):
        nodes = 6 + (i % 3) * 6
        switch.record(1, used_model=False, retrieval_accepted=0, accepted=0, nodes=nodes)
        switch._round_start -= 0.001 + 0.0005 * nodes
        switch.start_round()
    s, h = switch.fit()
    assert abs(s - 0.0005) < 5e-5 and h == 0.0
