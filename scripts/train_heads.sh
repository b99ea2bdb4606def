#!/bin/bash
# Train (or resume: re-run the same command) the draft heads committed under model_cards/.
# Usage: scripts/train_heads.sh <target> <hass|eagle|lyanna> [extra hf-spec train args...]
# Each run checkpoints to $HF_SPEC_CACHE/runs/<head folder name>-<path hash>; data and features are cached per target.
set -euo pipefail
target=$1; kind=$2; shift 2
case $target in
  smollm2-135m-instruct) vocab=16384; epochs=3 ;;
  qwen2.5-coder-0.5b-instruct) vocab=32768; epochs=4 ;;
  *) echo "unknown target $target" >&2; exit 2 ;;
esac
# training prompts: ShareGPT + Alpaca seed tasks (never evaluation prompts)
common=(--target "$target" --cached-only
        --prompts ../shared/data/train/sharegpt_1000.json --prompts ../shared/data/train/alpaca_seed_tasks.jsonl
        --draft-vocab "$vocab" --epochs "$epochs" --threads "${THREADS:-2}")
case $kind in
  hass) exec hf-spec train eagle "${common[@]}" --align-steps 3 --topk 10 --out "model_cards/hass-$target" "$@" ;;
  eagle) exec hf-spec train eagle "${common[@]}" --align-steps 1 --out "model_cards/eagle-$target" "$@" ;;
  lyanna) exec hf-spec train lyanna "${common[@]}" --chain-steps 4 --out "model_cards/lyanna-$target" "$@" ;;
  *) echo "unknown head kind $kind" >&2; exit 2 ;;
esac
