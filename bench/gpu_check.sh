#!/usr/bin/env bash
# The GPU check in one command, inside one overall timeout; every row is printed as it is made and
# appended to $OUT/gpu_check.jsonl (bench/out/ where OUT is unset), the log to $OUT/gpu_check.log.
#   bench/gpu_check.sh            on the GPU machine: every section (stopped at GPU_CHECK_TIMEOUT, 500 s)
#   bench/gpu_check.sh --tests    on the GPU machine: the engine's correctness tests on CUDA (TESTS_TIMEOUT,
#                                 240 s), log and JUnit XML to $OUT/tests.log and tests.xml
#   bench/gpu_check.sh --all      both in one ~9-minute call: the tests (170 s), then the check (370 s)
#   bench/gpu_check.sh --dry      every section's Python on CPU at tiny sizes, kernels interpreted
#   bench/gpu_check.sh --prepare  here, before the GPU run: SmolLM2's tokenizer files into
#                                 bench/gpu-check-tokenizer/ (git-ignored: carry it to the GPU machine)
# Wheels in .whl/ (bench/gpu_wheels.sh, carried) are installed first into /tmp/site, ahead on the path.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
out=${OUT:-bench/out}
mkdir -p "$out"

wheels() {
  [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 || return 0
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
}

check() {  # check LIMIT_S [gpu_check.py args...]
  local limit=$1
  shift
  { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.max.sm --format=csv,noheader; } 2>&1 | tee -a "$out/gpu_check.log"
  # The script's own budget ends 60 s before the timeout; -k: one that ignores TERM is killed 10 s later.
  # Either way the rows made so far are already in the JSON lines.
  timeout -k 10 "$limit" "$py" bench/gpu_check.py --out "$out" --budget $((limit - 60)) "$@" 2>&1 | tee -a "$out/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "gpu_check: stopped by its overall timeout (${limit}s); the rows made so far are in $out/gpu_check.jsonl"
  return "$rc"
}

tests() {  # tests LIMIT_S: the correctness tests the engine has, on CUDA with the compiled kernels
  local limit=$1
  local tok=bench/gpu-check-tokenizer
  [ -f "$tok/tokenizer.json" ] || { echo "no $tok: run bench/gpu_check.sh --prepare here and carry it"; return 2; }
  SLUICE_TEST_DEVICE=cuda SLUICE_TEST_TOKENIZER=$PWD/$tok TRITON_INTERPRET=0 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} \
    timeout -k 10 "$limit" "$py" -m pytest -v -p no:cacheprovider --junitxml "$out/tests.xml" -m "not slow" \
    -k "not cli_refuses and not refused_worker" \
    tests/kernels/test_kernels.py tests/engine/test_sampler_device.py tests/engine/test_engine_correctness.py tests/engine/test_transformers_models.py \
    2>&1 | tee "$out/tests.log"
  return "${PIPESTATUS[0]}"
}

case "${1:-}" in
  --prepare) exec "$py" bench/gpu_check.py --prepare ;;
  --dry|--dry-run) shift; check "${GPU_CHECK_TIMEOUT:-1200}" --dry-run "$@"; exit ;;  # the interpreter is slow
  --tests) shift; wheels; tests "${TESTS_TIMEOUT:-240}"; exit ;;
  --all) shift; wheels; tests "${TESTS_TIMEOUT:-170}"; t=$?
         check "${GPU_CHECK_TIMEOUT:-370}" --requests 64 "$@"; c=$?
         echo "gpu_check --all: tests exit $t, check exit $c"; exit $((t || c)) ;;
  *) wheels; check "${GPU_CHECK_TIMEOUT:-500}" "$@"; exit ;;
esac
