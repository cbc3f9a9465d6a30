#!/usr/bin/env bash
# GPU run 16 (2026-11-26, after run 15): where a prefix hit's TTFT goes outside the engine. In run
# 15 the server's own TTFT (Sequence made -> first token) was 26-35 ms with the cache, the
# client's p50 42-60 ms. This run measures, on fresh servers with the cache on and off:
# * c1: one stream (no other request's events on the event loop, no decode batch beside it);
# * si: 8 streams at switch intervals 0.005 (Python's default), 0.001 and 0.0005 s.
# From the repository root, after staging and run 15's kernel cache (.ptx/ptx.tgz):
#   bash docs/results/h100/run16/run.sh
set -uo pipefail
RUN=run16
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)

step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_c1() { prefix_level on-c1 8101 1 12 "${BASE[@]}" && prefix_level off-c1 8102 1 12 "${OFF[@]}"; }
si_round() {
  local r=$1 si p=$((8110 + 10 * $1))
  for si in 0.005 0.001 0.0005; do
    prefix_level "on-si$si-$r" $p 8 3 "${BASE[@]}" --switch-interval-s $si || return 1; p=$((p + 1))
    prefix_level "off-si$si-$r" $p 8 3 "${OFF[@]}" --switch-interval-s $si || return 1; p=$((p + 1))
  done
}
step_si1() { si_round 1; }
step_si2() { si_round 2; }

step warm 300
step c1 60
step si1 120
step si2 120
say "all steps done"
