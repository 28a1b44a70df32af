"""treefx.distributed: balancing trees over ranks (assign, CostModel) and packing each rank's
share so that the ranks' losses and gradients, averaged over the ranks as DDP / FSDP do, equal
one process training on the whole global batch:

    (1/W) Σ_k L_k = L = (1/P) Σ_p ω_p · loss_p        (1/W) Σ_k ∇L_k = ∇L

checked with two gloo processes on the CPU (float64 tiny Qwen3, eager backend), for
``tree_loss`` and ``treefx.rl`` objectives, reductions "mean" and "sum", on uneven shares.
"""

from __future__ import annotations

import datetime
import math
import os
import time
import traceback
import types

import numpy as np
import pytest
import torch
from test_normalization import value_and_grads
from trees import odd_forest, odd_tree

import treefx
from treefx import distributed, rl
from treefx.distributed import DEFAULT_COST, CostModel, assign, attended_pairs

VOCAB = 64
GRAD_RTOL = 1e-10
WORLD = 2
CHILD_TIMEOUT_S = 120


def small_agent_trees(n: int, seed: int = 0) -> list[treefx.Tree]:
    return treefx.synth.dataset(n, seed=seed, vocab_size=VOCAB, system_len=(20, 60),
                                prompt_len=(5, 30), think_len=(5, 40), answer_len=(3, 15),
                                tool_len=(5, 30), rollouts=2)


# ---------------------------------------------------------------------- attended pairs


def test_attended_pairs_are_what_the_tree_mask_allows():
    trees = odd_forest(3, VOCAB) + small_agent_trees(3)
    for t in trees:
        assert attended_pairs(t) == int(treefx.pack(t).dense_mask().sum())
    padded = treefx.pack(trees[:2], pad_to_multiple=64)
    real = padded.num_real_tokens
    assert int(padded.dense_mask()[:real].sum()) == sum(attended_pairs(t) for t in trees[:2])
    chain = treefx.Tree.from_sequences([list(range(10))])
    assert attended_pairs(chain) == 55  # a single sequence: causal, L(L+1)/2


# ---------------------------------------------------------------------- assign


def max_over_min(parts, cost) -> float:
    loads = [cost.of_batch(p) for p in parts]
    return max(loads) / min(loads)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_assign_balances_better_than_round_robin(world):
    trees = small_agent_trees(32, seed=world)
    parts = assign(trees, world)
    round_robin = [trees[r::world] for r in range(world)]
    lpt = max_over_min(parts, DEFAULT_COST)
    assert lpt < max_over_min(round_robin, DEFAULT_COST)
    # List scheduling's bound: the slowest rank is at most the mean plus the largest tree.
    costs = [DEFAULT_COST(t) for t in trees]
    assert max(DEFAULT_COST.of_batch(p) for p in parts) <= sum(costs) / world + max(costs)
    assert lpt < 1.25, lpt


def test_assign_is_deterministic_covers_every_tree_once_in_input_order():
    trees = small_agent_trees(13, seed=7)
    for world in (1, 2, 5, 13):
        parts = assign(trees, world)
        assert len(parts) == world and all(parts)
        ids = [id(t) for p in parts for t in p]
        assert sorted(ids) == sorted(id(t) for t in trees) and len(set(ids)) == len(trees)
        position = {id(t): i for i, t in enumerate(trees)}
        for p in parts:
            idx = [position[id(t)] for t in p]
            assert idx == sorted(idx)
        again = assign(list(trees), world)
        assert [[id(t) for t in p] for p in again] == [[id(t) for t in p] for p in parts]
    assert [len(p) for p in assign(trees, 13)] == [1] * 13
    # Equal costs (even zero): at least one tree per rank, ties to the rank with fewer trees.
    same = [trees[0]] * 6
    assert [len(p) for p in assign(same, 4, cost=lambda t: 0.0)] == [2, 2, 1, 1]
    assert [len(p) for p in assign(same, 3)] == [2, 2, 2]
    assert assign(trees[0], 1) == [[trees[0]]]


