#!/usr/bin/env bash
# Issues 12, 13 and 14's GPU lease of 2026-11-24, afternoon (after run9: run9/run.sh). After staging (docs/CONTRIBUTING.md, "On a GPU";
# the project's extra wheels carried in .whl), from the repository root on the GPU host, call
#   bash docs/results/h100/run9/run.sh
# as many times as needed, back to back (the host stays warm 30 s after a call, and MLX's kernel
# cache with it): the steps run in order, each skipped once done (a marker in ~/run9), and a step
# starts only when the call has the time it needs. The first step only fills the kernel cache
# (NVRTC JIT on a fresh host: minutes). Every result is packed into $OUT/results.tgz as soon as
# it exists. RUN9_MODEL and RUN9_BUDGET_S rehearse it elsewhere.
set -uo pipefail
[ -f ~/stage/env.sh ] && source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx PYTHONUNBUFFERED=1
python3 -c "import service.api.app, llguidance, fastapi_offline, rich" || { echo "missing packages: carry them in .whl"; exit 2; }
mkdir -p "$MLX_PTX_CACHE_DIR"
M=(${RUN9_MODEL:+--model "$RUN9_MODEL"})
R=$HOME/run9; mkdir -p $R
T0=$(date +%s)
left() { local s=$(( ${RUN9_BUDGET_S:-575} - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
pack() { tar -C $HOME -czf ${OUT:-/tmp}/results.tgz run9; say "packed: $1"; }
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

SMALL=("${BASE[@]}" --prefix-cache-bytes 0)
step_warm() { start warm 8090 "${SMALL[@]}" && stop; }  # the first bursts' own configuration
profiled_burst() {  # name port: a fresh server, py-spy on it (Python frames, and native ones), then its first burst of 32
  start $1 $2 "${SMALL[@]}" || return 1
  py-spy record -p "$(cat /tmp/srv.pid)" -r 250 -d 25 -f raw --nonblocking -o $R/$1-profile.txt \
    > $R/$1-profile.log 2>&1 &
  py-spy record -p "$(cat /tmp/srv.pid)" --native -r 50 -d 25 -f raw -o $R/$1-native.txt > $R/$1-native.log 2>&1 &
  sleep 2
  bench --workload first-burst --url http://127.0.0.1:$2 --concurrency 32 --max-tokens 32 --out $R/$1.json
  sleep 1; stop
}
step_burst32a() { profiled_burst burst32a 8102; }
step_burst32b() { profiled_burst burst32b 8103; }

step warm 300
step burst32a 60
step burst32b 60
say "all steps done"
