"""Issue 66's table: a real tree trained whole and in parts at several budgets, one process
(benchmarks/README.md and BENCHMARKS.md say what each row records)."""

from __future__ import annotations

import argparse
import math
import time
import types

import torch

import treefx
from benchmarks import common
from benchmarks.common import SHAPE_8B, TINY
from benchmarks.real_trees import load_tasks, packed_step, packing_batches, timed
from treefx.run.parts import memory as mem

CONFIGS = ("whole", "half", "quarter", "memory")


def _part_captures(tm) -> int:
    """The captures of ``tm``'s part graphs so far (layout, graph with gradients, no-grad)."""
    from treefx.run.parts import runners

    return sum(r.num_compilations for r in runners(tm))


def _first(fn, model, cuda: bool) -> tuple[float, int]:
    """Seconds and Dynamo graphs of one call of ``fn`` from no gradients."""
    model.zero_grad(set_to_none=True)
    common.sync(cuda)
    g0, t0 = common.unique_graphs(), time.perf_counter()
    fn()
    common.sync(cuda)
    return time.perf_counter() - t0, common.unique_graphs() - g0


def _where(frames) -> str:
    """An allocation's place: its innermost treefx frame (or innermost), and innermost function."""
    names = [(f.get("filename", ""), f.get("line", 0), f.get("name", "")) for f in frames]
    own = next((n for n in names if "/treefx/" in n[0]), names[0] if names else ("?", 0, "?"))
    place = f"{own[0].rsplit('/', 2)[-1]}:{own[1]} {own[2]}"
    return place if not names or names[0] == own else f"{place} <- {names[0][2]}"


