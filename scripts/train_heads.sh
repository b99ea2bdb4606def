#!/bin/bash
# Train (or resume: re-run the same command) the draft heads committed under model_cards/, from the target's corpus
# feature store (scripts/build_corpus.py, then AUX=1 scripts/capture_corpus.sh <target>).
# Usage: scripts/train_heads.sh <target> <hass|eagle|lyanna|eagle3> [extra hf-spec train args...]
# Environment: FEATURES (default: the store capture_corpus.sh writes), EPOCHS (default 1), THREADS (default 2),
# BATCH_TOKENS (default 1024) and LR (default 3e-4): smaller batches than the trainers' default, as more steps
# paid at equal tokens (docs/training.md, "Steps, learning rate and objective at equal tokens"); LIMIT_TOKENS
# (train on the first N tokens of the store; default: all of it), LOW (a command that lowers the priority, e.g.
# `nice -n 19`); for the second step, ANSWER_EPOCHS (default 2) and ANSWER_LR (default 1e-4).
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
  hass) trainer=eagle; shape=(--align-steps 3 --topk 10); warm=(--init-from-last-layer) ;;
  eagle) trainer=eagle; shape=(--align-steps 1); warm=(--init-from-last-layer) ;;
  lyanna) trainer=lyanna; shape=(--chain-steps 4); warm=() ;;
  eagle3) trainer=eagle3; shape=(--align-steps 3 --topk 10); warm=() ;;
  *) echo "unknown head kind $kind (hass, eagle, lyanna or eagle3)" >&2; exit 2 ;;
esac
# Two steps (docs/training.md, "At 4.5M tokens"): the whole store, then on from that head (--init-from) over the
# target's own answers only. The first head is kept outside model_cards/; step 1 is skipped once it is written whole.
base="$cache/heads/$kind-$target-store"
[ -f "$base/hf_spec_checksums.json" ] ||
  "${run[@]}" "$trainer" "${common[@]}" "${shape[@]}" "${warm[@]}" --out "$base" "$@"
exec "${run[@]}" "$trainer" --target "$target" --features "$store" --sources answers,answers-more --init-from "$base" \
  --epochs "${ANSWER_EPOCHS:-2}" --lr "${ANSWER_LR:-1e-4}" --threads "${THREADS:-2}" \
  --batch-tokens "${BATCH_TOKENS:-1024}" "${shape[@]}" --out "model_cards/$kind-$target" "$@"
