#!/bin/bash
# EAGLE-3 against HASS on the same tokens: both heads trained the same way on the same slice of a target's corpus
# store, then on from each over the target's answers (the two steps of scripts/train_heads.sh), then decoded side
# by side at two tree budgets in one `hf-spec bench` run.
# Usage: lab/same_tokens.sh [target]   (default qwen2.5-coder-0.5b-instruct)
# Environment: TOKENS (step-1 tokens, default 0.6M), OUT (default lab/results/scaling/same-tokens),
# FEATURES (default: the store scripts/capture_corpus.sh writes with AUX=1; it must hold TOKENS plus the held-out
# answers, e.g. `AUX=1 LIMIT_TOKENS=700000 scripts/capture_corpus.sh <target>`). For small runs: DRAFT_VOCAB
# (16384), VOCAB_LIMIT (8192 drafted rows), BATCH_TOKENS (1024), HELDOUT (16 held-out answers), PROMPTS
# (Spec-Bench's dev set), BENCH_ARGS (one prompt of each category, 128 new tokens). Re-running resumes every step.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.venv/bin:$PATH
target=${1:-qwen2.5-coder-0.5b-instruct}
cache=${HF_SPEC_CACHE:-$HOME/.cache/hf-spec}
store=${FEATURES:-$cache/corpus/${CORPUS:-v1}/features/$target-bfloat16-eagle3}
out=${OUT:-lab/results/scaling/same-tokens}
tokens=${TOKENS:-0.6M}
arm=same-$tokens
shape=(--threads 1 --align-steps 3 --topk 10)  # both steps, both heads: 1 thread each, side by side
method_of() { [ "$1" = hass ] && echo eagle || echo eagle3; }  # the hf-spec method (and trainer) of a head kind
wait_all() {  # wait_all STEP PID...: fail naming the step if any run failed
  local step=$1; shift
  for pid in "$@"; do wait "$pid" || { echo "$step failed: see the train.log files under $out" >&2; exit 1; }; done
}
[ -d "$store" ] || { echo "no feature store at $store: run AUX=1 scripts/capture_corpus.sh $target" >&2; exit 2; }

# step 1: one epoch over the first $tokens tokens of the store (answers first), 1 thread each, side by side
common=(--target "$target" --features "$store" --epochs 1 "${shape[@]}" --heldout "${HELDOUT:-16}"
        --arm "$arm:ALL:$tokens")
step1=(--draft-vocab "${DRAFT_VOCAB:-16384}" --batch-tokens "${BATCH_TOKENS:-1024}" --lr 3e-4)
python lab/scaling_curve.py "${common[@]}" --method eagle3 --out "$out/eagle3" -- "${step1[@]}" &
pids=($!)
python lab/scaling_curve.py "${common[@]}" --method eagle --out "$out/hass" -- "${step1[@]}" \
  --init-from-last-layer &
pids+=($!)
wait_all "step 1" "${pids[@]}"

# step 2: on from each head over the target's own answers, 2 epochs at lr 1e-4
pids=()
for kind in eagle3 hass; do
  mkdir -p "$out/step2/$kind"
  hf-spec train "$(method_of "$kind")" --target "$target" --features "$store" --sources answers \
    --init-from "$out/$kind/arms/$arm/head" --epochs 2 --lr 1e-4 --heldout "${HELDOUT:-16}" "${shape[@]}" \
    --batch-tokens "${BATCH_TOKENS:-1024}" \
    --checkpoint-dir "$out/step2/$kind/run" --out "$out/step2/$kind/head" > "$out/step2/$kind/train.log" 2>&1 &
  pids+=($!)
done
wait_all "step 2" "${pids[@]}"

# decoding: both heads of both steps at two tree budgets, in one run (configs written here, heads beside them)
methods=ar
mkdir -p "$out/configs"
for step in "" step2; do
  for tree in "4 2 5" "6 3 12"; do
    read -r depth topk total <<<"$tree"
    for kind in eagle3 hass; do
      head=$([ -n "$step" ] && echo "../step2/$kind/head" || echo "../$kind/arms/$arm/head")
      method=$(method_of "$kind")
      config="$out/configs/$kind${step:+-$step}-d${depth}k${topk}t${total}.json"
      printf '{\n  "method": "%s",\n  "head": "%s",\n  "depth": %s,\n  "topk": %s,\n  "total_tokens": %s,\n  "vocab_limit": %s,\n  "quantize": "int4"\n}\n' \
        "$method" "$head" "$depth" "$topk" "$total" "${VOCAB_LIMIT:-8192}" > "$config"
      methods+=",$method:$config"
    done
  done
done
read -r -a bench_args <<<"${BENCH_ARGS:---per-category 1 --max-new-tokens 128}"
hf-spec bench --target "$target" --prompts "${PROMPTS:-benchmarks/prompts/spec_bench_dev.jsonl}" "${bench_args[@]}" \
  --check-lossless --dtype bfloat16 --threads 2 --methods "$methods" --out "$out/bench"
