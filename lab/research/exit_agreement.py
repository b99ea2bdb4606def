"""How often the target's final norm + LM head applied after layer K predicts the next greedy token (what an
untrained early-exit drafter can hope for). Usage: python lab/research/exit_agreement.py [--target NAME]"""

from __future__ import annotations

import argparse
import json

import torch

from hf_spec.bench.runner import encode_chat
from hf_spec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", default="../shared/data/train/alpaca_seed_tasks.jsonl")
    ap.add_argument("--n", type=int, default=8)
    args = ap.parse_args()
    model, tok = load_model(args.target)
    with open(args.prompts) as f:  # Alpaca seed tasks: instruction + the first instance's input
        rows = [json.loads(line) for line in f if line.strip()][: args.n]
    texts = [
        (r["instruction"] + "\n" + (r.get("instances") or [{}])[0].get("input", "")).strip() for r in rows
    ]
    layers = model.config.num_hidden_layers
    hits = torch.zeros(layers)
    total = 0
    with torch.no_grad():
        for text in texts:
            ids = encode_chat(tok, [{"role": "user", "content": text}])
            seq = model.generate(ids, max_new_tokens=48, do_sample=False)
            hs = model(input_ids=seq, output_hidden_states=True).hidden_states
            target = seq[0, ids.shape[1] :]
            for k in range(1, layers):
                pred = model.lm_head(model.model.norm(hs[k]))[0, ids.shape[1] - 1 : -1].argmax(-1)
                hits[k - 1] += (pred == target).sum()
            total += len(target)
    print("| exit layer | next-token agreement |\n|---|---|")
    for k in range(1, layers):
        print(f"| {k} | {hits[k - 1] / total:.2f} |")


if __name__ == "__main__":
    main()
