#!/usr/bin/env bash
# Create .venv and install hf-spec with its extras. Idempotent: a second run only checks.
# torch is pinned to the CPU build the project is tested with (TORCH_SPEC overrides it): an unpinned
# `torch` from the registry pulls several GB of CUDA packages on a CPU-only machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # shellcheck disable=SC2086 # TORCH_SPEC may carry pip options
  .venv/bin/pip install --quiet --disable-pip-version-check $TORCH_SPEC
fi
if ! .venv/bin/python -c "import hf_spec, gguf, matplotlib, pytest, hypothesis" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.hf_spec_installed ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[gguf,bench,dev]"
  touch .venv/.hf_spec_installed
fi
