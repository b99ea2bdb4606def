"""`hf-spec train lyanna`: data (cached) -> Lyanna hidden-state chain head -> Hub-style folder."""

from __future__ import annotations

import argparse

from hf_spec.cli.argtypes import nonnegative_int, positive_int
from hf_spec.cli.training_args import add_common_train_args, common_train_config, train_and_save


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_spec.cli.common import examples

    parser = subparsers.add_parser(
        "lyanna",
        help="train a Lyanna hidden-state auto-regressive draft head",
        **examples(
            "hf-spec train lyanna --target smollm2-135m-instruct --prompts TRAIN.json --chain-steps 4 --out my-head",
        ),
    )
    add_common_train_args(parser)
    parser.add_argument(
        "--chain-steps", type=positive_int, default=4, help="chain depths unrolled in training"
    )
    parser.add_argument(
        "--token-info-rank", type=nonnegative_int, default=64, help="rank d of W1/W2 (0: no token info)"
    )
    parser.add_argument("--no-first-token-fusion", action="store_true", help="ablation: h1 = Layer(h0)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hf_spec.methods.lyanna.config import LyannaConfig
    from hf_spec.methods.lyanna.modeling import LyannaHeadModel
    from hf_spec.training.lyanna import LyannaTrainConfig, train_lyanna

    cfg = LyannaTrainConfig(
        align_steps=args.chain_steps,
        token_info_rank=args.token_info_rank,
        first_token_fusion=not args.no_first_token_fusion,
        **common_train_config(args),
    )
    return train_and_save(args, cfg, train_lyanna, LyannaConfig, "Lyanna", LyannaHeadModel)
