#!/usr/bin/env bash
# On the GPU machine: the decode-at-the-roofline table. Writes random-weight models in real 8B
# shapes with `kiln dev random-model`, runs `kiln bench -p 512 -n 128` on each (and tg128 at
# depth 8192 on the Q4_K_M file), and prints llama.cpp's tg128 on the same H200, the bar, kiln's
# tg128 and its fraction of the roofline (4,233 GB/s measured copy bandwidth / file bytes).
#     scripts/decode-bench-device.sh [quick | NAME...]   quick: the Llama-3-8B Q4_K_M rows only;
#                                                      NAME: only the rows named (e.g. qwen3-8b-Q1_0)
# On another card, COPY_GBS=$(python3 scripts/copy-bandwidth.py) sets the roofline (default: the H200's).
# Models go to $BENCH_DIR (default /tmp/kiln-bench), JSON logs to $OUT/decode-bench when set.
# With KILN_BASE=<another kiln binary>, each row is also run with it, just before kiln (same
# machine, same file), and the table gets its tg128 and the ratio: an A/B of a change.
set -euo pipefail
KILN=${KILN:-.gpu/kiln}
KILN_BASE=${KILN_BASE:-}
DIR=${BENCH_DIR:-/tmp/kiln-bench}
LOG=${OUT:+$OUT/decode-bench}
LOG=${LOG:-$DIR/decode-logs}
REPS=${BENCH_REPS:-3}
COPY_GBS=${COPY_GBS:-4233}
[[ $COPY_GBS =~ ^[0-9]+(\.[0-9]+)?$ ]] && [[ ! $COPY_GBS =~ ^0+(\.0*)?$ ]] ||
    { echo "COPY_GBS must be a positive number of GB/s, not '$COPY_GBS'" >&2; exit 2; }
mkdir -p "$DIR" "$LOG"
scripts/kernel-cache.sh restore  # kernels compiled on an earlier machine, when carried

# name shape type pure(0/1): one row's model, made on first use (several in parallel below).
ROWS=(
    "llama3-8b-Q4_K_M llama3-8b Q4_K_M 0"
    "llama3-8b-Q4_0 llama3-8b Q4_0 0"
    "llama3-8b-Q8_0 llama3-8b Q8_0 0"
    "llama3-8b-Q6_K llama3-8b Q6_K 0"
    "llama3-8b-F16 llama3-8b F16 0"
    "qwen3-8b-Q4_K_M qwen3-8b Q4_K_M 0"
    "qwen3-8b-Q1_0 qwen3-8b Q1_0 0"
    "qwen3-8b-TQ2_0 qwen3-8b TQ2_0 0"
    "qwen3-8b-Q2_0 qwen3-8b Q2_0 0"
    "qwen3-8b-IQ4_XS-pure qwen3-8b IQ4_XS 1"
    "qwen3-8b-IQ3_S-pure qwen3-8b IQ3_S 1"
    "qwen3-8b-IQ2_XXS-pure qwen3-8b IQ2_XXS 1"
    "qwen3-8b-MXFP4-pure qwen3-8b MXFP4_MOE 1"
)
if [ "${1:-}" = quick ]; then
    ROWS=("${ROWS[0]}")
