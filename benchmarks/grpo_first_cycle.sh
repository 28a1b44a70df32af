#!/bin/bash
# Issue 65 (TRL's first cycle): benchmarks.grpo on one GPU in one call of the device tool (under
# its 10-minute limit), from the repository root, `.whl/grpo` carried (TRL 1.16.0 and datasets,
# benchmarks/README.md): `bash benchmarks/grpo_first_cycle.sh a`.
# Stage a:
#   1. both paths at the settings (Qwen3-1.7B shape, 28 layers, G = 8, bf16, gradient
#      checkpointing, num_iterations=2, beta=0.04) with the tree trainer's defaults (TRL's row
#      shuffle, --row-shuffle), empty compile caches: $OUT/grpo_a.json
#   2. the treefx path alone with whole groups kept in micro-batches (keep_groups_together=True,
#      the setting of the runs of 2026-11-26), empty compile caches: $OUT/grpo_g.json
# Stage b: the treefx path alone with what issue 65 added switched off (TREEFX_WIDE_INDEXING=0:
#   the output layer indexed in 32 bits under a guard the next micro-batch may fail;
#   TREEFX_SHARE_TWINS=0: the reference model captures and compiles its own graph), the first
#   cycle only, empty compile caches: $OUT/grpo_b.json
set -u
export PYTHONUNBUFFERED=1
stage=${1:-a}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/grpo/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
run() {  # run <name> <seconds> <args...>: a fresh process, empty compile caches
  local name=$1 limit=$2; shift 2
  local dir; dir=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$dir/inductor TRITON_CACHE_DIR=$dir/triton timeout "$limit" \
    python3 -m benchmarks.grpo "$@" --out "$OUT/grpo_$name.json" > "$OUT/grpo_$name.log" 2>&1
  echo "grpo $name rc=$?"
  grep -E "^\[|^\||comparison|FAILED|Error" "$OUT/grpo_$name.log" | grep -v "Loading weights" \
    | cut -c1-400 | tail -n 16
}
case $stage in
  a)
    run a 320 --row-shuffle
    run g 200 --paths treefx
    ;;
  b)
    TREEFX_WIDE_INDEXING=0 TREEFX_SHARE_TWINS=0 run b 170 --paths treefx --warmup 0 --cycles 0
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
