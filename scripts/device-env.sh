# Sourced on the GPU machine, from the root of a copy of the repository carrying .gpu/ (made by
# scripts/build-gpu-bundle.sh), by gpu-tests.sh and by each command of device-job.sh: what the
# staged test binaries and the kiln binary need to run there.
# A bundle packed to fit the carry limit, unpacked once.
if [ -f .gpu/bundle.tar.xz ]; then
    tar xJf .gpu/bundle.tar.xz -C .gpu && rm .gpu/bundle.tar.xz || echo "warning: could not unpack .gpu/bundle.tar.xz" >&2
fi
# The tests find shared/testdata (and the shared folder, its parent) through KILN_TESTDATA.
export KILN_TESTDATA=${KILN_TESTDATA:-$PWD/.gpu/shared/testdata}
[ -d "$KILN_TESTDATA" ] || echo "warning: no test data at $KILN_TESTDATA; tests that need it will fail" >&2
# Files of the repository itself (models/stories260K.gguf, crates/*/tests/fixtures) are read through
# the build checkout's path, compiled in: link it to this copy when it is absent here.
if [ -f .gpu/build-root ]; then
    build_root=$(cat .gpu/build-root)
    if [ "$build_root" != "$PWD" ] && [ ! -e "$build_root" ]; then
        mkdir -p "$(dirname "$build_root")" && ln -s "$PWD" "$build_root"
    fi
fi
if env_lines=$(scripts/nvrtc-env.sh); then
    eval "$env_lines"
else
    echo "warning: libnvrtc not found; every test that compiles kernels will fail" >&2
fi
# Kernels compiled on an earlier machine, when carried.
scripts/kernel-cache.sh restore
# Tensor parallelism's NCCL (gpu_tensor_parallel), from torch's pip wheel when not installed.
eval "$(scripts/nccl-env.sh)"
