#!/usr/bin/env bash
# GPU run 26 (2026-11-26): run 25's A/B (the code before, db314c2, carried as .old/, against the
# request-path changes) with 10 timed requests per stream instead of 3, so that a fresh server's
# first hits (new CUDA graphs, once per server) weigh less in the p50; then first bursts of 32 and 8.
# (prefix_level, first_burst: ../lib.sh.) From the repository root: bash docs/results/h100/run26/run.sh
set -uo pipefail
RUN=run26
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
old() { (cd .old && "$@"); }
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
round() {  # suffix first-port: new on, new off, old on, old off (the order turns each round)
  local s=$1 p=$2
  if [ "$s" = b ]; then
    old prefix_level "old-on-$s" "$p" 8 10 "${BASE[@]}" && old prefix_level "old-off-$s" $((p + 1)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0 &&
      prefix_level "new-on-$s" $((p + 2)) 8 10 "${BASE[@]}" && prefix_level "new-off-$s" $((p + 3)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0
  else
    prefix_level "new-on-$s" "$p" 8 10 "${BASE[@]}" && prefix_level "new-off-$s" $((p + 1)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0 &&
      old prefix_level "old-on-$s" $((p + 2)) 8 10 "${BASE[@]}" && old prefix_level "old-off-$s" $((p + 3)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0
  fi
}
step_a() { round a 8101; }
step_b() { round b 8105; }
step_c() { round c 8109; }
step_bursts() {
  first_burst burst32-a 8113 32 "${BASE[@]}" && first_burst burst32-b 8114 32 "${BASE[@]}" &&
    first_burst burst32-c 8115 32 "${BASE[@]}" && first_burst burst8-a 8116 8 "${BASE[@]}"
}
step warm 120
step a 120
step b 120
step bursts 90
step c 120
say "all steps done"
