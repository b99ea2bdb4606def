"""Relative paths in a config file are read from the config's folder (see `hf_spec.core.config`).

Which values are paths is read from the values themselves, so a method's config declares nothing: a string field
without fixed choices, a string inside a list or dict field (a datastore recipe's sources), or the argument of a
method spec (`"eagle:hass.json"`, `"early-exit:exits.json"`) is a path when it names a file or folder next to the
config, or when it is written as one (`./x`, `../x`, `~/x`). Other strings (Hub ids, known model names, option
values) are left alone. A path written as one that exists nowhere is an error naming the config and the field.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hf_spec.core.registry import is_method

logger = logging.getLogger(__name__)

_WARNED: set[tuple[str, str]] = set()


def _written_as_path(value: str) -> bool:
    return value.startswith(("./", "../", "~", ".\\", "..\\")) or value in (".", "..")


def resolve_path(value: str, source: Path, field: str) -> str:
    """`value` (a field of the config read from `source`) as an absolute path when it is a relative path next to the
    config; else unchanged (see the module docstring)."""
    if not value or "\n" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    here = source.parent / path
    if here.exists():
        return os.path.normpath(here)
    if path.exists():  # how configs were read before: from the current directory
        if (str(source), field) not in _WARNED:
            _WARNED.add((str(source), field))
            logger.warning(
                "%s: %s %r is read from the current directory (%s); relative paths in a config are read from the "
                "config's folder (%s): write it relative to that folder",
                source, field, value, os.getcwd(), source.parent,
            )  # fmt: skip
        return value
    if _written_as_path(value):
        raise FileNotFoundError(
            f"{source}: {field}: no file or folder {value!r} (relative paths in a config are read from its folder, "
            f"{source.parent})"
        )
    return value


def resolve_spec(spec: str, source: Path, field: str) -> str:
    """A method spec with its path argument resolved: `"eagle:hass.json"` -> `"eagle:/abs/hass.json"`; a spec that
    is a path itself (a config file or folder) is resolved as a path."""
    name, sep, arg = spec.partition(":")
    if sep and is_method(name):
        return f"{name}:{resolve_spec(arg, source, field)}" if arg else spec
    return resolve_path(spec, source, field)


def resolve_value(value: Any, source: Path, field: str) -> Any:
    if isinstance(value, str):
        return resolve_path(value, source, field)
    if isinstance(value, list):
        return [resolve_value(v, source, f"{field}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: resolve_value(v, source, f"{field}.{k}") for k, v in value.items()}
    return value


__all__ = ["resolve_path", "resolve_spec", "resolve_value"]
