"""Pieces every head trainer shares: warm-up + linear-decay schedule and resumable checkpoints."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch


def warmup_linear_decay(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(warmup_steps, 1)
        return max(0.0, (total_steps - step) / max(total_steps - warmup_steps, 1))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class Checkpoint:
    """`<folder>/checkpoint.pt`: model + optimizer + scheduler + step + RNG states, written atomically."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.path = Path(folder) / "checkpoint.pt"

    def exists(self) -> bool:
        return self.path.exists()

    def save(self, model, optimizer, scheduler, step: int, extra: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "extra": extra,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.path)

    def load(self, model, optimizer, scheduler) -> tuple[int, dict[str, Any]]:
        try:
            state = torch.load(self.path, weights_only=False, map_location="cpu")  # resumable on any device
        except Exception as err:  # noqa: BLE001 - any unreadable file is reported the same way
            raise ValueError(
                f"cannot resume from {self.path}: corrupt checkpoint ({err}); delete it to restart"
            ) from None
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return int(state["step"]), state["extra"]

    def peek_extra(self) -> dict[str, Any]:
        return torch.load(self.path, weights_only=False, map_location="cpu")["extra"]
