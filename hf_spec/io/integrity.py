"""Saved artefacts prove they are intact: checksums of their payload, written last and checked at load.

A folder artefact (a draft head, exit heads, a datastore) holds `hf_spec_checksums.json`, written after every
other file, with the sha256 of each payload file (weights, index arrays). A single-file artefact (a Pre-cut
Q-table) carries the sha256 of its own content under the key `"sha256"`. At load:

- no checksum (written by an hf-spec from before checksums): loaded, with a warning;
- a checksum present and a file that does not match it, or a listed file missing: `IntegrityError` naming the
  file (flipped bytes that still parse would otherwise load as wrong weights or out-of-range token ids);
- weights that hold NaN or infinite values: refused too (`check_finite`), checksum or not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHECKSUM_FILE = "hf_spec_checksums.json"
FORMAT = "hf-spec-checksums"
JSON_KEY = "sha256"  # a single-file artefact's own checksum
_CHUNK = 1 << 20
_WARNED: set[str] = set()


class IntegrityError(ValueError):
    """A saved artefact does not match its checksum, or holds non-finite weights."""


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(folder: str | os.PathLike, files: Iterable[str]) -> Path:
    """Write `folder/hf_spec_checksums.json` with the sha256 of `files` (names inside `folder`); call it after
    every other file of the artefact is written. Returns its path."""
    folder = Path(folder)
    sums = {name: file_sha256(folder / name) for name in sorted(set(files))}
    return write_json_atomic(folder / CHECKSUM_FILE, {"format": FORMAT, "algorithm": "sha256", "files": sums})


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The payload of a saved model folder: its `.safetensors` files (a sharded one's index too)."""
    folder = Path(folder)
    return sorted(
        p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))
    )


def verify_checksums(folder: str | os.PathLike, what: str) -> bool:
    """Check the files `folder/hf_spec_checksums.json` lists; `what` names the artefact in messages. Returns False
    (after a warning) when the folder has no checksum file, True when every file matches; raises
    `IntegrityError` naming the file otherwise."""
    folder = Path(folder)
    listing = folder / CHECKSUM_FILE
    if not listing.is_file():
        _warn_unchecked(str(folder), what)
        return False
    try:
        data = json.loads(listing.read_text())
        files = data["files"]
        if data.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError("not an hf-spec checksum list")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise IntegrityError(
            f"{what}: {listing} is damaged ({err}); save or download the artefact again"
        ) from None
    for name, expected in files.items():
        file = folder / name
        if not file.is_file():
            raise IntegrityError(f"{what}: {file} is missing (listed in {CHECKSUM_FILE}): an incomplete copy")
        if file_sha256(file) != expected:
            raise IntegrityError(
                f"{what}: {file} does not match its checksum in {CHECKSUM_FILE}: the file is damaged (or was "
                "changed after saving); save, download or build it again"
            )
    return True


def check_finite(tensors: Mapping[str, torch.Tensor] | torch.nn.Module, where: str) -> None:
    """Raise `IntegrityError` naming the first floating-point tensor of `tensors` (a state dict or a module's
    parameters and buffers) that holds NaN or infinite values; `where` names the file or folder."""
    items = (
        [*tensors.named_parameters(), *tensors.named_buffers()]
        if isinstance(tensors, torch.nn.Module)
        else tensors.items()
    )
    for name, t in items:
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise IntegrityError(
                f"{where}: weight {name!r} holds NaN or infinite values: a damaged checkpoint or a training run "
                "that diverged; retrain or download it again"
            )


def with_json_checksum(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` plus the sha256 of its canonical JSON under `"sha256"` (a single-file artefact)."""
    body = {k: v for k, v in data.items() if k != JSON_KEY}
    return {**body, JSON_KEY: _json_digest(body)}


def verify_json_checksum(
    data: dict[str, Any], where: str, check: Callable[[dict], None] | None = None
) -> dict:
    """`data` without its checksum, checked: `check(body)` first (so a malformed file is refused by what is wrong
    with it), then the checksum (`IntegrityError` naming `where` on a mismatch). Data without a checksum is
    returned after a warning."""
    body = {k: v for k, v in data.items() if k != JSON_KEY}
    if check is not None:
        check(body)
    if JSON_KEY not in data:
        _warn_unchecked(where, where)
    elif data[JSON_KEY] != _json_digest(body):
        raise IntegrityError(
            f"{where} does not match its checksum ({JSON_KEY!r}): the file is damaged or was edited after saving; "
            f"save it again (or delete the {JSON_KEY!r} key to accept an edit)"
        )
    return body


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write `data` as JSON to `path` through a temporary file in the same folder: `path` is whole or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=1) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def save_tensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict | None = None
) -> Path:
    """`safetensors.torch.save_file`, then made readable by all (0644): safetensors >= 0.8 writes owner-only (0600)
    files, which hides a saved head from the other users of a shared folder or cache."""
    from safetensors.torch import save_file

    path = Path(path)
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o644)  # as write_json_atomic's files
    return path


def _json_digest(body: Mapping[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _warn_unchecked(key: str, what: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(
            "%s carries no checksum (saved by an earlier hf-spec): loaded without checking its files; save it "
            "again to add one", what,
        )  # fmt: skip


__all__ = [
    "CHECKSUM_FILE",
    "IntegrityError",
    "check_finite",
    "file_sha256",
    "verify_checksums",
    "verify_json_checksum",
    "weight_files",
    "with_json_checksum",
    "write_checksums",
    "write_json_atomic",
]