elif [ $# -gt 0 ]; then
    wanted=" $* "
    for row in "${ROWS[@]}"; do [[ $wanted == *" ${row%% *} "* ]] && picked+=("$row"); done
    [ ${#picked[@]} -gt 0 ] || { echo "no row named: $*" >&2; exit 2; }
    ROWS=("${picked[@]}")
fi

make_model() { # name shape type pure
    local path="$DIR/$1.gguf" pure=()
    [ "$4" = 1 ] && pure=(--pure)
    [ -f "$path" ] && return 0
    "$KILN" dev random-model "$path.part" --shape "$2" --type "$3" --distinct-rows 64 "${pure[@]}" > "$LOG/$1.make.log" 2>&1 && mv "$path.part" "$path" ||
        echo "could not make $1: $(tail -1 "$LOG/$1.make.log")" >&2
}
# Four at a time: each quantizer run is multi-threaded already; more only adds memory.
for row in "${ROWS[@]}"; do
    # shellcheck disable=SC2086
    make_model $row &
    while [ "$(jobs -r | wc -l)" -ge 4 ]; do sleep 1; done
done
wait

for row in "${ROWS[@]}"; do
    read -r name _ <<< "$row"
    [ -f "$DIR/$name.gguf" ] || continue
    if [ -n "$KILN_BASE" ]; then
        "$KILN_BASE" bench -o json -r "$REPS" -m "$DIR/$name.gguf" -p 512 -n 128 > "$LOG/$name.base.json" 2> "$LOG/$name.base.err" ||
            echo "FAILED (base): $name (see $LOG/$name.base.err)" >&2
    else
        rm -f "$LOG/$name.base.json"
    fi
    "$KILN" bench -o json -r "$REPS" -m "$DIR/$name.gguf" -p 512 -n 128 > "$LOG/$name.json" 2> "$LOG/$name.err" ||
        echo "FAILED: $name (see $LOG/$name.err)" >&2
done
if [[ "${ROWS[0]}" == llama3-8b-Q4_K_M* ]] && [ -f "$DIR/llama3-8b-Q4_K_M.gguf" ]; then
    "$KILN" bench -o json -r 2 -m "$DIR/llama3-8b-Q4_K_M.gguf" -p 0 -n 128 -d 8192 > "$LOG/llama3-8b-Q4_K_M-d8192.json" 2> "$LOG/d8192.err" || true
fi

scripts/kernel-cache.sh save
COPY_GBS=$COPY_GBS python3 - "$LOG" "$DIR" << 'EOF'
import json, os, sys
log, models = sys.argv[1], sys.argv[2]
BANDWIDTH = float(os.environ["COPY_GBS"]) * 1e9
print(f"roofline: {BANDWIDTH / 1e9:.0f} GB/s copy bandwidth / file bytes")
# name, label, llama.cpp tg128 (None: not measured), bar (None: 50% of the roofline)
rows = [
    ("llama3-8b-Q4_K_M", "Llama-3-8B Q4_K_M", 268.3, 430),
    ("llama3-8b-Q4_0", "Llama-3-8B Q4_0", 330.7, 496),
    ("llama3-8b-Q8_0", "Llama-3-8B Q8_0", 255.6, 383),
    ("llama3-8b-Q6_K", "Llama-3-8B Q6_K", 198.5, 321),
    ("llama3-8b-F16", "Llama-3-8B F16", 207.2, 224),
    ("qwen3-8b-Q4_K_M", "Qwen3-8B Q4_K_M", 254.2, 421),
    ("qwen3-8b-Q1_0", "Qwen3-8B Q1_0", 347.6, 1340),
    ("qwen3-8b-TQ2_0", "Qwen3-8B TQ2_0", None, 800),
    ("qwen3-8b-Q2_0", "Qwen3-8B Q2_0", None, None),
    ("qwen3-8b-IQ4_XS-pure", "Qwen3-8B IQ4_XS --pure", None, None),
    ("qwen3-8b-IQ3_S-pure", "Qwen3-8B IQ3_S --pure", None, None),
    ("qwen3-8b-IQ2_XXS-pure", "Qwen3-8B IQ2_XXS --pure", None, None),
    ("qwen3-8b-MXFP4-pure", "Qwen3-8B MXFP4 --pure", None, None),
]
def tg(name):
    try:
        for test in json.load(open(os.path.join(log, name + ".json"))):
            if test.get("n_gen", 0) > 0:
                return test["avg_ts"]
    except Exception:
        return None
ab = any(os.path.exists(os.path.join(log, name + ".base.json")) for name, *_ in rows)
print(f"{'model':<26} {'llama.cpp':>9} {'bar':>6} {'kiln':>7} {'roofline':>8} {'kiln/roof':>9} {'kiln/bar':>8}"
      + (f" {'base':>7} {'kiln/base':>9}" if ab else ""))
for name, label, ref, bar in rows:
    path = os.path.join(models, name + ".gguf")
    if not os.path.exists(path):
        continue
    roof = BANDWIDTH / os.path.getsize(path)
    bar = bar if bar is not None else 0.5 * roof
    got = tg(name)
    ref_s = f"{ref:9.1f}" if ref else f"{'-':>9}"
    if got is None:
        print(f"{label:<26} {ref_s} {bar:6.0f} {'-':>7} {roof:8.0f}")
        continue
    line = f"{label:<26} {ref_s} {bar:6.0f} {got:7.1f} {roof:8.0f} {got / roof:9.0%} {got / bar:8.2f}"
    before = tg(name + ".base") if ab else None
    if before:
        line += f" {before:7.1f} {got / before:9.3f}"
    print(line)
depth = tg("llama3-8b-Q4_K_M-d8192")
base = tg("llama3-8b-Q4_K_M")
if depth and base:
    print(f"Q4_K_M tg128 @ d8192: {depth:.1f} tok/s, {1 - depth / base:.0%} below depth 0 (bar: at most 15%)")
EOF
