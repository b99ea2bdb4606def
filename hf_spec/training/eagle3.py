"""`hf-spec train eagle3`: EAGLE-3 heads ([EAGLE-3](https://arxiv.org/abs/2503.01840)) on stored target features.

What is trained (the head module: `hf_spec.methods.eagle3.modeling.Eagle3Head`):
- the input of the first step at position t is the target's low/mid/high states at t-1 (`aux_features`, fused by
  the head's `fc`); every later step feeds the head's own state at t-1 back (no `fc`), as decoding does;
- training-time test: `align_steps` unrolled steps, each attending to the keys of the steps before it through the
  HASS alignment mask (`hf_spec.training.losses.alignment_mask`), so step j sees exactly what drafting depth j
  sees;
- a token-level loss only: soft cross-entropy against the target's distribution on the draft vocabulary (from
  the stored last-layer features through the target's final norm and LM-head rows), plus HASS's top-K
  distillation with `topk` > 0; no feature regression;
- a reduced draft vocabulary (the most frequent trained tokens) stored as `d2t` / `t2d`; a head trained on from
  an existing head's weights (`init_from`: a published head, or one of ours on new data) keeps its vocabulary.

The shared loop (`training/trainer.py`: AdamW, warm-up + decay, `accelerate`, resumable checkpoints, held-out
agreement by depth) trains it through `Eagle3Trainee`, which gives the head the interface that loop expects.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from hf_spec.methods.eagle3.modeling import Eagle3Head, Eagle3HeadConfig
from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint
from hf_spec.training.losses import alignment_mask
from hf_spec.training.trainer import HeadTrainConfig, Unroll, train_head
from hf_spec.training.warm_start import check_draft_vocabulary


@dataclass
class Eagle3TrainConfig(HeadTrainConfig):
    """`HeadTrainConfig` for EAGLE-3: `align_steps` are the training-time-test steps (EAGLE-3 uses 7), `topk` > 0
    adds HASS's top-K distillation (weight `topk_weight`); `feature_weight` is unused (token-level loss only)."""

    align_steps: int = 4
    feature_weight: float = 0.0
    topk: int = 0
    topk_weight: float = 1.0


class Eagle3Trainee(nn.Module):
    """An `Eagle3Head` as the shared trainer loop sees a head: `d2t` holds target ids (the head stores offsets),
    `draft_logits(u)` gives the target's logits on the draft vocabulary from its unit-RMS features, `forward`
    runs one head step. `export()` returns the head with its `d2t`/`t2d` set."""

    def __init__(self, head: Eagle3Head, target_fingerprint: dict, trained: bool = False) -> None:
        super().__init__()
        self.head = head
        self.config = head.config
        self.target = target_fingerprint
        self.register_buffer("d2t", torch.arange(head.config.draft_vocab_size))  # [draft_vocab] target ids
        self._target: list[nn.Module] = []  # the target, kept out of the state dict
        self._lm_weight: torch.Tensor | None = None  # [draft_vocab, hidden] the target's LM-head rows of d2t
        # a trained head keeps its draft vocabulary, norm and LM head (read by the shared loop and attach_target)
        self.keeps_its_vocabulary = self._warm_started = trained
        if trained:
            self.d2t.copy_(head.draft_token_ids())
            if head.embed_tokens is not None:  # its own copy of the embedding: frozen, as the target's is
                head.embed_tokens.requires_grad_(False)

    def attach_target(self, target) -> Eagle3Trainee:
        """Check `target` is the one the features came from, move to its LM head's device, borrow its frozen
        embedding, final norm and LM-head rows; the first time, start the head's norm and LM head from the
        target's (its rows of the draft vocabulary)."""
        check_fingerprint(self.target, target, "this EAGLE-3 training run")
        lm = target.get_output_embeddings().weight
        self.to(lm.device)
        self._target = [target]
        self._lm_weight = lm.detach()[self.d2t].float()
        self.head.use_target_embeddings(target.get_input_embeddings())
        if not self._warm_started:
            with torch.no_grad():
                self.head.lm_head.weight.copy_(self._lm_weight)
                self.head.norm.weight.copy_(target.model.norm.weight.float())
            self._warm_started = True
        return self

    def init_layer_from(self, target, index: int = -1) -> None:
        raise ValueError("EAGLE-3 heads read 2x-wide inputs: --init-from-last-layer does not apply")

    def draft_logits(self, u: torch.Tensor) -> torch.Tensor:
        """The target's logits `(..., draft_vocab)` from its unit-RMS features `u` `(..., hidden)`."""
        if self._lm_weight is None:
            raise RuntimeError("call attach_target(target) first")
        norm = self._target[0].model.norm.weight.float()
        return (u.float() * norm) @ self._lm_weight.T

    def forward(self, hidden, input_ids, position_ids, attention_mask=None, cache=None) -> torch.Tensor:
        """One head step (`Eagle3Head.forward`): `hidden` fused target states or the head's own `(B, n, *)`."""
        return self.head(hidden, input_ids, position_ids, attention_mask, cache)

    def export(self) -> Eagle3Head:
        self.head.set_vocab_mapping(self.d2t)
        return self.head


