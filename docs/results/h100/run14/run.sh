#!/usr/bin/env bash
# GPU run 14 (2026-11-26, the same H200 host as run 13, right after it: MLX's kernel cache warm).
# Run 13 profiled a prefix hit and measured the first bursts with the kernel cache warm; this run
# repeats what run 13 measured once, on fresh servers, so each figure has its spread:
# * prefix1-3: the prefix workload (8 streams, 1,500-token system prompt, 128 tokens out) with the
#   cache on, then off, each on a fresh server (run 10's pairs);
# * burst8b/c, burst32b/c: the first bursts after /readyz, again;
# * sbs-prefix: the prefix workload against mlx_lm.server on the same weights;
# * constrained: three more pairs of free / 8-constrained levels of 32 streams.
# From the repository root on the GPU host, after run 13:  bash docs/results/h100/run14/run.sh
set -uo pipefail
RUN=run14
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)

prefix_pair() {  # round: the prefix workload with the cache on, then off, each on a fresh server
  local round=$1 mode port args
  for mode in on off; do
    if [ $mode = on ]; then port=$((8110 + 2 * round)); args=("${BASE[@]}")
    else port=$((8111 + 2 * round)); args=("${OFF[@]}"); fi
    prefix_level prefix-$mode-$round $port 8 3 "${args[@]}" || return 1
  done
}
step_prefix1() { prefix_pair 1; }
step_prefix2() { prefix_pair 2; }
step_prefix3() { prefix_pair 3; }
step_burst8b() { first_burst burst8b 8101 8 "${OFF[@]}"; }
step_burst32b() { first_burst burst32b 8102 32 "${OFF[@]}"; }
step_burst8c() { first_burst burst8c 8103 8 "${OFF[@]}"; }
step_burst32c() { first_burst burst32c 8104 32 "${OFF[@]}"; }
step_sbsprefix() {
  STEPSERVE_BATCH_BUCKETS='[1,8,32]' STEPSERVE_PROMPT_BUCKETS='[64,256,512]' STEPSERVE_CAPACITY_BUCKETS='[2048]' \
  STEPSERVE_WARMUP_BATCH=32 bench --side-by-side --peers mlx_lm.server --workload chat-shared-prefix --system-tokens 1500 \
    --concurrency 8 --requests 3 --max-tokens 128 --warmup-requests 1 --out-dir $R/sbs-prefix
  rm -rf $R/sbs-prefix/model-* 2>/dev/null; true
}
step_constrained() {
  start constrained 8140 "${OFF[@]}" || return 1
  local pass=0 k
  for k in 0 8 0 8 0 8; do
    pass=$((pass + 1))
    bench --url http://127.0.0.1:8140 --api openai --concurrency 32 --requests 3 --max-tokens 128 --warmup-requests 1 \
      --constrained $k --constrained-schema report --out "$R/constrained-$k-$pass.json"
  done
  curl -sf localhost:8140/metrics > "$R/constrained.metrics.txt"; stop
}

step prefix1 60
step burst8b 25
step burst32b 25
step prefix2 60
step sbsprefix 150
step burst8c 25
step burst32c 25
step prefix3 60
step constrained 90
say "all steps done"
