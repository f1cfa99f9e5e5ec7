#!/usr/bin/env bash
# The aarch64 (NEON) CPU kernels, cross-built here and run under qemu's user-mode emulator: the
# f32 kernels (attention, norms, the tiled mat-mat) and the integer mat-mat/mat-vec against the
# scalar references, on an emulated CPU with the dot product extension (NEON and NEON-dot levels)
# and on one without it (NEON only).
#     scripts/aarch64-tests.sh
# rustup offers no aarch64 standard library here, so the cross build uses Debian's rustc-web with
# its arm64 standard library (installed with apt when missing, arm64 added as a dpkg architecture).
# Binaries are linked statically: dynamically linked threaded programs hang under qemu-user on
# this machine.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
rustc=/usr/bin/rustc
cargo=/usr/bin/cargo
if ! { [ -x $rustc ] && [ -x $cargo ] && [ -d /usr/lib/rustlib/$target/lib ] && command -v aarch64-linux-gnu-gcc > /dev/null && command -v qemu-aarch64 > /dev/null; }; then
    echo "aarch64-tests: installing the cross toolchain (Debian rustc-web, arm64 std, gcc, qemu-user)" >&2
    dpkg --add-architecture arm64
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        rustc-web cargo-web libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user > /dev/null
fi
host_version=$($rustc --version)
echo "aarch64-tests: $host_version, $(qemu-aarch64 --version | head -1)"

export RUSTC=$rustc
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR_AARCH64:-$PWD/target-aarch64}
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static -D warnings"

# The tests whose kernels differ per target; the rest of kiln-core runs the same scalar code on
# both and is covered by the native test run.
filters=(cpu_simd:: cpu_int:: attention_matches_a_float64_reference_at_every_level)
for cpu in max cortex-a57; do
    echo "aarch64-tests: emulated CPU $cpu"
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu"
    $cargo test --release --target $target -p kiln-core --lib -- "${filters[@]}"
    $cargo test --release --target $target -p kiln-core --test cpu_int
done