def unrolled_states(
    trainee: Eagle3Trainee, aux: torch.Tensor, ids: torch.Tensor, position_ids: torch.Tensor, steps: int
) -> Iterator[torch.Tensor]:
    """The head's states `(B, n, H)` at training-time-test steps 1..`steps`.

    Query index i stands for position t = i + 1 (see `Unroll`): step 1 reads the target's fused states at t-1
    (`aux` `(B, n, k * H)`) and x_t (`ids` `(B, n)`); step j > 1 reads the head's step j-1 state at t-1 instead,
    attending to the cached keys of steps 1..j-1 as drafting depth j does (`alignment_mask`)."""
    n = ids.shape[1]
    cache = DynamicCache()
    hidden = aux
    for j in range(1, steps + 1):
        attn = alignment_mask(n, j)[None, None].to(ids.device)
        h = trainee(hidden, ids, position_ids, attn, cache)  # [B, n, H]
        yield h
        # the next step at t reads the head's own state at t-1 (position 0 has none: masked at every depth > 1)
        hidden = torch.cat([trainee.head.fuse(aux[:, :1].to(h.dtype)), h[:, :-1]], dim=1)


def eagle3_step(
    trainee: Eagle3Trainee, batch: dict[str, torch.Tensor], cfg: Eagle3TrainConfig, t2d: torch.Tensor
) -> tuple[torch.Tensor, list[float], dict[str, float]]:
    """All training-time-test steps on a batch (`unrolled_states`): `(loss, top-1 agreement per step, loss
    parts)`; the loss is the token-level loss averaged over the steps."""
    if "aux_features" not in batch:
        raise ValueError(
            "EAGLE-3 training needs features captured with --aux-layers (the target's low/mid/high states)"
        )
    d = Unroll.of(trainee, batch, t2d)
    aux = batch["aux_features"][:, :-1]  # [B, n, k * H] target states at t-1
    loss = torch.zeros((), device=d.ids.device)
    accs, parts = [], {"ce": 0.0, "topk": 0.0}
    states = unrolled_states(trainee, aux, d.ids, d.position_ids, cfg.align_steps)
    for j, h in enumerate(states, start=1):
        logp = torch.log_softmax(
            trainee.head.logits(h[d.trained]).float(), dim=-1
        )  # [N, V_draft] trained rows
        l_tokens, agreement = d.token_loss(logp, j, cfg, parts)
        loss = loss + l_tokens / cfg.align_steps
        accs.append(agreement)
    return loss, accs, parts


def train_eagle3(
    target,
    sequences: list[dict],
    out: str | Path,
    cfg: Eagle3TrainConfig,
    hidden_state_indices: tuple[int, ...],
    progress: bool = True,
    groups: list[str] | None = None,
    heldout: list[dict] | None = None,
    init_from: Eagle3Head | None = None,
) -> tuple[Eagle3Head, dict]:
    """Train (or resume) an EAGLE-3 head for `target` on `sequences` with `aux_features` of the target's
    `hidden_state_indices`; returns `(head, report)`. `groups`, `heldout`: see `train_head`. `init_from`: start
    from this head's weights and draft vocabulary (it must read the same target layers; `cfg.draft_vocab` is
    its draft vocabulary size) instead of a fresh head."""
    torch.manual_seed(cfg.seed)
    if init_from is not None:
        if tuple(init_from.config.hidden_state_indices) != tuple(hidden_state_indices):
            raise ValueError(
                f"the head to start from reads target layers {list(init_from.config.hidden_state_indices)}, the "
                f"features hold layers {list(hidden_state_indices)}: capture the features with the head's layers"
            )
        check_draft_vocabulary(init_from.config.draft_vocab_size, cfg.draft_vocab, "EAGLE-3 head")
    config = Eagle3HeadConfig.for_target(target, cfg.draft_vocab, tuple(hidden_state_indices))
    width = config.fused_width
    if sequences and sequences[0]["aux_features"].shape[-1] != width:
        raise ValueError(
            f"the features hold {sequences[0]['aux_features'].shape[-1]} aux values per token, an EAGLE-3 head "
            f"reading layers {list(hidden_state_indices)} needs {width}"
        )
    head = Eagle3Head(config) if init_from is None else init_from.float()
    trainee = Eagle3Trainee(head, target_fingerprint(target), trained=init_from is not None)
    trainee, report = train_head(target, trainee, sequences, out, cfg, eagle3_step, progress, groups, heldout)
    return trainee.export(), report
