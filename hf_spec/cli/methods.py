"""`hf-spec methods`: the registered methods and their options."""

from __future__ import annotations

import argparse
import dataclasses


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("methods", help="list the registered methods and their config fields")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hf_spec.registry import get_method, list_methods

    for name in list_methods():
        cfg = get_method(name).config_cls
        print(f"{name}  (name:VALUE sets {cfg.main_arg})" if cfg.main_arg else name)
        for f in dataclasses.fields(cfg):
            print(f"    {f.name} = {_default(f)!r}: {f.metadata.get('help', '')}")
    return 0


def _default(f: dataclasses.Field):
    """A field's default value, whether given as a value or as a factory."""
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"
