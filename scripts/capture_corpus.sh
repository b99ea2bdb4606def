#!/bin/bash
# Capture (or resume: re-run the same command) the prefill features of the corpus built by scripts/build_corpus.py.
# Usage: scripts/capture_corpus.sh <target> [extra `hf-spec data features` args...]
# Runs in the background at the lowest CPU priority; progress: <store>/capture.log and <store>/progress.json.
set -euo pipefail
target=$1; shift
cache=${HF_SPEC_CACHE:-$HOME/.cache/hf-spec}
corpus=$cache/corpus/${CORPUS:-v1}/$target.jsonl
store=$cache/corpus/${CORPUS:-v1}/features/$target-bfloat16${AUX:+-eagle3}
[ -f "$corpus" ] || { echo "no corpus at $corpus: run scripts/build_corpus.py first" >&2; exit 2; }
mkdir -p "$store"
# AUX=1 adds EAGLE-3's three layers (about 4x the disk: 7.3 KB a token at hidden 896, against 1.9 KB without)
cmd=(.venv/bin/hf-spec data features --target "$target" --corpus "$corpus" --features-dir "$store" --dtype bfloat16
     --threads "${THREADS:-2}" --shard-tokens 4096 --log "$store/capture.log" ${AUX:+--aux-layers eagle3}
     ${LIMIT_TOKENS:+--limit-tokens "$LIMIT_TOKENS"} "$@")
# LOW: the command that lowers its priority (default nice -n 19)
HF_HUB_OFFLINE=1 nohup ${LOW:-nice -n 19} "${cmd[@]}" >>"$store/stdout.log" 2>&1 &
echo "capturing in the background (pid $!): tail -f $store/capture.log"
