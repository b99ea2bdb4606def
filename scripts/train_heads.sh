#!/bin/bash
# Train (or resume: re-run the same command) the draft heads committed under model_cards/, from the target's corpus
# feature store (scripts/build_corpus.py, then AUX=1 scripts/capture_corpus.sh <target>).
# Usage: scripts/train_heads.sh <target> <hass|eagle|lyanna|eagle3> [extra hf-spec train args...]
# Environment: FEATURES (default: the store capture_corpus.sh writes), EPOCHS (default 1), THREADS (default 2),
# BATCH_TOKENS (default 1024) and LR (default 3e-4): smaller batches than the trainers' default, as more steps
# paid at equal tokens (docs/training.md, "Steps, learning rate and objective at equal tokens"); LIMIT_TOKENS
# (train on the first N tokens of the store; default: all of it), LOW (a command that lowers the priority, e.g.
# `nice -n 19`).
# Each run checkpoints to $HF_SPEC_CACHE/runs/<head folder name>-<path hash>; the held-out set is the same 16 of
# the target's answers for every head (--heldout-sources auto), so their agreement figures compare.
set -euo pipefail
target=$1; kind=$2; shift 2
cache=${HF_SPEC_CACHE:-$HOME/.cache/hf-spec}
case $target in
  smollm2-135m-instruct) vocab=16384 ;;
  qwen2.5-coder-0.5b-instruct) vocab=16384 ;;  # trains 1.5x as fast as 32768 at the same agreement
  *) echo "unknown target $target" >&2; exit 2 ;;
esac
store=${FEATURES:-$cache/corpus/${CORPUS:-v1}/features/$target-bfloat16-eagle3}
[ -d "$store" ] || { echo "no feature store at $store: run scripts/capture_corpus.sh $target first" >&2; exit 2; }
common=(--target "$target" --features "$store" --draft-vocab "$vocab" --epochs "${EPOCHS:-1}" --threads "${THREADS:-2}"
        --batch-tokens "${BATCH_TOKENS:-1024}" --lr "${LR:-3e-4}"
        ${LIMIT_TOKENS:+--limit-tokens "$LIMIT_TOKENS"})
run=(${LOW:-} hf-spec train)
case $kind in
  hass) exec "${run[@]}" eagle "${common[@]}" --align-steps 3 --topk 10 --init-from-last-layer \
          --out "model_cards/hass-$target" "$@" ;;
  eagle) exec "${run[@]}" eagle "${common[@]}" --align-steps 1 --init-from-last-layer \
          --out "model_cards/eagle-$target" "$@" ;;
  lyanna) exec "${run[@]}" lyanna "${common[@]}" --chain-steps 4 --out "model_cards/lyanna-$target" "$@" ;;
  eagle3) exec "${run[@]}" eagle3 "${common[@]}" --align-steps 3 --topk 10 --out "model_cards/eagle3-$target" "$@" ;;
  *) echo "unknown head kind $kind (hass, eagle, lyanna or eagle3)" >&2; exit 2 ;;
esac
