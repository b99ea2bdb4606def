"""Method registry: name -> (config dataclass, drafter class), loaded lazily.

The built-in methods are listed by name and module path, as transformers' auto mappings list model classes: naming
or listing them imports nothing, and asking for one imports its package alone (whose `__init__` calls
`register_method`). Methods of other packages register themselves the same way when imported.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

# name -> the package that registers it on import
BUILTIN_METHODS: dict[str, str] = {
    "draft-model": "hf_spec.methods.draft_model",
    "eagle": "hf_spec.methods.eagle",
    "eagle3": "hf_spec.methods.eagle3",
    "early-exit": "hf_spec.methods.early_exit",
    "hispec": "hf_spec.methods.hispec",
    "lyanna": "hf_spec.methods.lyanna",
    "oracle": "hf_spec.methods.oracle",
    "pld": "hf_spec.methods.pld",
    "postuse": "hf_spec.methods.postuse",
    "retrieval": "hf_spec.methods.retrieval",
    "talon": "hf_spec.methods.talon",
}


@dataclass(frozen=True)
class MethodEntry:
    """A registered method. The registry imports nothing of hf-spec's (configs and drafters import it), so the
    classes are typed loosely here."""

    name: str
    config_cls: type  # a `hf_spec.core.config.MethodConfig` subclass
    drafter_cls: type  # a `hf_spec.core.drafter.Drafter` subclass


_METHODS: dict[str, MethodEntry] = {}


def register_method(name: str, config_cls: type, drafter_cls: type) -> None:
    """Make `name` a method: `config_cls.method` must be `name`; names are lowercase words joined by '-'."""
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
        raise ValueError(f"method names are lowercase words joined by '-', got {name!r}")
    if name in _METHODS:
        raise ValueError(f"method {name!r} is already registered")
    if config_cls.method != name:
        raise ValueError(f"{config_cls.__name__}.method is {config_cls.method!r}, expected {name!r}")
    _METHODS[name] = MethodEntry(name, config_cls, drafter_cls)


def get_method(name: str) -> MethodEntry:
    """The registered entry of `name`, importing its package first when it is a built-in one."""
    if name not in _METHODS and name in BUILTIN_METHODS:
        importlib.import_module(BUILTIN_METHODS[name])
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown hf-spec method {name!r}; registered: {', '.join(list_methods())}"
        ) from None


def list_methods() -> list[str]:
    """Every method name, built-in or registered; imports nothing."""
    return sorted(set(BUILTIN_METHODS) | set(_METHODS))


def is_method(name: str) -> bool:
    return name in BUILTIN_METHODS or name in _METHODS


__all__ = ["BUILTIN_METHODS", "MethodEntry", "get_method", "is_method", "list_methods", "register_method"]
