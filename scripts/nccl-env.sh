#!/usr/bin/env bash
# Prints the environment that lets kiln load libnccl at run time (tensor parallelism):
#     eval "$(scripts/nccl-env.sh)"
# cudarc dlopen()s "libnccl.so" (and a few versioned names, not NCCL's own soname
# libnccl.so.2). When only libnccl.so.2 exists (pip's nvidia-nccl wheel beside torch), a
# libnccl.so link to it is made in ${NCCL_LINK_DIR:-/tmp/kiln-nccl} and put on LD_LIBRARY_PATH.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0), as the GPU machines require.
set -euo pipefail
echo "export NCCL_NVLS_ENABLE=0"
if ldconfig -p 2> /dev/null | grep -q 'libnccl\.so '; then
    echo "# libnccl.so found in the ld.so cache"
    exit 0
fi
found=
for python in python3 /opt/torch/.venv/bin/python3; do
    command -v "$python" > /dev/null 2>&1 || continue
    for dir in $("$python" -c 'import site; print(" ".join(site.getsitepackages()))' 2> /dev/null); do
        found=$(find "$dir/nvidia" -name 'libnccl.so*' 2> /dev/null | head -1)
        [ -n "$found" ] && break 2
    done
done
if [ -z "$found" ]; then
    echo "# libnccl not found: tensor parallelism on GPUs will report it" >&2
    exit 0
fi
links=${NCCL_LINK_DIR:-/tmp/kiln-nccl}
mkdir -p "$links"
ln -sf "$found" "$links/libnccl.so"
echo "export LD_LIBRARY_PATH=$links:$(dirname "$found")\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
