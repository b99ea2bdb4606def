#!/bin/bash
# The draft-head figures of docs/benchmarks.md (issues 3 and 4): EAGLE, HASS and Lyanna heads against ar and
# transformers' baselines in one run. Usage: benchmarks/run_heads.sh <target> [per-category] [max-new-tokens]
# Outputs: benchmarks/results/heads-<target>/. The heads are model_cards/{eagle,hass,lyanna}-<target>/
# (scripts/train_heads.sh trains them).
set -euo pipefail
cd "$(dirname "$0")/.."
T=$1; PER=${2:-1}; NEW=${3:-128}
C=benchmarks/configs
case $T in
  qwen2.5-coder-0.5b-instruct) EXIT=6 ;;
  smollm2-135m-instruct) EXIT=6 ;;
  *) echo "unknown target $T" >&2; exit 2 ;;
esac
methods="ar,hf-pld,hf-early-exit:$EXIT,pld"
for kind in eagle hass lyanna; do  # the heads trained so far
  method=$([ $kind = lyanna ] && echo lyanna || echo eagle)
  [ -f "model_cards/$kind-$T/config.json" ] && methods+=",$method:$C/$kind-$T.json"
done
hf-spec bench --target "$T" --methods "$methods" \
  --prompts ../shared/data/eval/spec_bench_dev.jsonl --per-category "$PER" --max-new-tokens "$NEW" \
  --check-lossless --out "benchmarks/results/heads-$T"