def peak_breakdown(fn, top: int = 14) -> dict:
    """What is allocated at the peak of ``fn()`` beyond what was allocated before it, by
    place (:func:`_where`), from the CUDA caching allocator's history of the call."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python",
                                             clear_history=True)
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    live, total, best, at_best = {}, 0, 0, {}
    for e in (snap.get("device_traces") or [[]])[0]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames") or []))
            total += e["size"]
        elif e["action"] == "free_completed":
            size = live.pop(e["addr"], (e["size"], None))[0]
            total -= size
        if total > best:
            best, at_best = total, dict(live)
    by: dict[str, int] = {}
    for size, place in at_best.values():
        by[place] = by.get(place, 0) + size
    rows = sorted(by.items(), key=lambda kv: -kv[1])[:top]
    return {"before_gib": base / 2**30, "peak_over_before_gib": best / 2**30,
            "at_peak_gib": {k: round(v / 2**30, 3) for k, v in rows}}


def _plan_row(batch, max_tokens: int, memory: mem.MemoryModel, beyond: str) -> dict:
    plan = treefx.parts.plan(batch, max_tokens, beyond=beyond)
    return {"max_tokens": max_tokens, "parts": plan.num_parts,
            "part_tokens": [int(n) for n in plan.part_tokens()]
            if hasattr(plan, "part_tokens") else None,
            "held_tokens": plan.peak_held_tokens(), "context_tokens": plan.peak_context_tokens(),
            "recompute_tokens": plan.recompute_tokens, "host_tokens": plan.host_tokens,
            "estimate_gib": memory.plan_peak(plan) / 2**30}


def run_task(tree, tm, model, args, cuda: bool, dev: str) -> dict:
    batch = treefx.pack(tree, reduction="mean")
    n = batch.num_tokens
    row = {"task": tree.metadata.get("task"), "calls": tree.num_sequences,
           "unique_tokens": n, "sequence_tokens": tree.num_baseline_tokens,
           "token_bound": tree.num_baseline_tokens / n, "budgets": {}}
    whole_batch = batch.to(dev)

    def whole():
        loss = treefx.tree_loss(tm(whole_batch), whole_batch)
        loss.backward()
        return loss.detach()

    rows = [(c, b) for c in args.configs for b in (args.beyond if c != "whole" else [None])]
    for config, beyond in rows:
        name = config if beyond in (None, args.beyond[0]) else f"{config}-{beyond}"
        model.zero_grad(set_to_none=True)
        memory = mem.for_model(model)  # as treefx.backward makes it: before the step
        if config == "whole":
            step, rec = whole, {"estimate_gib": memory.peak(n, 0) / 2**30}
        else:
            if config == "memory":
                whole_peak = row["budgets"].get("whole", {}).get("peak_gib")
                fixed = memory.fixed / 2**30
                budget = args.max_memory or (
                    f"{fixed + args.memory_fraction * (whole_peak - fixed):.3f}GiB"
                    if whole_peak else None)
                if budget is None:
                    continue
                try:
                    tokens = mem.plan_tokens(memory, budget, batch, beyond=beyond)
                except ValueError as e:  # not one token fits: recorded, not run
                    row["budgets"][name] = {"max_memory": budget, "error": str(e)}
                    print(f"  {name:>7}: {e}", flush=True)
                    continue
                rec = {"max_memory": budget, **_plan_row(batch, tokens, memory, beyond)}
                kwargs = {"max_memory": budget, "beyond": beyond}
            else:
                tokens = math.ceil(n / (2 if config == "half" else 4))
                rec = _plan_row(batch, tokens, memory, beyond)
                kwargs = {"max_tokens": tokens, "beyond": beyond}

            def step(kwargs=kwargs):
                return treefx.backward(tm, batch, **kwargs)
        try:
            c0 = _part_captures(tm)
            rec["first_s"], rec["graphs"] = _first(step, model, cuda)
            rec["part_captures"] = _part_captures(tm) - c0
            rec.update(timed(step, model, cuda, warmup=0, reps=args.reps))
            if cuda and name in args.breakdown:
                model.zero_grad(set_to_none=True)
                try:
                    rec["breakdown"] = peak_breakdown(step)
                except Exception as e:  # a tool's failure: recorded, the table goes on
                    rec["breakdown"] = {"error": repr(e)[:300], "at_peak_gib": {}}
                print(f"  {name:>7} at its peak: " + "; ".join(
                    f"{k} {v:.2f}" for k, v in rec["breakdown"]["at_peak_gib"].items()),
                    flush=True)
        except torch.OutOfMemoryError as e:
            rec["oom"] = str(e).splitlines()[0]
        row["budgets"][name] = rec
        print(f"  {name:>7}: {_line(rec)}", flush=True)
        common.free_memory(model, cuda)
    if args.packing:
        micro = [b.to(dev) for b in packing_batches(tree, args.packing_budget)]
        biggest = max(micro, key=lambda b: b.num_tokens)
        row["packing"] = timed(lambda: packed_step(tm, micro, dev), model, cuda, warmup=0,
                               reps=1, pre_warm=lambda: packed_step(tm, [biggest], dev))
        row["packing"]["micro_batches"] = len(micro)
        print(f"  packing: {row['packing']['step_ms'] / 1e3:.2f} s, "
              f"{len(micro)} micro-batches", flush=True)
    whole = row["budgets"].get("whole", {})
    for rec in row["budgets"].values():
        if "step_ms" not in rec:
            continue
        if whole.get("step_ms"):
            rec["x_whole"] = rec["step_ms"] / whole["step_ms"]
        if whole.get("peak_gib") and rec.get("peak_gib"):
            rec["peak_x_whole"] = rec["peak_gib"] / whole["peak_gib"]
        if "packing" in row:
            rec["share_of_bound"] = row["packing"]["step_ms"] / rec["step_ms"] / row["token_bound"]
    return row


def _line(rec: dict) -> str:
    if "oom" in rec:
        return f"OOM ({rec['oom'][:80]})"
    peak = "-" if rec.get("peak_gib") is None else f"{rec['peak_gib']:.1f} GiB"
    plan = "" if "parts" not in rec else \
        f", {rec['parts']} parts of <= {rec['max_tokens']} (est. {rec['estimate_gib']:.1f} GiB)"
    return (f"step {rec['step_ms'] / 1e3:.2f} s, peak {peak}, first {rec['first_s']:.1f} s "
            f"({rec['graphs']} graphs, {rec.get('part_captures', 0)} part captures){plan}")


def reestimate(path: str, tasks) -> list[dict]:
    """Each parts row of the result at ``path``: its plan again (the budget it ran), today's
    estimate against the peak it measured (the estimate then plus what today's model adds to
    the plan's peak; the fixed bytes are the run's, which the result does not keep alone)."""
    import dataclasses
    import json

    with open(path) as f:
        res = json.load(f)
    a = res["args"]
    cfg = dict(SHAPE_8B, num_hidden_layers=a["layers"])
    new = mem.from_config(cfg, dtype="bfloat16", checkpointing=a["checkpointing"])
    old = dataclasses.replace(new, per_part=0)  # the model the runs of 2026-12-05 had
    rows = []
    for row, (_, tree) in zip(res["tasks"], tasks):
        batch = treefx.pack([tree])
        for name, r in row["budgets"].items():
            if "max_tokens" not in r or not r.get("peak_gib"):
                continue
            plan = treefx.parts.plan(batch, r["max_tokens"])
            est = r["estimate_gib"] + (new.plan_peak(plan) - old.plan_peak(plan)) / 2 ** 30
            rows.append({"task": row["task"], "row": name, "parts": plan.num_parts,
                         "parts_then": r["parts"], "peak_gib": r["peak_gib"],
                         "estimate_then_gib": r["estimate_gib"], "estimate_gib": est,
                         "held_parts": max(p for _, p in plan.held_on_device())})
            print(f"{row['task']}: {name}: {plan.num_parts} parts ({r['parts']} then), at most "
                  f"{rows[-1]['held_parts']} held; peak {r['peak_gib']:.1f} GiB, estimated "
                  f"{r['estimate_gib']:.1f} then ({r['estimate_gib'] / r['peak_gib']:.2f}), "
                  f"{est:.1f} now ({est / r['peak_gib']:.2f})", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=None, help="JSON Lines of trees (treefx.write_jsonl)")
    p.add_argument("--tasks", type=int, default=None, help="the first N trees (default all)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, in order: {', '.join(CONFIGS)}")
    p.add_argument("--memory-fraction", type=float, default=0.75,
                   help="the memory row's budget: the weights and gradients plus this share "
                        "of the rest of the whole step's peak")
    p.add_argument("--max-memory", default=None, help="the memory row's budget, e.g. 30GiB")
    p.add_argument("--beyond", default="recompute",
                   help="treefx.backward's beyond= for the parts' rows, comma-separated: "
                        "recompute, host, device (rows after the first are named "
                        "'<budget>-<beyond>')")
    p.add_argument("--breakdown", default="",
                   help="rows (e.g. whole,half) whose step is run once more with the CUDA "
                        "allocator's history on: what is allocated at the peak, by place")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--packing", action="store_true")
    p.add_argument("--packing-budget", type=int, default=65536)
    p.add_argument("--reestimate", default=None, metavar="RESULT.json",
                   help="no step run: a recorded result's rows estimated again (CPU)")
    common.add_run_args(p, "CPU, a tiny float32 model, the eager backend, a synthetic comb")
    args = p.parse_args(argv)
    args.configs = [c for c in args.configs.split(",") if c]
    if set(args.configs) - set(CONFIGS):
        p.error(f"--configs: {', '.join(CONFIGS)}")
    args.beyond = [b for b in args.beyond.split(",") if b]
    args.breakdown = [b for b in args.breakdown.split(",") if b]
    if not args.beyond or set(args.beyond) - {"recompute", "host", "device"}:
        p.error("--beyond: recompute, host, device")
    cuda = common.use_cuda(args.dry_run)
    dev = "cuda" if cuda else "cpu"
    shape, dtype = (dict(SHAPE_8B), torch.bfloat16) if cuda else (dict(TINY), torch.float32)
    select = types.SimpleNamespace(trees=args.trees, tasks=args.tasks, sample=None, seed=0,
                                   slice=None, dry_run=args.dry_run)
    if args.dry_run and args.tasks is None:
        select.tasks = 1
    tasks, prov = load_tasks(select, SHAPE_8B["vocab_size"] if args.trees else
                             shape["vocab_size"])
    if args.reestimate:
        rows = reestimate(args.reestimate, tasks)
        common.save_json({"meta": common.run_meta(False), "args": vars(args), "rows": rows},
                         args.out)
        return rows
    if args.trees and not cuda:
        shape["vocab_size"] = SHAPE_8B["vocab_size"]
    common.bump_dynamo_limits()
    model = common.hf_model("qwen3", dev=dev, dtype=dtype, on_device=cuda,
                            num_hidden_layers=args.layers, train=True,
                            checkpointing="nonreentrant" if args.checkpointing else None,
                            **shape)
    tm = treefx.compile(model, backend="inductor" if cuda else "eager", logits=False,
                        verify=False)
    res = {"meta": common.run_meta(cuda), "args": vars(args), "data": prov,
           "model": {"type": "qwen3", "layers": args.layers, "dtype": str(dtype),
                     "checkpointing": args.checkpointing, **shape}, "tasks": []}
    for _, tree in tasks:
        print(f"{tree.metadata.get('task', 'tree')}: {tree.num_sequences} calls, "
              f"{tree.num_tokens:,} tokens ({tree.num_baseline_tokens:,} in the calls)",
              flush=True)
        res["tasks"].append(run_task(tree, tm, model, args, cuda, dev))
        common.save_json(res, common.resolve_out(args, "parts_budget", cuda))
    return res


if __name__ == "__main__":
    main()
