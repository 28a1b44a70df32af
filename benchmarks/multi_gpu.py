"""Several GPUs, one process each (torchrun; plain ``python``: one process), treefx against
sequence packing (issue 37; BENCHMARKS.md, "Several GPUs"; benchmarks/README.md for commands)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import random
import re
import statistics
import time
import traceback

import torch
import torch.distributed as dist

import treefx
from benchmarks import common
from benchmarks.common import SHAPES, check_forest, odd_forest
from benchmarks.gpu_check import SMALL, TINY
from benchmarks.internals import agree_captures, recurrence_registry
from benchmarks.real_trees import (_top_id, call_chains, file_provenance, packing_batches,
                                   synthetic_combs)

START = time.perf_counter()
PAD = treefx.Tree.from_sequences([[0] * 16], weights=[0.0])  # a zero-weight micro-batch
FLOOR_FACTOR = treefx.verification.FLOOR_FACTOR
# a parameter's gradient relative to its largest entry or to this share of the model's
# largest (treefx.verify's floor: random Gated DeltaNet heads' gradients cancel to rounding)
SCALE_FLOOR = treefx.verification.Tolerance.floor
GRAD_TOL, LOSS_TOL = 1e-5, 1e-5
SPEED_LOSS_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # treefx's loss against packing's


def say(msg: str) -> None:
    """A progress line from rank 0, with the seconds since the start."""
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - START:7.1f} s] {msg}", flush=True)


def gathered(x) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def mean_over_ranks(loss: torch.Tensor, dev) -> float:
    """The mean over the ranks of their losses: the global batch's loss."""
    t = loss.detach().to(device=dev, dtype=torch.float64).reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _late(time_limit) -> bool:
    """Rank 0's clock decides for every rank (they must skip the same work)."""
    flag = [time_limit is not None and time.perf_counter() - START > time_limit]
    dist.broadcast_object_list(flag, src=0)
    return flag[0]


# ----------------------------------------------------------------------------- steps and timing


def tree_step(tm, opt, batch, budget, dev):
    """``treefx.backward`` in parts of ``budget`` (None: the batch whole), then the optimizer."""
    whole = None if budget else batch.to(dev)

    def step(first=False):
        if budget:
            loss = treefx.backward(tm, batch, max_tokens=budget)
        else:
            loss = treefx.tree_loss(tm(whole), whole)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def packing_step(tm, held, opt, calls, capacity, num_sequences, loss_scale, dev, fsdp,
                 grad_sync="last"):
    """``calls`` packed first-fit decreasing into micro-batches of at most ``capacity`` tokens,
    gradients accumulated and synchronized on the last (or ``grad_sync="every"``), then the
    optimizer; under FSDP2 as many micro-batches on every rank (zero-weight padding ones)."""
    micro = packing_batches(calls, capacity, num_sequences=num_sequences, loss_scale=loss_scale)
    pad = max(gathered(len(micro))) - len(micro) if fsdp else 0
    pad_batch = treefx.pack(PAD, reduction="mean", num_sequences=num_sequences,
                            loss_scale=loss_scale)
    batches = [b.to(dev) for b in micro + [pad_batch] * pad]
    info = {"micro_batches": len(micro), "padding_micro_batches": pad,
            "micro_batch_tokens": [b.num_tokens for b in micro],
            "computed_tokens": sum(b.num_tokens for b in micro)}

    def step(first=False):
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for i, b in enumerate(batches):
            last = i == len(batches) - 1
            if fsdp:
                tm.model.set_requires_gradient_sync(grad_sync == "every" or last)
                agree_captures(tm, b)
            with contextlib.nullcontext() if fsdp or last else held.no_sync():
                loss = treefx.tree_loss(tm(b), b)
                loss.backward()
            total += loss.detach().to(total.dtype)
            if first:
                say(f"packing: first step, micro-batch {i + 1}/{len(batches)} done")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, info


