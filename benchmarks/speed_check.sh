#!/bin/bash
# Issue 36 (speed where users feel it) on a machine with four GPUs, one job per GPU at the same
# time, in one call of the device tool (under its 10-minute limit), from the repository root.
# Every e2e run: Qwen3-8B-shaped layers (hidden 4096, 32 heads, 8 KV heads, head_dim 128,
# intermediate 12288, vocab 151,936), bf16, the POR 0.75 agent tree; its JSON and log in $OUT.
#   GPU 0, first steps in fresh processes with empty compile caches (TORCHINDUCTOR_CACHE_DIR,
#     TRITON_CACHE_DIR): 4 layers with the default treefx.compile (first-call check on), the
#     same with regional=True, the default with the check off (TREEFX_VERIFY=0)
#   GPU 1, the step of each path in one process: treefx (whole graph), regional, logits=False,
#     @treefx.step's fused loss, packing; model FLOP/s against the matmul rate measured there
#   GPU 2, the output layer's paths (benchmarks.logprobs --paths), then 36 layers (a quarter
#     of the tree) regional and whole-graph, first steps with empty caches
#   GPU 3, $GPU3 if set (another benchmark's command line, run as is)
set -u
export PYTHONUNBUFFERED=1
SHAPE="--hidden 4096 --heads 32 --kv-heads 8 --vocab 151936 --por 0.75 --stream 0 --mask-reps 0"
cold() {  # cold <name> <gpu> <seconds> <e2e args...>: a fresh process, empty compile caches
  local name=$1 gpu=$2 limit=$3; shift 3
  local dir; dir=$(mktemp -d)
  CUDA_VISIBLE_DEVICES=$gpu TORCHINDUCTOR_CACHE_DIR=$dir/inductor \
    TRITON_CACHE_DIR=$dir/triton timeout $limit python3 -m benchmarks.e2e $SHAPE "$@" \
    --out $OUT/e2e_$name.json > $OUT/e2e_$name.log 2>&1
  echo "e2e $name rc=$?"; grep -E "^hidden|FAILED|bf16 matmul" $OUT/e2e_$name.log | tail -n 8
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cold first_default 0 170 --layers 4 --methods treefx --warmup 1 --reps 3
 cold first_regional 0 170 --layers 4 --methods treefx_regional --warmup 1 --reps 3
 TREEFX_VERIFY=0 cold first_noverify 0 170 --layers 4 --methods treefx --warmup 1 \
   --reps 3) &
(cold steps 1 560 --layers 4 --warmup 2 --reps 5 --budget 520 \
   --methods treefx,treefx_regional,treefx_nologits,treefx_step,packed) &
(CUDA_VISIBLE_DEVICES=2 timeout 150 python3 -m benchmarks.logprobs --paths 17187,35530 --reps 5 \
   --out $OUT/logprobs_paths.json > $OUT/logprobs_paths.log 2>&1
 echo "logprobs rc=$?"; grep -E "x the materialized|tokens " $OUT/logprobs_paths.log | tail -n 14
 cold l36_regional 2 200 --layers 36 --scale 0.25 --methods treefx_regional \
   --warmup 1 --reps 3
 cold l36_whole 2 200 --layers 36 --scale 0.25 --methods treefx_whole --warmup 1 \
   --reps 3) &
if [ -n "${GPU3:-}" ]; then
  (CUDA_VISIBLE_DEVICES=3 timeout 560 bash -c "$GPU3" > $OUT/gpu3.log 2>&1
   echo "gpu3 rc=$?"; tail -n 30 $OUT/gpu3.log) &
fi
wait
