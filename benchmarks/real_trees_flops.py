"""Share of the FLOP bound for a ``benchmarks.real_trees`` result: the token-count bound with
attention's attended pairs counted too (``treefx.distributed.CostModel.from_config`` of the
measured model: FLOPs per token and per (query, key) pair of a training step)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import transformers

import treefx
from benchmarks.common import SHAPE_8B
from treefx.distributed import CostModel, attended_pairs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result")
    p.add_argument("trees")
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    cfg = transformers.AutoConfig.for_model("qwen3", num_hidden_layers=args.layers, **SHAPE_8B)
    cost = CostModel.from_config(cfg)
    with open(args.result) as f:
        tasks = [t for t in json.load(f)["tasks"] if t.get("speedup")]
    wanted = {t["index"] for t in tasks}
    trees = {i: t for i, t in enumerate(treefx.read_jsonl(args.trees)) if i in wanted}
    rows = []
    for t in tasks:
        tree = trees[t["index"]]
        lens = tree.sequence_lengths.astype(np.int64)
        packing = cost.per_token * lens.sum() + cost.per_pair * (lens * (lens + 1) // 2).sum()
        tree_flops = cost.per_token * tree.num_tokens + cost.per_pair * attended_pairs(tree)
        bound = packing / tree_flops
        rows.append((t["task"], t["bound"], bound, t["speedup"] / bound))
        print(f"{t['task']:<32} token bound {t['bound']:6.2f}x  FLOP bound {bound:6.2f}x  "
              f"speed-up {t['speedup']:6.2f}x = {t['speedup'] / bound:5.1%} of the FLOP bound")
    share = np.array([r[3] for r in rows])
    ratio = np.array([r[2] / r[1] for r in rows])
    print(f"{len(rows)} tasks: share of the FLOP bound median {np.median(share):.1%}, worst "
          f"{share.min():.1%}; FLOP bound / token bound median {np.median(ratio):.3f}")


if __name__ == "__main__":
    main()
