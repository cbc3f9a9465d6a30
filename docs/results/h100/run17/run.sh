#!/usr/bin/env bash
# GPU run 17 (2026-11-26): where a prefix hit's TTFT goes under load, request by request. Runs
# 14-16: with the cache, the client's TTFT p50 was 42-60 ms while the server's own TTFT (from the
# request's Sequence to its first token) averaged 26-35 ms. probe_server.py serves with per-request
# times (app reached, Sequence made, admitted, first token, first body writes) and
# probe_client.py runs the prefix workload with per-request client times, both on CLOCK_MONOTONIC.
# Cache on and off, 8 streams and 1 (probe: ../lib.sh). From the repository root:
#   bash docs/results/h100/run17/run.sh
set -uo pipefail
RUN=run17
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_on8() { probe on8 8101 8 3 "${BASE[@]}" && probe on8b 8102 8 3 "${BASE[@]}"; }
step_off8() { probe off8 8103 8 3 "${BASE[@]}" --prefix-cache-bytes 0; }
step_on1() { probe on1 8104 1 12 "${BASE[@]}"; }
# Is the first hit's extra time a first use? A hit on another long prompt first (PRE: its system
# prompt's tokens; the pre-run's own lines in NAME-pre.jsonl, read with the server's first lines).
step_pre1() { PRE=1400 probe pre1 8105 1 6 "${BASE[@]}"; }
step_pre8() { PRE=1400 probe pre8 8106 8 3 "${BASE[@]}"; }
step warm 300
step on8 60
step off8 30
step on1 40
step pre1 40
step pre8 40
say "all steps done"
