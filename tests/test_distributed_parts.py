"""``treefx.backward`` (trees in parts) on several processes: FSDP2 (``fully_shard`` per decoder
layer and root) and DDP, two CPU processes on the gloo backend.

The ranks plan their trees into different numbers of parts (rank 0 holds the largest tree and a
budget of a few tokens, rank 1 the rest in one part each; under FSDP2 ``treefx.backward`` then
replans rank 1 to as many parts as rank 0, ``treefx.parts.plan_even``, so parts of different
sizes and contexts meet in every round), or one rank has no trees at all (every round of it a
dummy), or ``assign(split=True)`` cuts one tree across the ranks.
The oracle is the unmodified model run on each sequence of the union of all ranks' trees in one
process, with the global mean over sequences: every rank's gathered gradients
(``full_tensor()`` under FSDP, the reduced ``.grad`` under DDP) and the mean of the ranks'
losses must equal its own. One spawn runs every case (see tests/test_distributed.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from test_distributed import (FLOOR_FACTOR, GRAD_TOL, VOCAB, WORLD, _model, _trees, hf_step,
                              run_cases)

import treefx
from treefx.run.parts import runners

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

# (case, model, wrapper, how the loss is computed, activation checkpointing, reduction, split)
# split "uneven": rank 0 the largest tree at a budget of 5 tokens, rank 1 the others whole;
# "empty": rank 0 every tree at a budget of 5, rank 1 none; "cut": a wide tree added (six
# completions off one prompt), ``assign(split=True)`` cuts it across the ranks, both at 5.
CASES = [
    ("fsdp-qwen3-uneven", "qwen3", "fsdp", "compile", False, "mean", "uneven"),
    ("fsdp-qwen3-checkpointing", "qwen3", "fsdp", "compile", True, "sum", "uneven"),
    ("fsdp-qwen3_next-uneven", "qwen3_next", "fsdp", "compile", False, "mean", "uneven"),
    ("fsdp-qwen3_next-step", "qwen3_next", "fsdp", "step", True, "mean", "uneven"),
    ("fsdp-qwen3-empty", "qwen3", "fsdp", "compile", False, "mean", "empty"),
    ("ddp-qwen3-uneven", "qwen3", "ddp", "compile", False, "mean", "uneven"),
    ("ddp-qwen3_next-uneven", "qwen3_next", "ddp", "compile", True, "mean", "uneven"),
    ("ddp-qwen3-empty", "qwen3", "ddp", "step", False, "mean", "empty"),
    ("fsdp-qwen3-cut", "qwen3", "fsdp", "compile", True, "mean", "cut"),
    ("ddp-qwen3_next-cut", "qwen3_next", "ddp", "compile", False, "mean", "cut"),
]
# In CI: FSDP2 on the hybrid, a rank without trees under FSDP2, DDP, and FSDP2 with
# checkpointing on a tree cut across the ranks
CI_CASES = {"fsdp-qwen3_next-uneven", "fsdp-qwen3-empty", "ddp-qwen3-uneven", "fsdp-qwen3-cut"}
BUDGET = 5  # rank 0's: parts of a few tokens


def _wide():
    """Six completions of 25 tokens off one 3-token prompt."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 3).tolist()
    return treefx.Tree.from_sequences([prompt + rng.integers(0, VOCAB, 25).tolist()
                                       for _ in range(6)])


def _split(trees, rank: int, split: str):
    """This rank's trees and budget."""
    if split == "cut":
        return treefx.distributed.assign(trees, WORLD, split=True)[rank], BUDGET
    if split == "empty":
        return (trees, BUDGET) if rank == 0 else ([], BUDGET)
    big = max(range(len(trees)), key=lambda i: trees[i].num_tokens)
    if rank == 0:
        return [trees[big]], BUDGET
    return [t for i, t in enumerate(trees) if i != big], 10_000


