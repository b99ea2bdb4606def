from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from hf_spec.config import MethodConfig, read_config


@dataclass
class EagleConfig(MethodConfig):
    """EAGLE-2 decoding with an EAGLE or HASS draft head ([EAGLE-2](https://arxiv.org/abs/2406.16858),
    [HASS](https://arxiv.org/abs/2408.15766)).

    Args:
        head: folder of a head saved by `hf-spec train eagle` (Hub-style: config.json + model.safetensors).
        depth: draft tree depth (head forwards per round).
        topk: children kept per expanded node, and nodes expanded per level.
        total_tokens: verification budget: nodes kept after the global rerank by cumulative log-probability.
    """

    method: ClassVar[str] = "eagle"
    main_arg: ClassVar[str] = "head"

    head: str = field(default="", metadata={"help": "draft head folder"})
    depth: int = field(default=5, metadata={"help": "draft tree depth"})
    topk: int = field(default=4, metadata={"help": "children per expanded node / nodes expanded per level"})
    total_tokens: int = field(default=16, metadata={"help": "nodes verified per round (after the rerank)"})

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 1:
            raise ValueError("eagle: depth, topk and total_tokens must be >= 1")

    @classmethod
    def from_cli_arg(cls, arg: str | None) -> EagleConfig:
        """`eagle:<head folder>` (a folder with the head's config.json) or `eagle:<config.json>`."""
        if arg and os.path.isdir(arg) and os.path.exists(os.path.join(arg, "config.json")):
            recipe = os.path.join(arg, "hf_spec_config.json")
            data = read_config(recipe) if os.path.exists(recipe) else {}
            data.pop("method", None)
            return cls(**{**data, "head": arg})
        return super().from_cli_arg(arg)
