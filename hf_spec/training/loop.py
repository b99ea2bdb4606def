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
    """`<folder>/checkpoint.pt`: model + optimizer + scheduler + step + RNG states + `extra` (JSON-like: dicts,
    lists, str, numbers), written atomically and read with `torch.load(weights_only=True)`, which builds tensors and
    plain values only: a planted file cannot run code."""

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
        save_checkpoint(state, self.path)

    def load(self, model, optimizer, scheduler) -> tuple[int, dict[str, Any]]:
        state = self.read()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        return int(state["step"]), state["extra"]

    def peek_extra(self) -> dict[str, Any]:
        return self.read()["extra"]

    def read(self) -> dict[str, Any]:
        """The saved state; `ValueError` naming the file for anything unreadable."""
        return load_checkpoint(self.path, ("model", "optimizer", "scheduler", "step", "extra", "rng"))


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    """`torch.save(state)` to a temporary file renamed to `path`: `path` is the old checkpoint or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_checkpoint(path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """A checkpoint `save_checkpoint` wrote, read with `weights_only=True` on the CPU (resumable on any device);
    `ValueError` "cannot resume from PATH: corrupt checkpoint" for a truncated, foreign or code-carrying file."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
        if not isinstance(state, dict) or not set(keys) <= set(state):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a training checkpoint: it holds {found}, not {list(keys)}")
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported the same way
        reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"cannot resume from {path}: corrupt checkpoint ({reason}); delete it to restart"
        ) from None
    return state
