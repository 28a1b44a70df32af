"""How evenly ``treefx.distributed.assign`` spreads real trees over ranks (CPU only; BENCHMARKS.md,
"Several GPUs", and docs/distributed.md).

    python -m benchmarks.balance --trees .data/swe200.jsonl [--worlds 2 4 8] [--per-rank 1 2 4]
    python -m benchmarks.balance --trees .data/swe200.jsonl --rounds 32768

Per (world, trees per rank): the slowest rank's cost over the mean (Qwen3-8B's FLOP cost
model), whole trees and ``split=True``. ``--rounds BUDGET``: the rounds' largest parts summed
over the busiest rank's tokens, parts planned in input order, largest first, and even.
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
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    with open(args.trees) as f:
        trees = [Tree.from_dict(json.loads(line)) for line in f if line.strip()]
    rng = random.Random(args.seed)
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
