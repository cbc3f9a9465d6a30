#!/usr/bin/env bash
# Helpers that GPU run scripts source (from run 10 on; runs 4-9 carry their own copies, as they ran).
# Before sourcing, a script sets RUN (its name: results go to ~/$RUN and into $OUT/results.tgz).
# Optional: ${RUN}_MODEL-style overrides are the script's own; BUDGET_S (default 575) is the seconds
# one call may spend, so a step starts only when the call has the time it needs.
[ -f ~/stage/env.sh ] && source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx PYTHONUNBUFFERED=1
python3 -c "import service.api.app, llguidance, fastapi_offline, rich" || { echo "missing packages: carry them in .whl"; exit 2; }
mkdir -p "$MLX_PTX_CACHE_DIR"
R=$HOME/$RUN; mkdir -p "$R"
# A kernel cache carried in .ptx/ptx.tgz (docs/CONTRIBUTING.md) is unpacked once, before any server starts.
[ -f .ptx/ptx.tgz ] && [ ! -f "$R/ptx.done" ] && tar -C "$MLX_PTX_CACHE_DIR" -xzf .ptx/ptx.tgz && touch "$R/ptx.done"
T0=$(date +%s)
B="python3 -m service.cli bench"
left() { local s=$(( ${BUDGET_S:-575} - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
pack() { tar -C "$HOME" -czf "${OUT:-/tmp}/results.tgz" "$RUN"; say "packed: $1"; }
start() {  # name port args...: start a server, wait for /readyz (printing warm-up progress), record its warm-up
  local name=$1 port=$2; shift 2
  python3 -m service.cli serve --port "$port" "$@" > "$R/$name.log" 2>&1 &
  echo $! > /tmp/srv.pid
  local n=0
  until curl -sf "localhost:$port/readyz" > "$R/$name-readyz.json"; do
    sleep 1; n=$((n + 1))
    if ! kill -0 "$(cat /tmp/srv.pid)" 2>/dev/null; then say "$name died"; tail -20 "$R/$name.log"; return 1; fi
    if (( $(left) <= 1 )); then say "$name: out of time"; stop; return 1; fi
    (( n % 30 == 0 )) && say "$name: $(grep -oE 'warm-up [0-9]+/[0-9]+[^,]*|rehearsal: .*' "$R/$name.log" | tail -1)"
  done
  say "$name ready after ${n} s: $(grep -o 'warm-up done.*' "$R/$name.log")"
}
stop() { kill "$(cat /tmp/srv.pid)" 2>/dev/null; wait "$(cat /tmp/srv.pid)" 2>/dev/null; }
bench() { timeout "$(left)" $B "$@" 2>&1 >/dev/null | tail -4; }
step() {  # name seconds-needed: run step_<name> unless done, or unless too little time is left
  local name=$1 need=$2
  [ -f "$R/done.$name" ] && return 0
  if (( $(left) < need )); then say "not starting $name: $(left) s left, it needs ~$need"; exit 0; fi
  say "step $name"
  "step_$name" && touch "$R/done.$name"
  pack "$name"
}
prefix_level() {  # name port streams requests args...: the prefix workload (a 1,500-token system prompt, 128 tokens out) on a fresh server
  local name=$1 port=$2 c=$3 n=$4; shift 4
  start "$name" "$port" "$@" || return 1
  bench --url http://127.0.0.1:$port --workload chat-shared-prefix --system-tokens 1500 --concurrency "$c" \
    --requests "$n" --max-tokens 128 --warmup-requests 1 --out "$R/$name.json"
  curl -sf "localhost:$port/metrics" > "$R/$name.metrics.txt"; stop
}
PROBES=$PWD/docs/results/h100/run17  # run 17's probes (this file is sourced from the repository root)
probe() {  # name port streams requests args...: that workload under run 17's probes (PRE: a first pass with a PRE-token system prompt)
  local name=$1 port=$2 s=$3 n=$4; shift 4
  python3 "$PROBES/probe_server.py" "$R/$name-server.jsonl" serve --port "$port" "$@" > "$R/$name.log" 2>&1 &
  echo $! > /tmp/srv.pid
  until curl -sf "localhost:$port/readyz" > "$R/$name-readyz.json"; do sleep 1; kill -0 "$(cat /tmp/srv.pid)" || return 1; done
  [ -n "${PRE:-}" ] && timeout "$(left)" python3 "$PROBES/probe_client.py" "http://127.0.0.1:$port" "$R/$name-pre.jsonl" 1 2 "$PRE"
  timeout "$(left)" python3 "$PROBES/probe_client.py" "http://127.0.0.1:$port" "$R/$name-client.jsonl" "$s" "$n"
  curl -sf "localhost:$port/metrics" > "$R/$name.metrics.txt"; stop
}
first_burst() {  # name port concurrency server-args...: a fresh server, its first burst right after /readyz
  local name=$1 port=$2 n=$3; shift 3
  python3 -m service.cli serve --port "$port" "$@" > "$R/$name.log" 2>&1 & echo $! > /tmp/srv.pid
  bench --workload first-burst --url "http://127.0.0.1:$port" --concurrency "$n" --max-tokens 32 --ready-timeout-s 200 \
    --out "$R/$name.json"
  curl -sf "localhost:$port/readyz" > "$R/$name-readyz.json"
  stop
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/device.txt" 2>&1
