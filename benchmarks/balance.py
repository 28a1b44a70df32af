"""How evenly ``treefx.distributed.assign`` spreads real trees over ranks (CPU only; BENCHMARKS.md,
"Several GPUs", and docs/distributed.md)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from benchmarks import common
from treefx import parts
from treefx.distributed import DEFAULT_COST, assign
from treefx.layout import pack
from treefx.tree import Tree


def imbalance(ranks, mean: float) -> float:
    return max(DEFAULT_COST.of_batch(r) for r in ranks) / mean


def simulate_step(ranks, budget: int, comm_tokens: float) -> dict:
    """One step's predicted efficiency under both FSDP2 designs (``comm_tokens``: one gather
    plus one reduce-scatter in token-times)."""
    batches = [pack(r) if r else None for r in ranks]
    ideal = sum(b.num_tokens for b in batches if b is not None) / len(ranks)
    busiest = max(b.num_tokens for b in batches if b is not None)
    held = [parts.plan(b, budget, recompute=False) for b in batches if b is not None]
    k = max(p.num_parts for p in held)
    even = [parts.plan_even(p.batch, budget, k, recompute=False) for p in held]
    rounds = sum(max(p.parts[i].num_tokens if i < p.num_parts else 0 for p in even)
                 for i in range(k))
    return dict(balance=ideal / busiest, rounds=ideal / rounds, gather_once=ideal / (busiest + comm_tokens))


def comm_tokens(world: int, args) -> float:
    """One all-gather of the parameters plus one reduce-scatter of the gradients (token-times)."""
    gbs = args.node_gbs if world <= args.gpus_per_node else args.net_gbs
    return 2 * args.param_gb * (world - 1) / world / gbs / (args.token_ms / 1000)


def simulate(trees, args, rng) -> list[dict]:
    """``--simulate``: a row per (world, trees per rank)."""
    rows = []
    print("world  trees/rank  comm s  balance: median   rounds: median  worst   "
          "gather_once: median  worst")
    for world in args.worlds:
        comm = comm_tokens(world, args)
        for per in args.per_rank:
            got = [simulate_step(assign(rng.choices(trees, k=world * per), world,
                                        order="largest_first"), args.simulate, comm)
                   for _ in range(args.steps)]
            row = dict(world=world, trees_per_rank=per, comm_s=comm * args.token_ms / 1000,
                       balance_median=statistics.median(g["balance"] for g in got))
            for design in ("rounds", "gather_once"):
                row[f"{design}_median"] = statistics.median(g[design] for g in got)
                row[f"{design}_worst"] = min(g[design] for g in got)
            rows.append(row)
            print(f"{world:5d}  {per:10d}  {row['comm_s']:6.2f}  {row['balance_median']:15.3f}"
                  f"  {row['rounds_median']:15.3f}  {row['rounds_worst']:5.3f}"
                  f"  {row['gather_once_median']:19.3f}  {row['gather_once_worst']:5.3f}",
                  flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.balance",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="a .jsonl of trees (treefx ingest)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--per-rank", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", type=int, default=None, metavar="BUDGET",
                   help="predict both FSDP2 designs at this token budget")
    p.add_argument("--token-ms", type=float, default=0.176)
    p.add_argument("--param-gb", type=float, default=16.4)
    p.add_argument("--node-gbs", type=float, default=360.0)
    p.add_argument("--net-gbs", type=float, default=45.0)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    with open(args.trees) as f:
        trees = [Tree.from_dict(json.loads(line)) for line in f if line.strip()]
    rng = random.Random(args.seed)
    if args.simulate:
        if args.worlds == p.get_default("worlds"):
            args.worlds = [8, 16, 32, 64]
        rows = simulate(trees, args, rng)
        common.save_json({"trees": args.trees, "steps": args.steps, "seed": args.seed,
                          "simulate_budget": args.simulate, "token_ms": args.token_ms,
                          "param_gb": args.param_gb, "node_gbs": args.node_gbs,
                          "net_gbs": args.net_gbs, "gpus_per_node": args.gpus_per_node,
                          "sampling": "with replacement", "order": "largest_first",
                          "rows": rows}, args.out)
        return
    rows = []
    print("world  trees/rank  whole: median  worst   split: median  worst   slowest assign s")
    for world in args.worlds:
        for per in args.per_rank:
            whole, cut, secs = [], [], []
            for _ in range(args.steps):
                step = rng.sample(trees, world * per)
                mean = DEFAULT_COST.of_batch(step) / world
                whole.append(imbalance(assign(step, world), mean))
                t0 = time.perf_counter()
                cut.append(imbalance(assign(step, world, split=True), mean))
                secs.append(time.perf_counter() - t0)
            row = dict(world=world, trees_per_rank=per, whole_median=statistics.median(whole),
                       whole_worst=max(whole), split_median=statistics.median(cut),
                       split_worst=max(cut), slowest_split_assign_s=max(secs))
            rows.append(row)
            print(f"{world:5d}  {per:10d}  {row['whole_median']:13.3f}  {row['whole_worst']:5.3f}"
                  f"  {row['split_median']:13.3f}  {row['split_worst']:5.3f}"
                  f"  {row['slowest_split_assign_s']:16.2f}", flush=True)
    common.save_json({"trees": args.trees, "steps": args.steps, "seed": args.seed,
                      "cost": "DEFAULT_COST (Qwen3-8B FLOPs)", "rows": rows}, args.out)


if __name__ == "__main__":
    main()