def _case(rank, name, model_name, wrapper, how, checkpointing, reduction, split):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    trees = _trees() + ([_wide()] if split == "cut" else [])
    mine, budget = _split(trees, rank, split)
    model = _model(model_name, checkpointing)
    oracle = copy.deepcopy(model)
    # one process on the union of all ranks' trees, the global mean over sequences
    treefx.reference.sequence_loss(oracle, trees, reduction=reduction).backward()
    if wrapper == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        held, inner = model, model
    else:
        held = DistributedDataParallel(model)
        inner = model
    batch = treefx.distributed.pack(mine, reduction=reduction, allow_empty=True)
    if how == "compile":
        tm = treefx.compile(held, backend="eager")
        loss = treefx.backward(tm, batch, max_tokens=budget)
    else:
        if reduction != "mean":
            raise ValueError("the HF step computes the mean")
        loss = treefx.backward(hf_step, batch, model=held, max_tokens=budget)
    num_parts = treefx.parts.plan(batch, budget).num_parts if batch is not None else 0
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref = dict(oracle.named_parameters())
    # the oracle's own floor per parameter (Gated DeltaNet's A_log and dt_bias: see
    # tests/test_distributed.py)
    spread = treefx.verification.oracle_floor_gradients(oracle, trees, reduction=reduction)

    def rel(a, r):
        return float((a - r).abs().max() / r.abs().max().clamp_min(1e-30))

    worst, where = 0.0, None  # error / tolerance, worst over the parameters
    for n, p in inner.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = ref[n].grad
        tol = max(GRAD_TOL, FLOOR_FACTOR * rel(spread[n], r))
        if rel(g, r) / tol > worst:
            worst, where = rel(g, r) / tol, (n, rel(g, r), tol)
    # a second call on the same model: nothing left behind by the first (held dummies, FSDP's
    # state), the gradients add up (here: twice the oracle's)
    recaptured = 0
    if split == "empty" and wrapper == "fsdp" and rank == 0:
        # rank 0 alone captures its part graph again (its captures dropped): the other rank
        # must gather and free every unit as often, or the collectives pair up wrongly
        (runner,) = runners(tm)
        recaptured = -len(runner.engine.compiled)
        runner.engine._regional.clear()
    if how == "compile":
        treefx.backward(tm, batch, max_tokens=budget)
    else:
        treefx.backward(hf_step, batch, model=held, max_tokens=budget)
    if recaptured:
        recaptured += len(runner.engine.compiled)
    again = 0.0
    for n, p in inner.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        r = 2 * ref[n].grad
        tol = max(GRAD_TOL, FLOOR_FACTOR * rel(spread[n], r))
        again = max(again, rel(g, r) / tol)
    ref_loss = treefx.reference.sequence_loss(oracle, trees, reduction=reduction)
    return {"loss": float(total) / WORLD, "ref_loss": float(ref_loss),
            "grad_err_over_tol": worst, "worst_param": where, "again_err_over_tol": again,
            "my_trees": len(mine), "num_parts": num_parts, "recaptured": recaptured,
            "wide_prompt": any(t.sequence(0)[:3].tolist() == _wide().sequence(0)[:3].tolist()
                               for t in mine)}


@pytest.fixture(scope="module")
def results(request):
    return run_cases(request, CASES, _case)


@pytest.mark.parametrize("case", [c[0] if c[0] in CI_CASES else
                                  pytest.param(c[0], marks=pytest.mark.slow) for c in CASES])
def test_parts_on_several_ranks_equal_one_process_on_all_trees(results, case):
    split = next(c[6] for c in CASES if c[0] == case)
    rs = [results[(rank, case)] for rank in range(WORLD)]
    for rank, r in enumerate(rs):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"]), r
        assert r["grad_err_over_tol"] <= 1.0, r  # (name, relative error, tolerance)
        assert r["again_err_over_tol"] <= 1.0, r
    # what the case is about: the ranks ran different numbers of parts, or one had no trees
    if split == "empty":
        assert rs[1]["my_trees"] == 0 and rs[1]["num_parts"] == 0 and rs[0]["num_parts"] > 2
        if case.startswith("fsdp"):
            assert rs[0]["recaptured"] == 1 and rs[1]["recaptured"] == 0
    elif split == "cut":  # pieces of the wide tree on both ranks
        assert all(r["wide_prompt"] and r["num_parts"] >= 1 for r in rs), rs
    else:
        assert rs[0]["num_parts"] > rs[1]["num_parts"] >= 1, rs
