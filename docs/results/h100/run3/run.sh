#!/usr/bin/env bash
# Issues 12 and 13's GPU measurements. After staging (docs/CONTRIBUTING.md, "On a GPU"; the
# project's extra wheels carried in .whl), from the repository root on the GPU host, two calls
# back to back (the host stays warm 30 s after a call, and MLX's kernel cache with it):
#   bash docs/results/h100/run3/run.sh warm      # NVRTC JIT of every kernel the runs need (fresh host: minutes)
#   bash docs/results/h100/run3/run.sh measure   # the measurements, in priority order
# Each result is packed into $OUT/results.tgz as soon as it exists (a call brings back at most 8
# files); progress is printed as it goes. RUN3_MODEL and RUN3_BUDGET_S rehearse it elsewhere.
set -uo pipefail
[ -f ~/stage/env.sh ] && source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx PYTHONUNBUFFERED=1
python3 -c "import service.api.app, llguidance, fastapi_offline, rich" || { echo "missing packages: carry them in .whl"; exit 2; }
mkdir -p "$MLX_PTX_CACHE_DIR"
M=(${RUN3_MODEL:+--model "$RUN3_MODEL"})
R=/tmp/run3; mkdir -p $R
T0=$(date +%s)
left() { local s=$(( ${RUN3_BUDGET_S:-570} - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
pack() { tar -C /tmp -czf $OUT/results.tgz run3; say "packed: $1"; }
BASE=("${M[@]}" --batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
STALL=("${M[@]}" --batch-buckets '[1,8]' --capacity-buckets '[2048,8192]' --warmup-batch 8 --warmup-prompt-tokens 8192)
B="python3 -m service.cli bench"
start() {  # name port args...: start a server, wait for /readyz, printing its warm-up progress
  local name=$1 port=$2; shift 2
  python3 -m service.cli serve --port $port "$@" > $R/$name.log 2>&1 &
  echo $! > /tmp/srv.pid
  local n=0
  until curl -sf localhost:$port/readyz >/dev/null; do
    sleep 1; n=$((n + 1))
    if ! kill -0 $(cat /tmp/srv.pid) 2>/dev/null; then say "$name died"; tail -20 $R/$name.log; return 1; fi
    if (( $(left) <= 1 )); then say "$name: out of time"; stop; return 1; fi
    (( n % 30 == 0 )) && say "$name: $(grep -oE 'warm-up [0-9]+/[0-9]+[^,]*|rehearsal: .*' $R/$name.log | tail -1)"
  done
  say "$name ready: $(grep -o 'warm-up done.*' $R/$name.log)"
}
stop() { kill $(cat /tmp/srv.pid) 2>/dev/null; wait $(cat /tmp/srv.pid) 2>/dev/null; }
bench() { timeout $(left) $B "$@" 2>&1 >/dev/null | tail -4; }
chat() { bench --url http://127.0.0.1:$1 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 \
  --requests 3 --max-tokens 128 --warmup-requests 1 --out $R/$2.json; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/device.txt 2>&1

case "${1:-measure}" in
warm)
  start w1 8090 "${BASE[@]}" --prefix-cache-bytes 0; stop; pack "kernel cache: base buckets"
  start w2 8091 "${STALL[@]}" --prompt-buckets '[64,256,512]'; stop
  start w3 8092 "${STALL[@]}" --prompt-buckets '[64,256,512,8192]' --prefill-chunk-tokens 8192 --max-batched-tokens 8192
  stop; pack "kernel cache: no-stall buckets" ;;
measure)
  # 1. first burst of 8 right after /readyz (prefix cache off), then chats without the cache
  python3 -m service.cli serve --port 8100 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s1.log 2>&1 & echo $! > /tmp/srv.pid
  bench --workload first-burst --url http://127.0.0.1:8100 --concurrency 8 --max-tokens 32 --ready-timeout-s 200 \
    --out $R/first-burst-8.json
  chat 8100 chat-prefix-off; stop; pack "first burst 8, chats without the prefix cache"
  # 2. chats with the prefix cache, then again without it
  start s2 8101 "${BASE[@]}" && chat 8101 chat-prefix-on; stop
  start s3 8102 "${BASE[@]}" --prefix-cache-bytes 0 && chat 8102 chat-prefix-off-2; stop; pack "prefix reuse"
  # 3. first burst of 32 (fresh server, prefix cache off), then 32 streams with 0 and 8 constrained
  python3 -m service.cli serve --port 8103 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s4.log 2>&1 & echo $! > /tmp/srv.pid
  bench --workload first-burst --url http://127.0.0.1:8103 --concurrency 32 --max-tokens 32 --ready-timeout-s 200 \
    --out $R/first-burst-32.json
  for k in 0 8 0 8; do
    bench --url http://127.0.0.1:8103 --api openai --concurrency 32 --requests 3 --max-tokens 128 --warmup-requests 1 \
      --constrained $k --out $R/constrained-$k-$(date +%s).json
  done
  stop; pack "first burst 32, constrained"
  # 4. no stall: 4 streams decoding while a 6,000-token prompt arrives, chunked and not
  start s5 8105 "${STALL[@]}" --prompt-buckets '[64,256,512]' && bench --workload long-arrival \
    --url http://127.0.0.1:8105 --streams 4 --long-prompt-tokens 6000 --out $R/stall-chunked.json; stop
  start s6 8106 "${STALL[@]}" --prompt-buckets '[64,256,512,8192]' --prefill-chunk-tokens 8192 \
    --max-batched-tokens 8192 && bench --workload long-arrival --url http://127.0.0.1:8106 --streams 4 \
    --long-prompt-tokens 6000 --out $R/stall-unchunked.json; stop; pack "no stall"
  # 5. no regression: essays at 1, 8, 32 streams against mlx_lm.server on the same weights
  if [ -z "${RUN3_MODEL:-}" ]; then
    STEPSERVE_BATCH_BUCKETS='[1,8,32]' STEPSERVE_PROMPT_BUCKETS='[64,256,512]' STEPSERVE_CAPACITY_BUCKETS='[2048]' \
    STEPSERVE_WARMUP_BATCH=32 bench --side-by-side --peers mlx_lm.server --concurrency 1 8 32 --requests 4 \
      --max-tokens 128 --out-dir $R/sbs
    rm -rf $R/sbs/model-* 2>/dev/null; pack "side by side"
  fi ;;
esac
