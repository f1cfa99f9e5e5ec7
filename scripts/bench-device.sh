#!/usr/bin/env bash
# On the GPU machine: writes random-weight models in real 8B shapes with `kiln dev random-model`
# (same per-tensor types and quantizer as `kiln quantize`), runs every benchmark row of the
# batched-engine issue with `kiln bench` (llama-bench and llama-batched-bench style), and prints
# one table with llama.cpp's figures on the same H200 and the bars beside kiln's numbers.
#     scripts/bench-device.sh [quick|models]   quick: Q4_K_M rows only; models: only make the models
# Models go to $BENCH_DIR (default /tmp/kiln-bench), logs and JSON to $OUT/bench when set.
set -euo pipefail
KILN=${KILN:-.gpu/kiln}
DIR=${BENCH_DIR:-/tmp/kiln-bench}
LOG=${OUT:+$OUT/bench}
LOG=${LOG:-$DIR/logs}
REPS=${BENCH_REPS:-3}
mkdir -p "$DIR" "$LOG"

model() { # shape type -> path (made on first use; another run's file counts once complete)
    local path="$DIR/$1-$2.gguf"
    if [ ! -f "$path" ]; then
        local start
        start=$(date +%s)
        "$KILN" dev random-model "$path.part" --shape "$1" --type "$2" --distinct-rows 64 > /dev/null 2>&1 && mv "$path.part" "$path"
        echo "made $path in $(($(date +%s) - start)) s" >&2
    fi
    echo "$path"
}
all_models() {
    model llama3-8b Q4_K_M > /dev/null
    for t in Q4_0 Q8_0 Q6_K; do model llama3-8b "$t" > /dev/null; done
    model qwen3-8b Q1_0 > /dev/null
}
if [ "${1:-}" = models ]; then
    all_models
    exit 0
fi
# Made before any timing, so that no quantization shares the CPU with a benchmark.
[ "${1:-}" = quick ] || all_models

bench() { # name reps args... : one kiln bench run, JSON kept as $LOG/name.json
    local name=$1 reps=$2
    shift 2
    "$KILN" bench -o json -r "$reps" "$@" > "$LOG/$name.json" 2> "$LOG/$name.err" || { echo "FAILED: $name (see $LOG/$name.err)" >&2; tail -3 "$LOG/$name.err" >&2; }
}

q4km=$(model llama3-8b Q4_K_M)
bench q4km-pp512 "$REPS" -m "$q4km" -p 512 -n 0
bench q4km-tg128 "$REPS" -m "$q4km" -p 0 -n 128
bench q4km-pp4096-d4096 2 -m "$q4km" -p 4096 -n 0 -d 4096
bench q4km-tg128-d8192 2 -m "$q4km" -p 0 -n 128 -d 8192
"$KILN" bench -m "$q4km" --batched --npp 128 --ntg 128 --npl 1,8,32,64 > "$LOG/q4km-batched.txt" 2> "$LOG/q4km-batched.err" || echo "FAILED: batched" >&2
"$KILN" run -m "$q4km" -c 8192 -n 64 --temp 0 -p "Once upon a time" > /dev/null 2> "$LOG/q4km-run-c8192.err" || echo "FAILED: run -c 8192" >&2
if [ "${1:-}" != quick ]; then
    for t in Q4_0 Q8_0 Q6_K; do
        bench "$t-pp512" "$REPS" -m "$(model llama3-8b "$t")" -p 512 -n 0
    done
    bench Q1_0-pp512 "$REPS" -m "$(model qwen3-8b Q1_0)" -p 512 -n 0
fi

python3 - "$LOG" << 'EOF'
import json, os, re, sys
log = sys.argv[1]
def ts(name):
    try:
        return json.load(open(os.path.join(log, name + ".json")))[0]["avg_ts"]
    except Exception:
        return None
rows = [
    ("Llama-3-8B Q4_K_M pp512", "q4km-pp512", 9461, 12300),
    ("Llama-3-8B Q4_0 pp512", "Q4_0-pp512", 10752, 10752),
    ("Llama-3-8B Q8_0 pp512", "Q8_0-pp512", 11024, 11024),
    ("Llama-3-8B Q6_K pp512", "Q6_K-pp512", 7705, 7705),
    ("Qwen3-8B Q1_0 pp512", "Q1_0-pp512", 9149, 9149),
    ("Llama-3-8B Q4_K_M pp4096 @ d4096", "q4km-pp4096-d4096", 9006, 9006),
    ("Llama-3-8B Q4_K_M tg128", "q4km-tg128", 268.3, 297),
    ("Llama-3-8B Q4_K_M tg128 @ d8192", "q4km-tg128-d8192", 236.5, 272),
]
print(f"{'test':<36} {'llama.cpp':>10} {'bar':>8} {'kiln':>10} {'kiln/bar':>9}")
for label, name, ref, bar in rows:
    got = ts(name)
    shown = f"{got:10.1f}" if got is not None else f"{'-':>10}"
    ratio = f"{got / bar:9.2f}" if got is not None else f"{'-':>9}"
    print(f"{label:<36} {ref:>10} {bar:>8} {shown} {ratio}")
try:
    text = open(os.path.join(log, "q4km-batched.txt")).read()
    bars = {1: (261, 522), 8: (764, 1527), 32: (3240, 6481), 64: (4493, 8986)}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 10 and cells[2].isdigit():
            b, s_tg = int(cells[2]), float(cells[7])
            ref, bar = bars.get(b, (0, 0))
            print(f"{'batched decode S_TG, B=' + str(b):<36} {ref:>10} {bar:>8} {s_tg:10.1f} {s_tg / bar if bar else 0:9.2f}")
except FileNotFoundError:
    pass
for name in ["q4km-batched.err", "q4km-run-c8192.err"]:
    try:
        for line in open(os.path.join(log, name)):
            if "memory" in line:
                print(name.split(".")[0] + ": " + line.strip())
    except FileNotFoundError:
        pass
EOF
