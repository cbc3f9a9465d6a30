#!/usr/bin/env bash
# Issue 13's GPU measurement (scratch): 32 streams, 0 then 8 constrained (response_format), same server.
set -uo pipefail
source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx
mkdir -p "$MLX_PTX_CACHE_DIR"
R=$OUT/issue13; mkdir -p $R
python3 -m service.cli serve --port 8200 --batch-buckets '[1,2,4,8,16,32]' --capacity-buckets '[1024,2048]' \
  --warmup-batch 32 > $R/server.log 2>&1 &
PID=$!
t0=$(date +%s)
until curl -sf localhost:8200/readyz >/dev/null; do sleep 1; kill -0 $PID || { tail -30 $R/server.log; exit 1; }; done
echo "ready after $(( $(date +%s) - t0 )) s"; grep "warm-up done" $R/server.log
B="python3 -m service.cli bench --url http://127.0.0.1:8200 --api openai --concurrency 32 --requests 3 --max-tokens 128 --warmup-requests 1"
for k in 0 8 0 8 0 8; do
  $B --constrained $k --out $R/constrained-$k-$(date +%s).json 2>&1 | grep -E "aggregate|mask_host|constrained_streams|32 " | head -5
done
kill $PID; wait $PID
ls $R
