"""Real agent trees task by task: ``treefx.backward`` against per-call sequence packing (FFD
micro-batches, document mask, gradients accumulated) on Qwen3-8B-shaped layers, the same model
and data in one run (issue 34; BENCHMARKS.md, "Real agent trajectories"; benchmarks/README.md
for the options)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import time

import torch

import treefx
from benchmarks import common
from benchmarks.common import SHAPE_8B, TINY

# ----------------------------------------------------------------------------- data


def comb_tree(seed: int, vocab: int, calls: int, scale: float) -> treefx.Tree:
    """A synthetic agent task shaped like a think-mode agent's: one rollout of ``calls`` model
    calls without forks, each call's reasoning dropped from the later calls' context, so the
    trunk (prompt, answers, tool outputs) grows call by call and each call's completion
    (reasoning and answer) is a leaf off it; each call's loss mask covers its completion."""
    tree = treefx.synth.agent_tree(seed, vocab_size=vocab, rollouts=1, turns=(calls, calls),
                                   branch_prob=0.0, think_mode=True, mask_outputs=True,
                                   **common.scaled_lengths(scale))
    return tree.with_metadata(task=f"synthetic-comb-{seed}")


def _file_lines(path: str) -> list[int]:
    """Byte offsets of the non-empty lines of a JSON Lines file."""
    offsets, pos = [], 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                offsets.append(pos)
            pos += len(line)
    return offsets


def _top_id(tree: treefx.Tree) -> int:
    return max(int(s.max()) for s in tree.segments if len(s))


def synthetic_combs(n: int, vocab: int, seed: int, dry_run: bool):
    """``n`` synthetic tasks (:func:`comb_tree`, a random number of calls each), provenance."""
    calls, scale = ((4, 6), 0.08) if dry_run else ((20, 40), 3.0)
    rng = random.Random(seed)
    trees = [comb_tree(seed * 1000 + i, vocab, rng.randint(*calls), scale) for i in range(n)]
    return trees, {"source": "synthetic combs (treefx.synth.agent_tree, think mode, one "
                             "rollout, no forks, completions masked)",
                   "calls": list(calls), "length_scale": scale, "seed": seed}


def file_provenance(path: str) -> dict:
    with open(path, "rb") as f:  # (hashlib.file_digest is Python 3.11; treefx takes 3.10)
        sha = hashlib.sha256(f.read()).hexdigest()
    return {"source": os.path.abspath(path), "bytes": os.path.getsize(path), "sha256": sha}


def load_tasks(args, vocab: int) -> tuple[list[tuple[int, treefx.Tree]], dict]:
    """The selected trees (only their lines parsed) with their 0-based line index, provenance."""
    if not args.trees:
        n = args.tasks if args.tasks is not None else (args.sample or 3)
        trees, prov = synthetic_combs(n, vocab, args.seed, args.dry_run)
        cut = _slice(args.slice)
        return list(enumerate(trees))[cut], dict(prov, selected=list(range(n)),
                                                 positions=list(range(n)[cut]))
    offsets = _file_lines(args.trees)
    total = len(offsets)
    if args.sample is not None:
        chosen = sorted(random.Random(args.seed).sample(range(total), min(args.sample, total)))
    else:
        chosen = list(range(total if args.tasks is None else min(total, args.tasks)))
    positions = list(range(len(chosen)))[_slice(args.slice)]
    out = []
    with open(args.trees, "rb") as f:
        for i in (chosen[j] for j in positions):
            f.seek(offsets[i])
            line = f.readline()
            try:
                tree = treefx.Tree.from_dict(json.loads(line))
            except (ValueError, TypeError) as e:
                raise type(e)(f"{args.trees}, tree {i} (counting from 0): {e}") from e
            top = _top_id(tree)
            if top >= vocab:
                raise ValueError(
                    f"{args.trees}, tree {i} ({tree.metadata.get('task', 'no task name')}): "
                    f"token id {top} is not below the model's vocabulary of {vocab:,} "
                    "(Qwen3's): were these trees tokenized for another model?")
            out.append((i, tree))
    prov = dict(file_provenance(args.trees), trees_in_file=total, selected=chosen,
                positions=positions)
    return out, prov


def _slice(text: str | None) -> slice:
    """``--slice A:B`` (either end may be left out) as a slice of the selected tasks."""
    if not text:
        return slice(None)
    a, sep, b = text.partition(":")
    if not sep:
        raise ValueError(f"--slice takes A:B (e.g. 0:17), got {text!r}")
    return slice(int(a) if a else None, int(b) if b else None)


