"""Output folders (heads, exit heads, datastores) are written only where nothing else would be lost."""

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


def check_output_folder(folder: str | os.PathLike, ours: Callable[[Path], bool], what: str) -> None:
    """Raise `ValueError` unless `folder` is missing, empty, or `ours` (an earlier `what` that may be replaced)."""
    folder = Path(folder)
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"{folder} is a file, not a folder: choose another --out for the {what}")
    names = sorted(p.name for p in folder.iterdir())
    if names and not ours(folder):
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        raise ValueError(
            f"{folder} already holds other files ({shown}): a {what} is written only into a new or empty folder "
            f"or over an earlier {what}; choose another --out"
        )