def measure(name: str, step, steps: int, dev, time_limit=None, on_step=lambda r: None,
            warm: int = 0) -> dict:
    """The first step alone, ``warm`` untimed ones, then up to ``steps`` timed ones (none
    starts past ``time_limit``), the ranks synchronized around each; ``on_step(result)``
    after each."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    common.dist_sync(dev)
    g0 = common.unique_graphs()
    t0 = time.perf_counter()
    loss = step(first=True)
    common.dist_sync(dev)
    first = time.perf_counter() - t0
    for _ in range(warm):
        step()
    if cuda and warm:
        torch.cuda.reset_peak_memory_stats(dev)
    g1 = common.unique_graphs()
    res = {"first_step_s": first, "first_loss": mean_over_ranks(loss, dev), "step_times_s": [],
           "own_times_s": [], "losses": [], "graphs_first_step": g1 - g0}
    say(f"{name}: first step {first:.1f} s (capture and compile), loss {res['first_loss']:.6f}")
    on_step(res)
    for k in range(steps):
        if _late(time_limit):
            res["stopped"] = f"time limit after {k} timed steps"
            say(f"{name}: time limit passed: {k} timed steps")
            break
        common.dist_sync(dev)
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize(dev)
        res["own_times_s"].append(time.perf_counter() - t0)
        dist.barrier()
        res["step_times_s"].append(time.perf_counter() - t0)
        res["losses"].append(mean_over_ranks(loss, dev))
        say(f"{name}: step {k + 1}/{steps} {res['step_times_s'][-1]:.2f} s")
        on_step(res)
    own = statistics.median(res["own_times_s"]) if res["own_times_s"] else None
    per_rank = gathered([own, torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
                         torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else None,
                         g1 - g0, common.unique_graphs() - g1])
    res.update({key: [x[i] for x in per_rank] for i, key in enumerate(
        ("step_s_per_rank", "peak_gib_per_rank", "reserved_gib_per_rank",
         "graphs_first_step_per_rank", "graphs_in_timed_steps_per_rank"))})
    res["timed_steps"] = len(res["step_times_s"])
    res["step_s"] = statistics.median(res["step_times_s"]) if res["step_times_s"] else first
    if not res["step_times_s"]:
        res["step_s_note"] = "no timed step: the first step's time"
    del res["graphs_first_step"]
    return res


# ----------------------------------------------------------------------------- real trees


def select_trees(args, vocab: int) -> tuple[list[tuple[int, treefx.Tree]], dict]:
    """The run's trees with their index in the file (the same on every rank), provenance."""
    if args.trees:
        pool = list(treefx.read_jsonl(args.trees))
        prov = dict(file_provenance(args.trees), trees_in_file=len(pool))
    else:
        pool, prov = synthetic_combs(args.tasks, vocab, args.seed, args.dry_run)
    limit = args.max_sequence_tokens
    fits = [i for i, t in enumerate(pool) if limit is None or t.num_baseline_tokens <= limit]
    if len(fits) < args.tasks:
        raise SystemExit(f"only {len(fits)} of {len(pool)} trees pass the size filter; "
                         f"--tasks {args.tasks} wants more")
    chosen = sorted(random.Random(args.seed).sample(fits, args.tasks))
    prov["candidates"] = len(fits)
    for i in chosen:
        if _top_id(pool[i]) >= vocab:
            raise SystemExit(f"tree {i}: a token id is not below the vocabulary of {vocab:,}")
    prov["selected"] = chosen
    return [(i, pool[i]) for i in chosen], prov


def _max_over_mean(xs) -> float:
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean else 1.0


