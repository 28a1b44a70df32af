#!/bin/bash
# Issue 33 (the redesign): its checks on the GPU machine, in three calls of the device tool
# (each under its 10-minute limit), from the repository root:
#   a: the 8B-shaped e2e step before (the last commit before the redesign, d23e26f, unpacked in
#      .whl/old) and after, on the same GPU one after the other; then the GPU exactness cases
#      of gpu_check (regional included), while the zoo's checkpointing table runs on the CPU
#   b: the rest of a's gpu_check cases and the parts exactness check (treefx.backward) on the
#      GPU, while the first half of the zoo runs on the CPU
#   c: the second half of the zoo (merged into the first), then the whole test suite on 16
#      CPU processes (the machine's transformers, 5.17: the floor of the supported range),
#      while the GPU runs what a and b left unrun (their limits, beside the CPU zoo)
# The zoo runs on transformers 5.24 (docs/zoo.md's), carried as a wheel in .whl/.
set -u
stage=$1
export PYTHONUNBUFFERED=1 TREEFX_SKIP_FLOOR=1
site() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/transformers-*.whl
}
zoo() {  # zoo <name> <extra args...>: on the CPU, transformers 5.24
  local name=$1; shift
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 PYTHONPATH=/tmp/site:$PWD \
    python3 -m treefx.tools.zoo --timeout 300 "$@" > $OUT/zoo_$name.log 2>&1
  echo "zoo $name rc=$?"; tail -n 4 $OUT/zoo_$name.log
}
case $stage in
a)
  site
  for side in old new; do
    dir=.; [ $side = old ] && dir=.whl/old
    (cd $dir && TREEFX_VERIFY=0 timeout 240 python3 -m benchmarks.e2e --hidden 4096 --layers 4 \
      --por 0.75 --vocab 151936 --methods treefx --warmup 1 --reps 5 --stream 0 --mask-reps 0 \
      --out $OUT/e2e_8b_$side.json) > $OUT/e2e_8b_$side.log 2>&1
    echo "e2e $side rc=$?"; grep -iE "treefx.*ms|step" $OUT/e2e_8b_$side.log | tail -n 3
  done
  zoo checkpointing --checkpointing --jobs 12 \
    --models qwen3,llama,mistral,gpt2,gemma2,qwen3_next,mixtral,qwen3_moe,deepseek_v3,gpt_oss,phi3,falcon,mamba2,bamba,granitemoehybrid,mamba,jamba,gpt_neo,mpt,llama4_text,bloom,mvp,trocr,xglm,gpt_neox_japanese,minimax,deepseek_v32,glm_moe_dsa,dots3_note,dots3_note_text,axk2 \
    --out $OUT/zoo_checkpointing.md --json $OUT/zoo_checkpointing.json &
  timeout 330 python3 -m benchmarks.gpu_check --err-dir $OUT \
    --cases qwen3-fp32,qwen3-bf16,mistral-window,hybrid-fp32,hybrid-bf16,inference,step-fp32,short-rows,regional \
    --out $OUT/gpu_check_redesign.json > $OUT/gpu_check.log 2>&1
  echo "gpu_check rc=$?"; grep -E ": (ok|FAILED) in" $OUT/gpu_check.log
  wait
  ;;
b)
  site
  zoo half_a --jobs 12 --models "$(cat .whl/half_a)" --out $OUT/zoo_a.md \
    --json $OUT/zoo_a.json &
  # the cases of a's gpu_check that its 330 s (beside the CPU zoo) left unrun
  timeout 300 python3 -m benchmarks.gpu_check --err-dir $OUT \
    --cases hybrid-bf16,inference,step-fp32,short-rows,regional \
    --out $OUT/gpu_check_redesign_b.json > $OUT/gpu_check_b.log 2>&1
  echo "gpu_check rc=$?"; grep -E ": (ok|FAILED) in" $OUT/gpu_check_b.log
  timeout 220 python3 -m benchmarks.parts --methods "" --out $OUT/parts_exactness.json \
    > $OUT/parts.log 2>&1
  echo "parts rc=$?"; grep -E "exactness" $OUT/parts.log
  wait
  ;;
c)
  site
  cp .whl/zoo_a.json /tmp/zoo_all.json
  (zoo half_b --jobs 13 --models "$(cat .whl/half_b)" --merge /tmp/zoo_all.json \
     --out $OUT/zoo.md
   cp /tmp/zoo_all.json $OUT/zoo_all.json
   timeout 170 python3 -m pytest -q -p no:cacheprovider -n 16 tests > $OUT/suite_517.log 2>&1
   echo "suite rc=$?"; tail -n 3 $OUT/suite_517.log) &
  # the cases of b's gpu_check and parts that its limits left unrun
  timeout 300 python3 -m benchmarks.gpu_check --err-dir $OUT \
    --cases step-fp32,short-rows,regional \
    --out $OUT/gpu_check_redesign_c.json > $OUT/gpu_check_c.log 2>&1
  echo "gpu_check rc=$?"; grep -E ": (ok|FAILED) in" $OUT/gpu_check_c.log
  timeout 150 python3 -m benchmarks.parts --methods "" --exactness-models gemma2,gpt_oss \
    --out $OUT/parts_exactness_c.json > $OUT/parts_c.log 2>&1
  echo "parts rc=$?"; grep -E "exactness" $OUT/parts_c.log
  wait
  ;;
esac
