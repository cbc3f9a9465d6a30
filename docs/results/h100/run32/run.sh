#!/usr/bin/env bash
# GPU run 32 (2026-11-26): run 26's A/B of the prefix workload (8 streams of 10 chats sharing a
# 1,500-token system prompt, 128 tokens out, fresh servers, cache on and off) for two changes that
# run 31's py-spy pointed at: memory admission no longer flattens the parameter tree on every
# request (65% of the chat handler's samples), and a prompt's prefix-cache block copies wait until
# the step's first tokens are sent and its decode step is queued. "old" is c408dd0, carried as
# .old/; then run 17's probes on each. (prefix_level, probe: ../lib.sh.)
# From the repository root: bash docs/results/h100/run32/run.sh
set -uo pipefail
RUN=${RUN:-run32}  # run 34 reran this script under its own name
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
step_probes() { probe new8 8113 8 10 "${BASE[@]}" && old probe old8 8114 8 10 "${BASE[@]}"; }
step warm 60
step a 120
step b 120
step c 120
step probes 70
say "all steps done"