def run_trees(args, dev) -> dict:
    cuda, rank, world = dev.type == "cuda", dist.get_rank(), dist.get_world_size()
    out = common.resolve_out(args, "multi_gpu", cuda)
    shape = dict(SHAPES[args.shape], num_hidden_layers=args.layers or
                 SHAPES[args.shape]["num_hidden_layers"], model_type="qwen3")
    if args.dry_run and args.trees:
        shape["vocab_size"] = SHAPES["qwen3-8b"]["vocab_size"]  # real ids
    vocab = shape["vocab_size"]
    tasks, prov = select_trees(args, vocab)
    trees = [t for _, t in tasks]
    index = {id(t): i for i, t in tasks}
    if len(trees) < world:
        raise SystemExit(f"{len(trees)} trees for {world} ranks: --tasks at least {world}")
    cost = treefx.distributed.CostModel.from_config(shape)
    shares = treefx.distributed.assign(trees, world, cost=cost, order=args.order)
    num_sequences = sum(t.num_sequences for t in trees)
    capacity = max(args.budget, max(int(t.sequence_lengths.max()) for t in trees))
    pack_shares = treefx.distributed.assign(call_chains(trees), world, cost=cost)
    tree_tokens = [sum(t.num_tokens for t in s) for s in shares]
    seq_tokens = [sum(t.num_baseline_tokens for t in s) for s in shares]
    pack_tokens = [sum(t.num_tokens for t in s) for s in pack_shares]
    balance = {"cost_max_over_mean": _max_over_mean([cost.of_batch(s) for s in shares]),
               "tree_tokens_max_over_mean": _max_over_mean(tree_tokens),
               "sequence_tokens_max_over_mean": _max_over_mean(seq_tokens),
               "packing_cost_max_over_mean": _max_over_mean([cost.of_batch(s)
                                                             for s in pack_shares]),
               "packing_tokens_max_over_mean": _max_over_mean(pack_tokens),
               "cost": "CostModel.from_config (FLOPs)"}
    bound = sum(seq_tokens) / sum(tree_tokens)
    say(f"{len(trees)} trees {prov['selected']}: {sum(tree_tokens):,} tree tokens, "
        f"{sum(seq_tokens):,} sequence tokens (bound {bound:.2f}x), {num_sequences} calls; "
        f"{world} rank(s), budget {args.budget}, packing capacity {capacity}; balance "
        f"(max/mean cost) {balance['cost_max_over_mean']:.3f}")
    res = {"meta": dict(common.run_meta(cuda), world_size=world), "args": vars(args),
           "data": prov,
           "model": {"type": "qwen3", "shape": args.shape, **shape,
                     "dtype": "bf16 compute, fp32 master" if cuda else "float32",
                     "checkpointing": True, "backend": "inductor" if cuda else "eager"},
           "trees_per_rank": [[index[id(t)] for t in s] for s in shares],
           "tree_tokens_per_rank": tree_tokens, "sequence_tokens_per_rank": seq_tokens,
           "packing_tokens_per_rank": pack_tokens, "bound": bound,
           "packing_capacity": capacity, "balance": balance, "methods": {}, "summary": {}}
    if cuda:
        res["meta"]["gpus"] = gathered(torch.cuda.get_device_name(dev))

    def save():
        if rank == 0:
            common.save_json(res, out)

    t0 = time.perf_counter()
    model = common.fsdp_qwen3(args.shape, dev, True, args.layers, vocab)
    res["build_s"] = time.perf_counter() - t0
    initial = [p.detach().to_local().to("cpu", copy=True) for p in model.parameters()] \
        if len(args.methods) > 1 else None  # the second method starts from the same shards
    tm = treefx.compile(model, backend="inductor" if cuda else "eager", logits=False,
                        verify=False)
    lr = 1e-6 if cuda else 1e-3  # the dry run's shows weights not put back
    for n, name in enumerate(args.methods):
        if n:
            with torch.no_grad():
                for p, x in zip(model.parameters(), initial):
                    p.to_local().copy_(x)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda or None)
        if name == "treefx":
            batch = treefx.distributed.pack(shares[rank], allow_empty=True)
            plan = treefx.parts.plan(batch, args.budget, recompute=False) \
                if batch is not None else None
            info = {"parts": plan.num_parts if plan else 0,
                    "peak_held_tokens": plan.peak_held_tokens() if plan else 0,
                    "computed_tokens": batch.num_tokens if batch is not None else 0}
            step = tree_step(tm, opt, batch, args.budget, dev)
        else:
            step, info = packing_step(tm, model, opt, pack_shares[rank], capacity,
                                      num_sequences, world, dev, True, args.grad_sync)
        infos = gathered(info)
        entry = res["methods"][name] = {k: [i[k] for i in infos] for k in infos[0]}
        r = measure(name, step, args.steps, dev, args.time_limit,
                    lambda r, entry=entry: (entry.update(r), save()))
        entry.update(r, unique_tokens_per_s=sum(tree_tokens) / r["step_s"],
                     sequence_tokens_per_s=sum(seq_tokens) / r["step_s"],
                     computed_tokens_per_s=sum(entry["computed_tokens"]) / r["step_s"],
                     sequence_tokens_per_s_per_gpu=sum(seq_tokens) / r["step_s"] / world)
        say(f"{name}: step {r['step_s']:.3f} s, {entry['sequence_tokens_per_s']:,.0f} sequence "
            f"tokens/s, peak {r['peak_gib_per_rank']} GiB")
        del opt, step
        common.free_memory(model, cuda)
        save()
    m = res["methods"]
    if {"treefx", "packing"} <= set(m):
        t, q = m["treefx"], m["packing"]
        diff = abs(t["first_loss"] - q["first_loss"]) / max(abs(q["first_loss"]), 1e-30)
        s = res["summary"] = {"bound": bound, "loss_rel_diff": diff,
                              "losses_agree": diff <= (1e-2 if cuda else 1e-5),
                              "first_loss": {"treefx": t["first_loss"],
                                             "packing": q["first_loss"]}, "speedup": None}
        if t["timed_steps"] and q["timed_steps"]:  # a first step is no step time to compare
            s["speedup"] = q["step_s"] / t["step_s"]
            s["share_of_bound"] = s["speedup"] / bound
        say(f"summary: {s}")
    res["elapsed_s"] = time.perf_counter() - START
    save()
    say(f"saved {out}")
    return res


