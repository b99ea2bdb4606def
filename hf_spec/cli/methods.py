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
            print(f"    {f.name} = {f.default!r}: {f.metadata.get('help', '')}")
    return 0
