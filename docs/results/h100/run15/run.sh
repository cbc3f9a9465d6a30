#!/usr/bin/env bash
# GPU run 15 (2026-11-26): the prefix-cache hits of one step share their copies (one gathered
# staging cache per shared prefix, one block save per set of starts), A/B against the code
# before (541554b, carried as .old/: `git archive 541554b service models pyproject.toml`):
# * hitprof-new/old: `stepserve bench hit-profile`, 1 and 8 hits' iterations (run 13: 9.8 and 24.6 ms);
# * prefix1-3: the prefix workload (8 streams, 1,500-token system prompt, 128 tokens out) on fresh
#   servers: cache on with the new code, cache on with the old, cache off (run 14's pairs).
# Run 13's kernel cache is unpacked first when carried (.ptx/ptx.tgz). From the repository root:
#   bash docs/results/h100/run15/run.sh      (back to back until "all steps done")
set -uo pipefail
RUN=run15
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)

step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_hitprof() {
  timeout "$(left)" $B hit-profile --out "$R/hitprof-new.json" 2>&1 | grep -E "iteration|chunk_over" | head -6
  (cd .old && timeout "$(left)" $B hit-profile --out "$R/hitprof-old.json" 2>&1 | grep -E "iteration|chunk_over" | head -6)
}
prefix_round() {
  local r=$1
  prefix_level "prefix-new-$r" $((8110 + 3 * r)) 8 3 "${BASE[@]}" || return 1
  (cd .old && prefix_level "prefix-old-$r" $((8111 + 3 * r)) 8 3 "${BASE[@]}") || return 1
  prefix_level "prefix-off-$r" $((8112 + 3 * r)) 8 3 "${OFF[@]}"
}
step_prefix1() { prefix_round 1; }
step_prefix2() { prefix_round 2; }
step_prefix3() { prefix_round 3; }

step warm 400
step hitprof 120
step prefix1 60
step prefix2 60
step prefix3 60
say "all steps done"
