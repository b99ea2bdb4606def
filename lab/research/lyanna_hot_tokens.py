"""Hot-token sparsity of Lyanna's token-info (paper Table 2 analogue): held-out top-1 accuracy by chain depth when
only the N most frequent tokens carry token info, the size of the collapsed table for N, and the cost per node
of a table row read against the low-rank form.

Accuracy is the training evaluation itself (`lyanna_step`, teacher-forced chains with the alignment mask) on the
head's held-out conversations (every k-th of the cached feature store, as training split them); N = 0 is the dense
low-rank form over the whole draft vocabulary, "off" no token info at all.

Usage: python lab/research/lyanna_hot_tokens.py --target qwen2.5-coder-0.5b-instruct \
    --head model_cards/lyanna-qwen2.5-coder-0.5b-instruct --hot off,0,16384,8192,4096,1024 --cols 8192
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_spec.methods.lyanna.drafter import load_lyanna_head
from hf_spec.models import load_model
from hf_spec.training.features import FeatureStore
from hf_spec.training.lyanna import LyannaTrainConfig, lyanna_step
from hf_spec.training.responses import default_data_dir
from hf_spec.training.trainer import evaluate, split_heldout


def heldout_sequences(target: str, report: dict) -> list[dict]:
    store = FeatureStore.open(default_data_dir(target) / "features")
    n = report["train_conversations"] + report["heldout_conversations"]
    return split_heldout(store.load_sequences()[:n], report["heldout_conversations"])[1]


def per_node_us(fn, ids: torch.Tensor, reps: int = 200) -> float:
    fn(ids)
    start = time.perf_counter()
    for _ in range(reps):
        fn(ids)
    return (time.perf_counter() - start) / reps / ids.numel() * 1e6


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--head", required=True)
    ap.add_argument("--hot", default="off,0,16384,8192,4096,1024", help="comma list: off, 0 (dense) or N")
    ap.add_argument("--cols", type=int, default=0, help="draft columns of the table (a config's vocab_limit)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.target)
    head = load_lyanna_head(args.head, model)
    report = head.config.training
    sequences = heldout_sequences(args.target, report)
    vocab = model.get_input_embeddings().weight.shape[0]
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[head.d2t] = torch.arange(len(head.d2t))
    cfg = LyannaTrainConfig(align_steps=args.depth, draft_vocab=len(head.d2t))
    cols = args.cols or len(head.d2t)
    dense = head.token_info
    nodes = head.d2t[
        torch.randint(0, min(1024, len(head.d2t)), (16,), generator=torch.Generator().manual_seed(0))
    ]
    lowrank_us = per_node_us(lambda ids: dense(ids)[..., :cols], nodes)
    rows = []
    print(f"{len(sequences)} held-out conversations, depth {args.depth}, table columns {cols}")
    print("| hot tokens | accuracy by depth | table MiB (fp32) | table build s | us / node |")
    print("|---|---|---|---|---|")
    for spec in args.hot.split(","):
        n = 0 if spec == "off" else (int(spec) or len(head.d2t))
        hot = torch.zeros(vocab, dtype=torch.bool)
        hot[head.d2t[:n]] = True
        head.token_info = lambda ids, hot=hot: dense(ids) * hot[ids].unsqueeze(-1)
        acc = evaluate(head, sequences, cfg, t2d, lyanna_step)["accuracy_by_depth"]
        head.token_info = dense
        mib, build, us = 0.0, 0.0, 0.0
        if n:
            start = time.perf_counter()
            table = head.token_info_table(head.d2t[:n])[:, :cols].contiguous()
            build = time.perf_counter() - start
            mib = table.numel() * table.element_size() / 2**20
            us = per_node_us(lambda ids, table=table: table[t2d[ids]], nodes)
            del table
        label = "off" if spec == "off" else ("all (dense)" if spec == "0" else spec)
        row = {"hot": label, "tokens": n, "accuracy_by_depth": acc, "table_mib": round(mib, 1)}
        row |= {"table_build_s": round(build, 2), "table_us_per_node": round(us, 2)}
        rows.append(row)
        accs = " / ".join(f"{a:.3f}" for a in acc)
        print(f"| {label} | {accs} | {mib:.0f} | {build:.1f} | {us:.2f} |")
    print(f"low-rank form (no table): {lowrank_us:.2f} us / node")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"rows": rows, "lowrank_us_per_node": lowrank_us, "heldout": len(sequences)}, f, indent=1
            )


if __name__ == "__main__":
    main()
