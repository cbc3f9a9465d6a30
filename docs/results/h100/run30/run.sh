#!/usr/bin/env bash
# GPU run 30 (2026-11-26): three more pairs of run 26's prefix levels (8 streams of 10 requests,
# a 1,500-token system prompt, fresh servers, cache on and off, the order turning each pair) on
# the final code, for the ratio's spread across pairs. (prefix_level: ../lib.sh.)
# From the repository root: bash docs/results/h100/run30/run.sh
set -uo pipefail
RUN=run30
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
on() { prefix_level "on-$1" "$2" 8 10 "${BASE[@]}"; }
off() { prefix_level "off-$1" "$2" 8 10 "${BASE[@]}" --prefix-cache-bytes 0; }
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_a() { on a 8101 && off a 8102; }
step_b() { off b 8103 && on b 8104; }
step_c() { on c 8105 && off c 8106; }
step warm 60
step a 90
step b 90
step c 90
say "all steps done"
