#!/usr/bin/env bash
# GPU run 12 (H100, 2026-11-24, night): issue 13's constrained rows after two changes, with the
# session's last ~390 s of device time (so one measurement, few buckets, nothing else).
# * The bench's level no longer ends with a tail of constrained rows alone (they are closed when
#   the free streams finish), and a constrained batch's masks are filled on a worker thread while
#   the engine queues the forward pass (measured here, then reverted: docs/BENCHMARKS.md, twelfth run).
# * MLX's kernel cache is packed into $OUT/ptx.tgz after the warm-up, so a later session can carry
#   it to a fresh host instead of spending ~7 minutes on NVRTC (it is the same MLX and GPU kind).
# From the repository root on the GPU host, after staging, call
#   bash docs/results/h100/run12/run.sh
# back to back until it says "all steps done" (resumable: ../lib.sh).
set -uo pipefail
RUN=run12
source docs/results/h100/lib.sh
CFG=(--batch-buckets '[8,32]' --prompt-buckets '[64,256]' --capacity-buckets '[512]' --warmup-batch 32
  --prefix-cache-bytes 0)
URL=http://127.0.0.1:8120
level() {  # k name requests [extra]: one level of 32 streams, k of them constrained
  bench --url $URL --api openai --concurrency 32 --requests "$3" --max-tokens 128 --constrained "$1" \
    --constrained-schema report --out "$R/$2.json" "${@:4}"
}

step_constrained() {
  start constrained 8120 "${CFG[@]}" || return 1
  tar -C "$MLX_PTX_CACHE_DIR" -czf "${OUT:-/tmp}/ptx.tgz" . && say "kernel cache: $(ls "$MLX_PTX_CACHE_DIR" | wc -l) files"
  level 0 warm-0 1 --warmup-requests 1
  level 8 warm-8 1
  for pass in 1 2 3; do
    level 0 constrained-0-$pass 4
    level 8 constrained-8-$pass 4
  done
  curl -sf localhost:8120/metrics > "$R/constrained.metrics.txt"
  stop
}

step constrained 60
say "all steps done"
