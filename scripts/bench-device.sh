#!/usr/bin/env bash
# On the GPU machine: writes random-weight models in real 8B shapes with
# `kiln dev random-model` (same per-tensor types and quantizer as `kiln quantize`)
# and benchmarks them with `kiln bench`, llama-bench style.
#   scripts/bench-device.sh [SHAPE:TYPE ...]      default: llama3-8b in Q4_K_M, Q8_0, Q4_0
set -euo pipefail
KILN=${KILN:-.gpu/kiln}
DIR=${BENCH_DIR:-/tmp/kiln-bench}
REPS=${BENCH_REPS:-3}
mkdir -p "$DIR"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(llama3-8b:Q4_K_M llama3-8b:Q8_0 llama3-8b:Q4_0)
for c in "${cases[@]}"; do
    shape=${c%%:*}; type=${c##*:}
    model="$DIR/$shape-$type.gguf"
    if [ ! -f "$model" ]; then
        start=$(date +%s)
        "$KILN" dev random-model "$model" --shape "$shape" --type "$type" > /dev/null
        echo "made $model in $(( $(date +%s) - start )) s ($(du -h "$model" | cut -f1))" >&2
    fi
    "$KILN" bench -m "$model" -p 512 -n 128 -d 0,4096 -r "$REPS" -o md
done
