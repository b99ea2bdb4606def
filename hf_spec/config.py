"""Base class for method configurations: dataclasses that save to and load from a folder."""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

CONFIG_NAME = "hf_spec_config.json"

# annotation -> accepted values (bools are not numbers here, though Python says they are ints)
_FIELD_KINDS: dict[str, tuple[type, ...]] = {
    "int": (numbers.Integral,),
    "float": (numbers.Real,),
    "bool": (bool,),
    "str": (str,),
}


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of a saved config: a folder holding `hf_spec_config.json`, or a `.json` file."""
    path = Path(path)
    file = path / CONFIG_NAME if path.is_dir() else path
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no hf-spec config at {file}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read an hf-spec config from {file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


@dataclass
class MethodConfig:
    """Base config. Subclasses set `method` (the registry name) and, optionally, `main_arg`: the field that
    `name:VALUE` on the command line sets (e.g. `early-exit:6` sets `exit_layer`)."""

    method: ClassVar[str] = ""
    main_arg: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        """Check that every `int` / `float` / `bool` / `str` field holds one; subclasses that check ranges too
        call this first."""
        for f in dataclasses.fields(self):
            kinds = _FIELD_KINDS.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
            value = getattr(self, f.name)
            if kinds and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
                raise TypeError(f"{self.method}: {f.name} must be {f.type}, got {value!r}")

    def require_at_least(self, minimum: float, *names: str) -> None:
        """Raise a `ValueError` naming the first field of `names` below `minimum`."""
        for name in names:
            if getattr(self, name) < minimum:
                raise ValueError(f"{self.method}: {name} must be >= {minimum}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, **dataclasses.asdict(self)}

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodConfig:
        data = dict(data)
        name = data.pop("method", cls.method)
        if name != cls.method:
            raise ValueError(f"config is for method {name!r}, not {cls.method!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.method} config keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> MethodConfig:
        """Load from a folder holding `hf_spec_config.json` or from a `.json` file."""
        return cls.from_dict(read_config(path))

    @classmethod
    def from_cli_arg(cls, arg: str | None) -> MethodConfig:
        """`None` -> defaults; a `.json` file or a folder holding `hf_spec_config.json` -> loaded; anything else
        (a local model folder for `draft-model`, a datastore folder for `retrieval`) sets `main_arg`."""
        if arg is None or arg == "":
            return cls()
        is_dir = os.path.isdir(arg)
        if arg.endswith(".json") or (
            is_dir and ((Path(arg) / CONFIG_NAME).is_file() or cls.main_arg is None)
        ):
            return cls.from_pretrained(arg)
        if cls.main_arg is None:
            raise ValueError(f"method {cls.method!r} takes a config path, not {arg!r}")
        field = next(f for f in dataclasses.fields(cls) if f.name == cls.main_arg)
        kind = field.type if isinstance(field.type, type) else eval(field.type, {})  # noqa: S307 - own annotation
        try:
            value = kind(arg) if kind in (int, float) else arg
        except ValueError:
            raise ValueError(f"{cls.method}:{arg}: expected {kind.__name__} for {cls.main_arg}") from None
        return cls(**{cls.main_arg: value})
