#!/usr/bin/env bash
# GPU run 24 (2026-11-26): run 21 again on the code after ed7573f (a hit's staging cache in buffers of its
# own): what the first hit still waits for (run 23: 35 and 56 ms against 9-14).
# It ran run 21's script under its own name, the kernel cache carried:
#   bash docs/results/h100/run24/run.sh
RUN=run24 WARM_S=30 exec bash docs/results/h100/run21/run.sh