def test_assign_largest_first_orders_each_rank_by_cost():
    """order="largest_first": the same trees on each rank as input order, each rank's from the
    most costly down (ties in input order); an unknown order is an error."""
    trees = small_agent_trees(13, seed=5)
    position = {id(t): i for i, t in enumerate(trees)}
    for world in (1, 3, 5):
        plain = assign(trees, world)
        ordered = assign(trees, world, order="largest_first")
        assert [sorted(map(id, p)) for p in ordered] == [sorted(map(id, p)) for p in plain]
        for p in ordered:
            keys = [(-DEFAULT_COST(t), position[id(t)]) for t in p]
            assert keys == sorted(keys)
        assert any([id(t) for t in p] != [id(t) for t in q] for p, q in zip(ordered, plain)) \
            or world == 1 or all(len(p) == 1 for p in plain)
    with pytest.raises(ValueError, match="order must be one of"):
        assign(trees, 2, order="smallest_first")


def test_assign_with_a_cost_model_of_tokens_only_balances_tokens():
    trees = small_agent_trees(20, seed=3)
    tokens_only = CostModel(per_token=1.0, per_pair=0.0)
    parts = assign(trees, 4, cost=tokens_only)
    loads = [sum(t.num_tokens for t in p) for p in parts]
    assert max(loads) - min(loads) <= max(t.num_tokens for t in trees)
    assert tokens_only.of_batch(trees) == sum(t.num_tokens for t in trees)


def test_assign_errors():
    trees = small_agent_trees(3)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="positive integer"):
            assign(trees, bad)
    for bad in (1.5, True, "2", None):
        with pytest.raises(TypeError, match="positive integer"):
            assign(trees, bad)
    with pytest.raises(ValueError, match="3 trees cannot be assigned to 4 ranks"):
        assign(trees, 4)
    with pytest.raises(ValueError, match="0 trees cannot be assigned to 1 ranks"):
        assign([], 1)
    with pytest.raises(TypeError, match=r"trees\[1\] is a list, not a treefx.Tree"):
        assign([trees[0], [[1, 2, 3]]], 1)
    with pytest.raises(TypeError, match="treefx.Tree or a list"):
        assign(42, 1)
    with pytest.raises(TypeError, match="cost must be"):
        assign(trees, 2, cost="tokens")
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match=r"cost of trees\[0\]"):
            assign(trees, 2, cost=lambda t, bad=bad: bad)


