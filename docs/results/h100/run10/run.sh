#!/usr/bin/env bash
# Issues 12, 13 and 14's GPU lease of 2026-11-24, evening. After staging (docs/CONTRIBUTING.md, "On a GPU";
# the project's extra wheels carried in .whl), from the repository root on the GPU host, call
#   bash docs/results/h100/run10/run.sh
# as many times as needed, back to back (the host stays warm 30 s after a call, and MLX's kernel
# cache with it): steps run in order, each skipped once done (a marker in ~/run10), each started
# only when the call has the time it needs (../lib.sh). The first step only fills the kernel cache.
# What it measures since run 8/9: the rehearsal's repeated prompt (the first 32-burst's stall,
# run 9), prefix hits' last chunks prefilled in one call, constrained rows, the MoE step at batch 8.
set -uo pipefail
RUN=run10
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)

step_warm() { start warm 8090 "${BASE[@]}" && stop; }  # prefix cache on: its copies' kernels too
step_burst32a() { first_burst burst32a 8102 32 "${OFF[@]}"; }
step_burst8a() { first_burst burst8a 8100 8 "${OFF[@]}"; }
prefix_pair() {  # round: the prefix workload with the cache on, then off, each on a fresh server
  local round=$1 mode port args
  for mode in on off; do
    if [ $mode = on ]; then port=$((8110 + 2 * round)); args=("${BASE[@]}")
    else port=$((8111 + 2 * round)); args=("${OFF[@]}"); fi
    start prefix-$mode-$round $port "${args[@]}" || return 1
    bench --url http://127.0.0.1:$port --workload chat-shared-prefix --system-tokens 1500 --concurrency 8 --requests 3 \
      --max-tokens 128 --warmup-requests 1 --out $R/prefix-$mode-$round.json
    curl -sf localhost:$port/metrics > $R/prefix-$mode-$round.metrics.txt; stop
  done
}
step_prefix1() { prefix_pair 1; }
step_prefix2() { prefix_pair 2; }
step_constrained() {  # 32 streams, 0 or 8 of them constrained, answers as long as free text, alternating
  start constrained 8120 "${OFF[@]}" || return 1
  for round in 1 2 3; do
    for k in 0 8; do
      bench --url http://127.0.0.1:8120 --api openai --concurrency 32 --requests 3 --max-tokens 128 --warmup-requests 1 \
        --constrained $k --constrained-schema report --out $R/constrained-report-$k-$round.json
    done
  done
  curl -sf localhost:8120/metrics > $R/constrained-metrics.txt; stop
}
step_moe() { timeout $(left) $B moe --batch 8 1 32 --rounds 5 --out $R/moe-48x128-top8-4bit.json 2>&1 | grep -v '^{'; }
step_burst32b() { first_burst burst32b 8103 32 "${OFF[@]}"; }
step_burst8b() { first_burst burst8b 8101 8 "${OFF[@]}"; }

step warm 300
step burst32a 60
step burst8a 60
step prefix1 90
step constrained 150
step moe 200
step prefix2 90
step burst32b 60
step burst8b 60
say "all steps done"
