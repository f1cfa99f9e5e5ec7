#!/usr/bin/env bash
# On a GPU machine with two or more GPUs (nvidia-h200-x2): the rows of the tensor-parallel
# issue. Runs the tensor-parallel GPU tests (NCCL sum, sharded = unsharded logits and greedy
# tokens on the tiny models, the all-reduce time per layer), writes random-weight Llama-3-8B
# and Llama-3-70B models in Q4_K_M (`kiln dev random-model`), checks tp=2 against tp=1 on the
# 8B (greedy text equal), and runs `kiln bench -p 512 -n 128` and the batched bench at 64
# sequences at tp=1 and tp=2 (the 70B at tp=2 only), then prints one table with the bars.
#     scripts/tp-bench-device.sh
# libnccl comes from scripts/nccl-env.sh (pip's nvidia-nccl wheel beside torch). Models go to $BENCH_DIR (default /tmp/kiln-tp), logs to
# $OUT/tp-bench when set.
set -uo pipefail
KILN=${KILN:-.gpu/kiln}
DIR=${BENCH_DIR:-/tmp/kiln-tp}
LOG=${OUT:+$OUT/tp-bench}
LOG=${LOG:-$DIR/logs}
REPS=${BENCH_REPS:-2}
mkdir -p "$DIR" "$LOG"
eval "$(bash scripts/nvrtc-env.sh)"
eval "$(bash scripts/nccl-env.sh)"
gpus=$(nvidia-smi -L 2> /dev/null | wc -l)
echo "GPUs: $gpus" >&2

for t in .gpu/bin/kiln-cuda--gpu_tensor_parallel; do
    [ -x "$t" ] && "$t" --include-ignored --nocapture --test-threads 1 > "$LOG/gpu-tests.txt" 2>&1 || echo "FAILED: $t (see $LOG/gpu-tests.txt)" >&2
done

model() { # shape -> path, made once
    local path="$DIR/$1-Q4_K_M.gguf"
    if [ ! -f "$path" ]; then
        "$KILN" dev random-model "$path.part" --shape "$1" --type Q4_K_M --distinct-rows 64 > /dev/null 2>&1 && mv "$path.part" "$path" || echo "FAILED: making $1" >&2
    fi
    echo "$path"
}
bench() { # name args...
    local name=$1
    shift
    "$KILN" bench -o json -r "$REPS" "$@" > "$LOG/$name.json" 2> "$LOG/$name.err" || { echo "FAILED: $name" >&2; tail -3 "$LOG/$name.err" >&2; }
}
batched() { # name args...
    local name=$1
    shift
    "$KILN" bench --batched -npp 128 -ntg 128 -npl 64 "$@" > "$LOG/$name.txt" 2> "$LOG/$name.err" || { echo "FAILED: $name" >&2; tail -3 "$LOG/$name.err" >&2; }
}

m8=$(model llama3-8b)
for tp in 1 2; do
    "$KILN" run -m "$m8" -tp "$tp" -n 32 --temp 0 -p "Once upon a time" --no-display-prompt > "$LOG/8b-text-tp$tp.txt" 2> "$LOG/8b-run-tp$tp.err"
    bench "8b-tp$tp" -m "$m8" -tp "$tp" -p 512 -n 128
    batched "8b-batched-tp$tp" -m "$m8" -tp "$tp"
done
cmp -s "$LOG/8b-text-tp1.txt" "$LOG/8b-text-tp2.txt" && echo "8B greedy text: tp=2 equals tp=1" || echo "8B greedy text: tp=2 DIFFERS from tp=1" >&2
rm -f "$m8"
m70=$(model llama3-70b)
bench 70b-tp2 -m "$m70" -tp 2 -p 512 -n 128

python3 - "$LOG" << 'PY'
import json, os, re, sys
log = sys.argv[1]
def rate(name, test):
    try:
        rows = json.load(open(os.path.join(log, name + ".json")))
    except Exception:
        return None
    for r in rows:
        if (test == "pp" and r["n_prompt"] > 0) or (test == "tg" and r["n_gen"] > 0):
            return r["avg_ts"]
def batched(name):
    try:
        for line in open(os.path.join(log, name + ".txt")):
            cells = [c.strip() for c in line.split("|")[1:-1]]
            if len(cells) == 10 and cells[2] == "64":
                return float(cells[7])
    except Exception:
        return None
def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"
fmt = lambda v: f"{v:,.1f}" if v else "-"
print("| Llama-3-8B Q4_K_M | tp=1 | tp=2 | tp=2 / tp=1 | bar |")
print("| --- | ---: | ---: | ---: | ---: |")
for label, f, bar in [("pp512", lambda n: rate(n, "pp"), "1.7x"), ("tg128", lambda n: rate(n, "tg"), "1.4x")]:
    a, b = f("8b-tp1"), f("8b-tp2")
    print(f"| {label} | {fmt(a)} | {fmt(b)} | {ratio(b, a)} | {bar} |")
a, b = batched("8b-batched-tp1"), batched("8b-batched-tp2")
print(f"| batched S_TG, 64 sequences | {fmt(a)} | {fmt(b)} | {ratio(b, a)} | 1.6x |")
tg70 = rate("70b-tp2", "tg")
# Roofline: two GPUs' copy bandwidth (2 x 4.2 TB/s) over the file's bytes.
size = os.path.getsize("/tmp/kiln-tp/llama3-70b-Q4_K_M.gguf") if os.path.exists("/tmp/kiln-tp/llama3-70b-Q4_K_M.gguf") else None
roof = 2 * 4.2e12 / size if size else None
print(f"\n70B Q4_K_M at tp=2: pp512 {fmt(rate('70b-tp2', 'pp'))}, tg128 {fmt(tg70)}" + (f", {100 * tg70 / roof:.0f}% of the {roof:.0f} tok/s roofline (bar 50%)" if tg70 and roof else ""))
try:
    for line in open(os.path.join(log, "gpu-tests.txt")):
        if "all-reduce" in line and "us" in line:
            print(line.rstrip())
except Exception:
    pass
PY
