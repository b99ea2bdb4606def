"""Base class of method configs: typed dataclasses that check their fields and save to / load from a folder.

A method's config is a `@dataclass` subclass of `MethodConfig`. Its annotations are the schema, read once with
`typing.get_type_hints`:

- `int`, `float`, `bool`, `str`, `dict`: the value must be one (a bool is not a number here);
- `Literal["a", "b"]`: one of those values (a `ValueError` lists them);
- `X | None`: `None` switches the option off; `""` reads as `None` (how saved configs said "off" before
  `config_version` 2);
- a `MethodConfig` subclass (or `MethodConfig` itself: any registered method): a nested config, given as an
  object or as its dict (built by the registry from the dict's `"method"`), saved back as the dict.

Saved configs carry `config_version`. A file without it is version 1 and loads as it always did: options removed
since then are accepted at the value that behaves as today's code does, and refused by name at any other value.

Paths in a config file (a head or exit-heads folder, a Q-table, a datastore and its sources, the config file of a
wrapped drafter in a method spec such as `"eagle:hass.json"`) are read relative to the folder of the config file,
not the current directory: a config loads the same from anywhere. `resolved()` returns the config with those paths
made absolute; the decoder builds its drafters from it. A relative path that exists only from the current
directory (how configs were read before) is still found, with a warning.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import numbers
import os
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from hf_spec.core.config_paths import resolve_spec, resolve_value
from hf_spec.core.registry import get_method

logger = logging.getLogger(__name__)

CONFIG_NAME = "hf_spec_config.json"
# 2: `None` for off (was `""`), typed nested configs, options removed (`removed_fields`); 3: settings grouped in
# parts (`ConfigPart`: Talon's `schedule`/`switch`/`fusion`, Post-use's `cache`/`reuse_*`/`precut`)
CONFIG_VERSION = 3

# packed draft weights (the schemes of `hf_spec.kernels.weight_only.SCHEMES`); `None`: the weights as loaded
QuantizeScheme = Literal["int8", "int4"]

# annotation -> accepted values (bools are not numbers here, though Python says they are ints)
_SCALARS: dict[type, tuple[type, ...]] = {
    int: (numbers.Integral,),
    float: (numbers.Real,),
    bool: (bool,),
    str: (str,),
    dict: (dict,),
    list: (list,),
}
_KIND_NAMES = {numbers.Integral: "int", numbers.Real: "float"}


@dataclass(frozen=True)
class FieldSchema:
    """What one config field accepts, from its annotation."""

    kinds: tuple[type, ...]  # accepted Python types (besides None and nested configs)
    choices: tuple[Any, ...] | None = None  # a `Literal`'s values
    optional: bool = False  # `None` allowed (off)
    nested: type[MethodConfig] | None = None  # a nested config (`MethodConfig` itself: any method)

    @property
    def scalar(self) -> type | None:
        """`int` or `float` where a command-line string must be converted to one, else None."""
        for kind in (int, float):
            if _SCALARS[kind] == self.kinds:
                return kind
        return None


def _schema_of(annotation: Any) -> FieldSchema:
    args = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    kinds: list[type] = []
    choices: tuple[Any, ...] | None = None
    nested = None
    for arg in args:
        if arg is type(None):
            continue
        if typing.get_origin(arg) is Literal:
            choices = typing.get_args(arg)
            kinds += sorted({type(c) for c in choices}, key=str)
        elif isinstance(arg, type) and issubclass(arg, MethodConfig):
            nested = arg
        elif typing.get_origin(arg) in _SCALARS:  # dict[str, int] and the like
            kinds += _SCALARS[typing.get_origin(arg)]
        elif arg in _SCALARS:
            kinds += _SCALARS[arg]
        else:
            raise TypeError(
                f"config fields take int, float, bool, str, dict, Literal or configs, not {arg!r}"
            )
    return FieldSchema(tuple(kinds), choices, type(None) in args, nested)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


@functools.cache
def config_schema(cls: type[MethodConfig]) -> dict[str, FieldSchema]:
    """Field name -> `FieldSchema` of a config class (its resolved annotations)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _schema_of(hints[f.name]) for f in dataclasses.fields(cls)}


