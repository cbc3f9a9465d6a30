#!/usr/bin/env bash
# GPU run 18 (2026-11-26): the first prefix hit after ready (run 17: 54-90 ms of prefill against
# 8 ms for the next ones), A/B on one host: the code before (5cd8595, carried as .old/) against
# the working tree, whose warm-up rehearsal also hits a long cached prefix (near the largest
# capacity) at the largest staging capacity. Probes of run 17 (probe_server.py, probe_client.py),
# 1 stream of 12 requests and 8 streams of 3, fresh servers, old and new alternating.
# (probe: ../lib.sh.) From the repository root: bash docs/results/h100/run18/run.sh
set -uo pipefail
RUN=run18
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_a() { (cd .old && probe old1a 8101 1 12 "${BASE[@]}") && probe new1a 8102 1 12 "${BASE[@]}"; }
step_b() { probe new1b 8103 1 12 "${BASE[@]}" && (cd .old && probe old1b 8104 1 12 "${BASE[@]}"); }
step_c() { (cd .old && probe old8 8105 8 3 "${BASE[@]}") && probe new8 8106 8 3 "${BASE[@]}"; }
step warm 300
step a 50
step b 50
step c 50
say "all steps done"
