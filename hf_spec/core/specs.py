"""Method specs: the strings and files that name a method and its settings, read into configs.

A spec is `"pld"`, `"early-exit:6"`, `"eagle:path/to/head"`, `"name:config.json"`, a saved config (a `.json` file
or a folder holding `hf_spec_config.json`), or a Hub id of a repo holding one (`org/name[@revision]`).
"""

from __future__ import annotations

import os

from hf_spec.core.config import CONFIG_NAME, MethodConfig, config_file, config_schema, read_config
from hf_spec.core.hub_ids import HubIdError, parse_hub_id, resolve_folder
from hf_spec.core.registry import get_method, is_method, list_methods

HEAD_IN_THIS_FOLDER = "."  # a recipe's head path meaning "the folder custom_generate was loaded from"


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
    if sep and is_method(name):  # `name:ARG`, where ARG may itself be a config path or Hub id
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


def resolved_config(config: MethodConfig, parse_specs: bool = True) -> MethodConfig:
    """`config` with its relative paths made absolute (`MethodConfig.resolved`); with `parse_specs`, a wrapped
    drafter given as a method spec becomes its resolved config."""
    return config.resolved(parse_method if parse_specs else None)


def config_from_hub(spec: str, method_cls: type[MethodConfig] | None = None) -> MethodConfig | None:
    """The hf-spec config saved in the Hub repo `spec` names (its `hf_spec_config.json`: a saved recipe, a
    `custom_generate` folder, a head folder), as a `MethodConfig`; None when `spec` is no Hub id or when
    `method_cls` takes a path of its own as its main argument (a model, a datastore, a head), which its
    `from_cli_arg` resolves. A head folder's own recipe (`"head": "."`) names the repo itself."""
    if parse_hub_id(spec) is None:
        return None
    if method_cls is not None and method_cls.main_arg is not None:
        main = config_schema(method_cls)[method_cls.main_arg]  # a path field: `str` or `str | None`
        if main.kinds == (str,) and main.nested is None:
            return None
    folder = resolve_folder(spec, "hf-spec config", [CONFIG_NAME, "custom_generate/*"])
    try:
        data = read_config(folder)
    except FileNotFoundError:
        raise HubIdError(
            f"hf-spec config {spec!r}: the Hub repo holds no {CONFIG_NAME} (a published head? name its method: "
            f"eagle:{spec})"
        ) from None
    if data.get("head") == HEAD_IN_THIS_FOLDER:
        data["head"] = spec
    if method_cls is None:
        method_cls = get_method(data.get("method", "")).config_cls
    return method_cls.from_dict(data)


__all__ = ["HEAD_IN_THIS_FOLDER", "config_from_hub", "parse_method", "resolved_config"]
