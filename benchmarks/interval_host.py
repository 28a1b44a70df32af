"""The host's time per call of the interval-mask op (:mod:`treefx.ops.attention.intervals`)
against the GPU's, at one layer of the e2e benchmark's shape.

    python -m benchmarks.interval_host            # GPU with the cuDNN frontend installed

A compiled training step launches its kernels ahead of the GPU; a call whose Python takes
longer than the GPU work queued before it leaves the GPU idle (the e2e profile's host gaps
name ``treefx::interval_attention``). Per call, over ``--reps`` calls after a warm-up, on the
e2e tree (POR 0.75, 32 query heads, 8 KV heads, head_dim 128, bf16):

- ``host_ms``: the call's own wall time, nothing synchronized (what the host spends);
- ``gpu_ms``: the calls' CUDA-event time with the host kept ahead (one sync at the end);
- the frontend's share: the same for the frontend's function called directly with the plan
  already built, and for the plan lookup alone (:func:`treefx.ops.attention.intervals._plan`);
- ``plan_build``: the plan of a row not seen before (every step's first call: a new tree), as
  the step meets it (the row moved by :meth:`treefx.TreeBatch.to`, its host copy kept), wall
  time from an idle GPU to the plan ready (the frontend's builder reads sizes back, so the
  host waits for the GPU within it).

Forward (``interval_attention``) and backward (``interval_attention_backward``) apart.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

import treefx
from benchmarks import common


def _host_and_gpu(fn, reps: int) -> dict:
    fn()
    torch.cuda.synchronize()
    host = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # keep the GPU busy first so that the host never waits on it while timing itself
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(20):
        big @ big
    start.record()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    end.record()
    torch.cuda.synchronize()
    total = start.elapsed_time(end)
    # the GPU's time alone: the same calls back to back after a sync
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    host.sort()
    return {"host_ms_median": host[len(host) // 2], "host_ms_min": host[0],
            "gpu_ms": start.elapsed_time(end) / reps, "queued_total_ms": total}


def _serial(fn, reps: int) -> dict:
    """Wall time per call from an idle GPU to the call's work done (synchronized around it)."""
    fn(0)
    walls = []
    for i in range(1, reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    walls.sort()
    return {"wall_ms_median": walls[len(walls) // 2], "wall_ms_min": walls[0]}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.interval_host",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from treefx.ops.attention import intervals

    if not (torch.cuda.is_available() and intervals.available(torch.device("cuda"))):
        raise SystemExit("needs a GPU and the cuDNN frontend (treefx's cudnn extra)")
    hq, hk, d, dtype = common.attention_heads(True)
    tree = common.make_tree(0.75, 1.0, 1000, seed=0)
    batch = treefx.pack(tree, reduction="mean")
    parent = batch.parent_token.cuda()
    n = parent.shape[0]
    torch.manual_seed(0)
    q = torch.randn(1, n, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(1, n, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(1, n, hk, d, device="cuda", dtype=dtype)
    g = torch.randn(1, n, hq, d, device="cuda", dtype=dtype)
    scale = 1 / math.sqrt(d)
    fwd = torch.ops.treefx.interval_attention
    bwd = torch.ops.treefx.interval_attention_backward
    out, lse = fwd(q, k, v, parent, scale)
    _, attend, attend_bwd = intervals._frontend()
    plan = intervals._plan(parent, q, k, v)
    rows = {
        "op_forward": _host_and_gpu(lambda: fwd(q, k, v, parent, scale), args.reps),
        "op_backward": _host_and_gpu(lambda: bwd(g, q, k, v, out, lse, parent, scale),
                                     args.reps),
        "frontend_forward": _host_and_gpu(
            lambda: attend(q, k, v, mask_plan=plan, softmax_scale=scale, return_lse=True),
            args.reps),
        "frontend_backward": _host_and_gpu(
            lambda: attend_bwd(q, k, v, out, g, lse, mask_plan=plan, softmax_scale=scale),
            args.reps),
        "plan_lookup": _host_and_gpu(lambda: intervals._plan(parent, q, k, v), args.reps),
    }
    rows_ = [treefx.pack(tree, reduction="mean").to("cuda").parent_token
             for _ in range(args.reps + 1)]  # each a row of its own, as a step's new batch
    rows["plan_build"] = _serial(lambda i: intervals._plan(rows_[i], q, k, v), args.reps)
    res = {"meta": common.run_meta(True), "tokens": n, "heads": [hq, hk, d], "rows": rows}
    for name, r in rows.items():
        if "wall_ms_median" in r:
            print(f"{name:18s} wall {r['wall_ms_median']:7.3f} ms (min {r['wall_ms_min']:.3f})",
                  flush=True)
            continue
        print(f"{name:18s} host {r['host_ms_median']:7.3f} ms (min {r['host_ms_min']:.3f})"
              f"   gpu {r['gpu_ms']:7.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
