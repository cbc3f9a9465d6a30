#!/usr/bin/env bash
# Issues 12 and 13's GPU measurements in one device call (the lease allows one): after staging
# (docs/CONTRIBUTING.md, "On a GPU"), from the repository root on the GPU host:
#   bash docs/results/h100/run3/run.sh
# Phases in priority order, each result packed into $OUT/results.tgz as soon as it exists (a call
# brings back at most 8 files). Few buckets, so a fresh host's kernel JIT (NVRTC) fits the call.
set -uo pipefail
[ -f ~/stage/env.sh ] && source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx PYTHONUNBUFFERED=1
M=(${RUN3_MODEL:+--model "$RUN3_MODEL"})  # a rehearsal of this script elsewhere may serve another model
mkdir -p "$MLX_PTX_CACHE_DIR"
R=/tmp/run3; mkdir -p $R
T0=$(date +%s)
left() { local s=$(( ${RUN3_BUDGET_S:-575} - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }  # of the call's 600 s
pack() { tar -C /tmp -czf $OUT/results.tgz run3; echo "[$(( $(date +%s) - T0 )) s] packed: $1"; }
BASE=("${M[@]}" --batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
B="python3 -m service.cli bench"
start() {  # name port args...: start a server, wait for /readyz
  local name=$1 port=$2; shift 2
  python3 -m service.cli serve --port $port "$@" > $R/$name.log 2>&1 &
  echo $! > /tmp/srv.pid
  local t=$(date +%s)
  until curl -sf localhost:$port/readyz >/dev/null; do
    sleep 0.5
    if ! kill -0 $(cat /tmp/srv.pid) 2>/dev/null; then echo "$name died"; tail -20 $R/$name.log; return 1; fi
    if (( $(left) <= 1 )); then echo "$name: out of time"; stop; return 1; fi
  done
  echo "$name ready after $(( $(date +%s) - t )) s: $(grep -o 'warm-up done.*' $R/$name.log)"
}
stop() { kill $(cat /tmp/srv.pid) 2>/dev/null; wait $(cat /tmp/srv.pid) 2>/dev/null; }
chat() {  # port out: 8 streams of chats sharing a ~1,500-token system prompt
  timeout $(left) $B --url http://127.0.0.1:$1 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 \
    --requests 3 --max-tokens 128 --warmup-requests 1 --out $R/$2.json 2>&1 >/dev/null | tail -3
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/device.txt 2>&1

# 1. fresh host: first burst of 8 right after /readyz (prefix cache off), then chats without the cache
python3 -m service.cli serve --port 8100 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s1.log 2>&1 & echo $! > /tmp/srv.pid
timeout $(left) $B --workload first-burst --url http://127.0.0.1:8100 --concurrency 8 --max-tokens 32 \
  --ready-timeout-s 400 --out $R/first-burst-8.json 2>&1 >/dev/null | tail -6
grep -o 'warm-up done.*' $R/s1.log
chat 8100 chat-prefix-off
stop; pack "first burst 8, chat without the prefix cache"

# 2. chats with the prefix cache, then again without it (same host, back to back)
start s2 8101 "${BASE[@]}" && chat 8101 chat-prefix-on; stop
start s3 8102 "${BASE[@]}" --prefix-cache-bytes 0 && chat 8102 chat-prefix-off-2; stop
pack "prefix reuse"

# 3. first burst of 32 (fresh server, prefix cache off), then 32 streams with 0 and 8 constrained
python3 -m service.cli serve --port 8103 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s4.log 2>&1 & echo $! > /tmp/srv.pid
timeout $(left) $B --workload first-burst --url http://127.0.0.1:8103 --concurrency 32 --max-tokens 32 \
  --ready-timeout-s 300 --out $R/first-burst-32.json 2>&1 >/dev/null | tail -6
for k in 0 8 0 8; do
  timeout $(left) $B --url http://127.0.0.1:8103 --api openai --concurrency 32 --requests 3 --max-tokens 128 \
    --warmup-requests 1 --constrained $k --out $R/constrained-$k-$(date +%s).json 2>&1 >/dev/null | tail -2
done
stop; pack "first burst 32, constrained"

# 4. no regression: essays at 1, 8, 32 streams against mlx_lm.server on the same weights
[ -n "${RUN3_MODEL:-}" ] || STEPSERVE_BATCH_BUCKETS='[1,8,32]' STEPSERVE_PROMPT_BUCKETS='[64,256,512]' STEPSERVE_CAPACITY_BUCKETS='[2048]' \
STEPSERVE_WARMUP_BATCH=32 timeout $(left) $B --side-by-side --peers mlx_lm.server --concurrency 1 8 32 --requests 4 \
  --max-tokens 128 --out-dir $R/sbs 2>&1 >/dev/null | tail -12
rm -rf $R/sbs/model-* 2>/dev/null; pack "side by side"

# 5. no stall (if time is left): 4 streams decoding while a 6,000-token prompt arrives, chunked and not
STALL=("${M[@]}" --batch-buckets '[1,8]' --capacity-buckets '[2048,8192]' --warmup-batch 8 --warmup-prompt-tokens 8192)
start s5 8105 "${STALL[@]}" --prompt-buckets '[64,256,512]' && timeout $(left) $B --workload long-arrival --url http://127.0.0.1:8105 --streams 4 \
  --long-prompt-tokens 6000 --out $R/stall-chunked.json 2>&1 >/dev/null | tail -4; stop; pack "no stall, chunked"
start s6 8106 "${STALL[@]}" --prompt-buckets '[64,256,512,8192]' --prefill-chunk-tokens 8192 --max-batched-tokens 8192 && \
  timeout $(left) $B --workload long-arrival --url http://127.0.0.1:8106 --streams 4 --long-prompt-tokens 6000 \
  --out $R/stall-unchunked.json 2>&1 >/dev/null | tail -4; stop; pack "no stall, unchunked"
