#!/bin/bash
# The Talon figures of docs/benchmarks.md (Talon section): datastore scale, then the Spec-Bench comparison (run it under
# /work/bench-quiet on a quiet machine; ~15 min at normal speed). Outputs go to
# benchmarks/results/talon-qwen2.5-coder-0.5b-instruct/.
set -e
cd "$(dirname "$0")/.."
T=qwen2.5-coder-0.5b-instruct
C=benchmarks/configs
OUT=benchmarks/results/talon-$T
mkdir -p "$OUT"
hf-spec datastore build --target $T \
  --from ../shared/data/train/sharegpt_1000.json --from ../shared/data/train/alpaca_seed_tasks.jsonl \
  --responses ../shared/data/train/responses/$T.jsonl --out runs/ds-qwen
OMP_NUM_THREADS=1 python benchmarks/datastore_scale.py --datastore runs/ds-qwen | tee "$OUT/datastore_scale.txt"
hf-spec bench --target $T \
  --methods "ar,hf-pld,retrieval:$C/retrieval-$T.json,talon:$C/talon-$T-model-only-early-exit.json,talon:$C/talon-$T-early-exit.json,talon:$C/talon-$T-async.json,talon:$C/talon-$T-preverify.json" \
  --prompts ../shared/data/eval/spec_bench_dev.jsonl --per-category 1 --max-new-tokens 96 --check-lossless \
  --out "$OUT"
