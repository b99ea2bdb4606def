"""Pre-cut: a tabular Q-learning controller that decides after every draft call whether to keep drafting.

    state  s = (draft calls so far, bucket of the expected benefit = product of the draft tokens' confidences)
    action a in {CONTINUE, STOP}, chosen as argmax_a Q(s, a), epsilon-greedy while learning
    reward after verification, for stopping after t calls:  r_t = eta_t - 1,
           eta_t = useful tokens among the first t calls' tokens / (t + c_T)
           (c_T: one target call in draft-call units)
    CONTINUE earns nothing itself and leads to the next state:
        Q(s_t, STOP)     <- Q(s_t, STOP)     + alpha * (r_t - Q(s_t, STOP))
        Q(s_t, CONTINUE) <- Q(s_t, CONTINUE) + alpha * (gamma * max_a Q(s_{t+1}, a) - Q(s_t, CONTINUE))

Warm-up (as in the paper): every drafted position of every round is a virtual STOP trial, and every step to
the next drafted position a CONTINUE trial, so one verification updates the whole trajectory. STOP trials
are applied first, then CONTINUE trials from the deepest state up, so values flow back in one round.
Q starts with CONTINUE slightly above STOP (`init_continue` > `init_stop`): an unexplored state keeps drafting.
Start both near the typical reward (e.g. -0.5 / -0.49 when a draft call costs about a target call): values far
above every reward make every unexplored state look better than any explored one, so the table keeps drafting
to `max_calls` until all of them have been visited. At `max_calls` only STOP is open.

The discount biases the table when rewards are negative: CONTINUE is worth gamma * (a reward near r), i.e.
(1 - gamma) * |r| more than stopping with the same reward, per call. With a cheap drafter (a head call at 1/7
to 1/15 of a target call) r is ~ -0.9, and the real difference between stopping after 2 or after 6 calls
(~0.015) is below those 4 calls' bias (~0.036 at gamma = 0.99): the table learns to draft to `max_calls`. The
episode is bounded by `max_calls`, so gamma = 1 (no discount) is well defined and removes the bias.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
from pathlib import Path

from hf_spec.io.integrity import verify_json_checksum, with_json_checksum, write_json_atomic

CONTINUE, STOP = 0, 1
FORMAT = "hf-spec-precut-qtable"


def is_q_table(path: str | os.PathLike) -> bool:
    """A file holding a saved Pre-cut Q-table (one a new table may replace)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


