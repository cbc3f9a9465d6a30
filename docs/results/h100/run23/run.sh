#!/usr/bin/env bash
# GPU run 23 (2026-11-26): the prefix cache's gather now gives each layer's keys and values a
# zeroed buffer of their own (as KVCache.allocate does) instead of views into one concatenation
# (run 22: the first chunk step on the views built a second cuDNN plan, 54-56 ms). A/B on one host
# against the code before (f84fcd3, carried as .old/):
# * layout: run 22's layout.py on the new code (its "gathered" is join_blocks);
# * first: run 21's first hit after a cold prefill, probes, no py-spy, old and new;
# * hitprof: `stepserve bench hit-profile`, old and new (the gather's own cost);
# * prefix: the prefix workload (8 streams), old and new, and the cache off once.
# (probe: ../lib.sh.) From the repository root: bash docs/results/h100/run23/run.sh
set -uo pipefail
RUN=run23
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_layout() { timeout "$(left)" python3 docs/results/h100/run22/layout.py 2>&1 | tee "$R/layout.txt" | tail -2; }
step_first() {
  (cd .old && probe first-old 8101 1 4 "${BASE[@]}") && probe first-new 8102 1 4 "${BASE[@]}" &&
    probe first-new2 8103 1 4 "${BASE[@]}" && (cd .old && probe first-old2 8104 1 4 "${BASE[@]}")
}
step_hitprof() {
  timeout "$(left)" $B hit-profile --out "$R/hitprof-new.json" 2>&1 | grep -E '"(1|8)"' | head -2
  (cd .old && timeout "$(left)" $B hit-profile --out "$R/hitprof-old.json" 2>&1 | grep -E '"(1|8)"' | head -2)
}
step_prefix() {
  (cd .old && probe old8 8105 8 3 "${BASE[@]}") && probe new8 8106 8 3 "${BASE[@]}" &&
    probe new8b 8107 8 3 "${BASE[@]}" && (cd .old && probe old8b 8108 8 3 "${BASE[@]}") &&
    probe off8 8109 8 3 "${BASE[@]}" --prefix-cache-bytes 0
}
step warm 300
step layout 60
step first 90
step hitprof 120
step prefix 120
say "all steps done"
