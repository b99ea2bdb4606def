"""What the EAGLE and Lyanna drafters share: loading a head folder onto its target, and the head's KV cache of
committed positions, which catches up with the target's features after every verification."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from hf_spec.core.config import MethodConfig, read_config
from hf_spec.core.drafter import Drafter, RoundResult, SpecState
from hf_spec.core.hub_ids import HEAD_CONFIG_FILES, resolve_folder, resolve_head_folder
from hf_spec.core.specs import HEAD_IN_THIS_FOLDER
from hf_spec.engine.compiled_step import StepSpec, draft_steps, rewindable_cache
from hf_spec.engine.target.cache import cache_length
from hf_spec.engine.target.profile import target_profile
from hf_spec.engine.target.static import static_capacity
from hf_spec.heads.base import DraftHeadModel
from hf_spec.heads.features import unit_features
from hf_spec.heads.published import load_published_head
from hf_spec.io.integrity import check_finite, verify_checksums
from hf_spec.kernels.weight_only import QuantizedWeight, quantize_linears
from hf_spec.tree.masks import causal_mask


def load_draft_head(head_cls: type[DraftHeadModel], path: str, target, method: str) -> DraftHeadModel:
    if not path:
        raise ValueError(
            f"{method} needs a head folder: {method}:<folder> (train one with `hf-spec train {method}`)"
        )
    name, path = path, resolve_head_folder(path, f"{method} head")  # a Hub id -> its local snapshot
    config_file = os.path.join(path, "config.json")
    try:
        with open(config_file) as f:
            found = json.load(f).get("model_type")
    except FileNotFoundError:
        raise ValueError(f"cannot load the {method} head at {path!r}: no config.json there") from None
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"cannot load the {method} head at {path!r}: bad config.json ({err})") from None
    expected = head_cls.config_class.model_type
    what = f"the {method} head at {path!r}"
    if found == expected:  # before reading the weights: a damaged file is named as such, not by its parser
        verify_checksums(path, what)
    if found != expected:
        published = load_published_head(path, target, method, name)  # EAGLE's own layout, ...
        if published is not None:
            return published
        raise ValueError(f"{path!r} holds a {found!r} model, not a {method} head ({expected!r})")
    try:
        head, info = head_cls.from_pretrained(
            path, dtype=next(target.parameters()).dtype, output_loading_info=True
        )
    except Exception as err:  # noqa: BLE001 - truncated safetensors, bad config fields, ...: all mean a bad folder
        raise ValueError(f"cannot load the {method} head at {path!r}: {type(err).__name__}: {err}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ValueError(
            f"the {method} head at {path!r} lacks weights {missing[:5]}: a damaged or foreign file"
        )
    check_finite(head, what)
    vocab, d2t = target.get_output_embeddings().weight.shape[0], getattr(head, "d2t", None)
    if d2t is not None and d2t.numel() and not 0 <= int(d2t.min()) <= int(d2t.max()) < vocab:
        raise ValueError(f"{what}: its draft vocabulary (d2t) names token ids outside the target's {vocab}")
    return head.eval().attach_target(target)


def head_config_from_cli_arg(cls: type[MethodConfig], arg: str | None) -> MethodConfig:
    """`method:<head folder>` (a folder with the head's config.json; its own recipe supplies the decoding
    parameters), `method:<Hub id of such a folder>` or `method:<config.json>`."""
    folder = resolve_folder(arg, f"{cls.method} head", HEAD_CONFIG_FILES) if arg else arg
    if folder and os.path.isdir(folder) and os.path.exists(os.path.join(folder, "config.json")):
        recipe = os.path.join(folder, "hf_spec_config.json")
        data = read_config(recipe) if os.path.exists(recipe) else {}
        found = data.pop("method", cls.method)
        if found != cls.method:
            raise ValueError(f"{arg!r} is a {found} head folder, not a {cls.method} one (use {found}:{arg})")
        return cls.from_dict({**data, "head": arg})
    config = MethodConfig.from_cli_arg.__func__(cls, arg)
    if arg and getattr(config, "head", None) == HEAD_IN_THIS_FOLDER:  # a head folder's own recipe
        config.head = arg if os.path.isdir(arg) else os.path.dirname(os.path.abspath(arg))
    return config


class HeadDrafter(Drafter):
    """Base of head drafters. `self.cache` holds the head's keys/values of committed positions only;
    `pending_features` are the target's unit features f_{p-1} of committed positions p not fed yet.

    The head's forwards are called through the attributes `head_steps` names (`self.head_step(features, ids,
    positions, mask, cache)` for EAGLE heads): the head's own methods in an eager generation, the same compiled at
    fixed widths over a static head cache in a compiled one (`hf_spec.engine.compiled_step`).
    """

    # slots the head's static cache holds beyond the target's: a round's provisional tree levels
    DRAFT_SLOTS = 256

    requires_hidden_states = True
    head_cls: type[DraftHeadModel] = DraftHeadModel

    def __init__(self, config, model, tokenizer=None, head: DraftHeadModel | None = None) -> None:
        super().__init__(config, model, tokenizer)
        if head is not None:  # drafted in the target's precision, as a head loaded from a folder is
            dtype = next(model.parameters()).dtype
            if dtype.is_floating_point and next(head.parameters()).dtype != dtype:
                head = head.to(dtype)
            self.head = head.attach_target(model)
        else:
            self.head = load_draft_head(self.head_cls, config.head, model, config.method)
        limit, full = getattr(config, "vocab_limit", 0), self.head.config.draft_vocab_size
        if limit > full:
            raise ValueError(
                f"{config.method}: vocab_limit {limit} exceeds the head's draft vocabulary ({full})"
            )
        topk = getattr(config, "topk", 0)
        if topk > (limit or full):
            raise ValueError(
                f"{config.method}: topk {topk} exceeds the {limit or full} tokens the head drafts from (its draft "
                f"vocabulary{', cut by vocab_limit' if limit else ''}): use topk <= {limit or full}"
            )
        # the LM-head rows drafted from: d2t is most-frequent first, so the first N rows are the N most frequent
        self.lm_weight = self.head.parts.lm_weight[: limit or full]
        scheme = getattr(config, "quantize", "")
        # packed copies for drafting (the head module itself stays as loaded)
        # (a head with its own LM head, as EAGLE-3's, holds those rows in a layer: they are packed once, below)
        self.quantized = quantize_linears(self.head, scheme, skip=self.lm_weight) if scheme else {}
        self.lm_quantized = QuantizedWeight.from_weight(self.lm_weight, scheme) if scheme else None
        self.norm = model.model.norm
        self.device = self.lm_weight.device  # the head's and the target LM head's
        self.dtype = next(self.head.parameters()).dtype  # the target's: the head runs in its precision
        # the head's layer is the target family's: it attends as the target's layers do in the loop, through the
        # target's kernel backend where the family dispatches through transformers' attention interface
        profile = target_profile(model)
        self.backend = profile.backend
        attention = getattr(self.head.layer, "self_attn", None)
        self.layer_config = getattr(attention, "config", None) if profile.dispatches_attention else None
        self.cache = DynamicCache()
        self.pending_features: list[torch.Tensor] = []  # [n, H] chunks
        # positions the head's cache lacks: cached before this call (no features) or dropped by `max_catch_up`
        self.skipped = 0
        self._use_steps(None)

    def head_steps(self) -> dict[str, Callable | StepSpec]:
        """The head's forwards by the attribute they are called through, each `step(*rows, mask, cache)` with
        `(1, n, ...)` rows, returning `(1, n, hidden)` (a bare callable, compiled up to `compiled_rows` rows), or a
        `StepSpec` saying how to compile it."""
        return {"head_step": self.head}

    def compiled_rows(self) -> int:
        """The most rows a compiled head step takes (wider calls, as the prompt's catch-up, run eagerly): a round's
        accepted positions or a tree level's beam."""
        cfg = self.config
        return max(getattr(cfg, "depth", 1) + 1, getattr(cfg, "topk", 1))

    def _use_steps(self, settings, capacity: int = 0) -> None:
        """Point the step attributes at the head's forwards: as they are (`settings` None), or compiled over a
        static head cache of `capacity` slots, both kept on the drafter so later compiled generations reuse what
        was compiled (`hf_spec.engine.compiled_step.draft_steps`)."""
        cache = None
        if settings is not None:
            cache = self.__dict__.get("_head_static_cache")
            if cache is None or static_capacity(cache) != capacity:
                cache = self.__dict__["_head_static_cache"] = rewindable_cache(capacity)
            cache.layers[0].crop_to(0)
            self.cache = cache
        steps = {
            name: step if isinstance(step, StepSpec) else StepSpec(step, self.compiled_rows())
            for name, step in self.head_steps().items()
        }
        for name, step in draft_steps(self, cache, settings, steps, modules=(self.head,)).items():
            setattr(self, name, step)

    @contextlib.contextmanager
    def fast_head(self) -> Iterator[None]:
        """Inside the block the head's linears run packed (`quantize`), its attention as the target's in the loop
        (the target's kernel backend)."""
        with (
            self.backend.packed_linears(self.head, self.quantized),
            self.backend.attention(self.layer_config),
        ):
            yield

    def lm_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Normed head states `(n, H)` -> draft-vocabulary logits `(n, V_draft)` (`vocab_limit` rows)."""
        if self.lm_quantized is not None:
            return self.lm_quantized.linear(normed)
        return self.backend.linear(normed, self.lm_weight)

    def for_another_row(self) -> HeadDrafter:
        """A copy sharing the loaded head and packed weights, with its own head cache."""
        twin = copy.copy(self)
        twin.cache, twin.pending_features = DynamicCache(), []
        twin.__dict__.pop("_hf_spec_draft_steps", None)
        twin.__dict__.pop("_head_static_cache", None)
        twin._use_steps(None)
        return twin

    def begin(self, state: SpecState) -> None:
        """Take the target features of the prompt positions prefilled in this call. Positions whose keys came in
        a passed-in cache (`past_key_values`) have none: the head starts after them (`self.skipped`); with a
        one-token or wholly cached prompt it sits out the first round."""
        self.backend = state.backend  # this generation's (`HF_SPEC_BACKEND` may have changed since the last)
        if state.compile_settings is None:
            self.cache = DynamicCache()
            self._use_steps(None)
        else:
            self._use_steps(state.compile_settings, static_capacity(state.cache) + self.DRAFT_SLOTS)
        seen = 0 if state.hidden_states is None else state.hidden_states.shape[1]
        if seen > state.seq_len - 1:
            raise ValueError(
                f"{self.config.method}: {seen} prompt features for {state.seq_len - 1} positions"
            )
        self.skipped = state.seq_len - 1 - seen
        self.pending_features = [self.target_features(state.hidden_states[0])] if seen else []

    def can_draft(self) -> bool:
        """False before the head has seen any target features (the first round after a one-token prompt)."""
        return bool(self.pending_features) or cache_length(self.cache) > 0

    def target_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's post-norm last-layer states `(n, H)` -> the head's input features `(n, H)`: unit features,
        or the states themselves for heads trained on those (published EAGLE-1/2 checkpoints)."""
        if getattr(self.head, "reads_post_norm_states", False):
            return hidden.to(self.dtype)
        return unit_features(hidden, self.norm).to(self.dtype)

    def observe(self, state: SpecState, result: RoundResult) -> None:
        self.pending_features.append(self.target_features(result.hidden_states[0]))

    def end(self, state: SpecState) -> None:
        self.cache, self.pending_features = DynamicCache(), []

    def catch_up(self, state: SpecState, first_step) -> torch.Tensor:
        """Feed the pending committed positions (up to the root) through `first_step(features, ids, positions,
        mask, cache)`; return the head state at the root `(H,)`."""
        return first_step(*self.catch_up_rows(state), self.cache)[0, -1]

    def catch_up_rows(
        self, state: SpecState
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pending committed positions (up to the root) as one head forward takes them, taken off the pending
        list: `(features (1, P, F), ids (1, P), positions (1, P), causal mask (1, 1, P, past + P))`."""
        features = torch.cat(self.pending_features)  # [P, H]
        self.pending_features = []
        past = cache_length(self.cache)
        first = state.seq_len - features.shape[0]
        if first != self.skipped + past + 1:
            raise RuntimeError(
                f"{self.config.method} head cache out of step: holds {past} positions after {self.skipped} "
                f"skipped, next is {first}"
            )
        limit = getattr(self.config, "max_catch_up", 0)
        if limit and features.shape[0] > limit:  # the older ones never enter the head's cache
            dropped = features.shape[0] - limit
            features, first = features[dropped:], first + dropped
            self.skipped += dropped
        ids = state.input_ids[:, first:]
        positions = torch.arange(first, state.seq_len, device=self.device).view(1, -1)
        return features[None], ids, positions, causal_mask(features.shape[0], past, self.dtype, self.device)
