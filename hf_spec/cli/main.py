"""`hf-spec` entry point: one sub-command per module, each exposing `add_parser(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import shlex
import sys

from hf_spec.core import envs

# every module of this package but these defines one sub-command with `add_parser(subparsers)`
_NOT_COMMANDS = {"main", "common", "argtypes", "training_args"}


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
    from hf_spec import __version__
    from hf_spec.cli.common import examples

    parser = argparse.ArgumentParser(
        prog="hf-spec",
        description="Lossless speculative decoding for transformers. Every command exits with status 2 on bad "
        "input, after a one-line error (HF_SPEC_DEBUG=1 shows the traceback).",
        **examples(
            "hf-spec generate --target smollm2-135m-instruct --method pld",
            "hf-spec check --target path/to/any-causal-lm",
            "hf-spec COMMAND --help",
        ),
    )
    parser.add_argument("--version", action="version", version=f"hf-spec {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in command_modules():
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a sub-command; errors propagate (for callers and tests), see `console_main` for the shell."""
    args = build_parser().parse_args(argv)
    # the command as given (for training reports and model cards): `argv` when called from Python, else the shell's
    args.command_line = "hf-spec " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# what bad input raises: shown as one line in the shell (HF_SPEC_DEBUG=1 shows the traceback)
_INPUT_ERRORS = (ValueError, TypeError, KeyError, OSError)


def console_main(argv: list[str] | None = None) -> int:
    """The `hf-spec` command: bad input ends with a one-line error and exit status 2, not a traceback."""
    try:
        return main(argv)
    except _INPUT_ERRORS as err:
        if envs.HF_SPEC_DEBUG:
            raise
        message = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        print(
            f"hf-spec: error: {message or type(err).__name__} (HF_SPEC_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(console_main())
