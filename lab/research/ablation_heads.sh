#!/bin/bash
# Head ablations on SmolLM2-135M-Instruct at a small fixed training budget (the first
# $LIMIT ShareGPT conversations, $EPOCHS epochs, identical data order for every head):
#   align  - HASS context-alignment steps 1..4, top-K 10 on (HASS Table 3 analogue; n = 1 is no alignment)
#   lyanna - full / no token-info / no first-token fusion (Lyanna Table 1 analogue)
# then one bench per ablation: tau, speedup and conditional acceptance by depth (results.json).
# Usage: lab/research/ablation_heads.sh align|lyanna   (heads under $HF_SPEC_CACHE/ablations, not committed)
set -euo pipefail
cd "$(dirname "$0")/.."
which=$1
T=smollm2-135m-instruct
LIMIT=${LIMIT:-300}; EPOCHS=${EPOCHS:-2}
A=${HF_SPEC_CACHE:-$HOME/.cache/hf-spec}/ablations/$T
data=(--target $T --cached-only --prompts ../shared/data/train/sharegpt_1000.json --limit "$LIMIT"
      --draft-vocab 16384 --epochs "$EPOCHS" --threads "${THREADS:-2}" --save-every 50)
methods=ar
case $which in
  align)
    for n in 1 2 3 4; do
      [ -f "$A/align$n/config.json" ] || hf-spec train eagle "${data[@]}" --topk 10 --align-steps "$n" \
        --out "$A/align$n" --checkpoint-dir "$A/runs/align$n"
      methods+=",eagle:$A/align$n"
    done ;;
  lyanna)
    for v in full:"" no-token-info:"--token-info-rank 0" no-fusion:"--no-first-token-fusion"; do
      name=${v%%:*}
      # shellcheck disable=SC2086
      [ -f "$A/lyanna-$name/config.json" ] || hf-spec train lyanna "${data[@]}" --chain-steps 4 ${v#*:} \
        --out "$A/lyanna-$name" --checkpoint-dir "$A/runs/lyanna-$name"
      methods+=",lyanna:$A/lyanna-$name"
    done ;;
  *) echo "usage: $0 align|lyanna" >&2; exit 2 ;;
esac
hf-spec bench --target $T --methods "$methods" --prompts ../shared/data/eval/spec_bench_dev.jsonl \
  --per-category 1 --max-new-tokens 128 --check-lossless --out "lab/results/ablation-$which-$T"
