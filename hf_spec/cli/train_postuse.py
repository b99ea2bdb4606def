"""`hf-spec train postuse`: learn a Pre-cut Q-table (and nothing else) by decoding training prompts.

    hf-spec train postuse --target qwen2.5-coder-0.5b-instruct \\
        --config benchmarks/configs/postuse-qwen2.5-coder-0.5b-instruct.json \\
        --prompts data/train/sharegpt_1000.json --limit 40 --out qtable.json

The config's drafter, cache and controller settings are used as given, with learning on (`freeze` off).
Use training prompts only: never the prompts you evaluate on.
"""

from __future__ import annotations

import argparse
import json

from hf_spec.cli.argtypes import nonnegative_int, positive_int
from hf_spec.cli.common import (
    add_device_argument,
    add_dtype_argument,
    load_target,
    set_threads,
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from hf_spec.cli.common import examples

    p = subparsers.add_parser(
        "postuse",
        help="learn a Post-use & Pre-cut Q-table on training prompts",
        **examples(
            "hf-spec train postuse --target qwen2.5-coder-0.5b-instruct --config postuse.json --prompts TRAIN.json "
            "--limit 40 --out q_table.json",
        ),
    )
    p.add_argument("--target", required=True, help="known model name, local folder or Hub id")
    p.add_argument("--config", required=True, help="postuse config .json (its q_table, if set, is the start)")
    p.add_argument(
        "--prompts", required=True, help="ShareGPT .json, Alpaca seed-task .jsonl or Spec-Bench-style .jsonl"
    )
    p.add_argument("--skip", type=nonnegative_int, default=0, help="skip the first N prompts")
    p.add_argument("--limit", type=positive_int, default=40, help="prompts to decode")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--epsilon", type=float, default=None, help="exploration while learning (default: config)")
    p.add_argument("--threads", type=positive_int, default=None)
    add_dtype_argument(p)  # learn the table in the dtype it will run in: draft and target costs depend on it
    add_device_argument(p)
    p.add_argument("--out", required=True, help="where to write the Q-table JSON")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from hf_spec.io.output_folder import check_output_file
    from hf_spec.methods.postuse.config import PostUseConfig
    from hf_spec.methods.postuse.controller import is_q_table
    from hf_spec.training.distributed import check_single_process
    from hf_spec.training.postuse import learn_q_table, read_prompts

    check_single_process("hf-spec train postuse")  # its episodes decode one after another
    check_output_file(args.out, is_q_table, "Pre-cut Q-table")  # before the training run, not after it
    config = PostUseConfig.from_pretrained(args.config)
    if config.precut is None:
        raise ValueError(f"{args.config} has precut off: there is no Q-table to learn")
    prompts = read_prompts(args.prompts)[args.skip : args.skip + args.limit]
    if not prompts:
        raise ValueError(f"no prompts in {args.prompts} after --skip {args.skip}")
    set_threads(args.threads)
    model, tokenizer = load_target(args)
    drafter = learn_q_table(model, tokenizer, config, prompts, args.max_new_tokens, args.epsilon)
    drafter.save_q_table(args.out)
    print(json.dumps(drafter.stats.to_dict(), indent=1))
    print(f"wrote {args.out} ({len(drafter.controller.table)} states, {drafter.controller.updates} updates)")
    return 0
