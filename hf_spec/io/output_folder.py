"""Output folders (heads, exit heads, datastores, recipes, exports) and files are written only where nothing else
would be lost, checked before the work that produces them, and written whole or not at all (`staged_folder`)."""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
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
    settle_folder(folder)
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


STAGING_TAG = (
    ".hf-spec-"  # `.<name>.hf-spec-new-<pid>-<n>` / `.<name>.hf-spec-old-<pid>-<n>`: siblings a write uses
)


@contextlib.contextmanager
def staged_folder(folder: str | os.PathLike, carry: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Write a folder whole or not at all: yields a new temporary sibling of `folder` to write into; when the block
    ends without error that sibling replaces `folder` (an earlier `folder` is renamed aside, the new one renamed into
    place, the old one removed), on an error it is removed and `folder` stays as it was.

    A process killed at any point leaves `folder` as it was, as the new folder, or absent (killed between the two
    renames); never a mix. The next write to `folder` clears what a killed one left beside it (and puts a new
    folder that was complete in the place left empty).

    Args:
        carry: files of an earlier `folder` (relative paths) to carry into the new one, hard-linked where the file
            system allows, else copied; the block must replace (not edit in place) any carried file it changes.
    """
    folder = Path(folder).absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_siblings(folder)
    tag = f".{folder.name}{STAGING_TAG}%s-{os.getpid()}-{next(_COUNTER)}"
    new, old = folder.with_name(tag % "new"), folder.with_name(tag % "old")
    try:
        if carry is not None and folder.is_dir():
            ignore = _not_carried(folder, carry)
            shutil.copytree(folder, new, symlinks=True, copy_function=_link_or_copy, ignore=ignore)
        else:
            new.mkdir()
        yield new
        if folder.is_dir() and not folder.is_symlink():
            folder.rename(old)
        elif folder.exists() or folder.is_symlink():
            folder.unlink()
        new.rename(folder)
    finally:
        shutil.rmtree(new, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def unstaged(folder: Path) -> Path:
    """The folder a `staged_folder` sibling will become (`folder` itself otherwise): the name messages show."""
    name = folder.name
    if name.startswith(".") and STAGING_TAG in name:
        return folder.with_name(name[1:].split(STAGING_TAG)[0])
    return folder


_COUNTER = itertools.count()


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _not_carried(root: Path, carry: Callable[[Path], bool]) -> Callable[[str, list[str]], set[str]]:
    def ignore(directory: str, names: list[str]) -> set[str]:
        here = Path(directory).relative_to(root)
        return {
            n
            for n in names
            if not (Path(directory, n).is_dir() and not Path(directory, n).is_symlink())
            and not carry(here / n)
        }

    return ignore


def settle_folder(folder: str | os.PathLike) -> None:
    """Finish or clear what killed writes to `folder` left (see `staged_folder`); writers call it first."""
    _remove_stale_siblings(Path(folder).absolute())


def _remove_stale_siblings(folder: Path) -> None:
    """Clear what writes to `folder` killed before they finished left beside it (their process is gone): a write
    killed between its two renames left `folder` absent, its new folder complete and the earlier one aside, and the
    new one is put in place; every other sibling is removed."""
    prefix = f".{folder.name}{STAGING_TAG}"
    for sibling in sorted(folder.parent.glob(f"{glob.escape(prefix)}*")):
        try:
            role, pid, _ = sibling.name[len(prefix) :].split("-", 2)
        except ValueError:
            continue
        if not pid.isdigit() or _running(int(pid)):
            continue
        if (
            role == "new"
            and not folder.exists()
            and sibling.with_name(prefix + "old" + sibling.name[len(prefix) + 3 :]).exists()
        ):
            sibling.rename(folder)  # the earlier folder was moved aside only once this one was complete
        else:
            shutil.rmtree(sibling, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
