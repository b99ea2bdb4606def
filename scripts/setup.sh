#!/usr/bin/env bash
# Create .venv and install hf-spec with its extras. Idempotent: a second run only checks.
# torch is pinned to the version the project is tested with (TORCH_SPEC overrides it): the CPU build from PyTorch's
# CPU index where nvidia-smi finds no GPU (the default index serves Linux the CUDA build, several GB of CUDA
# packages a CPU cannot use), the default index's CUDA build where it finds one.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
else
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu}
fi
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
# triton for the Triton kernels' tests (run under its interpreter on the CPU); --no-deps keeps the CPU torch
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('triton') is None)"; then
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps triton==3.9.0
fi
# bitsandbytes and optimum-quanto for the quantized-target tests (the `quant` extra); --no-deps keeps the CPU torch
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('bitsandbytes') and u.find_spec('optimum.quanto')))" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps bitsandbytes==0.50.2 optimum-quanto==0.2.7
fi
