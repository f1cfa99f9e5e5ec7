#!/usr/bin/env bash
# Builds, here, the release test binaries and the kiln binary, and stages them with the test
# data in .gpu/ (git-ignored) for the lead to carry to the GPU machine and run there with
# scripts/gpu-tests.sh.
#     scripts/build-gpu-bundle.sh [--all] [cargo package selection, default: --workspace]
# By default only test binaries that contain #[ignore]d tests (the GPU tests) are staged, to
# keep the carried bundle small; --all stages every test binary.
# Layout: .gpu/bin/<crate>--<test target> (test binaries), .gpu/kiln, .gpu/shared/testdata
# (gpu-tests.sh points KILN_TESTDATA at it), .gpu/shared/models with --all (kiln-quant reads it),
# .gpu/build-root (this checkout's path, compiled into the binaries for the repository's own files);
# all of it packed into .gpu/bundle.tar.xz when over 60 MiB (gpu-tests.sh unpacks it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target-gpu-bundle}

all=no
if [ "${1:-}" = --all ]; then all=yes; shift; fi
selection=("$@")
[ ${#selection[@]} -gt 0 ] || selection=(--workspace)

rm -rf .gpu/bin .gpu/kiln .gpu/shared .gpu/bundle.tar.xz
mkdir -p .gpu/bin
echo "$root" > .gpu/build-root

artifacts() { # jq filter over cargo's JSON messages -> "executable<TAB>crate<TAB>target" lines
    jq -r "select(.reason == \"compiler-artifact\" and .executable != null and ($1))
           | [.executable, (.manifest_path | split(\"/\") | .[-2]), .target.name] | @tsv"
}

echo "building release test binaries (${selection[*]}) in $CARGO_TARGET_DIR"
cargo test --release --no-run --message-format=json "${selection[@]}" > .gpu/build-tests.json
artifacts '.profile.test == true' < .gpu/build-tests.json | while IFS=$'\t' read -r exe crate target; do
    if [ "$all" = no ] && [ "$("$exe" --list --ignored 2>/dev/null | grep -c ': test$')" -eq 0 ]; then
        echo "  skip  $crate--$target (no ignored tests)"
        continue
    fi
    echo "  stage $crate--$target"
    objcopy --strip-debug "$exe" ".gpu/bin/$crate--$target"
done

echo "building the kiln binary"
if cargo build --release --message-format=json -p kiln-cli > .gpu/build-kiln.json; then
    artifacts '.target.kind == ["bin"] and .target.name == "kiln"' < .gpu/build-kiln.json |
        while IFS=$'\t' read -r exe _ _; do objcopy --strip-debug "$exe" .gpu/kiln; done
fi
[ -x .gpu/kiln ] || echo "WARNING: the kiln binary did not build; only the test binaries are staged" >&2

testdata="$(dirname "$root")/shared/testdata"
if [ -d "$testdata" ]; then
    # The GPU tests read testdata/models only; the whole folder is over the device's carry limit.
    mkdir -p .gpu/shared/testdata
    cp -a "$testdata/README.md" "$testdata/models" .gpu/shared/testdata/
    # One file of each new architecture (all of them exceed the carry limit), with references:
    # the Q4_K files, and gpt-oss's MXFP4 experts and its Q8_0 file.
    mkdir -p .gpu/shared/testdata/archs
    for f in "$testdata"/archs/tiny-*-Q4_K.gguf "$testdata"/archs/tiny-gpt-oss-*.gguf; do
        cp -a "$f" "$f.ref.json" .gpu/shared/testdata/archs/
    done
else
    echo "warning: no test data at $testdata; tests that need it will fail on the device" >&2
fi
if [ "$all" = yes ] && [ -d "$(dirname "$testdata")/models" ]; then
    mkdir -p .gpu/shared
    cp -a "$(dirname "$testdata")/models" .gpu/shared/
fi
rm -f .gpu/build-tests.json .gpu/build-kiln.json

echo
du -sh .gpu/bin .gpu/kiln .gpu/shared 2>/dev/null
total_kib=$(du -sk .gpu | cut -f1)
echo "total $((total_kib / 1024)) MiB in .gpu/"
if [ "$total_kib" -gt $((60 * 1024)) ]; then
    # Over the device tool's carry limit as files: packed (binaries shrink about 3x), and
    # unpacked again by scripts/gpu-tests.sh on the device.
    staged=()
    for path in bin kiln shared build-root; do [ -e ".gpu/$path" ] && staged+=("$path"); done
    rm -f .gpu/bundle.tar.xz
    tar cf - -C .gpu "${staged[@]}" | xz -T0 -6 > .gpu/bundle.tar.xz
    (cd .gpu && rm -rf "${staged[@]}")
    total_kib=$(du -sk .gpu | cut -f1)
    echo "packed into .gpu/bundle.tar.xz: $((total_kib / 1024)) MiB in .gpu/"
fi
if [ "$total_kib" -gt $((60 * 1024)) ]; then
    echo "warning: above 60 MiB; the device tool carries at most 64 MiB (narrow the selection, e.g. -p kiln-cuda)" >&2
fi
