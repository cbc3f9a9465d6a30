#!/usr/bin/env bash
# GPU run 25 (2026-11-26): two costs on each request's way to the engine, A/B on one host against
# the code before (db314c2, carried as .old/). (1) The State dependency was a plain def, so FastAPI
# ran it in its thread pool: a trip out and back that waits twice for the GIL while the engine
# thread runs Python. (2) The 1,500-token system turn was tokenized again for every request (about
# 2 ms each, on the event loop, one request after another in a burst); long pieces between added
# tokens are now kept by content. The prefix workload (8 streams of 3 requests, fresh servers) with
# the cache on and off for both, then run 17's probes on one server of each, then first bursts.
# (prefix_level, probe, first_burst: ../lib.sh.) From the repository root: bash docs/results/h100/run25/run.sh
set -uo pipefail
RUN=run25
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
old() { (cd .old && "$@"); }
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_a() {
  old prefix_level old-on-a 8101 8 3 "${BASE[@]}" && prefix_level new-on-a 8102 8 3 "${BASE[@]}" &&
    prefix_level new-off-a 8103 8 3 "${BASE[@]}" --prefix-cache-bytes 0 &&
    old prefix_level old-off-a 8104 8 3 "${BASE[@]}" --prefix-cache-bytes 0
}
step_b() {
  prefix_level new-on-b 8105 8 3 "${BASE[@]}" && old prefix_level old-on-b 8106 8 3 "${BASE[@]}" &&
    old prefix_level old-off-b 8107 8 3 "${BASE[@]}" --prefix-cache-bytes 0 &&
    prefix_level new-off-b 8108 8 3 "${BASE[@]}" --prefix-cache-bytes 0
}
step_c() {
  old prefix_level old-on-c 8109 8 3 "${BASE[@]}" && prefix_level new-on-c 8110 8 3 "${BASE[@]}" &&
    prefix_level new-off-c 8111 8 3 "${BASE[@]}" --prefix-cache-bytes 0
}
step_probes() { old probe old8 8112 8 3 "${BASE[@]}" && probe new8 8113 8 3 "${BASE[@]}"; }
step_bursts() {
  first_burst burst8-a 8114 8 "${BASE[@]}" && first_burst burst8-b 8115 8 "${BASE[@]}" &&
    first_burst burst8-c 8116 8 "${BASE[@]}" && first_burst burst32-a 8117 32 "${BASE[@]}"
}
step warm 120
step a 90
step b 90
step c 70
step probes 60
step bursts 90
say "all steps done"
