#!/usr/bin/env bash
# GPU run 31 (2026-11-26): where the engine thread's host time goes under run 26's prefix workload
# (8 streams of 10 chats sharing a 1,500-token system prompt, 128 tokens out, cache on). Runs 25-30
# found the engine host-bound on the GPU (run 25: 3.7 s of host time against 0.05 s waiting for
# the device), a lone hit's prefill 18 ms and seven hits together 41 ms. py-spy with native frames
# samples the server (speedscope, per thread) for the whole workload; run 17's probes time each
# request in a second server. From the repository root: bash docs/results/h100/run31/run.sh
set -uo pipefail
RUN=run31
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
spy() {  # name port: the prefix workload under py-spy
  local name=$1 port=$2
  start "$name" "$port" "${BASE[@]}" || return 1
  py-spy record -p "$(cat /tmp/srv.pid)" --native -r 250 -d "${SPY_S:-25}" -f speedscope -o "$R/$name.speedscope.json" \
    > "$R/$name-pyspy.log" 2>&1 &
  local spy=$!
  bench --url http://127.0.0.1:$port --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 \
    --requests 10 --max-tokens 128 --warmup-requests 1 --out "$R/$name.json"
  wait $spy
  curl -sf "localhost:$port/metrics" > "$R/$name.metrics.txt"; stop
}
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_spy() { spy spy 8101; }
step_probe() { probe probe 8102 8 10 "${BASE[@]}"; }
step warm 60
step spy 90
step probe 60
say "all steps done"
