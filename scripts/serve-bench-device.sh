#!/usr/bin/env bash
# On the GPU machine: starts `kiln serve` on a model with -np 64, waits for /health, runs
# scripts/load-test.py (1, 8, 32, 64 concurrent streaming clients, 128-token prompts as ids,
# 128 generated with ignore_eos) and stops the server.
#     scripts/serve-bench-device.sh MODEL.gguf [load-test.py args...]
# Environment: KILN (default .gpu/kiln), PORT (default 8080), SERVE_ARGS (extra kiln serve
# flags, e.g. "--kv-mem 0.9"); the server's log goes to $OUT/serve-bench/ when OUT is set.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:?usage: scripts/serve-bench-device.sh MODEL.gguf [load-test args...]}
shift
KILN=${KILN:-.gpu/kiln}
PORT=${PORT:-8080}
LOG=${OUT:+$OUT/serve-bench}
LOG=${LOG:-/tmp/kiln-serve-bench}
mkdir -p "$LOG"

# shellcheck disable=SC2086
"$KILN" serve -m "$MODEL" --port "$PORT" -np 64 -c 4096 --device cuda ${SERVE_ARGS:-} > "$LOG/serve.out" 2> "$LOG/serve.err" &
server=$!
stop() { kill -TERM "$server" 2> /dev/null && wait "$server" || true; }
trap stop EXIT

# The GPU machine may lack curl: Python's standard library fetches instead.
fetch() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' "$1"; }
for _ in $(seq 600); do
    if fetch "http://127.0.0.1:$PORT/health" > /dev/null 2>&1; then
        break
    fi
    if ! kill -0 "$server" 2> /dev/null; then
        echo "kiln serve exited while loading:" >&2
        cat "$LOG/serve.err" >&2
        exit 1
    fi
    sleep 0.5
done
fetch "http://127.0.0.1:$PORT/health" > /dev/null || { echo "kiln serve not healthy after 300 s" >&2; exit 1; }
# One unmeasured pass first: kernel shapes are measured at their first use per batch size. Its
# prompts come from another seed, so that no measured prompt finds its blocks in the prefix cache.
python3 scripts/load-test.py --url "http://127.0.0.1:$PORT" --concurrency 64,32,8,1 --rounds 1 --seed 7919 > "$LOG/warm-up.md"
python3 scripts/load-test.py --url "http://127.0.0.1:$PORT" --concurrency 1,8,32,64 --rounds 3 "$@" | tee "$LOG/load-test.md"
fetch "http://127.0.0.1:$PORT/metrics" > "$LOG/metrics.txt" || true
