#!/usr/bin/env bash
# `make demo`: the whole path of a batch on one machine. Starts the embedded job server and a worker,
# submits the sample file the repository ships, shows progress, writes the results file, prints a few
# results, and stops everything it started (also on Ctrl-C or failure).
#
# Usage: scripts/demo.sh [--model MODEL] [-o OUTPUT] [--max-tokens N] [-- WORKER FLAGS...]
#   --model       a local directory, a hub id or a .gguf file [default: $SLUICE_DEMO_MODEL, else the
#                 default model, SmolLM2-135M-Instruct]
#   -o            the results file [default: demo-results.jsonl]
#   --max-tokens  for lines that set none [default: 64]
#   after --      more `sluice worker` flags, e.g. -- --dtype float32 --kv-cache-memory 64MiB
# Environment: PYTHON (the environment's python [default: .venv/bin/python]); SLUICE_HOME (the job
# server's directory [default: a temporary one, removed at the end]).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
sluice=$(dirname "$py")/sluice
model=${SLUICE_DEMO_MODEL:-}
out=demo-results.jsonl
max_tokens=64
input=$root/cli/samples/demo.jsonl
worker_flags=()
while [ $# -gt 0 ]; do
  case $1 in
    --model) model=$2; shift 2 ;;
    -o | --output) out=$2; shift 2 ;;
    --max-tokens) max_tokens=$2; shift 2 ;;
    --) shift; worker_flags=("$@"); break ;;
    -h | --help) awk 'NR > 1 && /^#/ { print substr($0, 3); next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$sluice" ] || { echo "demo: no $sluice; run \`make install\` first (or set PYTHON)" >&2; exit 1; }

# The demo's own job server: the embedded Valkey of SLUICE_HOME, never an external Redis.
unset SLUICE_REDIS_URL
made_home=0
if [ -z "${SLUICE_HOME:-}" ]; then
  SLUICE_HOME=$(mktemp -d "${TMPDIR:-/tmp}/sluice-demo.XXXXXX")
  made_home=1
fi
export SLUICE_HOME
log=$SLUICE_HOME/demo-worker.log
errors=${out%.jsonl}.errors.jsonl
started_server=0
worker_pid=
submit_pid=

server() { "$py" -c "import sys; from sluice.jobs import connection as s; $1"; }

stop_pid() { # stop_pid PID SECONDS: SIGTERM, then SIGKILL if it is still there after SECONDS
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < $2 * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" -ne 0 ] && [ -s "$log" ]; then
    echo "demo: failed ($rc); the worker's last lines:" >&2
    tail -n 20 "$log" >&2
  fi
  [ -z "$submit_pid" ] || stop_pid "$submit_pid" 5
  # The worker drains on SIGTERM (--grace-period 5 below) and then writes what it holds.
  [ -z "$worker_pid" ] || stop_pid "$worker_pid" 30
  if [ "$started_server" = 1 ]; then
    server 's.stop_server()' >/dev/null || server 's.stop_server(kill=True)' >/dev/null || true
  fi
  [ "$made_home" = 0 ] || rm -rf "$SLUICE_HOME"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# 1. The job server: started here unless one already runs in this SLUICE_HOME (then it is left running).
if ! server 'sys.exit(s.find_server() is None)'; then
  server 's.ensure_server()'
  started_server=1
fi
echo "==> job server: the embedded Valkey in $SLUICE_HOME"

# 2. One worker, in the background (its log: $log). The first run of the default model dequantizes
#    it once (tens of seconds); later runs load the cached copy.
echo "==> starting a worker on ${model:-the default model}"
"$sluice" worker ${model:+--model "$model"} --grace-period 5 ${worker_flags[@]+"${worker_flags[@]}"} >"$log" 2>&1 &
worker_pid=$!

# 3. Submit the sample and wait with a progress bar; results land in $out as each request finishes.
echo "==> sluice submit $input --wait -o $out"
rm -f "$out" "$errors"
"$sluice" submit "$input" --wait -o "$out" --errors "$errors" --max-tokens "$max_tokens" \
  ${model:+--model "$model"} >"$SLUICE_HOME/batch-id" &
submit_pid=$!
while kill -0 "$submit_pid" 2>/dev/null; do
  if ! kill -0 "$worker_pid" 2>/dev/null; then
    wait "$worker_pid" || true
    echo "demo: the worker stopped before the batch was done" >&2
    exit 1
  fi
  sleep 0.5
done
rc=0
wait "$submit_pid" || rc=$?
submit_pid=
batch_id=$(cat "$SLUICE_HOME/batch-id")
[ "$rc" = 0 ] || [ "$rc" = 3 ] || { echo "demo: sluice submit failed ($rc)" >&2; exit "$rc"; }

# 4. What the batch looked like, and a few of its results.
echo "==> sluice status $batch_id"
"$sluice" status "$batch_id"
echo "==> $(wc -l <"$out" | tr -d ' ') results in $out; the first three:"
"$py" - "$out" <<'EOF'
import json
import sys

with open(sys.argv[1], encoding="utf-8") as f:
    for line in list(f)[:3]:
        x = json.loads(line)
        choice = x["response"]["body"]["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        print(f"--- {x['custom_id']}\n{text.strip()}")
EOF
[ ! -s "$errors" ] || echo "==> some requests failed: see $errors"
exit "$rc"
