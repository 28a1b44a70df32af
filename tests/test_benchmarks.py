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
import types

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
    res = _run("e2e", "--por", "0.75", "--methods", "treefx,treefx_nologits,packed",
               out=tmp_path / "e2e.json")
    checks = res["dry_run_checks"]["por0.75"]
    for method in ("treefx", "packed"):
        assert checks[method]["loss_rel_err"] < 1e-5, method
        assert checks[method]["max_rel_grad_err"] < 1e-5, method
    flex = checks["flex_forward"]
    assert max(v for k, v in flex.items() if k.endswith("_max_abs")) < 1e-5
    run = res["runs"]["hidden64"]["por0.75"]
    for method in ("treefx", "treefx_nologits", "packed"):
        assert "step_ms" in run[method], (method, run[method].get("error", "")[-1500:])
        # every treefx variant's loss is the tree's (the packed one's, to rounding)
        assert abs(run[method]["loss"] - run["packed"]["loss"]) < 1e-5 * abs(
            run["packed"]["loss"]), method


@pytest.mark.filterwarnings("ignore")
def test_e2e_packing_of_a_hybrid_in_micro_batches(tmp_path):
    """``packed_reset --pack-budget``: the sequences in micro-batches of the budget (as a
    trainer packs where one row of every sequence would not fit), gradients accumulated; the
    step's loss is the mean over all sequences, the tree's."""
    res = _run("e2e", "--arch", "qwen3_next", "--layers", "2", "--por", "0.75", "--stream",
               "0", "--mask-reps", "0", "--methods", "packed_reset,treefx", "--pack-budget",
               "400", out=tmp_path / "e2e.json")
    run = res["runs"]["hidden64"]["por0.75"]
    packed, tree = run["packed_reset"], run["treefx"]
    assert "step_ms" in packed, packed.get("error", "")[-1500:]
    sizes, info = packed["micro_batch_tokens"], res["trees"]["por0.75"]
    assert len(sizes) > 1 and max(sizes) <= max(400, info["max_seq_len"])
    assert sum(sizes) == info["baseline_tokens"]
    assert abs(packed["loss"] - tree["loss"]) < 1e-5 * abs(tree["loss"])


