"""Reading a published head checkpoint: its `config.json` and its tensors, from `model.safetensors`,
`pytorch_model.bin` or a sharded index of either.

`.bin` files are pickles: they are read with `torch.load(weights_only=True)`, which unpickles tensors and plain
containers only and refuses anything that would run code; such a file is refused with an error saying so.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch

SAFETENSORS = "model.safetensors"
PICKLE = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"


def read_config(folder: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object of `folder/config.json`; `ValueError` naming `what` when absent or unreadable."""
    file = Path(folder) / "config.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"cannot load {what}: no config.json in {folder}") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot load {what}: bad config.json ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"cannot load {what}: config.json must hold a JSON object")
    return data


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The checkpoint files of `folder`, safetensors first: one file, or the shards an index names."""
    folder = Path(folder)
    for single in (SAFETENSORS, PICKLE):
        index = folder / (single + INDEX_SUFFIX)
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as err:
                raise ValueError(f"bad checkpoint index {index} ({err})") from None
            return [folder / s for s in shards]
        if (folder / single).is_file():
            return [folder / single]
    return []


def read_weights(folder: str | os.PathLike, what: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `folder` (on the CPU, as stored); `ValueError` naming `what` when there
    is none, a file is truncated or foreign, or a `.bin` holds pickled code."""
    files = weight_files(folder)
    if not files:
        raise ValueError(f"cannot load {what}: no {SAFETENSORS} or {PICKLE} in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ValueError(f"cannot load {what}: the checkpoint index names {file.name}, which is missing")
        tensors.update(
            _read_safetensors(file, what) if file.suffix == ".safetensors" else _read_pickle(file, what)
        )
    return tensors


def _read_safetensors(file: Path, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as err:  # noqa: BLE001 - safetensors' own errors: a truncated or foreign file
        raise ValueError(
            f"cannot load {what}: {file.name} is not a readable safetensors file ({err})"
        ) from None


def _read_pickle(file: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"refused {what}: {file.name} holds pickled objects other than tensors (code that would run on "
            f"load), which torch.load(weights_only=True) does not execute ({str(err).splitlines()[-1][:200]})"
        ) from None
    except Exception as err:  # noqa: BLE001 - zip/pickle errors of a truncated or foreign file
        raise ValueError(f"cannot load {what}: {file.name} is not a readable checkpoint ({err})") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise ValueError(f"cannot load {what}: {file.name} is not a mapping of names to tensors")
    return data
