"""Output folders (heads, exit heads, datastores, recipes) and files are written only where nothing else would be
lost, and checked before the work that produces them."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def holds_model_type(model_type: str) -> Callable[[Path], bool]:
    """A folder whose `config.json` names `model_type` (an earlier output of the same kind)."""

    def check(folder: Path) -> bool:
        try:
            return json.loads((folder / "config.json").read_text()).get("model_type") == model_type
        except (OSError, ValueError, AttributeError):
            return False

    return check


def check_output_folder(
    folder: str | os.PathLike, ours: Callable[[Path], bool], what: str, remedy: str = "choose another --out"
) -> None:
    """Raise `ValueError` unless `folder` is missing, empty, or `ours` (an earlier `what` that may be replaced);
    `remedy` ends the message (what the user can do)."""
    folder = Path(folder)
    if not folder.exists():
        _check_writable(folder, folder, what, remedy)
        return
    if not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder: {remedy} for the {what}")
    names = sorted(p.name for p in folder.iterdir())
    if names and not ours(folder):
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(
            f"{folder} already holds other files ({shown}): a {what} is written only into a new or empty folder "
            f"or over an earlier {what}; {remedy}"
        )


def check_output_file(
    path: str | os.PathLike,
    ours: Callable[[Path], bool],
    what: str,
    remedy: str = "choose another --out",
) -> None:
    """Raise `ValueError` unless `path` can be written: missing (its folder writable) or `ours` (an earlier `what`
    that may be replaced). Checked before a command does any work, so a long run is not lost at the end."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a file: {remedy} for the {what}")
    if path.exists() and not ours(path):
        raise ValueError(
            f"{path} already exists and is not an earlier {what}: it is not written over; {remedy}"
        )
    _check_writable(path.parent, path, what, remedy)


def check_writable_folder(folder: str | os.PathLike, what: str, remedy: str = "choose another --out") -> None:
    """Raise `ValueError` where `folder` (or the first of its parents that exists) is not a writable folder."""
    _check_writable(Path(folder), Path(folder), what, remedy)


def _check_writable(folder: Path, target: Path, what: str, remedy: str) -> None:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write the {what} to {target}: {folder} is not a writable folder; {remedy}")
