#!/usr/bin/env bash
# GPU run 21 (2026-11-26): what the first prefix hit after a cold prefill waits for (runs 17-18: 54-90
# ms of prefill against 8 ms for the hits after it, on every fresh server). py-spy with native
# frames samples the server (speedscope format: samples in order, per thread) while one stream
# sends the 1,500-token-system-prompt chat twice: a cold prefill, then the first hit; the probes of
# run 17 give each request's times. From the repository root: bash docs/results/h100/run21/run.sh
set -uo pipefail
RUN=${RUN:-run21}  # run 24 reran this script under its own name
source docs/results/h100/lib.sh
P=$PWD/docs/results/h100/run17
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
first_hit() {  # name port
  local name=$1 port=$2
  python3 $P/probe_server.py "$R/$name-server.jsonl" serve --port "$port" "${BASE[@]}" > "$R/$name.log" 2>&1 &
  echo $! > /tmp/srv.pid
  until curl -sf "localhost:$port/readyz" > /dev/null; do sleep 1; kill -0 "$(cat /tmp/srv.pid)" || return 1; done
  py-spy record -p "$(cat /tmp/srv.pid)" --native -r 500 -d 4 -f speedscope -o "$R/$name.speedscope.json" \
    > "$R/$name-pyspy.log" 2>&1 &
  local spy=$!
  sleep 0.5
  python3 $P/probe_client.py "http://127.0.0.1:$port" "$R/$name-client.jsonl" 1 2
  wait $spy
  stop
}
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_a() { first_hit a 8101; }
step_b() { first_hit b 8102; }
step warm "${WARM_S:-300}"  # 30 where the kernel cache is carried (.ptx)
step a 40
step b 40
say "all steps done"
