#!/bin/bash
# Issue 37 on a machine with four GPUs (the device tool's nvidia-h100-x4 / nvidia-h200-x4), in
# calls of the device tool (each under its 10-minute limit), from the repository root, with
# .data (the SWE trees, benchmarks/README.md) and .whl (transformers 5.24 for the CPU zoo)
# carried:
#   a: scaling runs of benchmarks.multi_gpu on the same 8 SWE trees, 8 Qwen3-8B-shaped layers:
#      one GPU (GPU 0) and two (GPUs 1-2) at the same time, each on its own GPUs; the Gated
#      DeltaNet parts matrix (benchmarks.gdn_parts_check: FSDP2 / checkpointing / backends, one
#      process) on GPU 3; the first half of the zoo on the CPU (transformers 5.24)
#   b: the same scaling run on four GPUs, then the full-depth Qwen3-8B on four GPUs (budget
#      32,768, gradients reduce-scattered every micro-batch: H100 memory); the second half of
#      the zoo on the CPU
#   d: the scaling runs again after assign's largest_first order and plan_even (see the case)
#   c: benchmarks.distributed_check on two GPUs: the FSDP2 hybrid exactness case, the DDP one,
#      and the speed cases
#   e: c on GPUs 0-1 (no fla: the float32 exactness cases compare with HF's torch kernel); on
#      GPU 2 fla_check's float32 op level with TF32 products (TRITON_F32_DEFAULT=tf32: with
#      ieee no case finished in 540 s); on GPU 3 fla_check's model level in bf16 against the float32 oracle (fla from
#      .whl/fla, installed for these two jobs alone)
#   f: the full-depth Qwen3-8B on four GPUs again, after largest_first and plan_even
#   g: f with one timed step, then distributed_check's hybrid speed case on GPUs 0-1 (after
#      the fix for a second model's capture in one process)
#   h: f with a time limit that leaves packing a timed step (g's 240 s did not)
set -u
stage=$1
export PYTHONUNBUFFERED=1
DATA="--trees .data/swe200.jsonl --tasks 8 --max-sequence-tokens 200000"
SCALE="$DATA --layers 8 --budget 32768 --steps 2"
site() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/transformers-*.whl
}
zoo() {  # zoo <name> <extra args...>: on the CPU, transformers 5.24
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONPATH=/tmp/site:$PWD \
    timeout 560 python3 -m treefx.tools.zoo --timeout 240 "$@" > $OUT/zoo_$name.log 2>&1
  echo "zoo $name rc=$?"; tail -n 4 $OUT/zoo_$name.log
}
mg() {  # mg <name> <gpus> <n> <port> <seconds> <args...>
  local name=$1 gpus=$2 n=$3 port=$4 limit=$5; shift 5
  CUDA_VISIBLE_DEVICES=$gpus timeout $limit torchrun --nproc_per_node=$n --master_port=$port \
    -m benchmarks.multi_gpu "$@" --out $OUT/multi_gpu_$name.json > $OUT/mg_$name.log 2>&1
  echo "mg $name rc=$?"; grep -E "step|speed|bound|balance" $OUT/mg_$name.log | tail -n 12
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $stage in
a)
  site
  zoo half_a --jobs 20 --models "$(cat .whl/half_a)" --json $OUT/zoo_a.json \
    --out $OUT/zoo_a.md &
  mg l8_x1 0 1 29501 550 $SCALE --time-limit 420 &
  mg l8_x2 1,2 2 29502 550 $SCALE --time-limit 420 &
  (CUDA_VISIBLE_DEVICES=3 timeout 540 python3 -m benchmarks.gdn_parts_check \
     --out $OUT/gdn_parts_check.json > $OUT/gdn.log 2>&1
   echo "gdn rc=$?"; grep -A40 "worst scaled" $OUT/gdn.log | head -n 12) &
  wait
  ;;
b)
  site
  zoo half_b --jobs 20 --models "$(cat .whl/half_b)" --json $OUT/zoo_b.json \
    --out $OUT/zoo_b.md &
  mg l8_x4 0,1,2,3 4 29501 250 $SCALE --time-limit 170
  mg 8b_x4 0,1,2,3 4 29502 330 $DATA --shape qwen3-8b \
    --budget 32768 --steps 2 --grad-sync every --time-limit 260
  wait
  ;;
