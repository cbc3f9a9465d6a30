#!/usr/bin/env bash
# GPU run 20 (2026-11-26): the prefix workload on a model where a cold prefill is not cheap. On the
# 135M default model a cold 1,545-token prefill takes about 30 ms and HTTP and tokenizing about 14 ms
# of a hit's TTFT (runs 17-19), so the ratio (<= 0.3x) has little room. Here the same
# workload runs on a model of Llama 3.2 1B's shape (random weights, 4-bit, the default model's
# tokenizer: scale_model.py), cache on and off on fresh servers, 8 streams and 1.
# From the repository root: bash docs/results/h100/run20/run.sh
set -uo pipefail
RUN=run20
source docs/results/h100/lib.sh
M=$HOME/model-1b
BASE=(--model "$M" --batch-buckets '[1,8,32]' --prompt-buckets '[64,256,512]' --capacity-buckets '[2048]' --warmup-batch 32)
OFF=("${BASE[@]}" --prefix-cache-bytes 0)
step_model() {
  python3 -m service.cli convert "$STAGED_GGUF" "$HOME/conv" --dtype float16 > /dev/null &&
    python3 docs/results/h100/run20/scale_model.py "$HOME/conv" "$M"
}
step_warm() { start warm 8090 "${BASE[@]}" && stop; }
step_p1() { prefix_level on8-1 8101 8 3 "${BASE[@]}" && prefix_level off8-1 8102 8 3 "${OFF[@]}"; }
step_p2() { prefix_level off8-2 8103 8 3 "${OFF[@]}" && prefix_level on8-2 8104 8 3 "${BASE[@]}"; }
step_c1() { prefix_level on1 8105 1 8 "${BASE[@]}" && prefix_level off1 8106 1 8 "${OFF[@]}"; }
step model 60
step warm 400
step p1 90
step p2 90
step c1 90
say "all steps done"
