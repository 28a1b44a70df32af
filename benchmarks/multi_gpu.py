"""Several GPUs, real agent trees: ``treefx.backward`` in parts against per-call sequence packing
under FSDP2, side by side in one run per machine (issue 37; BENCHMARKS.md, "Several GPUs";
benchmarks/README.md for the commands).

    torchrun --nproc_per_node=2 -m benchmarks.multi_gpu --trees .data/swe200.jsonl \\
        --shape qwen3-8b --budget 8192 --time-limit 480 --out mg_8b_x2.json
    python -m benchmarks.multi_gpu --dry-run                    # CPU, gloo, one process

Qwen3 of ``--shape`` (``--layers`` overrides the depth), float32 masters sharded per layer and
root, bf16 compute, activation checkpointing, fused AdamW; one ``treefx.compile(model,
logits=False, verify=False)`` shared by both methods, run one after the other from the same
initial shards. ``treefx``: ``treefx.backward`` on ``treefx.distributed.pack`` of the rank's
trees (``assign``), parts of ``--budget`` tokens. ``packing``: every call its own sequence,
shared out over the ranks (``--packing-split``), first-fit-decreasing micro-batches of
``max(--budget, longest call)`` tokens, gradients accumulated (reduce-scattered on the last,
or ``--grad-sync every``); a rank with fewer micro-batches runs zero-weight padding ones so
the collectives pair up. Per method: first step, median step (the slowest rank's), tokens
per second, peak memory per rank, parts or micro-batches, the assignment's balance; then
``speedup``, ``bound`` and ``share_of_bound``. The JSON is written after every step;
``--time-limit`` stops further timed steps.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import time

import torch
import torch.distributed as dist

import treefx
from benchmarks import common
from benchmarks.common import SHAPES
from benchmarks.internals import agree_captures
from benchmarks.real_trees import _sha256, _top_id, call_chains, comb_tree, packing_batches

START = time.perf_counter()
FLOPS_PER_GPU = 3e14  # for the printed estimate only


def say(msg: str) -> None:
    """A progress line from rank 0, with the seconds since the start."""
    if dist.get_rank() == 0:
        print(f"[{time.perf_counter() - START:7.1f} s] {msg}", flush=True)


# ----------------------------------------------------------------------------- data


def select_trees(args, vocab: int) -> tuple[list[tuple[int, treefx.Tree]], dict]:
    """The trees of the run, with their index in the file (the same on every rank), and the
    data's provenance."""
    if args.trees:
        pool = list(treefx.read_jsonl(args.trees))
        prov = {"source": os.path.abspath(args.trees), "bytes": os.path.getsize(args.trees),
                "sha256": _sha256(args.trees), "trees_in_file": len(pool)}
    else:
        calls, scale = ((4, 6), 0.08) if args.dry_run else ((20, 40), 3.0)
        rng = random.Random(args.seed)
        pool = [comb_tree(args.seed * 1000 + i, vocab, rng.randint(*calls), scale)
                for i in range(args.tasks)]
        prov = {"source": "synthetic combs (benchmarks.real_trees.comb_tree)",
                "calls": list(calls), "length_scale": scale}
    if args.select:
        chosen = [int(x) for x in args.select.split(",") if x]
        bad = [i for i in chosen if not 0 <= i < len(pool)]
        if bad:
            raise SystemExit(f"--select: no tree {bad} among {len(pool)}")
    else:
        fits = [i for i, t in enumerate(pool)
                if (args.max_tree_tokens is None or t.num_tokens <= args.max_tree_tokens)
                and (args.max_sequence_tokens is None
                     or t.num_baseline_tokens <= args.max_sequence_tokens)]
        if len(fits) < args.tasks:
            raise SystemExit(f"only {len(fits)} of {len(pool)} trees have at most "
                             f"{args.max_tree_tokens} unique and {args.max_sequence_tokens} "
                             f"sequence tokens; --tasks {args.tasks} wants more")
        chosen = sorted(random.Random(args.seed).sample(fits, args.tasks))
        prov["candidates"] = len(fits)
    for i in chosen:
        top = _top_id(pool[i])
        if top >= vocab:
            raise SystemExit(f"tree {i}: token id {top} is not below the model's vocabulary "
                             f"of {vocab:,}")
    prov["selected"] = chosen
    return [(i, pool[i]) for i in chosen], prov


