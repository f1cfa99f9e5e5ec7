#!/usr/bin/env bash
# Checks formatting and clippy lints, then runs every test that needs no GPU: unit and integration tests of all crates,
# the tokenizer/model reference checks against ../shared/testdata, and the NVRTC
# compile check of every CUDA kernel for sm_90 (NVRTC comes from pip; no GPU needed).
# GPU tests are #[ignore]d here and run on a GPU machine with scripts/gpu-tests.sh. Last, the
# aarch64 NEON kernels, cross-built and run under qemu (scripts/aarch64-tests.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! eval "$(bash scripts/nvrtc-env.sh 2>/dev/null)"; then
    python3 -m pip install --quiet --disable-pip-version-check \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96
    eval "$(bash scripts/nvrtc-env.sh)"
fi

cargo fmt --all --check
cargo clippy --release --workspace --all-targets -- -D warnings
cargo test --release --workspace "$@"
bash scripts/aarch64-tests.sh