# ----------------------------------------------------------------------------- --check


def _whole_grads(model) -> dict:
    """Every parameter's whole gradient (FSDP2's shards gathered: every rank calls it)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[n] = None if g is None else g.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def _float64_oracle_grads(model, trees) -> dict:
    """The oracle's gradients in float64 throughout: the values the float32 oracle rounds (its
    floor where Gated DeltaNet's kernels cancel, on A_log and dt_bias; tests/test_hybrid.py)."""
    from treefx.tools.zoo import float64_throughout

    wide = copy.deepcopy(model).double()
    wide.zero_grad(set_to_none=True)
    if getattr(wide, "is_gradient_checkpointing", False):
        wide.gradient_checkpointing_disable()  # a recomputation would run outside the mode
    with float64_throughout():
        treefx.reference.sequence_loss(wide, trees, reduction="mean").backward()
    return {n: torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad
            for n, p in wide.named_parameters()}


def _verdict(grads: dict, loss: float, oracle, ref_loss: float, floors: list) -> dict:
    """Rank 0: the gathered gradients and loss against the one-process oracle's, each
    parameter's error beside the oracle's floor (the largest over ``floors``)."""
    refs = {n: torch.zeros_like(p) if p.grad is None else p.grad
            for n, p in oracle.named_parameters()}
    scale = SCALE_FLOOR * max(float(r.abs().max()) for r in refs.values())
    groups, worst, where = {}, 0.0, None
    for n, r in refs.items():
        err = common.max_rel(torch.zeros_like(r) if grads[n] is None else grads[n], r, scale)
        fl = max(common.max_rel(f[n].to(r.dtype), r, scale) for f in floors)
        tol = max(GRAD_TOL, FLOOR_FACTOR * fl)
        grp = groups.setdefault(re.sub(r"\.\d+\.", ".*.", n), {"max_rel_err": 0.0,
                                                               "max_oracle_floor": 0.0,
                                                               "max_err_over_tol": 0.0})
        for key, v in (("max_rel_err", err), ("max_oracle_floor", fl),
                       ("max_err_over_tol", err / tol)):
            grp[key] = max(grp[key], v)
        if err / tol >= worst:
            worst, where = err / tol, [n, err, tol]
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    return {"loss": loss, "ref_loss": ref_loss, "loss_rel_err": loss_err,
            "max_err_over_tol": worst, "worst_param": where, "groups": groups,
            "passed": loss_err <= LOSS_TOL and worst <= 1.0}


