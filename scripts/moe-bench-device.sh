#!/usr/bin/env bash
# On the GPU machine: the rows of the new-architectures issue. Writes random-weight models in
# the real shapes (`kiln dev random-model`: Qwen3-30B-A3B, Gemma-4-26B-A4B and Qwen3.5-35B-A3B
# in Q4_K_M, gpt-oss-20b in MXFP4 as released), runs `kiln bench -p 512 -n 128` and llama.cpp's
# llama-bench (same flags, -ngl 99 -fa 1) on each, and prints one table: both tools' numbers,
# kiln / llama.cpp, and tg128 as a share of the roofline of the bytes a token reads (every
# tensor but the embedding table, and of the expert tensors only the n_used of n_expert that
# a token chooses).
#     scripts/moe-bench-device.sh [SHAPE ...]   default: all four shapes
# llama.cpp is built first when .gpu/llama.cpp-34af94c.tar.xz and .gpu/build-llamacpp.sh are
# carried (about 5 minutes, overlapped with making the models); without them its columns stay
# empty. Each model is deleted after its rows (the disk holds about two). Logs: $OUT/moe-bench.
set -uo pipefail
KILN=${KILN:-.gpu/kiln}
DIR=${BENCH_DIR:-/tmp/kiln-moe}
LOG=${OUT:+$OUT/moe-bench}
LOG=${LOG:-$DIR/logs}
REPS=${BENCH_REPS:-2}
LLAMA_BIN=/tmp/llamacpp/build/bin
mkdir -p "$DIR" "$LOG"
scripts/kernel-cache.sh restore  # kernels compiled on an earlier machine, when carried
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(qwen3-30b-a3b gpt-oss-20b gemma4-26b-a4b qwen3.5-35b-a3b)

if [ ! -x "$LLAMA_BIN/llama-bench" ] && [ -f .gpu/llama.cpp-34af94c.tar.xz ]; then
    (bash .gpu/build-llamacpp.sh "$PWD/.gpu/llama.cpp-34af94c.tar.xz" /tmp/llamacpp/build llama-bench > "$LOG/llamacpp-build.log" 2>&1) &
    build_pid=$!
fi

make_model() { # shape -> path
    local path="$DIR/$1.gguf" start
    start=$(date +%s)
    "$KILN" dev random-model "$path" --shape "$1" --distinct-rows 64 > "$LOG/$1-make.log" 2>&1 || echo "FAILED: making $1" >&2
    echo "made $1 in $(($(date +%s) - start)) s ($(du -h "$path" | cut -f1))" >&2
}

make_model "${shapes[0]}"
for i in "${!shapes[@]}"; do
    shape=${shapes[$i]}
    path="$DIR/$shape.gguf"
    next=${shapes[$((i + 1))]:-}
    "$KILN" info --json "$path" > "$LOG/$shape-info.json" 2> /dev/null
    [ -n "${build_pid:-}" ] && { wait "$build_pid"; build_pid=; }
    "$KILN" bench -o json -r "$REPS" -m "$path" -p 512 -n 128 > "$LOG/$shape-kiln.json" 2> "$LOG/$shape-kiln.err" ||
        { echo "FAILED: kiln bench $shape" >&2; tail -3 "$LOG/$shape-kiln.err" >&2; }
    if [ -x "$LLAMA_BIN/llama-bench" ]; then
        "$LLAMA_BIN/llama-bench" -m "$path" -p 512 -n 128 -ngl 99 -fa 1 -r "$REPS" -o json > "$LOG/$shape-llama.json" 2> "$LOG/$shape-llama.err" ||
            echo "FAILED: llama-bench $shape" >&2
    fi
    rm -f "$path"
    [ -n "$next" ] && make_model "$next"
done

scripts/kernel-cache.sh save
python3 - "$LOG" "${shapes[@]}" << 'EOF'
import json, os, sys
log, shapes = sys.argv[1], sys.argv[2:]
# (experts, chosen per token) of each shape (kiln-quant's synthetic/archs.rs).
experts = {"qwen3-30b-a3b": (128, 8), "gemma4-26b-a4b": (128, 8), "qwen3.5-35b-a3b": (256, 8), "gpt-oss-20b": (32, 4)}
ROOFLINE = 4.2e12  # measured copy bandwidth of the H200, bytes/s

def load(name):
    try:
        return json.load(open(os.path.join(log, name)))
    except Exception:
        return None

def rate(rows, pp):
    # kiln bench and llama-bench both write n_prompt / n_gen and avg_ts per test.
    for r in rows or []:
        if (r.get("n_prompt", 0) > 0) == pp:
            return r.get("avg_ts")
    return None

def token_bytes(info, shape):
    n_expert, n_used = experts[shape]
    total = 0.0
    for t in info["tensors"]:
        if t["name"] == "token_embd.weight":
            continue
        share = n_used / n_expert if "_exps" in t["name"] else 1.0
        total += t["bytes"] * share
    return total

print(f"{'model':<18} {'test':<6} {'llama.cpp':>10} {'kiln':>10} {'ratio':>6} {'bar':>5} {'roofline':>9} {'% roofline':>10}")
for shape in shapes:
    kiln, llama, info = load(f"{shape}-kiln.json"), load(f"{shape}-llama.json"), load(f"{shape}-info.json")
    for test, pp, bar in [("pp512", True, 1.0), ("tg128", False, 1.3)]:
        k, l = rate(kiln, pp), rate(llama, pp)
        fmt = lambda v: f"{v:10.1f}" if v else f"{'-':>10}"
        ratio = f"{k / l:6.2f}" if k and l else f"{'-':>6}"
        roof = ROOFLINE / token_bytes(info, shape) if info and not pp else None
        share = f"{100 * k / roof:9.0f}%" if roof and k else f"{'':>10}"
        print(f"{shape:<18} {test:<6} {fmt(l)} {fmt(k)} {ratio} {bar:5.1f} {fmt(roof) if roof else f'{chr(32):>9}'} {share}")
EOF
