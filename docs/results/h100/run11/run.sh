#!/usr/bin/env bash
# GPU run 11 (H100, 2026-11-24, evening): diagnostics for what run 10 left open. From the repository
# root on the GPU host, after staging (py-spy carried in .whl too), call
#   bash docs/results/h100/run11/run.sh
# back to back until it says "all steps done" (resumable: ../lib.sh).
# * Which kernels does a first burst still build? MLX keeps every kernel it JIT-compiles as a file
#   in MLX_PTX_CACHE_DIR: the files listed (with their times) after the warm-up server and after each
#   first burst show what the warm-up left to first use (run 10: the 8-burst's p99 1.60-1.67x).
# * Where do constrained rows and prefix hits spend the engine's time? py-spy with native frames.
set -uo pipefail
RUN=run11
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)
kernels() { find "$MLX_PTX_CACHE_DIR" -type f -printf '%T@ %s %P\n' | sort -n > "$R/kernels-$1.txt"; say "$1: $(wc -l < "$R/kernels-$1.txt") kernel files"; }
native() {  # name seconds: py-spy (Python frames; --nonblocking: it does not stop the server) in the background
  # (A first call sampled native frames too, at 100 Hz: the server slowed to half its tokens/s and
  # the step ran out of the call's time; constrained-0-native.txt is what it left.)
  py-spy record -p "$(cat /tmp/srv.pid)" --nonblocking -r 250 -d "$2" -f raw -o "$R/$1-py.txt" > "$R/$1-py.log" 2>&1 &
  SPY=$!  # wait for it alone: a bare `wait` also waits for the server (what ran hung there; fixed after)
  sleep 1
}

step_warm() { start warm 8090 "${OFF[@]}" && stop; kernels warm; }  # the bursts' own configuration
step_burst8a() { first_burst burst8a 8100 8 "${OFF[@]}"; kernels burst8a; }
step_burst32a() { first_burst burst32a 8102 32 "${OFF[@]}"; kernels burst32a; }
step_burst8b() { first_burst burst8b 8101 8 "${OFF[@]}"; kernels burst8b; }
step_constrained() {
  start constrained 8120 "${OFF[@]}" || return 1
  for k in 0 8; do
    bench --url http://127.0.0.1:8120 --api openai --concurrency 32 --requests 2 --max-tokens 128 --warmup-requests 1 \
      --constrained $k --constrained-schema report --out $R/constrained-$k-warm.json
    native constrained-$k 8
    bench --url http://127.0.0.1:8120 --api openai --concurrency 32 --requests 4 --max-tokens 128 \
      --constrained $k --constrained-schema report --out $R/constrained-$k.json
    wait $SPY
  done
  stop; kernels constrained
}
step_prefix() {
  start prefix 8130 "${BASE[@]}" || return 1
  bench --url http://127.0.0.1:8130 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 1 \
    --max-tokens 128 --out $R/prefix-warm.json
  native prefix 8
  bench --url http://127.0.0.1:8130 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 6 \
    --max-tokens 128 --out $R/prefix.json
  wait $SPY; curl -sf localhost:8130/metrics > $R/prefix.metrics.txt; stop; kernels prefix
}

step warm 300
step burst8a 60
step burst32a 60
step burst8b 60
step constrained 120
step prefix 90
say "all steps done"
