"""Method registry: name -> (config dataclass, drafter class)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hf_spec.config import MethodConfig, config_file, read_config
from hf_spec.hub_ids import config_from_hub


@dataclass(frozen=True)
class MethodEntry:
    name: str
    config_cls: type[MethodConfig]
    drafter_cls: type


_METHODS: dict[str, MethodEntry] = {}


def register_method(name: str, config_cls: type[MethodConfig], drafter_cls: type) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9-]*", name):
        raise ValueError(f"method names are lowercase words joined by '-', got {name!r}")
    if name in _METHODS:
        raise ValueError(f"method {name!r} is already registered")
    if config_cls.method != name:
        raise ValueError(f"{config_cls.__name__}.method is {config_cls.method!r}, expected {name!r}")
    _METHODS[name] = MethodEntry(name, config_cls, drafter_cls)


def get_method(name: str) -> MethodEntry:
    _load_builtin_methods()
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown hf-spec method {name!r}; registered: {', '.join(sorted(_METHODS))}"
        ) from None


def list_methods() -> list[str]:
    _load_builtin_methods()
    return sorted(_METHODS)


def parse_method(spec: str | MethodConfig) -> MethodConfig:
    """`"pld"`, `"early-exit:6"`, `"oracle:8"`, `"draft-model:path/to/model"`, `"name:config.json"` -> config."""
    if isinstance(spec, MethodConfig):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"a method spec is a string such as 'pld' or 'early-exit:6', or a MethodConfig; got "
            f"{type(spec).__name__}: {spec!r:.60}"
        )
    name, sep, arg = spec.partition(":")
    if sep and name in list_methods():  # `name:ARG`, where ARG may itself be a config path or Hub id
        cls = get_method(name).config_cls
        return config_from_hub(arg, cls) or cls.from_cli_arg(arg or None)
    if spec.endswith(".json") or os.path.isdir(spec):  # a saved config: its "method" key says which
        data = read_config(spec)
        if not isinstance(data.get("method"), str) or not data["method"]:
            raise ValueError(
                f"{config_file(spec)} has no 'method' key: an hf-spec config names its method, e.g. "
                f'"method": "pld" (registered: {", ".join(list_methods())})'
            )
        return get_method(data["method"]).config_cls.from_dict(data).with_source(config_file(spec))
    hub = config_from_hub(spec)  # `org/name[@revision]`: a saved config on the Hub
    if hub is not None:
        return hub
    return get_method(name).config_cls.from_cli_arg(arg or None)


def _load_builtin_methods() -> None:
    import hf_spec.methods  # noqa: F401  (registers the built-in methods on import)
