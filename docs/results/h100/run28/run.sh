#!/usr/bin/env bash
# GPU run 28 (2026-11-26): hits.py (its docstring) on the code before (db314c2, carried as .old/)
# and on the padded gather, each in its own process, twice, with the same block counts: a chat's
# growing prefix meets new counts. Then run 26's prefix levels on the final code. From the repository root: bash docs/results/h100/run28/run.sh
set -uo pipefail
RUN=run28
source docs/results/h100/lib.sh
NS=(17 17 20 30 31 47 47 48 55 64 33 40 12 9)
HITS=$PWD/docs/results/h100/run28/hits.py
step_a() { (cd .old && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/old-a.txt" 2>&1) && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/new-a.txt" 2>&1; tail -qn 1 "$R/old-a.txt" "$R/new-a.txt"; }
step_b() { timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/new-b.txt" 2>&1 && (cd .old && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/old-b.txt" 2>&1); tail -qn 1 "$R/old-b.txt" "$R/new-b.txt"; }
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
step_c() {  # the final code on run 26's prefix levels (prefix_level: ../lib.sh)
  prefix_level on-c 8101 8 10 "${BASE[@]}" && prefix_level off-c 8102 8 10 "${BASE[@]}" --prefix-cache-bytes 0
}
step a 120
step b 120
step c 100
say "all steps done"
