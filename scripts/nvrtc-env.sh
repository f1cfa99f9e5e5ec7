#!/usr/bin/env bash
# Prints the environment that lets kiln load libnvrtc at run time (cudarc dlopen()s
# "libnvrtc.so", then versioned names such as "libnvrtc.so.13", through the normal loader
# search: LD_LIBRARY_PATH, then the ld.so cache). Use it as:
#     eval "$(scripts/nvrtc-env.sh)"
# It searches, in order: a directory already on LD_LIBRARY_PATH or in the ld.so cache,
# $CUDA_HOME / $CUDA_PATH, /usr/local/cuda, and the nvidia-cuda-nvrtc pip wheel of every
# python3 it can find (site-packages/nvidia/cu13/lib or .../cuda_nvrtc/lib for CUDA 12).
# When libnvrtc is nowhere to be found it exits 1 with the reason on stderr and prints `false`,
# so that `eval "$(scripts/nvrtc-env.sh)"` fails too (eval would otherwise succeed on "").
set -euo pipefail

has_nvrtc() { compgen -G "$1/libnvrtc.so*" > /dev/null 2>&1; }

for dir in ${LD_LIBRARY_PATH:+${LD_LIBRARY_PATH//:/ }}; do
    if has_nvrtc "$dir"; then
        echo "# libnvrtc already on LD_LIBRARY_PATH: $dir"
        exit 0
    fi
done
if ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
    echo "# libnvrtc found in the ld.so cache"
    exit 0
fi

candidates=()
for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    [ -n "$root" ] && candidates+=("$root/lib64" "$root/lib" "$root/targets/x86_64-linux/lib")
done
for python in python3 /opt/torch/.venv/bin/python3; do
    command -v "$python" > /dev/null 2>&1 || continue
    while IFS= read -r site; do
        candidates+=("$site/nvidia/cu13/lib" "$site/nvidia/cuda_nvrtc/lib")
    done < <("$python" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null || true)
done

for dir in "${candidates[@]}"; do
    if has_nvrtc "$dir"; then
        echo "export LD_LIBRARY_PATH=\"$dir\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\""
        exit 0
    fi
done
echo "nvrtc-env.sh: libnvrtc not found (searched: ${candidates[*]}); install it with" \
     "'pip install nvidia-cuda-nvrtc==13.0.88' or a CUDA toolkit" >&2
echo false
exit 1