class PreCutController:
    """Q-table over `(calls, benefit bucket)` states. `frozen` = no updates and no exploration."""

    def __init__(
        self,
        max_calls: int = 24,
        benefit_buckets: int = 10,
        alpha: float = 0.1,
        gamma: float = 0.99,
        epsilon: float = 0.05,
        init_continue: float = 0.01,
        init_stop: float = 0.0,
        frozen: bool = False,
        seed: int = 0,
    ) -> None:
        if max_calls < 1 or benefit_buckets < 1:
            raise ValueError("PreCutController needs max_calls >= 1 and benefit_buckets >= 1")
        if not (0 < alpha <= 1 and 0 <= gamma <= 1 and 0 <= epsilon <= 1):
            raise ValueError(
                f"need 0 < alpha <= 1, 0 <= gamma <= 1, 0 <= epsilon <= 1 (got {alpha}, {gamma}, {epsilon})"
            )
        self.max_calls = max_calls
        self.benefit_buckets = benefit_buckets
        self.alpha, self.gamma, self.epsilon = alpha, gamma, epsilon
        self.init = (init_continue, init_stop)
        self.frozen = frozen
        self.rng = random.Random(seed)
        self.table: dict[tuple[int, int], list[float]] = {}  # state -> [Q(CONTINUE), Q(STOP)]
        self.updates = 0
        self.target_cost: float | None = None  # c_T used while learning (recorded in the saved table)

    # ---- policy -----------------------------------------------------------------------------------
    def state(self, calls: int, benefit: float) -> tuple[int, int]:
        """`calls` clipped to `max_calls`; `benefit` in [0, 1] into `benefit_buckets` equal buckets."""
        bucket = min(int(max(benefit, 0.0) * self.benefit_buckets), self.benefit_buckets - 1)
        return min(calls, self.max_calls), bucket

    def q(self, state: tuple[int, int]) -> list[float]:
        if state not in self.table:
            self.table[state] = list(self.init)
        return self.table[state]

    def value(self, state: tuple[int, int]) -> list[float]:
        """Q values without creating the entry."""
        return self.table.get(state, list(self.init))

    def should_continue(self, state: tuple[int, int]) -> bool:
        if not self.frozen and self.epsilon > 0 and self.rng.random() < self.epsilon:
            return self.rng.random() < 0.5
        q_cont, q_stop = self.value(state)
        return q_cont >= q_stop

    # ---- learning ---------------------------------------------------------------------------------
    def update(self, states: list[tuple[int, int]], rewards: list[float]) -> None:
        """One round: `states[t]` after call `t + 1`, `rewards[t]` = reward of stopping there."""
        if self.frozen or not states:
            return
        if len(states) != len(rewards):
            raise ValueError("one reward per state")
        a, g = self.alpha, self.gamma
        for s, r in zip(states, rewards, strict=True):
            q = self.q(s)
            q[STOP] += a * (r - q[STOP])
        for t in range(len(states) - 2, -1, -1):
            q = self.q(states[t])
            q[CONTINUE] += a * (g * self.best(states[t + 1]) - q[CONTINUE])
        self.updates += 1

    def best(self, state: tuple[int, int]) -> float:
        """max_a Q(s, a) over the actions open in `state`: at `max_calls` only STOP."""
        q_cont, q_stop = self.value(state)
        return q_stop if state[0] >= self.max_calls else max(q_cont, q_stop)

    # ---- persistence ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": 1,
            "max_calls": self.max_calls,
            "benefit_buckets": self.benefit_buckets,
            "alpha": self.alpha,
            "gamma": self.gamma,
            "init": list(self.init),
            "updates": self.updates,
            "target_cost": self.target_cost,
            "q": {f"{c},{b}": v for (c, b), v in sorted(self.table.items())},
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write the table (with the checksum of its content, checked at load) through a temporary file."""
        return write_json_atomic(path, with_json_checksum(self.to_dict()))

    def load(self, path: str | os.PathLike) -> None:
        """Replace the table by a saved one; its state layout must match this controller's."""
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no Pre-cut Q-table at {path}") from None
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read a Pre-cut Q-table from {path}: {err}") from None
        if isinstance(data, dict):  # the table is checked on a copy of this controller, then its checksum
            data = verify_json_checksum(
                data, f"the Pre-cut Q-table {path}", lambda body: copy.copy(self).load_dict(body, str(path))
            )
        self.load_dict(data, str(path))

    def load_dict(self, data: dict, where: str = "Q-table") -> None:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{where} is not an hf-spec Pre-cut Q-table (format {FORMAT!r})")
        layout = (data.get("max_calls"), data.get("benefit_buckets"))
        if layout != (self.max_calls, self.benefit_buckets):
            raise ValueError(
                f"{where} has max_calls/benefit_buckets {layout}, the controller "
                f"{(self.max_calls, self.benefit_buckets)}"
            )
        q = data.get("q")
        if not isinstance(q, dict):
            raise ValueError(
                f"{where}: 'q' must map states 'calls,bucket' to [Q(continue), Q(stop)], got {q!r:.60}"
            )
        table = {}
        for key, v in q.items():
            try:
                c, b = (int(x) for x in key.split(","))
                values = [float(x) for x in v]
            except (TypeError, ValueError):
                raise ValueError(
                    f"{where}: bad entry {key!r}: {v!r:.60} (want 'calls,bucket': [q, q])"
                ) from None
            if len(values) != 2 or not all(math.isfinite(x) for x in values):
                raise ValueError(
                    f"{where}: state {key} needs two finite values [Q(continue), Q(stop)], got {v}"
                )
            if not (0 <= c <= self.max_calls and 0 <= b < self.benefit_buckets):
                raise ValueError(f"{where}: state {key} is outside this controller's layout")
            table[(c, b)] = values
        self.table = table
        self.updates = int(data.get("updates", 0))
        self.target_cost = data.get("target_cost")
