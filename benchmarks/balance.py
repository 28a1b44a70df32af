"""How evenly ``treefx.distributed.assign`` spreads real trees over ranks (CPU only; BENCHMARKS.md,
"Several GPUs", and docs/distributed.md).

    python -m benchmarks.balance --trees .data/swe200.jsonl [--worlds 2 4 8] [--per-rank 1 2 4]
    python -m benchmarks.balance --trees .data/swe200.jsonl --rounds 32768
    python -m benchmarks.balance --trees .data/swe200.jsonl --simulate 32768 --per-rank 1 4

Per (world, trees per rank): the slowest rank's cost over the mean (Qwen3-8B's FLOP cost
model), whole trees and ``split=True``. ``--rounds BUDGET``: the rounds' largest parts summed
over the busiest rank's tokens, parts planned in input order, largest first, and even.

``--simulate BUDGET`` (default ``--worlds 8 16 32 64``): both FSDP2 designs of
``treefx.backward`` predicted by a cost model over random steps of ``world × per_rank`` trees
drawn from the file with replacement, assigned largest first, planned without recompute parts
in both. Tokens stand in for compute, ``--token-ms`` a token (0.176: Qwen3-8B, 36 layers with
checkpointing on one H200, issue 66). ``rounds``: every rank replanned to the most parts
(``plan_even``), a round as long as its largest part, the per-part collectives taken as hidden
under compute (favouring rounds). ``gather_once``: the busiest rank's own parts plus one
all-gather and one reduce-scatter of ``--param-gb`` (16.4: Qwen3-8B in bf16), exposed, at
``(world - 1) / world`` of it over ``--node-gbs`` within ``--gpus-per-node`` GPUs, else
``--net-gbs`` (360 and 45 GB/s: NVLink; 400 Gb/s InfiniBand a GPU). Reported: the efficiency,
the step's tokens over ``world`` (perfect balance, no waiting, no communication) over the
predicted step, median and worst over ``--steps``; and the balance (mean over the busiest
rank's tokens) that the assignment alone leaves.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from treefx import parts
from treefx.distributed import DEFAULT_COST, assign
from treefx.layout import pack
from treefx.tree import Tree


def imbalance(ranks, mean: float) -> float:
    return max(DEFAULT_COST.of_batch(r) for r in ranks) / mean


def rounds_over_busiest(ranks, budget: int, even: bool = False) -> float:
    """Under FSDP2 rounds: the sum over rounds of the largest part's tokens, over the busiest
    rank's tokens (each rank's trees packed in the given order, planned at ``budget`` without
    recompute parts, as treefx.backward did with FSDP2 before 2026-11-26; ``even``: then
    replanned to the largest count as evenly as the trees allow, as it does since
    (:func:`treefx.parts.plan_even`))."""
    batches = [pack(r) for r in ranks]
    plans = [parts.plan(b, budget, recompute=False) for b in batches]
    if even:
        k = max(p.num_parts for p in plans)
        plans = [parts.plan_even(b, budget, k, recompute=False) for b in batches]
    k = max(p.num_parts for p in plans)
    rounds = sum(max(p.parts[i].num_tokens if i < p.num_parts else 0 for p in plans)
                 for i in range(k))
    return rounds / max(sum(x.num_tokens for x in p.parts) for p in plans)


def simulate_step(ranks, budget: int, comm_tokens: float) -> dict:
    """One step's predicted efficiency under both FSDP2 designs (see the module's docstring):
    ``ranks``' trees, the budget, and one gather plus one reduce-scatter in token-times."""
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
    """One all-gather of the parameters plus one reduce-scatter of the gradients, in
    token-times."""
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
    p.add_argument("--rounds", type=int, default=None, metavar="BUDGET",
                   help="also the rounds' waiting under FSDP2 at this token budget")
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
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"trees": args.trees, "steps": args.steps, "seed": args.seed,
                           "simulate_budget": args.simulate, "token_ms": args.token_ms,
                           "param_gb": args.param_gb, "node_gbs": args.node_gbs,
                           "net_gbs": args.net_gbs, "gpus_per_node": args.gpus_per_node,
                           "sampling": "with replacement", "order": "largest_first",
                           "rows": rows}, f, indent=1)
        return
    rows = []
    print("world  trees/rank  whole: median  worst   split: median  worst   slowest assign s"
          + ("   rounds input: median worst   largest first: median worst   even: median worst"
             if args.rounds else ""))
    for world in args.worlds:
        for per in args.per_rank:
            whole, cut, secs, r_in, r_lf, r_ev = [], [], [], [], [], []
            for _ in range(args.steps):
                step = rng.sample(trees, world * per)
                mean = DEFAULT_COST.of_batch(step) / world
                whole.append(imbalance(assign(step, world), mean))
                if args.rounds:
                    r_in.append(rounds_over_busiest(assign(step, world), args.rounds))
                    lf = assign(step, world, order="largest_first")
                    r_lf.append(rounds_over_busiest(lf, args.rounds))
                    r_ev.append(rounds_over_busiest(lf, args.rounds, even=True))
                t0 = time.perf_counter()
                cut.append(imbalance(assign(step, world, split=True), mean))
                secs.append(time.perf_counter() - t0)
            row = dict(world=world, trees_per_rank=per, whole_median=statistics.median(whole),
                       whole_worst=max(whole), split_median=statistics.median(cut),
                       split_worst=max(cut), slowest_split_assign_s=max(secs))
            if args.rounds:
                row.update(rounds_input_median=statistics.median(r_in), rounds_input_worst=max(
                    r_in), rounds_largest_first_median=statistics.median(r_lf),
                    rounds_largest_first_worst=max(r_lf),
                    rounds_even_median=statistics.median(r_ev), rounds_even_worst=max(r_ev))
            rows.append(row)
            print(f"{world:5d}  {per:10d}  {row['whole_median']:13.3f}  {row['whole_worst']:5.3f}"
                  f"  {row['split_median']:13.3f}  {row['split_worst']:5.3f}"
                  f"  {row['slowest_split_assign_s']:16.2f}"
                  + (f"   {row['rounds_input_median']:19.3f} {row['rounds_input_worst']:5.3f}"
                     f"   {row['rounds_largest_first_median']:20.3f} "
                     f"{row['rounds_largest_first_worst']:5.3f}"
                     f"   {row['rounds_even_median']:11.3f} {row['rounds_even_worst']:5.3f}"
                     if args.rounds else ""),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trees": args.trees, "steps": args.steps, "seed": args.seed,
                       "rounds_budget": args.rounds,
                       "cost": "DEFAULT_COST (Qwen3-8B FLOPs)", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
