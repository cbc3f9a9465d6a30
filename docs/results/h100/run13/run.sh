#!/usr/bin/env bash
# GPU run 13 (written 2026-11-26, when the session had no device time left; for the next lease).
# Issue 12's prefix hits and issue 13's constrained rows were measured in runs 10-12 but not
# explained; this run profiles them before anything changes (docs/BENCHMARKS.md, twelfth run):
# * hitprof: `stepserve bench hit-profile` splits a hit's prefill iteration (1,504 cached + 41 new
#   tokens, 7 requests decoding) into its parts, dispatch and eval each, against a decode step:
#   run 10's 64-token chunk step took 25 ms where a decode step took 9.3 ms;
# * prefix: the prefix workload with the cache on, py-spy (Python frames) on the server for the
#   whole level, so the engine thread's hit iterations show where host time goes;
# * constrained: one free and one constrained level of 32 streams, py-spy on each (the free
#   level's two speeds, run 12);
# * bursts: the first 8- and 32-stream bursts after /readyz with the kernel cache warm.
# Staging as in docs/CONTRIBUTING.md, plus py-spy in .whl (pip download --only-binary=:all:
# --platform manylinux2014_x86_64 -d .whl py-spy). From the repository root on the GPU host, call
#   bash docs/results/h100/run13/run.sh
# back to back until it says "all steps done" (resumable: ../lib.sh).
set -uo pipefail
RUN=run13
source docs/results/h100/lib.sh
command -v py-spy >/dev/null || { echo "py-spy missing: carry its wheel in .whl"; exit 2; }
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)
spy() {  # name seconds: py-spy (Python frames, idle threads left out) on the running server, in the background
  py-spy record -p "$(cat /tmp/srv.pid)" -r 200 -d "$2" -f raw --nonblocking -o "$R/$1-pyspy.txt" > "$R/$1-pyspy.log" 2>&1 &
  SPY=$!
}

step_warm() { start warm 8090 "${BASE[@]}" && stop && tar -C "$MLX_PTX_CACHE_DIR" -czf "${OUT:-/tmp}/ptx.tgz" .; }
step_hitprof() { timeout "$(left)" $B hit-profile --out "$R/hit-profile.json" 2>&1 | tail -40; }
step_prefix() {
  start prefix-on 8130 "${BASE[@]}" || return 1
  bench --url http://127.0.0.1:8130 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 1 \
    --max-tokens 16 --out "$R/prefix-warm.json"  # the system prompt cached, as on a server in use
  spy prefix-on 12
  bench --url http://127.0.0.1:8130 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 3 \
    --max-tokens 128 --out "$R/prefix-on.json"
  wait "$SPY"; curl -sf localhost:8130/metrics > "$R/prefix-on.metrics.txt"; stop
}
step_constrained() {
  start constrained 8140 "${OFF[@]}" || return 1
  local pass=0 k
  for k in 0 8 0 8; do
    pass=$((pass + 1))
    spy "constrained-$k-$pass" 8
    bench --url http://127.0.0.1:8140 --api openai --concurrency 32 --requests 3 --max-tokens 128 --warmup-requests 1 \
      --constrained $k --constrained-schema report --out "$R/constrained-$k-$pass.json"
    wait "$SPY"
  done
  curl -sf localhost:8140/metrics > "$R/constrained.metrics.txt"; stop
}
step_burst8() { first_burst burst8 8101 8 "${OFF[@]}"; }
step_burst32() { first_burst burst32 8102 32 "${OFF[@]}"; }

step warm 360
step hitprof 200
step prefix 90
step constrained 150
step burst8 60
step burst32 60
say "all steps done"
