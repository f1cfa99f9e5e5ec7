#!/usr/bin/env bash
# KL divergence of quantized files against a full-precision base (as llama-perplexity
# --kl-divergence), printed as the markdown table of docs/formats.md.
#     scripts/kld-table.sh BASE.gguf TEXT.txt QUANTIZED.gguf...   (BASE in F16: bits per weight are
# counted against its size)
# Environment: KILN (default target/release/kiln), CTX (tokens per chunk, 512), CHUNKS (8),
# DEVICE (cpu or cuda; default: kiln's choice), WORK (folder for the base's log-probabilities
# and the logs, default /tmp/kiln-kld).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: scripts/kld-table.sh BASE.gguf TEXT.txt QUANTIZED.gguf...}
TEXT=${2:?usage: scripts/kld-table.sh BASE.gguf TEXT.txt QUANTIZED.gguf...}
shift 2
KILN=${KILN:-target/release/kiln}
WORK=${WORK:-/tmp/kiln-kld}
mkdir -p "$WORK"
device=()
[ -n "${DEVICE:-}" ] && device=(--device "$DEVICE")

# The base's log-probabilities are reused when a finished run for the same base is in WORK.
if ! grep -qs "saved the log-probabilities" "$WORK/base.log" || [ "$(cat "$WORK/base.name" 2> /dev/null)" != "$BASE $TEXT" ]; then
    "$KILN" perplexity -m "$BASE" -f "$TEXT" -c "${CTX:-512}" --chunks "${CHUNKS:-8}" "${device[@]}" \
        --kl-divergence-base "$WORK/base.kld" > "$WORK/base.log" 2>&1 || { tail -5 "$WORK/base.log" >&2; exit 1; }
    echo "$BASE $TEXT" > "$WORK/base.name"
fi
base_bytes=$(stat -c %s "$BASE")

echo "| file | size MiB | bits/weight | PPL | ln(PPL(Q)/PPL(base)) | mean KLD | 99% KLD | same top |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
base_ppl=$(grep -o 'Final estimate: PPL = [0-9.]*' "$WORK/base.log" | awk '{print $NF}')
printf '| %s (base) | %d | %.2f | %.4f | | | | |\n' "$(basename "$BASE")" $((base_bytes >> 20)) 16 "$base_ppl"
for file in "$@"; do
    log="$WORK/$(basename "$file").log"
    if ! "$KILN" perplexity -m "$file" "${device[@]}" --kl-divergence-base "$WORK/base.kld" --kl-divergence > "$log" 2>&1; then
        echo "| $(basename "$file") | failed: $(tail -1 "$log") |"
        continue
    fi
    bytes=$(stat -c %s "$file")
    field() { grep -m1 "$1" "$log" | sed 's/.*: *//' | awk '{print $1}'; }
    # Bits per weight relative to the F16 base (whose weights take 16 bits each).
    bpw=$(awk -v b="$bytes" -v f="$base_bytes" 'BEGIN { printf "%.2f", 16 * b / f }')
    printf '| %s | %d | %s | %.4f | %s | %s | %s | %s %% |\n' "$(basename "$file")" $((bytes >> 20)) "$bpw" \
        "$(field 'Mean PPL(Q) ')" "$(field 'Mean ln(PPL(Q)/PPL(base))')" "$(field 'Mean    KLD')" \
        "$(field '99.0%   KLD')" "$(field 'Same top p')"
done
