#!/usr/bin/env python
"""More of the target's own answers for a corpus feature store: the answers `hf-spec data responses` generated
(greedy answers to training prompts the corpus has none for, and sampled answers) as corpus documents, to capture
into the same store with `hf-spec data features --corpus` (data/corpus/PROVENANCE.md).

    hf-spec data responses --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 --samples 1 \\
        --prompts ../shared/data/train/sharegpt_1000.json --prompts ../shared/data/train/alpaca_seed_tasks.jsonl \\
        --seed-cache ../shared/data/train/responses/qwen2.5-coder-0.5b-instruct.jsonl
    .venv/bin/python scripts/answers_corpus.py --target qwen2.5-coder-0.5b-instruct --store STORE \\
        --prompts ../shared/data/train/sharegpt_1000.json --prompts ../shared/data/train/alpaca_seed_tasks.jsonl
    hf-spec data features --target qwen2.5-coder-0.5b-instruct --dtype bfloat16 --aux-layers eagle3 \\
        --corpus ~/.cache/hf-spec/corpus/v1/qwen2.5-coder-0.5b-instruct-answers.jsonl --features-dir STORE

Sources: `answers-more`, greedy answers to prompts the store's `answers` do not cover (the same kind of text as
`answers`, which stays the held-out source); `answers-sampled`, answers sampled from the target, never to a prompt
of the store's held-out set (`--heldout`, as the trainers pick it). Greedy answers the store already holds are
skipped, and so is every document that overlaps the evaluation prompts (as `scripts/build_corpus.py` does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # hf_spec from this checkout
SHARED = REPO.parent / "shared" / "data"

from hf_spec.models.fetch import cache_root, resolve_model  # noqa: E402
from hf_spec.training.corpus import Document, EvalFilter  # noqa: E402
from hf_spec.training.features import FeatureStore  # noqa: E402
from hf_spec.training.prompts import load_train_prompts  # noqa: E402
from hf_spec.training.responses import SAMPLE_MARK, ResponseCache, default_data_dir, prompt_id_of  # noqa: E402
from hf_spec.training.store_data import ANSWERS, heldout_ids, source_of  # noqa: E402

GREEDY, SAMPLED = "answers-more", "answers-sampled"


def answer_documents(
    conversations, prompts: dict, tokenizer, have: set[str], heldout: set[str], eval_filter: EvalFilter
) -> tuple[list[Document], dict[str, int]]:
    """Documents of the cached conversations (see the module docstring) and the count of each reason to skip."""
    docs, skipped = [], {"in store": 0, "held out": 0, "no prompt": 0, "empty": 0, "evaluation overlap": 0}
    for conv in conversations:
        prompt_id = prompt_id_of(conv.id)
        sampled = SAMPLE_MARK in conv.id
        reason = None
        if not sampled and prompt_id in have:
            reason = "in store"
        elif sampled and prompt_id in heldout:
            reason = "held out"
        elif prompt_id not in prompts:
            reason = "no prompt"
        answer = tokenizer.decode(conv.response_ids, skip_special_tokens=True).strip()
        if reason is None and not answer:
            reason = "empty"
        if reason is None:
            source = SAMPLED if sampled else GREEDY
            doc = Document(
                f"{source}/{conv.id}", source, (*prompts[prompt_id].messages, ("assistant", answer))
            )
            if eval_filter.overlaps(doc.text):
                reason = "evaluation overlap"
            else:
                docs.append(doc)
        if reason is not None:
            skipped[reason] += 1
    return docs, skipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--store", required=True, help="the corpus feature store the answers will join")
    parser.add_argument(
        "--prompts", action="append", required=True, help="the prompt files answered; repeatable"
    )
    parser.add_argument("--responses", help="response cache folder (default: $HF_SPEC_CACHE/data/<target>)")
    parser.add_argument("--heldout", type=int, default=16, help="held-out prompts of the store's answers")
    parser.add_argument("--out", help="default: $HF_SPEC_CACHE/corpus/v1/<target>-answers.jsonl")
    parser.add_argument("--eval-dir", default=str(SHARED / "eval"), help="evaluation prompts to filter out")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    eval_files = sorted(Path(args.eval_dir).glob("*.jsonl"))
    if not eval_files:
        raise SystemExit(
            f"no evaluation prompts under {args.eval_dir}: the answers cannot be checked against them"
        )
    store = FeatureStore.open(args.store)
    if not any(source_of(cid) == ANSWERS for cid in store.done):
        raise SystemExit(f"{args.store} holds no `answers`: capture the corpus into it first")
    have = {prompt_id_of(cid.split("/", 1)[1]) for cid in store.done if source_of(cid) == ANSWERS}
    heldout = {prompt_id_of(cid.split("/", 1)[1]) for cid in heldout_ids(store, ANSWERS, args.heldout)}
    prompts = {p.id: p for path in args.prompts for p in load_train_prompts(path)}
    cache = ResponseCache(args.responses or default_data_dir(args.target))
    if not cache.path.exists():
        raise SystemExit(f"no answers at {cache.path}: generate them with `hf-spec data responses`")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.target))
    with tempfile.TemporaryDirectory() as tmp:  # a snapshot: a generation still running keeps appending
        shutil.copy(cache.path, Path(tmp) / cache.path.name)
        conversations = list(ResponseCache(tmp).load().values())
    docs, skipped = answer_documents(
        conversations, prompts, tokenizer, have, heldout, EvalFilter.from_files(eval_files)
    )
    out = Path(args.out or cache_root() / "corpus" / "v1" / f"{args.target}-answers.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text("".join(doc.to_json() + "\n" for doc in docs))
    partial.replace(out)  # never a half-written corpus under the final name
    counts = {s: sum(d.source == s for d in docs) for s in (GREEDY, SAMPLED)}
    manifest = {
        "target": args.target,
        "documents": counts,
        "skipped": skipped,
        "heldout_prompts": sorted(heldout),
        "responses": str(cache.path),
        "prompts": [Path(p).name for p in args.prompts],
        "eval_files": [p.name for p in eval_files],
        "sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
    }
    out.with_suffix(".manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{out}: {counts}; skipped {skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