d)  # scaling again with assign(order="largest_first") and plan_even (treefx.backward): one GPU
    # (treefx alone: the step whose share of linear the others are) on GPU 0, two on GPUs 1-2,
    # fla_check's op level on GPU 3 at the same time; then four GPUs
  RES=$OUT; OUT=/tmp/d; mkdir -p $OUT
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/fla/*.whl
  mg l8_x1 0 1 29501 200 $SCALE --methods treefx --time-limit 150 &
  mg l8_x2 1,2 2 29502 260 $SCALE --time-limit 220 &
  (CUDA_VISIBLE_DEVICES=3 timeout 250 python3 -m benchmarks.fla_check --cases op \
     --out $OUT/fla_op.json > $OUT/fla_op.log 2>&1; echo "fla op rc=$?"; tail -n 8 $OUT/fla_op.log) &
  wait
  mg l8_x4 0,1,2,3 4 29503 260 $SCALE --time-limit 200
  tar czf $RES/x4d.tgz -C $OUT .
  ;;
e)
  RES=$OUT; OUT=/tmp/e; mkdir -p $OUT
  python3 -m pip uninstall -q -y fla-core flash-linear-attention 2>/dev/null  # an earlier stage's
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla \
    .whl/fla/*.whl
  (CUDA_VISIBLE_DEVICES=0,1 timeout 570 torchrun --nproc_per_node=2 --master_port=29505 \
     -m benchmarks.distributed_check --time-limit 470 --out $OUT/distributed_check.json \
     > $OUT/dc.log 2>&1
   echo "distributed_check rc=$?"; grep -E "verdict|PASS|FAIL|step|bound" $OUT/dc.log | tail -n 20) &
  (CUDA_VISIBLE_DEVICES=2 PYTHONPATH=/tmp/fla TRITON_F32_DEFAULT=tf32 timeout 570 \
     python3 -m benchmarks.fla_check --cases op --op-dtypes float32 \
     --out $OUT/fla_op_f32_tf32.json > $OUT/fla_op_f32_tf32.log 2>&1
   echo "fla op float32 (tf32) rc=$?"; grep -E "^\[|total" $OUT/fla_op_f32_tf32.log | cut -c1-300) &
  (CUDA_VISIBLE_DEVICES=3 PYTHONPATH=/tmp/fla timeout 570 python3 -m benchmarks.fla_check \
     --cases model --model-dtypes bfloat16 --out $OUT/fla_model.json > $OUT/fla_model.log 2>&1
   echo "fla model rc=$?"; grep -E "^\[|total" $OUT/fla_model.log | cut -c1-400) &
  wait
  tar czf $RES/x4e.tgz -C $OUT .
  ;;
f)
  mg 8b_x4 0,1,2,3 4 29502 540 $DATA --shape qwen3-8b \
    --budget 32768 --steps 2 --grad-sync every --time-limit 460
  ;;
g)
  RES=$OUT; OUT=/tmp/g; mkdir -p $OUT
  mg 8b_x4 0,1,2,3 4 29502 320 $DATA --shape qwen3-8b \
    --budget 32768 --steps 1 --grad-sync every --time-limit 240
  CUDA_VISIBLE_DEVICES=0,1 timeout 170 torchrun --nproc_per_node=2 --master_port=29506 \
    -m benchmarks.distributed_check --cases fsdp-hybrid-speed --time-limit 150 \
    --out $OUT/distributed_check_hybrid_speed.json > $OUT/dc_hybrid_speed.log 2>&1
  echo "distributed_check hybrid speed rc=$?"
  grep -E "treefx:|packing:|share|verdict" $OUT/dc_hybrid_speed.log | cut -c1-300
  tar czf $RES/x4g.tgz -C $OUT .
  ;;
h)
  mg 8b_x4 0,1,2,3 4 29502 560 $DATA --shape qwen3-8b \
    --budget 32768 --steps 1 --grad-sync every --time-limit 420
  ;;
c)
  CUDA_VISIBLE_DEVICES=0,1 timeout 560 torchrun --nproc_per_node=2 \
    -m benchmarks.distributed_check --time-limit 420 --out $OUT/distributed_check.json \
    > $OUT/dc.log 2>&1
  echo "distributed_check rc=$?"; grep -E "verdicts|PASS|FAIL" $OUT/dc.log
  ;;
esac
