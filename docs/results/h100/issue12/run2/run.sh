#!/usr/bin/env bash
# Issue 12's GPU measurements (scratch; not committed). Usage: bash scratch/gpu12.sh PHASE...
set -uo pipefail
source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx
mkdir -p "$MLX_PTX_CACHE_DIR"
R=$OUT/issue12; mkdir -p $R
BASE=(--batch-buckets '[1,2,4,8]' --capacity-buckets '[2048,4096,8192]' --warmup-batch 8)
PY=python3
start() {  # name port args...
  local name=$1 port=$2; shift 2
  $PY -m service.cli serve --port $port "$@" > $R/$name.log 2>&1 &
  echo $! > /tmp/srv.pid
  local t0=$(date +%s)
  until curl -sf localhost:$port/readyz >/dev/null; do
    sleep 0.5; if ! kill -0 $(cat /tmp/srv.pid) 2>/dev/null; then echo "$name died"; tail -20 $R/$name.log; return 1; fi
  done
  echo "$name ready after $(( $(date +%s) - t0 )) s"; grep -i "warm" $R/$name.log | tail -3
}
stop() { kill $(cat /tmp/srv.pid); wait $(cat /tmp/srv.pid) 2>/dev/null; }
steps() { curl -s localhost:$1/metrics | grep -E '^stepserve_step_seconds_(sum|count)' > $R/$2.metrics.txt; }
B="$PY -m service.cli bench"
for phase in "$@"; do
case $phase in
A)  # fresh host: prefix off; first burst 8, then chat without the cache, then no-stall chunked
  $PY -m service.cli serve --port 8100 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s1.log 2>&1 & echo $! > /tmp/srv.pid
  $B --workload first-burst --url http://127.0.0.1:8100 --concurrency 8 --max-tokens 32 --ready-timeout-s 560 --out $R/first-burst-8.json 2>&1 | tail -8
  grep -iE "warm-up|ready" $R/s1.log | tail -3
  $B --url http://127.0.0.1:8100 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 2 --max-tokens 128 --warmup-requests 1 --out $R/chat-prefix-off.json 2>&1 | tail -4
  steps 8100 chat-prefix-off
  $B --workload long-arrival --url http://127.0.0.1:8100 --streams 4 --long-prompt-tokens 6000 --out $R/stall-chunked.json 2>&1 | tail -6
  stop ;;
B)  # prefix on, same flags
  start s2 8101 "${BASE[@]}" || exit 1
  $B --url http://127.0.0.1:8101 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 2 --max-tokens 128 --warmup-requests 1 --out $R/chat-prefix-on.json 2>&1 | tail -4
  steps 8101 chat-prefix-on
  stop
  start s2off 8105 "${BASE[@]}" --prefix-cache-bytes 0 || exit 1
  $B --url http://127.0.0.1:8105 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 2 --max-tokens 128 --warmup-requests 1 --out $R/chat-prefix-off-2.json 2>&1 | tail -4
  steps 8105 chat-prefix-off-2
  stop ;;
C)  # unchunked no-stall
  start s3 8102 "${BASE[@]}" --prefill-chunk-tokens 8192 --max-batched-tokens 8192 --prompt-buckets '[32,64,128,256,512,1024,2048,4096,8192]' || exit 1
  $B --workload long-arrival --url http://127.0.0.1:8102 --streams 4 --long-prompt-tokens 6000 --out $R/stall-unchunked.json 2>&1 | tail -6
  stop
  start s3b 8103 "${BASE[@]}" || exit 1
  $B --workload long-arrival --url http://127.0.0.1:8103 --streams 4 --long-prompt-tokens 6000 --out $R/stall-chunked-2.json 2>&1 | tail -6
  stop ;;
D)  # first burst 32, prefix off
  $PY -m service.cli serve --port 8104 --batch-buckets '[1,2,4,8,16,32]' --capacity-buckets '[2048,4096,8192]' --warmup-batch 32 --prefix-cache-bytes 0 > $R/s4.log 2>&1 & echo $! > /tmp/srv.pid
  $B --workload first-burst --url http://127.0.0.1:8104 --concurrency 32 --max-tokens 32 --ready-timeout-s 560 --out $R/first-burst-32.json 2>&1 | tail -8
  grep -iE "warm-up|ready" $R/s4.log | tail -3
  stop ;;
E)  # prefix reuse against mlx_lm.server on the converted weights
  STEPSERVE_BATCH_BUCKETS='[1,2,4,8]' STEPSERVE_CAPACITY_BUCKETS='[2048,4096,8192]' STEPSERVE_WARMUP_BATCH=8 \
  $B --side-by-side --peers mlx_lm.server --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 2 --max-tokens 128 --warmup-requests 1 --out-dir $R/sbs-prefix 2>&1 | tail -12 ;;
F)  # no regression: essays 1/8/32
  STEPSERVE_BATCH_BUCKETS='[1,2,4,8,16,32]' STEPSERVE_CAPACITY_BUCKETS='[2048,4096,8192]' STEPSERVE_WARMUP_BATCH=32 \
  $B --side-by-side --peers mlx_lm.server --concurrency 1 8 32 --requests 4 --max-tokens 128 --out-dir $R/sbs-essays 2>&1 | tail -14 ;;
esac
done
rm -rf $R/sbs-*/model-* 2>/dev/null
ls -la $R
