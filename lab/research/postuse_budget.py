"""Which verification tree budget `max_tree_nodes: 0` measures on this machine, prompt by prompt.

    python lab/research/postuse_budget.py --config benchmarks/configs/postuse-qwen2.5-coder-0.5b-instruct.json \\
        --prompts PROMPTS.jsonl --limit 4 --dtype bfloat16

Prints one JSON line a prompt: its length, the verification milliseconds by tree size, the budget kept.
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_spec import SpeculativeDecoder
from hf_spec.bench.runner import encode_chat, load_prompts
from hf_spec.models import load_model


def prompt_arguments(description: str, limit: int) -> argparse.ArgumentParser:
    """The options of a per-prompt measurement: target, prompts file, how many prompts, dtype, torch threads."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=limit)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    return parser


def load_target(args: argparse.Namespace):
    """`(model, tokenizer)` of `prompt_arguments`' target, dtype and threads."""
    torch.set_num_threads(args.threads)
    return load_model(args.target, dtype=getattr(torch, args.dtype))


def main() -> None:
    parser = prompt_arguments(__doc__, limit=4)
    parser.add_argument("--config", required=True, help="a postuse config with max_tree_nodes 0")
    args = parser.parse_args()
    model, tok = load_target(args)
    for p in load_prompts(args.prompts)[: args.limit]:
        decoder = SpeculativeDecoder(
            f"postuse:{args.config}", tokenizer=tok
        )  # a fresh drafter measures again
        ids = encode_chat(tok, [{"role": "user", "content": p.turns[0]}])
        model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=decoder)
        drafter = decoder.drafter_for(model)
        costs = {n: round(t * 1e3, 1) for n, t in drafter.verification_costs.items()}
        row = {"question_id": p.question_id, "prompt_tokens": ids.shape[1], "verify_ms": costs}
        print(json.dumps({**row, "max_tree_nodes": drafter.tree_budget}), flush=True)


if __name__ == "__main__":
    main()
