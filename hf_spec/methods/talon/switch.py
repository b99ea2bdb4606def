"""Talon's cost-aware switch: run the model drafter only in rounds where its branches are expected to pay.

Running means of
    R[b] = tokens the retrieval tree alone gets accepted, per bucket b of retrieval match length,
    G    = extra tokens the model's branches add (rounds that ran both; pooled over match lengths, on which it
           depends little).
Without the model a round commits R + 1 tokens in time T; with it R + G + 1 in T + c, where c is the model's
draft time plus the verification time of the nodes it adds (the round time's slope in the number of verified
nodes, a running least-squares fit, times the model's mean extra nodes). The model pays when
(R + G + 1) / (T + c) > (R + 1) / T, i.e.

    G > (R[b] + 1) * c / T,

so it is skipped where retrieval alone already gets long runs accepted (copying from the prompt). R[b] is
updated every round; G only when the model runs, so after `explore_every` skipped rounds in a row it runs once
anyway. The means live as long as the drafter (they carry over from one `generate` call to the next).

`choose` (Talon's `switch: best`) also lets a round drop the retrieval tree: where verification is dear (e.g. a
float32 target on a CPU) the fused tree of both halves can cost more than the tokens it adds over the better half
alone. With a round's time fitted as a + s * nodes (+ the model's draft time d) it picks the largest expected
tokens per second among

    retrieval: (R[b] + 1) / (a + s n_r)     model: (M + 1) / (a + s n_m + d)     both: (R[b] + G + 1) / (a + s (n_r + x) + d)

with n_r the round's retrieval tree, n_m the model tree's mean size, x the model's mean extra nodes in fused trees
and M what the model tree alone gets accepted. The fit has a step too: a greedy float32 verification of at most
`step_nodes` nodes reads the int8-screened LM head (`hf_spec.kernels.screened_head`), a larger one the fp32 head,
so each `s * n` above reads `s * n + h * [n > step_nodes]`, with h fitted with s (two-regressor running least
squares; h = 0 where all rounds fall on one side). Without the step, a linear fit prices a short model chain and
a larger fused tree alike where they fall on either side of it.

In model-only rounds R is what the retrieval tree would have had accepted by the committed tokens (exact under
greedy verification), and G = max(R, M) - R as the fused tree would have had (R is not updated when the retrieval
tree matched all of them: it would have had more). After `explore_every` rounds that did not run both, both run
once; so does a round whose match bucket has no R yet, or whose last dropped retrieval tree there was censored:
an unmeasured bucket reads R = 0, so its retrieval tree would otherwise be dropped for good.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from hf_spec.kernels.screened_head import max_screened_rows


@dataclass
class RunningMean:
    value: float = 0.0
    count: int = 0

    def add(self, x: float, min_rate: float = 0.1) -> None:
        """Plain mean over the first samples, then an exponential average (rate `min_rate`)."""
        self.count += 1
        self.value += max(1.0 / self.count, min_rate) * (x - self.value)


class CostAwareSwitch:
    """Decides per round whether Talon's model drafter runs (`use_model`), learning from `record`.

    Args:
        max_bucket: match lengths at or above this share one bucket.
        explore_every: after this many skipped rounds in a row the model runs once (0: never).
        cost_ratio: c / T when > 0 (fixed, deterministic); 0 measures both with `time.perf_counter`.
        step_nodes: verified nodes (the root aside) that still read the screened LM head; None: this CPU's.
    """

    def __init__(
        self,
        max_bucket: int = 8,
        explore_every: int = 4,
        cost_ratio: float = 0.0,
        step_nodes: int | None = None,
    ) -> None:
        self.max_bucket = max_bucket
        self.step_nodes = max_screened_rows() - 1 if step_nodes is None else step_nodes
        self.explore_every = explore_every
        self.cost_ratio = cost_ratio
        self.retrieval_accepted = [RunningMean() for _ in range(max_bucket + 1)]
        self.model_gain = RunningMean()
        self.model_seconds = RunningMean()
        self.rest_seconds = RunningMean()  # a round's time without the model's drafting
        self.model_nodes = RunningMean()  # nodes the model adds to the verified tree
        self.model_accepted = RunningMean()  # M: tokens the model tree alone gets accepted
        self.model_size = RunningMean()  # nodes of the model tree
        # running moments of (verified nodes n, step z = [n > step_nodes], rest of the round t) for the fit
        self._n, self._t, self._nn, self._nt = RunningMean(), RunningMean(), RunningMean(), RunningMean()
        self._z, self._zz, self._nz, self._zt = RunningMean(), RunningMean(), RunningMean(), RunningMean()
        self.skipped = 0  # rounds skipped in a row
        self.censored = [False] * (max_bucket + 1)  # the bucket's last dropped retrieval tree was censored
        self.new_generation()

    def new_generation(self) -> None:
        """Forget the round timing (the means stay)."""
        self._round_start: float | None = None
        self._round_model_seconds = 0.0
        self._round_nodes: int | None = None
        self._first_draft = True  # the model's first draft of a generation also reads the whole prompt

    def bucket(self, match: int) -> int:
        return min(max(match, 0), self.max_bucket)

    def fit(self) -> tuple[float, float]:
        """`(s, h)`: seconds per verified node and the step above `step_nodes` nodes (least squares, both >= 0)."""
        var_n = self._nn.value - self._n.value**2
        if self._n.count < 8 or var_n < 1.0:
            return 0.0, 0.0
        cov_nt = self._nt.value - self._n.value * self._t.value
        var_z = self._zz.value - self._z.value**2
        cov_nz = self._nz.value - self._n.value * self._z.value
        det = var_n * var_z - cov_nz**2
        if var_z < 0.02 or det < 1e-3 * var_n * var_z:  # one side of the step only (or n decides z)
            return max(0.0, cov_nt / var_n), 0.0
        cov_zt = self._zt.value - self._z.value * self._t.value
        s, h = (cov_nt * var_z - cov_zt * cov_nz) / det, (cov_zt * var_n - cov_nt * cov_nz) / det
        if s < 0 or h < 0:  # keep the constraint: refit with the other term alone
            return (max(0.0, cov_nt / var_n), 0.0) if h < 0 else (0.0, max(0.0, cov_zt / var_z))
        return s, h

    def node_seconds(self) -> float:
        """Seconds one more verified node adds to a round (the fit's slope)."""
        return self.fit()[0]

    def verify_seconds(self, nodes: float) -> float:
        """What `nodes` verified nodes add to a round's intercept: `s * nodes + h * [nodes > step_nodes]`."""
        s, h = self.fit()
        return s * nodes + h * (nodes > self.step_nodes)

    def ratio(self) -> float:
        """c / T: the model's cost (drafting + verifying its nodes) over the rest of a round."""
        if self.cost_ratio > 0:
            return self.cost_ratio
        if not self.model_seconds.count or not self.rest_seconds.count or self.rest_seconds.value <= 0:
            return 0.0
        cost = self.model_seconds.value + self.node_seconds() * self.model_nodes.value
        return cost / self.rest_seconds.value

    def intercept(self) -> float:
        """a: a round's time (without drafting the model) at zero verified nodes."""
        s, h = self.fit()
        a = self._t.value - s * self._n.value - h * self._z.value
        return a if a > 0 else self.rest_seconds.value

    def choose(self, match: int, retrieval_nodes: int) -> str:
        """`"both"`, `"retrieval"` or `"model"`: the draft with the most expected tokens per second."""
        if not self.model_gain.count or not self.model_seconds.count or not self.rest_seconds.count:
            return "both"
        b = self.bucket(match)
        unknown = retrieval_nodes > 0 and (not self.retrieval_accepted[b].count or self.censored[b])
        if unknown or (self.explore_every and self.skipped >= self.explore_every):
            self.skipped = 0
            return "both"
        expected = self.retrieval_accepted[b].value
        a, d, cost = self.intercept(), self.model_seconds.value, self.verify_seconds
        rates = {
            "retrieval": (expected + 1.0) / (a + cost(retrieval_nodes)),
            "model": (self.model_accepted.value + 1.0) / (a + cost(self.model_size.value) + d),
            "both": (expected + self.model_gain.value + 1.0)
            / (a + cost(retrieval_nodes + self.model_nodes.value) + d),
        }
        if not retrieval_nodes:
            rates.pop("retrieval")
        pick = max(rates, key=rates.get)
        self.skipped = self.skipped + 1 if pick != "both" else 0
        return pick

    def use_model(self, match: int) -> bool:
        expected = self.retrieval_accepted[self.bucket(match)].value
        if not self.model_gain.count or self.model_gain.value > (expected + 1.0) * self.ratio():
            self.skipped = 0
            return True
        self.skipped += 1
        if self.explore_every and self.skipped >= self.explore_every:
            self.skipped = 0
            return True
        return False

    # ---- measurements ------------------------------------------------------------------------------
    def start_round(self) -> None:
        """Call at the start of each round's drafting: closes the previous round's timing."""
        now = time.perf_counter()
        if self._round_start is not None:
            rest = now - self._round_start - self._round_model_seconds
            self.rest_seconds.add(rest)
            if self._round_nodes is not None:
                n = float(self._round_nodes)
                z = float(n > self.step_nodes)
                for mean, x in (
                    (self._n, n),
                    (self._t, rest),
                    (self._nn, n * n),
                    (self._nt, n * rest),
                    (self._z, z),
                    (self._zz, z),
                    (self._nz, n * z),
                    (self._zt, z * rest),
                ):
                    mean.add(x, min_rate=0.05)
        self._round_start, self._round_model_seconds, self._round_nodes = now, 0.0, None

    def model_drafted(self, seconds: float) -> None:
        self._round_model_seconds = seconds
        first, self._first_draft = self._first_draft, False
        if not (first and self.model_seconds.count):  # a prompt's prefill is not a round's draft cost
            self.model_seconds.add(seconds)

    def record(
        self,
        match: int,
        used_model: bool,
        retrieval_accepted: int,
        accepted: int,
        nodes: int | None = None,
        model_nodes: int = 0,
        model_accepted: int | None = None,
        model_size: int = 0,
        used_retrieval: bool = True,
        retrieval_censored: bool = False,
    ) -> None:
        """After verification: tokens accepted in the retrieval tree alone and in the whole (fused) tree; the
        verified tree's size `nodes` and how many of them only the model drafted; what the model tree alone got
        accepted and its size; whether the retrieval tree was verified (when not, `retrieval_accepted` is what it
        would have had accepted, `retrieval_censored` when it matched every committed token, so would have had
        more: then R is not updated)."""
        b = self.bucket(match)
        self.censored[b] = retrieval_censored
        if not retrieval_censored:
            self.retrieval_accepted[b].add(retrieval_accepted)
        self._round_nodes = nodes
        if used_model:
            # under greedy verification the fused tree gets max(R, M) accepted, so a model-only round tells G too
            self.model_gain.add(max(0, accepted - retrieval_accepted))
            if used_retrieval:
                self.model_nodes.add(model_nodes)
            if model_accepted is not None:
                self.model_accepted.add(model_accepted)
                self.model_size.add(model_size)


__all__ = ["CostAwareSwitch", "RunningMean"]
