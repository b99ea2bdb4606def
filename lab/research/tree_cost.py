"""What one greedy verification costs by tree size, on each prompt's own cache (the loop's verification path,
`hf_spec.engine.target.forward.time_verifications`, with the loop's attention): where a fused Talon tree stops being free
on this machine.

    python lab/research/tree_cost.py --prompts PROMPTS.jsonl [--limit 5] [--dtype bfloat16] [--sizes 1,4,8,...]

Prints one JSON line a prompt: its category, length and the milliseconds of a verification by tree size.
"""

from __future__ import annotations

import json

import torch
from postuse_budget import load_target, prompt_arguments
from transformers import DynamicCache

from hf_spec.bench.runner import encode_chat, load_prompts
from hf_spec.core.drafter import Drafter, SpecState
from hf_spec.engine.target.forward import time_verifications


class _StockForward(Drafter):
    """Only for `verify_forward` (the stock target forward)."""

    def propose(self, state, max_depth):
        raise NotImplementedError


def main() -> None:
    parser = prompt_arguments(__doc__, limit=5)
    parser.add_argument("--sizes", default="1,4,8,12,13,14,16,18,20,24,28,32")
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    model, tokenizer = load_target(args)
    sizes = [int(n) for n in args.sizes.split(",")]
    drafter = _StockForward.__new__(_StockForward)  # verify_forward needs no drafter state
    for prompt in load_prompts(args.prompts, limit=args.limit):
        ids = encode_chat(tokenizer, [{"role": "user", "content": prompt.turns[0]}])
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        state = SpecState(model, cache, ids, model.generation_config)
        costs = time_verifications(drafter, state, sizes, repeats=args.repeats)
        row = {"category": prompt.category, "prompt_tokens": ids.shape[1]}
        print(json.dumps({**row, "ms": {n: round(1000 * s, 1) for n, s in costs.items()}}), flush=True)


if __name__ == "__main__":
    main()
