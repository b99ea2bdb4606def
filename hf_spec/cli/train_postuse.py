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
from pathlib import Path

from hf_spec.cli.argtypes import nonnegative_int, positive_int
from hf_spec.cli.common import (
    add_device_argument,
    add_dtype_argument,
    load_target,
    set_threads,
)
from hf_spec.jsonl import read_json, read_jsonl


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("postuse", help="learn a Post-use & Pre-cut Q-table on training prompts")
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


def read_prompts(path: str | Path) -> list[str]:
    """First user turns of a ShareGPT `.json`, an Alpaca seed-task `.jsonl` (instruction + first input) or a
    Spec-Bench `.jsonl` (`turns[0]`)."""
    path = Path(path)
    if path.suffix == ".json":
        rows = read_json(path)
        out = []
        for row in rows:
            turns = [t["value"] for t in row.get("conversations", []) if t.get("from") == "human"]
            if turns and turns[0].strip():
                out.append(turns[0])
        return out
    out = []
    for line_no, row in read_jsonl(path):
        if "turns" in row:
            out.append(row["turns"][0])
        elif "instruction" in row:
            extra = (row.get("instances") or [{}])[0].get("input", "")
            out.append((row["instruction"] + "\n" + extra).strip())
        else:
            raise ValueError(f"{path}:{line_no}: neither Spec-Bench `turns` nor Alpaca `instruction`")
    return out


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    from hf_spec.training.distributed import check_single_process

    check_single_process("hf-spec train postuse")  # its episodes decode one after another

    from hf_spec.bench.prompts import encode_chat
    from hf_spec.decoder import SpeculativeDecoder
    from hf_spec.methods.postuse.config import PostUseConfig
    from hf_spec.methods.postuse.controller import is_q_table
    from hf_spec.output_folder import check_output_file

    check_output_file(args.out, is_q_table, "Pre-cut Q-table")  # before the training run, not after it
    config = PostUseConfig.from_pretrained(args.config)
    if config.precut is None:
        raise SystemExit(f"{args.config} has precut off: there is no Q-table to learn")
    config.precut.freeze = False
    if args.epsilon is not None:
        config.precut.epsilon = args.epsilon
    prompts = read_prompts(args.prompts)[args.skip : args.skip + args.limit]
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts} after --skip {args.skip}")
    set_threads(args.threads)
    model, tokenizer = load_target(args)
    decoder = SpeculativeDecoder(config, tokenizer=tokenizer)
    drafter = decoder.drafter_for(model)
    bar = tqdm(prompts, desc="train postuse", unit="prompt")
    for text in bar:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}]).to(model.device)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                custom_generate=decoder,
            )
        st = drafter.stats
        bar.set_postfix(
            util=f"{st.chain_accepted / max(st.chain_tokens, 1):.2f}",
            len=f"{st.chain_tokens / max(st.rounds, 1):.1f}",
            c_T=f"{drafter.target_cost:.2f}",
        )
    drafter.save_q_table(args.out)
    print(json.dumps(drafter.stats.to_dict(), indent=1))
    print(f"wrote {args.out} ({len(drafter.controller.table)} states, {drafter.controller.updates} updates)")
    return 0
