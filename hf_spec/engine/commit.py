"""Committing a verified round: accept, append the tokens, stop where plain decoding would.

`TokenBuffer` holds a sequence's committed tokens in one preallocated tensor (no `torch.cat` per token);
`StopCheck` runs `generate`'s stopping criteria after every committed token, on the host where every criterion is
of a kind whose answer depends only on the length and the last token (`max_length`, EOS), else by calling them;
`commit_tokens` puts the two together for one sequence's row of the verification logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from hf_spec.engine.acceptance import Acceptance, accept_greedy, accept_greedy_logits, accept_sampling
from hf_spec.engine.outputs import SpecStats
from hf_spec.tree import DraftTree

if TYPE_CHECKING:
    from hf_spec.engine.backend import Backend


class TokenBuffer:
    """A sequence's committed tokens, `(1, length)` views of one growing `(1, capacity)` tensor.

    Views handed out earlier stay valid: committed positions are never written again.
    """

    def __init__(self, input_ids: torch.Tensor, capacity: int) -> None:
        length = input_ids.shape[1]
        self.data = input_ids.new_empty((1, max(capacity, length) + 1))  # [1, capacity]
        self.data[:, :length] = input_ids
        self.length = length
        self.last = int(input_ids[0, -1])  # the last committed token, the next round's root
        self._written: list[int] = []

    def view(self, length: int | None = None) -> torch.Tensor:
        """`torch.LongTensor` of shape `(1, length)`: the first `length` tokens (all committed by default)."""
        return self.data[:, : self.length if length is None else length]

    def write(self, tokens: list[int]) -> None:
        """Write `tokens` after the committed ones (one host-to-device copy); `commit(n)` then keeps `n` of them."""
        end = self.length + len(tokens)
        if end > self.data.shape[1]:
            grown = self.data.new_empty((1, 2 * end))
            grown[:, : self.length] = self.data[:, : self.length]
            self.data = grown
        self.data[0, self.length : end] = torch.tensor(tokens, dtype=self.data.dtype)
        self._written = list(tokens)

    def commit(self, n: int) -> None:
        """Keep the first `n` of the tokens `write` wrote."""
        if n:
            self.last = self._written[n - 1]
        self.length += n


class StopCheck:
    """`generate`'s stopping criteria, asked after every committed token as plain decoding asks them."""

    def __init__(self, criteria: StoppingCriteriaList) -> None:
        self.criteria = criteria
        # a batch row's criteria see its left padding in front (`hf_spec.engine.rows`): lengths count it
        self.pad_length = int(getattr(criteria, "pad_length", 0))
        # every criterion depends only on the length and the last token: answered on the host, no transfer
        self.on_host = all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in criteria)
        self.max_length = min(
            (c.max_length for c in criteria if isinstance(c, MaxLengthCriteria)), default=None
        )
        eos = [c.eos_token_id for c in criteria if isinstance(c, EosTokenCriteria)] if self.on_host else []
        self.eos: set[int] = {int(t) for ids in eos for t in torch.as_tensor(ids).flatten().tolist()}

    def first_stop(
        self,
        buffer: TokenBuffer,
        new_tokens: list[int],
        scores_out: list[torch.Tensor] | None,
        scores: list[torch.Tensor],
    ) -> int | None:
        """Index of the first of `new_tokens` (written to `buffer` after its committed ones) after which a
        criterion fires, or None. Appends to `scores_out` (when given) the scores behind each token up to there,
        so a criterion sees every score so far, as in plain decoding."""
        start = buffer.length
        for j, tok in enumerate(new_tokens):
            if scores_out is not None:
                scores_out.append(scores[j][None].clone())
            if self.on_host:
                length = self.pad_length + start + j + 1
                fired = tok in self.eos or (self.max_length is not None and length >= self.max_length)
            else:
                shown = tuple(scores_out) if scores_out is not None else None
                fired = bool(self.criteria(buffer.view(start + j + 1), shown).all())
            if fired:
                return j
        return None


@dataclass
class Committed:
    """What one round committed for one sequence.

    Args:
        new_tokens: accepted + bonus, cut at a stop.
        accepted: accepted node indices.
        keep: block slots whose keys stay cached: the root (0) and accepted node `i` at `i + 1`.
        finished: a stopping criterion fired.
        predictions: the target's argmax at every verification row, where the rule computed it.
    """

    new_tokens: list[int]
    accepted: list[int]
    keep: list[int]
    finished: bool
    predictions: list[int] | None = None


@dataclass
class SequenceOutputs:
    """What a sequence returns besides its tokens, where `generate` was asked for it."""

    scores: list[torch.Tensor] | None = None  # each [1, vocab]
    logits: list[torch.Tensor] | None = None  # each [1, vocab]
    new_tokens: list[int] = field(default_factory=list)


def accept(
    tree: DraftTree,
    logits: torch.Tensor,
    prefix: torch.Tensor,
    processors: LogitsProcessorList,
    do_sample: bool,
    generator: torch.Generator | None,
    want_scores: bool,
    backend: Backend | None = None,
) -> Acceptance:
    """Accept `tree` against its verification logits `(num_nodes + 1, vocab)`; `prefix` `(1, seq_len)` is what
    the processors see before the accepted path. A `backend` with an acceptance kernel accepts on the device."""
    if backend is not None:
        acc = backend.accept(tree, logits, prefix, processors, do_sample, generator, want_scores)
        if acc is not None:
            return acc
    if not do_sample and not processors:
        return accept_greedy_logits(tree, logits, want_scores)
    score_row = _scorer(logits, prefix, tree, processors)
    return accept_sampling(tree, score_row, generator) if do_sample else accept_greedy(tree, score_row)


def commit_tokens(
    tree: DraftTree,
    acc: Acceptance,
    logits: torch.Tensor,
    buffer: TokenBuffer,
    stop: StopCheck,
    outputs: SequenceOutputs,
    stats: SpecStats,
) -> Committed:
    """Append the accepted tokens and the bonus to `buffer` up to the first stop; record the returned scores /
    logits in `outputs` where asked, and count the round in `stats`."""
    tokens = tree.tokens.tolist()
    new_tokens = [tokens[i] for i in acc.accepted] + [acc.bonus]
    buffer.write(new_tokens)
    cut = stop.first_stop(buffer, new_tokens, outputs.scores, acc.scores)
    if cut is not None:
        new_tokens = new_tokens[: cut + 1]
    buffer.commit(len(new_tokens))
    keep = [0] + [i + 1 for i in acc.accepted]
    if outputs.logits is not None:
        outputs.logits.extend(logits[k][None].clone() for k in keep[: len(new_tokens)])
    outputs.new_tokens.extend(new_tokens)
    stats.target_forwards += 1
    stats.new_tokens += len(new_tokens)
    stats.draft_tokens += len(tree)
    stats.accepted_tokens += len(acc.accepted)
    stats.record_round(int(tree.depth.max()) if len(tree) else 0, len(acc.accepted))
    return Committed(new_tokens, acc.accepted, keep, cut is not None, acc.predictions)


def _scorer(logits: torch.Tensor, prefix: torch.Tensor, tree: DraftTree, processors: LogitsProcessorList):
    """Row scores with the logits processors applied to the row's own prefix (committed + accepted path)."""
    if not processors:
        return lambda row, path: logits[row]
    tokens = tree.tokens.to(prefix.device)

    def score_row(row: int, path: list[int]) -> torch.Tensor:
        full = torch.cat([prefix, tokens[path].view(1, -1)], dim=1) if path else prefix
        return processors(full, logits[row : row + 1].clone())[0]

    return score_row
