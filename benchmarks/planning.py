"""What planning the parts costs on the host (CPU only): :func:`treefx.parts.plan` and
:func:`treefx.parts.plan_even`, which ``treefx.backward`` runs every step (``plan_even``
under FSDP2, on the step's critical path).

    python -m benchmarks.planning --trees .data/swe200.jsonl [--budget 32768] [--reps 5]
    python -m benchmarks.planning                      # synthetic comb trees only
    python -m benchmarks.planning --trees .data/swe200.jsonl --frozen   # and the old planner

Rows: real trees from the file (``treefx ingest`` output: the largest tree, and random
groups of trees of 100-130k tokens, a rank's share of a step), and synthetic comb trees (a
long trunk with every completion a leaf off it, the shape of agent trajectories) of 30-150
calls and 10k-130k tokens. Per row: the median of ``--reps`` calls of ``plan`` at the budget
(without recompute parts, as under FSDP2, and with them) and of ``plan_even`` at 1.5x and 3x
that plan's part count. ``--frozen``: the same with the planner as it was before it was made
faster (``tests/parts_frozen.py``, a frozen copy), and whether both give the same parts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import time

import numpy as np

from treefx import parts
from treefx.layout import pack
from treefx.tree import Tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def comb(seed: int, calls: int, tokens: int, vocab: int = 32000) -> Tree:
    """A comb of ``calls`` calls and about ``tokens`` unique tokens: the trunk grows by a
    random turn each call, each call's completion a leaf off it (about a third of the tokens
    in the leaves)."""
    rng = np.random.default_rng(seed)
    turn = max(1, int(tokens * 2 / 3 / calls))
    leaf = max(1, int(tokens / 3 / calls))
    convo, seqs = [], []
    for _ in range(calls):
        convo = convo + rng.integers(1, vocab, int(rng.integers(1, 2 * turn))).tolist()
        seqs.append(convo + rng.integers(1, vocab, int(rng.integers(1, 2 * leaf))).tolist())
    return Tree.from_sequences(seqs)


def _frozen():
    spec = importlib.util.spec_from_file_location(
        "parts_frozen", os.path.join(ROOT, "tests", "parts_frozen.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _median_s(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _same(a, b) -> bool:
    return a.num_parts == b.num_parts and all(
        (p.start, p.end, p.open, p.recompute, p.release) == (q.start, q.end, q.open, q.recompute,
                                                             q.release)
        for p, q in zip(a.parts, b.parts))


def batches(trees_file: str | None, groups: int, seed: int):
    rng = random.Random(seed)
    out = []
    if trees_file:
        with open(trees_file) as f:
            trees = [Tree.from_dict(json.loads(line)) for line in f if line.strip()]
        big = max(trees, key=lambda t: t.num_tokens)
        out.append((f"real largest ({big.num_sequences} calls)", [big]))
        for _ in range(groups):  # a rank's share: trees until 100-130k tokens
            while True:
                pick, total = [], 0
                for t in rng.sample(trees, len(trees)):
                    if total + t.num_tokens <= 130_000:
                        pick.append(t)
                        total += t.num_tokens
                    if total >= 100_000:
                        break
                if total >= 100_000:
                    break
            out.append((f"real {len(pick)} trees", pick))
    for calls, tokens in ((30, 10_000), (60, 35_000), (100, 100_000), (150, 130_000)):
        out.append((f"comb {calls} calls", [comb(calls, calls, tokens)]))
    return [(name, pack(ts)) for name, ts in out]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.planning",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=None, help="a .jsonl of trees (treefx ingest)")
    p.add_argument("--groups", type=int, default=3, help="random groups of 100-130k tokens")
    p.add_argument("--budget", type=int, default=32768)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frozen", action="store_true", help="also the old planner (tests/)")
    p.add_argument("--out", default=None, help="JSON file")
    args = p.parse_args(argv)
    planners = [("now", parts)] + ([("frozen", _frozen())] if args.frozen else [])
    rows = []
    print(f"{'batch':28s} {'tokens':>7s} {'planner':>7s} {'parts':>5s} {'plan s':>8s} "
          f"{'plan rec s':>10s} {'even 1.5x s':>11s} {'even 3x s':>9s}  same")
    for name, batch in batches(args.trees, args.groups, args.seed):
        got = {}
        for who, mod in planners:
            first = mod.plan(batch, args.budget, recompute=False)
            ks = (max(2, first.num_parts * 3 // 2), max(3, first.num_parts * 3))
            row = {"batch": name, "tokens": batch.num_tokens, "planner": who,
                   "parts": first.num_parts, "budget": args.budget,
                   "plan_s": _median_s(lambda: mod.plan(batch, args.budget, recompute=False),
                                       args.reps),
                   "plan_recompute_s": _median_s(lambda: mod.plan(batch, args.budget),
                                                 args.reps)}
            evens = []
            for k, key in zip(ks, ("even_1.5x_s", "even_3x_s")):
                row[key] = _median_s(lambda: mod.plan_even(batch, args.budget, k,
                                                           recompute=False), args.reps)
                evens.append(mod.plan_even(batch, args.budget, k, recompute=False))
            got[who] = [first, mod.plan(batch, args.budget), *evens]
            same = ""
            if who != "now":
                row["same"] = all(_same(a, b) for a, b in zip(got["now"], got[who]))
                same = "yes" if row["same"] else "NO"
            rows.append(row)
            print(f"{name:28s} {batch.num_tokens:7d} {who:>7s} {first.num_parts:5d} "
                  f"{row['plan_s']:8.4f} {row['plan_recompute_s']:10.4f} "
                  f"{row['even_1.5x_s']:11.4f} {row['even_3x_s']:9.4f}  {same}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