def ffd(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` in bins of at most ``capacity`` (each
    length at most ``capacity``), the longest first, each into the first bin with room."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for b, r in enumerate(room):
            if n <= r:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def call_chains(trees: treefx.Tree | list[treefx.Tree]) -> list[treefx.Tree]:
    """Every call of ``trees`` as its own one-sequence tree, its weight and loss mask kept."""
    trees = [trees] if isinstance(trees, treefx.Tree) else list(trees)
    return [treefx.Tree.from_sequences([t.sequence(i)], weights=[float(t.weights[i])],
                                       loss_masks=[t.loss_mask(i)])
            for t in trees for i in range(t.num_sequences)]


def packing_batches(trees: treefx.Tree | list[treefx.Tree], budget: int, *,
                    num_sequences: int | None = None,
                    loss_scale: float = 1.0) -> list[treefx.TreeBatch]:
    """:func:`call_chains` packed first-fit-decreasing into micro-batches of at most
    ``max(budget, longest call)`` tokens, each with ``num_sequences`` (default the calls': the
    losses add up to their mean) and ``loss_scale`` (as ``treefx.distributed.pack`` sets them)."""
    chains = call_chains(trees)
    lengths = [c.num_tokens for c in chains]
    cap = max(budget, max(lengths))
    if num_sequences is None:
        num_sequences = len(chains)
    return [treefx.pack([chains[i] for i in b], reduction="mean", num_sequences=num_sequences,
                        loss_scale=loss_scale)
            for b in ffd(lengths, cap)]


def packed_step(tm, batches, dev) -> torch.Tensor:
    """Forward and backward of each micro-batch (gradients accumulated): the float64 sum."""
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for b in batches:
        loss = treefx.tree_loss(tm(b), b)
        loss.backward()
        total += loss.detach().to(total.dtype)
    return total


# ----------------------------------------------------------------------------- timing


def timed(fn, model, cuda: bool, warmup: int, reps: int, pre_warm=None) -> dict:
    """``warmup`` steps (and ``pre_warm`` once), then ``reps`` timed steps, each from no
    gradients; a step during which Dynamo compiled a graph is run again (at most ``reps``
    more). The model's ``.grad`` holds the last step's gradients after."""
    if pre_warm is not None:
        model.zero_grad(set_to_none=True)
        pre_warm()
    for _ in range(warmup):
        model.zero_grad(set_to_none=True)
        fn()
    model.zero_grad(set_to_none=True)
    common.sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, recompiled, loss = [], 0, None
    for _ in range(2 * reps):
        model.zero_grad(set_to_none=True)
        common.sync(cuda)
        g0 = common.unique_graphs()
        t0 = time.perf_counter()
        loss = fn()
        common.sync(cuda)
        dt = time.perf_counter() - t0
        new = common.unique_graphs() - g0
        if new:
            recompiled += new
            continue
        times.append(dt)
        if len(times) == reps:
            break
    if not times:  # every step compiled something: keep the last one, flagged
        times.append(dt)
    return {"step_ms": statistics.median(times) * 1e3, "times_ms": [t * 1e3 for t in times],
            "recompiled_in_timing": recompiled, "loss": float(loss),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


# ----------------------------------------------------------------------------- one task


def run_task(index: int, tree: treefx.Tree, tm, model, args, cuda: bool, dev: str) -> dict:
    """One task: each method timed (``timed``)."""
    lengths = tree.sequence_lengths
    row = {"index": index, "task": tree.metadata.get("task"), "calls": tree.num_sequences,
           "unique_tokens": tree.num_tokens, "sequence_tokens": tree.num_baseline_tokens,
           "longest_call": int(lengths.max()), "bound": tree.bound,
           "trained_tokens": int(sum(int(tree.loss_mask(i)[1:].sum())
                                     for i in range(tree.num_sequences)))}
    budget = args.budget
    t0 = time.perf_counter()
    batch = treefx.pack(tree, reduction="mean")
    pack_tree_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    micro = packing_batches(tree, budget)
    pack_seq_ms = (time.perf_counter() - t0) * 1e3
    plan = treefx.parts.plan(batch, budget)
    methods = {}

    def tree_step():
        return treefx.backward(tm, batch, max_tokens=budget)

    for name in args.methods:
        oom = None
        try:
            if name == "treefx":
                st = timed(tree_step, model, cuda, args.warmup, args.reps)
                st.update(parts=plan.num_parts, peak_held_tokens=plan.peak_held_tokens(),
                          tokens=tree.num_tokens, host_pack_ms=pack_tree_ms)
            else:
                dev_batches = [b.to(dev) for b in micro]
                largest = max(dev_batches, key=lambda b: b.num_tokens)
                st = timed(lambda: packed_step(tm, dev_batches, dev), model, cuda, 0, 1,
                           pre_warm=lambda: packed_step(tm, [largest], dev))
                st.update(micro_batches=len(micro), capacity=max(budget, row["longest_call"]),
                          micro_batch_tokens=[b.num_tokens for b in micro],
                          tokens=tree.num_baseline_tokens, host_pack_ms=pack_seq_ms)
            st["tokens_per_s"] = st["tokens"] / (st["step_ms"] / 1e3)
            st["sequence_tokens_per_s"] = tree.num_baseline_tokens / (st["step_ms"] / 1e3)
            st["status"] = "ok"
            methods[name] = st
        except Exception as e:  # noqa: BLE001  (out of memory, however wrapped; else raised)
            if not common.is_oom(e):
                raise
            oom = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        if oom is not None:  # outside the handler: its traceback no longer holds the tensors
            if name == "packing":
                dev_batches = largest = None
            methods[name] = {"status": "oom", "error": oom}
        common.free_memory(model, cuda)
    row["methods"] = methods
    ok = {k for k, v in methods.items() if v.get("status") == "ok"}
    row["status"] = "ok" if ok == set(args.methods) else \
        "oom: " + ",".join(k for k in args.methods if k not in ok)
    if {"treefx", "packing"} <= ok:
        t, p = methods["treefx"], methods["packing"]
        row["speedup"] = p["step_ms"] / t["step_ms"]
        row["share_of_bound"] = row["speedup"] / row["bound"]
        row["loss_rel_diff"] = abs(t["loss"] - p["loss"]) / max(abs(p["loss"]), 1e-30)
        row["loss_agree"] = row["loss_rel_diff"] <= args.loss_tol
    return row


def summary(rows: list[dict]) -> dict:
    both = [r for r in rows if "speedup" in r]
    out = {"tasks": len(rows), "both_measured": len(both),
           "oom": [r["index"] for r in rows if str(r.get("status", "")).startswith("oom")]}
    if not both:
        return out
    share = [r["share_of_bound"] for r in both]
    speed = [r["speedup"] for r in both]
    worst = min(both, key=lambda r: r["share_of_bound"])
    slowest = min(both, key=lambda r: r["speedup"])
    seq = sum(r["sequence_tokens"] for r in both)
    t_tree = sum(r["methods"]["treefx"]["step_ms"] for r in both) / 1e3
    t_pack = sum(r["methods"]["packing"]["step_ms"] for r in both) / 1e3
    out.update(
        median_share_of_bound=statistics.median(share),
        worst_share_of_bound=worst["share_of_bound"], worst_share_task=worst["index"],
        median_speedup=statistics.median(speed), lowest_speedup=slowest["speedup"],
        lowest_speedup_task=slowest["index"],
        median_bound=statistics.median(r["bound"] for r in both),
        slower_than_packing=[r["index"] for r in both if r["speedup"] < 1.0],
        any_slower_than_packing=any(s < 1.0 for s in speed),
        losses_agree=all(r["loss_agree"] for r in both),
        max_loss_rel_diff=max(r["loss_rel_diff"] for r in both),
        # all tasks one after the other: sequence tokens (as trainers count them) per second
        overall_sequence_tokens_per_s={"treefx": seq / t_tree, "packing": seq / t_pack},
        overall_speedup=t_pack / t_tree)
    return out


# ----------------------------------------------------------------------------- main


def main(argv=None):
    start = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=None,
                   help="JSON Lines of trees (treefx.write_jsonl); default synthetic combs")
    p.add_argument("--tasks", type=int, default=None,
                   help="the first N trees (default all; synthetic: 3)")
    p.add_argument("--sample", type=int, default=None,
                   help="N trees drawn at random (--seed) from the file, in file order")
    p.add_argument("--slice", default=None,
                   help="A:B: run only the selected tasks A..B-1 (one shard of a longer "
                        "selection)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=None,
                   help="tokens per part / micro-batch (default 16384; dry run 96)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--methods", default="treefx,packing")
    p.add_argument("--warmup", type=int, default=1, help="treefx's full warm-up steps per task")
    p.add_argument("--reps", type=int, default=3, help="treefx's timed steps per task")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: stop before a task that would not finish by then")
    common.add_run_args(p, "CPU, a tiny float32 model, the eager backend, small synthetic "
                           "combs unless --trees")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    args.methods = [m for m in args.methods.split(",") if m]
    bad = set(args.methods) - {"treefx", "packing"}
    if bad or not args.methods:
        p.error(f"--methods: treefx and/or packing, got {sorted(bad) or 'none'}")
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    backend = "inductor" if cuda else "eager"
    if args.budget is None:
        args.budget = 16384 if cuda else 96
    args.loss_tol = 1e-2 if cuda else 1e-5
    common.bump_dynamo_limits()
    shape, dtype = (dict(SHAPE_8B), torch.bfloat16) if cuda else (dict(TINY), torch.float32)
    out = common.resolve_out(args, "real_trees", cuda)
    tasks, prov = load_tasks(args, SHAPE_8B["vocab_size"] if args.trees else
                             shape["vocab_size"])
    top = max((_top_id(t) for _, t in tasks), default=0)
    if not cuda and args.trees and top >= shape["vocab_size"]:
        shape["vocab_size"] = SHAPE_8B["vocab_size"]  # real ids: the real vocabulary
    res = {"meta": common.run_meta(cuda), "args": vars(args), "data": prov,
           "model": {"type": "qwen3", "layers": args.layers, "dtype": str(dtype),
                     "backend": backend, **shape},
           "tasks": [], "summary": {}}
    print(f"{len(tasks)} tasks from {prov['source']}; budget {args.budget}, "
          f"{args.layers} layers, {dtype}, {backend}", flush=True)
    model = common.hf_model("qwen3", dev=dev, dtype=dtype, on_device=cuda,
                            num_hidden_layers=args.layers, **shape)
    tm = treefx.compile(model, backend=backend, logits=False, verify=False)
    res["setup_s"] = time.perf_counter() - start
    ran = []  # (wall seconds, sequence tokens) of the tasks run
    for k, (index, tree) in enumerate(tasks):
        elapsed = time.perf_counter() - start
        if args.time_limit is not None and ran:
            # the first task pays the compiles: estimate from the later ones when there are
            later = ran[1:] or ran
            rate = sum(w for w, _ in later) / max(sum(n for _, n in later), 1)
            if elapsed + rate * tree.num_baseline_tokens > args.time_limit:
                res["stopped"] = {"reason": "time limit", "elapsed_s": elapsed,
                                  "tasks_not_run": [i for i, _ in tasks[k:]],
                                  "resume": f"--slice {prov['positions'][k]}:"
                                            f"{prov['positions'][-1] + 1}"}
                print(f"time limit: stopping before task {index} ({len(tasks) - k} not run; "
                      f"the same command with {res['stopped']['resume']} runs them)",
                      flush=True)
                break
        t0 = time.perf_counter()
        row = run_task(index, tree, tm, model, args, cuda, dev)
        row["wall_s"] = time.perf_counter() - t0
        ran.append((row["wall_s"], row["sequence_tokens"]))
        res["tasks"].append(row)
        res["summary"] = summary(res["tasks"])
        res["elapsed_s"] = time.perf_counter() - start
        common.save_json(res, out)
        print(_line(row), flush=True)
    print("summary: " + ", ".join(f"{k} {v}" for k, v in res["summary"].items()), flush=True)
    common.save_json(res, out)
    print(f"saved {out}", flush=True)
    return res


def _line(r: dict) -> str:
    """One task's progress line: each method's step, and the speed-up against packing."""
    head = f"task {r['index']} {r.get('task') or ''}: {r['calls']} calls, bound {r['bound']:.2f}x"
    steps = ", ".join(f"{k} {v['step_ms']:.1f} ms" if v["status"] == "ok" else f"{k} OOM"
                      for k, v in r["methods"].items())
    keys = ("speedup", "share_of_bound", "loss_rel_diff")
    return f"{head}; {steps}; " + ", ".join(f"{k} {r[k]}" for k in keys if k in r)



if __name__ == "__main__":
    main()
