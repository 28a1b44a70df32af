#!/usr/bin/env bash
# Device calls of one session, by stage (each fits one 10-minute call):
#   bash benchmarks/gpu_session.sh attention   tree attention on the e2e tree, block layouts,
#                                               trees shorter than a block
#   bash benchmarks/gpu_session.sh hybrid      hybrid exactness with fla (varlen fast path)
#                                               and without (torch kernel, padded)
#   bash benchmarks/gpu_session.sh e2e         profiled e2e step (dense) and the hybrid e2e row
#   bash benchmarks/gpu_session.sh verify      no-grad short rows (padded and not), hybrid bf16,
#                                               FlexAttention kernel options on the e2e tree
#   bash benchmarks/gpu_session.sh debug       short rows variant by variant, kernel options
#                                               (no autotune), hybrid e2e row (torch kernel)
#   bash benchmarks/gpu_session.sh confirm     short rows and exactness after the fixes, dense
#                                               e2e at POR 0.75 (TMA on), fla forward
#   bash benchmarks/gpu_session.sh tma         exactness with TMA off (treefx's default); TMA
#                                               on in float32 (where it crashed) and bf16
#   bash benchmarks/gpu_session.sh exact       exactness of short rows, no-grad, float32 (TMA off)
#   bash benchmarks/gpu_session.sh recompiles  graphs compiled over 71..20k-token trees (hidden
#                                               1024), the e2e step and its 12-tree stream
#   bash benchmarks/gpu_session.sh fla         fla's varlen fast path, forward (carry .whl)
#   bash benchmarks/gpu_session.sh hostgaps    where the GPU waits for the host in the e2e step
#   bash benchmarks/gpu_session.sh next        (for the next session) exactness after this
#                                               session's CPU-only changes, the hybrid with the
#                                               tree_nodes cache, heads-interleaved attention
#   bash benchmarks/gpu_session.sh layouts     exactness with the KV heads shared natively,
#                                               with and without interleave_heads; tree
#                                               attention layouts incl. the treefx op both ways
#   bash benchmarks/gpu_session.sh layouts_e2e e2e at POR 0.75, hidden 1024 and 2048:
#                                               treefx, treefx_standard, packed, hand (run at
#                                               bb57081 as treefx_interleaved vs treefx)
#   bash benchmarks/gpu_session.sh default     the treefx op both ways; e2e at every POR with
#                                               the new defaults, the 12-tree stream
#   bash benchmarks/gpu_session.sh default_check short rows, no-grad, hybrid exactness with the
#                                               new defaults; the e2e step profiled
#   bash benchmarks/gpu_session.sh compact     after the interleaved BlockMask stopped being
#                                               transposed at its own size: exactness, op, e2e
#   bash benchmarks/gpu_session.sh small       which row sizes of 50-1,000 tokens compile a
#                                               graph of their own, and the guard that failed
#   bash benchmarks/gpu_session.sh spare       the same after the spare block; short rows and
#                                               Qwen3 float32 exactness
#   bash benchmarks/gpu_session.sh retime      (fourth session) e2e at every POR after the
#                                               spare block and the grouped batch copy;
#                                               Qwen3 float32 exactness
#   bash benchmarks/gpu_session.sh obo         one by one compiled (dynamic) at every POR; the
#                                               hybrid e2e row with the current defaults
#   bash benchmarks/gpu_session.sh nograd      the guards that split no-grad graphs by row size;
#                                               the e2e step profiled after the grouped copy
#   bash benchmarks/gpu_session.sh nograd2     the same guards, filtered so they survive; the
#                                               one-by-one row the obo stage's budget skipped
#   bash benchmarks/gpu_session.sh prologue    e2e at POR 0.75 with Inductor's prologue fusion
#                                               off (RoPE recomputed inside the attention
#                                               forward's key loop?) against on
#   bash benchmarks/gpu_session.sh obo085      the one-by-one row at hidden 2048, POR 0.85
#   bash benchmarks/gpu_session.sh mixorder    the treefx step with Inductor's mix-order
#                                               reduction off (torch 2.11's slicing bug) and on
# Needs .whl/ with the fla-core, flash-linear-attention and einops wheels (carried).
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/err
log="$OUT/session_$1.log"
fla() {
  pip install --no-deps --no-index --target /tmp/fla .whl/*.whl >/dev/null 2>&1 && echo "fla installed"
}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  case "$1" in
  attention)
    timeout 180 python benchmarks/gpu_check.py --cases small-trees \
        --out "$OUT/gpu_check_small.json" --err-dir /tmp/err 2>&1 | grep -v Warning | tail -20
    timeout 150 python benchmarks/attention.py --e2e-trees 0.75 --tokens "" --reps 10 \
        --kv-heads 8 --out "$OUT/attention_e2e.json" 2>&1 | grep -v Warning | tail -30
    ;;
  hybrid)
    fla
    PYTHONPATH=.:/tmp/fla TREEFX_HYBRID_MODELS=qwen3_next timeout 230 \
        python benchmarks/gpu_check.py --cases hybrid-fp32,hybrid-bf16 --out "$OUT/gpu_check_hybrid_fla.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -60
    TREEFX_HYBRID_MODELS=qwen3_next timeout 120 python benchmarks/gpu_check.py \
        --cases hybrid-fp32 --out "$OUT/gpu_check_hybrid_nofla.json" --err-dir /tmp/err 2>&1 \
        | grep -v Warning | tail -40
    PYTHONPATH=.:/tmp/fla timeout 150 python benchmarks/e2e.py --arch qwen3_next \
        --hidden 1024 --por 0.75 --methods treefx,packed_reset --stream 0 --mask-reps 0 \
        --out "$OUT/e2e_hybrid.json" 2>&1 | grep -v Warning | tail -12
    ;;
  e2e)
    timeout 230 python benchmarks/e2e.py --hidden 1024 --por 0.75 --methods treefx,hand,packed \
        --profile --stream 0 --mask-reps 0 --out "$OUT/e2e_profile.json" 2>&1 | grep -v Warning | tail -12
    fla
    PYTHONPATH=.:/tmp/fla TREEFX_HYBRID_MODELS=qwen3_next timeout 110 \
        python benchmarks/gpu_check.py --cases hybrid-forward --out "$OUT/gpu_check_fla_forward.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    timeout 200 python benchmarks/e2e.py --arch qwen3_next --hidden 1024 --por 0.75 \
        --methods treefx,packed_reset --stream 0 --mask-reps 0 --warmup 1 --reps 3 --profile \
        --out "$OUT/e2e_hybrid.json" 2>&1 | grep -v Warning | tail -12
    ;;
  verify)
    timeout 140 python benchmarks/gpu_check.py --cases inference,qwen3-fp32 \
        --out "$OUT/gpu_check_inference.json" --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    TREEFX_HYBRID_MODELS=qwen3_next timeout 130 python benchmarks/gpu_check.py \
        --cases hybrid-bf16 --out "$OUT/gpu_check_hybrid_bf16.json" --err-dir /tmp/err 2>&1 \
        | grep -v Warning | tail -30
    timeout 270 python benchmarks/attention.py --e2e-trees 0.75 --kernel-sweep --tokens "" \
        --reps 10 --kv-heads 8 --out "$OUT/attention_sweep.json" 2>&1 | grep -v Warning | tail -30
    ;;
  debug)
    timeout 150 python benchmarks/gpu_check.py --cases short-rows \
        --out "$OUT/gpu_check_short_rows.json" --err-dir /tmp/err 2>&1 | grep -v Warning
    timeout 120 python benchmarks/attention.py --e2e-trees 0.75 --kernel-sweep --tokens "" \
        --reps 10 --kv-heads 8 --out "$OUT/attention_sweep.json" 2>&1 | grep -v Warning
    timeout 280 python benchmarks/e2e.py --arch qwen3_next --hidden 1024 --por 0.75 \
        --methods treefx,packed_reset --stream 0 --mask-reps 0 --warmup 1 --reps 3 --budget 250 \
        --out "$OUT/e2e_hybrid.json" 2>&1 | grep -v Warning | tail -40
    ;;
  confirm)
    timeout 110 python benchmarks/gpu_check.py --cases short-rows,inference,qwen3-fp32 \
        --out "$OUT/gpu_check_confirm.json" --err-dir /tmp/err 2>&1 | grep -v Warning | tail -60
    timeout 330 python benchmarks/e2e.py --hidden 1024,2048 --por 0.75 \
        --methods treefx,hand,packed,one_by_one --obo-compile none --stream 0 --mask-reps 0 \
        --budget 300 --out "$OUT/e2e_tma.json" 2>&1 | grep -v Warning | tail -30
    fla
    PYTHONPATH=.:/tmp/fla TREEFX_HYBRID_MODELS=qwen3_next timeout 120 \
        python benchmarks/gpu_check.py --cases hybrid-forward --out "$OUT/gpu_check_fla_forward.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    ;;
  tma)
    timeout 110 python benchmarks/gpu_check.py --cases short-rows,inference,qwen3-fp32 \
        --out "$OUT/gpu_check_exact.json" --err-dir /tmp/err 2>&1 | grep -v Warning | tail -50
    mkdir -p /tmp/err/tma32 /tmp/err/tma16
    CUDA_LAUNCH_BLOCKING=1 timeout 90 python benchmarks/gpu_check.py --tma --cases short-rows \
        --out "$OUT/gpu_check_tma_fp32.json" --err-dir /tmp/err/tma32 2>&1 | grep -v Warning | tail -20
    timeout 90 python benchmarks/gpu_check.py --tma --cases qwen3-bf16 \
        --out "$OUT/gpu_check_tma_bf16.json" --err-dir /tmp/err/tma16 2>&1 | grep -v Warning | tail -20
    for f in /tmp/err/tma32/*; do [ -e "$f" ] && { echo "=== $f"; grep -B2 -A30 "Traceback" "$f" | head -60; }; done
    ;;
  exact)
    PYTHONUNBUFFERED=1 timeout 330 python benchmarks/gpu_check.py \
        --cases short-rows,inference,qwen3-fp32 --out "$OUT/gpu_check_exact.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning
    ;;
  recompiles)
    PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles timeout 200 python benchmarks/gpu_check.py \
        --cases recompiles-wide,short-rows --out "$OUT/gpu_check_recompiles.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | grep -v "^C1122" | tail -60
    timeout 260 python benchmarks/e2e.py --hidden 1024 --por 0.75 --methods treefx \
        --stream 12 --mask-reps 0 --budget 240 --out "$OUT/e2e_stream.json" 2>&1 \
        | grep -v Warning | tail -25
    ;;
  fla)
    fla
    PYTHONPATH=.:/tmp/fla PYTHONUNBUFFERED=1 TREEFX_HYBRID_MODELS=qwen3_next timeout 420 \
        python benchmarks/gpu_check.py --cases hybrid-forward --out "$OUT/gpu_check_fla_forward.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -40
    ;;
  hostgaps)
    timeout 200 python benchmarks/e2e.py --hidden 1024 --por 0.75 --methods treefx,packed \
        --profile --stream 0 --mask-reps 0 --budget 180 --out "$OUT/e2e_hostgaps.json" 2>&1 \
        | grep -v Warning | tail -25
    ;;
  next)
    PYTHONUNBUFFERED=1 timeout 150 python benchmarks/gpu_check.py \
        --cases short-rows,inference,qwen3-fp32 --out "$OUT/gpu_check_exact.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -40
    PYTHONUNBUFFERED=1 TREEFX_HYBRID_MODELS=qwen3_next timeout 150 python benchmarks/gpu_check.py \
        --cases hybrid-fp32 --out "$OUT/gpu_check_hybrid.json" --err-dir /tmp/err 2>&1 \
        | grep -v Warning | tail -20
    PYTHONUNBUFFERED=1 timeout 200 python benchmarks/attention.py --e2e-trees 0.75 --tokens "" \
        --reps 10 --kv-heads 8 --out "$OUT/attention_layouts.json" 2>&1 | grep -v Warning | tail -30
    ;;
  layouts)
    PYTHONUNBUFFERED=1 timeout 170 python benchmarks/gpu_check.py --interleave-heads off \
        --cases qwen3-fp32,mistral-window,qwen3-bf16 --out "$OUT/gpu_check_shared_kv.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    PYTHONUNBUFFERED=1 timeout 170 python benchmarks/gpu_check.py --interleave-heads on \
        --cases qwen3-fp32,mistral-window,qwen3-bf16 --out "$OUT/gpu_check_interleaved.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    PYTHONUNBUFFERED=1 timeout 200 python benchmarks/attention.py --e2e-trees 0.75 --tokens "" \
        --reps 10 --kv-heads 8 --out "$OUT/attention_layouts2.json" 2>&1 | grep -v Warning | tail -30
    ;;
  layouts_e2e)
    PYTHONUNBUFFERED=1 timeout 570 python benchmarks/e2e.py --hidden 1024,2048 --por 0.75 \
        --methods treefx,treefx_standard,packed,hand --stream 0 --budget 500 \
        --out "$OUT/e2e_layouts.json" 2>&1 | grep -v Warning | tail -45
    ;;
  default)
    PYTHONUNBUFFERED=1 timeout 140 python benchmarks/attention.py --e2e-trees 0.75 --tokens "" \
        --reps 10 --kv-heads 8 --out "$OUT/attention_default.json" 2>&1 | grep -v Warning \
        | grep "treefx_op\|tree_b128 \|packed_doc\|relative"
    PYTHONUNBUFFERED=1 timeout 430 python benchmarks/e2e.py --hidden 1024,2048 \
        --methods treefx,packed,hand --stream 12 --budget 400 \
        --out "$OUT/e2e_default.json" 2>&1 | grep -v Warning | tail -45
    ;;
  default_check)
    PYTHONUNBUFFERED=1 timeout 270 python benchmarks/gpu_check.py \
        --cases short-rows,inference --out "$OUT/gpu_check_default.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -40
    PYTHONUNBUFFERED=1 TREEFX_HYBRID_MODELS=qwen3_next timeout 100 python benchmarks/gpu_check.py \
        --cases hybrid-fp32 --out "$OUT/gpu_check_default_hybrid.json" --err-dir /tmp/err 2>&1 \
        | grep -v Warning | tail -12
    PYTHONUNBUFFERED=1 timeout 190 python benchmarks/e2e.py --hidden 1024 --por 0.75 \
        --methods treefx --stream 0 --mask-reps 0 --profile --out "$OUT/e2e_default_profile.json" 2>&1 \
        | grep -v Warning | tail -25
    ;;
  compact)
    PYTHONUNBUFFERED=1 timeout 150 python benchmarks/gpu_check.py \
        --cases qwen3-fp32,mistral-window --out "$OUT/gpu_check_compact.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    PYTHONUNBUFFERED=1 timeout 120 python benchmarks/attention.py --e2e-trees 0.75 --tokens "" \
        --reps 10 --kv-heads 8 --out "$OUT/attention_compact.json" 2>&1 | grep -v Warning \
        | grep "treefx_op\|heads_interleaved\|tree_b128 \|packed_doc\|relative"
    PYTHONUNBUFFERED=1 timeout 200 python benchmarks/e2e.py --hidden 1024 --por 0.75 \
        --methods treefx,treefx_standard --stream 0 --mask-reps 0 \
        --out "$OUT/e2e_compact.json" 2>&1 | grep -v Warning | tail -8
    ;;
  small)
    PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles timeout 330 python benchmarks/gpu_check.py \
        --cases small-sizes --out "$OUT/gpu_check_small_sizes.json" --err-dir /tmp/err 2>&1 \
        | grep -v Warning | grep -i "small-sizes\|guard\|recompil\|error" | cut -c1-600 | tail -60
    ;;
  spare)
    PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles timeout 320 python benchmarks/gpu_check.py \
        --cases small-sizes,short-rows,qwen3-fp32 --out "$OUT/gpu_check_spare.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning \
        | grep -i "small-sizes\|- 0/\|: ok\|FAILED\|err\|compilations" | cut -c1-400 | tail -60
    ;;
  final)
    timeout 200 python benchmarks/gpu_check.py --cases inference,qwen3-fp32 \
        --out "$OUT/gpu_check_inference.json" --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    fla
    PYTHONPATH=.:/tmp/fla TREEFX_HYBRID_MODELS=qwen3_next timeout 200 \
        python benchmarks/gpu_check.py --cases hybrid-forward --out "$OUT/gpu_check_fla_forward.json" \
        --err-dir /tmp/err 2>&1 | grep -v Warning | tail -30
    ;;
  retime)
    PYTHONUNBUFFERED=1 timeout 420 python benchmarks/e2e.py --hidden 1024,2048 \
        --methods treefx,packed,hand --stream 12 --budget 390 \
        --out "$OUT/e2e_retime.json" 2>&1 | grep -v Warning | tail -45
    PYTHONUNBUFFERED=1 timeout 110 python benchmarks/gpu_check.py --cases qwen3-fp32 \
        --out "$OUT/gpu_check_retime.json" --err-dir /tmp/err 2>&1 | grep -v Warning | tail -12
    ;;
  obo)
    PYTHONUNBUFFERED=1 timeout 330 python benchmarks/e2e.py --hidden 1024,2048 \
        --methods one_by_one --obo-compile dynamic --stream 0 --mask-reps 0 --budget 300 \
        --out "$OUT/e2e_obo.json" 2>&1 | grep -v Warning | tail -20
    PYTHONUNBUFFERED=1 timeout 210 python benchmarks/e2e.py --arch qwen3_next --hidden 1024 \
        --por 0.75 --methods treefx,packed_reset --stream 0 --mask-reps 0 --warmup 1 --reps 3 \
        --out "$OUT/e2e_hybrid_retime.json" 2>&1 | grep -v Warning | tail -12
    ;;
  nograd)
    PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles timeout 240 python benchmarks/gpu_check.py \
        --cases short-rows --out "$OUT/gpu_check_nograd.json" --err-dir /tmp/err 2>&1 \
        | grep -v Warning | grep -i "short\|- 0/\|guard\|Recompil\|FAILED\|err" \
        | cut -c1-500 | tail -40
    PYTHONUNBUFFERED=1 timeout 220 python benchmarks/e2e.py --hidden 1024 --por 0.75 \
        --methods treefx,packed --stream 0 --mask-reps 0 --profile \
        --out "$OUT/e2e_profile_retime.json" 2>&1 | grep -v Warning | tail -8
    ;;
  nograd2)
    PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles timeout 200 python benchmarks/gpu_check.py \
        --cases short-rows --out "$OUT/gpu_check_nograd.json" --err-dir /tmp/err 2>&1 \
        | grep -v "Warning\|pow_by_natural" | grep -i "short\|- 0/\|Recompiling\|triggered" \
        | cut -c1-700 | tail -40
    PYTHONUNBUFFERED=1 timeout 200 python benchmarks/e2e.py --hidden 2048 --por 0.85 \
        --methods one_by_one --obo-compile dynamic --stream 0 --mask-reps 0 \
        --out "$OUT/e2e_obo_2048_085.json" 2>&1 | grep -v Warning | tail -5
    ;;
  prologue)
    PYTHONUNBUFFERED=1 TORCHINDUCTOR_PROLOGUE_FUSION=0 timeout 300 python benchmarks/e2e.py \
        --hidden 1024,2048 --por 0.75 --methods treefx,packed --stream 0 --mask-reps 0 \
        --profile --out "$OUT/e2e_noprologue.json" 2>&1 | grep -v Warning | tail -8
    PYTHONUNBUFFERED=1 timeout 150 python benchmarks/e2e.py --hidden 1024 --por 0.75 \
        --methods treefx --stream 0 --mask-reps 0 --profile \
        --out "$OUT/e2e_prologue.json" 2>&1 | grep -v Warning | tail -4
    ;;
  obo085)
    PYTHONUNBUFFERED=1 timeout 480 python benchmarks/e2e.py --hidden 2048 --por 0.85 \
        --methods one_by_one --obo-compile dynamic --stream 0 --mask-reps 0 --budget 450 \
        --out "$OUT/e2e_obo_2048_085.json" 2>&1 | grep -v Warning | tail -5
    ;;
  mixorder)
    PYTHONUNBUFFERED=1 TORCHINDUCTOR_MIX_ORDER_REDUCTION=0 timeout 200 python benchmarks/e2e.py \
        --hidden 1024,2048 --por 0.75 --methods treefx --stream 0 --mask-reps 0 \
        --out "$OUT/e2e_nomixorder.json" 2>&1 | grep -v Warning | tail -5
    PYTHONUNBUFFERED=1 timeout 200 python benchmarks/e2e.py --hidden 1024,2048 --por 0.75 \
        --methods treefx --stream 0 --mask-reps 0 \
        --out "$OUT/e2e_mixorder.json" 2>&1 | grep -v Warning | tail -5
    ;;
  esac
} > "$log" 2>&1
for f in /tmp/err/*.txt; do [ -e "$f" ] && { echo "=== $f"; cat "$f"; }; done > "$OUT/tracebacks_$1.txt"
tail -c 8000 "$log"
