"""The drafter interface every method implements, and the state the loop shares with it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from transformers import Cache, GenerationConfig, PreTrainedModel

from hf_spec.core.compat import cache_kwargs
from hf_spec.core.config import MethodConfig
from hf_spec.tree import DraftTree

if TYPE_CHECKING:
    from hf_spec.engine.backend import (
        Backend,  # the engine passes one; drafters only call its context managers
    )
    from hf_spec.engine.target.compiled import CompileSettings


def target_forward(
    model: PreTrainedModel,
    cache: Cache,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | dict | None,
    output_hidden_states: bool,
):
    """The stock verification forward of `input_ids` `(rows, width)` at `position_ids` `(rows, width)` into
    `cache`, with the 4D mask `attention_mask` (`None`: causal). The kernel backend is entered by the caller."""
    return model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        **cache_kwargs(model, cache),
        use_cache=True,
        output_hidden_states=output_hidden_states,
    )


@dataclass
class SpecState:
    """What the loop knows, shared with the drafter.

    Args:
        model: the target model.
        cache: the target's KV cache; it holds every committed token but the last (the next root).
        input_ids: `torch.LongTensor` of shape `(1, sequence_length)`, the committed tokens (prompt included).
        generation_config: the resolved generation config of this call.
        hidden_states: with `requires_hidden_states`, the target's last-layer hidden states of the positions
            committed by the last forward, `(1, num_positions, hidden_size)`; after the prefill these are the
            prompt's positions but the last. A drafter naming other `hidden_state_layers` gets those layers'
            states joined, `(1, num_positions, len(layers) * hidden_size)`.
        uses_verify_forward: the loop verifies through `Drafter.verify_forward` (hf-spec's loop); False in
            transformers' assisted loop, which runs its own forward.
        backend: the kernel backend of the target's forwards (`hf_spec.engine.backend`); a drafter enters
            `backend.drafting(...)` around its own forwards through the target's layers or a draft model. The
            engine passes the one the target's profile chose (`hf_spec.engine.target.profile`).
        compile_settings: set when this generation verifies compiled (`hf_spec.engine.target.compiled`): a drafter
            whose steps are model forwards compiles them as these say, at fixed widths
            (`hf_spec.engine.compiled_step`); None: eager.
    """

    model: PreTrainedModel
    cache: Cache
    input_ids: torch.Tensor  # [1, seq_len]
    generation_config: GenerationConfig
    hidden_states: torch.Tensor | None = None  # [1, num_positions, hidden_size]
    uses_verify_forward: bool = True
    backend: Backend | None = None
    compile_settings: CompileSettings | None = None

    @property
    def do_sample(self) -> bool:
        return bool(self.generation_config.do_sample)

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


@dataclass
class RoundResult:
    """What one verification round decided.

    Args:
        tree: the verified tree.
        accepted: accepted node indices, root's child first.
        new_tokens: the committed tokens (accepted + bonus, cut at a stop), in order.
        hidden_states: with `requires_hidden_states`, `(1, len(accepted) + 1, hidden_size)`: the target's
            last-layer hidden states at the root and the accepted nodes.
        target_predictions: with `requires_target_predictions`, `torch.LongTensor` of shape `(num_nodes + 1,)`:
            the target's argmax (raw logits) at the root (row 0) and after every node (row `i + 1`), also
            off the accepted path.
    """

    tree: DraftTree
    accepted: list[int]
    new_tokens: list[int]
    hidden_states: torch.Tensor | None = None
    target_predictions: torch.Tensor | None = None  # [num_nodes + 1]


class Drafter(ABC):
    """Proposes token trees for the round engine (`hf_spec.engine`).

    Lifecycle per `generate` call: `begin` (after the prompt prefill) -> (`propose` -> `observe`)* -> `end`.
    A drafter reports the exact distribution it sampled each node from (`DraftTree.draft_probs`) or
    leaves it out for deterministic proposals; the verifier is exact in both cases.
    """

    requires_hidden_states: ClassVar[bool] = False
    # with `requires_hidden_states`: the indices into the target's `output_hidden_states` whose states (joined along
    # the last dimension) `SpecState.hidden_states` and `RoundResult.hidden_states` carry; -1: the last, after the
    # final norm. A drafter may set its own per instance (EAGLE-3 reads three inner layers).
    hidden_state_layers: tuple[int, ...] = (-1,)
    requires_target_predictions: ClassVar[bool] = False  # fill RoundResult.target_predictions
    # keeps its state to itself and never touches the target's cache or forward: one copy per row can draft
    # for a batch verified in one forward (`hf_spec.engine.batch`)
    batchable: ClassVar[bool] = False

    def __init__(self, config: MethodConfig, model: PreTrainedModel, tokenizer=None) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer

    def begin(self, state: SpecState) -> None:  # noqa: B027 - optional hook
        """Reset per-generation state."""

    def for_another_row(self) -> Drafter:
        """A drafter of the same recipe with per-generation state of its own (for another row of a batch)."""
        return type(self)(self.config, self.model, self.tokenizer)

    @abstractmethod
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        """Return a tree below the root `state.input_ids[0, -1]`, no deeper than `max_depth`."""

    @property
    def continues_verification(self) -> bool:
        """True where `propose` begins the verification forward that `verify_forward` finishes (HiSpec, Talon's
        pre-verification): a wrapper verifying trees of its own cannot drive such a drafter."""
        return False

    def verify_forward(
        self,
        state: SpecState,
        tree: DraftTree,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        output_hidden_states: bool,
    ):
        """The verification forward of `[root] + tree`: the stock full target forward.

        A drafter that already ran the target's first layers on the tree (HiSpec) overrides it to continue from
        there. An override must return what the stock forward returns up to float rounding: `.logits` of shape
        `(1, num_nodes + 1, vocab_size)` (and `.hidden_states` when `output_hidden_states`), and leave every layer
        of `state.cache` holding the block `[root] + tree` at positions `[past, past + num_nodes + 1)`.

        Args:
            input_ids: `torch.LongTensor` of shape `(1, num_nodes + 1)`, `[root] + tree.tokens`.
            position_ids: `torch.LongTensor` of shape `(1, num_nodes + 1)`.
            attention_mask: additive 4D tree mask `(1, 1, num_nodes + 1, past + num_nodes + 1)`, `None` for a
                chain (causal).
        """
        return target_forward(
            state.model, state.cache, input_ids, position_ids, attention_mask, output_hidden_states
        )

    def skip_round(self) -> None:  # noqa: B027 - optional hook
        """No tree of this drafter is verified this round (a batch took a plain step); `observe` follows as
        usual. A drafter that keeps something from its last proposal for the next one drops it here."""

    def observe(self, state: SpecState, result: RoundResult) -> None:  # noqa: B027 - optional hook
        """See what was verified; `state` already holds the new tokens."""

    def end(self, state: SpecState) -> None:  # noqa: B027 - optional hook
        """Release per-generation state."""


def check_wrappable(inner: Drafter, wrapper: str) -> None:
    """Raise where `wrapper` (postuse, talon) cannot drive `inner`: a drafter that continues its own verification
    forward (HiSpec) or another of the same wrapper."""
    if inner.config.method == wrapper:
        raise ValueError(f"{wrapper} wraps another drafter, not itself")
    if inner.continues_verification:
        raise ValueError(
            f"{wrapper} cannot wrap {inner.config.method}: it runs its own verification forward, "
            "which the wrapper's tree replaces"
        )
