#!/usr/bin/env bash
# GPU run 29 (2026-11-26): run 28's hits.py on the padded gather with a fresh zero-block fill per
# gather (77c88bc, carried as .old/) and with one kept zero block (no fill), each in its own process,
# twice, alternating: block counts padded to a power of two, then that power itself. Then one pair
# of run 26's prefix levels on the final code. From the repository root: bash docs/results/h100/run29/run.sh
set -uo pipefail
RUN=run29
source docs/results/h100/lib.sh
NS=(17 32 20 47 64 55 12 16 9 33)
HITS=$PWD/docs/results/h100/run28/hits.py
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
step_a() { (cd .old && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/fill-a.txt" 2>&1) && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/kept-a.txt" 2>&1; tail -qn 1 "$R/fill-a.txt" "$R/kept-a.txt"; }
step_b() { timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/kept-b.txt" 2>&1 && (cd .old && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/fill-b.txt" 2>&1); tail -qn 1 "$R/fill-b.txt" "$R/kept-b.txt"; }
step_c() { prefix_level on-c 8101 8 10 "${BASE[@]}" && prefix_level off-c 8102 8 10 "${BASE[@]}" --prefix-cache-bytes 0; }
step a 120
step b 120
step c 100
say "all steps done"
