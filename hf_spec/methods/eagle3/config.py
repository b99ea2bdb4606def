"""Config of `eagle3`: EAGLE-2 dynamic draft trees from an EAGLE-3 draft head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from hf_spec.methods.eagle.config import EagleConfig


@dataclass
class Eagle3Config(EagleConfig):
    """EAGLE-2 decoding with an EAGLE-3 draft head ([EAGLE-3](https://arxiv.org/abs/2503.01840), trees of
    [EAGLE-2](https://arxiv.org/abs/2406.16858)).

    The head reads three of the target's inner hidden states (low, mid, high) fused by its `fc` at the first draft
    step, and its own state at the later ones. The tree and drafting fields are `eagle`'s, so an EAGLE-3 head and an
    EAGLE/HASS head compare at one tree budget.

    Args:
        head: folder or Hub id of an EAGLE-3 head: the EAGLE authors' or SpecForge/SGLang layout (`midlayer.*`
            keys), vLLM's speculators layout (`layers.0.*`), or hf-spec's own (the SGLang layout plus
            `hf_spec.json`).
        depth: draft tree depth (head forwards per round).
        topk: children kept per expanded node, and nodes expanded per level.
        total_tokens: verification budget: nodes kept after the global rerank by cumulative log-probability.
        vocab_limit: draft from the first N rows of the head's draft vocabulary only (0 = all). Heads trained by
            `hf-spec train eagle3` keep their draft vocabulary most-frequent first; a head whose draft vocabulary is
            in token-id order (the published checkpoints') is refused, as its first rows are not its likeliest.
        quantize: draft with packed `int8` or `int4` copies of the head's weights (CPU; None: as loaded).
        max_catch_up: feed the head only the latest N committed positions when more wait (0: all).
    """

    method: ClassVar[str] = "eagle3"

    head: str | None = field(default=None, metadata={"help": "EAGLE-3 head folder or Hub id"})
