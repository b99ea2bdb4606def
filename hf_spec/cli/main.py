"""`hf-spec` entry point: one sub-command per module, each exposing `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

# sub-command name -> module (imported lazily so `hf-spec --help` stays fast)
SUBCOMMANDS = {
    "fetch": "hf_spec.cli.fetch",
    "generate": "hf_spec.cli.generate",
    "bench": "hf_spec.cli.bench",
    "methods": "hf_spec.cli.methods",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-spec", description="Lossless speculative decoding for transformers.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in SUBCOMMANDS.values():
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
