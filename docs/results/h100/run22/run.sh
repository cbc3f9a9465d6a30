#!/usr/bin/env bash
# GPU run 22 (2026-11-26): run 21's py-spy (native frames) put the first prefix hit's extra time in
# cuDNN building an attention graph (cudnn_frontend, its NVRTC-compiled engines) while the hit's
# first token was evaluated. layout.py asks whether the hit's staging cache (the prefix cache's
# gather) is what differs from the warm-up's. From the repository root:
#   bash docs/results/h100/run22/run.sh
set -uo pipefail
RUN=run22
source docs/results/h100/lib.sh
step_layout() { timeout "$(left)" python3 docs/results/h100/run22/layout.py 2>&1 | tee "$R/layout.txt" | tail -4; }
step_layout2() { timeout "$(left)" python3 docs/results/h100/run22/layout.py 2>&1 | tee "$R/layout2.txt" | tail -4; }
step layout 120
step layout2 120
say "all steps done"
