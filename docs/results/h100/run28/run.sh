#!/usr/bin/env bash
# GPU run 28 (2026-11-26): hits.py (its docstring) on the code before (db314c2, carried as .old/)
# and on the padded gather, each in its own process, twice, with the same block counts: a chat's
# growing prefix meets new counts. From the repository root: bash docs/results/h100/run28/run.sh
set -uo pipefail
RUN=run28
source docs/results/h100/lib.sh
NS=(17 17 20 30 31 47 47 48 55 64 33 40 12 9)
HITS=$PWD/docs/results/h100/run28/hits.py
step_a() { (cd .old && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/old-a.txt" 2>&1) && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/new-a.txt" 2>&1; tail -1 "$R/old-a.txt" "$R/new-a.txt"; }
step_b() { timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/new-b.txt" 2>&1 && (cd .old && timeout "$(left)" python3 "$HITS" "${NS[@]}" > "$R/old-b.txt" 2>&1); tail -1 "$R/old-b.txt" "$R/new-b.txt"; }
step a 120
step b 120
say "all steps done"