def _wrap(model, wrapper: str, dev, mp_policy=None):
    """FSDP2 (the model itself, sharded) or its DDP wrapper."""
    from torch.nn.parallel import DistributedDataParallel

    if wrapper == "fsdp":
        return common.fsdp_shard(model, mp_policy)
    return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)


def exact(ctx, model_type: str, config: dict, wrapper: str, checkpointing: bool) -> dict:
    """Whole trees and parts on every rank against one process on all trees (rank 0)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev, rank, world = ctx["dev"], dist.get_rank(), dist.get_world_size()
    vocab = config["vocab_size"]
    trees = odd_forest(3, vocab) + odd_forest(5, vocab)
    if not ctx["dry_run"]:  # two odd trees more and an agent tree of 6,098 tokens
        trees += check_forest(vocab)
    mine = treefx.distributed.assign(trees, world)[rank]
    model = common.dist_build(model_type, config, dev, checkpointing)
    out = {"model": model_type, "config": config, "wrapper": wrapper,
           "checkpointing": checkpointing, "trees": len(trees),
           "tokens": sum(t.num_tokens for t in trees),
           "sequences": sum(t.num_sequences for t in trees), "trees_per_rank": gathered(len(mine))}
    if rank == 0:
        oracle = copy.deepcopy(model)
        ref_loss = treefx.reference.sequence_loss(oracle, trees, reduction="mean")
        ref_loss.backward()
        floors = [treefx.verification.oracle_floor_gradients(oracle, trees, reduction="mean"),
                  _float64_oracle_grads(model, trees)]
    tm = treefx.compile(_wrap(model, wrapper, dev), backend=ctx["backend"], verify=False)
    batch = treefx.distributed.pack(mine, reduction="mean")
    b = batch.to(dev)
    loss = treefx.tree_loss(tm(b), b)
    loss.backward()
    runs = {"whole": (mean_over_ranks(loss, dev), _whole_grads(model))}
    budget = (8 if ctx["dry_run"] else 256) * (rank + 1)
    plan = treefx.parts.plan(batch, budget, recompute=wrapper != "fsdp")
    out["parts_budget_per_rank"] = gathered(budget)
    out["parts_per_rank"] = gathered(plan.num_parts)
    loss = treefx.backward(tm, batch, max_tokens=budget)
    runs["parts"] = (mean_over_ranks(loss, dev), _whole_grads(model))
    if rank == 0:
        for how, (loss, grads) in runs.items():
            out[how] = _verdict(grads, loss, oracle, float(ref_loss), floors)
            say(f"  {how}: loss rel err {out[how]['loss_rel_err']:.2e}, worst gradient "
                f"{out[how]['worst_param']} (name, rel err, tol)")
        out["passed"] = all(out[how]["passed"] for how in runs)
    return out


def speed(ctx, model_type: str, config: dict, wrapper: str) -> dict:
    """treefx against packing, the same model, data and budget."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.backends.cuda.matmul.allow_tf32 = True
    dev, rank, world = ctx["dev"], dist.get_rank(), dist.get_world_size()
    fsdp = wrapper == "fsdp"
    low = torch.bfloat16 if dev.type == "cuda" else torch.float32
    trees = common.tree_pool(world, ctx["tokens"], ctx["por"], config["vocab_size"],
                             **ctx["lengths"])
    mine = treefx.distributed.assign(trees, world)[rank]
    t0 = time.perf_counter()
    model = common.dist_build(model_type, config, dev, True, dtype=torch.float32 if fsdp else low)
    held = _wrap(model, wrapper, dev,
                 MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32))
    build_s = time.perf_counter() - t0
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # its cost; the weights stay
    tm = treefx.compile(held, backend=ctx["backend"], logits=False, verify=False)
    batch = treefx.distributed.pack(mine, reduction="mean")
    tree_tokens = gathered(batch.num_tokens)
    seq_tokens = gathered(sum(t.num_baseline_tokens for t in mine))
    budget = max(tree_tokens)
    pack, info = packing_step(tm, held, opt, mine, budget, batch.num_sequences_normalizer,
                              batch.loss_scale, dev, fsdp)
    out = {"model": model_type, "config": config, "wrapper": wrapper,
           "precision": f"float32 masters, {str(low)[6:]} compute (FSDP2 mixed precision)"
           if fsdp else f"{str(low)[6:]} parameters", "checkpointing": True,
           "build_s": round(build_s, 1), "trees": len(trees),
           "trees_per_rank": gathered(len(mine)), "tree_tokens_per_rank": tree_tokens,
           "sequence_tokens_per_rank": seq_tokens,
           "por": round(1 - sum(tree_tokens) / sum(seq_tokens), 3),
           "treefx_mode": "whole trees",
           "packing_budget": budget,
           "micro_batches_per_rank": gathered(info["micro_batches"] + info[
               "padding_micro_batches"]),
           "padding_micro_batches_per_rank": gathered(info["padding_micro_batches"])}
    for name, step in (("treefx", tree_step(tm, opt, batch, None, dev)),
                       ("packing", pack)):
        if name == "packing" and _late(ctx["time_limit"]):
            out["packing"] = "skipped: time limit"
            return out
        r = measure(name, step, ctx["steps"], dev, warm=1)
        out[name] = {"first_step_s": round(r["first_step_s"], 2),
                     "step_s": round(r["step_s"], 4), "loss": r["first_loss"],
                     "peak_gib_per_rank": r["peak_gib_per_rank"]}
    out["captures"] = [x.num_compiled for v in tm.engine._regional.values() for x in v]
    bound = sum(seq_tokens) / sum(tree_tokens)
    speedup = out["packing"]["step_s"] / out["treefx"]["step_s"]
    loss_diff = abs(out["treefx"]["loss"] - out["packing"]["loss"]) / abs(out["packing"]["loss"])
    out.update(token_bound=round(bound, 3), speedup=round(speedup, 3),
               share_of_bound=round(speedup / bound, 3), loss_rel_diff=loss_diff,
               passed=loss_diff <= SPEED_LOSS_TOL[low])
    return out


