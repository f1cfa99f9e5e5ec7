#!/usr/bin/env bash
# Runs a long job on the GPU machine across several device calls. The machine is given back 30 s
# after a call returns, and a job started there dies with it: start it in one call and keep
# polling from the next ones, each within 30 s of the last (build nothing in between).
#     scripts/device-job.sh start 'COMMAND' [...]   in the first call: copies this tree (with
#         .gpu/, its bundle unpacked) to $JOB_DIR/tree and runs the commands there one after
#         another, detached, each one's output in $JOB_DIR/logs/N.log, in the environment
#         scripts/device-env.sh sets up (test data, NVRTC, carried kernels), as gpu-tests.sh does
#     scripts/device-job.sh poll SECONDS            in each later call: waits until the job ends
#         or SECONDS pass, prints its status and the tail of the running log, and leaves the
#         logs packed in $OUT/job-logs.tgz
# Status lines ($JOB_DIR/status): "started", "N running COMMAND" and "N rc=R COMMAND" for each
# command, then "done", each after the time of day.
set -uo pipefail
JOB_DIR=${JOB_DIR:-/tmp/kiln-job}

start() {
    [ $# -gt 0 ] || { echo "usage: $0 start 'COMMAND' [...]" >&2; exit 2; }
    if [ -f "$JOB_DIR/status" ] && ! grep -qE '^[0-9:]+ done$' "$JOB_DIR/status"; then
        echo "a job is still running in $JOB_DIR (poll it, or remove the folder to start another)" >&2
        exit 1
    fi
    rm -rf "$JOB_DIR" && mkdir -p "$JOB_DIR/logs" "$JOB_DIR/tree"
    cp -a . "$JOB_DIR/tree/"
    if [ -f "$JOB_DIR/tree/.gpu/bundle.tar.xz" ]; then
        tar xJf "$JOB_DIR/tree/.gpu/bundle.tar.xz" -C "$JOB_DIR/tree/.gpu" && rm "$JOB_DIR/tree/.gpu/bundle.tar.xz" ||
            { echo "could not unpack .gpu/bundle.tar.xz" >&2; exit 1; }
    fi
    printf '%s\n' "$@" > "$JOB_DIR/commands"
    echo "$(date +%T) started" > "$JOB_DIR/status"
    (cd "$JOB_DIR/tree" && setsid nohup bash "$0" run > "$JOB_DIR/logs/job.log" 2>&1 < /dev/null &)
    echo "started $# command(s) in $JOB_DIR/tree"
}

run() { # the detached part, in the copied tree
    local n=0 command rc
    . scripts/device-env.sh
    while IFS= read -r command; do
        n=$((n + 1))
        echo "$(date +%T) $n running $command" >> "$JOB_DIR/status"
        bash -c "$command" > "$JOB_DIR/logs/$n.log" 2>&1
        rc=$?
        echo "$(date +%T) $n rc=$rc $command" >> "$JOB_DIR/status"
    done < "$JOB_DIR/commands"
    echo "$(date +%T) done" >> "$JOB_DIR/status"
}

poll() {
    local seconds=${1:-20}
    [[ $seconds =~ ^[0-9]+$ ]] || { echo "poll SECONDS: a whole number, not '$seconds'" >&2; exit 2; }
    [ -d "$JOB_DIR" ] || { echo "no job in $JOB_DIR (started in this machine's life?)" >&2; exit 1; }
    local end=$(($(date +%s) + seconds))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -qE '^[0-9:]+ done$' "$JOB_DIR/status" 2>/dev/null; do sleep 2; done
    cat "$JOB_DIR/status" 2>/dev/null
    local latest
    latest=$(find "$JOB_DIR/logs" -name '[0-9]*.log' -printf '%T@ %p\n' 2>/dev/null | sort -n | tail -1 | cut -d' ' -f2)
    [ -n "$latest" ] && { echo "--- tail of $latest"; tail -20 "$latest"; }
    if [ -n "${OUT:-}" ]; then
        tar czf "$OUT/job-logs.tgz" -C "$JOB_DIR" logs status commands 2>/dev/null
    fi
    grep -qE '^[0-9:]+ done$' "$JOB_DIR/status" 2>/dev/null
}

case "${1:-}" in
    start) shift; start "$@" ;;
    run) run ;;
    poll) shift; poll "$@" ;;
    *) echo "usage: $0 start 'COMMAND' [...] | poll SECONDS" >&2; exit 2 ;;
esac
