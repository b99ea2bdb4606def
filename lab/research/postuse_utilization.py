"""Draft utilization over time (paper Figure 4 analogue): the same drafter at a fixed draft length (vanilla),
with Pre-cut starting from the initial Q-table (learning online), and with a learned Q-table (frozen).

    python lab/research/postuse_utilization.py --target qwen2.5-coder-0.5b-instruct \\
        --vanilla benchmarks/configs/postuse-qwen2.5-coder-0.5b-instruct-fixed.json \\
        --learned benchmarks/configs/postuse-qwen2.5-coder-0.5b-instruct.json \\
        --prompts ../shared/data/train/sharegpt_1000.json --skip 100 --limit 8 \\
        --out lab/results/postuse-qwen2.5-coder-0.5b-instruct/utilization

Utilization of a round = drafter tokens accepted / drafter tokens drafted (cached branches not counted);
the curve is its running ratio over a sliding window of rounds. Writes utilization.png and utilization.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from hf_spec.bench.runner import encode_chat
from hf_spec.decoder import SpeculativeDecoder
from hf_spec.methods.postuse.config import PostUseConfig
from hf_spec.models import load_model
from hf_spec.training.postuse import read_prompts


def run_variant(model, tokenizer, config: PostUseConfig, prompts: list[str], max_new_tokens: int) -> dict:
    decoder = SpeculativeDecoder(config, tokenizer=tokenizer)
    drafter = decoder.drafter_for(model)
    drafter.stats.rounds_log = []
    for text in prompts:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                custom_generate=decoder,
            )
    return {"config": config.to_dict(), "rounds": drafter.stats.rounds_log, "stats": drafter.stats.to_dict()}


def sliding(rounds: list[dict], window: int) -> list[float]:
    out = []
    for i in range(len(rounds)):
        part = rounds[max(0, i + 1 - window) : i + 1]
        out.append(sum(r["accepted"] for r in part) / max(sum(r["drafted"] for r in part), 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--vanilla", required=True, help="postuse config at a fixed draft length")
    ap.add_argument("--learned", required=True, help="postuse config with precut and a learned q_table")
    ap.add_argument("--prompts", required=True, help="training prompts (ShareGPT .json / .jsonl)")
    ap.add_argument("--skip", type=int, default=100, help="skip prompts the Q-table was learned on")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--window", type=int, default=30, help="rounds in the sliding window")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.target)
    prompts = read_prompts(args.prompts)[args.skip : args.skip + args.limit]
    learned = PostUseConfig.from_pretrained(args.learned)
    if learned.precut is None or not learned.precut.q_table:
        raise SystemExit(f"{args.learned} has no precut.q_table: nothing learned to compare with")
    variants = {
        "vanilla (fixed lambda)": PostUseConfig.from_pretrained(args.vanilla),
        "initial Q (learning online)": dataclasses.replace(
            learned, precut=dataclasses.replace(learned.precut, q_table=None, freeze=False)
        ),
        "learned Q (frozen)": dataclasses.replace(learned, precut=dataclasses.replace(learned.precut, freeze=True)),
    }
    results = {}
    for name, config in variants.items():
        print(f"running {name} ...", flush=True)
        results[name] = run_variant(model, tokenizer, config, prompts, args.max_new_tokens)
        st = results[name]["stats"]
        print(
            f"  utilization {st['chain_accepted'] / max(st['chain_tokens'], 1):.3f} over {st['rounds']} rounds"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "python lab/research/postuse_utilization.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())
    }
    (out / "utilization.json").write_text(json.dumps({"meta": meta, "variants": results}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, res in results.items():
        ax.plot(sliding(res["rounds"], args.window), label=name)
    ax.set_xlabel("verification round")
    ax.set_ylabel(f"draft utilization (last {args.window} rounds)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title(f"{args.target}: drafter tokens accepted / drafted")
    fig.tight_layout()
    fig.savefig(out / "utilization.png", dpi=120)
    print(f"wrote {out}/utilization.png and utilization.json")


if __name__ == "__main__":
    main()
