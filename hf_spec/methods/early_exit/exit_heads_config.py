"""Configuration of a set of exit heads (saved as the folder's `config.json`)."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_TYPE = "hf-spec-exit-heads"


@dataclass
class ExitHeadsConfig:
    """Exit heads for one target: one `ExitAdapter` per listed layer, read by the target's frozen final norm and
    LM head (a tuned-lens style translator, Belrose et al. 2023, used for self-speculation as in LayerSkip).

    Args:
        layers: exit layers; layer `k` reads the hidden state after the target's first `k` decoder layers.
        hidden_size: the target's hidden size.
        rank: rank of each adapter's low-rank correction.
        rms_norm_eps: epsilon of the adapter's input normalisation.
        draft_vocab_size: size of the draft vocabulary saved with the heads (the most frequent tokens of the
            training data): exits may take their argmax over it only, which reads a fraction of the LM head.
        target: `hf_spec.models.fingerprint.target_fingerprint` of the target the heads were trained for.
        target_name: the name or path the target was loaded from (informative).
        training: what the trainer recorded (data, steps, losses, measured agreement, command).
    """

    layers: list[int] = field(default_factory=list, metadata={"help": "exit layers (after k decoder layers)"})
    hidden_size: int = field(default=0, metadata={"help": "the target's hidden size"})
    rank: int = field(default=64, metadata={"help": "rank of each adapter's low-rank correction"})
    rms_norm_eps: float = field(default=1e-6, metadata={"help": "epsilon of the adapter input norm"})
    draft_vocab_size: int = field(
        default=0, metadata={"help": "size of the saved draft vocabulary (frequent training tokens); 0: none"}
    )
    target: dict[str, Any] = field(default_factory=dict, metadata={"help": "target fingerprint"})
    target_name: str = field(default="", metadata={"help": "target name or path (informative)"})
    training: dict[str, Any] = field(default_factory=dict, metadata={"help": "training record"})

    def __post_init__(self) -> None:
        self.layers = sorted(int(k) for k in self.layers)
        if len(set(self.layers)) != len(self.layers) or any(k < 1 for k in self.layers):
            raise ValueError(f"exit layers must be distinct and >= 1, got {self.layers}")
        if self.rank < 0:
            raise ValueError(f"rank must be >= 0, got {self.rank}")

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}

    def save(self, folder: str | os.PathLike) -> None:
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | os.PathLike) -> ExitHeadsConfig:
        file = Path(folder) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no exit heads at {folder} (missing config.json)")
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{file} is not readable JSON ({err})") from None
        if not isinstance(data, dict) or data.pop("model_type", None) != MODEL_TYPE:
            raise ValueError(f"{file} is not an exit-heads config (model_type must be {MODEL_TYPE!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
