#!/usr/bin/env bash
# Issues 12-15's GPU measurements (2026-11-24). After staging (docs/CONTRIBUTING.md, "On a GPU";
# the project's extra wheels carried in .whl), from the repository root on the GPU host, call
#   bash docs/results/h100/run4/run.sh
# as many times as needed, back to back (the host stays warm 30 s after a call, and MLX's kernel
# cache with it): the steps run in order, each skipped once done (a marker in ~/run4), and a step
# starts only when the call has the time it needs. The first step only fills the kernel cache
# (NVRTC JIT on a fresh host: minutes). Every result is packed into $OUT/results.tgz as soon as
# it exists. RUN4_MODEL and RUN4_BUDGET_S rehearse it elsewhere.
set -uo pipefail
[ -f ~/stage/env.sh ] && source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx PYTHONUNBUFFERED=1
python3 -c "import service.api.app, llguidance, fastapi_offline, rich" || { echo "missing packages: carry them in .whl"; exit 2; }
mkdir -p "$MLX_PTX_CACHE_DIR"
M=(${RUN4_MODEL:+--model "$RUN4_MODEL"})
R=$HOME/run4; mkdir -p $R
T0=$(date +%s)
left() { local s=$(( ${RUN4_BUDGET_S:-575} - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
pack() { tar -C $HOME -czf ${OUT:-/tmp}/results.tgz run4; say "packed: $1"; }
BASE=("${M[@]}" --batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
STALL=("${M[@]}" --batch-buckets '[1,8]' --capacity-buckets '[2048,8192]' --warmup-batch 8 --warmup-prompt-tokens 8192)
B="python3 -m service.cli bench"
start() {  # name port args...: start a server, wait for /readyz (printing warm-up progress), record its warm-up
  local name=$1 port=$2; shift 2
  python3 -m service.cli serve --port $port "$@" > $R/$name.log 2>&1 &
  echo $! > /tmp/srv.pid
  local n=0
  until curl -sf localhost:$port/readyz > $R/$name-readyz.json; do
    sleep 1; n=$((n + 1))
    if ! kill -0 $(cat /tmp/srv.pid) 2>/dev/null; then say "$name died"; tail -20 $R/$name.log; return 1; fi
    if (( $(left) <= 1 )); then say "$name: out of time"; stop; return 1; fi
    (( n % 30 == 0 )) && say "$name: $(grep -oE 'warm-up [0-9]+/[0-9]+[^,]*|rehearsal: .*' $R/$name.log | tail -1)"
  done
  say "$name ready after ${n} s: $(grep -o 'warm-up done.*' $R/$name.log)"
}
stop() { kill $(cat /tmp/srv.pid) 2>/dev/null; wait $(cat /tmp/srv.pid) 2>/dev/null; }
bench() { timeout $(left) $B "$@" 2>&1 >/dev/null | tail -4; }
step() {  # name seconds-needed: run step_<name> unless done, or unless too little time is left
  local name=$1 need=$2
  [ -f $R/done.$name ] && return 0
  if (( $(left) < need )); then say "not starting $name: $(left) s left, it needs ~$need"; exit 0; fi
  say "step $name"
  "step_$name" && touch $R/done.$name
  pack "$name"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/device.txt 2>&1

step_warm() { start warm 8090 "${BASE[@]}" --speculative lookup && stop; }
step_burst8() {  # first burst of 8 right after /readyz (prefix cache off); chats without it; 32 streams, 0 or 8 constrained
  python3 -m service.cli serve --port 8100 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s1.log 2>&1 & echo $! > /tmp/srv.pid
  bench --workload first-burst --url http://127.0.0.1:8100 --concurrency 8 --max-tokens 32 --ready-timeout-s 200 \
    --out $R/first-burst-8.json
  curl -sf localhost:8100/readyz > $R/s1-readyz.json
  bench --url http://127.0.0.1:8100 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 3 \
    --max-tokens 128 --warmup-requests 1 --out $R/chat-prefix-off.json
  for k in 0 8 0 8; do
    bench --url http://127.0.0.1:8100 --api openai --concurrency 32 --requests 3 --max-tokens 128 --warmup-requests 1 \
      --constrained $k --out $R/constrained-$k-$(date +%s).json
  done
  curl -sf localhost:8100/metrics > $R/s1-metrics.txt; stop
}
spec_runs() {  # port tag: copy-heavy and open-ended chat at 1 stream, copy at 32
  bench --url http://127.0.0.1:$1 --workload copy --system-tokens 400 --concurrency 1 --requests 4 --max-tokens 256 \
    --warmup-requests 1 --out $R/copy-1-$2.json
  bench --url http://127.0.0.1:$1 --workload chat --concurrency 1 --requests 4 --max-tokens 256 \
    --warmup-requests 1 --out $R/chat-1-$2.json
  bench --url http://127.0.0.1:$1 --workload copy --system-tokens 400 --concurrency 32 --requests 2 --max-tokens 256 \
    --warmup-requests 1 --out $R/copy-32-$2.json
  curl -sf localhost:$1/metrics > $R/metrics-$2.txt
}
step_off() {
  start off 8101 "${BASE[@]}" || return 1
  bench --url http://127.0.0.1:8101 --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 3 \
    --max-tokens 128 --warmup-requests 1 --out $R/chat-prefix-on.json
  spec_runs 8101 off; stop
}
step_lookup() { start lookup 8102 "${BASE[@]}" --speculative lookup || return 1; spec_runs 8102 lookup; stop; }
step_burst32() {
  python3 -m service.cli serve --port 8103 "${BASE[@]}" --prefix-cache-bytes 0 > $R/s4.log 2>&1 & echo $! > /tmp/srv.pid
  bench --workload first-burst --url http://127.0.0.1:8103 --concurrency 32 --max-tokens 32 --ready-timeout-s 200 \
    --out $R/first-burst-32.json
  stop
}
step_moe() {
  timeout $(left) $B moe --batch 1 8 32 --out $R/moe-48x128-top8-4bit.json 2>&1 | tail -6
  timeout $(left) $B moe --bits 0 --batch 1 8 32 --out $R/moe-48x128-top8-dense.json 2>&1 | tail -6
}
step_sbs() {  # no regression: essays at 1, 8, 32 streams against mlx_lm.server on the same weights
  [ -n "${RUN4_MODEL:-}" ] && return 0
  STEPSERVE_BATCH_BUCKETS='[1,8,32]' STEPSERVE_PROMPT_BUCKETS='[64,256,512]' STEPSERVE_CAPACITY_BUCKETS='[2048]' \
  STEPSERVE_WARMUP_BATCH=32 bench --side-by-side --peers mlx_lm.server --concurrency 1 8 32 --requests 4 \
    --max-tokens 128 --out-dir $R/sbs
  rm -rf $R/sbs/model-* 2>/dev/null; true
}
step_stall() {  # 4 streams decoding while a 6,000-token prompt arrives, chunked
  start stall 8105 "${STALL[@]}" --prompt-buckets '[64,256,512]' || return 1
  bench --workload long-arrival --url http://127.0.0.1:8105 --streams 4 --long-prompt-tokens 6000 --out $R/stall-chunked.json
  stop
}
step_unchunked() {
  start unchunked 8106 "${STALL[@]}" --prompt-buckets '[64,256,512,8192]' --prefill-chunk-tokens 8192 \
    --max-batched-tokens 8192 || return 1
  bench --workload long-arrival --url http://127.0.0.1:8106 --streams 4 --long-prompt-tokens 6000 --out $R/stall-unchunked.json
  stop
}

step warm 300
step burst8 200
step off 120
step lookup 120
step burst32 60
step moe 90
step sbs 200
step stall 200
step unchunked 200
say "all steps done"
