#!/usr/bin/env bash
# GPU run 27 (2026-11-26): gather.py (what it times: its docstring). From the repository root,
# after run 26 on the same host: bash docs/results/h100/run27/run.sh
set -uo pipefail
RUN=run27
source docs/results/h100/lib.sh
step_gather() { timeout "$(left)" python3 docs/results/h100/run27/gather.py > "$R/gather.txt" 2>&1; tail -30 "$R/gather.txt"; }
step gather 90
say "all steps done"
