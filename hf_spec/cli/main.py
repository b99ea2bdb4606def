"""`hf-spec` entry point: one sub-command per module, each exposing `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

# every module of this package but these defines one sub-command with `add_parser(subparsers)`
_NOT_COMMANDS = {"main", "common"}


def command_modules() -> list[str]:
    import hf_spec.cli

    names = [
        m.name
        for m in pkgutil.iter_modules(hf_spec.cli.__path__)
        if m.name not in _NOT_COMMANDS
        and not m.name.startswith("train_")  # those are `hf-spec train` trainers
    ]
    return [f"hf_spec.cli.{name}" for name in sorted(names)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-spec", description="Lossless speculative decoding for transformers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in command_modules():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
