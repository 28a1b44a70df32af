"""How evenly ``treefx.distributed.assign`` spreads real trees over ranks (CPU only).

    python -m benchmarks.balance --trees .data/swe200.jsonl [--worlds 2 4 8] [--per-rank 1 2 4]

Random steps of ``world × per_rank`` trees from the file (``treefx ingest`` output), each
assigned with whole trees and with ``split=True``; reported per (world, trees per rank): the
slowest rank's cost over the mean (median and worst over ``--steps`` steps; 1.0 is perfect),
with the Qwen3-8B FLOP cost model (:data:`treefx.distributed.DEFAULT_COST`), and the slowest
``assign`` call.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from treefx.distributed import DEFAULT_COST, assign
from treefx.tree import Tree


def imbalance(ranks, mean: float) -> float:
    return max(DEFAULT_COST.of_batch(r) for r in ranks) / mean


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.balance",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="a .jsonl of trees (treefx ingest)")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--per-rank", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    with open(args.trees) as f:
        trees = [Tree.from_dict(json.loads(line)) for line in f if line.strip()]
    rng = random.Random(args.seed)
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
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trees": args.trees, "steps": args.steps, "seed": args.seed,
                       "cost": "DEFAULT_COST (Qwen3-8B FLOPs)", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
