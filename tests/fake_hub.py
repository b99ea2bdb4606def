"""A fake Hugging Face Hub cache, laid out as `huggingface_hub` stores a downloaded repo:

<cache>/models--<org>--<name>/
    blobs/<etag>                          file contents (sha256 for LFS files, git blob sha1 for the rest)
    refs/<branch or tag>                  the commit sha, no newline
    snapshots/<commit sha>/<path>         relative symlinks to ../../blobs/<etag>
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def cache_repo(
    cache: str | os.PathLike,
    repo_id: str,
    folder: str | os.PathLike,
    refs: tuple[str, ...] = ("main",),
    commit: str | None = None,
) -> Path:
    """Store every file under `folder` as repo `repo_id` at one commit that `refs` point to; returns the
    snapshot folder."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    commit = (
        commit
        or hashlib.sha1(
            b"".join(str(p.relative_to(folder)).encode() + p.read_bytes() for p in files)
        ).hexdigest()
    )
    storage = Path(cache) / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for file in files:
        data = file.read_bytes()
        if file.suffix in LFS_SUFFIXES:
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = storage / "blobs" / etag
        blob.write_bytes(data)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot
