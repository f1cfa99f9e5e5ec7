#!/usr/bin/env bash
# kiln's CPU backend beside llama.cpp's CPU build, on the same random-weight files, in one run:
# builds llama-bench (CPU only, -march=native) from ../shared/tools/llama.cpp-34af94c.tar.xz and
# kiln, makes Qwen3-0.6B-shaped models in every file type kiln writes (and a Llama-3-8B Q4_K_M)
# with `kiln dev random-model`, runs llama-bench and `kiln bench --device cpu` back to back on each
# file (pp64 and tg32; tg16 on the 8B; Q4_K_M also at depth 2048, where attention weighs most)
# and prints one markdown table with the ratios and the bars.
#     scripts/cpu-bench.sh [--quick|--others] [--formats Q4_K_M,Q8_0,...] [--tg-only] [--pure]
#                          [--8b|--no-8b] [-r N] [-t N]
#                          [--kiln BIN] [--kiln-base BIN] [--llama-build DIR] [--models DIR] [--logs DIR]
#   --quick            only the four bar formats (Q4_K_M, Q8_0, Q4_0, Q6_K)
#   --others           only the other formats (bar: tg32 >= 0.8x llama.cpp)
#   --formats LIST     comma-separated file types instead (names as for `kiln quantize`)
#   --tg-only          generation only (tg32, `-p 0`; no pp64 and no depth-2048 row)
#   --pure             files with every quantizable tensor in the type (`random-model --pure`,
#                      kept as qwen3-0.6b-TYPE-pure.gguf) instead of the type's usual mix
#   --8b / --no-8b     with or without the Llama-3-8B Q4_K_M tg16 row (default: with)
#   -r N               repetitions of each test, for both tools (default 3); -t N: threads (default 2)
#   --kiln BIN         use this kiln binary instead of `cargo build --release -p kiln-cli`
#   --kiln-base BIN    also time this kiln binary (say, a build of the branch point) on each file,
#                      right after the other two, and add its tg column and kiln / base ratio
#   --llama-build DIR  llama.cpp's CMake build directory (llama-bench is DIR/bin/llama-bench); built
#                      there, sources unpacked into DIR/lcpp, when missing
#                      (default ${XDG_CACHE_HOME:-$HOME/.cache}/kiln/llamacpp-cpu-34af94c)
#   --models DIR       where the models are kept between runs (default .../kiln/models beside it)
#   --logs DIR         where each run's JSON and stderr go (default a new /tmp/kiln-cpu-bench.*)
# Models are made once (written to a temporary name, then renamed) and all before any timing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kiln
tarball=$root/../shared/tools/llama.cpp-34af94c.tar.xz
llama_build=$cache/llamacpp-cpu-34af94c
models=$cache/models
logs=
kiln=
kiln_base=
reps=3
threads=2
with_8b=1
bar_formats=(Q4_K_M Q8_0 Q4_0 Q6_K)
# Every other file type `kiln quantize` writes (kiln-quant's FileType::producible).
other_formats=(Q4_1 Q5_0 Q5_1 Q2_K Q3_K_S Q3_K_M Q3_K_L Q4_K_S Q5_K_S Q5_K_M IQ4_NL IQ4_XS
               TQ1_0 TQ2_0 Q1_0 Q2_0 MXFP4_MOE NVFP4 F16 BF16 F32)
formats=("${bar_formats[@]}" "${other_formats[@]}")

usage() { sed -n '2,26s/^# \{0,1\}//p' "$0"; exit "${1:-0}"; }
tg_only=0
pure=0
while [ $# -gt 0 ]; do
    case $1 in
        --quick) formats=("${bar_formats[@]}") ;;
        --others) formats=("${other_formats[@]}") ;;
        --tg-only) tg_only=1 ;;
        --pure) pure=1 ;;
        --formats) IFS=, read -r -a formats <<< "${2:?--formats needs a list}"; shift ;;
        --8b) with_8b=1 ;;
        --no-8b) with_8b=0 ;;
        -r) reps=${2:?-r needs a number}; shift ;;
        -t) threads=${2:?-t needs a number}; shift ;;
        --kiln) kiln=${2:?--kiln needs a path}; shift ;;
        --kiln-base) kiln_base=${2:?--kiln-base needs a path}; shift ;;
        --llama-build) llama_build=${2:?--llama-build needs a directory}; shift ;;
        --models) models=${2:?--models needs a directory}; shift ;;
        --logs) logs=${2:?--logs needs a directory}; shift ;;
        -h|--help) usage ;;
        *) echo "unknown argument: $1" >&2; usage 2 >&2 ;;
    esac
    shift
done
[ -n "$logs" ] || logs=$(mktemp -d /tmp/kiln-cpu-bench.XXXXXX)
mkdir -p "$models" "$logs"
say() { echo "cpu-bench: $*" >&2; }

# llama.cpp's CPU llama-bench, built once per build directory.
llama_bench=$llama_build/bin/llama-bench
if [ ! -x "$llama_bench" ]; then
    for tool in cmake ninja; do
        command -v "$tool" > /dev/null || { echo "$tool not found: apt-get install cmake ninja-build" >&2; exit 1; }
    done
    [ -f "$tarball" ] || { echo "no llama.cpp tarball at $tarball" >&2; exit 1; }
    say "building llama.cpp's CPU llama-bench in $llama_build (several minutes; log: $llama_build/build.log)"
    mkdir -p "$llama_build"
    [ -f "$llama_build/lcpp/CMakeLists.txt" ] || tar -xJf "$tarball" -C "$llama_build"
    # Without AMX: at 34af94c its tile kernels stop on an illegal instruction (SIGILL at the first
    # tilezero, Sapphire Rapids, gcc 12; llama.cpp PR 26954 addresses it). AVX-512 and VNNI stay.
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$llama_build/lcpp" -B "$llama_build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
        -DGGML_CUDA=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF > "$llama_build/cmake.log" 2>&1 \
        || { tail -20 "$llama_build/cmake.log" >&2; exit 1; }
    cmake --build "$llama_build" -j "$(nproc)" --target llama-bench > "$llama_build/build.log" 2>&1 \
        || { tail -20 "$llama_build/build.log" >&2; exit 1; }
fi

if [ -z "$kiln" ]; then
    say "building kiln (cargo build --release -p kiln-cli)"
    (cd "$root" && cargo build --release -p kiln-cli)
    kiln=${CARGO_TARGET_DIR:-$root/target}/release/kiln
fi
[ -x "$kiln" ] || { echo "no kiln binary at $kiln" >&2; exit 1; }

model() { # shape type [--pure] -> path of the model (made on first use)
    local path=$models/$1-$2${3:+-pure}.gguf
    if [ ! -f "$path" ]; then
        local part=$path.part.$$ start=$SECONDS
        say "making $path"
        # Rows repeat every 64 (same bytes per token, a fraction of the quantizing time).
        if "$kiln" dev random-model "$part" --shape "$1" --type "$2" --distinct-rows 64 ${3:+"$3"} > "$logs/make-$1-$2${3:+-pure}.log" 2>&1; then
            mv "$part" "$path"
            say "made $path in $((SECONDS - start)) s"
        else
            rm -f "$part"
            say "FAILED to make $1 $2 (see $logs/make-$1-$2.log)"
            return 1
        fi
    fi
    echo "$path"
}

# Every file first, so that no quantization shares the CPU with a measurement.
runs=()  # name|path|prompt length|generated tokens|depth
pp_len=64
[ "$tg_only" = 0 ] || pp_len=0
pure_flag=
[ "$pure" = 0 ] || pure_flag=--pure
for t in "${formats[@]}"; do
    path=$(model qwen3-0.6b "$t" $pure_flag) && runs+=("qwen3-0.6b-$t${pure_flag:+-pure}|$path|$pp_len|32|0")
    if [ "$t" = Q4_K_M ] && [ "$tg_only" = 0 ] && [ -z "$pure_flag" ]; then runs+=("qwen3-0.6b-$t-d2048|$path|64|32|2048"); fi
done
if [ "$with_8b" = 1 ]; then
    path=$(model llama3-8b Q4_K_M) && runs+=("llama3-8b-Q4_K_M|$path|0|16|0")
fi

for run in "${runs[@]}"; do
    IFS='|' read -r name path pp tg depth <<< "$run"
    say "$name: llama-bench"
    "$llama_bench" -m "$path" -t "$threads" -p "$pp" -n "$tg" -d "$depth" -r "$reps" -o json \
        > "$logs/$name.llama.json" 2> "$logs/$name.llama.err" \
        || say "llama-bench FAILED on $name: $(tail -1 "$logs/$name.llama.err")"
    say "$name: kiln bench"
    "$kiln" bench -m "$path" --device cpu -t "$threads" -p "$pp" -n "$tg" -d "$depth" -r "$reps" -o json \
        > "$logs/$name.kiln.json" 2> "$logs/$name.kiln.err" \
        || say "kiln bench FAILED on $name: $(tail -1 "$logs/$name.kiln.err")"
    if [ -n "$kiln_base" ]; then
        say "$name: kiln bench (base)"
        "$kiln_base" bench -m "$path" --device cpu -t "$threads" -p "$pp" -n "$tg" -d "$depth" -r "$reps" -o json \
            > "$logs/$name.base.json" 2> "$logs/$name.base.err" \
            || say "base kiln bench FAILED on $name: $(tail -1 "$logs/$name.base.err")"
    fi
