#!/usr/bin/env bash
# CPU head training with and without keeping freed memory (docs/training.md, "Memory on a CPU"): the same
# `hf-spec train eagle3` run twice back to back, HF_SPEC_KEEP_FREED_MEMORY=1 then 0. Prints each run's trained
# tokens/s, kernel seconds and peak memory, and whether the two heads' weights are identical.
#   lab/keep_freed_memory.sh STORE [TARGET] [TOKENS]    # STORE: a feature store with EAGLE-3's layers
set -euo pipefail
store=$1; target=${2:-smollm2-135m-instruct}; tokens=${3:-80000}
hf_spec=.venv/bin/hf-spec  # run from the repository root, after scripts/setup.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores"
for keep in 1 0; do
    HF_SPEC_KEEP_FREED_MEMORY=$keep HF_HUB_OFFLINE=1 /usr/bin/time -f "%S %M" -o "$work/time-$keep" \
        "$hf_spec" train eagle3 --target "$target" --features "$store" --draft-vocab 16384 --epochs 1 --threads 2 \
        --batch-tokens 1024 --lr 3e-4 --limit-tokens "$tokens" --align-steps 3 --topk 10 --heldout 4 \
        --save-every 100000 --checkpoint-dir "$work/run-$keep" --out "$work/head-$keep" > "$work/log-$keep" 2>&1
    rate=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['tokens_per_second'])" \
        "$work/head-$keep/training_report.json")
    read -r kernel peak < "$work/time-$keep"
    echo "HF_SPEC_KEEP_FREED_MEMORY=$keep: $rate trained tokens/s, $kernel s in the kernel, peak ${peak} KB"
done
if cmp -s "$work/head-1/model.safetensors" "$work/head-0/model.safetensors"; then
    echo "head weights: identical"
else
    echo "head weights: differ"
fi
