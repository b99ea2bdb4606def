"""Saved artefacts prove they are intact: checksums of their payload, written last and checked at load.

A folder artefact (a draft head, exit heads, an export, a datastore) holds `hf_spec_checksums.json`, written after
every other file, with the sha256 of every file the folder ships (configs, `custom_generate/` code, weights, index
arrays), and its `config.json` (a datastore: `meta.json`) says so: `"hf_spec_checksums": 2`. A single-file
artefact (a Pre-cut Q-table) carries the sha256 of its own content under the key `"sha256"`. At load:

- a file that does not match the list, a listed file missing, a file the list does not name, an empty list, a
  list naming a path outside the folder, or a folder whose config says it has a list and has none:
  `IntegrityError` naming the file (flipped bytes that still parse would otherwise load as wrong weights or
  out-of-range token ids, edited code would run);
- no list and no such mark (written by an hf-spec from before checksums), or an earlier hf-spec's list of the
  weights only: loaded, with a warning naming `hf-spec seal FOLDER`, which adds a complete list;
- weights that hold NaN or infinite values: refused too (`check_finite`), checksum or not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import torch

logger = logging.getLogger(__name__)

CHECKSUM_FILE = "hf_spec_checksums.json"
FORMAT = "hf-spec-checksums"
JSON_KEY = "sha256"  # a single-file artefact's own checksum
LIST_VERSION = 2  # lists every file of the folder (version 1, no "version" key: the weights only)
MARK = (
    "hf_spec_checksums"  # key of a folder's config saying it was written with a complete list (its version)
)
MARKED_CONFIGS = ("config.json", "meta.json")  # the first one a folder holds carries the mark
# what an earlier hf-spec's list (version 1) had to name: the weights and arrays
_PAYLOAD_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".npy")
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


def write_checksums(folder: str | os.PathLike) -> Path:
    """Mark the folder's config (`MARK` in its `config.json` or `meta.json`) and write `folder/hf_spec_checksums.json`
    with the sha256 of every file it ships (`shipped_files`); call it after every other file of the artefact is
    written (into a `staged_folder`). Returns the list's path."""
    folder = Path(folder)
    for name in MARKED_CONFIGS:
        config = folder / name
        if config.is_file():
            data = json.loads(config.read_text())
            if isinstance(data, dict) and data.get(MARK) != LIST_VERSION:
                # written as a new file: a hard link carried from an earlier folder is left as it was
                write_json_atomic(config, {**data, MARK: LIST_VERSION}, indent=2)
            break
    sums = {}
    for name in shipped_files(folder):
        sums[name] = file_sha256(_inside(folder, name, f"the folder {folder}"))
    body = {"format": FORMAT, "version": LIST_VERSION, "algorithm": "sha256", "files": sums}
    return write_json_atomic(folder / CHECKSUM_FILE, body)


def shipped_files(folder: str | os.PathLike) -> list[str]:
    """Every file under `folder` as a relative POSIX path, but the checksum list itself and what tools keep beside
    an artefact (names starting with a dot: `.gitattributes`, `.cache/`, `.git/`; `__pycache__/`)."""
    folder = Path(folder)
    found = []
    for directory, subdirs, files in os.walk(folder):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d != "__pycache__")
        here = Path(directory).relative_to(folder)
        found += [
            (here / f).as_posix()
            for f in files
            if not f.startswith(".") and (here / f).as_posix() != CHECKSUM_FILE
        ]
    return sorted(found)


def weight_files(folder: str | os.PathLike) -> list[str]:
    """The payload of a saved model folder: its `.safetensors` files (a sharded one's index too)."""
    folder = Path(folder)
    return sorted(
        p.name for p in folder.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))
    )


def marked(folder: str | os.PathLike) -> tuple[Path, int] | None:
    """`(config file, list version)` where the folder's config says hf-spec wrote it with a checksum list."""
    for name in MARKED_CONFIGS:
        config = Path(folder) / name
        if config.is_file():
            try:
                data = json.loads(config.read_text())
            except (OSError, ValueError):
                return None  # the loader names a broken config
            version = data.get(MARK) if isinstance(data, dict) else None
            return (config, version) if isinstance(version, int) and version > 0 else None
    return None


