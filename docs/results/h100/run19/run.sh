#!/usr/bin/env bash
# GPU run 19 (2026-11-26): prompts of more than 2,048 characters tokenized on a worker thread (was
# 16,384), A/B on one host against the code before (5cd8595, carried as .old/). Run 17 saw a burst of
# 8 chats with a 1,500-token system prompt reach the engine one by one, about 3 ms apart: each
# request's tokenization (about 2 ms here) ran on the event loop in turn. Probes of run 17, 8
# streams of 3 requests, fresh servers, old and new alternating, then one server with the cache off.
# (probe: ../lib.sh.) From the repository root: bash docs/results/h100/run19/run.sh
set -uo pipefail
RUN=run19
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_a() { (cd .old && probe old8a 8101 8 3 "${BASE[@]}") && probe new8a 8102 8 3 "${BASE[@]}"; }
step_b() { probe new8b 8103 8 3 "${BASE[@]}" && (cd .old && probe old8b 8104 8 3 "${BASE[@]}"); }
step_c() { (cd .old && probe old8c 8105 8 3 "${BASE[@]}") && probe new8c 8106 8 3 "${BASE[@]}"; }
step_off() { probe newoff8 8107 8 3 "${BASE[@]}" --prefix-cache-bytes 0 && probe new1 8108 1 12 "${BASE[@]}"; }
step warm 300
step a 50
step b 50
step c 50
step off 60
say "all steps done"
