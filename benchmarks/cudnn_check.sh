#!/bin/bash
# Tree attention on cuDNN's interval-mask kernels (treefx/ops/attention/intervals.py) on one
# GPU, in calls of the device tool, from the repository root. The frontend and the CuTe DSL it
# compiles with are not on the GPU machine and their wheels (cp312: nvidia-cudnn-frontend
# 1.32.0, nvidia-cutlass-dsl 4.8.1 with -libs-base, -libs-core, -libs-cu13, apache-tvm-ffi,
# cuda-python, cuda-bindings, cuda-core, cuda-pathfinder, protobuf; 126 MB) are over one
# call's 64 MiB, so they travel as a tar cut in three (`tar cf w.tar *.whl; split -b 42M`),
# one piece in .whl per call, each call `bash benchmarks/cudnn_check.sh stage` (the machine
# keeps /tmp while it stays warm); the third installs them into /tmp/site. Then:
#   z48a: benchmarks.gpu_check --cases intervals (exactness, the op and Qwen3 in bf16);
#         benchmarks.chain_attention (the attention alone: cuDNN's against treefx's site);
#         e2e at Qwen3-8B-shaped layers x4 (vocab 151,936, the POR 0.75 tree), treefx beside
#         packing, first-call check on, empty compile caches, --profile
#   z48c: benchmarks.gpu_check --cases intervals again (z48a's comparison with FlexAttention
#         traced the site with Dynamo, which it does not take; now as treefx lowers it)
#   z48d: first steps in fresh processes with empty caches, cuDNN's kernels compiled on a
#         thread while the compiler worked (a warm-up tried in ab20794 and taken out: the first step
#         took 49.3 s against 33.3 s with the kernels off on that host), then off
#   z48b: the same e2e shape, treefx, logits=False and @treefx.step on cuDNN's kernels, then
#         treefx with them off (TREEFX_CUDNN_ATTENTION=0) on the same host
set -u
export PYTHONUNBUFFERED=1
SHAPE="--hidden 4096 --heads 32 --kv-heads 8 --vocab 151936 --por 0.75 --stream 0 --mask-reps 0"
site() { export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages; }
if [ "${1:-}" = stage ]; then
  mkdir -p /tmp/stage && cp .whl/* /tmp/stage/ && ls /tmp/stage
  if [ "$(ls /tmp/stage/wpart_* 2>/dev/null | wc -l)" = 3 ]; then
    (cd /tmp/stage && cat wpart_* > w.tar && tar xf w.tar && rm -f wpart_* w.tar) &&
      rm -rf /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target /tmp/site /tmp/stage/*.whl
    site; python3 -c "import cudnn.flex_attention, cudnn; print('frontend', cudnn.__version__)"
  fi
fi
cold() {  # cold <name> <seconds> <e2e args...>: a fresh process, empty compile caches (or
  # those in $CACHE when set: a restart with the caches an earlier run left)
  local name=$1 limit=$2; shift 2
  local dir=${CACHE:-}; [ -n "$dir" ] || dir=$(mktemp -d)
  TORCHINDUCTOR_CACHE_DIR=$dir/inductor TRITON_CACHE_DIR=$dir/triton \
    FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=$dir/cute timeout $limit python3 -m benchmarks.e2e \
    $SHAPE "$@" --out $OUT/e2e_$name.json > $OUT/e2e_$name.log 2>&1
  echo "e2e $name rc=$?"; sed -i '/pow_by_natural/d' $OUT/e2e_$name.log
  grep -E "treefx|packed|FAILED|bf16 matmul" $OUT/e2e_$name.log | tail -n 14
}
if [ "${1:-}" = z48a ]; then
  site
  timeout 150 python3 -m benchmarks.gpu_check --cases intervals \
    --out $OUT/gpu_check_intervals_z48a.json > $OUT/gpu_check_intervals_z48a.log 2>&1
  echo "gpu_check rc=$?"; grep -iE "passed|failed|error" $OUT/gpu_check_intervals_z48a.log | head -20
  timeout 120 python3 -m benchmarks.chain_attention --seeds 0 \
    --out $OUT/chain_attention_z48a.json > $OUT/chain_attention_z48a.log 2>&1
  echo "chain_attention rc=$?"; grep "^seed\|nfunc" $OUT/chain_attention_z48a.log | cut -c1-400
  cold z48a 300 --layers 4 --warmup 2 --reps 5 --profile --methods treefx,packed
fi
if [ "${1:-}" = z48c ]; then
  site
  timeout 150 python3 -m benchmarks.gpu_check --cases intervals \
    --out $OUT/gpu_check_intervals_z48c.json > $OUT/gpu_check_intervals_z48c.log 2>&1
  echo "gpu_check rc=$?"; grep -iE "passed|failed|error" $OUT/gpu_check_intervals_z48c.log | head -20
fi
if [ "${1:-}" = z48d ]; then
  site
  cold z48d_on 200 --layers 4 --warmup 2 --reps 5 --methods treefx
  TREEFX_CUDNN_ATTENTION=0 cold z48d_off 200 --layers 4 --warmup 2 --reps 5 --methods treefx
fi
#   z48e: a restarted job: 4 layers in a fresh process with empty caches, then again with the
#         caches it left (Inductor's, Triton's and the frontend's kernels); then 36 layers
#         (regional, a quarter of the tree), treefx and logits=False, empty caches
if [ "${1:-}" = z48e ]; then
  site
  CACHE=$(mktemp -d) && export CACHE
  cold z48e_first 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  cold z48e_restart 120 --layers 4 --warmup 1 --reps 3 --methods treefx
  unset CACHE
  cold z48e_l36 240 --layers 36 --scale 0.25 --warmup 1 --reps 3 --methods treefx,treefx_nologits
fi
if [ "${1:-}" = z48b ]; then
  site
  cold z48b_on 330 --layers 4 --warmup 2 --reps 5 --methods treefx,treefx_nologits,treefx_step
  TREEFX_CUDNN_ATTENTION=0 cold z48b_off 200 --layers 4 --warmup 2 --reps 5 --methods treefx
fi
# Stage z49: parts of a tree on the op (treefx.backward: a part's keys are its context's path
# then its own rows, as intervals) and the kernels compiled in a second process while the
# compiler works (treefx/ops/attention/interval_warmup.py).
#   z49c (in the third `stage` call: `bash benchmarks/cudnn_check.sh stage && bash
#         benchmarks/cudnn_check.sh z49c`): a first step (4 layers, empty caches) without the
#         warm-up process (TREEFX_CUDNN_WARMUP=0), then with it, same host
#   z49a (carry .data/swe200.jsonl, made as BENCHMARKS.md's real agent trajectories say):
#         benchmarks.gpu_check --cases intervals (now with the op over a part's context, and
#         Qwen3 in parts against the whole tree and the float32 oracle), then speed_check's
#         parts of 16,384 tokens on the seven SWE trees, on the op
#   z49b (carry the same): the seven trees with the op off (FlexAttention with the trunk
#         split, the default without the frontend), same host
parts16k_here() {  # speed_check.sh's parts16k (its functions in a subshell: its cold differs)
  (source benchmarks/speed_check.sh functions; parts16k "$@")
}
if [ "${1:-}" = z49c ]; then
  site
  TREEFX_CUDNN_WARMUP=0 cold z49c_nowarm 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  cold z49c_warm 150 --layers 4 --warmup 1 --reps 3 --methods treefx
fi
if [ "${1:-}" = z49a ]; then
  site
  timeout 170 python3 -m benchmarks.gpu_check --cases intervals \
    --out $OUT/gpu_check_intervals_z49a.json > $OUT/gpu_check_intervals_z49a.log 2>&1
  echo "gpu_check rc=$?"; grep -iE "passed|failed|error" $OUT/gpu_check_intervals_z49a.log | head -20
  parts16k_here z49a_parts16k_intervals 280
fi
if [ "${1:-}" = z49b ]; then
  site
  TREEFX_CUDNN_ATTENTION=0 parts16k_here z49b_parts16k_off 280
fi
#   z49e: where the first step's extra time goes with the frontend: importing it; the warm-up
#         child alone with an empty kernel cache, then again with the kernels it left; then the
#         op's first plan, forward and backward on the e2e tree's length in a fresh process
#         with those kernels on disk (python -X importtime not used: wall clock per stage)
if [ "${1:-}" = z49e ]; then
  site
  export FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=$(mktemp -d)
  W=treefx/ops/attention/interval_warmup.py
  timed() { local s=$(date +%s%N); "${@:2}"; echo "$1: $(( ($(date +%s%N) - s) / 1000000 )) ms"; }
  timed "import torch" python3 -c "import torch"
  timed "import torch and the frontend" python3 -c "import torch, cudnn.flex_attention.execution"
  timed "the child, empty cache" python3 $W bfloat16 32 8 128 128 0
  timed "the child, its kernels on disk" python3 $W bfloat16 32 8 128 128 0
  python3 - <<'PY'
import time, torch
t0 = time.perf_counter()
from treefx.ops.attention import intervals
from benchmarks.real_trees import comb_tree
import treefx
t1 = time.perf_counter()
b = treefx.pack([comb_tree(s, 1000, 30, 0.3) for s in range(8)])
par = b.parent_token.cuda()
n = b.num_tokens
q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
for i in range(3):
    torch.cuda.synchronize(); a = time.perf_counter()
    out = intervals.tree_interval_attention(q, k, v, par)
    torch.cuda.synchronize(); f = time.perf_counter()
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize(); g = time.perf_counter()
    print(f"tokens {n} call {i}: forward (plan, kernels) {f - a:.2f} s, backward {g - f:.2f} s", flush=True)
print(f"imports {t1 - t0:.2f} s")
PY
fi
#   z49f (in the third `stage` call, after z49e's findings: the frontend's import took 4.7 s
#         in the passes, before the child started, and the child's kernels were not ready when
#         the op first ran; now the op imports the frontend and the child starts first): the
#         first step (4 layers, empty caches, first-call check on) with FlexAttention, with the
#         frontend as shipped, and without the warm-up process, same host
if [ "${1:-}" = z49f ]; then
  site
  TREEFX_CUDNN_ATTENTION=0 cold z49f_flex 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  cold z49f_cudnn 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  TREEFX_CUDNN_WARMUP=0 cold z49f_nowarm 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  TREEFX_VERIFY=0 cold z49f_cudnn_nocheck 150 --layers 4 --warmup 1 --reps 3 --methods treefx
fi
#   z49g (two GPUs, in the third `stage` call there): DDP on the op. distributed_check's
#         ddp-speed case (Qwen3-1.7B's layers x8, bf16, synthetic agent trees of POR 0.8, whole
#         trees; packing through the same compiled model, whose chains also run on the op),
#         then the same with the op off (TREEFX_CUDNN_ATTENTION=0); every rank starts its own
#         warm-up process on its GPU
if [ "${1:-}" = z49g ]; then
  site
  for mode in on off; do
    if [ $mode = off ]; then export TREEFX_CUDNN_ATTENTION=0; fi
    timeout 280 torchrun --nproc_per_node=2 -m benchmarks.distributed_check --cases ddp-speed \
      --time-limit 240 --out $OUT/distributed_check_ddp_speed_z49g_$mode.json \
      > $OUT/distributed_check_ddp_speed_z49g_$mode.log 2>&1
    echo "ddp-speed $mode rc=$?"; sed -i '/pow_by_natural/d' $OUT/distributed_check_ddp_speed_z49g_$mode.log
    grep -E "treefx:|packing:|speedup|passed|Error|error" $OUT/distributed_check_ddp_speed_z49g_$mode.log | tail -n 8 | cut -c1-600
  done
  unset TREEFX_CUDNN_ATTENTION
fi
#   z49h (in the third `stage` call): 36 layers (regional, a quarter of the tree), the first
#         step with empty caches, on cuDNN's kernels as shipped, then with FlexAttention's
#         sites (TREEFX_CUDNN_ATTENTION=0), same host (issue 36: at most 45 s)
if [ "${1:-}" = z49h ]; then
  site
  cold z49h_l36_cudnn 200 --layers 36 --scale 0.25 --warmup 1 --reps 3 --methods treefx
  TREEFX_CUDNN_ATTENTION=0 cold z49h_l36_flex 200 --layers 36 --scale 0.25 --warmup 1 --reps 3 \
    --methods treefx
fi
#   z49i (in the third `stage` call): the kernels' second process started before Dynamo's
#         trace, from the model's config (treefx.ops.attention.intervals.warm_up_model); the
#         first steps with empty caches of 4 and 36 layers on cuDNN's kernels, then both with
#         FlexAttention's sites, same host
if [ "${1:-}" = z49i ]; then
  site
  cold z49i_cudnn 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  cold z49i_l36_cudnn 200 --layers 36 --scale 0.25 --warmup 1 --reps 3 --methods treefx
  TREEFX_CUDNN_ATTENTION=0 cold z49i_flex 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  TREEFX_CUDNN_ATTENTION=0 cold z49i_l36_flex 200 --layers 36 --scale 0.25 --warmup 1 --reps 3 \
    --methods treefx
fi
#   z49j (carry .data/swe200.jsonl): z42's run on the interval kernels, then off, same host:
#         its first 7 SWE tasks, budget 65,536, treefx and packing (packing's document mask
#         runs on the same kernels: both sides change), 3 timed treefx steps after 2 warm-ups;
#         the time limit (what device time was left) let each finish its first task only
if [ "${1:-}" = z49j ]; then
  site
  for mode in on off; do
    if [ $mode = off ]; then export TREEFX_CUDNN_ATTENTION=0; fi
    OMP_NUM_THREADS=1 TREEFX_VERIFY=0 timeout 150 python3 -m benchmarks.real_trees \
      --trees .data/swe200.jsonl --sample 40 --seed 0 --budget 65536 --slice 0:7 \
      --methods treefx,packing --warmup 2 --reps 3 --time-limit 130 \
      --out $OUT/real_trees_swe1_z49j_$mode.json > $OUT/real_trees_swe1_z49j_$mode.log 2>&1
    echo "z49j $mode rc=$?"; sed -i '/pow_by_natural/d' $OUT/real_trees_swe1_z49j_$mode.log
    grep "tasks\|share\|speed" $OUT/real_trees_swe1_z49j_$mode.log | tail -n 4 | cut -c1-300
  done
  unset TREEFX_CUDNN_ATTENTION
fi
# Stage z50 (2026-11-28; the wheels staged again: three `stage` calls)
#   z50a (in the third `stage` call): the interval op's host time per call against its GPU
#         time (benchmarks.interval_host: the e2e profile's host gaps name the op), gpu_check's
#         intervals and families cases after 1cef588 (mask lifting: filled tensors, masks that
#         see later keys, data read by index), then e2e at 4 layers with --profile, treefx alone
#   z50b (carry .data/swe200.jsonl): z42's protocol on the interval kernels, both sides (14
#         SWE tasks, budget 65,536, 7 timed treefx steps after 2 warm-ups, one CPU thread,
#         first-call checks off): the share of the token-count bound with the cudnn extra
if [ "${1:-}" = z50a ]; then
  site
  timeout 90 python3 -m benchmarks.interval_host --out $OUT/interval_host_z50a.json \
    > $OUT/interval_host_z50a.log 2>&1
  echo "interval_host rc=$?"; tail -n 8 $OUT/interval_host_z50a.log
  timeout 200 python3 -m benchmarks.gpu_check --cases intervals,families \
    --out $OUT/gpu_check_z50a.json > $OUT/gpu_check_z50a.log 2>&1
  echo "gpu_check rc=$?"; grep -iE "passed|failed|error" $OUT/gpu_check_z50a.log | head -20
  cold z50a 150 --layers 4 --warmup 2 --reps 5 --profile --methods treefx
fi
if [ "${1:-}" = z50b ]; then
  site
  OMP_NUM_THREADS=1 TREEFX_VERIFY=0 timeout 560 python3 -m benchmarks.real_trees \
    --trees .data/swe200.jsonl --sample 40 --seed 0 --budget 65536 --slice 0:14 \
    --methods treefx,packing --warmup 2 --reps 7 --time-limit 520 \
    --out $OUT/real_trees_swe14_z50b_intervals.json > $OUT/real_trees_swe14_z50b_intervals.log 2>&1
  echo "z50b rc=$?"; sed -i '/pow_by_natural/d' $OUT/real_trees_swe14_z50b_intervals.log
  grep "tasks\|share\|slower" $OUT/real_trees_swe14_z50b_intervals.log | tail -n 4 | cut -c1-300
fi
# Stage z51 (2026-11-28; the wheels staged again: three `stage` calls)
#   z51a (in the third `stage` call): the input embedding's gradient, ATen's kernel against
#         Inductor's decomposition (benchmarks.embedding_grad); the interval op's host time
#         with a new row's plan (interval_host's plan_build); the warm-up children alone with
#         empty kernel caches, one process for all kernels, then the forward's and the
#         backward's side by side; then first steps (4 layers, empty caches, check on) with
#         two warm-up processes (the new default; the first profiled, z50a's protocol) and
#         with one (TREEFX_CUDNN_WARMUP_PROCESSES=1), alternated, same host
if [ "${1:-}" = z51a ]; then
  site
  timeout 60 python3 -m benchmarks.embedding_grad --out $OUT/embedding_grad_z51a.json \
    > $OUT/embedding_grad_z51a.log 2>&1
  echo "embedding_grad rc=$?"; tail -n 3 $OUT/embedding_grad_z51a.log
  timeout 90 python3 -m benchmarks.interval_host --out $OUT/interval_host_z51a.json \
    > $OUT/interval_host_z51a.log 2>&1
  echo "interval_host rc=$?"; tail -n 6 $OUT/interval_host_z51a.log
  W=treefx/ops/attention/interval_warmup.py
  ms() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }
  export FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
  s=$(date +%s%N)
  FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=$(mktemp -d) python3 $W forward,backward bfloat16 32 8 128 128 0 \
    > $OUT/warmup_one_z51a.log 2>&1
  echo "one child, all kernels: rc=$? $(ms $s) ms"
  D=$(mktemp -d); s=$(date +%s%N)
  FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=$D python3 $W forward bfloat16 32 8 128 128 0 \
    > $OUT/warmup_fwd_z51a.log 2>&1 &
  FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=$D python3 $W backward bfloat16 32 8 128 128 0 \
    > $OUT/warmup_bwd_z51a.log 2>&1 &
  wait -n; echo "two children: the first done after $(ms $s) ms"
  wait; echo "two children: both done after $(ms $s) ms"
  s=$(date +%s%N)
  FLEX_ATTENTION_CUTE_DSL_CACHE_DIR=$D python3 $W forward,backward bfloat16 32 8 128 128 0 \
    > $OUT/warmup_after_z51a.log 2>&1
  echo "one child after them (kernels on disk: none compiled): rc=$? $(ms $s) ms"
  grep -c "Compiled" $OUT/warmup_after_z51a.log
  unset FLEX_ATTENTION_CUTE_DSL_CACHE_ENABLED
  cold z51a_two 150 --layers 4 --warmup 2 --reps 5 --profile --methods treefx
  TREEFX_CUDNN_WARMUP_PROCESSES=1 cold z51a_one 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  cold z51a_two_b 150 --layers 4 --warmup 1 --reps 3 --methods treefx
  TREEFX_CUDNN_WARMUP_PROCESSES=1 cold z51a_one_b 150 --layers 4 --warmup 1 --reps 3 --methods treefx
fi
#   z51b (in the third `stage` call): gpu_check's intervals case (Qwen3 in bf16 now with the
#         input embedding's gradient on ATen's kernel), benchmarks.embedding_grad, then first
#         steps with empty caches as shipped (two warm-up processes): 4 layers (the e2e report
#         now with the matmul rate sustained over a step's length) and 36 layers (regional, a
#         quarter of the tree); every file in one tar (a call brings back 8 files at most)
if [ "${1:-}" = z51b ]; then
  site
  timeout 170 python3 -m benchmarks.gpu_check --cases intervals \
    --out $OUT/gpu_check_intervals_z51b.json > $OUT/gpu_check_intervals_z51b.log 2>&1
  echo "gpu_check rc=$?"; grep -iE "passed|failed|error" $OUT/gpu_check_intervals_z51b.log | head -20
  timeout 60 python3 -m benchmarks.embedding_grad --out $OUT/embedding_grad_z51b.json \
    > $OUT/embedding_grad_z51b.log 2>&1
  echo "embedding_grad rc=$?"; tail -n 3 $OUT/embedding_grad_z51b.log
  cold z51b 150 --layers 4 --warmup 2 --reps 5 --methods treefx
  cold z51b_l36 200 --layers 36 --scale 0.25 --warmup 1 --reps 3 --methods treefx
  (cd $OUT && tar cf z51b.tar *.json *.log && rm -f *.json *.log)
fi
