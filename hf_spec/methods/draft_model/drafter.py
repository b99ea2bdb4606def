from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_spec.core.compat import cache_kwargs
from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.engine.target.cache import compact_cache, crop_cache
from hf_spec.engine.target.profile import target_profile
from hf_spec.engine.target.windows import sequence_mask, target_cache
from hf_spec.methods.draft_model.config import DraftModelConfig
from hf_spec.methods.stepwise import StepwiseDrafter
from hf_spec.tree.draft_tree import DraftTree


def load_draft_model(name_or_path: str | None, target: PreTrainedModel) -> PreTrainedModel:
    """The draft model's weights (a known model name, folder or Hub id) in the target's dtype, on its device; its
    tokenizer is not needed (the vocabularies are compared instead)."""
    if not name_or_path:
        raise ValueError("draft-model needs a draft model: `draft-model:<name or path>`")
    from transformers import AutoModelForCausalLM

    from hf_spec.models import resolve_model

    path = resolve_model(name_or_path)
    try:
        draft = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load the draft model {name_or_path!r} ({path}): {err}") from None
    return draft.to(target.device).eval()


class DraftModelDrafter(Drafter, StepwiseDrafter):
    """Greedy chain (plus optional sibling leaves) from a separate small model with its own KV cache."""

    config: DraftModelConfig

    def __init__(
        self, config: DraftModelConfig, model, tokenizer=None, draft_model: PreTrainedModel | None = None
    ):
        super().__init__(config, model, tokenizer)
        if draft_model is None:
            draft_model = load_draft_model(config.model, model)
        elif draft_model.device != model.device:
            raise ValueError(
                f"the draft model is on {draft_model.device}, the target on {model.device}: "
                "move the draft model to the target's device"
            )
        target_vocab = model.get_output_embeddings().weight.shape[0]
        draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target_vocab:
            raise ValueError(
                f"draft model vocabulary ({draft_vocab}) differs from the target's ({target_vocab}): "
                "draft-model needs the same tokenizer"
            )
        self.draft = draft_model.eval()
        self.cache: DynamicCache | None = None
        self.cached = 0  # draft cache holds input_ids[:cached] plus self.pending drafted tokens
        self.pending: list[int] = []

    def for_another_row(self) -> DraftModelDrafter:
        """A drafter sharing this one's loaded draft model, with its own draft cache."""
        return type(self)(self.config, self.model, self.tokenizer, draft_model=self.draft)

    def begin(self, state: SpecState) -> None:
        self.cache = target_cache(self.draft)
        self.cached = 0
        self.pending = []

    def _next_logits(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        position_ids = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)
        out = self.draft(
            input_ids=ids,
            position_ids=position_ids,
            **cache_kwargs(self.draft, self.cache),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float()

    @contextlib.contextmanager
    def _fast(self) -> Iterator[None]:
        """The draft model's linears and attention on the target's kernel backend, as the target's in the loop."""
        with target_profile(self.model).backend.drafting(self.draft, linears=True):
            yield

    @torch.no_grad()
    def propose(self, state: SpecState, max_depth: int) -> DraftTree:
        cfg = self.config
        depth = min(cfg.num_draft_tokens, max_depth)
        if depth <= 0:
            return DraftTree.empty()
        chain: list[int] = []
        siblings: list[list[int]] = []
        self.pending = []
        with self._fast():
            logits = self._next_logits(state.input_ids[:, self.cached :], self.cached)
            self.cached = state.seq_len
            for step in range(depth):
                top = torch.topk(logits, cfg.siblings + 1)
                chain.append(int(top.indices[0]))
                siblings.append(top.indices[1:].tolist())
                if step + 1 < depth:
                    logits = self._next_logits(top.indices[:1].view(1, 1), self.cached + len(self.pending))
                    self.pending.append(chain[-1])
        return DraftTree.chain_with_siblings(chain, siblings if cfg.siblings else None)

    def observe(self, state: SpecState, result: RoundResult) -> None:
        # keep the drafted tokens the target committed, drop the rest
        agree = 0
        for drafted, committed in zip(self.pending, result.new_tokens, strict=False):
            if drafted != committed:
                break
            agree += 1
        self.cached += agree
        self.pending = []
        crop_cache(self.cache, self.cached)

    def end(self, state: SpecState) -> None:
        self.cache = None

    # ---- step-wise drafting (StepwiseDrafter hooks) ----
    def _step_prepare(self, state: SpecState):
        if self.cache is None:
            self.begin(state)
        if self.cached > state.seq_len - 1:  # a kept draft token matched the bonus: the root is fed again
            self.cached = state.seq_len - 1
            crop_cache(self.cache, self.cached)
        return self.cached, state.input_ids[0, self.cached : -1].tolist()

    def _step_forward(self, ids, position_ids, mask) -> torch.Tensor:
        with self._fast():
            out = self.draft(
                input_ids=ids,
                position_ids=position_ids,
                attention_mask=sequence_mask(self.draft, mask, position_ids),
                **cache_kwargs(self.draft, self.cache),
                use_cache=True,
            )
        return out.logits[0].float()

    def _step_compact(self, past: int, keep: list[int]) -> None:
        compact_cache(self.cache, past, keep)

    def _step_finish(self, state: SpecState, start: int, kept: list[int]) -> None:
        # the cache holds the committed tokens (root included) then the fed chain: `observe` keeps what is accepted
        self.cached = state.seq_len
        self.pending = kept[state.seq_len - start :]
        crop_cache(self.cache, start + len(kept))

    def _step_where(self):
        param = next(self.draft.parameters())
        return param.dtype, param.device
