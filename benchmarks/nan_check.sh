#!/bin/bash
# Gemma 4 (the zoo's gemma4_unified) through Inductor on one GPU: the first-call check finds
# its RMSNorm weights' gradients non-finite (models.md). One call of the device tool, from the
# repository root, on a bare machine (no wheels needed); each variant is its own process:
#   z52a: benchmarks.nan_probe --grads --regional --dtype float32 with
#         split_reductions=False (whole graph and regional); interleave_heads=False;
#         triton.persistent_reductions=False; nan_asserts=True (the first kernel writing a
#         NaN/inf raises, naming its buffer) with Inductor's output code kept (gzip). The
#         code showed the cause: a mix-order reduction (pytorch/pytorch#195845)
#   z52b: after treefx turned mix-order reductions off: the same probe as shipped (whole
#         graph and regional), then benchmarks.gpu_check --cases families for Gemma 4 and
#         the families whose norms or states differ most
#   z52c: the step at Qwen3-8B-shaped layers x4 (FlexAttention: no wheels here) with
#         mix-order reductions off (as shipped) and on (TREEFX_MIX_ORDER_REDUCTION=1),
#         alternated twice, first-call check off, the compile caches shared; then
#         benchmarks.gpu_check --cases families for Gemma 4 (z52b's run of it reached its time
#         limit before writing its JSON; the case now prints each family's results)
#   z52d: benchmarks.gpu_check --cases qwen3-fp32,qwen3-bf16,small-trees,regional with
#         mix-order reductions off (every model's compile changed): Qwen3 against the oracle
set -u
export PYTHONUNBUFFERED=1
probe() {  # probe <name> <seconds> [env...] -- <nan_probe args>
  local name=$1 limit=$2; shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" timeout $limit python3 -m benchmarks.nan_probe --model gemma4_unified \
    --grads --regional --dtype float32 "$@" > $OUT/nan_$name.log 2>&1
  echo "== $name rc=$?"; grep -E "verify|non-finite|Error|assert|inductor config" \
    $OUT/nan_$name.log | cut -c1-700 | tail -n 8
}
if [ "${1:-}" = z52a ]; then
  probe split 240 X=1 -- --inductor split_reductions=False
  probe nointerleave 150 X=1 -- --only-regional --no-interleave
  probe persistent 150 X=1 -- --only-regional --inductor triton.persistent_reductions=False
  probe asserts 180 TORCH_LOGS=output_code -- --only-regional --inductor nan_asserts=True
  gzip -f $OUT/nan_asserts.log
fi
if [ "${1:-}" = z52b ]; then
  probe shipped 240 X=1 --
  TREEFX_FAMILIES=gemma4_unified,gemma4_text,qwen3_5_moe,nemotron_h,gemma2,jamba,qwen3-flex \
    timeout 330 python3 -m benchmarks.gpu_check --cases families \
    --out $OUT/gpu_check_families_z52b.json > $OUT/gpu_check_families_z52b.log 2>&1
  echo "== families rc=$?"; sed '/pow_by_natural/d' $OUT/gpu_check_families_z52b.log | \
    cut -c1-300 | tail -n 40
fi
if [ "${1:-}" = z52c ]; then
  SHAPE="--hidden 4096 --heads 32 --kv-heads 8 --vocab 151936 --por 0.75 --stream 0 --mask-reps 0"
  dir=$(mktemp -d)
  for run in off1 on1 off2 on2; do
    mix=0; case $run in on*) mix=1;; esac
    TREEFX_MIX_ORDER_REDUCTION=$mix TREEFX_VERIFY=0 TORCHINDUCTOR_CACHE_DIR=$dir/inductor \
      TRITON_CACHE_DIR=$dir/triton timeout 200 python3 -m benchmarks.e2e $SHAPE --layers 4 \
      --warmup 2 --reps 5 --methods treefx --out $OUT/e2e_mix_$run.json \
      > $OUT/e2e_mix_$run.log 2>&1
    echo "== $run rc=$?"; grep -E "treefx|FAILED|bf16 matmul" $OUT/e2e_mix_$run.log | tail -n 4
  done
  TREEFX_FAMILIES=gemma4_unified,gemma4_text timeout 200 python3 -m benchmarks.gpu_check \
    --cases families --out $OUT/gpu_check_families_z52c.json \
    > $OUT/gpu_check_families_z52c.log 2>&1
  echo "== families rc=$?"; grep -E "^  " $OUT/gpu_check_families_z52c.log | cut -c1-400
fi
if [ "${1:-}" = z52d ]; then
  timeout 390 python3 -m benchmarks.gpu_check --cases qwen3-fp32,qwen3-bf16,small-trees,regional \
    --out $OUT/gpu_check_z52d.json > $OUT/gpu_check_z52d.log 2>&1
  echo "== gpu_check rc=$?"; grep -E "^[a-z0-9-]+: (ok|FAILED)|^  " $OUT/gpu_check_z52d.log | cut -c1-300
  sed -i '/pow_by_natural/d' $OUT/gpu_check_z52d.log
fi
