#!/usr/bin/env bash
# mypy over the installed layout: the package-dir mapping puts engine/, jobs/, ... under sluice/ on
# install (pyproject.toml), and mypy follows no import hook, so it reads a tree of links laid out the
# same way (build/typecheck/sluice/engine -> engine/, ...). Errors name files under that tree.
# Usage: scripts/typecheck.sh [PYTHON]
set -euo pipefail
py=${1:-python3}
cd "$(dirname "$0")/.."
tree=build/typecheck/sluice
rm -rf build/typecheck
mkdir -p "$tree"
for f in sluice/*.py; do ln -s "$PWD/$f" "$tree/"; done
for p in engine kernels worker jobs cli api; do ln -s "$PWD/$p" "$tree/$p"; done
exec "$py" -m mypy
