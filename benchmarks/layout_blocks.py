"""Attention blocks the tree mask computes, against the pairs it needs, for three orders of a
node's children in the depth-first layout: as ``treefx.pack`` lays them out (largest subtree
first), in the trees' node order (the order of their token ids), and smallest first.

    python -m benchmarks.layout_blocks TREES.jsonl [--every 10] [--block 128]

Per tree: (partial + full blocks) x block² / attended pairs. CPU only, no model.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import treefx
from treefx.distributed import attended_pairs
from treefx.layout import _dfs_order, subtree_tokens
from treefx.mask import tree_block_tensors


def subtree_end(tree: treefx.Tree, children_order) -> torch.Tensor:
    """The layout's ``subtree_end`` row for a preorder whose children come in
    ``children_order(children, subtree sizes)``."""
    lens = tree.segment_lengths.astype(np.int64)
    order = _dfs_order(tree.parents, lens, children_order)
    sub = subtree_tokens(tree.parents, lens)
    starts = np.zeros(len(lens), dtype=np.int64)
    starts[order] = np.concatenate([[0], np.cumsum(lens[order])[:-1]])
    return torch.from_numpy(np.repeat((starts + sub)[order], lens[order]))


ORDERS = {
    "treefx.pack": None,
    "node order": lambda kids, sub: kids,
    "smallest first": lambda kids, sub: sorted(kids, key=lambda c: sub[c]),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trees")
    p.add_argument("--every", type=int, default=10, help="every N-th tree of the file")
    p.add_argument("--block", type=int, default=128)
    args = p.parse_args(argv)
    ratios: dict[str, list[float]] = {k: [] for k in ORDERS}
    for i, tree in enumerate(treefx.read_jsonl(args.trees)):
        if i % args.every:
            continue
        pairs = attended_pairs(tree)
        line = []
        for name, fn in ORDERS.items():
            se = treefx.pack(tree).subtree_end if fn is None else subtree_end(tree, fn)
            kv, _, full, _, _ = tree_block_tensors(se, args.block)
            r = (int(kv.sum()) + int(full.sum())) * args.block ** 2 / pairs
            ratios[name].append(r)
            line.append(f"{name} {r:.3f}")
        print(f"tree {i:4d} ({tree.num_tokens:6d} tokens): " + "  ".join(line), flush=True)
    for name, rs in ratios.items():
        print(f"{name:15} computed / attended: median {np.median(rs):.3f}, "
              f"range {min(rs):.3f}-{max(rs):.3f}")


if __name__ == "__main__":
    main()