done

say "JSON and logs in $logs"
python3 - "$logs" "${bar_formats[*]}" "${kiln_base:+base}" "${runs[@]}" << 'EOF' | tee "$logs/table.md"
import json, os, sys

logs, bar_formats, with_base, runs = sys.argv[1], sys.argv[2].split(), sys.argv[3] == "base", [r.split("|") for r in sys.argv[4:]]

def speeds(name, tool):
    """{(n_prompt, n_gen): avg tokens/s} from one tool's JSON, or None when it failed."""
    try:
        with open(os.path.join(logs, f"{name}.{tool}.json")) as f:
            return {(r["n_prompt"], r["n_gen"]): r["avg_ts"] for r in json.load(f)}
    except (OSError, ValueError, KeyError, TypeError):
        return None

def cell(v):
    return "-" if v is None else f"{v:,.1f}"

def ratio(ours, theirs):
    return ours / theirs if ours is not None and theirs else None

print(f"CPU, {os.cpu_count()} cores visible; tokens/s (avg of the repetitions); ratio = kiln / llama.cpp\n")
base_head = (" | kiln base tg32 | kiln / base", " | ---: | ---:") if with_base else ("", "")
print(f"| file | llama.cpp pp64 | kiln pp64 | ratio | llama.cpp tg32 | kiln tg32 | ratio | bar | met{base_head[0]} |")
print(f"| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---{base_head[1]} |")
failed = []
for name, _path, pp_len, tg_len, depth in runs:
    lc, kn = speeds(name, "llama"), speeds(name, "kiln")
    for tool, got in (("llama-bench", lc), ("kiln bench", kn)):
        if got is None:
            failed.append(f"{tool} on {name}: see {os.path.join(logs, name)}.{'llama' if tool == 'llama-bench' else 'kiln'}.err")
    lc, kn = lc or {}, kn or {}
    pp_len, tg_len = int(pp_len), int(tg_len)
    pp = (lc.get((pp_len, 0)), kn.get((pp_len, 0))) if pp_len else (None, None)
    tg = (lc.get((0, tg_len)), kn.get((0, tg_len)))
    pp_r, tg_r = ratio(pp[1], pp[0]), ratio(tg[1], tg[0])
    fmt = name.split("-", 2)[-1].removesuffix("-pure")
    tg_name = f"tg{tg_len}"
    if int(depth):
        # The attention part has no numeric bar: the row shows what depth costs each tool.
        label, bar, checks = f"{name[:-6]} @ depth {depth}", "-", []
    elif name.startswith("llama3-8b"):
        label, bar, checks = f"{name} ({tg_name})", f"1.0x {tg_name}", [(tg_name, tg_r, 1.0)]
    elif fmt in bar_formats and pp_len:
        label, bar, checks = name, f"1.0x pp{pp_len}+{tg_name}", [(f"pp{pp_len}", pp_r, 1.0), (tg_name, tg_r, 1.0)]
    else:
        label, bar, checks = name, f"0.8x {tg_name}", [(tg_name, tg_r, 0.8)]
    short = [test for test, got, need in checks if got is not None and got < need]
    if not checks:
        met = "-"
    elif any(got is None for _, got, _ in checks):
        met = "?"
    else:
        met = f"not met ({', '.join(short)})" if short else "met"
    r = lambda x: "-" if x is None else f"{x:.2f}x"
    base = ""
    if with_base:
        bs = speeds(name, "base") or {}
        b_tg = bs.get((0, tg_len))
        base = f" | {cell(b_tg)} | {r(ratio(tg[1], b_tg))}"
    print(f"| {label} | {cell(pp[0])} | {cell(pp[1])} | {r(pp_r)} | {cell(tg[0])} | {cell(tg[1])} | {r(tg_r)} | {bar} | {met}{base} |")
if failed:
    print("\nfailed: " + "; ".join(failed))
EOF
