#!/usr/bin/env bash
# One GPU loan's checks, each writing under OUT (default runs/gpu-session) as it finishes: the machine; with
# TRAIN_CORPUS (a corpus JSONL) and TRAIN_TARGETS (config + tokenizer folders, space-separated), the training check
# (benchmarks/gpu_train_check.py: capture with DOCS_PER_FORWARD documents a forward, default 1 then 8, EAGLE-3 and HASS
# training timed, the heads lossless on the GPU); the CUDA
# tests (tests/test_cuda.py: every method lossless on CUDA with both backends, sampling chi-square); then
# benchmarks/gpu_check.py (1B- then 8B-shaped random-weight targets, eager and compiled, within CHECK_S less 30 s;
# CHECK_S=0 skips it). Each step has its own
# time limit (TRAIN_S, TEST_S, CHECK_S seconds) so a slow one cannot starve the next.
#   scripts/gpu_session.sh [OUT]
set -u
OUT=${1:-${OUT:-runs/gpu-session}}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda); print('transformers', transformers.__version__)"
    python -c "import triton; print('triton', triton.__version__)" || echo "no triton"
    lscpu | grep -E 'Model name|^CPU\(s\)'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
if [ -n "${TRAIN_CORPUS:-}" ]; then
    targets=()
    for t in ${TRAIN_TARGETS:?TRAIN_TARGETS: the target folders to train for}; do targets+=(--target "$t"); done
    timeout "${TRAIN_S:-360}" python benchmarks/gpu_train_check.py --out "$OUT/train-check" "${targets[@]}" \
        --corpus "$TRAIN_CORPUS" --limit-tokens "${TRAIN_TOKENS:-400000}" --step-seconds "${STEP_S:-150}" \
        --docs-per-forward "${DOCS_PER_FORWARD:-1,8}" > "$OUT/train_check.log" 2>&1
    echo "train check: rc $?"; tail -n 25 "$OUT/train_check.log"
fi
timeout "${TEST_S:-240}" python -m pytest -v -p no:cacheprovider -m gpu tests/test_cuda.py tests/test_custom_ops.py --durations=15 \
    > "$OUT/test_cuda.txt" 2>&1
echo "tests: rc $?"; tail -n 25 "$OUT/test_cuda.txt"
CHECK_S=${CHECK_S:-600}
[ "$CHECK_S" = 0 ] && exit 0
timeout "$CHECK_S" python benchmarks/gpu_check.py --out "$OUT/gpu-check" --shapes 1b,8b \
    --budget-s "$((CHECK_S - 30))" --rounds benchmarks/results/rounds/qwen2.5-coder-0.5b-instruct.json \
    > "$OUT/gpu_check.log" 2>&1
echo "gpu check: rc $?"; tail -n 60 "$OUT/gpu_check.log"
