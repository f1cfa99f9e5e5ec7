#!/usr/bin/env bash
# On the GPU machine: carries kiln's compiled kernels (the NVRTC CUBIN cache, src/cache.rs)
# between fresh machines, so that a run does not spend its first minutes compiling.
#     scripts/kernel-cache.sh restore   unpacks .gpu/kernel-cache.tgz.NN, when carried, into the cache
#     scripts/kernel-cache.sh save      packs the cache into $OUT/kernel-cache.tgz.NN, parts of 4 MiB
#                                       (the device tool can leave larger files behind); copy them to
#                                       .gpu/ for the next machine
# Entries are keyed by source text, defines, architecture and NVRTC version, so a stale one is
# never used: it is only not found.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where kiln looks (src/cache.rs): $KILN_CACHE_DIR, else an absolute $XDG_CACHE_HOME, else ~/.cache.
xdg=${XDG_CACHE_HOME:-}
[[ $xdg == /* ]] || xdg=$HOME/.cache
dir=${KILN_CACHE_DIR:-$xdg/kiln/kernels}
case "${1:-}" in
restore)
    parts=(.gpu/kernel-cache.tgz.[0-9][0-9])
    if [ -f "${parts[0]}" ]; then
        mkdir -p "$dir"
        # An unreadable archive only costs the compile time it would have saved.
        if cat "${parts[@]}" | tar xzf - -C "$dir"; then
            echo "kernel cache: $(ls "$dir" | wc -l) entries restored into $dir"
        else
            echo "warning: .gpu/kernel-cache.tgz.* could not be unpacked; kernels will be compiled" >&2
        fi
    fi
    ;;
save)
    if [ -n "${OUT:-}" ] && [ -d "$dir" ]; then
        # A failed save only costs the next machine its compile time: it never stops a run.
        if tar czf - -C "$dir" . | split -b 4M -d - "$OUT/kernel-cache.tgz."; then
            echo "kernel cache: $(ls "$dir" | wc -l) entries saved, $(cat "$OUT"/kernel-cache.tgz.* | wc -c) bytes in $(ls "$OUT"/kernel-cache.tgz.* | wc -l) parts"
        else
            rm -f "$OUT"/kernel-cache.tgz.*
            echo "warning: the kernel cache could not be saved into $OUT" >&2
        fi
    fi
    ;;
*)
    echo "usage: scripts/kernel-cache.sh restore|save" >&2
    exit 2
    ;;
esac
