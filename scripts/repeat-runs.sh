#!/usr/bin/env bash
# On the GPU machine: greedy and seeded sampled `kiln run` and `kiln perplexity` three times on
# each model, all three from one fresh tuning cache (the kernels copied from the usual cache, the
# saved launch choices left out): the first run times its choices and saves them, the later ones
# load them. Fails unless all three generate the same tokens (greedy and sampled), write the same
# log-probabilities byte for byte (--kl-divergence-base: every scored token's, so any rounding
# difference shows) and choices were saved.
#     scripts/repeat-runs.sh KILN MODEL...
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: scripts/repeat-runs.sh KILN MODEL..." >&2; exit 2; }
kiln=$1
shift
[ -x "$kiln" ] || { echo "repeat-runs: $kiln is not an executable kiln binary" >&2; exit 2; }
kernels=${KILN_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/kernels}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Long enough for the prompt's products to take the tensor-core mat-mat, whose shapes are timed too.
prompt=$(printf 'Once upon a time, in a small town by the sea, there lived a girl who loved to draw. %.0s' 1 2 3 4 5 6)
for _ in 1 2 3 4; do echo "$prompt"; done > "$work/text.txt"
status=0
for model in "$@"; do
    rm -rf "$work/cache" && mkdir -p "$work/cache"
    if [ -d "$kernels" ]; then cp -r "$kernels/." "$work/cache/"; fi
    rm -rf "$work/cache/tuning"
    for run in 1 2 3; do
        KILN_CACHE_DIR=$work/cache "$kiln" run -m "$model" --device cuda -n 96 --temp 0 -p "$prompt" --json > "$work/run$run.json"
        KILN_CACHE_DIR=$work/cache "$kiln" run -m "$model" --device cuda -n 96 --temp 0.9 --top-k 0 --top-p 0.95 -s 7 -p "$prompt" --json > "$work/sampled$run.json"
        KILN_CACHE_DIR=$work/cache "$kiln" perplexity -m "$model" --device cuda -f "$work/text.txt" -c 128 \
            --kl-divergence-base "$work/logprobs$run.bin" > /dev/null 2> "$work/perplexity$run.log"
    done
    saved=$( (find "$work/cache/tuning" -type f 2> /dev/null || true) | wc -l)
    if verdict=$(python3 - "$work" << 'PY'
import json, sys
same = True
for kind, what in (("run", "greedy"), ("sampled", "sampled")):
    runs = [json.load(open(f"{sys.argv[1]}/{kind}{i}.json"))["generated_tokens"] for i in (1, 2, 3)]
    agree = runs[0] == runs[1] == runs[2]
    same &= agree
    print(f"{what} {len(runs[0])} tokens " + ("the same" if agree else "DIFFERENT"), end="; " if kind == "run" else "\n")
sys.exit(0 if same else 1)
PY
    ); then :; else status=1; fi
    if cmp -s "$work/logprobs1.bin" "$work/logprobs2.bin" && cmp -s "$work/logprobs1.bin" "$work/logprobs3.bin"; then
        verdict="$verdict; log-probabilities of $(stat -c %s "$work/logprobs1.bin") bytes the same"
    else
        verdict="$verdict; log-probabilities DIFFERENT"
        status=1
    fi
    [ "$saved" -gt 0 ] || { verdict="$verdict, no choice saved"; status=1; }
    echo "$(basename "$model"): three runs, $verdict ($saved launch choices saved)"
done
exit $status
