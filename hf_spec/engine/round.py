"""The round engine: one place owns the steps of a speculative round, for one sequence or a batch.

    trees  = [drafter_r.propose(row r)]                     # draft (or a plain step: an empty tree)
    logits = layout.verify(rows, trees)                     # ONE target forward, inside the backend's context
    for each row: accept -> commit (stop at EOS / criteria / max length) -> stream
    layout.compact(rows, keeps)                             # cache: root + accepted path; the bonus is the next root
    for each row still decoding: drafter_r.observe(...)
    stats

What differs between a single sequence and a batch verified in one forward is only how rows are laid out in the
cache and the forward's inputs: that is the `Layout` (`hf_spec.engine.sequence`, `hf_spec.engine.batch`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.engine.commit import (
    Committed,
    SequenceOutputs,
    StopCheck,
    TokenBuffer,
    accept,
    commit_tokens,
)
from hf_spec.engine.outputs import SpecStats
from hf_spec.engine.target.hidden import select_hidden_states
from hf_spec.engine.target.profile import TargetProfile
from hf_spec.engine.target.static import is_static, static_capacity
from hf_spec.tree import DraftTree


@dataclass
class Row:
    """One sequence being decoded: its drafter, committed tokens, criteria, outputs and counters."""

    drafter: Drafter
    state: SpecState  # state.input_ids is a view of `tokens`
    tokens: TokenBuffer
    processors: LogitsProcessorList
    stop: StopCheck
    outputs: SequenceOutputs = field(default_factory=SequenceOutputs)
    stats: SpecStats = field(default_factory=SpecStats)
    streamer: object | None = None
    finished: bool = False

    @classmethod
    def start(
        cls,
        drafter: Drafter,
        state: SpecState,
        processors: LogitsProcessorList,
        criteria: StoppingCriteriaList,
        return_scores: bool = False,
        return_logits: bool = False,
        streamer=None,
    ) -> Row:
        """A row decoding `state.input_ids` `(1, prompt_length)` up to `state.generation_config.max_length`."""
        tokens = TokenBuffer(state.input_ids, state.generation_config.max_length)
        state.input_ids = tokens.view()
        outputs = SequenceOutputs([] if return_scores else None, [] if return_logits else None)
        return cls(drafter, state, tokens, processors, StopCheck(criteria), outputs, streamer=streamer)


def propose_within_room(drafter: Drafter, state: SpecState) -> DraftTree:
    """`drafter`'s tree for `state`, no deeper than the tokens it may still commit less the bonus (and in a static
    cache, no larger than its free slots)."""
    room = max(state.generation_config.max_length - state.seq_len - 1, 0)
    tree = drafter.propose(state, max_depth=room).truncate_depth(room)
    if is_static(state.cache):  # [root] + tree goes in the slots after the committed tokens but the root
        tree = tree.truncate_nodes(static_capacity(state.cache) - state.seq_len)
    return tree


class Layout(Protocol):
    """How the rows of a round sit in the target's cache and in its verification forward."""

    def verify(self, rows: list[Row], trees: list[DraftTree], output_hidden_states: bool):
        """Run the target once over every row's `[root] + tree`; `.logits` of shape `(rows, width, vocab)`,
        row `r`'s `[root] + tree` in its first `len(tree) + 1` slots."""

    def compact(self, rows: list[Row], committed: list[Committed]) -> None:
        """Keep each row's root and accepted nodes in the cache; drop rows that finished."""


class RoundEngine:
    """Runs rounds over rows laid out by `layout`, with `profile.backend`'s kernels around the verification.

    Args:
        screen: greedy verification reads only each row's argmax (the backend may screen the LM head).
        generator: the sampler's random numbers (`do_sample=True`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        profile: TargetProfile,
        layout: Layout,
        do_sample: bool,
        screen: bool,
        want_hidden: bool,
        generator: torch.Generator | None = None,
    ) -> None:
        self.model, self.profile, self.layout = model, profile, layout
        self.do_sample, self.screen, self.want_hidden = do_sample, screen, want_hidden
        self.generator = generator

    def step(self, rows: list[Row], draft: bool = True) -> int:
        """One round over `rows` (those not finished); `draft=False` takes a plain step (empty trees). Returns the
        number of tokens committed."""
        t0 = time.perf_counter()
        trees = [self.propose(row) if draft else self.skip(row) for row in rows]
        t1 = time.perf_counter()
        with self.verification_context(rows, trees):
            out = self.layout.verify(rows, trees, self.want_hidden)
        logits = out.logits.float()  # [rows, width, vocab]
        t2 = time.perf_counter()

        done = [
            self.commit(row, tree, logits[i]) for i, (row, tree) in enumerate(zip(rows, trees, strict=True))
        ]
        self.layout.compact(rows, done)
        for i, (row, tree, c) in enumerate(zip(rows, trees, done, strict=True)):
            if row.streamer is not None:
                row.streamer.put(torch.tensor(c.new_tokens))
            row.finished = c.finished
            if not c.finished:
                self.observe(row, tree, c, out, logits[i], i)
        t3 = time.perf_counter()
        for row in rows:  # each row of the round gets an even share of its times
            row.stats.time_draft += (t1 - t0) / len(rows)
            row.stats.time_verify += (t2 - t1) / len(rows)
            row.stats.time_other += (t3 - t2) / len(rows)
        return sum(len(c.new_tokens) for c in done)

    def verification_context(self, rows: list[Row], trees: list[DraftTree]):
        """The backend's kernels around an eager verification; nothing around a compiled one (its graph is plain
        torch, traced without the backend's patches)."""
        compiled_width = getattr(self.layout, "compiled_width", None)
        if compiled_width is not None and compiled_width(rows, trees) is not None:
            return contextlib.nullcontext()
        return self.profile.backend.verification(self.model, screen=self.screen)

    @staticmethod
    def propose(row: Row) -> DraftTree:
        return propose_within_room(row.drafter, row.state)

    @staticmethod
    def skip(row: Row) -> DraftTree:
        row.drafter.skip_round()
        row.stats.plain_rounds += 1
        return DraftTree.empty()

    def commit(self, row: Row, tree: DraftTree, logits: torch.Tensor) -> Committed:
        """Accept `tree` against the row's logits `(width, vocab)` and commit up to the first stop."""
        rows = logits[: len(tree) + 1]  # [num_nodes + 1, vocab]
        acc = accept(
            tree, rows, row.state.input_ids, row.processors, self.do_sample, self.generator,
            want_scores=row.outputs.scores is not None, backend=self.profile.backend,
        )  # fmt: skip
        committed = commit_tokens(tree, acc, rows, row.tokens, row.stop, row.outputs, row.stats)
        row.state.input_ids = row.tokens.view()
        return committed

    def observe(self, row: Row, tree: DraftTree, c: Committed, out, logits: torch.Tensor, i: int) -> None:
        hidden = None
        if self.want_hidden:  # the layers the drafter reads, at the root and the accepted nodes of this row
            layers = row.drafter.hidden_state_layers
            hidden = select_hidden_states(out.hidden_states, layers)[i : i + 1, c.keep]
        row.state.hidden_states = hidden
        predictions = None
        if row.drafter.requires_target_predictions:
            rows = logits[: len(tree) + 1]
            predictions = (
                torch.tensor(c.predictions, device=rows.device)
                if c.predictions is not None
                else rows.argmax(-1)
            )
        row.drafter.observe(row.state, RoundResult(tree, c.accepted, c.new_tokens, hidden, predictions))
