#!/usr/bin/env bash
# GPU run 18 (2026-11-26): the first prefix hit after ready (run 17: 54-90 ms of prefill against
# 8 ms for the next ones), A/B on one host: the code before (5cd8595, carried as .old/) against
# the working tree, whose warm-up rehearsal also hits a long cached prefix (near the largest
# capacity) at the largest staging capacity. Probes of run 17 (probe_server.py, probe_client.py),
# 1 stream of 12 requests and 8 streams of 3, fresh servers, old and new alternating.
# From the repository root: bash docs/results/h100/run18/run.sh
set -uo pipefail
RUN=run18
source docs/results/h100/lib.sh
[ -f .ptx/ptx.tgz ] && [ ! -f "$R/ptx.done" ] && tar -C "$MLX_PTX_CACHE_DIR" -xzf .ptx/ptx.tgz && touch "$R/ptx.done"
P=$PWD/docs/results/h100/run17
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
probe() {  # name port streams requests args...
  local name=$1 port=$2 s=$3 n=$4; shift 4
  python3 $P/probe_server.py "$R/$name-server.jsonl" serve --port "$port" "$@" > "$R/$name.log" 2>&1 &
  echo $! > /tmp/srv.pid
  until curl -sf "localhost:$port/readyz" > "$R/$name-readyz.json"; do sleep 1; kill -0 "$(cat /tmp/srv.pid)" || return 1; done
  timeout "$(left)" python3 $P/probe_client.py "http://127.0.0.1:$port" "$R/$name-client.jsonl" "$s" "$n"
  stop
}
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_a() { (cd .old && probe old1a 8101 1 12 "${BASE[@]}") && probe new1a 8102 1 12 "${BASE[@]}"; }
step_b() { probe new1b 8103 1 12 "${BASE[@]}" && (cd .old && probe old1b 8104 1 12 "${BASE[@]}"); }
step_c() { (cd .old && probe old8 8105 8 3 "${BASE[@]}") && probe new8 8106 8 3 "${BASE[@]}"; }
step warm 300
step a 50
step b 50
step c 50
say "all steps done"
