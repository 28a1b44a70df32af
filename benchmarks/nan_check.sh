#!/bin/bash
# Gemma 4 (the zoo's gemma4_unified) through Inductor on one GPU: the first-call check finds
# its RMSNorm weights' gradients non-finite (models.md). One call of the device tool, from the
# repository root, on a bare machine (no wheels needed); each variant is its own process:
#   z52a: benchmarks.nan_probe --grads --regional --dtype float32 with
#         split_reductions=False (whole graph and regional); interleave_heads=False;
#         triton.persistent_reductions=False; nan_asserts=True (the first kernel writing a
#         NaN/inf raises, naming its buffer) with Inductor's output code kept (gzip)
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