def test_chain_attention_dry_run_checks(tmp_path):
    """The tree's chains, and FlexAttention on the whole row (forward: no backward on the CPU)
    against the float32 chain-by-chain reference."""
    res = _run("chain_attention", out=tmp_path / "chains.json")
    (row,) = res["trees"]
    assert row["chains"] > 1
    assert row["flex"]["out_rel"] < 1e-5, row["flex"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_gpu_check_dry_run_checks(tmp_path):
    res = _run("gpu_check", "--cases", "inference,qwen3-bf16", out=tmp_path / "gc.json")
    for key in ("inference-qwen3-tiny", "inference-qwen3-small-trees"):
        assert res[key]["passed"] is True, res.get("inference-error", "")[-1500:]
        assert res[key]["max_abs_logprob_err"] < 1e-5, key
    assert res["qwen3-bf16-tree-vs-fp32-oracle"]["passed"] is True
    assert "max_rel_grad_err" in res["qwen3-bf16-perbranch-vs-fp32-oracle"]


@pytest.mark.slow  # ~1 min: TRL's GRPOTrainer and TreeGRPOTrainer, two cycles each
@pytest.mark.filterwarnings("ignore")
def test_grpo_dry_run_paths_agree(tmp_path):
    """benchmarks.grpo on the CPU (tiny Qwen3, float32): TRL's GRPO step and treefx's on the
    same rollouts give the same old and reference log-probs, step losses and gradients, and
    the treefx path ran fewer tokens than the rows hold."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    res = _run("grpo", "--verify", "on", out=tmp_path / "grpo.json")  # as on the GPU
    cmp = res["comparison"]
    assert cmp["same_first_batch"] and cmp["within_tolerance"], cmp
    assert cmp["old_logprob_max_abs_err"] <= 1e-5 and cmp["ref_logprob_max_abs_err"] <= 1e-5
    assert cmp["loss_max_rel_err"] <= 1e-5 and cmp["grad_max_rel_err"] <= 1e-5
    assert len(cmp["step_losses_trl"]) == 2 * res["args"]["iterations"]
    assert cmp["grad_params_compared"] == res["model"]["num_hidden_layers"] * 11 + 2
    d, tree = res["data"], res["paths"]["treefx"]
    assert tree["first_call_checks"]["policy"]["passed"]
    assert tree["first_call_checks"]["reference"]["passed"]
    passes = 2 + res["args"]["iterations"]  # old and reference log-probs, then the loss's
    for c in tree["cycles"]:
        assert c["tree_stats"]["sequence_tokens"] == passes * d["sequence_tokens"]
        assert c["tree_stats"]["tree_tokens"] < c["tree_stats"]["sequence_tokens"]
    for name in ("trl", "treefx"):
        m = res["paths"][name]["median"]
        assert m["cycle_ms"] > 0 and m["prep_ms"] > 0 and m["loss_backward_ms"] > 0, name
        assert res["paths"][name]["first_cycle"]["micro_batches"] == 2 * res["args"]["iterations"]
    assert "| TRL | treefx |" in res["table"]


@pytest.mark.slow  # ~1.5 min: the GPU's regional path on the CPU (aot-eager), TRL's too
@pytest.mark.filterwarnings("ignore")
def test_grpo_dry_run_regional_first_cycle_breakdown(tmp_path):
    """benchmarks.grpo's treefx path as it runs on the GPU (regional execution, AOTAutograd)
    on the CPU: the paths agree, the policy captures one graph (for training, at its first call,
    the old log-probs; the loss captures nothing), the reference model runs the policy's graph
    (its own first-call check passed on it, nothing captured for it), and the first cycle's
    breakdown accounts for the log-prob calls' time."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    res = _run("grpo", "--verify", "on", "--layers", "3", "--compile-options",
               '{"backend": "aot-eager", "regional": true}', out=tmp_path / "grpo.json")
    cmp = res["comparison"]
    assert cmp["within_tolerance"], cmp
    tree = res["paths"]["treefx"]
    assert tree["first_call_checks"]["reference"]["passed"]
    parts = tree["first_cycle_breakdown"]
    assert parts["old"]["tree_compilations"] == 1 and parts["loss"]["tree_compilations"] == 0
    assert parts["ref"]["tree_compilations"] == 0 and parts["ref"]["new_graphs"] == 0
    assert parts["ref"]["wall_s"] < parts["old"]["wall_s"]
    for kind in ("old", "ref", "loss"):
        p = parts[kind]
        assert p["rest_s"] >= -0.05 and p["wall_s"] > 0, (kind, p)
    assert parts["old"]["dynamo_trace_s"] > 0 and parts["old"]["check_oracle_s"] > 0
    assert any("twin" in m for m in tree["treefx_notes"])


def test_profile_kinds_do_not_count_fused_kernels_as_copies():
    sys.path.insert(0, ROOT)
    try:
        from benchmarks.e2e.main import kernel_kind as kind
    finally:
        sys.path.pop(0)
    assert kind("triton_poi_fused__to_copy__unsafe_view_add_cos_mul_permute_10") == \
        "triton pointwise/reduction"
    assert kind("triton_tem_fused_flex_attention_backward_8") == "attention"
    assert kind("Memcpy HtoD (Pinned -> Device)") == "copy/fill"
    assert kind("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>") == \
        "copy/fill"
    assert kind("nvjet_sm90_tst_128x272_64x4_2x1_v_bz_coopA_NNT") == "gemm"


