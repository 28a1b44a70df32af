#!/usr/bin/env bash
# A transformers release other than the device machine's (5.17) on the GPU, through Hugging
# Face's own kernel dispatch: the wheels in .whl (here transformers 5.25.0 with the `kernels`
# package it requires, and fla 0.4.2, which Hugging Face's wrappers call on CUDA) installed
# over the machine's packages. Checks, side by side:
# - what Hugging Face's wrapper of Gated DeltaNet dispatches to (fla's kernel, on CUDA) and the
#   torch function treefx reads beneath it;
# - benchmarks.fla_check's model cases: Qwen3-Next and Qwen3.5 through treefx (fla where its
#   checks allow it) against the per-sequence oracle, float32 and bf16, whole trees and parts;
# - benchmarks.gpu_check's plain and hybrid cases.
# Run from the repository root on the device machine, with `.whl` carried:
#   bash benchmarks/release_check.sh TAG
set -uo pipefail
tag=${1:?tag}
out=${OUT:-benchmarks/results}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | tee "$out/release_${tag}_dispatch.log"
import torch, transformers, fla
import transformers.models.qwen3_next.modeling_qwen3_next as m
from treefx.families.hf_kernels import _func_of_module, torch_function
wrapper = m.torch_chunk_gated_delta_rule
wrapped = _func_of_module(wrapper)
cells = dict(zip(wrapped.__code__.co_freevars, (c.cell_contents for c in wrapped.__closure__)))
impl = cells.get("implementation")
print(f"transformers {transformers.__version__}, fla {fla.__version__}, torch {torch.__version__}")
print(f"{type(wrapper).__name__} wrapper dispatches on CUDA to {impl.__module__}.{impl.__name__}")
print(f"treefx reads beneath it {torch_function(wrapper).__module__}.{torch_function(wrapper).__name__}")
PY
# fla's float32 matrix products are TF32 in Triton unless told otherwise: the float32 checks
# compare at float32's tolerance, so both run them in IEEE float32 (as fla_check does itself).
export TRITON_F32_DEFAULT=ieee
python3 -m benchmarks.fla_check --cases model --model-dtypes "${FLA_DTYPES:-float32,bfloat16}" \
    --out "$out/release_${tag}_fla_check.json" > "$out/release_${tag}_fla_check.log" 2>&1 &
python3 -m benchmarks.gpu_check --cases "${GPU_CASES:-qwen3-fp32,qwen3-bf16,small-trees,hybrid-fp32,hybrid-bf16}" \
    --out "$out/release_${tag}_gpu_check.json" 2>&1 | grep -v pow_by_natural \
    > "$out/release_${tag}_gpu_check.log" &
wait
tail -5 "$out/release_${tag}_fla_check.log" "$out/release_${tag}_gpu_check.log"
