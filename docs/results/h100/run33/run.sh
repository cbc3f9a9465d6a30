#!/usr/bin/env bash
# GPU run 33 (2026-11-26), a fresh host after run 32's: run 32's prefix A/B again (two rounds; old is
# c408dd0, carried as .old/), then the other GPU figures on the new code: the first 32- and
# 8-stream bursts after /readyz against a second identical burst (fresh servers), and the
# side-by-side against mlx_lm.server at 1, 8, 32 streams (no regression).
# (prefix_level, first_burst: ../lib.sh.) From the repository root: bash docs/results/h100/run33/run.sh
set -uo pipefail
RUN=run33
source docs/results/h100/lib.sh
BASE=(--batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
old() { (cd .old && "$@"); }
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
round() {  # suffix first-port: new on, new off, old on, old off (the order turns each round)
  local s=$1 p=$2
  if [ "$s" = b ]; then
    old prefix_level "old-on-$s" "$p" 8 10 "${BASE[@]}" && old prefix_level "old-off-$s" $((p + 1)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0 &&
      prefix_level "new-on-$s" $((p + 2)) 8 10 "${BASE[@]}" && prefix_level "new-off-$s" $((p + 3)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0
  else
    prefix_level "new-on-$s" "$p" 8 10 "${BASE[@]}" && prefix_level "new-off-$s" $((p + 1)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0 &&
      old prefix_level "old-on-$s" $((p + 2)) 8 10 "${BASE[@]}" && old prefix_level "old-off-$s" $((p + 3)) 8 10 "${BASE[@]}" --prefix-cache-bytes 0
  fi
}
step_a() { round a 8101; }
step_b() { round b 8105; }
step_bursts() {
  first_burst burst32-a 8111 32 "${BASE[@]}" && first_burst burst8-a 8112 8 "${BASE[@]}" &&
    first_burst burst32-b 8113 32 "${BASE[@]}" && first_burst burst8-b 8114 8 "${BASE[@]}"
}
step_sbs() {  # no regression: essays at 1, 8, 32 streams against mlx_lm.server on the same weights
  STEPSERVE_BATCH_BUCKETS='[1,8,32]' STEPSERVE_PROMPT_BUCKETS='[64,256,512]' STEPSERVE_CAPACITY_BUCKETS='[2048]' \
  STEPSERVE_WARMUP_BATCH=32 bench --side-by-side --peers mlx_lm.server --concurrency 1 8 32 --requests 4 \
    --max-tokens 128 --out-dir $R/sbs
  rm -rf $R/sbs/model-* 2>/dev/null; true
}
step warm 60
step a 120
step b 120
step bursts 100
step sbs 300
say "all steps done"