def _choices_text(choices: tuple[Any, ...], optional: bool) -> str:
    words = [repr(c) for c in choices] + (["None"] if optional else [])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def config_file(path: str | os.PathLike) -> Path:
    """The file a saved config is read from: `path` itself, or `hf_spec_config.json` in the folder `path`."""
    path = Path(path)
    return path / CONFIG_NAME if path.is_dir() else path


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object of a saved config: a folder holding `hf_spec_config.json`, or a `.json` file."""
    file = config_file(path)
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"no hf-spec config at {file}") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read an hf-spec config from {file}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


def build_config(data: dict[str, Any], base: type[MethodConfig], version: int | None = None) -> MethodConfig:
    """A config from its dict: of class `base`, or, when `base` is `MethodConfig` itself, of the registered method
    the dict's `"method"` names. `version`: the `config_version` to read it as when the dict carries none."""
    if base is MethodConfig:
        if not isinstance(data.get("method"), str):
            raise ValueError(f"a nested method config needs a 'method' name, got keys {sorted(data)}")
        base = get_method(data["method"]).config_cls
    return base.from_dict(data, version=version)


@dataclass
class MethodConfig:
    """Base config. Subclasses set `method` (the registry name) and, optionally, `main_arg`: the field that
    `name:VALUE` on the command line sets (e.g. `early-exit:6` sets `exit_layer`).

    `removed_fields` maps options a version-1 file may still hold to the value that behaves as the current code
    does; see the module docstring.
    """

    method: ClassVar[str] = ""
    main_arg: ClassVar[str | None] = None
    removed_fields: ClassVar[dict[str, Any]] = {}
    # keys of the flat layout used before the config had parts -> where they live now: `"part.field"`, or `"part"`
    # for a bool that switched a part on or off (false -> the part is None)
    flat_keys: ClassVar[dict[str, str]] = {}
    # per instance: the file the config was loaded from (its relative paths are read from that file's folder)
    source: ClassVar[Path | None] = None

    def __getattr__(self, name: str) -> Any:  # only for attributes a config lacks
        if name in ("config", "get_text_config"):  # what transformers reads of an assistant model
            raise AttributeError(
                f"an hf-spec {type(self).__name__} was passed where transformers expects a model (assistant_model=): "
                "call hf_spec.integrations.enable_assistant(model) first, or pass custom_generate=SpeculativeDecoder(...)"
            )
        moved = type(self).flat_keys.get(name)
        if moved is not None:  # a setting of the flat layout, now in a part
            raise AttributeError(
                f"{type(self).__name__} has no attribute {name!r}: the setting is now {moved}"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __post_init__(self) -> None:
        """Normalise (`""` -> `None` where `None` is allowed, nested dicts -> configs) and check every field against
        its annotation; subclasses that check ranges or combinations too call this first."""
        for name, schema in config_schema(type(self)).items():
            value = getattr(self, name)
            if value == "" and schema.optional:
                value = None
            elif isinstance(value, dict) and schema.nested is not None:
                value = build_config(value, schema.nested, CONFIG_VERSION)
            setattr(self, name, value)
            self._check_field(name, schema, value)

    def _check_field(self, name: str, schema: FieldSchema, value: Any) -> None:
        if value is None:
            if not schema.optional:
                raise TypeError(f"{self.method}: {name} must not be None")
            return
        if schema.nested is not None and isinstance(value, schema.nested):
            if isinstance(value, ConfigPart) and not issubclass(schema.nested, ConfigPart):
                raise ValueError(
                    f"{self.method}: {name} must be a method config, not the part {value.method}"
                )
            return
        if schema.nested is not None and not isinstance(value, schema.kinds):
            forms = (["a method spec"] if str in schema.kinds else []) + ["a settings object"]
            forms += ["null"] if schema.optional else []
            what = forms[0] if len(forms) == 1 else ", ".join(forms[:-1]) + " or " + forms[-1]
            raise ValueError(
                f"{self.method}: {name} must be {what} (a dict or {schema.nested.__name__}), got {value!r}"
            )
        if schema.choices is not None:
            if isinstance(value, bool) or value not in schema.choices:
                allowed = _choices_text(schema.choices, schema.optional)
                raise ValueError(f"{self.method}: {name} must be {allowed}, got {value!r}")
            return
        if not isinstance(value, schema.kinds) or (isinstance(value, bool) and bool not in schema.kinds):
            names = [_KIND_NAMES.get(k, k.__name__) for k in schema.kinds]
            names += [schema.nested.__name__] if schema.nested is not None else []
            raise TypeError(f"{self.method}: {name} must be {' or '.join(names)}, got {value!r}")

    def require_at_least(self, minimum: float, *names: str) -> None:
        """Raise a `ValueError` naming the first field of `names` below `minimum`."""
        for name in names:
            if getattr(self, name) < minimum:
                raise ValueError(f"{self.method}: {name} must be >= {minimum}, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `save_pretrained` writes: `method`, `config_version`, then every field (nested configs as
        their dicts)."""
        return {"method": self.method, "config_version": CONFIG_VERSION, **self._field_dict()}

    def _field_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ConfigPart):
                out[f.name] = value._field_dict()
            elif isinstance(value, MethodConfig):
                out[f.name] = {"method": value.method, **value._field_dict()}
            else:
                out[f.name] = copy.deepcopy(value)
        return out

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write `hf_spec_config.json` into `save_directory`; paths this config read relative to another folder are
        written absolute, so the saved file names the same files."""
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        keep = self.source is not None and self.source.parent.resolve() == path.resolve()
        config = self if keep else self.resolved()
        (path / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        return path

    def resolved(self, parse: Callable[[str], MethodConfig] | None = None) -> MethodConfig:
        """A copy whose relative paths (see the module docstring) are absolute, read from the folder of the file
        this config (or a nested one) was loaded from; nested configs read from their own files use their own
        folders. With `parse` (`hf_spec.core.specs.parse_method`), a wrapped drafter given as a method spec
        (`"early-exit:exits.json"`) becomes its config, resolved in turn; without it the spec stays a string, its
        path made absolute. `hf_spec.core.specs.resolved_config` is the usual entry point."""
        source = self.source
        out = copy.copy(self)
        for name, schema in config_schema(type(self)).items():
            value = getattr(self, name)
            if isinstance(value, MethodConfig):
                value = value.with_default_source(source).resolved(parse)
            elif schema.nested is not None and isinstance(value, str) and value:
                spec = value if source is None else resolve_spec(value, source, name)
                value = spec if parse is None else parse(spec).resolved(parse)
            elif schema.choices is None and source is not None:
                value = resolve_value(value, source, name)
            setattr(out, name, value)
        out.source = None  # nothing relative is left
        return out

    def with_default_source(self, file: Path | None) -> MethodConfig:
        """This config, or a copy read from `file` where it was read from no file of its own (a nested config
        written inside its parent's file)."""
        if self.source is not None or file is None:
            return self
        out = copy.copy(self)
        out.source = file
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, version: int | None = None) -> MethodConfig:
        """A config from its JSON object. `version`: the `config_version` to read it as when `data` has none (a
        nested config reads as its parent); top-level data without one is version 1."""
        data = dict(data)
        name = data.pop("method", cls.method)
        if name != cls.method:
            raise ValueError(f"config is for method {name!r}, not {cls.method!r}")
        version = data.pop("config_version", version or 1)
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ValueError(f"{cls.method}: config_version must be a positive integer, got {version!r}")
        if version > CONFIG_VERSION:
            raise ValueError(
                f"{cls.method}: this config has config_version {version}; this hf-spec reads up to "
                f"{CONFIG_VERSION} (upgrade hf-spec)"
            )
        if version == 1:
            cls._drop_removed_fields(data)
        data = cls.nest_flat_keys(data, stacklevel=4)
        schema = config_schema(cls)
        unknown = sorted(set(data) - set(schema))
        if unknown:
            raise ValueError(f"unknown {cls.method} config keys {unknown}; known: {sorted(schema)}")
        for key, value in data.items():
            if isinstance(value, dict) and schema[key].nested is not None:
                data[key] = build_config(value, schema[key].nested, version)
        return cls(**data)

    @classmethod
    def _drop_removed_fields(cls, data: dict[str, Any]) -> None:
        """Version 1: drop options removed since, where they hold the value that behaves as today's code."""
        for key, kept in cls.removed_fields.items():
            if key in data and data.pop(key) != kept:
                raise ValueError(
                    f"{cls.method}: option {key!r} was removed (config_version 2); this config sets it to another "
                    f"value than {kept!r}, which is how hf-spec behaves now: delete the key"
                )

    @classmethod
    def nest_flat_keys(cls, data: dict[str, Any], stacklevel: int = 3) -> dict[str, Any]:
        """`data` with the keys of the flat layout (`flat_keys`) moved into their parts, with a `FutureWarning`;
        `data` itself when it has none. A key that is also a part's name (Talon's `switch`) is flat only when its
        value is not the part's (a dict, a `ConfigPart` or None)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        flat = [
            k
            for k in data
            if k in cls.flat_keys
            and not (k in fields and (data[k] is None or isinstance(data[k], dict | ConfigPart)))
        ]
        if not flat:
            return data
        data = dict(data)
        parts: dict[str, dict[str, Any]] = {}
        switched_off: set[str] = set()
        for key in flat:
            value = data.pop(key)
            part, _, sub = cls.flat_keys[key].partition(".")
            if not sub:  # the part's on/off switch
                if not isinstance(value, bool):
                    raise TypeError(
                        f"{cls.method}: {key} must be a dict of its settings or null (true or false in the flat "
                        f"layout of older configs), got {value!r}"
                    )
                if not value:
                    switched_off.add(part)
                parts.setdefault(part, {})
            else:
                parts.setdefault(part, {})[sub] = value
        for part, values in parts.items():
            given = data.get(part)
            if isinstance(given, ConfigPart):
                given = given._field_dict()
            data[part] = None if part in switched_off else {**values, **(given or {})}
        moved = ", ".join(
            f"{k} -> {cls.flat_keys[k]}"
            if "." in cls.flat_keys[k]
            else f"{k}: false -> {cls.flat_keys[k]}: null"
            for k in flat
        )
        warnings.warn(
            f"{cls.method}: flat config keys are deprecated and will stop loading in a future hf-spec; they now live "
            f"in the config's parts ({moved}). Re-save the config to write the nested form, e.g. "
            "`hf_spec.parse_method('old.json').save_pretrained('new_folder')` (a folder holding hf_spec_config.json)",
            FutureWarning,
            stacklevel=stacklevel,
        )
        return data

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> MethodConfig:
        """Load from a folder holding `hf_spec_config.json` or from a `.json` file (relative paths in it are read
        from its folder)."""
        return cls.from_dict(read_config(path)).with_source(config_file(path))

    def with_source(self, file: str | os.PathLike | None) -> MethodConfig:
        """Mark this config (and its nested configs) as read from `file`; returns it."""
        self.source = None if file is None else Path(file).absolute()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, MethodConfig) and value.source is None:
                value.with_source(file)
        return self

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
        kind = config_schema(cls)[cls.main_arg].scalar
        try:
            value = kind(arg) if kind is not None else arg
        except ValueError:
            raise ValueError(f"{cls.method}:{arg}: expected {kind.__name__} for {cls.main_arg}") from None
        return cls(**{cls.main_arg: value})


@dataclass
class ConfigPart(MethodConfig):
    """A part of a method's config (Talon's `switch`, Post-use's `precut`, ...): a typed dataclass checked as a method
    config is (its `__post_init__` checks its own rules), saved inside its parent's JSON object as a plain dict,
    without `method` or `config_version`. Subclasses set `method` to the name errors give it: `"talon.switch"`."""

    method: ClassVar[str] = "part"


def accepts_flat_keys(cls: type[MethodConfig]) -> type[MethodConfig]:
    """Class decorator (above `@dataclass`): the constructor also takes the keyword arguments of the flat layout
    (`cls.flat_keys`), moved into their parts with a `FutureWarning` (see `MethodConfig.nest_flat_keys`)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **cls.nest_flat_keys(kwargs))

    cls.__init__ = __init__
    return cls
