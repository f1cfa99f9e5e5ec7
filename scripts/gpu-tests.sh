#!/usr/bin/env bash
# Runs on the GPU machine, from a copy of the repository carrying .gpu/ (made here by
# scripts/build-gpu-bundle.sh): every test binary in .gpu/bin/ with --include-ignored, then
# the kiln binary's checks (device list, a decode under compute-sanitizer memcheck, a timed
# decode), then each extra command given as an argument (run with bash -c), then a summary table.
#     scripts/gpu-tests.sh ['.gpu/kiln info --devices' ...]
# Logs go to $OUT/gpu-tests/ when $OUT is set (the device tool fetches it), else .gpu/logs/.
# Exits 1 when any binary or command fails.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD

# The bundle unpacked, test data, the build checkout's path, NVRTC, carried kernels, NCCL.
. scripts/device-env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "warning: nvidia-smi failed" >&2

logs=${OUT:+$OUT/gpu-tests}
logs=${logs:-$root/.gpu/logs}
mkdir -p "$logs"

rows=()
failed=0
count() { # what log: sum of "N <what>" over the libtest result lines
    grep -E '^test result:' "$2" | grep -oE "[0-9]+ $1" | awk '{s += $1} END {print s + 0}'
}
run_logged() { # label log is_test_binary command...
    local label=$1 log=$2 is_test=$3 start_ms status result elapsed_ms
    shift 3
    echo "=== $label"
    start_ms=$(($(date +%s%N) / 1000000))
    "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    elapsed_ms=$(($(date +%s%N) / 1000000 - start_ms))
    result=ok
    [ "$status" -eq 0 ] || { result="rc=$status"; failed=1; }
    local passed=- failures=- ignored=-
    if [ "$is_test" = yes ]; then
        passed=$(count passed "$log") failures=$(count failed "$log") ignored=$(count ignored "$log")
    fi
    rows+=("$(printf '%-40s %-7s %7s %7s %8s %6d.%d' "${label:0:40}" "$result" "$passed" "$failures" "$ignored" \
        $((elapsed_ms / 1000)) $((elapsed_ms % 1000 / 100)))")
}

shopt -s nullglob
binaries=(.gpu/bin/*)
[ ${#binaries[@]} -gt 0 ] || echo "warning: no test binaries in .gpu/bin/ (run scripts/build-gpu-bundle.sh)" >&2
for binary in "${binaries[@]}"; do
    [ -x "$binary" ] || continue
    name=$(basename "$binary")
    # --show-output prints what passing tests report (error tables, timings) after the run.
    run_logged "$name" "$logs/$name.log" yes "$binary" --include-ignored --show-output
done
# Whole-program checks of the CUDA decode path when the kiln binary is staged: the device
# list, one greedy decode under compute-sanitizer's memcheck and one sampled decode (the
# sampler's shared-memory radix passes) under racecheck (any error fails them), a longer
# decode whose tokens/s line shows the speed, and greedy runs repeated that must agree.
if [ -x .gpu/kiln ]; then
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    set -- ".gpu/kiln info --devices" \
        "$sanitizer --tool memcheck --error-exitcode 1 .gpu/kiln run -m models/stories260K.gguf --device cuda -n 8 --temp 0" \
        "$sanitizer --tool racecheck --error-exitcode 1 .gpu/kiln run -m models/stories260K.gguf --device cuda -n 8 --temp 0.8 --repeat-penalty 1.1 -s 1" \
        ".gpu/kiln run -m models/stories260K.gguf --device cuda -n 400 --temp 0 --no-display-prompt" \
        "scripts/repeat-runs.sh .gpu/kiln models/stories260K.gguf $KILN_TESTDATA/models/tiny-llama-Q8_0.gguf" "$@"
fi
# The batched engine with prefill chunks and decode tokens mixed in one step, under memcheck.
if [ -x .gpu/bin/kiln-cuda--gpu_models ]; then
    sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    set -- "$@" "$sanitizer --tool memcheck --error-exitcode 1 .gpu/bin/kiln-cuda--gpu_models --include-ignored batched_sequences_match_each_sequence_alone"
fi
index=0
for command in "$@"; do
    index=$((index + 1))
    run_logged "$command" "$logs/command-$index.log" no bash -c "$command"
done

scripts/kernel-cache.sh save
echo
echo "=== summary (logs in $logs)"
printf '%-40s %-7s %7s %7s %8s %8s\n' "binary / command" status passed failed ignored seconds
printf '%s\n' "${rows[@]}"
exit $failed
