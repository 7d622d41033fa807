#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes; the table is printed last):
#   bench/gpu_check.sh            on the GPU machine
#   bench/gpu_check.sh --dry-run  tiny shapes on CPU under the Triton interpreter
#   bench/gpu_check.sh --prepare  here, before the GPU run: SmolLM2's tokenizer files into
#                                 bench/gpu-check-tokenizer/ (git-ignored: carry it to the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
[ "${1:-}" = --prepare ] && exec "$py" bench/gpu_check.py --prepare
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
exec "$py" bench/gpu_check.py "$@"
