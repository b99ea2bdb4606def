"""`hf-spec train eagle`: data (target answers + features, cached, or a feature store) -> EAGLE/HASS head -> Hub-style
folder."""

from __future__ import annotations

import argparse

from hf_spec.cli.argtypes import (
    nonnegative_float,
    nonnegative_int,
    positive_int,
)
from hf_spec.cli.training_args import add_common_train_args, common_train_config, train_and_save


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_spec.cli.common import examples

    parser = subparsers.add_parser(
        "eagle",
        help="train an EAGLE draft head (HASS with --topk and --align-steps)",
        **examples(
            "hf-spec train eagle --target smollm2-135m-instruct --prompts TRAIN.json --out my-head",
            "hf-spec train eagle --target smollm2-135m-instruct --prompts TRAIN.json --topk 10 --align-steps 3 "
            "--epochs 3 --out my-hass-head",
            "hf-spec train eagle --target smollm2-135m-instruct --features STORE --sources ALL --out my-head",
        ),
    )
    add_common_train_args(parser)
    parser.add_argument(
        "--align-steps", type=positive_int, default=1, help="HASS context alignment steps (1 = EAGLE)"
    )
    parser.add_argument("--topk", type=nonnegative_int, default=0, help="HASS top-K distillation K (0 = off)")
    parser.add_argument("--topk-weight", type=nonnegative_float, default=1.0, help="weight of the top-K loss")
    parser.add_argument(
        "--architecture",
        choices=("hf-spec", "eagle1"),
        default="hf-spec",
        help="eagle1: the published EAGLE-1 layer vLLM and SGLang load (`hf-spec export --format eagle`); "
        "drafts over the whole vocabulary (--draft-vocab does not apply)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_spec.methods.eagle.config import EagleConfig
    from hf_spec.methods.eagle.modeling import EagleHeadModel
    from hf_spec.training.eagle import EagleTrainConfig, train_eagle

    cfg = EagleTrainConfig(
        align_steps=args.align_steps,
        topk=args.topk,
        topk_weight=args.topk_weight,
        architecture=args.architecture,
        **common_train_config(args),
    )
    kind = "HASS" if cfg.topk or cfg.align_steps > 1 else "EAGLE"
    return train_and_save(args, cfg, train_eagle, EagleConfig, kind, EagleHeadModel)
