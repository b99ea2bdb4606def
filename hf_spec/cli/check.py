"""`hf-spec check`: which hf-spec methods a model can run, by the checks the methods themselves run."""

from __future__ import annotations

import argparse

from hf_spec.cli.argtypes import positive_int
from hf_spec.cli.common import (
    DATA_DTYPE,
    add_device_argument,
    add_dtype_argument,
    examples,
    load_target,
    set_threads,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "check",
        help="which methods a model can run",
        description="Load a causal LM and report its attention layout, whether it verifies token trees exactly "
        "as hf-spec calls it, and which methods it supports. Exit status 1 if it cannot verify trees.",
        **examples(
            "hf-spec check --target smollm2-135m-instruct",
            "hf-spec check --target path/to/any-causal-lm --dtype bfloat16",
        ),
    )
    p.add_argument("--target", required=True, help="known model name, folder or Hub id")
    p.add_argument("--threads", type=positive_int, default=None)
    add_dtype_argument(p, DATA_DTYPE)  # the exactness check is defined in float32
    add_device_argument(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hf_spec.models.support import support_report

    set_threads(args.threads)
    model, _ = load_target(args)
    print(f"{args.target}: {type(model).__name__} ({model.config.model_type}), {model.dtype}")
    report = support_report(model)
    width = max(len(topic) for topic in report)
    for topic, verdict in report.items():
        print(f"  {topic:<{width}}  {verdict}")
    return 0 if report.get("tree verification", "").startswith("yes") else 1