def test_flop_bound_lies_between_the_pair_and_token_bounds():
    """The e2e report's FLOP bound: between the attention-pair bound and the token bound, and
    none for a hybrid (its recurrent layers are not counted)."""
    sys.path.insert(0, ROOT)
    import treefx
    from benchmarks.e2e.report import flop_bound, tree_info

    tree = treefx.Tree.from_sequences([[1] * 30 + [2] * 10, [1] * 30 + [3] * 12, [1] * 5])
    info = tree_info(tree)
    qwen3 = dict(arch="qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=192, num_hidden_layers=2, vocab_size=128)
    pairs = info["baseline_pairs"] / info["tree_pairs"]
    assert min(pairs, tree.bound) < flop_bound(info, qwen3) < max(pairs, tree.bound)
    assert flop_bound(info, dict(qwen3, arch="qwen3_next")) is None


def test_model_flops_count_the_tree_for_treefx_and_the_sequences_for_baselines():
    """The e2e report's model FLOPs: 6 per parameter-token (the output projection counted) and
    attention at 3x its forward per attended pair, on the tree for every treefx variant and
    on the sequences for packing."""
    sys.path.insert(0, ROOT)
    import treefx
    from benchmarks.e2e.report import model_flops, tree_info

    tree = treefx.Tree.from_sequences([[1] * 30 + [2] * 10, [1] * 30 + [3] * 12, [1] * 5])
    info = tree_info(tree)
    h, heads, kv, d, f, v, layers = 64, 4, 2, 16, 192, 128, 3
    model = dict(arch="qwen3", hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv,
                 head_dim=d, intermediate_size=f, num_hidden_layers=layers, vocab_size=v)
    params = layers * (2 * h * heads * d + 2 * h * kv * d + 3 * h * f) + h * v
    per_pair = layers * 4 * d * heads
    for method in ("treefx", "treefx_nologits", "treefx_step"):
        assert model_flops(info, model, method) == \
            6 * params * info["tokens"] + 3 * per_pair * info["tree_pairs"]
    assert model_flops(info, model, "packed") == \
        6 * params * info["baseline_tokens"] + 3 * per_pair * info["baseline_pairs"]


@pytest.mark.filterwarnings("ignore")
def test_logprobs_paths_dry_run_agree(tmp_path):
    """benchmarks.logprobs --paths on the CPU (float32): the fused log-probabilities' and the
    fused loss's gradients equal the materialized path's."""
    res = _run("logprobs", "--paths", "300", "--reps", "1", out=tmp_path / "lp.json")
    (case,) = res["paths"]
    for name in ("fused_logprobs", "fused_loss"):
        assert case[f"{name}_dh_vs_materialized"] < 1e-5, name
        assert case[f"{name}_dw_vs_materialized"] < 1e-5, name


def _real_trees():
    sys.path.insert(0, ROOT)
    try:
        from benchmarks import real_trees
    finally:
        sys.path.pop(0)
    return real_trees


def _comb_file(path, n: int = 2, vocab: int = 1024):
    import treefx

    rt = _real_trees()
    trees = [rt.comb_tree(s, vocab, calls=5, scale=0.1) for s in range(n)]
    treefx.write_jsonl(path, trees)
    return trees


def test_real_trees_packing_keeps_calls_and_masks():
    """The packing baseline's micro-batches: first-fit decreasing within the capacity, every
    call once as its own sequence, its loss mask kept, the task's mean over calls."""
    import treefx

    rt = _real_trees()
    assert rt.ffd([5, 9, 3, 4, 2], 10) == [[1], [0, 3], [2, 4]]
    assert rt.ffd([12, 3], 10) == [[0], [1]]  # longer than the capacity: alone
    tree = rt.comb_tree(3, 1024, calls=6, scale=0.1)
    assert tree.loss_masks is not None and tree.bound > 1.5  # a comb, completions trained
    assert tree.num_sequences == 6 and tree.metadata["task"] == "synthetic-comb-3"
    budget = int(tree.sequence_lengths.max()) // 2  # the longest call sets the capacity
    batches = rt.packing_batches(tree, budget)
    cap = int(tree.sequence_lengths.max())
    assert all(b.num_tokens <= cap for b in batches) and len(batches) > 1
    assert sum(b.num_tokens for b in batches) == tree.num_baseline_tokens
    assert sum(b.num_sequences for b in batches) == tree.num_sequences
    trained = sum(int(tree.loss_mask(i)[1:].sum()) for i in range(tree.num_sequences))
    assert sum(int((b.loss_weights != 0).sum()) for b in batches) == trained
    whole = treefx.pack(tree, reduction="mean")
    total = sum(float(b.loss_weights.sum()) for b in batches)
    assert abs(total - float(whole.loss_weights.sum())) < 1e-12


def test_real_trees_refuses_ids_beyond_the_vocabulary(tmp_path):
    import argparse

    import treefx

    rt = _real_trees()
    path = tmp_path / "bad.jsonl"
    treefx.write_jsonl(path, [treefx.Tree.from_sequences([[1, 2, 3], [1, 2, 151936]])
                              .with_metadata(task="too-big")])
    args = argparse.Namespace(trees=str(path), tasks=None, sample=None, seed=0, slice=None,
                              dry_run=True)
    with pytest.raises(ValueError, match=r"token id 151936 .*too-big.*|too-big.*151936"):
        rt.load_tasks(args, 151936)
    trees, prov = rt.load_tasks(args, 151937)
    assert [i for i, _ in trees] == [0] and prov["trees_in_file"] == 1


def test_real_trees_dry_run(tmp_path, monkeypatch):
    """The experiment on the CPU: two comb trees from a file, both methods, the losses equal
    (float32), every figure in the result file; a third task whose packing runs out of memory
    is recorded as such and the run goes on."""
    import torch

    rt = _real_trees()
    trees = _comb_file(tmp_path / "t.jsonl", n=3)
    timed = rt.timed

    def oom_on_last(fn, model, cuda, warmup, reps, pre_warm=None):
        if pre_warm is not None and seen.setdefault("packing", 0) == 2:
            # as a compiled graph's wrapper raises it
            raise RuntimeError("the graph failed") from torch.OutOfMemoryError(
                "CUDA out of memory (simulated)")
        if pre_warm is not None:
            seen["packing"] += 1
        return timed(fn, model, cuda, warmup, reps, pre_warm)

    seen = {}
    monkeypatch.setattr(rt, "timed", oom_on_last)
    out = tmp_path / "res.json"
    rt.main(["--dry-run", "--trees", str(tmp_path / "t.jsonl"), "--layers", "1", "--budget",
             "96", "--reps", "1", "--out", str(out)])
    with open(out) as f:
        res = json.load(f)
    assert res["meta"]["cuda"] is False and res["data"]["trees_in_file"] == 3
    assert len(res["data"]["sha256"]) == 64
    rows = res["tasks"]
    assert [r["index"] for r in rows] == [0, 1, 2]
    for r, tree in zip(rows[:2], trees):
        assert r["status"] == "ok" and r["task"] == tree.metadata["task"]
        assert r["unique_tokens"] == tree.num_tokens
        assert r["sequence_tokens"] == tree.num_baseline_tokens
        assert r["bound"] == pytest.approx(tree.bound)
        t, p = r["methods"]["treefx"], r["methods"]["packing"]
        assert t["parts"] > 1 and p["micro_batches"] >= 1
        assert t["tokens"] == tree.num_tokens and p["tokens"] == tree.num_baseline_tokens
        for st in (t, p):
            assert st["step_ms"] > 0 and "peak_gib" in st
            assert st["sequence_tokens_per_s"] == pytest.approx(
                tree.num_baseline_tokens / st["step_ms"] * 1e3)
        assert t["tokens_per_s"] == pytest.approx(tree.num_tokens / t["step_ms"] * 1e3)
        assert r["speedup"] == pytest.approx(p["step_ms"] / t["step_ms"])
        assert r["share_of_bound"] == pytest.approx(r["speedup"] / tree.bound)
        assert r["loss_rel_diff"] < 1e-5 and r["loss_agree"] is True
    assert rows[2]["status"] == "oom: packing"
    assert "simulated" not in rows[2]["methods"]["packing"]["error"]  # the outer error's
    assert not rt.common.is_oom(ValueError("a bug")) and rt.common.is_oom(torch.OutOfMemoryError("x"))
    assert rows[2]["methods"]["packing"]["status"] == "oom"
    assert rows[2]["methods"]["treefx"]["status"] == "ok" and "speedup" not in rows[2]
    s = res["summary"]
    assert s["both_measured"] == 2 and s["oom"] == [2]
    assert s["losses_agree"] is True
    for key in ("median_share_of_bound", "worst_share_of_bound", "median_speedup",
                "lowest_speedup", "any_slower_than_packing", "slower_than_packing"):
        assert key in s, key
    assert s["worst_share_of_bound"] == min(r["share_of_bound"] for r in rows[:2])


def test_real_trees_time_limit(tmp_path, monkeypatch):
    """``--time-limit`` stops before a task that would not fit (0.3 s a task on a fake clock
    against a limit of 0.1 s), the file keeping the tasks done; ``--slice`` resumes."""
    rt = _real_trees()
    trees = _comb_file(tmp_path / "t.jsonl", n=4)
    longest = [int(t.sequence_lengths.max()) for t in trees]
    calls = []
    # the module's clock, advanced by the tasks alone: each fake task takes 0.3 s of it, so
    # the decision to stop depends on no machine's speed
    clock = [0.0]
    monkeypatch.setattr(rt, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def fake_task(index, tree, tm, model, args, cuda, dev):
        calls.append(index)
        clock[0] += 0.3
        return {"index": index, "task": None, "calls": tree.num_sequences,
                "unique_tokens": tree.num_tokens, "sequence_tokens": tree.num_baseline_tokens,
                "longest_call": longest[index], "bound": tree.bound, "status": "ok",
                "methods": {}}

    monkeypatch.setattr(rt, "run_task", fake_task)
    out = tmp_path / "res.json"
    res = rt.main(["--dry-run", "--trees", str(tmp_path / "t.jsonl"), "--layers", "1",
                   "--time-limit", "0.1", "--out", str(out)])
    assert calls == [0]  # the first task always runs; the next would not fit
    with open(out) as f:
        saved = json.load(f)
    assert [r["index"] for r in saved["tasks"]] == [0]
    assert saved["stopped"]["tasks_not_run"] == [1, 2, 3]
    assert saved["stopped"]["resume"] == "--slice 1:4"
    calls.clear()  # the rest, resumed: a shard of the same selection
    res = rt.main(["--dry-run", "--trees", str(tmp_path / "t.jsonl"), "--layers", "1",
                   "--sample", "3", "--seed", "1", "--slice", "1:", "--out", str(out)])
    assert calls == res["data"]["selected"][1:] and len(calls) == 2
    assert res["data"]["positions"] == [1, 2]


def test_balance_reports_whole_and_cut_assignments(tmp_path):
    import treefx
    from benchmarks import balance

    trees = treefx.synth.dataset(12, seed=1, vocab_size=64, rollouts=3)
    path = tmp_path / "trees.jsonl"
    treefx.write_jsonl(path, trees)
    out = tmp_path / "balance.json"
    balance.main(["--trees", str(path), "--worlds", "2", "3", "--per-rank", "1", "2",
                  "--steps", "3", "--out", str(out)])
    rows = json.load(open(out))["rows"]
    assert [(r["world"], r["trees_per_rank"]) for r in rows] == [(2, 1), (2, 2), (3, 1), (3, 2)]
    for r in rows:  # 1.0 is a perfect split; cutting never makes the slowest rank slower
        assert 1.0 <= r["whole_median"] <= r["whole_worst"]
        assert 1.0 <= r["split_median"] <= r["whole_median"] + 1e-12
        assert r["split_worst"] <= r["whole_worst"] + 1e-12


@pytest.mark.slow  # ~45 s; the parts under FSDP2 are in CI through test_distributed_parts
@pytest.mark.filterwarnings("ignore")
def test_multi_gpu_dry_run(tmp_path, monkeypatch):
    """``python -m benchmarks.multi_gpu --dry-run`` in one process (FSDP2 on gloo, a tiny
    float32 model): treefx in parts and per-call packing on the same two trees from the same
    weights, their first-step losses equal, every figure in the result file. ~45 s on 2 cores
    (torchrun --nproc_per_node=2 runs the same code; see benchmarks/README.md)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    res = _run("multi_gpu", "--tasks", "2", out=tmp_path / "mg.json")
    assert res["meta"]["world_size"] == 1 and res["data"]["selected"] == [0, 1]
    t, p = res["methods"]["treefx"], res["methods"]["packing"]
    assert t["parts"][0] > 1 and p["micro_batches"][0] > 1 and p["padding_micro_batches"] == [0]
    assert t["computed_tokens"] == res["tree_tokens_per_rank"]
    assert p["computed_tokens"] == res["sequence_tokens_per_rank"] == res["packing_tokens_per_rank"]
    for m in (t, p):
        assert m["timed_steps"] == 1 and m["step_s"] > 0 and m["first_step_s"] > 0
        assert m["sequence_tokens_per_s"] == pytest.approx(
            sum(res["sequence_tokens_per_rank"]) / m["step_s"])
        assert m["graphs_in_timed_steps_per_rank"] == [0]
    s = res["summary"]
    assert s["losses_agree"] is True and s["loss_rel_diff"] < 1e-5
    assert s["speedup"] == pytest.approx(p["step_s"] / t["step_s"])
    assert s["share_of_bound"] == pytest.approx(s["speedup"] / res["bound"])
    # the second method started from the same weights: its later losses are the first's
    assert p["losses"] == pytest.approx(t["losses"], rel=1e-5)


def test_fla_check_op_case_on_the_cpu():
    """fla_check's tree-op case where fla cannot run (the CPU): the torch kernel's path,
    exact against the float64 per-sequence recurrence (the Qwen3-Next layout of transformers
    5.17: query and key expanded before the kernel, which every transformers version takes)."""
    import torch

    from benchmarks import fla_check

    res = fla_check.op_case("cpu", torch.float32, "qwen3_next",
                            fla_check.odd_trees(1024)["short"])
    assert res["passed"], res
    assert res["fla"]["use"] is False and "CUDA" in res["fla"]["reason"]
    assert res["kernel_runs"] == {"qwen3_next_gated_delta_rule:padded": 1}
    assert res["worst"] < 1e-5


def test_flop_budget_reads_a_profiled_e2e_result():
    """benchmarks.flop_budget on a kept H100 result (e2e-24): the timed row is the report's
    own model FLOP/s, the GEMMs' rate is the model's FLOPs less attention's over their time,
    and each saving only shortens the step."""
    sys.path.insert(0, ROOT)
    from benchmarks import flop_budget

    path = os.path.join(ROOT, "benchmarks", "results", "e2e_z51a_two_2026-11-28_h100.json")
    with open(path) as f:
        result = json.load(f)
    (e,) = flop_budget.budget(result)
    timed = e["steps"]["as timed"]
    assert timed["tflops"] == pytest.approx(result["summary"][0]["model_tflops_per_s"])
    assert timed["of_burst"] == pytest.approx(result["summary"][0]["share_of_matmul_rate"])
    # 6 per parameter-token without the embedding lookups: the GEMMs' FLOPs
    m, tokens = result["models"]["hidden4096"], result["trees"]["por0.75"]["tokens"]
    gemm_tflop = 6 * (m["params"] - m["vocab_size"] * m["hidden_size"]) * tokens / 1e12
    assert e["model_tflop"] - e["attention_tflop"] == pytest.approx(gemm_tflop, rel=1e-3)
    assert e["gemm_tflops"] == pytest.approx(gemm_tflop / e["gemm_ms"] * 1e3, rel=1e-3)
    ms = [s["ms"] for s in e["steps"].values()]
    assert ms == sorted(ms, reverse=True) and e["logprob_floor_ms"] < e["logprob_ms"]


def test_stages_name_existing_benchmarks_and_group_steps_by_gpu():
    """Every stage's step runs a module of the suite with an argument parser; steps on other
    GPUs form lanes of their own, in order; ``"fresh"`` caches are new folders, a named cache
    is shared by the steps that name it."""
    import importlib.util

    from benchmarks import stages

    for name, st in stages.STAGES.items():
        names = [s.name for phase in st.phases for s in phase]
        assert len(names) == len(set(names)), name
        for phase in st.phases:
            for s in phase:
                module = s.args.split()[0]
                assert importlib.util.find_spec(module) is not None, (name, module)
    fla = stages.STAGES["fla"].phases[0]
    assert [[s.name for s in lane] for lane in stages.lanes(fla)] == [
        ["fla_check", "e2e_qwen3_5"], ["e2e_qwen3_next"], ["fla_tree_check"]]
    made = iter(["/a", "/b", "/c"])
    caches = {}
    restart = stages.STAGES["restart"].phases[0]
    envs = [stages.command(s, "/out", caches, lambda: next(made))[1] for s in restart]
    assert [e["TORCHINDUCTOR_CACHE_DIR"] for e in envs] == ["/a/inductor"] * 2 + ["/b/inductor"]
    argv, env = stages.command(stages.STAGES["distributed"].phases[0][0], "/out", {})
    assert argv[1:5] == ["-m", "torch.distributed.run", "--nproc_per_node=2",
                         "--master_port=29505"]
    assert argv[-2:] == ["--out", "/out/distributed_check.json"]
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "TORCHINDUCTOR_CACHE_DIR" not in env


def test_stages_run_phases_in_order_and_record_each_step(tmp_path, monkeypatch):
    """A stage's run with a stand-in runner: the second phase starts after the first is done,
    each step's exit status (124: stopped at its limit) and command go to the stage's JSON."""
    from benchmarks import stages

    monkeypatch.setattr(stages, "prepare", lambda needs, env: env.update(PYTHONPATH="/x"))
    seen = []

    def runner(argv, env, limit, log):
        seen.append((os.path.basename(log), env["PYTHONPATH"]))
        return (124 if "x2" in log else 0), 1.0

    res = stages.run("multi-gpu", str(tmp_path), runner=runner)
    assert sorted(seen[:2]) == [("multi_gpu_l8_x1.log", "/x"), ("multi_gpu_l8_x2.log", "/x")]
    assert seen[2] == ("multi_gpu_l8_x4.log", "/x")
    saved = json.loads((tmp_path / "stage_multi-gpu.json").read_text())
    assert saved == res and saved["was"].startswith("x4_check.sh d")
    rows = {r["name"]: r for r in saved["steps"]}
    assert rows["multi_gpu_l8_x2"]["timed_out"] and rows["multi_gpu_l8_x4"]["rc"] == 0
    assert "timeout 260 python -m torch.distributed.run --nproc_per_node=4" in \
        rows["multi_gpu_l8_x4"]["command"]
    assert stages.main(["multi-gpu", "--print", "--out", str(tmp_path / "p")]) == 0
    assert not (tmp_path / "p").exists()  # printed only


def test_parts_budget_dry_run(tmp_path):
    """Issue 66's table on the CPU: each budget's plan is the planner's at that budget, the
    whole tree is one step, and packing's loss equals every budget's (float32): the same
    objective, whatever the budget."""
    import json

    from benchmarks import parts_budget

    out = tmp_path / "pb.json"
    res = parts_budget.main(["--dry-run", "--packing", "--configs", "whole,half,quarter",
                             "--reps", "1", "--out", str(out)])
    (task,) = res["tasks"]
    assert json.loads(out.read_text())["tasks"][0]["unique_tokens"] == task["unique_tokens"]
    n = task["unique_tokens"]
    for name, div in (("half", 2), ("quarter", 4)):
        rec = task["budgets"][name]
        assert rec["max_tokens"] == -(-n // div)
        assert rec["parts"] >= 2 and rec["held_tokens"] <= n
    losses = [rec["loss"] for rec in task["budgets"].values()] + [task["packing"]["loss"]]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0]), losses
    # --reestimate: the recorded rows' plans again, today's memory model beside the peaks
    # recorded (here made up), adding each held part's output-weight gradient (8B, bf16)
    recorded = json.loads(out.read_text())
    for name in ("half", "quarter"):
        recorded["tasks"][0]["budgets"][name]["peak_gib"] = 1.0
    out.write_text(json.dumps(recorded))
    rows = parts_budget.main(["--dry-run", "--reestimate", str(out),
                              "--out", str(tmp_path / "re.json")])
    assert [r["row"] for r in rows] == ["half", "quarter"]
    per_part = 151936 * 4096 * 2 / 2 ** 30
    for r in rows:
        assert r["parts"] == r["parts_then"] and r["held_parts"] >= 1
        added = r["estimate_gib"] - r["estimate_then_gib"]
        assert per_part - 1e-9 <= added <= r["held_parts"] * per_part + 1e-9, r
