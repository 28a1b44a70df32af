"""The GPU benchmarks' own checks, run on the CPU (``python -m benchmarks.<name> --dry-run``:
tiny model and trees, eager backends): every e2e method's loss and gradients against the
per-sequence reference, the block masks against the dense mask, and a few of gpu_check's and
checkpointing's ``treefx.verify`` cases. Keeps the harness from drifting while only the GPU
times it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(module: str, *args: str, out) -> dict:
    """``python -m benchmarks.<module> --dry-run --out <out> ...`` from the repository root."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--dry-run", "--out",
                           str(out), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.slow  # 50 s; the other benchmarks' dry runs stay in CI
@pytest.mark.filterwarnings("ignore")
def test_e2e_dry_run_checks(tmp_path):
    res = _run("e2e", "--por", "0.75", "--methods", "treefx,treefx_standard,packed,hand",
               out=tmp_path / "e2e.json")
    checks = res["dry_run_checks"]["por0.75"]
    for method in ("treefx", "packed", "hand"):
        assert checks[method]["loss_rel_err"] < 1e-5, method
        assert checks[method]["max_rel_grad_err"] < 1e-5, method
    flex = checks["flex_forward"]
    assert flex["hand_blocks_match_tree_block_mask"] is True
    assert max(v for k, v in flex.items() if k.endswith("_max_abs")) < 1e-5
    run = res["runs"]["hidden64"]["por0.75"]
    for method in ("treefx", "treefx_standard", "packed", "hand"):
        assert "step_ms" in run[method], (method, run[method].get("error", "")[-1500:])


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_attention_dry_run_checks(tmp_path):
    res = _run("attention", "--tokens", "512", "--kv-heads", "2", out=tmp_path / "att.json")
    checks = res["sizes"]["512"]["checks"]
    assert checks["pairs_match_dense"] is True
    for key in ("flex_tree", "heads_interleaved", "treefx_op", "treefx_op_interleaved"):
        assert checks[f"{key}_vs_dense_max_abs"] < 1e-5, key


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_gpu_check_dry_run_checks(tmp_path):
    res = _run("gpu_check", "--cases", "inference,qwen3-bf16", out=tmp_path / "gc.json")
    for key in ("inference-qwen3-tiny", "inference-qwen3-small-trees"):
        assert res[key]["passed"] is True, res.get("inference-error", "")[-1500:]
        assert res[key]["max_abs_logprob_err"] < 1e-5, key
    assert res["qwen3-bf16-tree-vs-fp32-oracle"]["passed"] is True
    assert "max_rel_grad_err" in res["qwen3-bf16-perbranch-vs-fp32-oracle"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_checkpointing_dry_run_checks(tmp_path):
    res = _run("checkpointing", "--parts", "verify", out=tmp_path / "ckpt.json")
    for name in ("ckpt-off", "ckpt-nonreentrant"):
        assert res["verify"][name].get("passed") is True, res["verify"][name]


def test_profile_kinds_do_not_count_fused_kernels_as_copies():
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.e2e.profile import kernel_kind as kind
    finally:
        sys.path.pop(0)
    assert kind("triton_poi_fused__to_copy__unsafe_view_add_cos_mul_permute_10") == \
        "triton pointwise/reduction"
    assert kind("triton_tem_fused_flex_attention_backward_8") == "attention"
    assert kind("Memcpy HtoD (Pinned -> Device)") == "copy/fill"
    assert kind("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>") == \
        "copy/fill"
    assert kind("nvjet_sm90_tst_128x272_64x4_2x1_v_bz_coopA_NNT") == "gemm"


def test_flop_bound_counts_windows_and_active_experts():
    """The e2e report's FLOP bound: pairs within a sliding window counted per sequence as a
    brute force would, a windowed layer cheaper than a full one, and an MoE layer counting
    only its active experts; between the attention-pair bound and the token bound."""
    sys.path.insert(0, ROOT)
    import treefx
    from benchmarks.e2e.report import _capped_pairs, flop_bound, tree_info

    for n in (1, 5, 9, 40):
        for w in (1, 4, 9, 100):
            assert _capped_pairs(n, w) == sum(min(i + 1, w) for i in range(n))
    tree = treefx.Tree.from_sequences([[1] * 30 + [2] * 10, [1] * 30 + [3] * 12, [1] * 5])
    info = tree_info(tree, windows=(4,))
    assert info["tree_pairs_w4"] < info["tree_pairs"]
    gpt_oss = dict(arch="gpt_oss", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                   intermediate_size=64, sliding_window=4, num_hidden_layers=2, vocab_size=128)
    full = dict(gpt_oss, sliding_window=10_000)
    assert flop_bound(info, gpt_oss) > flop_bound(tree_info(tree, windows=(10_000,)), full)
    pairs = info["baseline_pairs"] / info["tree_pairs"]
    assert min(pairs, tree.bound) < flop_bound(info, gpt_oss) < max(pairs, tree.bound)
    assert flop_bound(tree_info(tree), gpt_oss) is None  # the window's pairs are missing
    assert flop_bound(info, dict(gpt_oss, arch="qwen3_next")) is None