def verify_checksums(folder: str | os.PathLike, what: str) -> bool:
    """Check `folder` against its `hf_spec_checksums.json`; `what` names the artefact in messages. Returns True when
    every file matches a complete list, False (after a warning) for a folder an earlier hf-spec wrote (no list, or a
    list of its weights only); raises `IntegrityError` naming the file or the list otherwise."""
    folder = Path(folder)
    listing = folder / CHECKSUM_FILE
    mark = marked(folder)
    if not listing.is_file():
        if mark is not None:
            raise IntegrityError(
                f"{what}: {listing} is missing, though {mark[0]} says hf-spec wrote the folder with one: an "
                "incomplete copy, or the list was removed; copy, download or save the folder again"
            )
        _warn_unchecked(
            folder, what, "carries no checksum list (written by an hf-spec from before checksums, or by hand)"
        )
        return False
    try:
        data = json.loads(listing.read_text())
        files = data["files"]
        if data.get("format") != FORMAT or not isinstance(files, dict):
            raise ValueError("not an hf-spec checksum list")
        version = data.get("version", 1)
        if not isinstance(version, int) or not all(isinstance(v, str) for v in files.values()):
            raise ValueError("its version or a checksum is not what hf-spec writes")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise IntegrityError(
            f"{what}: {listing} is damaged ({err}); save or download the artefact again"
        ) from None
    if not files:
        raise IntegrityError(
            f"{what}: {listing} lists no files: an edited or damaged list checks nothing; save, download or build "
            "the folder again"
        )
    for name, expected in files.items():
        file = _inside(folder, name, what)
        if not file.is_file():
            raise IntegrityError(f"{what}: {file} is missing (listed in {CHECKSUM_FILE}): an incomplete copy")
        if file_sha256(file) != expected:
            raise IntegrityError(
                f"{what}: {file} does not match its checksum in {CHECKSUM_FILE}: the file is damaged (or was "
                "changed after saving); save, download or build it again"
            )
    complete = version >= LIST_VERSION
    shipped = shipped_files(folder)
    required = shipped if complete else [n for n in shipped if n.endswith(_PAYLOAD_SUFFIXES)]
    # the weights first: the file whose change matters most is the one named
    unlisted = sorted(
        (n for n in required if n not in files), key=lambda n: not n.endswith(_PAYLOAD_SUFFIXES)
    )
    if unlisted:
        raise IntegrityError(
            f"{what}: {folder / unlisted[0]} is not in {CHECKSUM_FILE}"
            + (f" (nor {len(unlisted) - 1} other files)" if len(unlisted) > 1 else "")
            + ": a partial list, or files added after saving; save, download or build the folder again"
        )
    if not complete:
        if mark is not None:
            raise IntegrityError(
                f"{what}: {listing} lists only the weights, though {mark[0]} says hf-spec wrote a list of every "
                "file: an edited list; save, download or build the folder again"
            )
        _warn_unchecked(
            folder, what, "carries a checksum list of its weights only (written by an earlier hf-spec)"
        )
    return True


def seal_folder(folder: str | os.PathLike) -> Path:
    """Give a folder artefact (a head, exit heads, an export, a datastore) an earlier hf-spec wrote without a
    complete checksum list one (and the mark in its config), as a save does; the folder is replaced whole. A list
    it holds is checked first: a damaged folder is refused, not sealed. Returns the folder."""
    from hf_spec.io.output_folder import staged_folder

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"cannot seal {folder}: not a folder")
    if not any((folder / name).is_file() for name in MARKED_CONFIGS):
        raise ValueError(
            f"cannot seal {folder}: it holds no {' or '.join(MARKED_CONFIGS)}, so it is no head, exit heads, export "
            "or datastore folder"
        )
    if (folder / CHECKSUM_FILE).is_file():
        verify_checksums(folder, f"the folder {folder}")
    with staged_folder(folder, carry=lambda path: True) as new:
        write_checksums(new)
    return folder


def _inside(folder: Path, name: str, what: str) -> Path:
    """`folder/name`, refused (`IntegrityError`) unless it stays inside `folder`: a relative path without `..`, not
    a link out of it (but a Hub cache snapshot's links into its own `blobs/`)."""
    path = PurePosixPath(name)
    if not name or "\\" in name or path.is_absolute() or ".." in path.parts or name.startswith("~"):
        raise IntegrityError(
            f"{what}: {CHECKSUM_FILE} names {name!r}, which is not a path inside the folder: a forged or damaged "
            "list; save, download or build the folder again"
        )
    file, root = folder / path, folder.resolve()
    real = file.resolve()
    if real != root and root not in real.parents and not _in_hub_blobs(root, real):
        raise IntegrityError(
            f"{what}: {file} leads to {real}, outside the folder: a forged or damaged folder; save, download or "
            "build it again"
        )
    return file


def _in_hub_blobs(root: Path, real: Path) -> bool:
    """Whether `root` lies in a Hub cache snapshot (`<repo>/snapshots/<revision>/...`) and `real` in that repo's
    `blobs/`, where the snapshot's files link to."""
    for parent in (root, *root.parents):
        if parent.parent.name == "snapshots":
            blobs = parent.parent.parent / "blobs"
            return blobs in real.parents
    return False


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
        _warn_unchecked(where, where, "carries no checksum (saved by an earlier hf-spec)")
    elif data[JSON_KEY] != _json_digest(body):
        raise IntegrityError(
            f"{where} does not match its checksum ({JSON_KEY!r}): the file is damaged or was edited after saving; "
            f"save it again (or delete the {JSON_KEY!r} key to accept an edit)"
        )
    return body


def write_json_atomic(path: str | os.PathLike, data: Any, indent: int = 1) -> Path:
    """Write `data` as JSON to `path` through a temporary file in the same folder: `path` is whole or absent."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=indent) + "\n")
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


def _warn_unchecked(where: str | os.PathLike, what: str, why: str = "carries no checksum") -> None:
    if str(where) not in _WARNED:
        _WARNED.add(str(where))
        how = (
            f"if it is the one you trust, add a complete list with `hf-spec seal {where}`"
            if Path(where).is_dir()
            else "save it again to add one"
        )
        logger.warning("%s %s: loaded without checking its files; %s", what, why, how)


__all__ = [
    "CHECKSUM_FILE",
    "IntegrityError",
    "check_finite",
    "marked",
    "seal_folder",
    "shipped_files",
    "file_sha256",
    "verify_checksums",
    "verify_json_checksum",
    "weight_files",
    "with_json_checksum",
    "write_checksums",
    "write_json_atomic",
]
