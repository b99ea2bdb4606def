"""Draft heads in the layouts other projects publish, loaded onto a target and run by hf-spec's own drafters.

| format | method | where it comes from | detected by |
|---|---|---|---|
| `eagle` | `eagle` | EAGLE-1/2 heads of the EAGLE authors (SafeAILab/EAGLE) | `fc.weight` [H, 2H] + `layers.0.*` |
| `eagle3` | `eagle3` | EAGLE-3 heads: the EAGLE authors', SpecForge/SGLang, hf-spec | `midlayer.*` keys |
| `eagle3` | `eagle3` | EAGLE-3 heads of vLLM's speculators | `speculators_model_type: "eagle3"`, `layers.0.hidden_norm` |

`load_published_head(folder, target, method, name)` is what a drafter's loader calls when a head folder is not
one of hf-spec's own (`config.json` without an `hf_spec_*` model type).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from hf_spec.heads.published_files import read_config, read_weights
from hf_spec.io.integrity import CHECKSUM_FILE, marked, verify_checksums

SIDECAR = "hf_spec.json"  # hf-spec's metadata next to a head it wrote (format version, target fingerprint)

# method -> the module whose `load_published(folder, target, what, config, tensors)` reads that method's published
# layouts, imported when such a head is loaded (the heads' shared code names no method's module otherwise)
PUBLISHED_LOADERS = {"eagle": "hf_spec.methods.eagle.published", "eagle3": "hf_spec.methods.eagle3.published"}


def is_eagle_checkpoint(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `(config.json, tensors)` is an EAGLE-1/2 head in the EAGLE authors' layout."""
    keys = list(tensors)
    return (
        "fc.weight" in tensors
        and any(k.startswith("layers.0.") for k in keys)
        and not any(k.startswith("midlayer.") for k in keys)
    )


def is_eagle3_checkpoint(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
    """Whether `(config.json, tensors)` is an EAGLE-3 head in one of the layouts above."""
    return (
        config.get("speculators_model_type") == "eagle3"
        or any(k.startswith("midlayer.") for k in tensors)
        or "layers.0.hidden_norm.weight" in tensors
    )


def verify_folder(folder: str | os.PathLike, what: str) -> None:
    """Check a head folder hf-spec wrote against its `hf_spec_checksums.json` (`IntegrityError` naming a damaged,
    missing or unlisted file, or a list removed from a folder whose `config.json` says it had one; a warning for an
    hf-spec EAGLE-3 folder saved before checksums, which has only `hf_spec.json`). A third-party folder has none of
    these and is not checked."""
    folder = Path(folder)
    if (folder / CHECKSUM_FILE).is_file() or (folder / SIDECAR).is_file() or marked(folder) is not None:
        verify_checksums(folder, what)


def detect_format(config: dict[str, Any], tensors: dict) -> str | None:
    """The published format of a checkpoint (`"eagle"`, `"eagle3"`), or None when it is none of them."""
    if is_eagle3_checkpoint(config, tensors):  # first: a speculators EAGLE-3 head has `layers.0.*` keys too
        return "eagle3"
    if is_eagle_checkpoint(config, tensors):
        return "eagle"
    return None


def is_published_config(config: dict[str, Any]) -> bool:
    """Whether a `config.json` may be a published head's: one decoder layer, not an hf-spec model type (so a
    whole model passed by mistake is refused before its weights are read)."""
    model_type = str(config.get("model_type", ""))
    layers = config.get("num_hidden_layers", 1)
    return not model_type.startswith("hf_spec") and layers == 1


def load_published_head(
    folder: str | os.PathLike, target: PreTrainedModel, method: str, name: str | None = None
) -> torch.nn.Module | None:
    """The head in `folder` (named `name` by the user: a path or Hub id) for `method`, checked against `target`;
    None when `folder` is not a published head at all. A published head of another method is refused with an
    error naming the method to use."""
    what = f"the {method} head {name or os.fspath(folder)!r}"
    config = read_config(folder, what)
    if not is_published_config(config):
        return None
    verify_folder(folder, what)  # a folder hf-spec wrote (hf-spec's EAGLE-3 format, an export): its checksums
    tensors = read_weights(folder, what)
    found = detect_format(config, tensors)
    if found is None:
        return None
    if found != method:
        label = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3"}[found]
        raise ValueError(f"{what} is a published {label} head: use {found}:{name or os.fspath(folder)}")
    return importlib.import_module(PUBLISHED_LOADERS[found]).load_published(
        folder, target, what, config, tensors
    )


__all__ = [
    "SIDECAR",
    "detect_format",
    "is_eagle3_checkpoint",
    "is_eagle_checkpoint",
    "load_published_head",
    "verify_folder",
]
