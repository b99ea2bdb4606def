#!/bin/bash
# The Post-use & Pre-cut benchmarks behind docs/benchmarks.md (Post-use section) (each wrapped in /work/bench-quiet on the
# shared dev machine; drop the wrapper elsewhere). Run from the repository root.
set -e
C=benchmarks/configs/postuse-qwen2.5-coder-0.5b-instruct
/work/bench-quiet hf-spec bench --target qwen2.5-coder-0.5b-instruct \
  --methods ar,postuse:$C-lambda1.json,postuse:$C-L23-fixed.json,postuse:$C-reuse-draft.json,postuse:$C-reuse-target.json,postuse:$C-L23.json,postuse:$C-precut-draft-reuse.json \
  --prompts ../shared/data/eval/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 80 --check-lossless \
  --out benchmarks/results/postuse-qwen2.5-coder-0.5b-instruct
/work/bench-quiet python benchmarks/postuse_utilization.py --target qwen2.5-coder-0.5b-instruct \
  --vanilla $C-L23-fixed.json --learned $C-L23.json --prompts ../shared/data/train/sharegpt_1000.json --skip 100 --limit 5 \
  --max-new-tokens 64 --window 20 --out benchmarks/results/postuse-qwen2.5-coder-0.5b-instruct/utilization
/work/bench-quiet hf-spec bench --target qwen2.5-coder-0.5b-instruct \
  --methods ar,postuse:$C-lambda2.json,postuse:$C-lambda3.json,postuse:$C-lambda6.json,postuse:$C-lambda9.json \
  --prompts ../shared/data/eval/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 48 --check-lossless \
  --out benchmarks/results/postuse-qwen2.5-coder-0.5b-instruct-sweep-a
/work/bench-quiet hf-spec bench --target qwen2.5-coder-0.5b-instruct \
  --methods ar,postuse:$C-lambda12.json,postuse:$C-lambda18.json,postuse:$C-lambda24.json \
  --prompts ../shared/data/eval/spec_bench_dev.jsonl --per-category 1 --limit 7 --max-new-tokens 48 --check-lossless \
  --out benchmarks/results/postuse-qwen2.5-coder-0.5b-instruct-sweep-b