def wide_tree(rollouts: int, completion: int, seed: int = 0) -> treefx.Tree:
    """``rollouts`` completions of ``completion`` tokens off one 4-token prompt, each with its
    own weight and loss mask; the first completion is also a sequence of its own (a prefix of
    the second) and the last a duplicate of the one before."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB, 4).tolist()
    seqs = [prompt + rng.integers(0, VOCAB, completion).tolist() for _ in range(rollouts)]
    seqs[0] = seqs[1][:len(prompt) + completion // 2]
    seqs[-1] = list(seqs[-2])
    masks = [[0] * len(prompt) + [1] * (len(s) - len(prompt)) for s in seqs]
    masks[1][len(prompt)] = 0
    return treefx.Tree.from_sequences(seqs, weights=rng.uniform(0.5, 2.0, rollouts).tolist(),
                                      loss_masks=masks)


def sequences_of(trees) -> list:
    """Every sequence of ``trees`` with its weight and loss mask, as a sorted multiset."""
    return sorted((t.sequence(i).tolist(), float(t.weights[i]), np.asarray(t.loss_mask(i)).tolist())
                  for t in trees for i in range(t.num_sequences))


def test_assign_split_cuts_a_wide_tree_across_ranks_and_keeps_every_sequence_once():
    wide, small = wide_tree(8, 40), wide_tree(2, 10, seed=1)
    trees = [small, wide]
    whole = assign(trees, 2)
    cut = assign(trees, 2, split=True)
    slowest = [max(DEFAULT_COST.of_batch(r) for r in a) for a in (whole, cut)]
    mean = DEFAULT_COST.of_batch(trees) / 2
    assert slowest[0] / mean > 1.5 and slowest[1] / mean < 1.1, (slowest, mean)
    # the wide tree is on both ranks; the sequences, weights and masks are those of the input
    assert all(any(t.sequence(0)[:4].tolist() == wide.sequence(0)[:4].tolist()
                   for t in r) for r in cut)
    assert sequences_of(t for r in cut for t in r) == sequences_of(trees)
    # each rank's share packed with the global count: the weights add up to the whole batch's
    total = sum(t.num_sequences for t in trees)
    w = sum(treefx.pack(r, reduction="mean", num_sequences=total).loss_weights.sum()
            for r in cut)
    assert np.isclose(float(w), float(treefx.pack(trees, reduction="mean").loss_weights.sum()),
                      rtol=1e-12)
    assert assign(trees, 2, split=True)[0][0].sequence(0).tolist() == \
        cut[0][0].sequence(0).tolist()  # deterministic
    # one wide tree, more ranks than trees: cut so that every rank gets a piece
    four = assign([wide], 4, split=True)
    assert all(four) and sequences_of(t for r in four for t in r) == sequences_of([wide])


def test_assign_split_leaves_trees_whole_where_a_cut_does_not_pay():
    # a comb (each call extends the last, reasoning dropped): a piece repeats the trunk
    comb = treefx.synth.dataset(1, seed=2, vocab_size=VOCAB, rollouts=1, turns=(6, 6))[0]
    trees = [comb] + small_agent_trees(5, seed=4)
    assert [[id(t) for t in r] for r in assign(trees, 2, split=True)] == \
        [[id(t) for t in r] for r in assign(trees, 2)]
    # balanced already: nothing to cut
    trees = small_agent_trees(12, seed=5)
    assert [[id(t) for t in r] for r in assign(trees, 3, split=True)] == \
        [[id(t) for t in r] for r in assign(trees, 3)]
    one = treefx.Tree.from_sequences([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="1 trees cannot be assigned to 2 ranks"):
        assign([one], 2, split=True)


def test_cost_model_validation():
    for kw in (dict(per_token=-1.0, per_pair=0.0), dict(per_token=1.0, per_pair=float("nan")),
               dict(per_token=1.0, per_pair=1.0, per_tree=float("inf"))):
        with pytest.raises(ValueError, match="finite and non-negative"):
            CostModel(**kw)
    with pytest.raises(ValueError, match="every coefficient 0"):
        CostModel(per_token=0, per_pair=0)
    with pytest.raises(TypeError, match="must be a number"):
        CostModel(per_token="1", per_pair=0)
    c = CostModel(per_token=2, per_pair=3, per_tree=5)
    t = odd_tree(0, VOCAB)
    assert c(t) == 2 * t.num_tokens + 3 * attended_pairs(t) + 5
    assert c.of_batch([t, t]) == 2 * c(t) and c.of_batch(t) == c(t)
    with pytest.raises(TypeError):
        c([1, 2, 3])


# ---------------------------------------------------------------------- from a config


def test_cost_model_from_a_qwen3_config():
    transformers = pytest.importorskip("transformers")
    shape = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                 vocab_size=151936)
    cfg = transformers.Qwen3Config(**shape)
    cost = CostModel.from_config(cfg)
    h, L, H, kv, d, i, v = (shape[k] for k in ("hidden_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads",
                                               "head_dim", "intermediate_size", "vocab_size"))
    per_layer = 2 * h * H * d + 2 * h * kv * d + 3 * h * i
    assert cost.per_token == 6 * (L * per_layer + v * h)
    assert cost.per_pair == 3.5 * 4 * H * d * L
    assert cost.per_tree == 0
    # The default is this shape's FLOP ratio (a placeholder until measured on the GPU).
    assert cost == DEFAULT_COST
    # A dict config and a config object agree.
    assert CostModel.from_config(dict(shape, model_type="qwen3")) == cost


def test_cost_model_from_moe_configs_counts_active_experts():
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=1000)
    moe = transformers.Qwen3MoeConfig(**common, intermediate_size=1024, moe_intermediate_size=128,
                                      num_experts=16, num_experts_per_tok=2)
    h = 256
    attn = 2 * h * 4 * 64 + 2 * h * 2 * 64
    want = 6 * (4 * (attn + 3 * h * 2 * 128 + h * 16) + 1000 * h)
    assert CostModel.from_config(moe).per_token == want
    # All experts would be 8 times the expert FLOPs: the active ones are what runs.
    dense = CostModel.from_config(transformers.Qwen3Config(**common, intermediate_size=16 * 128))
    assert CostModel.from_config(moe).per_token < dense.per_token
    # Hybrid layers: only attention layers attend pairs.
    nxt = transformers.Qwen3NextConfig(**common, layer_types=["linear_attention",
                                       "linear_attention", "linear_attention",
                                       "full_attention"])
    assert CostModel.from_config(nxt).per_pair == 3.5 * 4 * 4 * 64 * 1
    with pytest.raises(ValueError, match="num_hidden_layers"):
        CostModel.from_config(dict(hidden_size=8, num_attention_heads=2))


# ---------------------------------------------------------------------- measured


def test_cost_model_measure_on_a_tiny_model_cpu(monkeypatch):
    """measure's plumbing on a real model's steps, against a clock that a known cost drives:
    each step runs the real model and moves the clock 2 ms per token plus 5 ms, so the fit
    must give per_token = 2 ms and nothing per pair or tree (the 5 ms is the dropped
    intercept). A wall clock would make this test flaky: tiny steps on a loaded CI machine
    do not reliably grow with tokens."""
    from support import hf_model

    from treefx.distributed import timing

    model = hf_model("qwen3", "sdpa")
    tm = treefx.compile(model, backend="eager", verify=False)
    calls = []
    clock = [0.0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def step_fn(batch):
        calls.append(batch.num_tokens)
        loss = treefx.tree_loss(tm(batch), batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        clock[0] += 2e-3 * batch.num_tokens + 5e-3

    cost = CostModel.measure(step_fn, (64, 128, 256), device="cpu", repeats=2,
                             vocab_size=VOCAB)
    assert len(calls) == 9 * 3  # 3 batches per size, 1 warm-up + 2 timed each
    assert cost.per_token == pytest.approx(2e-3, rel=1e-6)
    assert cost.per_pair == pytest.approx(0, abs=1e-9)
    assert cost.per_tree == pytest.approx(0, abs=1e-9)
    parts = assign(small_agent_trees(6), 2, cost=cost)
    assert sorted(len(p) for p in parts)[0] >= 1
    # Trees (or lists of trees) as samples; bad arguments.
    trees = small_agent_trees(4)
    CostModel.measure(step_fn, [trees[0], trees[1:3], trees[3], [trees[0], trees[3]]],
                      device="cpu", repeats=1, warmup=0)
    with pytest.raises(TypeError, match="step_fn"):
        CostModel.measure(None)
    with pytest.raises(ValueError, match="repeats"):
        CostModel.measure(step_fn, (64,), repeats=0)
    with pytest.raises(TypeError, match="mixes"):
        CostModel.measure(step_fn, [trees[0], 64])


# ---------------------------------------------------------------------- loss_scale in pack


def test_loss_scale_multiplies_every_weight_and_rl_coefficient():
    trees = odd_forest(2, VOCAB)
    for reduction in ("sum", "mean"):
        plain = treefx.pack(trees, reduction=reduction, num_sequences=40)
        scaled = treefx.pack(trees, reduction=reduction, num_sequences=40, loss_scale=3)
        assert plain.loss_scale == 1.0 and scaled.loss_scale == 3.0
        assert scaled.num_sequences_normalizer == 40
        for r in ("sum", "mean"):
            torch.testing.assert_close(scaled.loss_weights_for(r), 3 * plain.loss_weights_for(r),
                                       rtol=1e-15, atol=0)
        torch.testing.assert_close(rl.token_sums(scaled), scaled.loss_weights, rtol=1e-13,
                                   atol=1e-17)
        torch.testing.assert_close(rl.path_incidence(scaled).coef,
                                   3 * rl.path_incidence(plain).coef, rtol=1e-15, atol=0)
        assert scaled.to("cpu").loss_scale == 3.0
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="loss_scale"):
            treefx.pack(trees, loss_scale=bad)
    with pytest.raises(TypeError, match="loss_scale"):
        treefx.pack(trees, loss_scale="2")


def test_distributed_pack_needs_a_process_group_and_sets_its_own_count():
    import torch.distributed as dist

    assert not (dist.is_available() and dist.is_initialized())
    trees = odd_forest(0, VOCAB)
    with pytest.raises(RuntimeError, match="init_process_group.*treefx.pack"):
        distributed.pack(trees)
    with pytest.raises(TypeError, match="sets num_sequences itself"):
        distributed.pack(trees, num_sequences=10)
    with pytest.raises(TypeError, match="sets loss_scale itself"):
        distributed.pack(trees, loss_scale=2)


# ---------------------------------------------------------------------- two gloo ranks


def global_trees() -> list[treefx.Tree]:
    """Three odd trees (prefix and duplicate sequences, weights, loss masks), split unevenly:
    rank 0 one tree (13 sequences), rank 1 two (26)."""
    return [odd_tree(11, VOCAB), odd_tree(12, VOCAB, masks=False), odd_tree(13, VOCAB)]


def shares(trees):
    return [trees[:1], trees[1:]]


def advantages_for(trees) -> torch.Tensor:
    """Per-sequence advantages of the global batch, computed once for all of it (as GRPO's
    group statistics must be), then each rank takes its sequences'."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(sum(t.num_sequences for t in trees), generator=g, dtype=torch.float64)