CASES = {
    "fsdp-hybrid-exact": lambda ctx: exact(ctx, "qwen3_next", ctx["shapes"]["exact_hybrid"],
                                           "fsdp", checkpointing=True),
    "ddp-exact": lambda ctx: exact(ctx, "qwen3", ctx["shapes"]["exact_qwen3"], "ddp",
                                   checkpointing=False),
    "fsdp-hybrid-speed": lambda ctx: speed(ctx, "qwen3_next", ctx["shapes"]["speed_hybrid"],
                                           "fsdp"),
    "ddp-speed": lambda ctx: speed(ctx, "qwen3", ctx["shapes"]["speed_qwen3"], "ddp"),
}


def run_check(args, dev) -> int:
    cuda, rank, dry = dev.type == "cuda", dist.get_rank(), args.dry_run
    if dry:
        torch.set_num_threads(1)
    layers = args.layers or 8
    tiny_hybrid = common.hybrid_config(32, 64, 2, 4, 2, 8, 2, 4, 8, 1024)
    ctx = {"dev": dev, "dry_run": dry, "backend": "inductor" if cuda else "eager",
           "tokens": 300 if dry else 16384,  # unique tree tokens per rank, POR 0.8
           "lengths": common.scaled_lengths(0.03) if dry else {}, "por": 0.8,
           "steps": 1 if dry else args.steps,
           "time_limit": args.time_limit,
           "shapes": {"exact_hybrid": tiny_hybrid if dry else
                      common.hybrid_config(256, 512, 4, 8, 2, 32, 4, 8, 32, 1024),
                      "exact_qwen3": dict(TINY if dry else SMALL),
                      "speed_hybrid": tiny_hybrid if dry else
                      common.hybrid_config(2048, 5632, layers, 16, 2, 256, 16, 32, 128, 151936),
                      "speed_qwen3": dict(SHAPES["tiny"]) if dry else
                      dict(SHAPES["qwen3-1.7b"], num_hidden_layers=layers)}}
    if rank == 0:
        common.resolve_out(args, "distributed_check", cuda)
    res = {**common.run_meta(cuda), "world_size": dist.get_world_size(),
           "gdn_varlen_fast_path": {name: rec.varlen is not None
                                    for name, rec in recurrence_registry().items()
                                    if "gated_delta" in name},
           "fla_installed": importlib.util.find_spec("fla") is not None}
    failed = []
    for name in args.cases.split(","):
        if _late(args.time_limit):
            res[name] = "skipped: time limit"
            continue
        say(f"{name}: start")
        c0 = time.perf_counter()
        try:
            res[name] = CASES[name](ctx)
            ok = rank != 0 or res[name].get("passed", False)
        except Exception:
            res[name], ok = {"error": traceback.format_exc()}, False
        if cuda:
            torch.cuda.empty_cache()
        res[name]["seconds"] = round(time.perf_counter() - c0, 1)
        failed += [] if ok else [name]
        say(f"{name}: {'ok' if ok else 'FAILED'} in {res[name]['seconds']} s")
        if rank == 0:
            common.save_json(res, args.out)
    failed = sorted({n for rank_failed in gathered(failed) for n in rank_failed})
    verdicts = [f"{n} {res[n] if isinstance(res[n], str) else 'FAILED' if n in failed else 'ok'}"
                for n in args.cases.split(",")]
    say(f"verdicts: {', '.join(verdicts)}; written to {args.out}")
    return 1 if failed else 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m benchmarks.multi_gpu",
                                description=__doc__.split("\n\n")[0])
    common.add_run_args(p, "CPU, gloo, tiny shapes, eager (real trees: 4 small synthetic "
                           "combs, budget 64; --check: every case)")
    p.add_argument("--check", action="store_true",
                   help="the exactness and speed cases (--cases) instead of real trees")
    p.add_argument("--trees", default=None, help="JSON Lines of trees; default synthetic combs")
    p.add_argument("--tasks", type=int, default=None,
                   help="trees drawn (--seed) among those that pass the size filters "
                        "(default 2; dry run 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-sequence-tokens", type=int, default=100_000,
                   help="draw only trees with at most this many sequence tokens (packing's "
                        "cost); 0: no limit")
    p.add_argument("--methods", default="treefx,packing")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None,
                   help="override the shape's depth (--check: the speed models', default 8)")
    p.add_argument("--budget", type=int, default=None,
                   help="tokens per part / micro-batch (default 8192, dry run 64; --check runs "
                        "trees whole, packing at the largest rank's tokens)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps after the first (default 3; dry run 1)")
    p.add_argument("--order", choices=("input", "largest_first"), default="largest_first",
                   help="treefx.distributed.assign(order=) (runs before 2026-11-26 10:00: input)")
    p.add_argument("--grad-sync", choices=("last", "every"), default="last",
                   help="packing: reduce-scatter gradients on the last micro-batch only (FSDP2 "
                        "then holds unsharded float32 gradients) or on every one")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds since the start after which no timed step (case) starts")
    p.add_argument("--cases", default=",".join(CASES), help=f"--check: of {', '.join(CASES)}")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if not args.methods or set(args.methods) - {"treefx", "packing"}:
        p.error(f"--methods: treefx and/or packing, got {args.methods}")
    if set(args.cases.split(",")) - set(CASES):
        p.error(f"--cases: of {', '.join(CASES)}")
    if args.dry_run:
        args.shape = "tiny"
    args.tasks = args.tasks or (4 if args.dry_run else 2)
    args.steps = args.steps if args.steps is not None else (1 if args.dry_run else 3)
    if not args.check:
        args.budget = args.budget or (64 if args.dry_run else 8192)
    args.max_sequence_tokens = (args.max_sequence_tokens or None) if args.trees else None
    dev = common.dist_setup(args.dry_run)
    common.bump_dynamo_limits()
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return run_check(args, dev) if args.check else run_trees(args, dev)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    res = main()
    raise SystemExit(res if isinstance(res, int) else 0)
