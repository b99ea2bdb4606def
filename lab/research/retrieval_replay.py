"""Replay retrieval drafting against recorded greedy answers: tau per category in seconds, no target forwards.

A deterministic drafter's acceptance under greedy decoding depends only on the answer, so recording the target's
greedy answers once lets every retrieval config (and transformers' prompt lookup, `hf-pld`) be scored offline:
each round drafts a tree for prompt + answer so far, the longest tree path the answer follows is accepted, and
one more token is committed. The per-prompt tau equals the bench's (checked on a summarization run).

    python lab/research/retrieval_replay.py record --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 \\
        --categories summarization,rag --first 1 --last 20 --out answers.jsonl
    python lab/research/retrieval_replay.py replay answers.jsonl benchmarks/configs/retrieval-*.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import numpy as np
import torch

from hf_spec.bench.runner import encode_chat, load_prompts
from hf_spec.methods.pld.ngram_matcher import first_continuation
from hf_spec.methods.retrieval.config import RetrievalConfig
from hf_spec.methods.retrieval.retriever import Retriever
from hf_spec.models import load_model
from hf_spec.tree.draft_tree import DraftTree
from hf_spec.tree.fusion import matched_depth

SPEC_BENCH = "../shared/data/eval/spec_bench_dev.jsonl"


def record(args) -> None:
    """Greedy answers (`max_new_tokens`) of the `first`..`last` prompt of each category, appended as JSON lines."""
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.target, dtype=getattr(torch, args.dtype))
    seen: dict[str, int] = defaultdict(int)
    with open(args.out, "a") as out:
        for p in load_prompts(args.prompts):
            seen[p.category] += 1
            wanted = p.category in args.categories.split(",")
            if not wanted or not args.first <= seen[p.category] <= args.last:
                continue
            ids = encode_chat(tok, [{"role": "user", "content": p.turns[0]}])
            out_ids = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            answer = out_ids[0, ids.shape[1] :]
            row = {"question_id": p.question_id, "category": p.category, "index": seen[p.category]}
            out.write(json.dumps({**row, "prompt": ids[0].tolist(), "answer": answer.tolist()}) + "\n")
            out.flush()
            print(p.question_id, p.category, flush=True)


def replay_tau(rows: list[dict], propose) -> list[float]:
    """Per-prompt tau (answer tokens per verification round) of `propose(context) -> DraftTree`."""
    taus = []
    for r in rows:
        prompt, answer = np.array(r["prompt"]), r["answer"]
        i = rounds = 0
        while i < len(answer):
            tree = propose(np.concatenate([prompt, np.array(answer[:i], dtype=prompt.dtype)]))
            i += matched_depth(tree, answer[i:]) + 1
            rounds += 1
        taus.append(len(answer) / rounds)
    return taus


def replay(args) -> None:
    rows = [json.loads(line) for line in open(args.answers)]
    model, tok = load_model(args.target)  # the vocabulary check and datastore recipes need the target

    def prompt_lookup(context):
        return DraftTree.chain(first_continuation(context, 2, 10))  # transformers' defaults (hf-pld)

    base = replay_tau(rows, prompt_lookup)
    results = {"hf-pld": base}
    for path in args.configs:
        settings = {k: v for k, v in json.load(open(path)).items() if k != "method"}
        retriever = Retriever(RetrievalConfig(**settings), model, tok)

        def propose(context, retriever=retriever):
            return retriever.propose(context, 10**6)[0]

        results[path] = replay_tau(rows, propose)
    print("| drafter | category | prompts | mean tau | tau / hf-pld's (mean) | lowest | prompts below 1 |")
    print("|---|---|---|---|---|---|---|")
    for name, taus in results.items():
        by_cat: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r, t, b in zip(rows, taus, base, strict=True):
            by_cat[r["category"]].append((t, t / b))
        for cat, pairs in sorted(by_cat.items()):
            ratios = [q for _, q in pairs]
            print(
                f"| `{name}` | {cat} | {len(pairs)} | {np.mean([t for t, _ in pairs]):.2f} | {np.mean(ratios):.3f} "
                f"| {min(ratios):.2f} | {sum(q < 1 for q in ratios)} |"
            )


def main() -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record greedy answers")
    rec.add_argument("--target", required=True)
    rec.add_argument("--dtype", default="bfloat16")
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--prompts", default=SPEC_BENCH)
    rec.add_argument("--categories", default="summarization,rag")
    rec.add_argument("--first", type=int, default=1, help="first prompt of each category (1-based)")
    rec.add_argument("--last", type=int, default=20, help="last prompt of each category")
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--out", required=True)
    rep = sub.add_parser("replay", help="score retrieval configs against recorded answers")
    rep.add_argument("answers")
    rep.add_argument("configs", nargs="*")
    rep.add_argument("--target", default="qwen2.5-coder-0.5b-instruct")
    args = parser.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
