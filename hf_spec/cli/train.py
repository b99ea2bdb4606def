"""`hf-spec train <what>`: every module `hf_spec/cli/train_<what>.py` adds one trainer with `add_parser`."""

from __future__ import annotations

import argparse
import importlib
import pkgutil


def trainer_modules() -> list[str]:
    import hf_spec.cli

    names = [m.name for m in pkgutil.iter_modules(hf_spec.cli.__path__) if m.name.startswith("train_")]
    return [f"hf_spec.cli.{name}" for name in sorted(names)]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_spec.cli.common import examples

    parser = subparsers.add_parser(
        "train",
        help="train draft heads, exit heads and other learned parts",
        description="Train a head for a target. The trainers share their options' names: --target, --prompts, "
        "--data-dir, --epochs, --topk, --dtype, --device, --out.",
        **examples(
            "hf-spec train eagle --target smollm2-135m-instruct --prompts TRAIN.json --out my-head",
            "hf-spec train eagle --help",
        ),
    )
    trainers = parser.add_subparsers(dest="trainer", required=True)
    for module_name in trainer_modules():
        importlib.import_module(module_name).add_parser(trainers)