# ----------------------------------------------------------------------------- timing


def _agree(flag: bool, dev) -> bool:
    """True on every rank when it is on any."""
    t = torch.tensor([int(flag)], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _global_loss(loss: torch.Tensor, dev) -> float:
    """The mean over the ranks of their losses: the global batch's loss."""
    t = loss.detach().to(device=dev, dtype=torch.float64).reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def measure(name: str, step, args, dev, on_step) -> dict:
    """The first step alone, then up to ``args.steps`` timed ones (none starts after
    ``args.time_limit``); ``on_step(partial result)`` after each."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    common.dist_sync(dev)
    g0 = common.dynamo_counts().get("unique_graphs", 0)
    say(f"{name}: first step (capture and compile) ...")
    t0 = time.perf_counter()
    loss = step(first=True)
    common.dist_sync(dev)
    first = time.perf_counter() - t0
    g1 = common.dynamo_counts().get("unique_graphs", 0)
    res = {"first_step_s": first, "first_loss": _global_loss(loss, dev), "step_times_s": [],
           "own_times_s": [], "losses": [], "graphs_first_step": g1 - g0}
    say(f"{name}: first step {first:.1f} s (capture and compile), loss {res['first_loss']:.6f}")
    on_step(res)
    for k in range(args.steps):
        late = args.time_limit is not None and time.perf_counter() - START > args.time_limit
        if _agree(late, dev):
            res["stopped"] = f"time limit after {k} timed steps"
            say(f"{name}: time limit ({args.time_limit:.0f} s) passed: {k} timed steps")
            break
        common.dist_sync(dev)
        t0 = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize(dev)
        own = time.perf_counter() - t0
        dist.barrier()
        res["step_times_s"].append(time.perf_counter() - t0)
        res["own_times_s"].append(own)
        res["losses"].append(_global_loss(loss, dev))
        say(f"{name}: step {k + 1}/{args.steps} {res['step_times_s'][-1]:.2f} s")
        on_step(res)
    res["graphs_in_timed_steps"] = common.dynamo_counts().get("unique_graphs", 0) - g1
    res["peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None
    res["reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else None
    return res


# ----------------------------------------------------------------------------- methods


def treefx_step(tm, opt, mine, args):
    """``treefx.backward`` on this rank's trees in parts, then the optimizer: the step, and
    what it computes."""
    batch = treefx.distributed.pack(mine, allow_empty=True)
    plan = treefx.parts.plan(batch, args.budget, recompute=False) if batch is not None else None
    info = {"parts": plan.num_parts if plan else 0,
            "peak_held_tokens": plan.peak_held_tokens() if plan else 0,
            "computed_tokens": batch.num_tokens if batch is not None else 0}

    def step(first=False):
        loss = treefx.backward(tm, batch, max_tokens=args.budget)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, info


def packing_step(tm, opt, calls, args, dev, num_sequences: int, capacity: int):
    """This rank's calls (one-sequence trees) packed FFD into micro-batches of at most
    ``capacity`` tokens, as many on every rank (zero-weight padding), gradients accumulated,
    then the optimizer: the step, and what it computes."""
    model, world = tm.model, dist.get_world_size()
    micro = packing_batches(calls, capacity, num_sequences=num_sequences, loss_scale=world)
    counts = [None] * world
    dist.all_gather_object(counts, len(micro))
    pad = treefx.pack(treefx.Tree.from_sequences([[0, 0]], weights=[0.0]), reduction="mean",
                      num_sequences=num_sequences, loss_scale=world)
    batches = [b.to(dev) for b in micro] + [pad.to(dev)] * (max(counts) - len(micro))
    info = {"micro_batches": len(micro), "padding_micro_batches": max(counts) - len(micro),
            "micro_batch_tokens": [b.num_tokens for b in micro],
            "computed_tokens": sum(b.num_tokens for b in micro)}

    def step(first=False):
        total = torch.zeros((), dtype=torch.float64, device=dev)
        last = len(batches) - 1
        for i, b in enumerate(batches):
            model.set_requires_gradient_sync(args.grad_sync == "every" or i == last)
            agree_captures(tm, b)
            loss = treefx.tree_loss(tm(b), b)
            loss.backward()
            total += loss.detach().to(total.dtype)
            if first:
                say(f"packing: first step, micro-batch {i + 1}/{len(batches)} "
                    f"({b.num_tokens} tokens) done")
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, info


# ----------------------------------------------------------------------------- main


def _gather(x):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def _ratio_max_mean(xs) -> float:
    mean = sum(xs) / len(xs)
    return max(xs) / mean if mean else 1.0


def main(argv=None):
    p = argparse.ArgumentParser(prog="torchrun ... -m benchmarks.multi_gpu",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=None, help="JSON Lines of trees; default synthetic combs")
    p.add_argument("--tasks", type=int, default=None,
                   help="trees drawn (--seed) among those that pass the size filters "
                        "(default 2; dry run 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--select", default=None, help="i,j,...: these trees (file line indices)")
    p.add_argument("--max-tree-tokens", type=int, default=None,
                   help="draw only trees with at most this many unique tokens")
    p.add_argument("--max-sequence-tokens", type=int, default=100_000,
                   help="draw only trees with at most this many sequence tokens (the sum of "
                        "their calls' lengths; packing's cost); 0: no limit")
    p.add_argument("--methods", default="treefx,packing")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    p.add_argument("--layers", type=int, default=None, help="override the shape's depth")
    p.add_argument("--budget", type=int, default=None,
                   help="tokens per part / micro-batch (default 8192; dry run 64)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps after the first (default 3; dry run 1)")
    p.add_argument("--order", choices=("input", "largest_first"), default="largest_first",
                   help="each rank's trees as treefx.distributed.assign(order=) returns them "
                        "(runs before 2026-11-26 10:00: input)")
    p.add_argument("--grad-sync", choices=("last", "every"), default="last",
                   help="packing: reduce-scatter gradients on the last micro-batch only (FSDP2 "
                        "then holds unsharded float32 gradients) or on every one")
    p.add_argument("--packing-split", choices=("calls", "trees"), default="calls",
                   help="packing's share of each rank: the global batch's calls balanced "
                        "over the ranks on their own (assign on the calls), or the calls of "
                        "the trees treefx gives the rank")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds since the start after which no timed step starts")
    common.add_run_args(p, "CPU, gloo, the tiny shape, eager, 4 small synthetic combs, budget 64")
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    if not args.methods or set(args.methods) - {"treefx", "packing"}:
        p.error(f"--methods: treefx and/or packing, got {args.methods}")
    if args.dry_run:
        args.shape = "tiny"
    cuda = common.use_cuda(args.dry_run)
    args.tasks = args.tasks or (4 if args.dry_run else 2)
    args.steps = args.steps if args.steps is not None else (1 if args.dry_run else 3)
    args.budget = args.budget or (8192 if cuda else 64)
    args.lr = 1e-6 if cuda else 1e-3  # the dry run's shows weights not put back
    args.loss_tol = 1e-2 if cuda else 1e-5
    args.max_sequence_tokens = args.max_sequence_tokens or None
    if not args.trees:  # synthetic: exactly the trees made
        args.max_sequence_tokens = None

    dev = common.dist_setup(args.dry_run)
    rank, world = dist.get_rank(), dist.get_world_size()
    common.bump_dynamo_limits()
    torch.backends.cuda.matmul.allow_tf32 = True
    out = common.resolve_out(args, "multi_gpu", cuda)

    # data, and each rank's share
    shape = dict(SHAPES[args.shape], num_hidden_layers=args.layers or
                 SHAPES[args.shape]["num_hidden_layers"], model_type="qwen3")
    vocab = shape["vocab_size"]
    if args.dry_run and args.trees:
        vocab = shape["vocab_size"] = SHAPES["qwen3-8b"]["vocab_size"]  # real ids
    tasks, prov = select_trees(args, vocab)
    trees = [t for _, t in tasks]
    index = {id(t): i for i, t in tasks}
    if len(trees) < world:
        raise SystemExit(f"{len(trees)} trees for {world} ranks: --tasks at least {world}")
    cost = treefx.distributed.CostModel.from_config(shape)
    shares = treefx.distributed.assign(trees, world, cost=cost, order=args.order)
    mine = shares[rank]
    num_sequences = sum(t.num_sequences for t in trees)
    capacity = max(args.budget, max(int(t.sequence_lengths.max()) for t in trees))
    # packing's share: its calls (one-sequence trees), from the same trees or balanced alone
    pack_shares = [call_chains(s) for s in shares] if args.packing_split == "trees" else \
        treefx.distributed.assign(call_chains(trees), world, cost=cost)
    tree_tokens = [sum(t.num_tokens for t in s) for s in shares]
    seq_tokens = [sum(t.num_baseline_tokens for t in s) for s in shares]
    pack_tokens = [sum(t.num_tokens for t in s) for s in pack_shares]
    costs = [cost.of_batch(s) for s in shares]
    pack_costs = [cost.of_batch(s) for s in pack_shares]
    balance = {"cost_max_over_mean": _ratio_max_mean(costs),
               "tree_tokens_max_over_mean": _ratio_max_mean(tree_tokens),
               "sequence_tokens_max_over_mean": _ratio_max_mean(seq_tokens),
               "packing_cost_max_over_mean": _ratio_max_mean(pack_costs),
               "packing_tokens_max_over_mean": _ratio_max_mean(pack_tokens),
               "cost": "CostModel.from_config (FLOPs)"}
    bound = sum(seq_tokens) / sum(tree_tokens)
    say(f"{len(trees)} trees {prov['selected']} from {prov['source']}: {sum(tree_tokens):,} "
        f"tree tokens, {sum(seq_tokens):,} sequence tokens (bound {bound:.2f}x), "
        f"{num_sequences} calls; {world} rank(s), budget {args.budget}, packing capacity "
        f"{capacity}")
    for r in range(world):
        say(f"  rank {r}: {len(shares[r])} trees, {tree_tokens[r]:,} tree tokens, "
            f"{seq_tokens[r]:,} sequence tokens; packing: {len(pack_shares[r])} calls, "
            f"{pack_tokens[r]:,} tokens")
    say(f"  balance (max/mean): cost {balance['cost_max_over_mean']:.3f}, tree tokens "
        f"{balance['tree_tokens_max_over_mean']:.3f}; packing ({args.packing_split}) cost "
        f"{balance['packing_cost_max_over_mean']:.3f}")
    if cuda:
        say(f"  rough estimate at {FLOPS_PER_GPU:.0e} FLOP/s per GPU: packing step "
            f"~{max(pack_costs) / FLOPS_PER_GPU:.1f} s, treefx ~{max(costs) / FLOPS_PER_GPU:.1f}"
            f" s")

    res = {"meta": dict(common.run_meta(cuda), world_size=world), "args": vars(args),
           "data": prov,
           "model": {"type": "qwen3", "shape": args.shape, **shape,
                     "dtype": "bf16 compute, fp32 master" if cuda else "float32",
                     "checkpointing": True,
                     "backend": "inductor" if cuda else "eager"},
           "trees_per_rank": [[index[id(t)] for t in s] for s in shares],
           "tree_tokens_per_rank": tree_tokens, "sequence_tokens_per_rank": seq_tokens,
           "packing_tokens_per_rank": pack_tokens,
           "bound": bound, "packing_capacity": capacity, "balance": balance,
           "methods": {}, "summary": {}}
    if cuda:
        res["meta"]["gpus"] = _gather(torch.cuda.get_device_name(dev))

    def save():
        if rank == 0:
            common.save_json(res, out)

    t0 = time.perf_counter()
    model = common.fsdp_qwen3(args.shape, dev, True, args.layers, vocab)
    res["build_s"] = time.perf_counter() - t0
    say(f"model built and sharded in {res['build_s']:.1f} s "
        f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters)")
    initial = None
    if len(args.methods) > 1:  # this rank's shards, to start the second method from them
        initial = [p.detach().to_local().to("cpu", copy=True) for p in model.parameters()]
    tm = treefx.compile(model, backend="inductor" if cuda else "eager", logits=False,
                        verify=False)
    for n, name in enumerate(args.methods):
        if n:
            with torch.no_grad():
                for p, x in zip(model.parameters(), initial):
                    p.to_local().copy_(x)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda or None)
        if name == "treefx":
            step, info = treefx_step(tm, opt, mine, args)
        else:
            step, info = packing_step(tm, opt, pack_shares[rank], args, dev, num_sequences,
                                      capacity)
        infos = _gather(info)
        say(f"{name}: " + ", ".join(
            f"rank {r}: {i.get('parts', i.get('micro_batches'))} "
            f"{'parts' if 'parts' in i else 'micro-batches'}" for r, i in enumerate(infos)))
        entry = {k: [i[k] for i in infos] for k in infos[0]}
        res["methods"][name] = entry

        def on_step(r, entry=entry):
            entry.update(r)
            save()

        r = measure(name, step, args, dev, on_step)
        per_rank = _gather({"own": statistics.median(r["own_times_s"]) if r["own_times_s"]
                            else None, "peak": r["peak_gib"], "reserved": r["reserved_gib"],
                            "graphs_first": r["graphs_first_step"],
                            "graphs_timed": r["graphs_in_timed_steps"]})
        step_s = statistics.median(r["step_times_s"]) if r["step_times_s"] else r[
            "first_step_s"]
        entry.update(r)
        entry.update(
            step_s=step_s, timed_steps=len(r["step_times_s"]),
            step_s_per_rank=[x["own"] for x in per_rank],
            peak_gib_per_rank=[x["peak"] for x in per_rank],
            reserved_gib_per_rank=[x["reserved"] for x in per_rank],
            graphs_first_step_per_rank=[x["graphs_first"] for x in per_rank],
            graphs_in_timed_steps_per_rank=[x["graphs_timed"] for x in per_rank],
            unique_tokens_per_s=sum(tree_tokens) / step_s,
            sequence_tokens_per_s=sum(seq_tokens) / step_s,
            computed_tokens_per_s=sum(entry["computed_tokens"]) / step_s,
            sequence_tokens_per_s_per_gpu=sum(seq_tokens) / step_s / world)
        for k in ("peak_gib", "reserved_gib", "graphs_first_step", "graphs_in_timed_steps"):
            entry.pop(k)
        if not r["step_times_s"]:
            entry["step_s_note"] = "no timed step: the first step's time"
        peak = entry["peak_gib_per_rank"]
        say(f"{name}: step {step_s:.3f} s, {entry['sequence_tokens_per_s']:,.0f} sequence "
            f"tokens/s ({entry['unique_tokens_per_s']:,.0f} unique)"
            + (f", peak {max(peak):.1f} GiB" if cuda else ""))
        del opt, step
        model.zero_grad(set_to_none=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        save()

    m = res["methods"]
    if {"treefx", "packing"} <= set(m):
        t, q = m["treefx"], m["packing"]
        diff = abs(t["first_loss"] - q["first_loss"]) / max(abs(q["first_loss"]), 1e-30)
        res["summary"] = {"bound": bound, "loss_rel_diff": diff,
                          "losses_agree": diff <= args.loss_tol,
                          "first_loss": {"treefx": t["first_loss"], "packing": q["first_loss"]}}
        s = res["summary"]
        say(f"first-step loss: treefx {t['first_loss']:.6f}, packing {q['first_loss']:.6f} "
            f"(rel diff {diff:.1e}, {'agree' if s['losses_agree'] else 'DISAGREE'})")
        if t["timed_steps"] and q["timed_steps"]:
            speedup = q["step_s"] / t["step_s"]
            s.update(speedup=speedup, share_of_bound=speedup / bound)
            say(f"speed-up {speedup:.2f}x of a {bound:.2f}x bound: {s['share_of_bound']:.1%} "
                f"of the token-count bound; {world} GPU(s), assign balance "
                f"{balance['cost_max_over_mean']:.3f}")
        else:  # a first step includes capture and compilation: not a step time to compare
            s["speedup"] = None
            say("no speed-up: a method ran no timed step (--time-limit); raise it")
    res["elapsed_s"] = time.perf_counter() - START
    save()
    say(f"saved {out}")
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