def old_logprobs_of(batch, lp: torch.Tensor) -> torch.Tensor:
    """A sampling policy a little off the current one, per token by token id (so the same on a
    rank's batch and the global batch): ratios up to e^±0.3, some clipped."""
    return lp.detach() - 0.1 * ((batch.input_ids[0] % 7) - 3).to(lp.dtype)


def objectives(tm, batch, advantages):
    """name -> a function computing that objective on ``batch``."""
    def out():
        return tm(batch)

    def ppo():
        lp = out().token_logprobs
        return rl.ppo_clip_loss(lp, batch, advantages, old_logprobs_of(batch, lp))

    def kl():
        lp = out().token_logprobs
        return rl.kl_penalty(lp, batch, old_logprobs_of(batch, lp), estimator="k3", coef=0.5)

    return {
        "tree_loss": lambda: treefx.tree_loss(out(), batch),
        "policy_gradient": lambda: rl.policy_gradient_loss(out().token_logprobs, batch,
                                                           advantages),
        "ppo_clip": ppo,
        "kl_k3": kl,
    }


def tiny_qwen3():
    from support import hf_model

    return hf_model("qwen3", "sdpa", torch.float64)


def _worker(rank: int, store: str, out_dir: str) -> None:
    """One rank: pack its share with treefx.distributed.pack, compute every objective and its
    gradients, save them to out_dir/rank{rank}.pt (a traceback to rank{rank}.err on failure)."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        model = tiny_qwen3()
        tm = treefx.compile(model, backend="eager", verify=False)
        trees = global_trees()
        mine = shares(trees)[rank]
        start = sum(t.num_sequences for t in shares(trees)[0]) if rank else 0
        adv = advantages_for(trees)[start:start + sum(t.num_sequences for t in mine)]
        results = {}
        for reduction in ("mean", "sum"):
            batch = distributed.pack(mine, reduction=reduction, pad_to_multiple=8)
            results[reduction] = {
                "normalizer": batch.num_sequences_normalizer,
                "loss_scale": batch.loss_scale,
                "num_sequences": batch.num_sequences,
                **{name: value_and_grads(model, fn)
                   for name, fn in objectives(tm, batch, adv).items()},
            }
        # Invalid input on one rank raises on every rank (nobody waits in the collective).
        errors = {}
        for case, mine_, reduction in (("no trees", [] if rank else mine, "mean"),
                                       ("reductions", mine, "mean" if rank else "sum")):
            try:
                distributed.pack(mine_, reduction=reduction)
                errors[case] = None
            except Exception as e:  # noqa: BLE001 - recorded for the parent to check
                errors[case] = (type(e).__name__, str(e))
        results["errors"] = errors
        if rank == 0:
            # The single-process reference: one process, the whole global batch, no
            # collectives (computed here to reuse this process's compiled model).
            results["reference"] = {}
            for reduction in ("mean", "sum"):
                whole = treefx.pack(trees, reduction=reduction)
                results["reference"][reduction] = {
                    name: value_and_grads(model, fn)
                    for name, fn in objectives(tm, whole, advantages_for(trees)).items()}
                # Each share averaged over its own sequences (no global count, no scale).
                results["reference"][reduction]["own_means"] = [
                    treefx.tree_loss(tm(b), b).detach() for b in
                    (treefx.pack(s, reduction=reduction) for s in shares(trees))]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(tmp_path) -> list[dict]:
    """Spawn WORLD workers; any child's failure fails the test with its traceback, and no child
    outlives CHILD_TIMEOUT_S."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    store = str(tmp_path / "store")
    procs = [ctx.Process(target=_worker, args=(r, store, str(tmp_path)), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)

    def errors():
        return "\n".join(f"--- rank {r} ---\n{(tmp_path / f'rank{r}.err').read_text()}"
                         for r in range(WORLD) if (tmp_path / f"rank{r}.err").exists())

    if any(p.exitcode != 0 for p in procs):
        codes = [p.exitcode for p in procs]
        timed_out = time.monotonic() > deadline
        pytest.fail(f"distributed workers failed (exit codes {codes}"
                    f"{', timed out' if timed_out else ''}):\n{errors()}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_pack_over_two_gloo_ranks_averages_to_the_global_batch(tmp_path):
    ranks = run_ranks(tmp_path)
    total = sum(t.num_sequences for t in global_trees())
    for reduction in ("mean", "sum"):
        got = [r[reduction] for r in ranks]
        reference = ranks[0]["reference"][reduction]
        assert [g["normalizer"] for g in got] == [total] * WORLD
        assert [g["loss_scale"] for g in got] == [float(WORLD)] * WORLD
        assert [g["num_sequences"] for g in got] == [13, 26]  # uneven shares
        for name in ("tree_loss", "policy_gradient", "ppo_clip", "kl_k3"):
            want_value, want_grads = reference[name]
            # What DDP / FSDP do: average the rank gradients (and so the losses) over W.
            value = sum(g[name][0] for g in got) / WORLD
            torch.testing.assert_close(value, want_value, rtol=1e-12, atol=1e-14,
                                       msg=f"{reduction} {name}")
            assert want_grads.keys() == got[0][name][1].keys() == got[1][name][1].keys()
            for p, want in want_grads.items():
                avg = sum(g[name][1][p] for g in got) / WORLD
                torch.testing.assert_close(avg, want, rtol=GRAD_RTOL,
                                           atol=GRAD_RTOL * float(want.abs().max()),
                                           msg=f"{reduction} {name} grad {p}")
        # Without the global count and the scale (each rank its own mean) it would be wrong.
        own = sum(reference["own_means"]) / WORLD
        want = reference["tree_loss"][0]
        assert abs(float(own - want)) > 1e-3 * abs(float(want))
    errs = [r["errors"] for r in ranks]
    assert errs[1]["no trees"][0] == "ValueError" and "no trees" in errs[1]["no trees"][1]
    assert errs[0]["no trees"][0] == "RuntimeError" and "1 other rank" in errs[0]["no trees"][1]
    for e in errs:
        assert e["reductions"][0] == "ValueError" and "disagree on the reduction" in \
            e["reductions"][1]


def test_assign_then_pack_by_hand_matches_the_global_batch():
    """What each rank of ``assign`` + ``distributed.pack`` gets, without processes: the global
    count and the world size; the rank weights sum to W times the global batch's."""
    trees = odd_forest(4, VOCAB) + small_agent_trees(4)
    world = 3
    parts = assign(trees, world)
    total = sum(t.num_sequences for t in trees)
    whole = treefx.pack(trees, reduction="mean")
    summed = sum(float(treefx.pack(p, reduction="mean", num_sequences=total,
                                   loss_scale=world).loss_weights.sum()) for p in parts)
    assert np.isclose(summed / world, float(whole.loss_weights.sum()), rtol=1e-12)
