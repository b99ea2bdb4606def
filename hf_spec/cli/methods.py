"""`hf-spec methods`: the registered methods and their options (default, allowed values, help)."""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(subparsers) -> argparse.ArgumentParser:
    from hf_spec.cli.common import examples

    p = subparsers.add_parser(
        "methods",
        help="list the registered methods and their config fields",
        **examples("hf-spec methods", "hf-spec methods | grep -A 12 '^eagle '"),
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hf_spec.core.registry import get_method, list_methods

    for name in list_methods():
        cfg = get_method(name).config_cls
        print(f"{name}  (name:VALUE sets {cfg.main_arg})" if cfg.main_arg else name)
        _print_fields(cfg, "    ")
    print("\nRelative paths in a config file are read from the config file's folder.")
    return 0


def _print_fields(cfg: type, prefix: str) -> None:
    """One line per field; a part of the config (`ConfigPart`) as its own line, then its fields as `part.field`."""
    from hf_spec.core.config import ConfigPart, config_schema

    schema = config_schema(cfg)
    for f in dataclasses.fields(cfg):
        field_schema, allowed = schema[f.name], ""
        if field_schema.choices:
            allowed = f" [{' | '.join(map(repr, field_schema.choices))}{' | None' if field_schema.optional else ''}]"
        part = (
            field_schema.nested
            if field_schema.nested and issubclass(field_schema.nested, ConfigPart)
            else None
        )
        if part is not None:
            off = " (None: off)" if field_schema.optional else ""
            print(f"{prefix}{f.name}{off}: {f.metadata.get('help', '')}")
            _print_fields(part, f"{prefix}{f.name}.")
        else:
            print(f"{prefix}{f.name} = {_default(f)}{allowed}: {f.metadata.get('help', '')}")


def _default(f: dataclasses.Field) -> str:
    """A field's default value, whether given as a value or as a factory (a nested config: its method's defaults)."""
    from hf_spec.core.config import MethodConfig

    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is dataclasses.MISSING:
        return "(required)"
    value = f.default_factory()
    return f"{value.method} defaults" if isinstance(value, MethodConfig) else repr(value)
